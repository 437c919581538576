#!/usr/bin/env python
"""Detection (issue 38): the same v2 detection pipeline through DataLoader and PooledLoader.

    python scripts/benchmarks/bench_detection.py [--rounds 3] [--images 96] [--workers 2]

A COCO folder written here: `--images` JPEGs (quality 90) of 640-800 x 480-640 px, 2-12 boxes
each with polygon masks. Pipeline: RandomIoUCrop -> Resize((640, 640)) -> RandomHorizontalFlip
-> SanitizeBoundingBoxes, batch 16, uint8 CHW images:

- dataloader: torchvision's CocoDetection wrapped with wrap_dataset_for_transforms_v2, a v2
  Compose (ToImage first), DataLoader(collate_fn=tuple(zip(*batch))), the torchvision recipe;
- routed: that same dataset object and collate_fn, unchanged, through PooledLoader (it routes the
  pipeline to the fused detection path itself and yields torchvision's types);
- pooled: pooled_loader.vision.coco.CocoDetection + DetectionCompose of the same ops (the
  image decoded by libjpeg-turbo, crop+resize+flip+CHW one kernel call), PooledLoader with
  detection_collate() (images stacked, targets per image as views of the slot).

Two settings: images + boxes, and images + boxes + instance masks (target_keys with "masks").
Every loader uses `--workers` persistent workers; per round and loader, one timed epoch after a
warm-up epoch; the order rotates between rounds; printed: images/s, the median of the per-round
ratios to DataLoader, the CPU time per sample of the whole process tree (main process and
workers, through psutil, in the peers extra) during the timed epochs, the load average, and
PASS/MISS against the issue's goals (>= 2.5x DataLoader on images + boxes, >= 2x with masks;
the routed loader is held to the same goals). The machine is shared: compare ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

BATCH = 16


def write_coco(root: str, n: int) -> tuple[str, str]:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    img_dir = os.path.join(root, "img")
    os.makedirs(img_dir)
    images, anns = [], []
    for i in range(n):
        w, h = int(rng.integers(640, 801)), int(rng.integers(480, 641))
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        pic = np.stack([127 + 100 * np.sin(x / (20 + 7 * c) + y / 31 + i) for c in range(3)], -1)
        pic += rng.normal(0, 12, pic.shape)  # some texture, so that JPEG has work to do
        buf = io.BytesIO()
        Image.fromarray(pic.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
        with open(os.path.join(img_dir, f"{i}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        images.append({"id": i, "file_name": f"{i}.jpg", "height": h, "width": w})
        for k in range(int(rng.integers(2, 13))):
            bw, bh = rng.uniform(20, w / 2), rng.uniform(20, h / 2)
            x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            poly = [x0, y0, x0 + bw, y0, x0 + bw / 2, y0 + bh]
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": k + 1,
                         "iscrowd": 0, "bbox": [x0, y0, bw, bh], "area": bw * bh / 2,
                         "segmentation": [poly]})
    ann = os.path.join(root, "ann.json")
    with open(ann, "w") as f:
        json.dump({"images": images, "annotations": anns, "categories": []}, f)
    return img_dir, ann


def zip_collate(batch):
    return tuple(zip(*batch))


def dataloader(img_dir: str, ann: str, keys: set, workers: int):
    import torch
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import v2
    t = v2.Compose([v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((640, 640)),
                    v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes()])
    ds = wrap_dataset_for_transforms_v2(CocoDetection(img_dir, ann, transforms=t),
                                        target_keys=keys)
    return torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                                       persistent_workers=True, collate_fn=zip_collate)


def pooled(img_dir: str, ann: str, keys: set, workers: int):
    from pooled_loader import PooledLoader
    from pooled_loader.vision import DecodeImage, RandomHorizontalFlip, Resize, ToCHW
    from pooled_loader.vision.coco import CocoDetection
    from pooled_loader.vision.detection import (DetectionCompose, RandomIoUCrop,
                                                SanitizeBoundingBoxes)
    from pooled_loader.vision.detection_batch import detection_collate
    t = DetectionCompose([DecodeImage(), RandomIoUCrop(), Resize((640, 640)),
                          RandomHorizontalFlip(), ToCHW(), SanitizeBoundingBoxes()])
    ds = CocoDetection(img_dir, ann, transform=t,
                       target_keys=tuple(k for k in ("image_id", "boxes", "labels", "masks")
                                         if k in keys))
    return PooledLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=True,
                        collate_fn=detection_collate())


def tree_cpu_s() -> float:
    """CPU seconds used so far by this process and its live children (the loaders' workers)."""
    import psutil
    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def epoch(loader) -> int:
    n = 0
    for images, _ in loader:
        n += len(images)
    return n


GOALS = {"images + boxes": 2.5, "images + boxes + masks": 2.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    import pycocotools  # noqa: F401  (both sides decode polygon masks with it)
    from pooled_loader import PooledLoader
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        img_dir, ann = write_coco(tmp, args.images)
        for name, keys in (("images + boxes", {"image_id", "boxes", "labels"}),
                           ("images + boxes + masks", {"image_id", "boxes", "labels", "masks"})):
            ref = dataloader(img_dir, ann, keys, args.workers)
            loaders = {"dataloader": ref,
                       "routed": PooledLoader(ref.dataset, batch_size=BATCH,
                                              num_workers=args.workers, persistent_workers=True,
                                              collate_fn=zip_collate),
                       "pooled": pooled(img_dir, ann, keys, args.workers)}
            for loader in loaders.values():
                epoch(loader)  # warm-up: workers started, files in the page cache
            assert "transforms" in loaders["routed"].stats(), "the routed loader did not fuse"
            rates: dict[str, list[float]] = {k: [] for k in loaders}
            cpu: dict[str, list[float]] = {k: [] for k in loaders}
            for r in range(args.rounds):
                order = list(loaders)[r % 3:] + list(loaders)[:r % 3]
                for k in order:
                    c0, t0 = tree_cpu_s(), time.perf_counter()
                    n = epoch(loaders[k])
                    rates[k].append(n / (time.perf_counter() - t0))
                    cpu[k].append((tree_cpu_s() - c0) * 1000 / n)
            print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.0f} img/s"
                                          for k, v in rates.items()), flush=True)
            for k in ("routed", "pooled"):
                ratios = [p / d for p, d in zip(rates[k], rates["dataloader"])]
                med = statistics.median(ratios)
                cpu_ratio = statistics.median(cpu["dataloader"]) / statistics.median(cpu[k])
                print(f"  {k}: ratio median {med:.2f}x (rounds "
                      f"{', '.join(f'{x:.2f}' for x in ratios)}); CPU-ms per sample (all "
                      f"processes) dataloader {statistics.median(cpu['dataloader']):.1f}, {k} "
                      f"{statistics.median(cpu[k]):.1f} ({cpu_ratio:.2f}x); goal >= "
                      f"{GOALS[name]}x: {'PASS' if med >= GOALS[name] else 'MISS'}", flush=True)
            del loaders, ref  # they shut their persistent workers down when collected
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
