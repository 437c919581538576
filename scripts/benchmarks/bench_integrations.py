#!/usr/bin/env python
"""Integration figures (issue 23): HF `datasets.Dataset` map-style loading (fetched through its
`__getitems__`), a custom collate with num_workers=0 (handed out as is), and what copying small
leaves (labels) out of their slot costs.

    python scripts/benchmarks/bench_integrations.py [--rounds 7] [--cases hf-torch,hf-numpy,collate0,small]

Each round times one epoch of every loader of a case in this process, the order alternating
between rounds (after one warm-up epoch each; workers are persistent); the figure is the
median over rounds of DataLoader's epoch time over PooledLoader's (above 1.0: PooledLoader is
faster), with the spread of the per-round ratios: wall time, and with 0 workers also the
process's CPU time, which other jobs on a shared machine disturb far less.
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pooled_loader import PooledLoader

ROWS, FEATURES, BATCH = 16384, 256, 64


def hf_table(fmt: str):
    import datasets
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({
        "x": rng.standard_normal((ROWS, FEATURES), dtype=np.float32),
        "label": np.arange(ROWS) % 10}).with_format(fmt)


class Samples(Dataset):
    def __init__(self, n: int = ROWS):
        self.data = np.random.default_rng(0).standard_normal((n, FEATURES), dtype=np.float32)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"x": self.data[i], "label": i % 10}


def stack_collate(samples):
    return {"x": torch.from_numpy(np.stack([s["x"] for s in samples])),
            "label": torch.tensor([s["label"] for s in samples])}


class Images(Dataset):
    """Zero-copy-friendly samples: a 3x64x64 uint8 image and a label."""

    def __len__(self):
        return 8192

    def __getitem__(self, i):
        return np.full((3, 64, 64), i % 251, np.uint8), i


def epoch(loader) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one epoch."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in loader:
        pass
    return time.perf_counter() - start, time.process_time() - cpu


def small_leaves(copied: bool):
    loader = PooledLoader(Images(), batch_size=BATCH)

    def run() -> float:
        it = iter(loader)
        it._small_copied = copied
        start, cpu = time.perf_counter(), time.process_time()
        for _ in it:
            pass
        return time.perf_counter() - start, time.process_time() - cpu
    return run


def cases(name: str, workers: int) -> dict:
    kw = dict(batch_size=BATCH, shuffle=True, num_workers=workers,
              persistent_workers=workers > 0)
    if name.startswith("hf-"):
        table = hf_table(name[3:])
        return {"DataLoader": DataLoader(table, **kw), "PooledLoader": PooledLoader(table, **kw)}
    if name == "collate0":
        data = Samples()
        return {"DataLoader": DataLoader(data, collate_fn=stack_collate, **kw),
                "PooledLoader": PooledLoader(data, collate_fn=stack_collate, **kw)}
    if name == "small":  # reference: no copy; "PooledLoader": labels copied out (the default)
        return {"DataLoader": small_leaves(False), "PooledLoader": small_leaves(True)}
    raise SystemExit(f"unknown case {name}")


def measure(name: str, workers: int, rounds: int) -> None:
    loaders = cases(name, workers)
    runs = {k: (v if callable(v) else (lambda v=v: epoch(v))) for k, v in loaders.items()}
    for run in runs.values():
        run()  # warm-up: workers start, the pool reaches its size
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            times[k].append(runs[k]())
    label = {"small": "labels not copied / copied"}.get(name, "DataLoader / PooledLoader")
    # wall time; with 0 workers also the main process's CPU time (less disturbed by other jobs)
    for what, col in (("wall", 0), ("cpu", 1)) if workers == 0 else (("wall", 0),):
        ratios = [a[col] / b[col] for a, b in zip(times["DataLoader"], times["PooledLoader"])]
        print(f"{name:9s} workers={workers} {what:4s} {label}: median "
              f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); "
              "epoch s: " + ", ".join(f"{k} {statistics.median(t[col] for t in v):.3f}"
                                      for k, v in times.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", default="hf-torch,hf-numpy,collate0,small")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in args.cases.split(","):
        for workers in ((0,) if name in ("collate0", "small") else (0, 2)):
            measure(name, workers, args.rounds)


if __name__ == "__main__":
    main()
