#!/usr/bin/env python
"""Overhead of the always-on stage timings (issue 29): this tree against the code without them.

    python scripts/benchmarks/bench_stages.py [--base REV] [--rounds 5] [--epochs 3] [--data DIR]
                                   [--json OUT]

Two trees run the same loaders, each run in a fresh process, rounds alternating which tree goes
first (ABBA), so both see the same machine load: this working tree (PYTHONPATH=.) and ``--base``
(default: the merge base with main, the code before the timings), extracted with ``git archive``
into a temporary folder with this tree's compiled extensions copied in (csrc/ is unchanged).
Workloads, 2 workers, persistent, one warm-up epoch then ``--epochs`` timed epochs:

- transport: bench.py's synthetic 224x224x3 uint8 + label, 10,240 samples, batch 256 (the
  cheapest samples there are, ~30 us each: the worst case for a per-sample cost);
- images: ImageFolder(--data) with DecodeImage + RandomResizedCrop(224) + flip + ToCHW, batch 64
  (default data: 600 images made by scripts/tools/make_dataset.py in /tmp);
- transport-inproc: transport with num_workers=0, rated by this process's CPU time (one thread:
  the least noisy figure on a loaded machine, the very code a worker runs per sample).

Prints per tree the median samples/s, the ratio this / base (median of the per-round ratios),
the same ratio by CPU time per sample (this process and its workers, every epoch: far less
sensitive to other jobs on the machine than wall clock) and, measured directly in this process, the hooks' own cost per sample (the clock reads and
bookkeeping a sample pays) against the per-sample worker time this tree's stats() reports.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOADS = ("transport", "images", "transport-inproc")


class Synthetic(torch.utils.data.Dataset):
    """As scripts/benchmarks/bench.py: n samples of (224x224x3 uint8, int) from 16 precomputed images."""

    def __init__(self, n: int):
        rng = np.random.default_rng(0)
        self.n = n
        self.images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(16)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.images[i % 16], i


def run_one(workload: str, data: str, epochs: int) -> dict:
    """In a child process whose PYTHONPATH names the tree: samples/s per timed epoch."""
    import pooled_loader
    from pooled_loader import PooledLoader
    torch.set_num_threads(1)
    workers = 0 if workload.endswith("-inproc") else 2
    clock = time.process_time if workers == 0 else time.perf_counter
    if workload.startswith("transport"):
        ds, batch = Synthetic(10240), 256
    else:
        from pooled_loader.vision import (Compose, DecodeImage, ImageFolder,
                                          RandomHorizontalFlip, RandomResizedCrop, ToCHW)
        ds = ImageFolder(data, transform=Compose([DecodeImage(), RandomResizedCrop(224),
                                                  RandomHorizontalFlip(), ToCHW()]))
        batch = 64
    loader = PooledLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0,
                          generator=torch.Generator().manual_seed(0))
    rates, total = [], 0
    for epoch in range(epochs + 1):
        start, seen = clock(), 0
        for batch_data in loader:
            seen += len(batch_data[1])
        total += seen
        if epoch:
            rates.append(seen / (clock() - start))
    stats = loader.stats()
    out = {"tree": os.path.dirname(os.path.dirname(pooled_loader.__file__)), "rates": rates}
    if "stages" in stats:
        fig = stats["stages"]["all"]
        out["busy_ms_per_sample"] = 1e3 * fig["busy_s"] / fig["samples"]
        out["stage_ms_per_sample"] = fig["per_sample_ms"]
    loader.close()  # joins the workers: their CPU time is then in RUSAGE_CHILDREN
    cpu = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    out["cpu_us_per_sample"] = 1e6 * cpu / total  # every epoch and the start-up included
    return out


def hook_cost_ns(stages_per_sample: int, n: int = 200_000) -> float:
    """Nanoseconds a sample pays for the timings: the two clock reads and sums of the collate
    loop, plus one read and ``CLOCK.add`` per vision stage, less the same loop without them."""
    from pooled_loader.observability.stages import CLOCK, Collating, perf_counter_ns
    CLOCK.begin(False)
    c = Collating(CLOCK)

    def timed() -> None:
        for _ in range(n):
            start = perf_counter_ns()
            for _ in range(stages_per_sample):
                start = CLOCK.add("decode", start, perf_counter_ns())
            end = perf_counter_ns()
            c.fetch_ns += end - start
            if c.spans is not None:
                c.span(start, end, 0)

    def bare() -> None:
        for _ in range(n):
            for _ in range(stages_per_sample):
                pass
    best = []
    for fn in (timed, bare) * 5:
        t = time.perf_counter_ns()
        fn()
        best.append(((time.perf_counter_ns() - t) / n, fn is timed))
    t_on = min(v for v, on in best if on)
    t_off = min(v for v, on in best if not on)
    return t_on - t_off


def base_tree(rev: str) -> str:
    out = tempfile.mkdtemp(prefix="pl_base_")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "pooled_loader", "**", "*.so"), recursive=True):
        shutil.copy(so, os.path.join(out, os.path.relpath(so, ROOT)))
    return out


def run_isolated(tree: str, workload: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", workload, "--data", args.data,
           "--epochs", str(args.epochs)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=tree)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert os.path.samefile(res["tree"], tree), (res["tree"], tree)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", default=None, help="git revision without the timings "
                                                "(default: merge-base HEAD main)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--data", default="/tmp/pl_bench_stages_imgs")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--json")
    p.add_argument("--one", choices=WORKLOADS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.data, args.epochs)))
        return 0
    if not os.path.isdir(args.data):
        sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))
        from make_dataset import make_dataset
        make_dataset(args.data, n=600)
    rev = args.base or subprocess.run(["git", "-C", ROOT, "merge-base", "HEAD", "main"],
                                      capture_output=True, text=True,
                                      check=True).stdout.strip()
    trees = {"this": ROOT, "base": base_tree(rev)}
    results: dict = {"base_rev": rev, "load_start": os.getloadavg()[0], "workloads": {}}
    try:
        for workload in args.workloads.split(","):
            runs: dict[str, list] = {"this": [], "base": []}
            ratios, cpu_ratios = [], []
            for r in range(args.rounds):
                order = ("this", "base") if r % 2 == 0 else ("base", "this")
                got = {name: run_isolated(trees[name], workload, args) for name in order}
                for name in order:
                    runs[name].append(got[name])
                ratios.append(statistics.median(got["this"]["rates"])
                              / statistics.median(got["base"]["rates"]))
                cpu_ratios.append(got["base"]["cpu_us_per_sample"]
                                  / got["this"]["cpu_us_per_sample"])
                print(f"{workload} round {r}: this/base {ratios[-1]:.3f} by wall clock, "
                      f"{cpu_ratios[-1]:.3f} by CPU time", flush=True)
            med = {k: statistics.median(x for run in v for x in run["rates"])
                   for k, v in runs.items()}
            busy = statistics.median(run["busy_ms_per_sample"] for run in runs["this"])
            stages = 2 if workload == "images" else 0  # decode, crop_resize
            cost = hook_cost_ns(stages)
            results["workloads"][workload] = {
                "median_samples_per_s": med, "ratio_this_over_base": statistics.median(ratios),
                "round_ratios": ratios, "worker_ms_per_sample": busy,
                "cpu_ratio_this_over_base": statistics.median(cpu_ratios),
                "round_cpu_ratios": cpu_ratios,
                "hook_ns_per_sample": cost, "hook_share": cost * 1e-6 / busy,
                "stage_ms_per_sample": runs["this"][-1]["stage_ms_per_sample"]}
    finally:
        shutil.rmtree(trees["base"], ignore_errors=True)
    results["load_end"] = os.getloadavg()[0]
    print(f"\nbase {rev}, {args.rounds} rounds (ABBA), {args.epochs} timed epochs each, "
          f"load {results['load_start']:.1f} -> {results['load_end']:.1f}")
    for w, r in results["workloads"].items():
        print(f"{w:<10} this {r['median_samples_per_s']['this']:>9.0f}/s  base "
              f"{r['median_samples_per_s']['base']:>9.0f}/s  this/base "
              f"{r['ratio_this_over_base']:.3f} (rounds {min(r['round_ratios']):.3f}-"
              f"{max(r['round_ratios']):.3f}), by CPU time {r['cpu_ratio_this_over_base']:.3f} "
              f"({min(r['round_cpu_ratios']):.3f}-{max(r['round_cpu_ratios']):.3f});  hooks {r['hook_ns_per_sample']:.0f} ns of "
              f"{1e3 * r['worker_ms_per_sample']:.1f} us per sample = {r['hook_share']:.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
