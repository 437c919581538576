#!/usr/bin/env python
"""Detection (issue 38): the same v2 detection pipeline through DataLoader and PooledLoader.

    python scripts/benchmarks/bench_detection.py [--rounds 3] [--images 96] [--workers 2]

A COCO folder written here: `--images` JPEGs (quality 90) of 640-800 x 480-640 px, 2-12 boxes
each with polygon masks. Pipeline: RandomIoUCrop -> Resize((640, 640)) -> RandomHorizontalFlip
-> SanitizeBoundingBoxes, batch 16, uint8 CHW images:

- dataloader: torchvision's CocoDetection wrapped with wrap_dataset_for_transforms_v2, a v2
  Compose (ToImage first), DataLoader(collate_fn=tuple(zip(*batch))), the torchvision recipe;
- pooled: pooled_loader.vision.coco.CocoDetection + DetectionCompose of the same ops (the
  image decoded by libjpeg-turbo, crop+resize+flip+CHW one kernel call), PooledLoader with
  detection_collate() (images stacked, targets per image as views of the slot).

Two settings: images + boxes, and images + boxes + instance masks (target_keys with "masks").
Both loaders use `--workers` persistent workers; per round and loader, one warm-up epoch then one
timed epoch; the order alternates between rounds; printed: images/s and the median of the
per-round ratios pooled / dataloader; then the CPU time of one sample (dataset + transform) in
this process for each. The machine is shared: compare ratios, not absolutes.
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


def cpu_ms_per_sample(loader) -> float:
    """CPU milliseconds per sample of the loader's dataset (transform included), in this
    process: steadier than images/s when other jobs share the CPU."""
    ds = loader.dataset
    ds[0]
    t0 = time.process_time()
    for i in range(len(ds)):
        ds[i]
    return (time.process_time() - t0) * 1000 / len(ds)


def epoch(loader) -> int:
    n = 0
    for images, _ in loader:
        n += len(images)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    import pycocotools  # noqa: F401  (both sides decode polygon masks with it)
    with tempfile.TemporaryDirectory() as tmp:
        img_dir, ann = write_coco(tmp, args.images)
        for name, keys in (("images + boxes", {"image_id", "boxes", "labels"}),
                           ("images + boxes + masks", {"image_id", "boxes", "labels", "masks"})):
            loaders = {"dataloader": dataloader(img_dir, ann, keys, args.workers),
                       "pooled": pooled(img_dir, ann, keys, args.workers)}
            for loader in loaders.values():
                epoch(loader)  # warm-up: workers started, files in the page cache
            rates: dict[str, list[float]] = {k: [] for k in loaders}
            for r in range(args.rounds):
                order = list(loaders) if r % 2 == 0 else list(reversed(loaders))
                for k in order:
                    t0 = time.perf_counter()
                    n = epoch(loaders[k])
                    rates[k].append(n / (time.perf_counter() - t0))
            ratios = [p / d for p, d in zip(rates["pooled"], rates["dataloader"])]
            print(f"{name}: dataloader {statistics.median(rates['dataloader']):.0f} img/s, "
                  f"pooled {statistics.median(rates['pooled']):.0f} img/s, "
                  f"ratio median {statistics.median(ratios):.2f}x "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
            cpu = {k: cpu_ms_per_sample(v) for k, v in loaders.items()}
            print(f"  one sample in-process: dataloader {cpu['dataloader']:.1f} CPU-ms, pooled "
                  f"{cpu['pooled']:.1f} CPU-ms ({cpu['dataloader'] / cpu['pooled']:.2f}x)",
                  flush=True)
            del loaders  # both shut their persistent workers down when collected


if __name__ == "__main__":
    main()
