"""Compose: run ops through buffers planned once per process, writing the last one into ``out``.

At construction the ops are grouped into stages: a resizing op (``RandomResizedCrop``,
``Resize``) absorbs the ``RandomHorizontalFlip`` / ``ToCHW`` / ``Normalize`` right after it and
becomes one ``crop_resize_flip_chw`` call (one pass, no intermediate image). A leading
``DecodeImage`` followed by a resizing op is fused with it: the box is sampled from the JPEG
header's size, then the JPEG is decoded at the largest DCT scale (1/2, 1/4, 1/8) that keeps the
box at least as large as the output and, with the compiled "roi" decoder, only the part of the
image that the resize reads (see vision/io/decode.py). Random parameters are drawn in op order, so
fusing does not change which crops and flips a seed gives.

Per process, each stage's output spec is computed once per input spec (a small cache) and its
buffer is a grow-only scratch buffer; the decode buffer is sized for the image's full-size decode
(up to 64 MiB) whatever scale is used, so once every image has been seen nothing is allocated per
sample (see ``stats()``). The last stage writes into the caller's ``out`` when shape and dtype
match.

Each call books its time per stage on ``pooled_loader.observability.stages.CLOCK`` ("decode", "crop_resize"
for a resize with what is folded into it, else the op's name: "flip", "normalize", ...), which
the loader reports in ``stats()["stages"]``: one clock read per stage.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import NamedTuple, Sequence

import numpy as np

from pooled_loader.observability.stages import CLOCK, perf_counter_ns
from pooled_loader.vision.base import Box, Op, Spec
from pooled_loader.vision.io.buffers import Scratch
from pooled_loader.vision.io.decode import (JPEG_SCALES, Buffer, DecodeImage, decode_crop_into,
                                            decode_into, read_header)
from pooled_loader.vision.io.decode import scale_box  # noqa: F401  (kept importable from here)
from pooled_loader.vision.io.kernels import crop_resize_flip_chw, flip_horizontal_, resize_hwc
from pooled_loader.vision.ops.geometry import Normalize, RandomHorizontalFlip, Resampler, ToCHW

_PLAN_CACHE = 32  # input specs remembered per stage
_RESERVE_MAX = 64 << 20  # decode buffers are pre-sized for a full decode up to this many bytes


class _Resample(NamedTuple):
    """A resizing op plus the flip / CHW / normalize folded into it."""

    op: Resampler
    flip: RandomHorizontalFlip | None
    chw: bool
    norm: Normalize | None

    def spec(self, spec: Spec) -> Spec:
        """The output of the resize and the ops folded into it, from their own declarations."""
        spec = self.op.spec(spec)
        if self.chw:
            spec = ToCHW().spec(spec)
        return self.norm.spec(spec) if self.norm is not None else spec


def _stages(ops: Sequence[Op]) -> list:
    stages: list = []
    i = 0
    while i < len(ops):
        op = ops[i]
        if isinstance(op, DecodeImage) and i > 0:
            raise ValueError("DecodeImage must be the first op")
        if not isinstance(op, Resampler):
            stages.append(op)
            i += 1
            continue
        flip, chw, norm = None, False, None
        i += 1
        while i < len(ops):
            nxt = ops[i]
            if isinstance(nxt, RandomHorizontalFlip) and flip is None:
                flip = nxt
            elif isinstance(nxt, ToCHW) and not chw:
                chw = True
            elif isinstance(nxt, Normalize) and chw and norm is None:
                norm = nxt
            else:
                break
            i += 1
        stages.append(_Resample(op, flip, chw, norm))
    return stages


_STAGE_NAMES = {"RandomHorizontalFlip": "flip", "Normalize": "normalize", "ToCHW": "to_chw"}


def stage_name(stage: object) -> str:
    """The name a stage's time is booked under in ``stats()["stages"]``."""
    if isinstance(stage, _Resample):
        return "crop_resize"
    name = type(stage).__name__
    return _STAGE_NAMES.get(name) or "".join(
        f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def dct_factor(box: Box, out_hw: tuple[int, int]) -> int:
    """Largest JPEG DCT downscale factor that keeps the box >= out_hw (1 if none does)."""
    bw, bh = box[2], box[3]
    for f in reversed(JPEG_SCALES):
        if bw // f >= out_hw[1] and bh // f >= out_hw[0]:
            return f
    return 1


class Compose:
    """Chain ops; ``compose(x, out=None)`` returns the result, written into ``out`` if it fits.

    ``x`` is encoded image bytes when the first op is :class:`DecodeImage`, else an HWC array.
    Without ``out`` (or with one of another shape/dtype) the result is a new array.
    ``dct_scaling=False`` always decodes JPEGs at full size (slower; for comparisons).
    The buffers belong to the process (a forked or unpickled copy starts with none); one thread
    at a time: threads that share a Compose would share its buffers.
    """

    def __init__(self, ops: Sequence[Op], dct_scaling: bool = True) -> None:
        self.ops = list(ops)
        self.dct_scaling = dct_scaling
        for op in self.ops:
            if not isinstance(op, Op):
                raise TypeError(f"Compose takes pooled_loader.vision ops, got {op!r}")
        self._decode = bool(self.ops) and isinstance(self.ops[0], DecodeImage)
        self._stages = _stages(self.ops[1:] if self._decode else self.ops)
        # the resize a leading DecodeImage is fused with (its box is sampled on the header's size)
        first = self._stages[0] if self._decode and self._stages else None
        self._fused = first if isinstance(first, _Resample) else None
        self._names = [stage_name(st) for st in self._stages]
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self.scratch = scratch = Scratch()
        self._decode_alloc = lambda n: scratch.flat("decode", n)
        self._plans: OrderedDict[tuple, Spec] = OrderedDict()
        self.plans_made = 0
        self.dct_scaled = 0  # samples decoded with a DCT downscale (a counter for tests/benches)
        self.roi_decoded = 0  # samples of which only the crop's region was decoded

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("scratch", "_plans", "_pid", "_decode_alloc"):
            state.pop(k)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    def stats(self) -> dict:
        """Counters: buffer allocations, bytes held, plans computed, DCT-scaled and region
        (ROI) decodes."""
        return {"allocations": self.scratch.allocations, "scratch_bytes": self.scratch.nbytes,
                "plans_made": self.plans_made, "dct_scaled": self.dct_scaled,
                "roi_decoded": self.roi_decoded}

    # -- planning

    def _plan(self, k: int, spec: Spec, hw: tuple[int, int] | None = None,
              src_hw: tuple[int, int] | None = None) -> Spec:
        """Stage k's output spec for input ``spec``, cached; for a resize, ``hw`` is its output
        size and ``src_hw`` the size its box was sampled on (which stands in for spec's)."""
        st = self._stages[k]
        # a resize's output depends on the target size and channels, not on the input's size
        key = (k, spec.shape[2:], spec.dtype, spec.layout, hw) if hw else (k, spec)
        out = self._plans.get(key)
        if out is None:
            if hw:  # validates (HWC uint8) as on the size the box was sampled on
                spec = Spec((*src_hw, *spec.shape[2:]), spec.dtype, spec.layout)
            out = st.spec(spec)
            self._plans[key] = out
            self.plans_made += 1
            if len(self._plans) > _PLAN_CACHE * max(1, len(self._stages)):
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return out

    def _dst(self, k: int, spec: Spec, out: np.ndarray | None, last: bool) -> np.ndarray:
        if not last:
            return self.scratch.array(k, spec.shape, spec.dtype)
        if (out is not None and out.shape == spec.shape and out.dtype == spec.dtype
                and out.flags.c_contiguous and out.flags.writeable):
            return out
        return np.empty(spec.shape, spec.dtype)  # the caller's own result: not scratch

    # -- running

    def __call__(self, x: Buffer | np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if os.getpid() != self._pid:  # a forked worker: its own buffers
            self._reset()
        fused = None
        start = perf_counter_ns()
        if self._decode:
            hdr = read_header(x)
            full = (hdr.height, hdr.width)
            if self._fused is not None:
                box, hw = self._fused.op.sample(*full)
                factor = dct_factor(box, hw) if hdr.jpeg and self.dct_scaling else 1
                # size the buffer for this image's full decode, so that once every image has
                # been seen, whichever scale a later crop picks, nothing is allocated again
                self.scratch.reserve("decode", min(hdr.height * hdr.width * 3, _RESERVE_MAX))
                crop = decode_crop_into(x, hdr, self._decode_alloc, factor, box, hw,
                                        self.ops[0].fast)
                img, box = crop.image, crop.box
                self.dct_scaled += crop.scaled
                self.roi_decoded += crop.region
                fused = (box, hw, full)
            else:
                spec = Spec((*full, 3), np.dtype(np.uint8), "HWC")
                dst = self._dst(-1, spec, out, not self._stages)
                flat = dst.reshape(-1)
                img = decode_into(x, hdr, lambda n: flat, fast=self.ops[0].fast)
            start = CLOCK.add("decode", start, perf_counter_ns())
        else:
            img = np.asarray(x)
            if img.ndim == 2:
                img = img[:, :, None]
        return self._run(img, fused, out, start)

    def _run(self, cur: np.ndarray, fused: tuple | None, out: np.ndarray | None,
             start: int) -> np.ndarray:
        """Stages from the first; ``fused``: (box on cur, output hw, full-size hw) already
        sampled for stage 0 by the fused decode; ``start``: the clock when stage 0 began."""
        spec = Spec(cur.shape, cur.dtype, "HWC")
        n = len(self._stages)
        for k, st in enumerate(self._stages):
            last = k == n - 1
            if isinstance(st, _Resample):
                if k == 0 and fused:  # fused with the decode: sampled on the full size
                    box, hw, src_hw = fused
                else:
                    src_hw = cur.shape[:2]
                    box, hw = st.op.sample(*src_hw)
                flip = st.flip.draw() if st.flip is not None else False
                nspec = self._plan(k, spec, hw, src_hw)
                dst = self._dst(k, nspec, out, last)
                if st.chw:
                    if cur.strides[1:] != (cur.shape[2], 1):  # the kernel wants packed pixels
                        cur = np.ascontiguousarray(cur)
                    mean, std = (st.norm.mean, st.norm.std) if st.norm else (None, None)
                    crop_resize_flip_chw(cur, box, dst, flip, mean, std)
                else:
                    resize_hwc(cur, box, dst)
                    if flip:
                        flip_horizontal_(dst)
            else:
                params = st.draw(spec)
                nspec = self._plan(k, spec)
                dst = self._dst(k, nspec, out, last)
                st.apply(cur, dst, params, spec)
            start = CLOCK.add(self._names[k], start, perf_counter_ns())
            cur, spec = dst, nspec
        if cur is out:
            return out
        if out is not None and out.shape == cur.shape and out.dtype == cur.dtype:
            np.copyto(out, cur)  # out fits but is not C-contiguous: copy into it
            return out
        if n == 0 and not self._decode:
            return cur.copy()  # never hand the caller's input back as the result
        return cur

    def __repr__(self) -> str:
        return "Compose([" + ", ".join(repr(op) for op in self.ops) + "])"
