"""The one table of torchvision ops the fused paths translate, and the rule for which resizes
resample as our kernels do.

:func:`op_table` maps each recognised op class (exact classes: a subclass may change what the
op does) to ``(kind, version)``: the kind of fused step it becomes and how its parameters are
drawn ("v1", "v2" or "timm"). Both translators read it: ``plan.read_plan`` (a classification
``Compose``: crops, resizes, flip, colour jitter and the conversions to a tensor) and
``detection`` (a v2 detection ``Compose``: the same geometry plus the kinds in ``DETECTION``;
the detection translator takes none of ``AUGMENT``/``ERASE``).
An op's kind the reading path has no step for ends its fused prefix (classification) or leaves
the dataset to torchvision (detection), as an op missing from the table does.

:func:`resizes_bilinearly` is the one interpolation check, following how torchvision itself
resolves the mode: ``InterpolationMode.BILINEAR``; PIL's integer 2 (v1 converts it at
construction, v2 keeps it and converts it when it runs); the string "bilinear" for v2 only
(v2's functional resize takes exactly that string; v1 raises on a string, so a v1 op given one
is left to torchvision, which raises as it always did). A tensor is resized by torchvision with
antialiasing only when ``antialias`` is True, and ours always antialiases, so on a tensor
``antialias`` must be True (a PIL image is always antialiased).

Imports: torchvision only, inside the functions (called where torchvision is imported already).
"""
from __future__ import annotations

import sys
from typing import Any

# kinds of step (``Step.kind`` and the detection translator's dispatch)
RESIZED_CROP, RESIZE, CENTER_CROP, FLIP, JITTER, CONVERT = (
    "resized_crop", "resize", "center_crop", "flip", "jitter", "convert")
AUGMENT, ERASE = "augment", "erase"  # the AutoAugment family (on the crop), RandomErasing
IOU_CROP, ZOOM_OUT, SHORTEST_SIZE, PAD, CLAMP_BOXES, SANITIZE = (
    "iou_crop", "zoom_out", "shortest_size", "pad", "clamp_boxes", "sanitize")
DETECTION = (IOU_CROP, ZOOM_OUT, SHORTEST_SIZE, PAD, CLAMP_BOXES, SANITIZE)  # targets only


def op_table() -> dict:
    """Exact op classes recognised, keyed by class: (kind, version). timm's crop and ToTensor
    are in it when timm is already imported."""
    import torchvision.transforms as v1
    import torchvision.transforms.v2 as v2
    table = {
        v1.RandomResizedCrop: (RESIZED_CROP, "v1"), v2.RandomResizedCrop: (RESIZED_CROP, "v2"),
        v1.Resize: (RESIZE, "v1"), v2.Resize: (RESIZE, "v2"),
        v1.CenterCrop: (CENTER_CROP, "v1"), v2.CenterCrop: (CENTER_CROP, "v2"),
        v1.RandomHorizontalFlip: (FLIP, "v1"), v2.RandomHorizontalFlip: (FLIP, "v2"),
        v1.ColorJitter: (JITTER, "v1"), v2.ColorJitter: (JITTER, "v2"),
        v1.ToTensor: (CONVERT, "v1"), v1.PILToTensor: (CONVERT, "v1"),
        v1.ConvertImageDtype: (CONVERT, "v1"), v1.Normalize: (CONVERT, "v1"),
        v2.PILToTensor: (CONVERT, "v2"), v2.ToImage: (CONVERT, "v2"),
        v2.ToDtype: (CONVERT, "v2"), v2.Normalize: (CONVERT, "v2"),
        v2.ToPureTensor: (CONVERT, "v2"),
        v1.TrivialAugmentWide: (AUGMENT, "v1"), v2.TrivialAugmentWide: (AUGMENT, "v2"),
        v1.RandAugment: (AUGMENT, "v1"), v2.RandAugment: (AUGMENT, "v2"),
        v1.AutoAugment: (AUGMENT, "v1"), v2.AutoAugment: (AUGMENT, "v2"),
        v1.AugMix: (AUGMENT, "v1"), v2.AugMix: (AUGMENT, "v2"),
        v1.RandomErasing: (ERASE, "v1"), v2.RandomErasing: (ERASE, "v2"),
        v2.RandomIoUCrop: (IOU_CROP, "v2"), v2.RandomZoomOut: (ZOOM_OUT, "v2"),
        v2.RandomShortestSize: (SHORTEST_SIZE, "v2"), v2.Pad: (PAD, "v2"),
        v2.ClampBoundingBoxes: (CLAMP_BOXES, "v2"), v2.SanitizeBoundingBoxes: (SANITIZE, "v2"),
    }
    try:  # timm's training crop, ToTensor, RandAugment and RandomErasing (when imported)
        timm_t = sys.modules.get("timm.data.transforms")
        if timm_t is not None:
            table[timm_t.RandomResizedCropAndInterpolation] = (RESIZED_CROP, "timm")
            table[timm_t.MaybeToTensor] = (CONVERT, "v1")
        timm_aa = sys.modules.get("timm.data.auto_augment")
        if timm_aa is not None:
            table[timm_aa.RandAugment] = (AUGMENT, "timm")
        timm_re = sys.modules.get("timm.data.random_erasing")
        if timm_re is not None:
            table[timm_re.RandomErasing] = (ERASE, "timm")
    except AttributeError:
        pass
    return table


def resizes_bilinearly(op: Any, version: str, tensor: bool) -> bool:
    """Whether ``op`` (of ``version``, see :func:`op_table`) resamples as our kernels do: it
    resolves to bilinear as torchvision resolves it, antialiased when it resizes a ``tensor``
    (see the module docstring)."""
    from torchvision.transforms import InterpolationMode
    mode = getattr(op, "interpolation", None)
    if isinstance(mode, InterpolationMode):
        bilinear = mode is InterpolationMode.BILINEAR
    elif isinstance(mode, str):
        bilinear = version == "v2" and mode == InterpolationMode.BILINEAR.value
    else:
        bilinear = type(mode) is int and mode == 2  # PIL.Image.BILINEAR
    return bilinear and (not tensor or getattr(op, "antialias", True) is True)


__all__ = ["op_table", "resizes_bilinearly", "DETECTION", "RESIZED_CROP", "RESIZE",
           "CENTER_CROP", "FLIP", "JITTER", "CONVERT", "AUGMENT", "ERASE", "IOU_CROP", "ZOOM_OUT", "SHORTEST_SIZE",
           "PAD", "CLAMP_BOXES", "SANITIZE"]
