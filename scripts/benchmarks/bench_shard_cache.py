#!/usr/bin/env python
"""The shard cache, prefetch and global shuffle (pooled_loader.shards.cache, .global_shuffle) in
the image pipeline, against local disk; every ratio is measured within one run.

    python scripts/benchmarks/bench_shard_cache.py --data DIR [--part cache,prefetch,global,lru]
                                        [--epochs 5] [--rounds 3] [--rate-mb 50]

DIR as for scripts/benchmarks/bench_wds.py (shard folder, ImageFolder, or where to make one); shards
without an index get one. Work per sample: decode + RandomResizedCrop 224 + flip (bench_wds's),
batch 256, 2 persistent workers, PooledLoader + WebDataset. Parts:

- ``cache``: local disk vs http://127.0.0.1 (``python -m http.server`` in a subprocess) with
  ``cache_dir``: the epochs after the first read the cache. Epochs alternate (local, http;
  then http, local; ...); medians of ``--epochs`` after one warm-up epoch each.
- ``prefetch``: the first epoch (an empty cache; ``samples_per_epoch`` given, so nothing is
  counted up front) over tests/http_shards.py throttled to ``--rate-mb`` MB/s in a subprocess,
  ``prefetch_shards=0`` vs ``2``, and local disk for reference; ``--rounds`` rounds, the order
  alternating; medians. A 100-sample shuffle buffer: a buffer is filled before the first
  sample is transformed, and one of 1000 would be each worker's whole share of 2,000 samples,
  read before any work that a download could overlap. ``--sleep-ms MS`` replaces the decode by
  a sleep (wall time without CPU, as a GPU-bound step would take).
- ``global``: shard order (1000-sample buffer) vs ``shuffle="global"``, from local disk and
  from http with the cache (warm), epochs alternating; medians.
- ``checks`` (issue 35): the cost of the checks added to a cache hit (an ``O_NOFOLLOW|
  O_NONBLOCK`` open, owner/links/size checks, the record in ``.locks/KEY``, mtime through the
  descriptor) and to opening a local shard (regular files only), against copies of the paths
  before them (79c5d7b: the cache name made per open, a plain open, ``flock``, ``stat``,
  ``utime`` of the path; a plain ``open``); and
  of HTTP streaming with the header deadline and the minimum rate (one socket read at a time)
  against ``urllib``'s plain opener and ``HTTPResponse.readinto``. All in the main process,
  variants alternating per round, rates per CPU-second of the main process
  (``time.process_time``: other processes' load moves wall-clock rates by more than the effect
  measured). Hits; global-shuffle reads from the warm cache with one pinned shard
  (``OPEN_SHARDS = 1``: a shard open for almost every sample, the worst case), with the decode
  and without it (raw bytes); streaming the shards over ``python -m http.server``.
- ``lru``: the cache's hit rate with a budget below the dataset's size: measured (server
  requests per epoch, small shards, 2 workers) and simulated (one reader, LRU, the epoch's
  shuffled shard order) for budgets of 20-80% of the shards.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [REPO, HERE, os.path.join(REPO, "tests")]

from bench_remote import start_server  # noqa: E402
from bench_wds import (Sample, make_augment, resolve_shards, run_epoch,  # noqa: E402
                       time_epochs)

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.shards.index import INDEX_SUFFIX, write_index  # noqa: E402
from pooled_loader.webdataset import WebDataset, count_samples  # noqa: E402

THROTTLED_SERVER = """
import sys, time
sys.path.insert(0, {tests!r})
from http_shards import ShardServer
srv = ShardServer({root!r}, rate={rate}).__enter__()
print(srv.base, flush=True)
time.sleep(10**6)
"""


def throttled_server(root: str, rate: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", THROTTLED_SERVER.format(
        tests=os.path.join(REPO, "tests"), root=root, rate=rate)], stdout=subprocess.PIPE,
        text=True)
    return proc, proc.stdout.readline().strip()


def loader(ds, args):
    return PooledLoader(ds, batch_size=args.batch, num_workers=args.workers,
                        persistent_workers=True)


def table(rates: dict[str, list[float]], ref: str, per_cpu: dict | None = None) -> None:
    """Medians, and the median of the per-round ratios to ``ref`` (each epoch or round against
    the reference's in the same round: robust to the machine's load drifting during a run)."""
    def paired(r: list[float], base: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(r, base))

    cpu = bool(per_cpu and all(per_cpu.get(name) for name in rates))
    print(f"| variant | median images/s | epochs (images/s) | vs {ref} (paired) |"
          + (" median images per CPU-second | vs ref (paired) |" if cpu else ""))
    print("| --- | ---: | --- | ---: |" + (" ---: | ---: |" if cpu else ""))
    for name, r in rates.items():
        row = (f"| {name} | {statistics.median(r):.1f} | {', '.join(f'{x:.0f}' for x in r)} | "
               f"{paired(r, rates[ref]):.2f}x |")
        if cpu:
            row += (f" {statistics.median(per_cpu[name]):.0f} | "
                    f"{paired(per_cpu[name], per_cpu[ref]):.2f}x |")
        print(row)


def time_variants(shards, total, augment, args, variants) -> tuple[dict, dict]:
    """Epochs 2.. of WebDatasets over local disk or ``python -m http.server``: ``variants`` are
    (name, remote?, WebDataset keywords); persistent loaders, epochs alternating."""
    proc, base = start_server(os.path.dirname(shards[0]))
    built = {}
    try:
        urls = [f"{base}/{os.path.basename(s)}" for s in shards]
        for name, remote, kw in variants:
            ds = WebDataset(urls if remote else shards, transform=Sample(augment), seed=0, **kw)
            built[name] = (loader(ds, args), ds)
        return time_epochs(built, total, 1, args.epochs, alternate=True)
    finally:
        for ld, _ in built.values():
            ld.close()
        proc.kill()
        proc.wait()


def part_cache(shards, total, augment, args, tmp) -> None:
    rates, per_cpu = time_variants(shards, total, augment, args, [
        ("local disk", False, {"shuffle_buffer": 1000}),
        ("http + cache", True, {"shuffle_buffer": 1000, "cache_dir": os.path.join(tmp, "c1")})])
    print(f"\n## cache: epochs 2..{args.epochs + 1} (the cache is filled while counting, before "
          "epoch 1)")
    table(rates, "local disk", per_cpu)


class SleepSample:
    """Per-sample work that takes wall time but no CPU (as a GPU-bound step would): sleep, then
    a blank uint8 [3, 224, 224] image, so the loader's own pipeline is unchanged."""

    def __init__(self, ms: float) -> None:
        self.s = ms / 1000
        self.name = f"sleep {ms} ms per sample"

    def __call__(self, sample: dict):
        time.sleep(self.s)
        return np.zeros((3, 224, 224), np.uint8), int(sample["cls"])


PREFETCH_BUFFER = 100  # a 1000-sample buffer is a worker's whole share of 2,000: read up front


def part_prefetch(shards, total, augment, args, tmp) -> None:
    work = Sample(augment) if args.sleep_ms is None else SleepSample(args.sleep_ms)
    proc, base = throttled_server(os.path.dirname(shards[0]), args.rate_mb * 1e6)
    variants = {"http, prefetch_shards=0": 0, "http, prefetch_shards=2": 2, "local disk": None}
    secs: dict[str, list[float]] = {name: [] for name in variants}
    try:
        urls = [f"{base}/{os.path.basename(s)}" for s in shards]
        for r in range(args.rounds):
            for name in (list(secs) if r % 2 == 0 else list(secs)[::-1]):
                cache = os.path.join(tmp, f"p-{r}-{variants[name]}")
                remote = {} if variants[name] is None else {
                    "cache_dir": cache, "prefetch_shards": variants[name]}
                ds = WebDataset(shards if variants[name] is None else urls, transform=work,
                                shuffle_buffer=PREFETCH_BUFFER, seed=r, samples_per_epoch=total,
                                **remote)
                ld = PooledLoader(ds, batch_size=args.batch, num_workers=args.workers)
                n, dt, _ = run_epoch(ld, ds, 0)  # (CPU time: its workers are gone by then)
                ld.close()
                assert n == total, n
                secs[name].append(n / dt)
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        proc.kill()
        proc.wait()
    mb = sum(os.path.getsize(s) for s in shards) / 1e6
    print(f"\n## prefetch: first epoch, empty cache, server throttled to {args.rate_mb} MB/s "
          f"({mb:.0f} MB of shards: {mb / args.rate_mb:.1f} s of transfer at full rate), "
          f"{args.rounds} rounds, {PREFETCH_BUFFER}-sample shuffle buffer, work: "
          f"{'decode + crop' if args.sleep_ms is None else work.name}")
    table(secs, "http, prefetch_shards=0")


def part_global(shards, total, augment, args, tmp) -> None:
    cache = os.path.join(tmp, "g")
    rates, per_cpu = time_variants(shards, total, augment, args, [
        ("local, shard order + buffer", False, {"shuffle_buffer": 1000}),
        ("local, global", False, {"shuffle": "global"}),
        ("http + cache, shard order + buffer", True,
         {"shuffle_buffer": 1000, "cache_dir": cache}),
        ("http + cache, global", True, {"shuffle": "global", "cache_dir": cache})])
    print(f"\n## global shuffle vs shard order, epochs 2..{args.epochs + 1}")
    table(rates, "local, shard order + buffer", per_cpu)


def simulate_lru(nshards: int, capacity: int, epochs: int, seed: int = 0) -> list[float]:
    """Hit rate per epoch of one reader reading all shards in a new random order each epoch
    through an LRU cache of ``capacity`` shards."""
    cache: collections.OrderedDict = collections.OrderedDict()
    out = []
    for e in range(epochs):
        order = list(range(nshards))
        random.Random(seed + e).shuffle(order)
        hits = 0
        for s in order:
            if s in cache:
                hits += 1
                cache.move_to_end(s)
            else:
                cache[s] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
        out.append(hits / nshards)
    return out


def part_lru(args, tmp) -> None:
    from http_shards import ShardServer
    from test_webdataset import make_shards, sample_id
    root = os.path.join(tmp, "small")
    nshards, epochs = 40, 6
    paths = make_shards(root, [25] * nshards)
    size = os.path.getsize(paths[0])
    print(f"\n## LRU hit rate with a budget below the dataset ({nshards} shards, epochs 2.."
          f"{epochs}; measured: {args.workers} workers, server requests; simulated: one reader, "
          "mean of 20 seeds)")
    print("| budget (share of the shards) | measured hit rate per epoch | measured mean "
          "| simulated mean | same order every epoch (simulated) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for frac in (0.2, 0.4, 0.6, 0.8):
        with ShardServer(root) as srv:
            urls = [srv.url(os.path.basename(p)) for p in paths]
            ds = WebDataset(urls, transform=sample_id, cache_dir=os.path.join(tmp, f"l{frac}"),
                            cache_limit=int(frac * nshards * size), samples_per_epoch=25 * nshards)
            hits = []
            for e in range(epochs):
                srv.clear()
                ds.set_epoch(e)
                ids = [i for b in PooledLoader(ds, batch_size=25, num_workers=args.workers)
                       for i in b.tolist()]
                assert sorted(ids) == list(range(25 * nshards))
                srv.settle()
                if e:
                    hits.append(1 - sum(srv.requests.values()) / nshards)
        cap = int(frac * nshards)
        sim = statistics.mean(statistics.mean(simulate_lru(nshards, cap, epochs, s)[1:])
                              for s in range(20))
        same = _same_order_hits(nshards, cap, epochs)
        print(f"| {frac:.0%} | {', '.join(f'{h:.2f}' for h in hits)} | "
              f"{statistics.mean(hits):.2f} | {sim:.2f} | {same:.2f} |")


def _same_order_hits(nshards: int, capacity: int, epochs: int) -> float:
    cache: collections.OrderedDict = collections.OrderedDict()
    hits = reads = 0
    for e in range(epochs):
        for s in range(nshards):
            if e:
                reads += 1
            if s in cache:
                hits += e > 0
                cache.move_to_end(s)
            else:
                cache[s] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / reads


def _old_open(self, url, *, size=None, sha256=None, wait=True):
    """``ShardCache.open`` before issue 35 (79c5d7b), its hit path copied: the cache name made
    from the URL on every open, then ``_old_pin``; a miss goes the current way."""
    from pooled_loader.shards.cache import cache_key
    shard = _old_pin(self, url, os.path.join(self.dir, cache_key(url)), size)
    if shard is not None:
        self.stats["hits"] += 1
        return shard
    return _NEW_OPEN(self, url, size=size, sha256=sha256, wait=wait)


def _old_pin(self, url, path, size):
    """The cache-hit path before issue 35 (79c5d7b's ``_pin``, for ``checks``): no link, FIFO,
    owner or record check, mtime set through the path."""
    import fcntl

    from pooled_loader.shards.cache import CachedShard
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        st = os.fstat(fd)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
            break
        os.close(fd)
    if size is not None and st.st_size != size:
        os.close(fd)
        return None
    t = time.time_ns()
    os.utime(path, ns=(t, t))
    return CachedShard(url, path, fd)


def _old_open_local(path, offset, timeout, end=None):
    """A local shard opened as before issue 35 (for ``checks``): plain ``open``, no fstat check
    of its kind."""
    from pooled_loader.shards.remote import _Opened
    f = open(path, "rb")  # noqa: SIM115 - closed by the stream
    f.seek(offset)
    return _Opened(f, os.fstat(f.fileno()).st_size)


class _ReadintoBody:
    """The HTTP body as read before issue 35 (for ``checks``): ``HTTPResponse.readinto``."""

    def __init__(self, resp) -> None:
        self.readinto = resp.readinto


_NEW_OPEN = None  # ShardCache.open as this branch has it (set by part_checks)


def _alternate(variants: dict, rounds: int) -> dict[str, list[float]]:
    """{name: [rate per round]}: each round runs every variant once, the order alternating."""
    rates: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            rates[name].append(variants[name]())
    return rates


def part_checks(shards, total, augment, args, tmp) -> None:
    from pooled_loader.shards import global_shuffle, remote
    from pooled_loader.shards.cache import ShardCache
    global _NEW_OPEN
    proc, base = start_server(os.path.dirname(shards[0]))
    new_open, new_body, new_local = ShardCache.open, remote._Body, remote._open_local
    _NEW_OPEN = new_open
    new_opener = remote._opener_with_deadline
    try:
        urls = [f"{base}/{os.path.basename(s)}" for s in shards]
        folder = os.path.join(tmp, "checks")
        cache = ShardCache(folder)
        for u in urls:
            cache.open(u).close()

        def with_pin(opener, fn):
            """``fn`` run with the hit path ``opener`` (and, for the old one, the old local
            open)."""
            def run():
                ShardCache.open = opener
                remote._open_local = new_local if opener is new_open else _old_open_local
                try:
                    return fn()
                finally:
                    ShardCache.open, remote._open_local = new_open, new_local
            return run

        def hits(n=3000):
            t = time.process_time()
            for i in range(n):
                cache.open(urls[i % len(urls)]).close()
            return n / (time.process_time() - t)

        print("\n## checks: cache hits per CPU-second (in-process)")
        table(_alternate({"before (plain open)": with_pin(_old_open, hits),
                          "checked (issue 35)": with_pin(new_open, hits)}, args.rounds * 3),
              "before (plain open)")

        global_shuffle.OPEN_SHARDS = 1
        for label, transform in (("decode + crop", Sample(augment)), ("raw bytes", None)):
            ds = WebDataset(urls, transform=transform, shuffle="global", cache_dir=folder,
                            index=True, seed=0)

            def epoch(ds=ds):
                t = time.process_time()
                n = sum(1 for _ in ds)
                return n / (time.process_time() - t)

            print(f"\n## checks: global shuffle from the warm cache, one pinned shard, "
                  f"{label} (samples per CPU-second, in-process)")
            table(_alternate({"before (plain open)": with_pin(_old_open, epoch),
                              "checked (issue 35)": with_pin(new_open, epoch)}, args.rounds),
                  "before (plain open)")

        plain = urllib.request.build_opener()  # what urlopen used before issue 35

        def stream(body, opener):
            def run():
                remote._Body, remote._opener_with_deadline = body, opener
                try:
                    t, n = time.process_time(), 0
                    for u in urls:
                        with remote.open_shard(u) as f:
                            while chunk := f.read(1 << 20):
                                n += len(chunk)
                    return n / 1e6 / (time.process_time() - t)
                finally:
                    remote._Body, remote._opener_with_deadline = new_body, new_opener
            return run

        print("\n## checks: streaming every shard over http (MB per CPU-second of the reader)")
        table(_alternate({"readinto (before)": stream(_ReadintoBody, lambda: plain),
                          "readinto1 + deadline + rate (issue 35)": stream(new_body, new_opener)},
                         args.rounds * 2),
              "readinto (before)")
    finally:
        ShardCache.open, remote._Body, remote._open_local = new_open, new_body, new_local
        remote._opener_with_deadline = new_opener
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--part", default="cache,prefetch,global,lru")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate-mb", type=float, default=50.0)
    p.add_argument("--sleep-ms", type=float, default=None,
                   help="prefetch part: per-sample work is a sleep of this long instead of "
                        "decoding (a consumer this machine's CPUs do not limit)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--make", type=int, default=2000)
    args = p.parse_args(argv)
    parts = args.part.split(",")

    shards = resolve_shards(args.data, args.per_shard, args.make)
    for s in shards:
        if not os.path.exists(s + INDEX_SUFFIX):
            write_index(s)
    total = sum(count_samples(s) for s in shards)
    augment = make_augment()
    mb = sum(os.path.getsize(s) for s in shards) / 1e6
    print(f"# {total} JPEGs in {len(shards)} shards ({mb:.0f} MB), {augment.name}, "
          f"RandomResizedCrop 224 + flip, batch {args.batch}, {args.workers} workers; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start")
    tmp = tempfile.mkdtemp(prefix="bench_shard_cache-")
    try:
        t0 = time.monotonic()
        for name in parts:
            if name == "lru":
                part_lru(args, tmp)
            else:
                {"cache": part_cache, "prefetch": part_prefetch, "global": part_global,
                 "checks": part_checks}[name](
                    shards, total, augment, args, tmp)
        print(f"\n# {time.monotonic() - t0:.0f} s; load average "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
