#!/usr/bin/env python
"""The image pipeline over the same tar shards read from local disk and from a localhost HTTP
server: how much of local throughput remote streaming (pooled_loader.shards.remote) keeps.

    python scripts/benchmarks/bench_remote.py --data DIR [--epochs 3] [--warmup 1] [--batch 256] [--workers 2]

DIR as for scripts/benchmarks/bench_wds.py (shard folder, ImageFolder, or where to make one). The server is
the standard library's (``python -m http.server``, one thread per connection) in a subprocess on
127.0.0.1, so its CPU time is taken from the same cores as the loader's: a stricter test than a
remote object store. Both loaders are PooledLoader + pooled_loader.webdataset.WebDataset with
the same decode + RandomResizedCrop 224 + flip (bench_wds's per-sample work), shard shuffle and
a 1000-sample shuffle buffer, persistent workers, run interleaved (local, http, local, ...).
With psutil, images per CPU-second count the main process and all its descendants, the server
included (it idles during the local epochs), which other processes' load disturbs much less than
wall-clock rates.
``--cut BYTES`` serves through tests/http_shards.py instead, cutting every response after that
many bytes (so each shard is read through many Range-resumed connections).
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from bench_wds import Sample, make_augment, resolve_shards, time_epochs  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.webdataset import WebDataset, count_samples  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                             "--directory", root, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(base + "/", timeout=1).close()
            return proc, base
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the local HTTP server did not start")


def build(urls: list[str], augment, batch: int, workers: int):
    ds = WebDataset(urls, transform=Sample(augment), shuffle_buffer=1000, seed=0)
    return PooledLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True), ds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-shard", type=int, default=250)
    p.add_argument("--make", type=int, default=2000)
    p.add_argument("--cut", type=int, default=None,
                   help="serve with tests/http_shards.py, cutting every response after BYTES")
    args = p.parse_args(argv)
    if args.epochs < 3:
        p.error("--epochs must be >= 3 (the median of at least 3 epochs is reported)")

    shards = resolve_shards(args.data, args.per_shard, args.make)
    root = os.path.dirname(shards[0])
    total = sum(count_samples(s) for s in shards)
    augment = make_augment()
    server = None
    if args.cut:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from http_shards import ShardServer
        server = ShardServer(root, cut_after=args.cut).__enter__()
        base, proc = server.base, None
    else:
        proc, base = start_server(root)
    try:
        urls = {"local disk": shards,
                "http://127.0.0.1": [f"{base}/{os.path.basename(s)}" for s in shards]}
        built = {name: build(u, augment, args.batch, args.workers) for name, u in urls.items()}
        rates, per_cpu = time_epochs(built, total, args.warmup, args.epochs)
        for loader, _ in built.values():
            loader.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        if server is not None:
            server.__exit__(None, None, None)

    served = f"tests/http_shards.py cutting every response after {args.cut} bytes" if args.cut \
        else "python -m http.server"
    print(f"# {total} JPEGs in {len(shards)} shards, {augment.name}, RandomResizedCrop 224 + "
          f"flip, batch {args.batch}, {args.workers} workers, {args.epochs} timed epochs after "
          f"{args.warmup} warm-up; server: {served} on the same machine")
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
          " at the end (shared machine: compare within a run)")
    local = statistics.median(rates["local disk"])
    local_cpu = statistics.median(per_cpu["local disk"] or [math.nan])
    print("| shards read from | median images/s | epochs (images/s) | vs local disk "
          "| images per CPU-second (loader + server) | vs local disk |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, r in rates.items():
        med = statistics.median(r)
        pc = statistics.median(per_cpu[name] or [math.nan])
        print(f"| {name} | {med:.0f} | {', '.join(f'{x:.0f}' for x in r)} | {med / local:.2f}x "
              f"| {pc:.0f} | {pc / local_cpu:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
