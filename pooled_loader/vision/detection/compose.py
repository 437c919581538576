"""Detection and segmentation transforms: one drawn geometry for the image and its targets.

``DetectionCompose([DecodeImage(), RandomIoUCrop(), Resize((640, 640)),
RandomHorizontalFlip(), ToCHW(), SanitizeBoundingBoxes()])(image_bytes, target)`` returns
``(image, target)``: the image as the classification path makes it (the last resize fused with
flip, CHW and normalize into one ``crop_resize_flip_chw`` call, writing into ``out``), and the
target dict with its boxes, masks and keypoints moved by the same drawn parameters
(vision/detection/targets.py holds that geometry, with torchvision v2's arithmetic).

Random parameters are drawn op by op in pipeline order, each on the canvas the ops before it left:
``RandomResizedCrop`` and ``RandomHorizontalFlip`` from ``random`` (as the classification path
does), :class:`RandomIoUCrop` from ``torch``'s generator with torchvision's own sampling code
path (the same seed gives torchvision's crop). Ops are planned, not run one by one: crops, flips
and pads only move a window over the decoded image; a resize reads that window (one kernel call)
and only a window reaching past the image (padding) is ever copied.

Target dict entries are recognised by type, then by key: ``tv_tensors.BoundingBoxes`` (format and
canvas from the tensor) or an array under "boxes" (``box_format``, default XYXY);
``tv_tensors.Mask`` or an array under "masks": [N, H, W] instance masks or an [H, W] semantic
mask; ``tv_tensors.KeyPoints`` ([..., 2]) or an array under "keypoints" ([N, K, 2], or COCO's
[N, K, 3] with visibility, which a crop that leaves a point out sets to 0). Everything else
passes through. Outputs are numpy arrays (boxes float32 in the input's format).

:class:`SanitizeBoundingBoxes` (after the last geometric op) drops the boxes torchvision's rule
drops and, row for row, their labels (``labels_getter``), instance masks and per-instance
keypoints: torchvision keeps keypoints (and would misalign them), this is the one difference.
A semantic mask is never touched. Dropped instance masks are never resampled.

Imports: vision/base, buffers, decode, kernels, ops, targets; torch (for RandomIoUCrop's draw).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from pooled_loader.core.deferred import DeferredArray
from pooled_loader.vision.base import Spec, fits
from pooled_loader.vision.detection.targets import Geometry, sanitize, to_xyxy
from pooled_loader.vision.detection.targets import box_format as format_name
from pooled_loader.vision.io.buffers import Scratch
from pooled_loader.vision.io.decode import DecodeImage, decode_into, read_header
from pooled_loader.vision.io.kernels import crop_resize_flip_chw, flip_horizontal_, resize_hwc
from pooled_loader.vision.ops.geometry import (Normalize, RandomHorizontalFlip, RandomResizedCrop,
                                               Resize, ToCHW)


class RandomIoUCrop:
    """SSD's crop (torchvision's ``RandomIoUCrop``, same arguments, same draws from ``torch``):
    a window whose IoU with at least one box (centre inside it) is at least a drawn threshold, or
    no crop. Boxes whose centre falls outside become all-zero: follow it with
    :class:`SanitizeBoundingBoxes`."""

    def __init__(self, min_scale: float = 0.3, max_scale: float = 1.0,
                 min_aspect_ratio: float = 0.5, max_aspect_ratio: float = 2.0,
                 sampler_options: Sequence[float] | None = None, trials: int = 40) -> None:
        self.min_scale, self.max_scale = float(min_scale), float(max_scale)
        self.min_aspect_ratio, self.max_aspect_ratio = float(min_aspect_ratio), \
            float(max_aspect_ratio)
        self.options = list(sampler_options) if sampler_options is not None else \
            [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
        self.trials = int(trials)

    def draw(self, canvas: tuple[int, int], xyxy: np.ndarray) -> tuple[int, int, int, int] | None:
        """(top, left, height, width) or None (leave as is). Like torchvision it retries until an
        option succeeds, so an image without boxes draws until the "as is" option comes up."""
        orig_h, orig_w = canvas
        b = np.asarray(xyxy, np.float32).reshape(-1, 4)
        cx, cy = np.float32(0.5) * (b[:, 0] + b[:, 2]), np.float32(0.5) * (b[:, 1] + b[:, 3])
        area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
        lo, span = np.float32(self.min_scale), np.float32(self.max_scale - self.min_scale)
        while True:
            idx = int(torch.randint(low=0, high=len(self.options), size=(1,)))
            min_iou = self.options[idx]
            if min_iou >= 1.0:
                return None
            for _ in range(self.trials):
                # torch draws the numbers; the float32 arithmetic on them is torchvision's
                r = lo + span * torch.rand(2).numpy()
                new_w, new_h = int(np.float32(orig_w) * r[0]), int(np.float32(orig_h) * r[1])
                if new_h == 0 or not (self.min_aspect_ratio <= new_w / new_h
                                      <= self.max_aspect_ratio):
                    continue
                r = torch.rand(2).numpy()
                left = int(np.float32(orig_w - new_w) * r[0])
                top = int(np.float32(orig_h - new_h) * r[1])
                right, bottom = left + new_w, top + new_h
                if left == right or top == bottom:
                    continue
                within = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
                if not within.any():
                    continue
                inside = b[within]  # torchvision's box_iou against the window, in float32
                iw = np.minimum(inside[:, 2], np.float32(right)) - \
                    np.maximum(inside[:, 0], np.float32(left))
                ih = np.minimum(inside[:, 3], np.float32(bottom)) - \
                    np.maximum(inside[:, 1], np.float32(top))
                inter = np.clip(iw, 0, None) * np.clip(ih, 0, None)
                union = area[within] + np.float32(new_w * new_h) - inter
                if (inter / union).max() < min_iou:
                    continue
                return top, left, new_h, new_w

    def __repr__(self) -> str:
        return (f"RandomIoUCrop(min_scale={self.min_scale}, max_scale={self.max_scale}, "
                f"options={self.options}, trials={self.trials})")


class Pad:
    """Pad the canvas by ``padding`` (int, (left/right, top/bottom) or (left, top, right,
    bottom), as torchvision); the image with ``fill``, masks with 0."""

    def __init__(self, padding: int | Sequence[int], fill: int = 0) -> None:
        p = [padding] if isinstance(padding, int) else [int(v) for v in padding]
        if len(p) == 1:
            p = p * 4
        elif len(p) == 2:
            p = [p[0], p[1], p[0], p[1]]
        if len(p) != 4 or min(p) < 0:
            raise ValueError(f"padding must be 1, 2 or 4 ints >= 0, got {padding!r}")
        self.padding = tuple(p)
        self.fill = int(fill)

    def __repr__(self) -> str:
        return f"Pad(padding={self.padding}, fill={self.fill})"


class SanitizeBoundingBoxes:
    """Drop degenerate boxes (torchvision's rule: width and height >= ``min_size``, area >=
    ``min_area``, inside the canvas) with their labels, instance masks and keypoints.
    ``labels_getter``: "default" (the "labels" key, else the first key containing "label",
    case-insensitive, as torchvision), a key, a tuple of keys, a callable on the target dict
    returning keys, or None."""

    def __init__(self, min_size: float = 1.0, min_area: float = 1.0,
                 labels_getter: Any = "default") -> None:
        if min_size < 1 or min_area < 1:
            raise ValueError(f"min_size and min_area must be >= 1, got {min_size}, {min_area}")
        self.min_size, self.min_area = float(min_size), float(min_area)
        self.labels_getter = labels_getter

    def label_keys(self, target: dict) -> tuple:
        g = self.labels_getter
        if g is None:
            return ()
        if g == "default":
            keys = [k for k in target if isinstance(k, str) and k.lower() == "labels"] or \
                [k for k in target if isinstance(k, str) and "label" in k.lower()]
            return tuple(keys[:1])
        if callable(g):
            g = g(target)
        return (g,) if isinstance(g, str) else tuple(g)

    def __repr__(self) -> str:
        return (f"SanitizeBoundingBoxes(min_size={self.min_size}, min_area={self.min_area}, "
                f"labels_getter={self.labels_getter!r})")


_GEOMETRIC = (RandomResizedCrop, Resize, RandomHorizontalFlip, RandomIoUCrop, Pad)
_TAIL = (ToCHW, Normalize)


def _array(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.as_subclass(torch.Tensor).detach().cpu().numpy()
    return np.asarray(x)


def _kind(key: Any, value: Any) -> str | None:
    """"boxes", "masks", "keypoints" or None, by tv_tensor type first, then by key."""
    name = type(value).__name__ if isinstance(value, torch.Tensor) else None
    if name in ("BoundingBoxes", "Mask", "KeyPoints"):
        return {"BoundingBoxes": "boxes", "Mask": "masks", "KeyPoints": "keypoints"}[name]
    if isinstance(value, torch.Tensor) and name != "Tensor":
        return None  # another tv_tensor (an Image in the target): passed through
    return key if key in ("boxes", "masks", "keypoints") else None


def _deferred_masks(g: Geometry, masks: Any, select: np.ndarray | None) -> Any:
    """``g.masks(masks, select=select)`` as a DeferredArray: resampled (RLEs decoded) straight
    into the slot, the source kept only until then; a mask of the wrong size raises now."""
    if masks.ndim not in (2, 3) or tuple(masks.shape[-2:]) != g.source:
        return g.masks(masks, select=select)  # raises, naming the shapes
    n = masks.shape[0] if select is None else len(select)
    shape = g.mask_shape((n, *masks.shape[1:]) if masks.ndim == 3 else masks.shape)
    return DeferredArray(shape, masks.dtype, lambda out: g.masks(masks, out, select=select))


class DetectionCompose:
    """Chain detection ops; ``compose(image, target=None, out=None) -> (image, target)``.

    Ops: an optional leading ``DecodeImage`` (then ``image`` is encoded bytes, else an HWC uint8
    array or a CHW uint8 tensor), then ``RandomIoUCrop``, ``RandomResizedCrop``, ``Resize``,
    ``RandomHorizontalFlip``, ``Pad`` and the ops of vision/detection/ops.py (``CenterCrop``,
    ``RandomZoomOut``, ...: any op with ``plan(geometry, boxes_xyxy)``) in any order, then
    ``SanitizeBoundingBoxes``, ``ToCHW``, ``Normalize``. ``box_format`` names the format of
    boxes given as plain arrays (integer boxes stay integers, truncated after each resize).
    """

    defers_masks = True  # __call__ takes defer_masks= (read by CocoDetection)

    def __init__(self, ops: Sequence[Any], box_format: str = "XYXY") -> None:
        self.ops = list(ops)
        self.box_format = format_name(box_format)
        self._decode = bool(self.ops) and isinstance(self.ops[0], DecodeImage)
        rest = self.ops[1:] if self._decode else self.ops
        self.geometric: list = []
        self.sanitize: SanitizeBoundingBoxes | None = None
        self.tail: list = []
        for op in rest:
            if (isinstance(op, _GEOMETRIC) or hasattr(op, "plan")) and not self.tail \
                    and self.sanitize is None:
                self.geometric.append(op)
            elif isinstance(op, SanitizeBoundingBoxes) and self.sanitize is None:
                self.sanitize = op
            elif isinstance(op, _TAIL):
                self.tail.append(op)
            else:
                raise ValueError(
                    f"DetectionCompose: {op!r} is not supported here (ops: DecodeImage first; "
                    "RandomIoUCrop, RandomResizedCrop, Resize, RandomHorizontalFlip, Pad; then "
                    "SanitizeBoundingBoxes, ToCHW, Normalize)")
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self.scratch = Scratch()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["scratch"], state["_pid"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- drawing

    def draw(self, canvas: tuple[int, int], boxes_xyxy: np.ndarray | None,
             integer: bool = False) -> Geometry:
        """Draw every op's parameters in order; the geometry they give (``integer``: the boxes
        are integers, which torchvision truncates after each resize)."""
        g = Geometry(*canvas)
        for op in self.geometric:
            if isinstance(op, RandomResizedCrop):
                x0, y0, cw, ch = op.box(*g.canvas)
                g.crop(y0, x0, ch, cw)
                g.resize(*op.size)
            elif isinstance(op, Resize):
                g.resize(*op.out_hw(*g.canvas))
            elif isinstance(op, RandomHorizontalFlip):
                if op.draw():
                    g.flip()
            elif isinstance(op, RandomIoUCrop):
                if boxes_xyxy is None:
                    raise ValueError("RandomIoUCrop needs boxes in the target")
                window = op.draw(g.canvas, g.boxes(boxes_xyxy, "XYXY", integer))
                if window is not None:
                    g.crop(*window, keep_centers=True)
            elif hasattr(op, "plan"):  # vision/detection/ops.py: the op plans its own steps
                op.plan(g, boxes_xyxy)
            else:
                g.pad(*op.padding)
        return g

    # -- running

    def __call__(self, image: Any, target: dict | None = None, out: np.ndarray | None = None,
                 defer_masks: bool = False) -> tuple[np.ndarray, dict | None]:
        """``defer_masks``: masks come out as a ``pooled_loader.core.deferred.DeferredArray``,
        resampled when the ragged collate fills the slot with them (``CocoDetection`` asks for
        it while the batch's collate accepts them)."""
        if os.getpid() != self._pid:
            self._reset()
        img = self._source(image)
        canvas = img.shape[:2]
        found = self._find(target, canvas)
        boxes = found.get("boxes")
        g = self.draw(canvas, None if boxes is None else to_xyxy(boxes[1], boxes[2]),
                      boxes is not None and boxes[1].dtype.kind in "iu")
        result = self._render(img, g, out)
        return result, (None if target is None else self._targets(target, found, g,
                                                                   defer_masks))

    def _source(self, image: Any) -> np.ndarray:
        if self._decode:
            hdr = read_header(image)
            return decode_into(image, hdr, lambda n: self.scratch.flat("decode", n),
                               fast=self.ops[0].fast)
        if isinstance(image, torch.Tensor):  # CHW, as torchvision's images
            return np.ascontiguousarray(_array(image).transpose(1, 2, 0))
        img = np.asarray(image)
        return img[:, :, None] if img.ndim == 2 else img

    def _find(self, target: dict | None, canvas: tuple[int, int]) -> dict:
        """kind -> (key, array, box format) for the boxes, masks and keypoints of ``target``."""
        found: dict = {}
        for key, value in (target or {}).items():
            kind = _kind(key, value)
            if kind is None:
                continue
            if kind in found:
                raise ValueError(f"target has two {kind} entries ({found[kind][0]!r}, {key!r})")
            fmt = format_name(value.format) if kind == "boxes" and hasattr(value, "format") \
                else self.box_format
            size = getattr(value, "canvas_size", None)
            if size is not None and tuple(size) != tuple(canvas):
                raise ValueError(f"target[{key!r}] has canvas_size {tuple(size)}, the image is "
                                 f"{tuple(canvas)}")
            arr = value if hasattr(value, "decode_instances") else _array(value)  # RleMasks
            if kind == "boxes" and (arr.ndim != 2 or arr.shape[1] != 4):
                raise ValueError(f"target[{key!r}] must be [N, 4] boxes, got {arr.shape}")
            found[kind] = (key, arr, fmt)
        return found

    def _targets(self, target: dict, found: dict, g: Geometry,
                 defer_masks: bool = False) -> dict:
        out = dict(target)
        keep = None
        if "boxes" in found:
            key, arr, fmt = found["boxes"]
            integer = arr.dtype.kind in "iu"  # kept integer, as torchvision keeps them
            moved = g.boxes(arr, fmt, integer)
            if self.sanitize is not None:
                keep = sanitize(to_xyxy(moved, fmt), g.canvas, self.sanitize.min_size,
                                self.sanitize.min_area)
                moved = moved[keep]
                for lk in self.sanitize.label_keys(target):
                    labels = target[lk]
                    if len(labels) != len(keep):
                        raise ValueError(f"target[{lk!r}] has {len(labels)} entries for "
                                         f"{len(keep)} boxes")
                    out[lk] = _array(labels)[keep]
            out[key] = moved.astype(arr.dtype) if integer else moved
        n = None if keep is None else len(keep)
        if "masks" in found:
            key, arr, _ = found["masks"]
            instance = arr.ndim == 3
            select = np.flatnonzero(keep) if keep is not None and instance and \
                arr.shape[0] == n else None  # dropped masks are never read
            out[key] = _deferred_masks(g, arr, select) if defer_masks else \
                g.masks(arr, select=select)
        if "keypoints" in found:
            key, arr, _ = found["keypoints"]
            if keep is not None and arr.ndim >= 3 and arr.shape[0] == n:
                arr = arr[keep]
            if arr.shape[-1] == 3:  # COCO's (x, y, visibility)
                pts, vis = g.keypoints(arr[..., :2], arr[..., 2] > 0)
                kp = np.empty(arr.shape, np.float32)
                kp[..., :2] = pts
                kp[..., 2] = np.where(vis > 0, arr[..., 2], 0)
                out[key] = kp
            else:
                out[key] = g.keypoints(arr)[0]
        return out

    # -- the image

    def _render(self, img: np.ndarray, g: Geometry, out: np.ndarray | None) -> np.ndarray:
        """Run the geometry on the image: crops, pads and flips only move a window over the
        current image (``win``: top, left, height, width on ``cur``) and the part of it that
        shows pixels (``shown``: y0, x0, y1, x1 in the window; padding elsewhere), both in the
        unmirrored frame; each resize is one kernel call."""
        cur = img
        win = (0, 0, *img.shape[:2])
        shown = (0, 0, *img.shape[:2])
        flip = False
        fill = next((op.fill for op in self.geometric if getattr(op, "fill", None) is not None),
                    0)
        steps = g.steps
        chw = bool(self.tail) and isinstance(self.tail[0], ToCHW)
        norm = self.tail[1] if chw and len(self.tail) > 1 else None
        for i, (kind, args, _) in enumerate(steps):
            if kind == "crop":
                t, l, h, w = args
                l = win[3] - l - w if flip else l  # the window's own (unmirrored) frame
                win = (win[0] + t, win[1] + l, h, w)
                shown = (max(shown[0] - t, 0), max(shown[1] - l, 0), min(shown[2] - t, h),
                         min(shown[3] - l, w))
            elif kind == "pad":
                left, top, right, bottom = args
                if flip:
                    left, right = right, left
                win = (win[0] - top, win[1] - left, win[2] + top + bottom, win[3] + left + right)
                shown = (shown[0] + top, shown[1] + left, shown[2] + top, shown[3] + left)
            elif kind == "flip":
                flip = not flip
            else:
                if not self._plain(cur, win, shown):
                    cur = self._window(cur, win, shown, False, fill, ("pad", i))
                    win = shown = (0, 0, *cur.shape[:2])
                box = (win[1], win[0], win[3], win[2])
                oh, ow = args
                after = [st for st in steps[i + 1:]  # a crop of the whole canvas is no step
                         if not (st.kind == "crop" and st.args == (0, 0, *st.canvas))]
                if all(st.kind == "flip" for st in after) and chw and cur.shape[2] == 3:
                    flip ^= len(after) % 2 == 1  # flips after it fold into it
                    spec = Spec((3, oh, ow), np.dtype(np.float32 if norm else np.uint8), "CHW")
                    dst = out if fits(out, spec) else np.empty(spec.shape, spec.dtype)
                    if cur.strides[1:] != (3, 1):
                        cur = np.ascontiguousarray(cur)
                    crop_resize_flip_chw(cur, box, dst, flip, norm.mean if norm else None,
                                         norm.std if norm else None)
                    return dst
                dst = self.scratch.array(("resize", i), (oh, ow, cur.shape[2]), cur.dtype)
                resize_hwc(cur, box, dst)
                if flip:
                    flip_horizontal_(dst)
                cur, win, shown, flip = dst, (0, 0, oh, ow), (0, 0, oh, ow), False
        final = self._window(cur, win, shown, flip, fill, "final")
        return self._tail(final, out)

    @staticmethod
    def _plain(cur: np.ndarray, win: tuple, shown: tuple) -> bool:
        """True when the window lies inside ``cur`` and shows pixels everywhere."""
        return (win[0] >= 0 and win[1] >= 0 and win[0] + win[2] <= cur.shape[0]
                and win[1] + win[3] <= cur.shape[1] and shown == (0, 0, win[2], win[3]))

    def _window(self, cur: np.ndarray, win: tuple, shown: tuple, flip: bool, fill: int,
                key: object) -> np.ndarray:
        """The window as a C-contiguous HWC scratch array: ``cur``'s pixels where it shows them
        and ``cur`` has them, ``fill`` elsewhere, mirrored left-right when ``flip``."""
        t, l, h, w = win
        if not flip and self._plain(cur, win, shown):
            return cur[t:t + h, l:l + w]  # a view: the tail (or the final copy) reads it
        dst = self.scratch.array(("window", key), (h, w, cur.shape[2]), cur.dtype)
        y0, y1 = max(t + shown[0], 0), min(t + shown[2], cur.shape[0])  # rows of cur
        x0, x1 = max(l + shown[1], 0), min(l + shown[3], cur.shape[1])
        if y0 > t or x0 > l or y1 < t + h or x1 < l + w:
            dst[...] = fill  # an int or one value per channel
        if y1 > y0 and x1 > x0:
            src = cur[y0:y1, x0:x1]
            if flip:  # mirrored: column l + j of the window lands at w - 1 - j
                np.copyto(dst[y0 - t:y1 - t, w - (x1 - l):w - (x0 - l)], src[:, ::-1])
            else:
                np.copyto(dst[y0 - t:y1 - t, x0 - l:x1 - l], src)
        return dst

    def _tail(self, hwc: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        cur, spec = hwc, Spec(hwc.shape, hwc.dtype, "HWC")
        for k, op in enumerate(self.tail):
            nspec = op.spec(spec)
            last = k == len(self.tail) - 1
            dst = (out if fits(out, nspec) else np.empty(nspec.shape, nspec.dtype)) if last \
                else self.scratch.array(("tail", k), nspec.shape, nspec.dtype)
            op.apply(cur, dst, None, spec)
            cur, spec = dst, nspec
        if not self.tail:
            if fits(out, spec):
                np.copyto(out, cur)
                return out
            return cur.copy()  # never hand out scratch
        return cur

    def __repr__(self) -> str:
        return "DetectionCompose([" + ", ".join(repr(op) for op in self.ops) + "])"


__all__ = ["DetectionCompose", "RandomIoUCrop", "Pad", "SanitizeBoundingBoxes"]
