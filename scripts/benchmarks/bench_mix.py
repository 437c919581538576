#!/usr/bin/env python
"""Mixing three sources (two map-style, one WebDataset) by weight: pooled_loader.mix.Mix against
reading each source alone, torchdata.nodes' MultiNodeWeightedSampler + Loader, and litdata's
CombinedStreamingDataset (when it runs here); samples/s and the cost of a state_dict/load.

    python scripts/benchmarks/bench_mix.py [--rounds 5] [--samples 24000] [--reps 20]

Every sample is 3x32x32 uint8 bytes turned into an array by the same work (`--reps` rounds of
an integer op on it, ~3 us each; `--reps 0`: the bare conversion, to see each loader's own cost),
run in 2 worker processes, batches of 256. Ours: PooledLoader over each source alone (shuffled),
then over Mix(stop="never", samples_per_epoch=--samples); the mix's *expected* rate from the
singles is 1 / sum(fraction_s / rate_s), and "mix cost" is expected / measured - 1. torchdata:
each source a node yielding its raw items (shuffled indices or the tar's bytes) in the main
process, MultiNodeWeightedSampler, ParallelMapper(method="process", 2 workers) doing the work,
Batcher, Loader. The loaders run interleaved (A B C A B C ...) `--rounds` times; medians.
state_dict/load: the time of `state_dict()` mid-epoch, and of `load_state_dict()` on a fresh
loader up to its first batch (ours includes starting 2 workers; so does theirs).
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.mix import Mix  # noqa: E402
from pooled_loader.webdataset import WebDataset  # noqa: E402
from bench_wds import cpu_seconds  # noqa: E402 - psutil: CPU of this process and its workers

ITEM = 3 * 32 * 32
BATCH, WORKERS = 256, 2
WEIGHTS = {"a": 0.5, "b": 0.3, "web": 0.2}
REPS = 20
GOAL = 0.03  # the goal: the mix costs < 3% over reading one source


def work(buf: bytes) -> np.ndarray:
    a = np.frombuffer(buf, dtype=np.uint8).reshape(3, 32, 32)
    for _ in range(REPS):
        a = ((a.astype(np.uint16) * 3) >> 2).astype(np.uint8)
    return np.array(a)


class Bytes(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.data = np.random.default_rng(seed).integers(0, 256, (n, ITEM), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self.data)

    def raw(self, i: int) -> bytes:
        return self.data[i].tobytes()

    def __getitem__(self, i: int) -> np.ndarray:
        return work(self.data[i].tobytes())


def web_work(sample: dict) -> np.ndarray:
    return work(sample["bin"])


def make_shards(root: str, n: int, per_shard: int) -> list[str]:
    import webdataset as wds
    rng = np.random.default_rng(7)
    paths = []
    for s in range(0, n, per_shard):
        path = os.path.join(root, f"web-{s // per_shard:04d}.tar")
        with wds.TarWriter(path, encoder=False, mtime=0) as w:
            for k in range(s, min(n, s + per_shard)):
                w.write({"__key__": f"{k:08d}",
                         "bin": rng.integers(0, 256, ITEM, dtype=np.uint8).tobytes()})
        paths.append(path)
    return paths


# -- ours -----------------------------------------------------------------------------------------
def ours_single(src: Any) -> PooledLoader:
    iterable = isinstance(src, torch.utils.data.IterableDataset)
    return PooledLoader(src, batch_size=BATCH, shuffle=None if iterable else True,
                        num_workers=WORKERS, persistent_workers=True)


def ours_mix_one(a: Bytes) -> PooledLoader:
    """The mix path reading one source: what it costs over reading `a` alone (same workers,
    same batch, same samples)."""
    mix = Mix({"a": a}, {"a": 1.0}, stop="never", samples_per_epoch=len(a), batch_size=BATCH)
    return PooledLoader(mix, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)


def ours_mix(a: Bytes, b: Bytes, shards: list[str], samples: int) -> PooledLoader:
    mix = Mix({"a": a, "b": b, "web": WebDataset(shards, transform=web_work, seed=1)},
              dict(WEIGHTS), stop="never", samples_per_epoch=samples, batch_size=BATCH)
    return PooledLoader(mix, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)


def timed_epoch(loader: Any, limit: int | None = None) -> tuple[int, float, float | None]:
    """(samples, wall seconds, CPU seconds of this process and its workers or None)."""
    cpu0, start, n = cpu_seconds(), time.perf_counter(), 0
    for batch in loader:
        n += len(batch)
        if limit is not None and n >= limit:
            break
    wall, cpu1 = time.perf_counter() - start, cpu_seconds()
    return n, wall, None if cpu0 is None else cpu1 - cpu0


# -- torchdata.nodes ------------------------------------------------------------------------------
def _td_raw(item: tuple) -> np.ndarray:
    return work(item[1])


def torchdata_loader(a: Bytes, b: Bytes, shards: list[str]) -> Any:
    import torchdata.nodes as tn

    def shuffled(ds: Bytes, name: str, seed: int):
        def gen():
            epoch = 0
            while True:  # cycle, as the mix cycles its sources
                for i in np.random.default_rng(seed + epoch).permutation(len(ds)).tolist():
                    yield name, ds.raw(i)
                epoch += 1
        return gen()

    def web():
        ds = WebDataset(shards, transform=lambda s: ("web", s["bin"]), seed=1)
        while True:
            yield from ds

    nodes = {"a": tn.IterableWrapper(shuffled(a, "a", 0)),
             "b": tn.IterableWrapper(shuffled(b, "b", 1)), "web": tn.IterableWrapper(web())}
    node = tn.MultiNodeWeightedSampler(nodes, dict(WEIGHTS), stop_criteria="CYCLE_FOREVER",
                                       seed=0)
    node = tn.ParallelMapper(node, _td_raw, num_workers=WORKERS, method="process")
    node = tn.Batcher(node, BATCH)
    node = tn.Mapper(node, lambda batch: torch.from_numpy(np.stack(batch)))
    return tn.Loader(node)


# -- litdata --------------------------------------------------------------------------------------
def _lit_item(i: int) -> dict:
    return {"bin": np.random.default_rng(i).integers(0, 256, ITEM, dtype=np.uint8).tobytes()}


def _lit_class() -> type:
    from litdata import StreamingDataset

    class Worked(StreamingDataset):
        def __getitem__(self, index: Any) -> np.ndarray:
            return work(super().__getitem__(index)["bin"])
    Worked.__qualname__ = "Worked"
    globals()["Worked"] = Worked  # picklable by name for its workers
    return Worked


def litdata_loader(root: str, n: int) -> Any:
    """Three StreamingDatasets over one optimized folder (litdata's optimize takes ~30 s to
    start here, so it runs once)."""
    from litdata import CombinedStreamingDataset, StreamingDataLoader

    out = os.path.join(root, "lit")
    if not os.path.exists(out):  # in a child: optimize sets this process's start method to spawn
        subprocess.run([sys.executable, os.path.abspath(__file__), "--lit-optimize", out,
                        str(n)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    worked = globals().get("Worked") or _lit_class()
    sets = [worked(out, shuffle=True, seed=k) for k in range(3)]
    combined = CombinedStreamingDataset(sets, seed=0, weights=[WEIGHTS[k] for k in WEIGHTS],
                                        iterate_over_all=False)
    return StreamingDataLoader(combined, batch_size=BATCH, num_workers=WORKERS)


# -- the mix's own cost ---------------------------------------------------------------------------
class _Zero(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.x = n, np.zeros(4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return self.x


def own_cost(n: int = 100_000) -> tuple[float, float]:
    """(CPU us a sample of reading a free map-style source in a shuffled order, of the same
    through Mix over three such sources), in this process: the mix's own bookkeeping (draws,
    item indices, the stage clock), which wall-clock rates on a shared machine blur."""
    sources = {k: _Zero(n) for k in WEIGHTS}
    order = np.random.default_rng(0).permutation(n).tolist()
    start = time.process_time()
    for i in order:
        sources["a"][i]
    direct = (time.process_time() - start) / n
    mix = Mix(sources, dict(WEIGHTS), stop="never", samples_per_epoch=n, batch_size=BATCH)
    start = time.process_time()
    count = sum(1 for _ in mix)
    return 1e6 * direct, 1e6 * (time.process_time() - start) / count


class _AsIterable(torch.utils.data.IterableDataset):
    """A map-style source read in a shuffled order through the loader's iterable path."""

    def __init__(self, source: Bytes) -> None:
        self.source = source

    def __iter__(self):
        for i in np.random.default_rng(0).permutation(len(self.source)).tolist():
            yield self.source[i]


def in_process_cpu(a: Bytes, b: Bytes, shards: list[str], samples: int,
                   rounds: int) -> dict[str, float]:
    """CPU us a sample with 0 workers (everything in this process, so other processes' load
    hardly moves it): each source alone, then the mix; medians of `rounds` interleaved runs."""
    makers = {"a": lambda: PooledLoader(a, batch_size=BATCH, shuffle=True),
              "a as an IterableDataset": lambda: PooledLoader(_AsIterable(a), batch_size=BATCH),
              "Mix(a)": lambda: PooledLoader(Mix({"a": a}, {"a": 1.0}, stop="never",
                                                 samples_per_epoch=len(a), batch_size=BATCH),
                                             batch_size=BATCH),
              "b": lambda: PooledLoader(b, batch_size=BATCH, shuffle=True),
              "web": lambda: PooledLoader(WebDataset(shards, transform=web_work, seed=1),
                                          batch_size=BATCH),
              "mix": lambda: PooledLoader(
                  Mix({"a": a, "b": b, "web": WebDataset(shards, transform=web_work, seed=1)},
                      dict(WEIGHTS), stop="never", samples_per_epoch=samples,
                      batch_size=BATCH), batch_size=BATCH)}
    got: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(rounds):
        for name, make in makers.items():
            loader = make()
            start, n = time.process_time(), 0
            for batch in loader:
                n += len(batch)
            got[name].append(1e6 * (time.process_time() - start) / n)
    return {k: statistics.median(v) for k, v in got.items()}


# -- state cost -----------------------------------------------------------------------------------
def state_cost(make: Callable[[], Any], steps: int = 20) -> tuple[float, float]:
    """(seconds of state_dict() after `steps` batches, seconds of load_state_dict() on a fresh
    loader up to its first batch)."""
    loader = make()
    it = iter(loader)
    for _ in range(steps):
        next(it)
    start = time.perf_counter()
    state = loader.state_dict()
    saved = time.perf_counter() - start
    del it
    fresh = make()
    start = time.perf_counter()
    fresh.load_state_dict(state)
    next(iter(fresh))
    return saved, time.perf_counter() - start


def main() -> None:
    global REPS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--samples", type=int, default=24_000)
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--per-source", type=int, default=8_000)
    args = p.parse_args()
    REPS = args.reps
    tmp = tempfile.mkdtemp(prefix="bench_mix_")
    try:
        a, b = Bytes(args.per_source, 0), Bytes(args.per_source, 1)
        shards = make_shards(tmp, args.per_source, 1000)
        web = WebDataset(shards, transform=web_work, seed=1)
        print("state_dict / load_state_dict + first batch (seconds):")
        makers = {"ours: Mix(a, b, web)": lambda: ours_mix(a, b, shards, args.samples),
                  "torchdata MultiNodeWeightedSampler": lambda: torchdata_loader(a, b, shards),
                  "litdata CombinedStreamingDataset": lambda: litdata_loader(tmp,
                                                                             args.per_source)}
        for name, make in makers.items():
            try:
                saved, loaded = state_cost(make)
                print(f"  {name:40s} state_dict {1e3 * saved:8.2f} ms   load+first batch "
                      f"{loaded:6.2f} s")
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: {type(exc).__name__}: {exc}")
        gc.collect()  # the peers' loaders of the state phase, before our workers fork
        load0 = os.getloadavg()
        loaders: dict[str, Any] = {"ours: a alone": ours_single(a),
                                   "ours: Mix(a)": ours_mix_one(a),
                                   "ours: b alone": ours_single(b),
                                   "ours: web alone": ours_single(web),
                                   "ours: Mix(a, b, web)": ours_mix(a, b, shards, args.samples)}
        try:
            loaders["torchdata MultiNodeWeightedSampler"] = torchdata_loader(a, b, shards)
        except Exception as exc:  # noqa: BLE001 - a peer that does not run is reported
            print(f"torchdata skipped: {type(exc).__name__}: {exc}")
        try:
            loaders["litdata CombinedStreamingDataset"] = litdata_loader(tmp, args.per_source)
        except Exception as exc:  # noqa: BLE001
            print(f"litdata skipped: {type(exc).__name__}: {exc}")
        rates: dict[str, list[float]] = {k: [] for k in loaders}
        cpu_us: dict[str, list[float]] = {k: [] for k in loaders}  # CPU us a sample
        for r in range(args.rounds + 1):  # the first round warms up (workers, page cache)
            for name, loader in list(loaders.items()):
                limit = args.samples if "a)" not in name and "alone" not in name else None
                try:
                    n, s, cpu = timed_epoch(loader, limit)
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} failed: {type(exc).__name__}: {exc}; dropped")
                    del loaders[name], rates[name]
                    continue
                if r:
                    rates[name].append(n / s)
                    if cpu is not None:
                        cpu_us[name].append(1e6 * cpu / n)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"\nreps={REPS} (per-sample work), batch {BATCH}, {WORKERS} workers, "
              f"{args.rounds} rounds, medians (samples/s):")
        for name, rate in med.items():
            rounds = ", ".join(f"{x:.0f}" for x in rates[name])
            print(f"  {name:40s} {rate:10.0f}   (rounds: {rounds})")
        fractions = {"a": WEIGHTS["a"], "b": WEIGHTS["b"], "web": WEIGHTS["web"]}
        mix_stats = loaders["ours: Mix(a, b, web)"].stats()["mix"]["sources"]
        total = sum(v["samples"] for v in mix_stats.values())
        if total:
            fractions = {k: v["samples"] / total for k, v in mix_stats.items()}

        def expected(r: int) -> float:
            return 1 / sum(f / rates[f"ours: {k} alone"][r] for k, f in fractions.items())
        verdicts: list[tuple[str, float, bool]] = []
        one = [x / y - 1 for x, y in zip(rates["ours: a alone"], rates["ours: Mix(a)"])]
        print(f"  Mix(a) over a alone (same samples, workers, batch), wall clock per round: "
              f"{', '.join(f'{c:+.1%}' for c in one)}; median {statistics.median(one):+.1%}")
        verdicts.append(("mix path over reading one source, wall clock (median of rounds)",
                         statistics.median(one), statistics.median(one) < GOAL))
        if cpu_us["ours: a alone"] and cpu_us["ours: Mix(a)"]:
            c1 = statistics.median(cpu_us["ours: Mix(a)"]) / statistics.median(
                cpu_us["ours: a alone"]) - 1
            print(f"  Mix(a) over a alone, CPU us a sample (main + workers, medians): "
                  f"{statistics.median(cpu_us['ours: Mix(a)']):.1f} vs "
                  f"{statistics.median(cpu_us['ours: a alone']):.1f}: {c1:+.1%}")
            verdicts.append(("mix path over reading one source, CPU a sample", c1, c1 < GOAL))
        costs = [expected(r) / rates["ours: Mix(a, b, web)"][r] - 1 for r in range(args.rounds)]
        print(f"  mix cost over reading its sources alone (the singles' rates weighted by the "
              f"realised fractions), per round: {', '.join(f'{c:+.1%}' for c in costs)}; "
              f"median {statistics.median(costs):+.1%}")
        if all(cpu_us[f"ours: {k} alone"] for k in fractions) and cpu_us["ours: Mix(a, b, web)"]:
            cpu = {k: statistics.median(v) for k, v in cpu_us.items() if v}
            want = sum(f * cpu[f"ours: {k} alone"] for k, f in fractions.items())
            got = cpu["ours: Mix(a, b, web)"]
            print(f"  CPU us a sample (main + workers, medians): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items() if k.startswith("ours"))
                  + f"; expected for the mix from the singles {want:.1f}: mix cost "
                  f"{got / want - 1:+.1%}")
            verdicts.append(("mix of three over its sources alone, CPU a sample",
                             got / want - 1, got / want - 1 < GOAL))
        verdicts.append(("mix of three over its sources alone, wall clock (median of rounds)",
                         statistics.median(costs), statistics.median(costs) < GOAL))
        cpu0 = in_process_cpu(a, b, shards, args.per_source, args.rounds)
        want = sum(WEIGHTS[k] * cpu0[k] for k in WEIGHTS)
        print(f"  0 workers, CPU us a sample (medians): "
              + ", ".join(f"{k} {v:.1f}" for k, v in cpu0.items())
              + f"; expected for the mix {want:.1f}: mix cost {cpu0['mix'] / want - 1:+.1%}; "
              f"Mix(a) over a read through the iterable path "
              f"{cpu0['Mix(a)'] / cpu0['a as an IterableDataset'] - 1:+.1%}, over a map-style "
              f"{cpu0['Mix(a)'] / cpu0['a'] - 1:+.1%}")
        own = [own_cost() for _ in range(3)]
        direct, mixed = (statistics.median(c[k] for c in own) for k in (0, 1))
        start = time.process_time()
        for i in range(2000):
            a[i]
        per_sample = 1e6 * (time.process_time() - start) / 2000
        print(f"  the mix's own CPU cost: {mixed - direct:.2f} us a sample (free source: "
              f"{direct:.2f} us direct, {mixed:.2f} us through Mix); reading a sample of 'a' "
              f"costs {per_sample:.0f} us of CPU: {(mixed - direct) / per_sample:.1%}")
        own_share = (mixed - direct) / per_sample
        verdicts.append(("the mix's own work over a sample of 'a', CPU", own_share,
                         own_share < GOAL))
        zero = cpu0["Mix(a)"] / cpu0["a"] - 1
        verdicts.append(("Mix(a) over a, 0 workers, CPU a sample", zero, zero < GOAL))
        for name in loaders:
            if not name.startswith("ours"):
                ratios = [x / y for x, y in zip(rates[name], rates["ours: Mix(a, b, web)"])]
                print(f"  {name} / ours (median of per-round ratios): "
                      f"{statistics.median(ratios):.2f}x")
                verdicts.append((f"ours at least as fast as {name} (their rate / ours)",
                                 statistics.median(ratios), statistics.median(ratios) <= 1.0))
        print(f"\nload average (1, 5, 15 min) at the start of the timed rounds "
              f"{', '.join(f'{x:.1f}' for x in load0)}, at the end "
              f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"goals (< {GOAL:.0%} over one source; at least as fast as each peer):")
        for what, value, ok in verdicts:
            shown = f"{value:.2f}x" if "peer" in what or "fast as" in what else f"{value:+.1%}"
            print(f"  {'PASS' if ok else 'MISS'}  {what}: {shown}")
        for name, loader in loaders.items():
            close = getattr(loader, "close", None)
            if callable(close):
                close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--lit-optimize"]:
        import litdata
        litdata.optimize(fn=_lit_item, inputs=list(range(int(sys.argv[3]))),
                         output_dir=sys.argv[2], chunk_bytes="4MB", num_workers=1)
    else:
        main()
