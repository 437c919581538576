#!/usr/bin/env python
"""Deferred masks (issue 38): instance masks resampled straight into the slot vs into a buffer
that the ragged write then copies, in one process, on bench_detection.py's COCO folder.

    python scripts/benchmarks/bench_deferred_masks.py [--rounds 5] [--images 64]

Per sample: the transform (decode, RandomIoUCrop -> Resize((640, 640)) -> flip -> CHW ->
SanitizeBoundingBoxes, masks from polygons) and detection_collate's plan + write of batches of
16 into one reused, already-touched buffer (as a recycled slot is). "copied": the transform's
masks are arrays, copied by the write; "deferred": the samples are made under
``deferred.accepted()`` (as a worker makes them for a pooled_loader.collate helper) and the
write resamples them into the buffer. Both draw from the same seeds (the same crops), the
order alternates between rounds; printed: process CPU-ms per sample (median of rounds) and the
ratio, minor page faults per sample, and the bytes of masks per batch. The machine is shared:
compare the ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BATCH = 16


def run(ds, collate, buf, defer: bool, seed: int) -> tuple[float, int, int, int]:
    """(process CPU seconds, samples, mask bytes written, minor page faults) for one pass."""
    import resource

    import numpy as np
    import torch

    from pooled_loader.core import deferred
    from pooled_loader.ragged import slots as ragged
    torch.manual_seed(seed)
    np.random.seed(seed)
    n, mask_bytes = len(ds) // BATCH * BATCH, 0
    faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
    for b in range(0, n, BATCH):
        if defer:
            with deferred.accepted():
                samples = [ds[i] for i in range(b, b + BATCH)]
        else:
            samples = [ds[i] for i in range(b, b + BATCH)]
        p = ragged.plan(collate, samples)
        ragged.write(p, buf[:p.nbytes])
        mask_bytes += sum(int(np.prod(s[1]["masks"].shape)) for s in samples)
    return (time.process_time() - start, n, mask_bytes,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--images", type=int, default=64)
    args = ap.parse_args()
    import numpy as np

    from bench_detection import write_coco
    from pooled_loader.vision import DecodeImage, RandomHorizontalFlip, Resize, ToCHW
    from pooled_loader.vision.coco import CocoDetection
    from pooled_loader.vision.detection import (DetectionCompose, RandomIoUCrop,
                                                SanitizeBoundingBoxes)
    from pooled_loader.vision.detection_batch import detection_collate
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        img_dir, ann = write_coco(tmp, args.images)
        t = DetectionCompose([DecodeImage(), RandomIoUCrop(), Resize((640, 640)),
                              RandomHorizontalFlip(), ToCHW(), SanitizeBoundingBoxes()])
        ds = CocoDetection(img_dir, ann, transform=t,
                           target_keys=("image_id", "boxes", "labels", "masks"))
        collate = detection_collate()
        buf = np.ones(256 << 20, np.uint8)  # touched once, as a recycled slot's pages are
        cpu: dict[str, list[float]] = {"copied": [], "deferred": []}
        faults: dict[str, list[float]] = {"copied": [], "deferred": []}
        run(ds, collate, buf, False, 0)  # warm-up: page cache, pycocotools, OpenCV
        run(ds, collate, buf, True, 0)
        masks = 0
        for r in range(args.rounds):
            for name in (("copied", "deferred") if r % 2 == 0 else ("deferred", "copied")):
                s, n, masks, f = run(ds, collate, buf, name == "deferred", 1 + r)
                cpu[name].append(s * 1000 / n)
                faults[name].append(f / n)
        med = {k: statistics.median(v) for k, v in cpu.items()}
        print(f"mask bytes per batch of {BATCH}: {masks / (n / BATCH) / 1e6:.1f} MB")
        for k, v in cpu.items():
            print(f"{k}: CPU-ms per sample median {med[k]:.2f} (rounds "
                  f"{', '.join(f'{x:.2f}' for x in v)}); minor page faults per sample "
                  f"{statistics.median(faults[k]):.0f}")
        print(f"deferred saves {med['copied'] - med['deferred']:.2f} CPU-ms a sample "
              f"({med['copied'] / med['deferred']:.3f}x)")
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
