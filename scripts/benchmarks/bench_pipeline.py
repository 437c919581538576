#!/usr/bin/env python
"""Per-core throughput of the pooled image pipeline: decode + RandomResizedCrop(224) + flip + CHW.

    python scripts/benchmarks/bench_pipeline.py [DIR] [--n 400] [--reps 5] [--upscale K]

DIR is an ImageFolder of JPEGs (default: data/imagenet2k, made with scripts/tools/make_dataset.py if
missing: 2000 ImageNet-like images, short side 256..512). ``--upscale K`` first writes a copy of DIR with
every image enlarged K times (bicubic, plus a little noise for photo-like entropy; JPEG q90) to
DIR_xK and benchmarks that: photo-sized images, where DCT-domain downscaling matters.

Single process, one thread; each row is the median over ``--reps`` passes over the
images (read into memory first, except the ImageFolder row) of images/s by CPU time of this
process (robust on a shared machine) and by wall clock. Rows:

- pooled: Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()])
  writing into one reused output (what a PooledLoader worker does per sample);
- pooled, DCT scaling off: the same, always decoding at full size (the naive full decode);
- pooled, DecodeImage(fast): libjpeg-turbo's fast IDCT and upsampling (about 1 level off);
- ImageFolder.getitem_into: the pooled row plus reading the file into the reused buffer;
- decode only: simplejpeg full-size decode into a reused buffer (the floor of the naive path);
- Pillow reference: PIL decode (draft off), resize(BILINEAR, box), flip, to CHW uint8 (what
  torchvision's RandomResizedCrop on PIL images costs, without torch).
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import random
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _median_rate(fn, items, reps: int) -> tuple[float, float]:
    for x in items[:20]:  # warm-up: buffers, caches
        fn(x)
    cpu, wall = [], []
    for _ in range(reps):
        c, w = time.process_time(), time.perf_counter()
        for x in items:
            fn(x)
        cpu.append(len(items) / max(time.process_time() - c, 1e-9))
        wall.append(len(items) / (time.perf_counter() - w))
    return statistics.median(cpu), statistics.median(wall)


def _upscaled_copy(src: str, k: float, n: int) -> str:
    """DIR_xK: the first n images of src enlarged k times (made once, then reused)."""
    import cv2

    dst = f"{src.rstrip('/')}_x{k:g}"
    paths = sorted(glob.glob(os.path.join(src, "*", "*.jpg")))[:n]
    rng = np.random.default_rng(0)
    for path in paths:
        out = os.path.join(dst, os.path.relpath(path, src))
        if os.path.exists(out):
            continue
        img = cv2.imread(path, cv2.IMREAD_COLOR)
        img = cv2.resize(img, None, fx=k, fy=k, interpolation=cv2.INTER_CUBIC)
        noise = rng.normal(0, 3, img.shape).astype(np.float32)
        img = np.clip(img + noise, 0, 255).astype(np.uint8)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cv2.imwrite(out, img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=os.path.join(ROOT, "data", "imagenet2k"))
    p.add_argument("--n", type=int, default=400, help="images used (default 400)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--upscale", type=float, default=0, help="benchmark an enlarged copy of DIR")
    a = p.parse_args(argv)

    import cv2
    import simplejpeg
    from PIL import Image

    from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                      RandomResizedCrop, ToCHW)
    from pooled_loader.vision import kernels

    cv2.setNumThreads(1)
    if not glob.glob(os.path.join(a.dir, "*", "*.jpg")):
        sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))
        from make_dataset import make_dataset

        make_dataset(a.dir, n=max(a.n, 2000), classes=10, progress=False)
    if a.upscale:
        a.dir = _upscaled_copy(a.dir, a.upscale, a.n)
    ds = ImageFolder(a.dir)
    ds.samples = ds.samples[: a.n]
    datas = [np.fromfile(path, np.uint8) for path, _ in ds.samples]
    sizes = np.array([simplejpeg.decode_jpeg_header(d)[:2] for d in datas])
    print(f"{len(datas)} JPEGs from {a.dir}: short side {sizes.min(1).min()}..{sizes.min(1).max()}"
          f", mean {np.mean([d.size for d in datas]) / 1e3:.0f} kB; kernel backend "
          f"{kernels.BACKEND}; one process, one thread; median of {a.reps} passes; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    def pipeline(dct: bool, fast: bool = False) -> Compose:
        return Compose([DecodeImage(fast), RandomResizedCrop(224), RandomHorizontalFlip(),
                        ToCHW()], dct_scaling=dct)

    out = np.empty((3, 224, 224), np.uint8)
    tf_on, tf_off, tf_fast = pipeline(True), pipeline(False), pipeline(True, fast=True)
    ds.transform = pipeline(True)
    buf = np.empty(64 << 20, np.uint8)
    rrc = RandomResizedCrop(224)

    def pil_ref(d: np.ndarray) -> None:
        im = Image.open(io.BytesIO(d)).convert("RGB")
        x0, y0, w, h = rrc.box(im.height, im.width)
        im = im.resize((224, 224), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        if random.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        np.copyto(out, np.asarray(im).transpose(2, 0, 1))

    def decode_only(d: np.ndarray) -> None:
        h, w = simplejpeg.decode_jpeg_header(d)[:2]
        simplejpeg.decode_jpeg(d, buffer=buf[: h * w * 3])

    rows = [
        ("pooled (DCT scaling on)", lambda d: tf_on(d, out=out), datas),
        ("pooled, DCT scaling off", lambda d: tf_off(d, out=out), datas),
        ("pooled, DecodeImage(fast)", lambda d: tf_fast(d, out=out), datas),
        ("ImageFolder.getitem_into", lambda i: ds.getitem_into(i, (out, None)),
         list(range(len(ds)))),
        ("decode only (full size)", decode_only, datas),
        ("Pillow reference", pil_ref, datas),
    ]
    random.seed(0)
    results = {}
    print(f"{'':28s}{'img/s (CPU)':>12s}{'img/s (wall)':>14s}")
    for name, fn, items in rows:
        cpu, wall = _median_rate(fn, items, a.reps)
        results[name] = cpu
        print(f"{name:28s}{cpu:12.0f}{wall:14.0f}")
    n_dct = tf_on.stats()["dct_scaled"]
    calls = (a.reps * len(datas) + 20)
    print(f"DCT-scaled decodes: {n_dct}/{calls} ({100 * n_dct / calls:.0f}%); "
          f"gain from DCT scaling: "
          f"{results['pooled (DCT scaling on)'] / results['pooled, DCT scaling off']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
