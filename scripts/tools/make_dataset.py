#!/usr/bin/env python
"""Make an ImageNet-like JPEG ImageFolder for benchmarks and tests.

    python scripts/tools/make_dataset.py OUT_DIR [--n 2000] [--classes 10] [--seed 0]

Layout: OUT_DIR/class_000/img_00000.jpg, ... (image i goes to class i % classes).

Content is natural-photo material: random crops of the colour photographs scikit-image ships
(astronaut, chelsea, coffee, rocket, hubble_deep_field, immunohistochemistry, retina, stereo
motorcycle, ... -- only those that load offline; the grey ones are tinted), rescaled to a short side
of 256..512, mixed aspect (most in 3/4..4/3, about a fifth wider, either orientation), random
horizontal flip, colour jitter and a little sensor-like noise, encoded by OpenCV's libjpeg at
quality 75..95 with 4:2:0 chroma subsampling (what most ImageNet JPEGs use).

Deterministic: image i is drawn from its own generator seeded by (seed, i), and the encoder is
deterministic, so the same (n, classes, seed) gives byte-identical files in any order.

Importable: ``make_dataset(out_dir, n=2000, classes=10, seed=0) -> list[str]``.
"""
from __future__ import annotations

import argparse
import os
import sys

import cv2
import numpy as np

# Colour photographs first; grey ones are tinted into colour.  Loaded lazily, once per process.
_COLOUR = ["astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
           "immunohistochemistry", "retina", "stereo_motorcycle"]
_GREY = ["camera", "moon", "coins", "brick", "grass", "gravel", "clock"]
_SOURCES: list[np.ndarray] | None = None


def _load_sources() -> list[np.ndarray]:
    """BGR uint8 source photos that load without the network (skimage.data)."""
    global _SOURCES
    if _SOURCES is not None:
        return _SOURCES
    import skimage.data as skd

    out: list[np.ndarray] = []
    for name in _COLOUR + _GREY:
        f = getattr(skd, name, None)
        if f is None:
            continue
        try:
            im = f()
        except Exception:  # needs pooch / a download: skip it
            continue
        ims = list(im[:2]) if isinstance(im, tuple) else [im]  # stereo pair -> two images
        for a in ims:
            a = np.asarray(a)
            if a.dtype != np.uint8 or a.ndim not in (2, 3) or min(a.shape[:2]) < 96:
                continue
            if a.ndim == 2:
                a = np.repeat(a[:, :, None], 3, axis=2)
            elif a.shape[2] == 4:
                a = a[:, :, :3]
            out.append(np.ascontiguousarray(a[:, :, ::-1]))  # RGB -> BGR for cv2
    if not out:
        raise RuntimeError("no scikit-image sample photo could be loaded")
    _SOURCES = out
    return out


def _target_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): short side 256..512; aspect mostly 3/4..4/3, ~20% up to 2:1."""
    short = int(rng.integers(256, 513))
    if rng.random() < 0.2:
        aspect = float(rng.uniform(4 / 3, 2.0))
    else:
        aspect = float(np.exp(rng.uniform(np.log(1.0), np.log(4 / 3))))
    long_ = int(round(short * aspect))
    if rng.random() < 0.5:  # landscape or portrait
        return long_, short
    return short, long_


_NOISE_TILE = 1040  # >= the longest side _target_size can return (2 * 512)
_NOISE_SCALE = 16.0
_NOISE: np.ndarray | None = None


def _noise_tile() -> np.ndarray:
    """A fixed tile of N(0, 1) * 16 noise (int16) that images take random windows of."""
    global _NOISE
    if _NOISE is None:
        g = np.random.default_rng(20240531)
        _NOISE = np.round(g.standard_normal((_NOISE_TILE, _NOISE_TILE, 3), dtype=np.float32)
                          * _NOISE_SCALE).astype(np.int16)
    return _NOISE


def _render(i: int, seed: int, sources: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Image i as a BGR uint8 array (for cv2.imencode) and its JPEG quality."""
    rng = np.random.default_rng([seed, i])
    src = sources[int(rng.integers(len(sources)))]
    tw, th = _target_size(rng)
    sh, sw = src.shape[:2]
    # Random crop of the source with the target's aspect, 35..100% of the largest such crop.
    scale = float(np.sqrt(rng.uniform(0.35, 1.0)))
    cw = min(sw, sh * tw / th) * scale
    ch = cw * th / tw
    cw, ch = max(16, int(cw)), max(16, int(ch))
    x0 = int(rng.integers(0, sw - cw + 1))
    y0 = int(rng.integers(0, sh - ch + 1))
    crop = src[y0:y0 + ch, x0:x0 + cw]
    interp = cv2.INTER_AREA if cw > tw else cv2.INTER_CUBIC
    img = cv2.resize(crop, (tw, th), interpolation=interp)
    if rng.random() < 0.5:
        img = cv2.flip(img, 1)
    # Colour jitter as one affine colour map (cv2.transform, saturating):
    # brightness b, contrast c about the mean, saturation s, per-channel gain g (tints grey photos).
    b, c, s = rng.uniform(0.7, 1.3), rng.uniform(0.7, 1.3), rng.uniform(0.6, 1.5)
    g = rng.uniform(0.85, 1.15, size=3)
    m0 = float(np.mean(cv2.mean(img)[:3]))
    sat = s * np.eye(3) + (1.0 - s) * np.full((3, 3), 1.0 / 3.0)
    lin = np.diag(g) @ sat * (c * b)
    off = g * (1.0 - c) * b * m0
    img = cv2.transform(img, np.hstack([lin, off[:, None]]).astype(np.float32))
    # A little sensor-like noise (sigma 2..7) so the JPEGs have photo-like entropy.
    sigma = float(rng.uniform(2.0, 7.0))
    nz = _noise_tile()
    ny = int(rng.integers(0, _NOISE_TILE - th + 1))
    nx = int(rng.integers(0, _NOISE_TILE - tw + 1))
    img = cv2.addWeighted(img, 1.0, nz[ny:ny + th, nx:nx + tw], sigma / _NOISE_SCALE, 0.0,
                          dtype=cv2.CV_8U)
    quality = int(rng.integers(75, 96))
    return img, quality


def make_dataset(out_dir: str, n: int = 2000, classes: int = 10, seed: int = 0,
                 progress: bool = True) -> list[str]:
    """Write n JPEGs under out_dir/class_XXX/ and return their paths (index order)."""
    if n < 0 or classes < 1:
        raise ValueError("n must be >= 0 and classes >= 1")
    from tqdm import tqdm

    sources = _load_sources()
    for c in range(classes):
        os.makedirs(os.path.join(out_dir, f"class_{c:03d}"), exist_ok=True)
    paths = []
    for i in tqdm(range(n), desc="make_dataset", unit="img", disable=not progress):
        bgr, quality = _render(i, seed, sources)
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise RuntimeError(f"JPEG encode failed for image {i}")
        path = os.path.join(out_dir, f"class_{i % classes:03d}", f"img_{i:05d}.jpg")
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(buf.tobytes())
        os.replace(tmp, path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--n", type=int, default=2000, help="number of images (default 2000)")
    p.add_argument("--classes", type=int, default=10, help="number of class folders (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    paths = make_dataset(a.out_dir, a.n, a.classes, a.seed, progress=not a.quiet)
    total = sum(os.path.getsize(x) for x in paths)
    print(f"wrote {len(paths)} JPEGs in {a.classes} classes to {a.out_dir} "
          f"({total / 1e6:.1f} MB, {total / max(1, len(paths)) / 1e3:.0f} kB/image)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
