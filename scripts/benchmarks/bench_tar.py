#!/usr/bin/env python
"""Tar shard reading speed of two source trees, in the same run (issue 24's hardened reader).

    python scripts/benchmarks/bench_tar.py --baseline /work/main [--rounds 7] [--shards 8] [--per-shard 500]

Writes ``--shards`` shards of ``--per-shard`` samples (a ``.cls`` and a ~``--kb`` KB ``.jpg``
of random bytes each, by ``shards write``) once, then, in alternated order each round, runs one
process per tree (this checkout, and the tree given by ``--baseline``, imported through
PYTHONPATH) that times two things: reading every sample of every shard through
``pooled_loader.webdataset.WebDataset`` (no transform; the data is read), and counting them from
their headers (``count_samples``, its per-process cache cleared). The table gives the median MB/s
and samples/s of each, and the ratio this/baseline. Shards sit in the page cache (read once
before timing), so this measures the reader, not the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import glob, json, sys, time
import pooled_loader.webdataset as w
from pooled_loader.shards.samples import COUNT_CACHE
shards = sorted(glob.glob(sys.argv[1] + "/*.tar"))
nbytes = sum(__import__("os").path.getsize(s) for s in shards)
t = time.perf_counter()
ds = w.WebDataset(shards, shuffle_shards=False, samples_per_epoch=int(sys.argv[2]))
n = sum(1 for _ in ds)
read = time.perf_counter() - t
t = time.perf_counter()
for _ in range(5):
    COUNT_CACHE.clear()
    c = sum(w.count_samples(s) for s in shards)
count = (time.perf_counter() - t) / 5
print(json.dumps({"file": w.__file__, "n": n, "c": c, "read_s": read, "count_s": count,
                  "mb": nbytes / 2**20}))
"""


def make_shards(root: str, shards: int, per_shard: int, kb: int) -> str:
    from pooled_loader.shards import write_shards
    imgs = os.path.join(root, "imgs")
    for i in range(shards * per_shard):
        d = os.path.join(imgs, f"c{i % 10}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
            f.write(os.urandom(kb * 1024 + (i * 37) % 4096))
    out = os.path.join(root, "shards")
    write_shards(imgs, os.path.join(out, "s-%04d.tar"), per_shard, progress=False)
    return out


def run(tree: str, shards: str, total: int) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    r = subprocess.run([sys.executable, "-c", CHILD, shards, str(total)], env=env, capture_output=True,
                       text=True, check=True, cwd=tree)
    return json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="source tree to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--per-shard", type=int, default=500)
    ap.add_argument("--kb", type=int, default=40, help="approximate sample size")
    args = ap.parse_args()
    trees = {"this": HERE, "baseline": os.path.abspath(args.baseline)}
    res: dict[str, list[dict]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        shards = make_shards(tmp, args.shards, args.per_shard, args.kb)
        total = args.shards * args.per_shard
        for name in trees:  # warm the page cache, check both trees read the same samples
            first = run(trees[name], shards, total)
            print(f"{name}: {first['file']}: {first['n']} samples read, {first['c']} counted")
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                res[name].append(run(trees[name], shards, total))
    print(f"\n{args.rounds} rounds, {args.shards} shards x {args.per_shard} samples "
          f"({res['this'][0]['mb']:.0f} MB), alternated order; medians")
    print(f"{'':10} {'read MB/s':>10} {'count shards/s':>15}")
    med = {}
    for name in trees:
        mb, n = res[name][0]["mb"], args.shards
        med[name] = (statistics.median(mb / x["read_s"] for x in res[name]),
                     statistics.median(n / x["count_s"] for x in res[name]))
        print(f"{name:10} {med[name][0]:10.0f} {med[name][1]:15.0f}")
    print(f"{'ratio':10} {med['this'][0] / med['baseline'][0]:10.2f} "
          f"{med['this'][1] / med['baseline'][1]:15.2f}  (this / baseline; > 1: faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
