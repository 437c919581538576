#!/usr/bin/env python
"""What an elastic resume costs (issue 25): one `state_dict()` of a rank with 8 workers,
`merge_rank_states` of 64 ranks x 8 workers (map-style and WebDataset), and the time to the first
batch after loading a merged state against a fresh start (same run, alternating, medians).

    python scripts/benchmarks/bench_elastic.py [--rounds 5] [--n 1281167]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
warnings.filterwarnings("ignore", message="This DataLoader will create")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.resume import merge_rank_states  # noqa: E402


class Tiny(torch.utils.data.Dataset):
    """ImageNet's length, samples of 16 bytes: the loader's own costs, not the dataset's."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(4, i, dtype=np.int32)


def with_rank(rank: int, world: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))


def median_ms(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def timed_states(loader: PooledLoader, batches: int, world: int,
                 also: Callable[[dict, int], None] = lambda s, r: None
                 ) -> tuple[float, list[dict]]:
    """The loader's state_dict() time after `batches` batches, and the states of `world` ranks
    (its state with the rank changed, and `also(state, rank)` applied)."""
    it = iter(loader)
    for _ in range(min(batches, len(loader) - 1)):  # mid-epoch
        next(it)
    ms = median_ms(loader.state_dict, 200)
    state = loader.state_dict()
    del it
    loader.close()
    states = []
    for r in range(world):
        s = copy.deepcopy(state)
        s["_pooled"]["rank"] = r
        also(s, r)
        states.append(s)
    return ms, states


def map_states(n: int, world: int, workers: int) -> tuple[float, list[dict]]:
    """Map-style: a rank with `workers` workers after 10 batches, as `world` ranks."""
    with_rank(0, world)
    loader = PooledLoader(Tiny(n), batch_size=256, distributed=True, shuffle=True,
                          num_workers=workers)
    loader.set_epoch(3)
    return timed_states(loader, 10, world)


def wds_states(world: int, workers: int) -> tuple[float, list[dict]]:
    from test_webdataset import make_shards, sample_id
    from pooled_loader.webdataset import WebDataset
    root = tempfile.mkdtemp(prefix="bench_elastic_")
    make_shards(root, [400] * 64)
    with_rank(0, world)
    loader = PooledLoader(WebDataset(root, transform=sample_id, seed=1), batch_size=4,
                          num_workers=workers)

    def set_rank(state: dict, rank: int) -> None:
        for w in state["_snapshot"]["_worker_snapshots"].values():
            w["dataset_state"]["rank"] = rank
    return timed_states(loader, 4 * workers, world, set_rank)


def first_batch_s(n: int, merged: dict | None, workers: int) -> float:
    with_rank(1, 3)
    t = time.perf_counter()
    loader = PooledLoader(Tiny(n), batch_size=256, distributed=True, shuffle=True,
                          num_workers=workers)
    if merged is not None:
        loader.load_state_dict(merged)
    loader.set_epoch(3)
    next(iter(loader))
    elapsed = time.perf_counter() - t
    loader.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=1_281_167)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    ms, states = map_states(args.n, 64, 8)
    out["map_state_dict_ms"] = ms
    out["map_merge_64_ranks_ms"] = median_ms(lambda: merge_rank_states(states), 20)
    merged = merge_rank_states(states)
    out["map_merged_json_bytes"] = len(json.dumps(merged))
    ms, wstates = wds_states(64, 8)
    out["wds_state_dict_ms"] = ms
    out["wds_merge_64x8_ms"] = median_ms(lambda: merge_rank_states(wstates), 20)
    ratios, fresh, resumed = [], [], []
    for k in range(args.rounds):  # alternate which goes first
        pair = [("fresh", None), ("resumed", merged)]
        if k % 2:
            pair.reverse()
        got = {name: first_batch_s(args.n, m, 2) for name, m in pair}
        fresh.append(got["fresh"])
        resumed.append(got["resumed"])
        ratios.append(got["resumed"] / got["fresh"])
    out.update(first_batch_fresh_s=statistics.median(fresh),
               first_batch_resumed_s=statistics.median(resumed),
               resumed_over_fresh=statistics.median(ratios), rounds=args.rounds, n=args.n)
    for key, value in out.items():
        print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
