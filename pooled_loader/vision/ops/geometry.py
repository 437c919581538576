"""Image ops that declare their output and write into a given buffer.

Every op maps an input :class:`Spec` (shape, dtype, layout) to its output spec, draws its random
parameters (``draw``, from the worker-seeded ``random`` module, in pipeline order) and writes its
result into ``out`` (``apply``); the contract lives in vision/base.py (``Resampler``, the
resizing ops' base, here), and these ops import nothing above vision/io/.
:class:`~pooled_loader.vision.Compose` sizes the buffers from the specs and fuses a resizing op
with a following flip / ``ToCHW`` / ``Normalize`` into one ``kernels.crop_resize_flip_chw`` call.
Images are uint8 HWC (RGB) until ``ToCHW``.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import numpy as np

from pooled_loader.vision.base import Box, Op, Size, Spec  # noqa: F401  (re-exported)
from pooled_loader.vision.base import hwc as _hwc
from pooled_loader.vision.base import pair as _pair
from pooled_loader.vision.io.kernels import resize_hwc
from pooled_loader.vision.ops.crop_box import PYTHON_RANDOM, resized_crop_box


# ---------------------------------------------------------------- resizing ops (fusable)

class Resampler(Op):
    """An op that resizes a box of its input: ``sample(h, w) -> (box, (out_h, out_w))``.

    Alone it resizes with :func:`~pooled_loader.vision.io.kernels.resize_hwc`; in a ``Compose`` a
    following flip / ``ToCHW`` / ``Normalize`` is fused into the same kernel call.
    """

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        """Output (height, width) for an h x w input."""
        raise NotImplementedError

    def sample(self, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        """The box to resize (drawing from ``random`` if the op is random) and the output size."""
        raise NotImplementedError

    def spec(self, spec: Spec) -> Spec:
        h, w, c = _hwc(spec, type(self).__name__)
        if spec.dtype != np.uint8:
            raise ValueError(f"{type(self).__name__} expects uint8, got {spec.dtype}")
        return Spec((*self.out_hw(h, w), c), spec.dtype, "HWC")

    def draw(self, spec: Spec) -> tuple[Box, tuple[int, int]]:
        return self.sample(*spec.shape[:2])

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        box, _ = params  # type: ignore[misc]
        return resize_hwc(x, box, out)


class RandomResizedCrop(Resampler):
    """Crop a random area/aspect box and resize it to ``size`` (torchvision's sampling).

    ``size``: int or (height, width). ``scale``: area fraction range, ``ratio``: aspect (w/h)
    range, sampled log-uniformly; 10 tries, then a centre crop clamped to ``ratio``.
    """

    def __init__(self, size: Size, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        self.size = _pair(size, "size")
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"scale and ratio must be (min, max) > 0, got {scale}, {ratio}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def box(self, h: int, w: int) -> Box:
        """Sample a crop box of an h x w image; draws from ``random``."""
        if h < 1 or w < 1:
            raise ValueError(f"RandomResizedCrop: cannot crop an image without pixels ({w}x{h})")
        return resized_crop_box(h, w, self.scale, self._log_ratio, self.ratio, PYTHON_RANDOM)

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        return self.size

    def sample(self, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        return self.box(h, w), self.size

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class Resize(Resampler):
    """Resize keeping the aspect: shorter side to ``size`` and/or longer side capped at
    ``max_side``.

    ``size`` may also be (height, width) for an exact size. With only ``max_side``, images whose
    longer side is within it are left as they are.
    """

    def __init__(self, size: Size | None = None, max_side: int | None = None) -> None:
        if size is None and max_side is None:
            raise ValueError("Resize needs size and/or max_side")
        if size is not None and not isinstance(size, int):
            size = _pair(size, "size")
            if max_side is not None:
                raise ValueError("max_side only applies when size is an int (or None)")
        elif size is not None and size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if max_side is not None and (max_side < 1 or (isinstance(size, int) and max_side < size)):
            raise ValueError(f"max_side must be >= 1 and >= size, got {max_side}")
        self.size = size
        self.max_side = max_side

    def out_hw(self, h: int, w: int) -> tuple[int, int]:
        if h < 1 or w < 1:
            raise ValueError(f"Resize: cannot resize an image without pixels ({w}x{h})")
        if isinstance(self.size, tuple):
            return self.size
        short, long = (w, h) if w <= h else (h, w)
        if self.size is not None:
            short, long = self.size, int(self.size * long / short)
        if self.max_side is not None and long > self.max_side:
            short, long = max(1, int(self.max_side * short / long)), self.max_side
        return (long, short) if w <= h else (short, long)

    def sample(self, h: int, w: int) -> tuple[Box, tuple[int, int]]:
        return (0, 0, w, h), self.out_hw(h, w)

    def __repr__(self) -> str:
        return f"Resize(size={self.size}, max_side={self.max_side})"


# ---------------------------------------------------------------- other ops

class RandomHorizontalFlip(Op):
    """Mirror left-right with probability ``p`` (HWC or CHW)."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = float(p)

    def spec(self, spec: Spec) -> Spec:
        return spec

    def draw(self, spec: Spec | None = None) -> bool:
        return random.random() < self.p

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        axis = 1 if spec.layout == "HWC" else 2
        np.copyto(out, np.flip(x, axis) if params else x)
        return out

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class CenterCrop(Op):
    """Crop the centre ``size`` (int or (height, width)); zero-pads an image smaller than that."""

    def __init__(self, size: Size) -> None:
        self.size = _pair(size, "size")

    def spec(self, spec: Spec) -> Spec:
        h, w, c = _hwc(spec, "CenterCrop")
        return Spec((*self.size, c), spec.dtype, "HWC")

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        h, w = x.shape[:2]
        ch, cw = self.size
        top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
        sy, sx = max(top, 0), max(left, 0)  # source window start
        dy, dx = max(-top, 0), max(-left, 0)  # destination window start
        n_h, n_w = min(h - sy, ch - dy), min(w - sx, cw - dx)
        if dy or dx or n_h < ch or n_w < cw:
            out.fill(0)
        np.copyto(out[dy:dy + n_h, dx:dx + n_w], x[sy:sy + n_h, sx:sx + n_w])
        return out

    def __repr__(self) -> str:
        return f"CenterCrop(size={self.size})"


class ToCHW(Op):
    """HWC -> CHW (same dtype)."""

    def spec(self, spec: Spec) -> Spec:
        h, w, c = _hwc(spec, "ToCHW")
        return Spec((c, h, w), spec.dtype, "CHW")

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        np.copyto(out, x.transpose(2, 0, 1))
        return out

    def __repr__(self) -> str:
        return "ToCHW()"


class Normalize(Op):
    """CHW -> float32 ``(x - mean) / std`` per channel; uint8 input is first scaled to [0, 1].

    Like torchvision it expects CHW, so put ``ToCHW()`` before it.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        if len(self.mean) != len(self.std) or min(self.std, default=1.0) <= 0:
            raise ValueError("mean and std need one entry per channel, std > 0")
        m = np.asarray(self.mean, np.float32)[:, None, None]
        s = np.asarray(self.std, np.float32)[:, None, None]
        self._coef = {True: (m * 255, 1 / (s * 255)), False: (m, 1 / s)}  # keyed by uint8 input

    def spec(self, spec: Spec) -> Spec:
        if spec.layout != "CHW" or spec.shape[0] != len(self.mean):
            raise ValueError(f"Normalize expects CHW with {len(self.mean)} channels, got "
                             f"{spec.layout} {spec.shape}: put ToCHW() before it")
        return Spec(spec.shape, np.dtype(np.float32), "CHW")

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        sub, mul = self._coef[x.dtype == np.uint8]
        np.subtract(x, sub, out=out)
        np.multiply(out, mul, out=out)
        return out

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"
