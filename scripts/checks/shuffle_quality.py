#!/usr/bin/env python
"""How far an epoch's order is from a uniform permutation: shard order + buffer shuffling vs
WebDataset(shuffle="global"), on shards written sorted by class (the worst case for shard
shuffling: each shard holds one class).

    python scripts/checks/shuffle_quality.py [--shards 100] [--per-shard 200] [--classes 10]
                                      [--workers 2] [--batch 32] [--buffers 0,1000]

The order measured is what the training loop sees: the flattened batches of a PooledLoader
with real workers. Per order: the mean and longest run of equal labels, the share of adjacent
samples from the same shard, the mean number of distinct classes in a batch, the Pearson
correlation between position and source shard (listed order: near 0 as soon as the shard order
is shuffled, however clumped the samples), and the shard spread (the standard deviation of a
shard's positions over the epoch length, averaged over shards: about 0.29 when its samples are
spread uniformly, near 0 when they come together), each next to what uniform permutations of
the same labels give (mean over --draws numpy permutations).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import webdataset as wds  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.shards.index import write_index  # noqa: E402
from pooled_loader.webdataset import WebDataset  # noqa: E402


def make_sorted_shards(root: str, nshards: int, per_shard: int, classes: int) -> list[str]:
    """Shards sorted by class: shard s holds only class s * classes // nshards."""
    paths, gid = [], 0
    for s in range(nshards):
        path = os.path.join(root, f"sorted-{s:05d}.tar")
        with wds.TarWriter(path, encoder=False, mtime=0) as w:
            for _ in range(per_shard):
                w.write({"__key__": f"{gid:08d}", "cls": str(s * classes // nshards).encode(),
                         "shard": str(s).encode()})
                gid += 1
        write_index(path)
        paths.append(path)
    return paths


def label_and_shard(sample: dict) -> tuple[int, int]:
    return int(sample["cls"]), int(sample["shard"])


def epoch_order(ds: WebDataset, workers: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    loader = PooledLoader(ds, batch_size=batch, num_workers=workers)
    labels, shards = [], []
    for lab, sh in loader:
        labels.extend(lab.tolist())
        shards.extend(sh.tolist())
    return np.array(labels), np.array(shards)


def measures(labels: np.ndarray, shards: np.ndarray, batch: int) -> dict[str, float]:
    change = np.flatnonzero(np.diff(labels)) + 1
    runs = np.diff(np.concatenate([[0], change, [len(labels)]]))
    nb = len(labels) // batch
    per_batch = [len(np.unique(labels[i * batch:(i + 1) * batch])) for i in range(nb)]
    pos = np.arange(len(shards), dtype=float)
    spread = [pos[shards == s].std() / len(pos) for s in np.unique(shards)]
    return {"mean label run": float(runs.mean()), "longest label run": float(runs.max()),
            "adjacent same shard": float(np.mean(shards[1:] == shards[:-1])),
            "classes per batch": float(np.mean(per_batch)),
            "corr(position, shard)": float(np.corrcoef(pos, shards)[0, 1]),
            "shard spread": float(np.mean(spread))}


def uniform_reference(labels: np.ndarray, shards: np.ndarray, batch: int, draws: int
                      ) -> dict[str, float]:
    rng = np.random.default_rng(0)
    got = []
    for _ in range(draws):
        perm = rng.permutation(len(labels))
        got.append(measures(labels[perm], shards[perm], batch))
    return {k: statistics.mean(g[k] for g in got) for k in got[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=100)
    p.add_argument("--per-shard", type=int, default=200)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--buffers", default="0,1000", help="shuffle_buffer sizes for shard order")
    p.add_argument("--draws", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as root:
        paths = make_sorted_shards(root, args.shards, args.per_shard, args.classes)
        variants = {f"shard order + buffer {b}": WebDataset(
            paths, transform=label_and_shard, shuffle_buffer=int(b), seed=args.seed)
            for b in args.buffers.split(",")}
        variants["global"] = WebDataset(paths, transform=label_and_shard, shuffle="global",
                                        seed=args.seed)
        results = {}
        for name, ds in variants.items():
            labels, shards = epoch_order(ds, args.workers, args.batch)
            results[name] = measures(labels, shards, args.batch)
        ref = uniform_reference(labels, shards, args.batch, args.draws)

    n = args.shards * args.per_shard
    print(f"# {n} samples in {args.shards} shards sorted by class ({args.classes} classes, "
          f"{args.shards // args.classes} shards each), PooledLoader with {args.workers} "
          f"workers, batch {args.batch}, epoch 0, seed {args.seed}; uniform: mean of "
          f"{args.draws} numpy permutations")
    keys = list(ref)
    print("| order | " + " | ".join(keys) + " |")
    print("| --- |" + " ---: |" * len(keys))
    for name, r in {**results, "uniform permutation": ref}.items():
        print(f"| {name} | " + " | ".join(f"{r[k]:.3g}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
