"""The contract every image op follows, at the bottom of ``vision/``: :class:`Spec`, :class:`Op`,
``Box``, ``Size`` and the checks ops share (``fits``, ``deliver``, ``pair``, ``hwc``).

An op declares its output (``spec``), draws its random parameters (``draw``) and writes into a
given buffer (``apply``); calling an op alone runs exactly those three steps, so an op never needs
the planner above it. The resizing ops' base, ``Resampler``, lives with them in
``vision/ops/geometry.py`` (it runs the resize kernel). The layers of vision/ are listed once, in
``pooled_loader.vision.LAYERS``. Imports nothing of the package.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import numpy as np

Size = Union[int, Sequence[int]]
Box = tuple[int, int, int, int]  # (x0, y0, width, height) in source pixels


class Spec(NamedTuple):
    """What an op consumes or produces: array shape, dtype and layout ("HWC" or "CHW")."""

    shape: tuple[int, ...]
    dtype: np.dtype
    layout: str


def fits(out: np.ndarray | None, spec: Spec) -> bool:
    """True when ``out`` can take a result of ``spec`` in place (shape, dtype, C-contiguous,
    writable)."""
    return (out is not None and out.shape == spec.shape and out.dtype == spec.dtype
            and out.flags.c_contiguous and out.flags.writeable)


def deliver(result: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Hand ``result`` back through ``out`` when it has the same shape and dtype (copying into an
    ``out`` that could not be written in place), else return ``result``."""
    if out is not None and result is not out and out.shape == result.shape \
            and out.dtype == result.dtype:
        np.copyto(out, result)
        return out
    return result


class Op:
    """Base class: ``spec`` declares the output, ``draw`` samples, ``apply`` writes into ``out``."""

    def spec(self, spec: Spec) -> Spec:
        """Output spec for an input spec (raises ValueError if the input does not fit)."""
        raise NotImplementedError

    def draw(self, spec: Spec) -> object:
        """Random parameters for one sample (None for deterministic ops)."""
        return None

    def apply(self, x: np.ndarray, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        """Write the result for input ``x`` (of ``spec``) into ``out``; return ``out``."""
        raise NotImplementedError

    def __call__(self, x: object, out: np.ndarray | None = None) -> np.ndarray:
        """Run this op alone on an HWC array (2-D: one channel): draw, declare, apply. The result
        is written into ``out`` when it fits, else into a new array."""
        img = np.asarray(x)
        if img.ndim == 2:
            img = img[:, :, None]
        spec = Spec(img.shape, img.dtype, "HWC")
        params = self.draw(spec)  # before spec(), in the order Compose draws
        out_spec = self.spec(spec)
        dst = out if fits(out, out_spec) else np.empty(out_spec.shape, out_spec.dtype)
        self.apply(img, dst, params, spec)
        return deliver(dst, out)


def pair(size: Size, name: str) -> tuple[int, int]:
    """(height, width) from an int or a (height, width) sequence, like torchvision."""
    if isinstance(size, int):
        size = (size, size)
    size = tuple(int(s) for s in size)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"{name} must be a positive int or (height, width), got {size}")
    return size  # type: ignore[return-value]


def hwc(spec: Spec, op: str) -> tuple[int, int, int]:
    """(height, width, channels) of an HWC spec; ValueError naming ``op`` otherwise."""
    if spec.layout != "HWC" or len(spec.shape) != 3:
        raise ValueError(f"{op} expects an HWC image, got {spec.layout} {spec.shape}")
    return spec.shape  # type: ignore[return-value]
