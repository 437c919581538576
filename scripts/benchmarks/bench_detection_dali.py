#!/usr/bin/env python
"""Detection, images + boxes (issue 38): DALI's CPU pipeline beside DataLoader and PooledLoader.

    /work/venv-dali/bin/python scripts/benchmarks/bench_detection_dali.py [--rounds 5]
        [--images 96] [--workers 2]

Run it with a python that has ``nvidia-dali-cuda120`` (a venv with ``--system-site-packages``,
so torch, torchvision and this checkout are the same as the main environment's). The COCO folder
and the DataLoader / PooledLoader pipelines are bench_detection.py's (RandomIoUCrop -> Resize
((640, 640)) -> RandomHorizontalFlip -> SanitizeBoundingBoxes, batch 16, `--workers` workers);
DALI's is the same chain in its own graph, on the CPU only (``device_id=None``, `--workers`
threads): ``readers.coco`` (boxes as ltrb ratios) -> ``decoders.image`` (cpu) ->
``random_bbox_crop`` (SSD's thresholds, scale (0.3, 1), aspect (0.5, 2), 40 attempts; it drops
boxes whose centre leaves the crop) -> ``slice`` -> ``resize`` to 640x640 -> ``flip`` with
``bb_flip`` from one coin -> ``transpose`` to CHW uint8. DALI's iterator hands out the images
as one array and the boxes per image, as numpy.

Per round, each loader runs one timed epoch (after one warm-up epoch each), the order rotating
between rounds; printed: images/s medians, the median of the per-round ratios against
DataLoader, and CPU-ms per image of the whole loader (this process, where DALI's threads run,
plus the workers; /proc). The machine is shared: compare ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_detection import BATCH, dataloader, epoch, pooled, write_coco  # noqa: E402
from peers import tree_cpu_seconds  # noqa: E402


class DaliLoader:
    """An epoch of DALI's CPU pipeline: (images uint8 [B, 3, 640, 640], list of boxes)."""

    def __init__(self, img_dir: str, ann: str, n: int, threads: int) -> None:
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=BATCH, num_threads=threads, device_id=None, seed=0,
                      prefetch_queue_depth=2)
        def pipe():
            jpegs, boxes, labels = fn.readers.coco(
                file_root=img_dir, annotations_file=ann, ltrb=True, ratio=True,
                skip_empty=False, random_shuffle=False, name="reader")
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            anchor, shape, boxes, labels = fn.random_bbox_crop(
                boxes, labels, device="cpu", aspect_ratio=[0.5, 2.0],
                thresholds=[0.0, 0.1, 0.3, 0.5, 0.7, 0.9], scaling=[0.3, 1.0],
                bbox_layout="xyXY", allow_no_crop=True, num_attempts=40)
            images = fn.slice(images, anchor, shape, axis_names="WH")
            images = fn.resize(images, resize_x=640, resize_y=640)
            coin = fn.random.coin_flip(probability=0.5)
            images = fn.flip(images, horizontal=coin)
            boxes = fn.bb_flip(boxes, ltrb=True, horizontal=coin)
            images = fn.transpose(images, perm=[2, 0, 1])
            return images, boxes, labels

        self.pipe = pipe()
        self.pipe.build()
        self.batches = n // BATCH  # the reader wraps around; one epoch = the images once
        self.dataset = range(self.batches * BATCH)

    def __iter__(self):
        for _ in range(self.batches):
            images, boxes, _ = self.pipe.run()
            yield images.as_array(), [np.array(b) * 640 for b in boxes]  # pixels, as the peers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=96)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    import nvidia.dali
    import torch
    print(f"DALI {nvidia.dali.__version__}, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    keys = {"image_id", "boxes", "labels"}
    with tempfile.TemporaryDirectory() as tmp:
        img_dir, ann = write_coco(tmp, args.images)
        loaders = {"dataloader": dataloader(img_dir, ann, keys, args.workers),
                   "pooled": pooled(img_dir, ann, keys, args.workers),
                   "dali": DaliLoader(img_dir, ann, args.images, args.workers)}
        for loader in loaders.values():
            epoch(loader)  # warm-up: workers / threads started, files in the page cache
        rates: dict[str, list[float]] = {k: [] for k in loaders}
        cpu: dict[str, list[float]] = {k: [] for k in loaders}
        names = list(loaders)
        for r in range(args.rounds):
            for k in names[r % 3:] + names[:r % 3]:
                c0, t0 = tree_cpu_seconds(), time.perf_counter()
                n = epoch(loaders[k])
                rates[k].append(n / (time.perf_counter() - t0))
                cpu[k].append((tree_cpu_seconds() - c0) * 1000 / n)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print("images + boxes: " + ", ".join(f"{k} {v:.0f} img/s" for k, v in med.items()))
        print("  CPU-ms per image (process and workers, median of rounds): " + ", ".join(
            f"{k} {statistics.median(v):.1f}" for k, v in cpu.items()))
        for k in ("pooled", "dali"):
            ratios = [a / b for a, b in zip(rates[k], rates["dataloader"])]
            print(f"  {k} / dataloader: median {statistics.median(ratios):.2f}x "
                  f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")
        ratios = [a / b for a, b in zip(rates["pooled"], rates["dali"])]
        print(f"  pooled / dali: median {statistics.median(ratios):.2f}x "
              f"(rounds {', '.join(f'{x:.2f}' for x in ratios)}); load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        del loaders


if __name__ == "__main__":
    main()
