#!/usr/bin/env python
"""Ragged batches (issue 26): PooledLoader's collate helpers vs DataLoader with Python collates.

    python scripts/benchmarks/bench_ragged.py [--rounds 5] [--epochs 2] [--workers 2] [--docs 20000]
                                   [--only tokens|detection] [--json PATH]

(a) Tokens. A token file (``pooled_loader.tokens``, uint16) of `--docs` documents whose lengths
    are log-normal (median 400) clipped to 16..4096, batched by
    ``TokenBudgetBatchSampler(lengths, max_tokens=65536)`` (the same batches for every loader),
    handed out as int64 [batch, longest] ids + mask:
    - ours:     PooledLoader(TokenDataset, collate_fn=pad(dtype=torch.int64))
    - dl_pad:   DataLoader, items as int64 tensors, collate = pad_sequence + lengths + mask
    - dl_hf:    DataLoader, items as {"input_ids": list} (HF datasets' python lists), collate =
                DataCollatorWithPadding-style padding of the lists + torch.tensor (transformers'
                own collator is not installed here: it would pull another torch)
(b) Detection. Images of varying size (CHW uint8, sides 240-480) with 0-50 boxes and labels, each
    a fresh tensor per item (as a decoder gives), batch 16, handed out per sample:
    - ours: PooledLoader(collate_fn=as_list()) vs dl_zip: DataLoader(collate_fn=tuple(zip(*b)))

Every (round, loader) runs in a fresh process (the order alternates between rounds): one warm-up
epoch, then `--epochs` timed epochs with persistent workers; peak PSS of the process tree is
sampled every 0.1 s over the whole run, and its CPU seconds (user + system, main process and
workers) over the timed epochs: samples per CPU-second depends less on what else the machine
runs than samples/s. Prints a Markdown table and the medians of the per-round ratios ours / peer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts", "benchmarks")]

MAX_TOKENS = 65536
MIN_LEN, MAX_LEN = 16, 4096
DET_BATCH, DET_ITEMS = 16, 1200
CONFIGS = {"tokens": ["ours", "dl_pad", "dl_hf"], "detection": ["ours", "dl_zip"]}


def doc_lengths(n: int):
    import numpy as np
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(6.0, 1.0, n), MIN_LEN, MAX_LEN).astype(np.int64)


def make_tokens(path: str, n: int) -> None:
    import numpy as np
    from pooled_loader.tokens import write_tokens
    rng = np.random.default_rng(1)
    write_tokens(path, (rng.integers(1, 50000, int(k), dtype=np.uint16) for k in doc_lengths(n)),
                 dtype=np.uint16)


# -- the peers' datasets and collates (top level: picklable) ------------------------------------
class TensorItems:
    """Documents as int64 tensors (what a typical torch text dataset returns)."""

    def __init__(self, path):
        from pooled_loader.tokens import TokenDataset
        self.ds = TokenDataset(path)

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        import numpy as np
        import torch
        return torch.from_numpy(self.ds[i].astype(np.int64))


class ListItems(TensorItems):
    """Documents as {"input_ids": list of ints} (HF datasets without a torch format)."""

    def __getitem__(self, i):
        return {"input_ids": self.ds[i].tolist()}


def pad_collate(samples):
    import torch
    from torch.nn.utils.rnn import pad_sequence
    ids = pad_sequence(samples, batch_first=True)
    lengths = torch.tensor([len(s) for s in samples])
    return ids, lengths, torch.arange(ids.shape[1])[None, :] < lengths[:, None]


def hf_style_collate(features):
    """DataCollatorWithPadding's work for input_ids: pad the lists, then tensors."""
    import torch
    longest = max(len(f["input_ids"]) for f in features)
    ids = [f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]
    mask = [[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features]
    return {"input_ids": torch.tensor(ids, dtype=torch.int64),
            "attention_mask": torch.tensor(mask, dtype=torch.int64)}


class Detection:
    """(image CHW uint8, boxes [n, 4] float32, labels [n] int64), fresh tensors every item."""

    def __init__(self):
        import numpy as np
        import torch
        rng = np.random.default_rng(2)
        self.images = [torch.from_numpy(rng.integers(0, 256, (3, int(h), int(w)), np.uint8))
                       for h, w in rng.integers(240, 481, (32, 2))]
        self.counts = rng.integers(0, 51, DET_ITEMS)

    def __len__(self):
        return DET_ITEMS

    def __getitem__(self, i):
        import torch
        n = int(self.counts[i])
        gen = torch.Generator().manual_seed(i)
        return (self.images[i % len(self.images)].clone(), torch.rand(n, 4, generator=gen),
                torch.randint(0, 80, (n,), generator=gen))


def zip_collate(batch):
    return tuple(zip(*batch))


# -- one run (in its own process) ---------------------------------------------------------------
def build(task: str, config: str, path: str, workers: int):
    import torch
    from torch.utils.data import DataLoader
    from pooled_loader import PooledLoader
    from pooled_loader.collate import as_list, pad
    from pooled_loader.samplers import TokenBudgetBatchSampler
    from pooled_loader.tokens import TokenDataset
    common = dict(num_workers=workers, persistent_workers=workers > 0)
    if task == "detection":
        if config == "ours":
            return PooledLoader(Detection(), batch_size=DET_BATCH, collate_fn=as_list(), **common)
        return DataLoader(Detection(), batch_size=DET_BATCH, collate_fn=zip_collate, **common)
    ds = TokenDataset(path)
    sampler = TokenBudgetBatchSampler(ds.lengths(), MAX_TOKENS, seed=0)
    if config == "ours":
        return PooledLoader(ds, batch_sampler=sampler, collate_fn=pad(dtype=torch.int64),
                            **common)
    if config == "dl_pad":
        return DataLoader(TensorItems(path), batch_sampler=sampler, collate_fn=pad_collate,
                          **common)
    return DataLoader(ListItems(path), batch_sampler=sampler, collate_fn=hf_style_collate,
                      **common)


def run_one(task: str, config: str, path: str, workers: int, epochs: int) -> dict:
    from bench_memory import tree_pss_mb
    from bench_wds import cpu_seconds as tree_cpu_s  # main process + live workers
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_pss_mb(os.getpid()))
            stop.wait(0.1)
    threading.Thread(target=sample, daemon=True).start()
    loader = build(task, config, path, workers)
    samples_per_batch = []
    for _ in loader:  # warm-up epoch (workers start, the pool finds its sizes)
        pass
    start, cpu_start = time.perf_counter(), tree_cpu_s()
    for _ in range(epochs):
        for batch in loader:
            samples_per_batch.append(_samples(batch))
            del batch
    elapsed, cpu = time.perf_counter() - start, tree_cpu_s() - cpu_start
    stop.set()
    result = {"samples_per_s": sum(samples_per_batch) / elapsed, "seconds": elapsed,
              "samples_per_cpu_s": sum(samples_per_batch) / cpu, "peak_pss_mb": peak[0]}
    if task == "tokens":
        lengths = doc_lengths(len(loader.dataset))
        real = sum(int(lengths[b].sum()) for b in loader.batch_sampler)
        padded = sum(int(lengths[b].max()) * len(b) for b in loader.batch_sampler)
        result["tokens_per_s"] = real * epochs / elapsed
        result["padding"] = 1 - real / padded
    if hasattr(loader, "stats"):
        result["allocations_after_warmup"] = loader.stats()["allocations_after_warmup"]
        result["arenas"] = loader.stats()["arenas"]
    return result


def _samples(batch) -> int:
    if isinstance(batch, dict):
        return len(batch["input_ids"])
    first = batch[0]
    return len(first) if isinstance(first, tuple) else first.shape[0]


# -- orchestration -------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--only", choices=list(CONFIGS))
    parser.add_argument("--json")
    parser.add_argument("--run", nargs=3, metavar=("TASK", "CONFIG", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(*args.run, args.workers, args.epochs)))
        return
    tmp = tempfile.mkdtemp(prefix="bench_ragged_")
    try:
        results = run_rounds(args, os.path.join(tmp, "tokens"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, args)


def run_rounds(args: argparse.Namespace, path: str) -> dict:
    """Every (round, loader) in a fresh process, alternating the order; the raw figures."""
    make_tokens(path, args.docs)
    results: dict = {}
    for task, configs in CONFIGS.items():
        if args.only and task != args.only:
            continue
        for r in range(args.rounds):
            for config in (configs if r % 2 == 0 else configs[::-1]):
                out = subprocess.run(
                    [sys.executable, __file__, "--run", task, config, path, "--workers",
                     str(args.workers), "--epochs", str(args.epochs)],
                    capture_output=True, text=True, check=True)
                results.setdefault(task, {}).setdefault(config, []).append(
                    json.loads(out.stdout.strip().splitlines()[-1]))
                print(task, config, r, results[task][config][-1], file=sys.stderr, flush=True)
    return results


def report(results: dict, args: argparse.Namespace) -> None:
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    for task, per in results.items():
        med = {c: {k: statistics.median(run[k] for run in runs) for k in runs[0]
                   if runs[0][k] is not None} for c, runs in per.items()}
        print(f"\n{task} (medians of {args.rounds} rounds)\n")
        print("| loader | samples/s | samples/CPU-s | tokens/s | padding | peak PSS MB "
              "| allocs after warm-up |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c, m in med.items():
            tok = f"{m['tokens_per_s']:,.0f}" if "tokens_per_s" in m else "-"
            pad_ = f"{100 * m['padding']:.1f}%" if "padding" in m else "-"
            print(f"| {c} | {m['samples_per_s']:,.0f} | {m['samples_per_cpu_s']:,.0f} | {tok} "
                  f"| {pad_} | {m['peak_pss_mb']:.0f} "
                  f"| {m.get('allocations_after_warmup', '-')} |")
        for c in med:
            for key in ("samples_per_s", "samples_per_cpu_s") if c != "ours" else ():
                ratios = [o[key] / p[key] for o, p in zip(per["ours"], per[c])]
                print(f"\nours / {c}, {key}: {statistics.median(ratios):.2f}x (per-round "
                      f"ratios {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
