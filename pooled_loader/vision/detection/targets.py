"""Geometry of detection targets: boxes, masks and keypoints through the image's crops, resizes,
flips and pads, with torchvision v2's arithmetic.

Why a module of its own: the image ops (vision/ops/) move pixels; here the same drawn
parameters move everything that is *about* the pixels, with numpy only, so that the
detection glue (vision/detection/compose.py) can run both from one list of steps. Imports: numpy;
OpenCV (a blocked transpose) where it is installed.

A :class:`Geometry` is the list of steps one sample went through, each on the canvas the step
before left: ``crop(top, left, height, width)`` (a window that may reach past the canvas: what
lies outside is padding), ``resize(height, width)``, ``flip()`` (left-right) and ``pad(left,
top, right, bottom)``. What torchvision does to a target for each step is what happens here:

- boxes: crop subtracts the window's corner and clamps to the new canvas, pad adds and clamps,
  resize scales (unclamped, as torchvision), flip mirrors ``x -> W - x``; kept in float32 XYXY
  between steps, with torchvision's float32 operations (XYXY boxes come out bit-equal), and
  written back in the input's format (XYXY, XYWH or CXCYWH).
- keypoints: the same, but flip is ``x -> W - 1 - x`` and nothing clamps (torchvision's rules);
  a point that leaves a crop window loses its visibility (set to 0), which torchvision has no
  notion of.
- masks: nearest-neighbour index maps, one per axis, composed step by step with torch's
  "nearest" rule (``src = min(floor(dst * float32(in / out)), in - 1)``, computed in float32
  as torch computes it), then gathered once from the source mask straight into the output
  buffer (:func:`gather_masks`: row copies and OpenCV's blocked transpose, in whatever layout
  the mask is stored, pycocotools' column-major included; numpy's gather without OpenCV): a
  semantic mask's values are copied, never thresholded.
  Padding reads as 0.

:func:`sanitize` is torchvision's ``SanitizeBoundingBoxes`` rule (width and height >= min_size,
area >= min_area, every coordinate inside the canvas); which rows it drops is the detection
glue's business.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

FORMATS = ("XYXY", "XYWH", "CXCYWH")


def box_format(fmt: object) -> str:
    """The format's name ("XYXY", "XYWH" or "CXCYWH") from a string or a
    ``tv_tensors.BoundingBoxFormat``; ValueError for rotated or unknown formats."""
    name = str(getattr(fmt, "name", fmt)).upper()
    if name not in FORMATS:
        raise ValueError(f"bounding box format {fmt!r} is not supported (one of {FORMATS}; "
                         "rotated boxes run as torchvision's own code)")
    return name


def to_xyxy(boxes: np.ndarray, fmt: str) -> np.ndarray:
    """[N, 4] boxes of format ``fmt`` as a new float32 XYXY array."""
    b = np.array(boxes, dtype=np.float32, copy=True).reshape(-1, 4)
    if fmt == "XYWH":
        b[:, 2:] += b[:, :2]
    elif fmt == "CXCYWH":
        half = b[:, 2:] / 2
        b[:, :2], b[:, 2:] = b[:, :2] - half, b[:, :2] + half
    return b


def from_xyxy(b: np.ndarray, fmt: str) -> np.ndarray:
    """float32 XYXY [N, 4] -> a new array in ``fmt``."""
    out = b.copy()
    if fmt == "XYWH":
        out[:, 2:] -= out[:, :2]
    elif fmt == "CXCYWH":
        out[:, :2] = (b[:, :2] + b[:, 2:]) / 2
        out[:, 2:] = b[:, 2:] - b[:, :2]
    return out


class Step(NamedTuple):
    """One geometric step: ``kind`` is "crop" (top, left, height, width), "resize" (height,
    width), "flip" () or "pad" (left, top, right, bottom); ``canvas`` is the (height, width) it
    was applied to."""

    kind: str
    args: tuple[int, ...]
    canvas: tuple[int, int]


class Geometry:
    """The steps one sample's image went through, from a source canvas of (height, width)."""

    def __init__(self, height: int, width: int) -> None:
        if height < 1 or width < 1:
            raise ValueError(f"a canvas needs pixels, got {width}x{height}")
        self.source = (int(height), int(width))
        self.canvas = self.source
        self.steps: list[Step] = []
        # the box of each crop in which a box's centre must lie to be kept (RandomIoUCrop)
        self.center_windows: dict[int, tuple[int, int, int, int]] = {}
        # crops whose boxes and keypoints move by another corner than the image (CenterCrop)
        self.target_origins: dict[int, tuple[int, int]] = {}

    def crop(self, top: int, left: int, height: int, width: int,
             keep_centers: bool = False, target_origin: tuple[int, int] | None = None) -> None:
        """A window of the current canvas (padding where it reaches past it); with
        ``keep_centers`` (RandomIoUCrop) boxes whose centre lies outside it become all-zero;
        ``target_origin`` (top, left): the corner boxes and keypoints move by, when not the
        image's (torchvision's CenterCrop past the image)."""
        if height < 1 or width < 1:
            raise ValueError(f"a crop needs pixels, got {width}x{height}")
        if keep_centers:
            self.center_windows[len(self.steps)] = (top, left, height, width)
        if target_origin is not None and tuple(target_origin) != (top, left):
            self.target_origins[len(self.steps)] = (int(target_origin[0]), int(target_origin[1]))
        self._add("crop", (top, left, height, width), (height, width))

    def resize(self, height: int, width: int) -> None:
        if height < 1 or width < 1:
            raise ValueError(f"a resize needs pixels, got {width}x{height}")
        if (height, width) != self.canvas:  # torchvision returns targets unchanged then
            self._add("resize", (height, width), (height, width))

    def flip(self) -> None:
        self._add("flip", (), self.canvas)

    def pad(self, left: int, top: int, right: int, bottom: int) -> None:
        if min(left, top, right, bottom) < 0:
            raise ValueError(f"padding must be >= 0, got {(left, top, right, bottom)}")
        h, w = self.canvas
        self._add("pad", (left, top, right, bottom), (h + top + bottom, w + left + right))

    def _add(self, kind: str, args: tuple, new_canvas: tuple[int, int]) -> None:
        self.steps.append(Step(kind, tuple(int(a) for a in args), self.canvas))
        self.canvas = (int(new_canvas[0]), int(new_canvas[1]))

    # -- boxes

    def boxes(self, boxes: np.ndarray, fmt: str = "XYXY", integer: bool = False) -> np.ndarray:
        """[N, 4] boxes in ``fmt`` on the source canvas -> float32 [N, 4] in ``fmt`` on the
        final canvas. ``integer``: integer boxes (torchvision's VOC wrapper makes int64 boxes),
        truncated after each resize as torchvision's kernels cast back to the boxes' dtype."""
        b = to_xyxy(boxes, fmt)
        for i, (kind, args, (h, w)) in enumerate(self.steps):
            if kind == "crop":
                top, left, ch, cw = args
                top, left = self.target_origins.get(i, (top, left))
                if i in self.center_windows:
                    cx, cy = (b[:, 0] + b[:, 2]) * 0.5, (b[:, 1] + b[:, 3]) * 0.5
                    inside = (left < cx) & (cx < left + cw) & (top < cy) & (cy < top + ch)
                b -= (left, top, left, top)
                _clamp(b, ch, cw)
                if i in self.center_windows:
                    b[~inside] = 0.0
            elif kind == "resize":
                oh, ow = args
                b *= np.array((ow / w, oh / h, ow / w, oh / h), np.float32)
                if integer:
                    np.trunc(b, out=b)
            elif kind == "flip":
                b[:, [0, 2]] = w - b[:, [2, 0]]
            else:
                left, top, right, bottom = args
                b += (left, top, left, top)
                _clamp(b, h + top + bottom, w + left + right)
        return from_xyxy(b, fmt)

    # -- keypoints

    def keypoints(self, points: np.ndarray,
                  visibility: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[..., 2] (x, y) points on the source canvas -> (float32 points on the final canvas,
        uint8 visibility [...]: the given one (1 where None), 0 where a crop left them out)."""
        p = np.array(points, dtype=np.float32, copy=True)
        if p.shape[-1:] != (2,):
            raise ValueError(f"keypoints must have shape [..., 2], got {p.shape}")
        vis = (np.ones(p.shape[:-1], np.uint8) if visibility is None
               else np.array(visibility, np.uint8).reshape(p.shape[:-1]))
        for i, (kind, args, (h, w)) in enumerate(self.steps):
            if kind == "crop":
                top, left, ch, cw = args
                top, left = self.target_origins.get(i, (top, left))
                p -= (left, top)
                out = ((p[..., 0] < 0) | (p[..., 0] >= cw) | (p[..., 1] < 0) | (p[..., 1] >= ch))
                vis[out] = 0
            elif kind == "resize":
                p *= np.array((args[1] / w, args[0] / h), np.float32)
            elif kind == "flip":
                p[..., 0] = np.float32(w - 1) - p[..., 0]
            else:
                p += (args[0], args[1])
        return p, vis

    # -- masks

    def index_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, cols): for each output row / column, the source row / column it reads (-1
        where it reads padding)."""
        rows = np.arange(self.source[0], dtype=np.int64)
        cols = np.arange(self.source[1], dtype=np.int64)
        for kind, args, (h, w) in self.steps:
            if kind == "crop":
                top, left, ch, cw = args
                rows, cols = _window(rows, top, ch), _window(cols, left, cw)
            elif kind == "resize":
                rows, cols = rows[_nearest(h, args[0])], cols[_nearest(w, args[1])]
            elif kind == "flip":
                cols = cols[::-1]
            else:
                left, top, right, bottom = args
                rows = np.concatenate([np.full(top, -1), rows, np.full(bottom, -1)])
                cols = np.concatenate([np.full(left, -1), cols, np.full(right, -1)])
        return rows, cols

    def mask_shape(self, mask_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape of a [H, W] (semantic) or [N, H, W] (instance) mask."""
        return (*mask_shape[:-2], *self.canvas)

    def masks(self, masks: np.ndarray, out: np.ndarray | None = None,
              maps: tuple[np.ndarray, np.ndarray] | None = None,
              select: np.ndarray | None = None) -> np.ndarray:
        """Resample a [H, W] or [N, H, W] mask (H, W the source canvas; any memory layout,
        pycocotools' column-major masks included) with nearest neighbour into ``out``
        (allocated when None); values are copied, padding is 0. ``select``: the instances to
        keep (indices into N), read in place rather than copied out first."""
        if hasattr(masks, "decode_instances"):  # coco.RleMasks: only the instances kept
            m, select = masks.decode_instances(select), None
        else:
            m = np.asarray(masks)
        if m.ndim not in (2, 3) or m.shape[-2:] != self.source:
            raise ValueError(f"a mask must be [H, W] or [N, H, W] with (H, W) = {self.source}, "
                             f"got {m.shape}")
        picked = range(len(m)) if select is None or m.ndim == 2 else \
            [int(i) for i in np.asarray(select).reshape(-1)]
        shape = self.mask_shape((len(picked), *m.shape[1:]) if m.ndim == 3 else m.shape)
        if out is None:
            out = np.empty(shape, m.dtype)
        elif out.shape != shape:
            raise ValueError(f"mask out has shape {out.shape}, the result {shape}")
        rows, cols = maps if maps is not None else self.index_maps()
        if m.ndim == 2:
            gather(m, rows, cols, out)
        elif not gather_masks(m, picked, rows, cols, out):
            gather(m if select is None else m[list(picked)], rows, cols, out)
        return out


def _clamp(b: np.ndarray, h: int, w: int) -> None:
    np.clip(b[:, 0::2], 0, w, out=b[:, 0::2])
    np.clip(b[:, 1::2], 0, h, out=b[:, 1::2])


def _window(idx: np.ndarray, start: int, length: int) -> np.ndarray:
    """``idx[start:start + length]`` with -1 where the window leaves ``idx``."""
    out = np.full(length, -1, np.int64)
    lo, hi = max(start, 0), min(start + length, len(idx))
    if hi > lo:
        out[lo - start:hi - start] = idx[lo:hi]
    return out


def _nearest(n_in: int, n_out: int) -> np.ndarray:
    """torch's "nearest" source index per output index (float32 arithmetic, as ATen's CPU
    kernel: identity for equal sizes, ``i >> 1`` for an exact 2x upscale)."""
    if n_in == n_out:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    scale = np.float32(n_in) / np.float32(n_out)
    src = np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64)
    return np.minimum(src, n_in - 1)


def _valid_run(idx: np.ndarray) -> tuple[int, int]:
    """[start, stop) of the entries >= 0 (one contiguous run: padding only ever borders)."""
    ok = np.flatnonzero(idx >= 0)
    return (int(ok[0]), int(ok[-1]) + 1) if len(ok) else (0, 0)


_CV_DTYPES = (np.uint8, np.int8, np.uint16, np.int16, np.int32, np.float32, np.float64)


def gather_masks(m: np.ndarray, picked: Any, rows: np.ndarray, cols: np.ndarray,
                 out: np.ndarray) -> bool:
    """``out[k] = m[picked[k]][rows][:, cols]`` (0 where an index is -1) for instance masks
    stored row-major or column-major (pycocotools decodes column-major), each pass a copy of
    whole rows (``np.take`` along the first axis) or OpenCV's blocked transpose, never a
    per-pixel gather or a numpy transposing copy (both ~10x slower). Column-major: the source
    columns, transposed, then the rows, straight into ``out``. False (nothing written) when
    OpenCV is absent or the masks do not suit it; :func:`gather` then does it."""
    from pooled_loader.vision.io.kernels import transpose_into  # (OpenCV, loaded there lazily)
    if not _opencv() or not len(picked) or not out.flags.c_contiguous or m.dtype != out.dtype:
        return False
    src_all, dst_all = m, out
    if m.dtype == np.bool_:  # the same bytes, as uint8
        src_all, dst_all = m.view(np.uint8), out.view(np.uint8)
    elif m.dtype.type not in _CV_DTYPES:
        return False
    first = src_all[picked[0]]  # one array: every mask has the same layout
    column_major = not first.flags.c_contiguous
    if column_major and not first.T.flags.c_contiguous:
        return False
    r0, r1 = _valid_run(rows)
    c0, c1 = _valid_run(cols)
    if r0 > 0 or c0 > 0 or r1 < len(rows) or c1 < len(cols):
        out.fill(0)
    if r1 <= r0 or c1 <= c0:
        return True
    r, c = rows[r0:r1], cols[c0:c1]
    h, w = first.shape
    dt = src_all.dtype
    if column_major:
        taken, turned = np.empty((len(c), h), dt), np.empty((h, len(c)), dt)
    else:
        taken, turned = np.empty((len(r), w), dt), np.empty((w, len(r)), dt)
        cols_taken, back = np.empty((len(c), len(r)), dt), np.empty((len(r), len(c)), dt)
    for k, i in enumerate(picked):
        dst = dst_all[k, r0:r1, c0:c1]
        if column_major:  # stored rows are the mask's columns
            np.take(src_all[i].T, c, axis=0, out=taken, mode="clip")
            transpose_into(taken, turned)
            np.take(turned, r, axis=0, out=dst, mode="clip")
        else:
            np.take(src_all[i], r, axis=0, out=taken, mode="clip")
            transpose_into(taken, turned)
            np.take(turned, c, axis=0, out=cols_taken, mode="clip")
            transpose_into(cols_taken, back)
            np.copyto(dst, back)
    return True


_OPENCV: list = []


def _opencv() -> bool:
    """True when OpenCV imports (asked once, through vision.kernels)."""
    if not _OPENCV:
        from pooled_loader.vision.io.kernels import transpose_into
        _OPENCV.append(transpose_into(np.zeros((1, 1), np.uint8), np.zeros((1, 1), np.uint8)))
    return _OPENCV[0]


def gather(m: np.ndarray, rows: np.ndarray, cols: np.ndarray, out: np.ndarray) -> None:
    """``out[..., i, j] = m[..., rows[i], cols[j]]`` (0 where an index is -1), one pass."""
    r0, r1 = _valid_run(rows)
    c0, c1 = _valid_run(cols)
    if r0 > 0 or c0 > 0 or r1 < len(rows) or c1 < len(cols):
        out.fill(0)
    if r1 <= r0 or c1 <= c0 or m.size == 0:
        return
    r, c = rows[r0:r1], cols[c0:c1]
    dst = out[..., r0:r1, c0:c1]
    rstep, cstep = _stride(r), _stride(c)
    if rstep is not None and cstep is not None:  # a plain window, maybe mirrored: a strided copy
        np.copyto(dst, m[..., _as_slice(r, rstep), _as_slice(c, cstep)])
    else:  # rows, then columns: two gathers, the second straight into ``out``
        rows_taken = np.take(m, r, axis=-2)
        if dst.flags.c_contiguous:
            np.take(rows_taken, c, axis=-1, out=dst)
        else:
            np.copyto(dst, np.take(rows_taken, c, axis=-1))


def _stride(idx: np.ndarray) -> int | None:
    if len(idx) == 1:
        return 1
    d = np.diff(idx)
    return int(d[0]) if d[0] in (1, -1) and (d == d[0]).all() else None


def _as_slice(idx: np.ndarray, step: int) -> slice:
    stop = int(idx[-1]) + step
    return slice(int(idx[0]), None if stop < 0 else stop, step)


def sanitize(boxes_xyxy: np.ndarray, canvas: tuple[int, int], min_size: float = 1.0,
             min_area: float = 1.0) -> np.ndarray:
    """torchvision's SanitizeBoundingBoxes rule: bool [N], True for boxes to keep."""
    b = np.asarray(boxes_xyxy, np.float32).reshape(-1, 4)  # torchvision's float32 arithmetic
    ws, hs = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    h, w = canvas
    return ((ws >= min_size) & (hs >= min_size) & (b >= 0).all(axis=1) & (ws * hs >= min_area)
            & (b[:, 0] <= w) & (b[:, 2] <= w) & (b[:, 1] <= h) & (b[:, 3] <= h))
