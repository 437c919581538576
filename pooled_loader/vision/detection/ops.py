"""More torchvision v2 detection ops on the fused path: ``CenterCrop``, ``RandomZoomOut``,
``Resize`` with ``max_size``, ``RandomShortestSize`` and ``ClampBoundingBoxes``.

Each op plans its steps onto a :class:`~pooled_loader.vision.detection.targets.Geometry`
(``plan(geometry, boxes_xyxy)``), drawing its random parameters from ``torch`` with torchvision's
own expressions (the same seed gives torchvision's sizes and paddings, draw for draw), so
:class:`~pooled_loader.vision.detection.DetectionCompose` runs them like its own crops, resizes
and pads: the image is resampled once per resize and a zoom-out only moves the window.

torchvision's quirks are kept, since boxes must equal its boxes: a ``CenterCrop`` larger than the
image pads the image by ``(crop - size) // 2`` before its crop but moves boxes and keypoints by
``round((size - crop) / 2)`` (Python's rounding to even), which differ by one pixel when
``crop - size`` is 3 mod 4. ``ClampBoundingBoxes`` is a crop of the whole canvas: it clamps boxes
and (our addition, keypoints carrying COCO visibility) marks points outside the canvas invisible.

vision/torchvision/detection.py maps torchvision's ops to these (exact classes, looked up in
vision/torchvision/table.py, and the arguments honoured exactly). Imports:
vision/detection/targets.py (types only); torch.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from pooled_loader.vision.detection.targets import Geometry


def _size_pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    s = [size] if isinstance(size, int) else [int(v) for v in size]
    if len(s) == 1:
        s = s * 2
    if len(s) != 2 or min(s) < 1:
        raise ValueError(f"{what}: size must be an int or (height, width) >= 1, got {size!r}")
    return s[0], s[1]


class CenterCrop:
    """The centre ``size`` window (padding with 0 where it is larger than the canvas), as
    torchvision v2's ``CenterCrop``."""

    fill = 0

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _size_pair(size, "CenterCrop")

    def plan(self, g: Geometry, boxes_xyxy: np.ndarray | None = None) -> None:
        (h, w), (ch, cw) = g.canvas, self.size
        top, box_top = _anchor(h, ch)
        left, box_left = _anchor(w, cw)
        g.crop(top, left, ch, cw, target_origin=(box_top, box_left))

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


def _anchor(n: int, c: int) -> tuple[int, int]:
    """(where the image's window starts, where targets' does) along an axis of ``n`` pixels."""
    targets = int(round((n - c) / 2.0))
    return (-((c - n) // 2) if c > n else targets), targets


class RandomZoomOut:
    """SSD's zoom out (torchvision's ``RandomZoomOut``): with probability ``p`` the canvas grows
    by a factor drawn from ``side_range`` and the image lands at a drawn place on it; the image
    is padded with ``fill`` (an int or one per channel), masks with 0."""

    def __init__(self, fill: int | Sequence[int] = 0,
                 side_range: Sequence[float] = (1.0, 4.0), p: float = 0.5) -> None:
        if len(side_range) != 2 or not 1.0 <= side_range[0] <= side_range[1]:
            raise ValueError(f"RandomZoomOut: side_range must be (lo, hi) with 1 <= lo <= hi, "
                             f"got {side_range!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomZoomOut: p must be in [0, 1], got {p}")
        self.fill = _fill(fill)
        self.side_range = (float(side_range[0]), float(side_range[1]))
        self.p = float(p)

    def plan(self, g: Geometry, boxes_xyxy: np.ndarray | None = None) -> None:
        if torch.rand(1) >= self.p:  # torchvision's _RandomApplyTransform draw
            return
        h, w = g.canvas
        lo, hi = self.side_range
        r = lo + torch.rand(1) * (hi - lo)  # float32 tensor arithmetic, as torchvision
        canvas_w, canvas_h = int(w * r), int(h * r)
        r = torch.rand(2)
        left, top = int((canvas_w - w) * r[0]), int((canvas_h - h) * r[1])
        g.pad(left, top, canvas_w - left - w, canvas_h - top - h)

    def __repr__(self) -> str:
        return f"RandomZoomOut(fill={self.fill}, side_range={self.side_range}, p={self.p})"


def _fill(fill: Any) -> int | tuple[int, ...]:
    """An image fill as uint8 values: an int or one int per channel (integral floats allowed)."""
    values = [fill] if isinstance(fill, (int, float)) else list(fill)
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float))
                         or v != int(v) or not 0 <= v <= 255 for v in values):
        raise ValueError(f"fill must be integers in [0, 255], got {fill!r}")
    ints = tuple(int(v) for v in values)
    return ints[0] if len(ints) == 1 else ints


class TorchResize:
    """torchvision v2's ``Resize(size, max_size=...)`` output size, exactly: ``size`` an int (the
    shorter side, the longer capped at ``max_size``), (h, w), or None with ``max_size`` (the
    longer side to ``max_size``, up or down)."""

    def __init__(self, size: int | Sequence[int] | None, max_size: int | None = None) -> None:
        if size is None and max_size is None:
            raise ValueError("TorchResize needs size and/or max_size")
        if size is not None:
            size = [size] if isinstance(size, int) else [int(v) for v in size]
            if len(size) not in (1, 2) or min(size) < 1 or (len(size) == 2 and max_size):
                raise ValueError(f"TorchResize: size must be an int or (h, w) without "
                                 f"max_size, got {size!r}, max_size={max_size!r}")
        if max_size is not None and (max_size < 1 or (size and max_size <= size[0])):
            raise ValueError(f"TorchResize: max_size must exceed size, got {max_size}")
        self.size, self.max_size = (tuple(size) if size else None), max_size

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        short, long = (w, h) if w <= h else (h, w)
        if self.size is None:
            short, long = int(self.max_size * short / long), self.max_size
        elif len(self.size) == 2:
            return self.size
        else:
            short, long = self.size[0], int(self.size[0] * long / short)
            if self.max_size is not None and long > self.max_size:
                short, long = int(self.max_size * short / long), self.max_size
        return (long, short) if w <= h else (short, long)

    def plan(self, g: Geometry, boxes_xyxy: np.ndarray | None = None) -> None:
        g.resize(*self.out_hw(*g.canvas))

    def __repr__(self) -> str:
        return f"TorchResize(size={self.size}, max_size={self.max_size})"


class RandomShortestSize:
    """torchvision's ``RandomShortestSize``: the shorter side to one of ``min_size`` (drawn with
    ``torch.randint``), the longer capped at ``max_size``."""

    def __init__(self, min_size: int | Sequence[int], max_size: int | None = None) -> None:
        self.min_size = [min_size] if isinstance(min_size, int) else [int(v) for v in min_size]
        if not self.min_size or min(self.min_size) < 1 or (max_size is not None
                                                           and max_size < 1):
            raise ValueError(f"RandomShortestSize: sizes must be >= 1, got {min_size!r}, "
                             f"{max_size!r}")
        self.max_size = max_size

    def plan(self, g: Geometry, boxes_xyxy: np.ndarray | None = None) -> None:
        h, w = g.canvas
        size = self.min_size[int(torch.randint(len(self.min_size), ()))]
        r = size / min(h, w)
        if self.max_size is not None:
            r = min(r, self.max_size / max(h, w))
        g.resize(int(h * r), int(w * r))

    def __repr__(self) -> str:
        return f"RandomShortestSize(min_size={self.min_size}, max_size={self.max_size})"


class ClampBoundingBoxes:
    """Clamp boxes to the canvas (torchvision's ``ClampBoundingBoxes``); the image is untouched."""

    def plan(self, g: Geometry, boxes_xyxy: np.ndarray | None = None) -> None:
        g.crop(0, 0, *g.canvas)

    def __repr__(self) -> str:
        return "ClampBoundingBoxes()"


def fills_agree(ops: Sequence[Any]) -> bool:
    """Whether every op that may pad the image pads it with the same fill (the fused render has
    one fill)."""
    return len({repr(op.fill) for op in ops if getattr(op, "fill", None) is not None}) <= 1


__all__ = ["CenterCrop", "RandomZoomOut", "TorchResize", "RandomShortestSize",
           "ClampBoundingBoxes", "fills_agree"]
