"""pooled_loader.vision output quality vs a Pillow/torchvision-style reference, and
RandomResizedCrop's parameter sampling vs torchvision's documented algorithm.

Tolerance: for the same crop box and flip, the pipeline's uint8 output is within a mean absolute
difference of 2 levels (of 255) of Pillow's ``Image.resize(size, BILINEAR, box=...)`` (antialiased
bilinear, what torchvision's ``RandomResizedCrop(antialias=True)`` does on PIL images) applied to
Pillow's full-size decode. That budget covers libjpeg's DCT-domain downscaling and the rounding of
the box onto the downscaled image's pixel grid is part of the crop taken (each edge moves at most
half a decoded pixel), so the reference crops that box (see test_pipeline_matches_pillow_reference).
"""
from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

import imgutil
from pooled_loader.vision import (Compose, DecodeImage, RandomHorizontalFlip, RandomResizedCrop,
                                  Resize, ToCHW)
from pooled_loader.vision.compose import dct_factor, scale_box
from pooled_loader.vision.io.kernels import resize_hwc

TOL = 2.0  # mean abs diff, uint8 levels


def reference_rrc_params(rng: random.Random, height: int, width: int, scale=(0.08, 1.0),
                         ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision.transforms.RandomResizedCrop.get_params as documented, on ``rng``.

    Returns (top, left, h, w). Ten attempts: area ~ U(scale) * H*W, log aspect ~ U(log ratio),
    w = round(sqrt(area * aspect)), h = round(sqrt(area / aspect)); accept when it fits, then
    top ~ U{0..H-h}, left ~ U{0..W-w}. Otherwise a centre crop whose aspect is clamped to ratio.
    """
    area = height * width
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    attempt = 0
    while attempt < 10:
        attempt += 1
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(lo, hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return top, left, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("hw", [(375, 500), (500, 375), (256, 256), (1, 1), (16, 20000),
                                (20000, 16), (3, 900), (1536, 2048)])
def test_rrc_sampling_follows_torchvision(hw):
    op = RandomResizedCrop(224)
    for seed in range(200):
        random.seed(seed)
        x0, y0, w, h = op.box(*hw)
        top, left, rh, rw = reference_rrc_params(random.Random(seed), *hw)
        assert (y0, x0, h, w) == (top, left, rh, rw), seed
        assert 0 <= x0 and x0 + w <= hw[1] and 0 <= y0 and y0 + h <= hw[0]


def test_rrc_sampling_distribution():
    # square image, ranges where every first try fits: the accepted boxes follow the draws
    op = RandomResizedCrop(224, scale=(0.05, 0.3), ratio=(0.5, 2.0))
    random.seed(1)
    H = W = 1000
    boxes = np.array([op.box(H, W) for _ in range(4000)], float)
    area = boxes[:, 2] * boxes[:, 3] / (H * W)
    log_aspect = np.log(boxes[:, 2] / boxes[:, 3])
    assert area.min() > 0.048 and area.max() < 0.302
    assert log_aspect.min() > math.log(0.49) and log_aspect.max() < math.log(2.01)
    assert abs(area.mean() - 0.175) < 0.005  # area fraction ~ U(0.05, 0.3)
    assert abs(log_aspect.mean()) < 0.03 and abs(log_aspect.std() - math.log(4) / 12 ** 0.5) < 0.02
    # positions uniform over the valid range: mean box centre near the image centre
    assert abs((boxes[:, 0] + boxes[:, 2] / 2).mean() - W / 2) < 10
    # extreme aspect: every try fails, centre-crop fallback clamped to the ratio range
    random.seed(2)
    assert RandomResizedCrop(224).box(16, 20000) == ((20000 - 21) // 2, 0, 21, 16)


def pil_reference(data: bytes, box, size, flip: bool) -> np.ndarray:
    """Pillow full decode, then resize(BILINEAR, box) (antialiased), then flip; HWC uint8."""
    im = Image.open(io.BytesIO(data)).convert("RGB")
    x0, y0, w, h = box
    im = im.resize((size[1], size[0]), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(im)


CASES = [  # (photo, (width, height), quality): DCT factors 1 .. 8 all occur
    ("astronaut", (512, 512), 90),
    ("chelsea", (451, 300), 85),
    ("coffee", (900, 600), 95),
    ("astronaut", (1800, 1400), 80),
    ("chelsea", (3000, 2000), 90),
]


def effective_box(box, full_hw, factor):
    """The box the DCT-scaled path really crops, in full-size pixels (fractional)."""
    if factor == 1:
        return box
    sh, sw = -(-full_hw[0] // factor), -(-full_hw[1] // factor)  # libjpeg rounds up
    x0, y0, w, h = scale_box(box, full_hw, (sh, sw))
    fx, fy = full_hw[1] / sw, full_hw[0] / sh
    return x0 * fx, y0 * fy, w * fx, h * fy


@pytest.mark.parametrize("name, size, quality", CASES)
def test_pipeline_matches_pillow_reference(name, size, quality):
    """Same box and flip -> within TOL of Pillow's antialiased bilinear crop-resize.

    With a DCT downscale by f the box edges land on the downscaled pixel grid: each edge moves by
    at most f/2 full-size pixels (half a decoded pixel, under half an output pixel since the
    decoded box is at least the output size). The reference uses that box; against the box before
    snapping, sharp images differ by up to ~2.7 levels at f=2 (a sub-pixel shift, not blur).
    """
    data = imgutil.jpeg(name, size, quality)
    full_hw = (size[1], size[0])
    tf = Compose([DecodeImage(), RandomResizedCrop(224, scale=(0.08, 1.0)),
                  RandomHorizontalFlip(), ToCHW()])
    op = RandomResizedCrop(224)
    factors, diffs = set(), []
    for seed in range(12):
        random.seed(seed)
        got = tf(data).transpose(1, 2, 0)
        random.seed(seed)  # replay the draws: box, then flip
        box = op.box(*full_hw)
        flip = random.random() < 0.5
        f = dct_factor(box, (224, 224))
        factors.add(f)
        eff = effective_box(box, full_hw, f)
        edges = (box[0], box[1], box[0] + box[2], box[1] + box[3])
        eff_edges = (eff[0], eff[1], eff[0] + eff[2], eff[1] + eff[3])
        assert max(abs(a - b) for a, b in zip(edges, eff_edges)) <= f / 2 + 1e-9
        ref = pil_reference(data, eff, (224, 224), flip)
        diffs.append(np.abs(got.astype(np.int16) - ref).mean())
    assert max(diffs) <= TOL, (factors, diffs)
    if max(size) >= 1800:
        assert factors & {2, 4, 8}  # the DCT-scaled path was compared


@pytest.mark.parametrize("factor_size", [(512, 384), (1200, 900), (2400, 1800)])
def test_resize_matches_pillow_reference(factor_size):
    data = imgutil.jpeg("coffee", factor_size, 90)
    got = Compose([DecodeImage(), Resize(256)])(data)
    w, h = factor_size
    ow, oh = int(256 * w / h), 256
    ref = pil_reference(data, (0, 0, w, h), (oh, ow), False)
    assert got.shape == ref.shape
    assert np.abs(got.astype(np.int16) - ref).mean() <= TOL


@pytest.mark.parametrize("ratio", [0.6, 1.0, 1.3, 1.7, 1.95, 2.4, 3.5])
def test_hwc_resize_matches_pillow(ratio):
    """The OpenCV path used for HWC outputs (no ToCHW), at shrink/enlarge ratios."""
    img = imgutil.rgb("astronaut", (1024, 1024))
    n = int(224 * ratio)
    box = (7, 11, n, min(n, 500))
    out = np.empty((224, 200, 3), np.uint8)
    resize_hwc(img, box, out)
    ref = np.asarray(Image.fromarray(img).resize((200, 224), Image.BILINEAR,
                                                 box=(7, 11, 7 + n, 11 + min(n, 500))))
    assert np.abs(out.astype(np.int16) - ref).mean() <= TOL


def test_fast_decode_is_close():
    data = imgutil.jpeg("coffee", (600, 400), 90)
    exact, fast = Compose([DecodeImage()])(data), Compose([DecodeImage(fast=True)])(data)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(exact, ref)  # the same libjpeg-turbo settings as Pillow: identical
    assert 0 < np.abs(fast.astype(np.int16) - ref).mean() <= TOL


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_decode_like_pillow(mode):
    data = imgutil.jpeg("chelsea", (451, 300), 90, mode=mode)
    got = Compose([DecodeImage()])(data)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert got.shape == (300, 451, 3)
    assert np.abs(got.astype(np.int16) - ref).mean() <= 1.0


@pytest.mark.parametrize("fmt, mode", [("PNG", "RGBA"), ("PNG", "P"), ("BMP", None),
                                       ("WEBP", None)])
def test_other_formats_decode_via_pillow(fmt, mode):
    img = imgutil.rgb("coffee", (120, 80))
    data = imgutil.encode(img, fmt, mode=mode, **({"lossless": True} if fmt == "WEBP" else {}))
    got = Compose([DecodeImage()])(data)
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert got.shape == (80, 120, 3) and np.array_equal(got, ref)
    out = Compose([DecodeImage(), RandomResizedCrop(64), ToCHW()])(data)
    assert out.shape == (3, 64, 64)
