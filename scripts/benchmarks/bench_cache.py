#!/usr/bin/env python
"""Cached samples vs our JPEG path: PooledLoader images/s over the same images, in one run.

    python scripts/benchmarks/bench_cache.py --data DIR [--cache FILE] [--max-side 512] [--epochs 3]
                                  [--warmup 1] [--batch 256] [--workers 2] [--json OUT]

- jpeg:   ImageFolder(DIR, Compose([DecodeImage(), RandomResizedCrop(224),
          RandomHorizontalFlip(), ToCHW()]))
- cached: CachedDataset(FILE, Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()]))
          over build_cache(ImageFolder(DIR, Compose([DecodeImage(), Resize(max_side=512)])))

Both run under PooledLoader (batch 256, shuffle, persistent workers, uint8 CHW). Their epochs are
interleaved (jpeg, cached, jpeg, cached, ...) so drift in machine load hits both alike; each
figure is the median images/s of the timed epochs, and the ratio is cached / jpeg. The cache is
built once (time and size reported) and reused by later runs; the first (warm-up) epochs also
bring the cache file into the page cache. If DIR does not exist it is made with
scripts/tools/make_dataset.py (--n images).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.cache import CachedDataset, build_cache  # noqa: E402
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder,  # noqa: E402
                                  RandomHorizontalFlip, RandomResizedCrop, Resize, ToCHW)


def epoch(loader) -> tuple[float, int]:
    """(seconds, images) of one pass over ``loader``."""
    t0, n = time.perf_counter(), 0
    for imgs, _ in loader:
        n += imgs.shape[0]
    return time.perf_counter() - t0, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="ImageFolder root (made if missing)")
    p.add_argument("--n", type=int, default=2000, help="images to make if --data is missing")
    p.add_argument("--cache", default=None, help="cache file (default bench_out/NAME_maxN.plc)")
    p.add_argument("--max-side", type=int, default=512)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--build-workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (>= 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args(argv)

    if not os.path.isdir(a.data):
        sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))
        from make_dataset import make_dataset
        print(f"making {a.n} images in {a.data}")
        make_dataset(a.data, n=a.n)
    cache = a.cache or os.path.join(
        "bench_out", f"{os.path.basename(os.path.normpath(a.data))}_max{a.max_side}.plc")
    os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)

    front = ImageFolder(a.data, transform=Compose([DecodeImage(), Resize(max_side=a.max_side)]))
    existed = os.path.exists(cache)
    t0 = time.perf_counter()
    build_cache(front, cache, num_workers=a.build_workers)
    build_s = time.perf_counter() - t0
    size_mb = os.path.getsize(cache) / 2**20
    print(f"cache {cache}: {size_mb:.0f} MiB, "
          + ("reused" if existed else f"built in {build_s:.1f} s ({len(front) / build_s:.0f}/s)"))

    tail = [RandomResizedCrop(a.size), RandomHorizontalFlip(), ToCHW()]
    datasets = {
        "jpeg": ImageFolder(a.data, transform=Compose([DecodeImage(), *tail])),
        "cached": CachedDataset(cache, transform=Compose(tail), expect_fingerprint_of=front),
    }
    loaders = {k: PooledLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                               persistent_workers=True) for k, ds in datasets.items()}
    rates: dict[str, list[float]] = {k: [] for k in loaders}
    for e in range(a.warmup + a.epochs):
        for name, loader in loaders.items():
            loader.set_epoch(e)
            s, n = epoch(loader)
            tag = "warm-up" if e < a.warmup else "timed"
            print(f"epoch {e} {name:6s} {n / s:7.0f} images/s ({tag}, load {os.getloadavg()[0]:.1f})")
            if e >= a.warmup:
                rates[name].append(n / s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["cached"] / med["jpeg"]
    print(f"\nmedian of {a.epochs} epochs, batch {a.batch}, {a.workers} workers, "
          f"{len(front)} images:")
    print(f"  jpeg   (decode + RRC {a.size} + flip + CHW)       {med['jpeg']:7.0f} images/s")
    print(f"  cached (max side {a.max_side}, RRC {a.size} + flip + CHW) {med['cached']:7.0f} images/s")
    print(f"  ratio cached / jpeg: {ratio:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"images": len(front), "cache_mib": size_mb,
                       "build_s": None if existed else build_s, "rates": rates, "median": med,
                       "ratio": ratio, "batch": a.batch, "workers": a.workers,
                       "max_side": a.max_side}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
