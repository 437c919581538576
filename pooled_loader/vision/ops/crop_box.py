"""RandomResizedCrop's box, drawn in one place for every random source that draws it.

torchvision's ``RandomResizedCrop`` (v1 ``get_params``, v2 ``make_params``), timm's
``RandomResizedCropAndInterpolation`` and our own op draw the same algorithm: ten tries of an
area fraction from ``scale`` and an aspect ``exp(uniform(log ratio))``, the first box that fits
placed at a random top, then left; when none fits, the centre box with the aspect clamped into
``ratio``. They differ only in the random source and in what they check, so the source is a
parameter (:class:`Source`: Python's ``random`` here, torch's generator in
``vision/torchvision/plan.py``'s ``Draws``) and the same calls are made in the same order, which
keeps every draw equal to the op's own (tests/test_torchvision_draws.py, test_detection_more.py).

Boxes are ``(x0, y0, width, height)`` (``base.Box``), as everywhere in vision/. Imports: ops/base.
"""
from __future__ import annotations

import math
import random
from typing import Protocol, Sequence

from pooled_loader.vision.base import Box


class Source(Protocol):
    """The three draws a crop box needs, from one random generator."""

    def uniform(self, low: float, high: float) -> float:
        """A float drawn uniformly from [low, high)."""

    def exp_uniform(self, low: float, high: float) -> float:
        """``exp`` of a float drawn uniformly from [low, high) (in the generator's precision)."""

    def randint_incl(self, low: int, high: int) -> int:
        """An int drawn from [low, high], both ends included."""


class PythonRandom:
    """Python's ``random`` module as a :class:`Source` (the worker seeds it): our own op's and
    timm's draws."""

    @staticmethod
    def uniform(low: float, high: float) -> float:
        return random.uniform(low, high)

    @staticmethod
    def exp_uniform(low: float, high: float) -> float:
        return math.exp(random.uniform(low, high))

    @staticmethod
    def randint_incl(low: int, high: int) -> int:
        return random.randint(low, high)


PYTHON_RANDOM = PythonRandom()


def resized_crop_box(h: int, w: int, scale: Sequence[float], log_ratio: Sequence[float],
                     ratio: Sequence[float], source: Source, *, empty_ok: bool = False) -> Box:
    """The crop box of an h x w image, drawn from ``source``: ten tries, then
    :func:`centre_box`. ``log_ratio`` is ``log(ratio)`` as the op keeps it (float64 for Python's
    ``random``, float32 for torch's). ``empty_ok``: accept a box 0 pixels wide or high, as timm
    does (torchvision and our op ask for at least one)."""
    area = h * w
    for _ in range(10):
        target_area = area * source.uniform(scale[0], scale[1])
        aspect = source.exp_uniform(log_ratio[0], log_ratio[1])
        cw = int(round(math.sqrt(target_area * aspect)))
        ch = int(round(math.sqrt(target_area / aspect)))
        if cw <= w and ch <= h and (empty_ok or (cw > 0 and ch > 0)):
            top = source.randint_incl(0, h - ch)
            left = source.randint_incl(0, w - cw)
            return left, top, cw, ch
    return centre_box(h, w, ratio)


def centre_box(h: int, w: int, ratio: Sequence[float]) -> Box:
    """RandomResizedCrop's box when ten draws found none (torchvision's and timm's rule): the
    centre of the image with its aspect clamped into ``ratio``."""
    in_ratio = float(w) / float(h)
    if in_ratio < min(ratio):
        cw, ch = w, int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        cw, ch = int(round(h * max(ratio))), h
    else:
        cw, ch = w, h
    return (w - cw) // 2, (h - ch) // 2, cw, ch


__all__ = ["Source", "PythonRandom", "PYTHON_RANDOM", "resized_crop_box", "centre_box"]
