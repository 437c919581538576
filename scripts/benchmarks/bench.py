#!/usr/bin/env python
"""Transport benchmark: PooledLoader vs torch DataLoader moving synthetic images, same run.

Samples are 224x224x3 uint8 arrays (precomputed, so only transport is measured) plus an int
label; batch 256, 2 workers, persistent workers for both. Each loader runs in its own process
(clean peak RSS), one warm-up epoch then timed epochs; rounds alternate between the loaders so
both see the same machine load. Reports medians, the ratio, peak RSS and the pool's slot
allocations after warm-up.

    python scripts/benchmarks/bench.py [--samples 10240] [--epochs 3] [--rounds 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

LOADERS = ("pooled", "torch")


class Synthetic(torch.utils.data.Dataset):
    """n samples of (224x224x3 uint8, int) drawn from 16 precomputed random images."""

    def __init__(self, n: int, shape=(224, 224, 3)):
        rng = np.random.default_rng(0)
        self.n = n
        self.images = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(16)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % 16], i


def make_loader(name: str, dataset, batch: int, workers: int):
    from torch.utils.data import DataLoader
    from pooled_loader import PooledLoader
    cls = PooledLoader if name == "pooled" else DataLoader
    return cls(dataset, batch_size=batch, shuffle=True, num_workers=workers,
               persistent_workers=workers > 0)


def run_one(name: str, samples: int, batch: int, workers: int, epochs: int) -> dict:
    """Run one loader in this process: warm-up epoch, then `epochs` timed epochs."""
    loader = make_loader(name, Synthetic(samples), batch, workers)
    rates = []
    for epoch in range(epochs + 1):
        start, seen = time.perf_counter(), 0
        for images, labels in loader:
            seen += len(labels)
        rate = seen / (time.perf_counter() - start)
        if epoch > 0:
            rates.append(rate)
    result = {"loader": name, "samples_per_s": rates,
              "peak_rss_mb_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if name == "pooled":
        stats = loader.stats()
        result["allocations_after_warmup"] = stats["allocations_after_warmup"]
        result["pool_slots"] = stats["slots"]
    del loader  # workers exit: their peak RSS is then counted in RUSAGE_CHILDREN
    time.sleep(0.5)
    result["peak_rss_mb_worker"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return result


def run_isolated(name: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--one", name, "--samples", str(args.samples), "--batch",
           str(args.batch), "--workers", str(args.workers), "--epochs", str(args.epochs)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict]) -> dict:
    table = {}
    for name in LOADERS:
        mine = [r for r in runs if r["loader"] == name]
        rates = [v for r in mine for v in r["samples_per_s"]]
        table[name] = {
            "median_samples_per_s": statistics.median(rates),
            "epochs": len(rates),
            "peak_rss_mb_main": max(r["peak_rss_mb_main"] for r in mine),
            "peak_rss_mb_worker": max(r["peak_rss_mb_worker"] for r in mine),
            "allocations_after_warmup": max((r.get("allocations_after_warmup") or 0)
                                            for r in mine) if name == "pooled" else None,
        }
    table["ratio"] = (table["pooled"]["median_samples_per_s"]
                      / table["torch"]["median_samples_per_s"])
    return table


def print_table(table: dict, args: argparse.Namespace) -> None:
    gbps = 224 * 224 * 3 / 1e9
    print(f"\nTransport: 224x224x3 uint8 + label, batch {args.batch}, {args.workers} workers, "
          f"median of {table['pooled']['epochs']} epochs (after warm-up), {os.cpu_count()} cores")
    print(f"{'loader':<22}{'samples/s':>12}{'GB/s':>8}{'peak RSS main':>15}"
          f"{'peak RSS worker':>17}{'slot allocs after warm-up':>27}")
    for name, label in (("pooled", "PooledLoader"), ("torch", "torch DataLoader")):
        row = table[name]
        allocs = "-" if row["allocations_after_warmup"] is None else row["allocations_after_warmup"]
        print(f"{label:<22}{row['median_samples_per_s']:>12.0f}"
              f"{row['median_samples_per_s'] * gbps:>8.2f}{row['peak_rss_mb_main']:>12.0f} MB"
              f"{row['peak_rss_mb_worker']:>14.0f} MB{allocs!s:>27}")
    print(f"PooledLoader / DataLoader: {table['ratio']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--samples", type=int, default=10240)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--one", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.samples, args.batch, args.workers, args.epochs)))
        return 0
    try:
        from tqdm import tqdm
    except ImportError:
        def tqdm(x, **_):
            return x
    runs = []
    for r in tqdm(range(args.rounds * len(LOADERS)), desc="transport benchmark", unit="run"):
        runs.append(run_isolated(LOADERS[r % len(LOADERS)], args))
    table = summarize(runs)
    print_table(table, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "summary": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
