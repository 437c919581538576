#!/usr/bin/env python
"""The same JPEG tar shards through PooledLoader + pooled_loader.webdataset.WebDataset and through
webdataset.WebLoader (plus torch's DataLoader over our WebDataset, to separate loader from reader).

    python scripts/benchmarks/bench_wds.py --data DIR [--epochs 3] [--warmup 1] [--batch 256] [--workers 2]

DIR is a folder of WebDataset ``.tar`` shards, or an ImageFolder (written once as shards of
``--per-shard`` samples into ``DIR.shards/`` with ``pooled_loader.shards``), or a path that does
not exist yet: an ImageFolder of ``--make`` JPEGs is made there (``scripts/tools/make_dataset.py``).

Every loader runs the same per-sample work in its 2 worker processes: decode the JPEG,
RandomResizedCrop 224 (scale 0.08-1, ratio 3/4-4/3) + random horizontal flip, uint8 CHW, with
``pooled_loader.vision`` ops when present (else simplejpeg + OpenCV) -- or, with ``--work none``,
only a zero image per sample, to see the loaders' own cost -- shard shuffle + a 1000-sample
shuffle buffer, batches of 256 formed in the workers (the last of each worker partial).
Workers are persistent, so epochs exclude worker start-up; one untimed warm-up epoch each.
The loaders are run interleaved (A B C A B C ...) so that load from other processes on a shared
machine falls on all of them alike; the table gives the median images/s over the timed epochs and
(with psutil) the median images per CPU-second of the main process and its workers together,
which other processes' load disturbs much less than wall-clock rates.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from pooled_loader.shards import write_shards  # noqa: E402
from pooled_loader.webdataset import WebDataset, count_samples, expand_shards  # noqa: E402

SIZE = 224


# -- the per-sample work, identical for every loader ------------------------------------------
class _CvAugment:
    """simplejpeg decode + torchvision-style RandomResizedCrop params + cv2.resize + flip + CHW."""

    name = "simplejpeg + cv2"

    def __call__(self, data: bytes) -> np.ndarray:
        import cv2
        import simplejpeg

        img = simplejpeg.decode_jpeg(data, colorspace="RGB")
        h, w = img.shape[:2]
        x0, y0, cw, ch = 0, 0, w, h
        for _ in range(10):
            area = h * w * random.uniform(0.08, 1.0)
            ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
            tw, th = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
            if 0 < tw <= w and 0 < th <= h:
                x0, y0, cw, ch = random.randint(0, w - tw), random.randint(0, h - th), tw, th
                break
        out = cv2.resize(img[y0:y0 + ch, x0:x0 + cw], (SIZE, SIZE), interpolation=cv2.INTER_AREA)
        if random.random() < 0.5:
            out = out[:, ::-1]
        return np.ascontiguousarray(out.transpose(2, 0, 1))


class _NoWork:
    """``--work none``: a zero image per sample (the shard is still read): the loaders' own cost."""

    name = "no decode (zero image per sample)"

    def __call__(self, data: bytes) -> np.ndarray:
        return np.zeros((3, SIZE, SIZE), np.uint8)


def make_augment() -> Callable[[bytes], np.ndarray]:
    try:
        from pooled_loader.vision import (Compose, DecodeImage, RandomHorizontalFlip,
                                          RandomResizedCrop, ToCHW)
    except ImportError:
        return _CvAugment()
    aug = Compose([DecodeImage(), RandomResizedCrop(SIZE), RandomHorizontalFlip(), ToCHW()])
    aug.name = "pooled_loader.vision Compose"
    return aug


class Sample:
    """WebDataset sample dict -> (uint8 [3, 224, 224], label); torch tensors if ``as_tensor``."""

    def __init__(self, augment: Callable, as_tensor: bool = False) -> None:
        self.augment, self.as_tensor = augment, as_tensor

    def __call__(self, sample: dict) -> tuple[Any, int]:
        img = self.augment(sample["jpg"])
        return (torch.from_numpy(img) if self.as_tensor else img), int(sample["cls"])


# -- the data -----------------------------------------------------------------------------------
def _make_jpegs(root: str, n: int) -> None:
    """Fallback when scripts/tools/make_dataset.py is absent: smooth random-colour JPEGs, 10 classes."""
    import cv2

    rng = np.random.default_rng(0)
    for i in range(n):
        h, w = rng.integers(256, 513, size=2)
        small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        img = cv2.resize(small, (int(w), int(h)), interpolation=cv2.INTER_CUBIC)
        img = cv2.add(img, rng.integers(0, 24, img.shape, dtype=np.uint8))
        d = os.path.join(root, f"class_{i % 10:03d}")
        os.makedirs(d, exist_ok=True)
        cv2.imwrite(os.path.join(d, f"img_{i:05d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])


def resolve_shards(data: str, per_shard: int, make: int) -> list[str]:
    if not os.path.exists(data):
        try:
            sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))
            from make_dataset import make_dataset
            make_dataset(data, n=make)
        except ImportError:
            _make_jpegs(data, make)
    if any(f.endswith(".tar") for f in os.listdir(data)):
        return expand_shards(data)
    out = data.rstrip("/") + ".shards"
    done = os.path.join(out, "DONE")
    if not os.path.exists(done):
        write_shards(data, os.path.join(out, "shard-%06d.tar"), per_shard)
        with open(done, "w") as f:
            f.write("ok\n")
    return expand_shards(out)


# -- the loaders --------------------------------------------------------------------------------
def pooled(shards, augment, batch, workers):
    from pooled_loader import PooledLoader
    ds = WebDataset(shards, transform=Sample(augment), shuffle_buffer=1000, seed=0)
    return PooledLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True), ds


def dataloader(shards, augment, batch, workers):
    ds = WebDataset(shards, transform=Sample(augment, as_tensor=True), shuffle_buffer=1000, seed=0)
    return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers,
                                       persistent_workers=True), ds


def webloader(shards, augment, batch, workers):
    import webdataset as wds
    ds = (wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False, seed=0)
          .shuffle(1000)
          .map(Sample(augment, as_tensor=True))
          .batched(batch, collation_fn=torch.utils.data.default_collate, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True), None


class _PilSample:
    """webdataset's usual recipe: ``.decode("pil")`` then a PIL RandomResizedCrop + flip
    (scripts/benchmarks/peers.py's torchvision-equivalent), uint8 CHW tensor."""

    def __call__(self, sample: dict) -> tuple[Any, int]:
        import peers
        return peers.pil_augment(sample["jpg"]), int(sample["cls"])


def webloader_pil(shards, augment, batch, workers):
    import webdataset as wds
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ds = (wds.WebDataset(shards, shardshuffle=len(shards), empty_check=False, seed=0)
          .shuffle(1000)
          .decode("pil")
          .map(_PilSample())
          .batched(batch, collation_fn=torch.utils.data.default_collate, partial=True))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True), None


LOADERS = {
    "PooledLoader + pl WebDataset": pooled,
    "webdataset.WebLoader": webloader,
    "torch DataLoader + pl WebDataset": dataloader,
    "webdataset.WebLoader, PIL decode (its usual recipe)": webloader_pil,
}


def cpu_seconds() -> float | None:
    """User + system CPU seconds of this process and all its descendants (the loaders' workers,
    which are persistent, so none exits between two readings); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for proc in [me] + me.children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def run_epoch(loader, dataset, epoch: int) -> tuple[int, float, float | None]:
    """(images, wall seconds, CPU seconds of main + workers) of one epoch."""
    if dataset is not None:
        dataset.set_epoch(epoch)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    n, c0, t0 = 0, cpu_seconds(), time.perf_counter()
    for images, labels in loader:
        assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == (3, SIZE, SIZE)
        n += images.shape[0]
    dt, c1 = time.perf_counter() - t0, cpu_seconds()
    return n, dt, (c1 - c0 if c0 is not None and c1 is not None else None)


def time_epochs(built: dict, total: int, warmup: int, epochs: int,
                alternate: bool = False) -> tuple[dict, dict]:
    """Epochs of every loader in turn (so all see the same machine load): images/s and images
    per CPU-second of each timed epoch, by loader name; every epoch must give `total` images.
    ``alternate``: the order of the loaders reverses every epoch (none always goes first)."""
    rates: dict[str, list[float]] = {name: [] for name in built}
    per_cpu: dict[str, list[float]] = {name: [] for name in built}
    for epoch in range(warmup + epochs):
        items = list(built.items())
        for name, (loader, ds) in (items[::-1] if alternate and epoch % 2 else items):
            n, dt, cpu = run_epoch(loader, ds, epoch)
            if n != total:
                raise RuntimeError(f"{name}: epoch {epoch} gave {n} images, expected {total}")
            if epoch >= warmup:
                rates[name].append(n / dt)
                if cpu:
                    per_cpu[name].append(n / cpu)
    return rates, per_cpu

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="shard folder, ImageFolder, or where to make one")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (>= 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-shard", type=int, default=250, help="when sharding an ImageFolder")
    p.add_argument("--make", type=int, default=2000, help="JPEGs to make if --data is absent")
    p.add_argument("--work", choices=["decode", "none"], default="decode",
                   help="per-sample work: decode+crop+flip (default) or none (loader cost only)")
    args = p.parse_args(argv)
    if args.epochs < 3:
        p.error("--epochs must be >= 3 (the median of at least 3 epochs is reported)")

    shards = resolve_shards(args.data, args.per_shard, args.make)
    total = sum(count_samples(s) for s in shards)
    augment = make_augment() if args.work == "decode" else _NoWork()
    built = {name: make(shards, augment, args.batch, args.workers)
             for name, make in LOADERS.items() if args.work == "decode" or "PIL" not in name}
    rates, per_cpu = time_epochs(built, total, args.warmup, args.epochs)
    for loader, _ in built.values():
        del loader
    built.clear()

    ref = statistics.median(rates["webdataset.WebLoader"])
    work = f"{augment.name}, RandomResizedCrop {SIZE} + flip" if args.work == "decode" \
        else augment.name
    print(f"# {total} JPEGs in {len(shards)} shards ({shards[0]} ..), {work}, uint8 CHW, "
          f"batch {args.batch}, "
          f"{args.workers} workers, {args.epochs} timed epochs after {args.warmup} warm-up")
    print(f"# {os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
          f" at the end (shared machine: compare within a run)")
    cpu_ref = statistics.median(per_cpu["webdataset.WebLoader"] or [math.nan])
    print("| loader | median images/s | epochs (images/s) | vs WebLoader "
          "| images per CPU-second (main + workers) | vs WebLoader |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name, r in rates.items():
        med = statistics.median(r)
        pc = statistics.median(per_cpu[name] or [math.nan])
        print(f"| {name} | {med:.0f} | {', '.join(f'{x:.0f}' for x in r)} | {med / ref:.2f}x "
              f"| {pc:.0f} | {pc / cpu_ref:.2f}x |")
    pil = [r for name, r in rates.items() if "PIL" in name]
    if pil:
        ours = statistics.median(rates["PooledLoader + pl WebDataset"])
        print(f"PooledLoader + pl WebDataset / WebLoader with PIL decode: "
              f"{ours / statistics.median(pil[0]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
