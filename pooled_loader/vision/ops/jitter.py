"""Colour jitter on uint8 CHW images, bit for bit as Pillow's ``ImageEnhance`` computes it.

torchvision's ``ColorJitter`` on a PIL image (v1, v2 and timm's default training transform)
calls ``ImageEnhance.Brightness / Contrast / Color``, each ``Image.blend(degenerate, image,
factor)``: per byte ``(uint8)(d + factor * (x - d))`` in float32, clipped to 0..255 and
truncated, where the degenerate image ``d`` is black (brightness), the mean of the grey image
rounded to an integer (contrast) or the pixel's own grey (saturation). Grey is Pillow's
``convert("L")``: ``(19595 R + 38470 G + 7471 B + 0x8000) >> 16``. Hue (an HSV round trip in
Pillow) is not here: a ColorJitter with hue runs as torchvision's own op.

Two implementations, the same bytes (tests/test_torchvision_swap.py checks both against
Pillow): the compiled ``_kernels.enhance_chain`` (csrc/jitter.c), used when built, and numpy
(a 256-entry table per call for brightness and contrast, float32 passes for saturation). The
compiled one exists because numpy was not enough: a 224x224 image through brightness, contrast
and saturation took 1.8 ms in numpy against 2.2 ms for Pillow's three ``enhance`` calls, which
left timm's default training transform at ~1.1x DataLoader. It runs the whole chain a block
of pixels at a time in vectorised loops and writes the float32 result (ToTensor + Normalize as
``v * mul + add``) in its last pass: two passes over the image for timm's jitter instead of
three jitter passes and two conversion passes; see BENCHMARKS.md
(scripts/benchmarks/bench_torchvision_swap.py prints the jitter's time first).
"""
from __future__ import annotations

import numpy as np

from pooled_loader.vision.io.buffers import Scratch
from pooled_loader.vision.io.kernels import _get_cv2, _kernels

_RAMP = np.arange(256, dtype=np.float32)
_CHAIN = getattr(_kernels, "enhance_chain", None)  # None: not built (or an older build): numpy
_GREY_WEIGHTS = (19595, 38470, 7471)  # Pillow's ITU-R 601-2 luma in 16-bit fixed point


def _blend_lut(degenerate: float, factor: float) -> np.ndarray:
    """``Image.blend(constant, image, factor)`` for every byte value."""
    d = np.float32(degenerate)
    out = d + np.float32(factor) * (_RAMP - d)
    return np.clip(out, 0, 255, out=out).astype(np.uint8)


def grey(img: np.ndarray, scratch: Scratch) -> np.ndarray:
    """Pillow's ``convert("L")`` of a (3, h, w) uint8 image, as int32 (h, w) in scratch."""
    h, w = img.shape[1:]
    acc = scratch.array("jitter.grey", (h, w), np.int32)
    tmp = scratch.array("jitter.tmp", (h, w), np.int32)
    np.multiply(img[0], _GREY_WEIGHTS[0], out=acc, dtype=np.int32)
    np.multiply(img[1], _GREY_WEIGHTS[1], out=tmp, dtype=np.int32)
    acc += tmp
    np.multiply(img[2], _GREY_WEIGHTS[2], out=tmp, dtype=np.int32)
    acc += tmp
    acc += 0x8000
    acc >>= 16
    return acc


def _lut_(img: np.ndarray, lut: np.ndarray) -> None:
    """``img = lut[img]`` in place (OpenCV's table lookup: 3x numpy's ``take`` here)."""
    planes = img.reshape(img.shape[0] * img.shape[1], img.shape[2])
    _get_cv2().LUT(planes, lut, dst=planes)


def brightness_(img: np.ndarray, factor: float) -> None:
    """``ImageEnhance.Brightness(img).enhance(factor)`` in place."""
    _lut_(img, _blend_lut(0.0, factor))


def contrast_(img: np.ndarray, factor: float, scratch: Scratch) -> None:
    """``ImageEnhance.Contrast(img).enhance(factor)`` in place."""
    g = grey(img, scratch)
    mean = int(float(g.sum(dtype=np.int64)) / g.size + 0.5)  # ImageStat's mean, rounded
    _lut_(img, _blend_lut(mean, factor))


def saturation_(img: np.ndarray, factor: float, scratch: Scratch) -> None:
    """``ImageEnhance.Color(img).enhance(factor)`` in place."""
    g = grey(img, scratch)
    gf = scratch.array("jitter.greyf", g.shape, np.float32)
    np.copyto(gf, g, casting="unsafe")
    f = np.float32(factor)
    t = scratch.array("jitter.plane", g.shape, np.float32)
    for c in range(3):
        np.subtract(img[c], gf, out=t, dtype=np.float32)
        t *= f
        t += gf
        np.clip(t, 0, 255, out=t)
        np.copyto(img[c], t, casting="unsafe")  # float -> uint8 truncates, as Pillow's cast


def jitter_(img: np.ndarray, order: list[int], factors: tuple, scratch: Scratch,
            compiled: bool = True) -> None:
    """ColorJitter's ``transform`` in place on a C-contiguous (3, h, w) uint8 image: for each
    index of ``order`` (0 brightness, 1 contrast, 2 saturation; 3, hue, must be None) apply its
    factor when not None. ``compiled=False`` takes the numpy route even where the extension is
    built (for tests)."""
    jitter_into(img, [(order, factors)], scratch, compiled=compiled)


def jitter_into(img: np.ndarray, jitters: list[tuple[list[int], tuple]], scratch: Scratch,
                out: np.ndarray | None = None, mul: tuple = (1.0,) * 3, add: tuple = (0.0,) * 3,
                compiled: bool = True) -> None:
    """Every ColorJitter of ``jitters`` ((order, factors) each, as :func:`jitter_` takes them)
    on ``img`` in turn, in place; or, with ``out`` (float32, img's shape), ``out[c] =
    float32(result[c]) * mul[c] + add[c]`` in float32 (numpy's arithmetic), ``img`` then left
    as it was (compiled) or holding the result (numpy). The compiled route runs the whole chain
    per block of pixels: one read pass per contrast (its grey mean) and one pass that stores."""
    ops = []
    for order, factors in jitters:
        if factors[3] is not None:
            raise ValueError("hue is not supported here (it runs as torchvision's own op)")
        ops += [(fn, float(factors[fn])) for fn in order if fn < 3 and factors[fn] is not None]
    if compiled and _CHAIN is not None:
        _CHAIN(img, ops, out, mul, add)
        return
    for fn, factor in ops:
        if fn == 0:
            brightness_(img, factor)
        elif fn == 1:
            contrast_(img, factor, scratch)
        else:
            saturation_(img, factor, scratch)
    if out is not None:
        np.multiply(img, np.asarray(mul, np.float32)[:, None, None], out=out)
        out += np.asarray(add, np.float32)[:, None, None]
