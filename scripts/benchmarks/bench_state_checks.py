"""The cost of checking loaded states (issue 35): `load_state_dict` / `state_dict` / merges,
this checkout against an older one, in the same run.

    git worktree add /tmp/old <commit before the checks>   # and copy its compiled *.so there
    python scripts/benchmarks/bench_state_checks.py --old /tmp/old

Each round runs one child process per checkout, alternately; a child times every case (the
median of many calls) on states of real loaders, JSON round-tripped. Printed: per case the
median over rounds of each checkout's time and their ratio (this / old).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r'''
import json, os, statistics, sys, tarfile, io, time, contextlib
sys.path.insert(0, sys.argv[1])
import torch
from torch.utils.data import Dataset
from pooled_loader import PooledLoader, shards
from pooled_loader.resume import merge_rank_states
from pooled_loader.webdataset import WebDataset

class Ints(Dataset):
    def __len__(self): return 10000
    def __getitem__(self, i): return i

def timed(fn, n):
    fn()
    out = []
    for _ in range(n):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return statistics.median(out)

def after(loader, k):
    it = iter(loader)
    for _ in range(k):
        next(it)
    return json.loads(json.dumps(loader.state_dict())), it

res = {}
shuffled = PooledLoader(Ints(), batch_size=32, shuffle=True)
state, it = after(shuffled, 5)
target = PooledLoader(Ints(), batch_size=32, shuffle=True)
res["map load_state_dict"] = timed(lambda: target.load_state_dict(state), 300)
res["map state_dict"] = timed(shuffled.state_dict, 300)

ranks = []
for r in range(8):
    os.environ.update(RANK=str(r), WORLD_SIZE="8")
    ranks.append(after(PooledLoader(Ints(), batch_size=32, shuffle=True, distributed=True), 3)[0])
res["merge_rank_states, 8 ranks"] = timed(lambda: merge_rank_states(ranks), 300)
merged = merge_rank_states(ranks)
os.environ.update(RANK="1", WORLD_SIZE="3")
elastic = PooledLoader(Ints(), batch_size=32, shuffle=True, distributed=True)
res["merged load_state_dict"] = timed(lambda: elastic.load_state_dict(merged), 300)
os.environ.update(RANK="0", WORLD_SIZE="1")

root = sys.argv[2]
def txt(s): return int(s["txt"])
ds = WebDataset(root, transform=txt, shuffle_buffer=16, seed=1)
it = iter(ds)
for _ in range(40):
    next(it)
wstate = json.loads(json.dumps(ds.state_dict()))
fresh = WebDataset(root, transform=txt, shuffle_buffer=16, seed=1)
def wds_resume():  # load, then the first sample: where the position is checked
    fresh.load_state_dict(wstate)
    g = iter(fresh); next(g); g.close()
res["WebDataset resume (load + first sample)"] = timed(wds_resume, 40)
res["WebDataset state_dict"] = timed(ds.state_dict, 300)
gds = WebDataset(root, transform=txt, shuffle="global", seed=1)
it = iter(gds)
for _ in range(40):
    next(it)
gstate = json.loads(json.dumps(gds.state_dict()))
gfresh = WebDataset(root, transform=txt, shuffle="global", seed=1)
res["global load_state_dict"] = timed(lambda: gfresh.load_state_dict(gstate), 300)
print(json.dumps(res))
'''


def make_shards(root: str) -> None:
    import io
    import tarfile
    k = 0
    for s in range(4):
        with tarfile.open(os.path.join(root, f"s-{s}.tar"), "w") as tf:
            for _ in range(500):
                data = str(k).encode()
                info = tarfile.TarInfo(f"{k:06d}.txt")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                k += 1
    sys.path.insert(0, HERE)
    from pooled_loader import shards
    assert shards.main(["index", root]) == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="an older checkout of the repository")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        make_shards(root)
        times: dict[str, dict[str, list[float]]] = {"this": {}, "old": {}}
        for _ in range(args.rounds):
            for name, tree in (("this", HERE), ("old", args.old)):
                out = subprocess.run([sys.executable, "-c", CHILD, tree, root], check=True,
                                     capture_output=True, text=True, cwd=tree).stdout
                for case, t in json.loads(out.strip().splitlines()[-1]).items():
                    times[name].setdefault(case, []).append(t)
    print(f"{'case':42s} {'old us':>9s} {'this us':>9s} {'this/old':>9s}")
    for case in times["this"]:
        old = statistics.median(times["old"][case]) * 1e6
        new = statistics.median(times["this"][case]) * 1e6
        print(f"{case:42s} {old:9.1f} {new:9.1f} {new / old:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
