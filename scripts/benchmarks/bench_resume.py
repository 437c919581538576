#!/usr/bin/env python
"""What checkpointing costs (issue 9): throughput with a state taken at every step, against the
same loader without, the per_sample_seed cost, StatefulDataLoader's own overhead against
DataLoader (the peer figure), and the time of one state_dict() call with 8 workers.

    python scripts/benchmarks/bench_resume.py transport [--rounds 5] [--before TREE]
    python scripts/benchmarks/bench_resume.py images --data DIR [--rounds 5]
    python scripts/benchmarks/bench_resume.py state-time [--workers 8] [--rounds 5]

Every loader run is a process of its own (one warm-up epoch, then timed epochs); variants
alternate within each round (the order rotates) so that all see the same machine load, and the
figures are medians of the per-round ratios to the plain loader. `--before TREE` adds the loader
from another checkout (PYTHONPATH=TREE), e.g. the code before state tracking existed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TRANSPORT = ("plain", "snap", "torch", "stateful")
IMAGES = ("plain", "snap", "seeded")


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset with its own (tiny) state, for timing state_dict() with 8 workers."""

    def __init__(self, n: int):
        self.n, self.pos = n, 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for self.pos in range(info.id, self.n, info.num_workers):
            yield np.zeros(64, np.float32)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def make_loader(variant: str, dataset, batch: int, workers: int):
    kw = dict(batch_size=batch, shuffle=True, num_workers=workers,
              persistent_workers=workers > 0)
    if variant in ("torch", "stateful"):
        if variant == "torch":
            return torch.utils.data.DataLoader(dataset, **kw)
        from torchdata.stateful_dataloader import StatefulDataLoader
        return StatefulDataLoader(dataset, snapshot_every_n_steps=1, **kw)
    from pooled_loader import PooledLoader
    if variant == "before":
        return PooledLoader(dataset, **kw)
    if variant == "plain":
        return PooledLoader(dataset, snapshot_every_n_steps=None, **kw)
    return PooledLoader(dataset, snapshot_every_n_steps=1, per_sample_seed=variant == "seeded",
                        **kw)


def images_dataset(root: str):
    from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                      RandomResizedCrop, ToCHW)
    return ImageFolder(root, transform=Compose([DecodeImage(), RandomResizedCrop(224),
                                                RandomHorizontalFlip(), ToCHW()]))


def run_one(args: argparse.Namespace) -> dict:
    if args.mode == "transport":
        from bench import Synthetic
        dataset = Synthetic(args.samples)
    else:
        dataset = images_dataset(args.data)
    loader = make_loader(args.one, dataset, args.batch, args.workers)
    take_state = args.one in ("snap", "seeded", "stateful")
    rates, state_s, cpu_per_batch = [], [], []
    for epoch in range(args.epochs + 1):
        start, seen, batches, cpu = time.perf_counter(), 0, 0, time.process_time()
        for batch in loader:
            batches += 1
            seen += len(batch[1])
            if take_state:  # what a training loop that checkpoints every step does
                t = time.perf_counter()
                loader.state_dict()
                state_s.append(time.perf_counter() - t)
        if epoch:
            rates.append(seen / (time.perf_counter() - start))
            cpu_per_batch.append((time.process_time() - cpu) / batches)
    # The main process's CPU time per batch: what state tracking adds there, and far less
    # disturbed by other jobs on a shared machine than the wall-clock rate.
    return {"variant": args.one, "samples_per_s": statistics.median(rates),
            "main_cpu_us_per_batch": statistics.median(cpu_per_batch) * 1e6,
            "state_dict_us": statistics.median(state_s) * 1e6 if state_s else None}


def compare(args: argparse.Namespace, variants: tuple[str, ...]) -> None:
    if args.before:
        variants = variants + ("before",)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            env = dict(os.environ)
            if v == "before":
                env["PYTHONPATH"] = args.before
            cmd = [sys.executable, __file__, args.mode, "--one", v, "--samples",
                   str(args.samples), "--batch", str(args.batch), "--workers", str(args.workers),
                   "--epochs", str(args.epochs)] + (["--data", args.data] if args.data else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                sys.exit(f"{v} failed:\n{out.stderr[-3000:]}")
            results[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(r, v, round(results[v][-1]["samples_per_s"]), flush=True)
    rate = {v: [x["samples_per_s"] for x in results[v]] for v in variants}

    cpu = {v: [x.get("main_cpu_us_per_batch") for x in results[v]] for v in variants}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(rate[a], rate[b]))

    print(f"\n{args.mode}: batch {args.batch}, {args.workers} workers, {args.rounds} rounds, "
          f"{os.cpu_count()} cores; medians")
    for v in variants:
        us = [x["state_dict_us"] for x in results[v] if x["state_dict_us"] is not None]
        extra = f", state_dict() {statistics.median(us):.0f} us" if us else ""
        main_cpu = [c for c in cpu[v] if c is not None]
        cpu_text = f", main process {statistics.median(main_cpu):.0f} us CPU/batch" \
            if main_cpu else ""
        print(f"  {v:<9} {statistics.median(rate[v]):>9.0f} samples/s{cpu_text}{extra}")
    pairs = [("snap", "plain"), ("seeded", "plain"), ("plain", "before"), ("snap", "before"),
             ("stateful", "torch")]
    for a, b in pairs:
        if a in rate and b in rate:
            print(f"  {a} / {b}: {ratio(a, b):.3f} (median of per-round ratios)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def state_time(args: argparse.Namespace) -> None:
    """One state_dict() call, ours and StatefulDataLoader's (the peer, same configurations,
    `snapshot_every_n_steps=1`), `args.rounds` rounds alternating; medians."""
    from bench import Synthetic
    from torchdata.stateful_dataloader import StatefulDataLoader
    from pooled_loader import PooledLoader

    def cases(cls):
        extra = {"snapshot_every_n_steps": 1} if cls is StatefulDataLoader else {}
        return {
            "map-style, shuffled": lambda: cls(
                Synthetic(4096, (8, 8, 3)), batch_size=16, shuffle=True,
                num_workers=args.workers, generator=torch.Generator().manual_seed(0), **extra),
            "iterable, 8 worker states": lambda: cls(Stream(100000), batch_size=16,
                                                     num_workers=args.workers, **extra),
        }

    def one(make) -> tuple[float, int]:
        loader = make()
        it = iter(loader)
        for _ in range(64):
            next(it)
        times = []
        for _ in range(2000):
            t = time.perf_counter()
            state = loader.state_dict()
            times.append(time.perf_counter() - t)
        size = len(json.dumps(state)) if "_pooled" in state else len(str(state))
        del it
        if hasattr(loader, "close"):
            loader.close()
        return statistics.median(times) * 1e6, size

    print(f"state_dict() with {args.workers} workers, {os.cpu_count()} cores "
          f"(median of 2000 calls after 64 batches; medians of {args.rounds} rounds)")
    us: dict = {}
    for r in range(args.rounds):
        for cls in ((PooledLoader, StatefulDataLoader) if r % 2 == 0
                    else (StatefulDataLoader, PooledLoader)):
            for name, make in cases(cls).items():
                us.setdefault((name, cls.__name__), []).append(one(make))
    for name in cases(PooledLoader):
        ours = [t for t, _ in us[name, "PooledLoader"]]
        theirs = [t for t, _ in us[name, "StatefulDataLoader"]]
        print(f"  {name:<28} ours {statistics.median(ours):7.1f} us "
              f"(JSON {us[name, 'PooledLoader'][-1][1]} bytes), StatefulDataLoader "
              f"{statistics.median(theirs):7.1f} us, ours / theirs "
              f"{statistics.median(a / b for a, b in zip(ours, theirs)):.2f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("mode", choices=("transport", "images", "state-time"))
    p.add_argument("--data", help="ImageFolder of JPEGs (images)")
    p.add_argument("--samples", type=int, default=5120)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", help="another checkout to compare with (its root)")
    p.add_argument("--json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.batch is None:
        args.batch = 64 if args.mode == "images" else 256
    if args.workers is None:
        args.workers = 8 if args.mode == "state-time" else 2
    if args.one:
        print(json.dumps(run_one(args)))
    elif args.mode == "state-time":
        state_time(args)
    else:
        compare(args, TRANSPORT if args.mode == "transport" else IMAGES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
