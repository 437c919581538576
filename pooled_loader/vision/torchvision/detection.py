"""Recognise an unchanged torchvision detection dataset and run it on the fused detection path.

``accelerate_detection(ds)`` takes ``wrap_dataset_for_transforms_v2(CocoDetection(root,
annFile, transforms=v2.Compose([...])))`` (or a wrapped ``VOCDetection``: then a
:class:`~pooled_loader.vision.detection.voc.VOCDetection`) and returns a
:class:`~pooled_loader.vision.detection.coco.CocoDetection` over the same images, in the same
order, with the same target keys, running a
:class:`~pooled_loader.vision.detection.DetectionCompose` of the same ops whose random
parameters are drawn from ``torch`` exactly as torchvision draws them (the same seed gives the
same crops and flips). Anything it cannot honour exactly leaves the dataset as it is (it is
returned unchanged, and runs as torchvision's own code): a subclass of the dataset or of an op,
``transform``/``target_transform`` instead of ``transforms``, an op not in the table below (the
ops are looked up in vision/torchvision/table.py, the table the classification path reads too),
an argument we do not honour (interpolation other than bilinear, antialias off, a
``labels_getter`` other than the default, a mask fill other than 0, two different fills),
target keys we do not make.

==============================  =========================================================
torchvision v2                  fused
==============================  =========================================================
``ToImage()`` / ``PILToTensor``  first op: ``DecodeImage()`` (libjpeg-turbo, into a buffer)
``RandomIoUCrop(...)``           :class:`~pooled_loader.vision.detection.RandomIoUCrop`
``Resize(size)``                 ``Resize(size)`` (an int: shorter side; or (h, w))
``RandomResizedCrop(size, ...)``  the same box, drawn from ``torch`` (vision/ops/crop_box.py)
``RandomHorizontalFlip(p)``      the same, drawn with ``torch.rand(1) < p``
``Pad(padding)`` (fill 0)        ``Pad(padding)``
``SanitizeBoundingBoxes(...)``   the same rule, with labels (default labels_getter)
``ToPureTensor()`` (last ops)    plain tensors rather than tv_tensors
``CenterCrop``, ``RandomZoomOut``  vision/detection/ops.py, drawn as torchvision draws
``Resize(..., max_size=m)``      (fill: the image's, masks' 0), ``RandomShortestSize``,
``ClampBoundingBoxes()``          ``TorchResize``, ``ClampBoundingBoxes``
==============================  =========================================================

The outputs differ in type only: the image is a uint8 CHW numpy array (a ``tv_tensors.Image``
in torchvision) and the target's entries numpy arrays; batched by PooledLoader they are tensors.
Imports: vision/detection/, io/decode.py, ops/, torchvision/table.py and plan.py (``Draws``);
torchvision where called.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from pooled_loader.vision.detection.coco import KEYS, CocoDetection
from pooled_loader.vision.detection.compose import (DetectionCompose, Pad, RandomIoUCrop,
                                                    SanitizeBoundingBoxes)
from pooled_loader.vision.detection.ops import (CenterCrop, ClampBoundingBoxes, RandomShortestSize,
                                                RandomZoomOut, TorchResize, fills_agree)
from pooled_loader.vision.detection.voc import VOCDetection
from pooled_loader.vision.io.decode import DecodeImage
from pooled_loader.vision.ops.crop_box import resized_crop_box
from pooled_loader.vision.ops.geometry import RandomHorizontalFlip, RandomResizedCrop, Resize, ToCHW
from pooled_loader.vision.torchvision import table as T
from pooled_loader.vision.torchvision.plan import Draws


class TorchFlip(RandomHorizontalFlip):
    """``RandomHorizontalFlip`` drawing as torchvision v2 does (``torch.rand(1) < p``)."""

    def draw(self, spec: Any = None) -> bool:
        return bool(torch.rand(1) < self.p)


class TorchRandomResizedCrop(RandomResizedCrop):
    """``RandomResizedCrop`` drawing its box as torchvision v2 does: from ``torch``, with the
    float32 logs of ``ratio`` torchvision takes (vision/ops/crop_box.py, with :class:`Draws`)."""

    def __init__(self, size: Any, scale: Any = (0.08, 1.0), ratio: Any = (3 / 4, 4 / 3)) -> None:
        super().__init__(size, scale, ratio)
        self._torch_log_ratio = tuple(float(v) for v in torch.log(torch.tensor(self.ratio)))

    def box(self, h: int, w: int) -> tuple[int, int, int, int]:
        return resized_crop_box(h, w, self.scale, self._torch_log_ratio, self.ratio, Draws())


def _op(t: Any) -> Any:
    """Our op for torchvision v2 op ``t`` (exact classes, looked up in the one table,
    vision/torchvision/table.py; the arguments honoured exactly), or None."""
    kind, version = T.op_table().get(type(t), (None, None))
    if version != "v2":
        return None
    bilinear = T.resizes_bilinearly(t, version, tensor=True)  # (the first op made a tensor)
    if kind == T.RESIZE:
        size = list(t.size) if t.size is not None else None
        if not bilinear:
            return None
        if t.max_size is not None or size is None:  # torchvision's own size rule
            return TorchResize(size, t.max_size)
        return Resize(size[0] if len(size) == 1 else tuple(size)) if len(size) in (1, 2) \
            else None
    if kind == T.RESIZED_CROP:
        if not bilinear or not (0 < t.scale[0] <= t.scale[1]) \
                or not (0 < t.ratio[0] <= t.ratio[1]):
            return None
        return TorchRandomResizedCrop(tuple(t.size), t.scale, t.ratio)
    if kind == T.CENTER_CROP:
        return CenterCrop(list(t.size))
    if kind == T.FLIP:
        return TorchFlip(t.p)
    if kind == T.SHORTEST_SIZE:
        return RandomShortestSize(t.min_size, t.max_size) if bilinear else None
    if kind == T.IOU_CROP:
        return RandomIoUCrop(t.min_scale, t.max_scale, t.min_aspect_ratio, t.max_aspect_ratio,
                             t.options, t.trials)
    if kind == T.ZOOM_OUT:
        return _zoom_out(t)
    if kind == T.PAD:
        if t.padding_mode != "constant" or t.fill != 0:  # masks are padded with 0 here
            return None
        return Pad(t.padding)
    if kind == T.CLAMP_BOXES:
        return ClampBoundingBoxes() if t.clamping_mode == "auto" else None
    if kind == T.SANITIZE:
        if t.labels_getter != "default":
            return None
        return SanitizeBoundingBoxes(t.min_size, t.min_area)
    return None  # (ColorJitter and the conversions: no detection step)


def _zoom_out(t: Any) -> RandomZoomOut | None:
    """Our RandomZoomOut for torchvision's, when it pads masks with 0 as ours does."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2._utils import _get_fill
    if _get_fill(t._fill, tv_tensors.Mask) not in (0, None):
        return None  # masks are padded with 0 here
    fill = _get_fill(t._fill, tv_tensors.Image)
    try:
        return RandomZoomOut(0 if fill is None else fill, t.side_range, t.p)
    except (ValueError, TypeError):
        return None


def translate_transforms(transforms: Any) -> DetectionCompose | None:
    """Our DetectionCompose for a torchvision ``v2.Compose``, or None when it does not map."""
    return _translate(transforms)[0]


def _translate(transforms: Any) -> tuple[DetectionCompose | None, str]:
    """(our DetectionCompose, "") for a torchvision ``v2.Compose``, or (None, why not)."""
    from torchvision.transforms import v2

    if type(transforms) is not v2.Compose or not transforms.transforms:  # None included
        return None, "its transforms are not a torchvision v2.Compose"
    first, *rest = transforms.transforms
    if type(first) not in (v2.ToImage, v2.PILToTensor):
        return None, f"its first op {type(first).__name__} is not ToImage/PILToTensor"
    ops: list = [DecodeImage()]
    tail: list = []
    for k, t in enumerate(rest):
        if type(t) is v2.ToPureTensor:
            if any(type(u) is not v2.ToPureTensor for u in rest[k:]):
                return None, "an op after ToPureTensor"  # it would see plain tensors
            continue
        op = _op(t)
        if op is None:
            return None, f"{type(t).__name__}: no fused equivalent for these arguments"
        (tail if isinstance(op, SanitizeBoundingBoxes) else ops).append(op)
        if tail and not isinstance(op, SanitizeBoundingBoxes):
            return None, "a geometric op after SanitizeBoundingBoxes"
    if not fills_agree(ops):
        return None, "two different fills (one render has one)"
    return DetectionCompose(ops + [ToCHW()] + tail), ""


def read_dataset(dataset: Any) -> tuple[CocoDetection | VOCDetection | None, str]:
    """(our CocoDetection or VOCDetection making ``dataset``'s samples, "") for an unchanged
    ``wrap_dataset_for_transforms_v2(torchvision.datasets.CocoDetection(...))`` (or
    ``VOCDetection``); (None, why)
    for another such wrapper we cannot honour exactly; (None, "") for anything else. The
    target keys are the ones we make arrays of: iscrowd and area are left to the caller
    (torchvision gives them as lists of the raw values)."""
    if "torchvision" not in sys.modules:  # a wrapped torchvision dataset imported it
        return None, ""
    try:
        from torchvision import datasets
        from torchvision.tv_tensors._dataset_wrapper import VisionDatasetTVTensorWrapper
    except ImportError:
        return None, ""
    if not isinstance(dataset, VisionDatasetTVTensorWrapper):
        return None, ""
    inner = getattr(dataset, "_dataset", None)
    # wrap_dataset_for_transforms_v2 makes a class of its own: (wrapper, type(inner)), nothing else
    cls = type(dataset)
    base = datasets.VOCDetection if type(inner) is datasets.VOCDetection \
        else datasets.CocoDetection
    if cls.__bases__ != (VisionDatasetTVTensorWrapper, base) \
            or set(vars(cls)) - {"__module__", "__doc__", "__parameters__"} \
            or type(inner) is not base:
        return None, (f"{type(inner).__name__} is not an unchanged torchvision CocoDetection "
                      "or VOCDetection")
    if dataset.transform is not None or dataset.target_transform is not None:
        return None, "it has transform/target_transform (only transforms= is read)"
    if base is datasets.VOCDetection:
        return _voc(dataset, inner)
    keys = dataset._target_keys
    keys = ("image_id", "boxes", "labels") if keys is None else keys
    if isinstance(keys, str) or not set(keys) <= set(KEYS) - {"keypoints"}:
        return None, f"target_keys {keys!r} (fused: {', '.join(KEYS[:4])}, iscrowd, area)"
    compose, why = _translate(dataset.transforms)
    if compose is None:  # (no transforms at all: PIL images, nothing to fuse)
        return None, why
    order = [k for k in KEYS[:4] if k in set(keys)]
    return CocoDetection.from_dict(inner.root, inner.coco.dataset, compose, tuple(order)), ""


def _voc(dataset: Any, inner: Any) -> tuple[VOCDetection | None, str]:
    """read_dataset for a wrapped torchvision VOCDetection."""
    keys = dataset._target_keys
    keys = ("boxes", "labels") if keys is None else keys
    if isinstance(keys, str) or not set(keys) <= {"boxes", "labels"}:
        # ("annotation": the XML as a dict, which we do not make)
        return None, f"target_keys {keys!r} (fused: boxes, labels)"
    compose, why = _translate(dataset.transforms)
    if compose is None:
        return None, why
    order = [k for k in ("boxes", "labels") if k in set(keys)]
    return VOCDetection.from_files(inner.images, inner.targets, compose, order), ""


def accelerate_detection(dataset: Any) -> Any:
    """A fused equivalent of a wrapped torchvision ``CocoDetection`` or ``VOCDetection`` (numpy
    outputs), or
    ``dataset`` itself. ``PooledLoader`` does this by itself, with torchvision's output types
    (``vision/torchvision/detection_fused.py``)."""
    fused = read_dataset(dataset)[0]
    if fused is None:
        return dataset
    if isinstance(fused, CocoDetection):
        keys = dataset._target_keys or ()
        fused.target_keys += tuple(k for k in ("iscrowd", "area") if k in keys)
    return fused


__all__ = ["accelerate_detection", "read_dataset", "translate_transforms", "TorchFlip",
           "TorchRandomResizedCrop"]
