"""Run a user's unchanged torchvision detection dataset on the fused detection path (issue 38).

:func:`translate` recognises ``wrap_dataset_for_transforms_v2(CocoDetection(root, annFile,
transforms=v2.Compose([...])))`` (or a wrapped ``VOCDetection``; read by
``detection.read_dataset``) and returns a :class:`FusedDetection` that the loader's workers use
in its place, as ``folder.translate`` does for folder datasets; anything else runs as it is.

A sample of a :class:`FusedDetection` is what torchvision gives for the same draws from torch's
RNG: ``(tv_tensors.Image, {"image_id": int, "boxes": tv_tensors.BoundingBoxes (XYXY, with
canvas_size), "masks": tv_tensors.Mask, "labels": int64 tensor, ...})`` with the keys asked for
(``iscrowd`` and ``area`` as torchvision gives them: lists of the annotations' raw values), plain
tensors when the Compose ends with ``ToPureTensor``. The tensors wrap the arrays the fused path
wrote (no copy). An image without annotations is made by the dataset's own ``__getitem__``
(torchvision's wrapper gives such an image only its image_id, and its ops decide what happens
to it); so is a sample the fused path fails on (a file it refuses: a symlink, a format our
decoder does not read), with torch's RNG state as it was before, so the draws stay the same:
torchvision's code then opens it or raises its own error (the first such sample of a process
is logged, ``fallbacks`` counts them). Imports: vision/torchvision/detection.py;
torchvision where it is called.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

log = logging.getLogger("pooled_loader")


def translate(dataset: Any, logged: str | None = None) -> tuple[FusedDetection | None,
                                                                  str | None]:
    """(a :class:`FusedDetection` for ``dataset``, or None; the line that says so, or None when
    ``dataset`` is no torchvision detection wrapper). The line is logged (INFO,
    "pooled_loader") unless it equals ``logged``."""
    from pooled_loader.vision.torchvision.detection import read_dataset
    fused, why = read_dataset(dataset)
    if fused is None and not why:
        return None, None
    if fused is None:
        line = f"PooledLoader: the torchvision detection transforms run as they are ({why})"
        result = None
    else:
        result = FusedDetection(dataset, fused)
        line = "PooledLoader: accelerated torchvision detection transforms: fused [{}]".format(
            ", ".join(result.describe()["fused"]))
    if line != logged:
        log.info("%s", line)
    return result, line


class FusedDetection:
    """The user's wrapped torchvision dataset, its samples made on the fused detection path (see
    the module docstring). ``dataset`` is the user's object; other attributes are read from it;
    ``fused`` the :class:`~pooled_loader.vision.detection.coco.CocoDetection` making the samples."""

    def __init__(self, dataset: Any, fused: Any) -> None:
        from torchvision.transforms import v2
        self.dataset = dataset
        self.fused = fused
        ops = list(dataset.transforms.transforms)
        self.pure = type(ops[-1]) is v2.ToPureTensor
        self.names = [" ".join(repr(op).split()) for op in ops]
        keys = dataset._target_keys or ()
        self.raw_keys = tuple(k for k in ("iscrowd", "area") if k in keys)  # lists, as is
        self.fallbacks = 0  # samples made by the dataset's own __getitem__ (this process)
        self.failed = 0  # of which the fused path failed on

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("dataset", "fused"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __len__(self) -> int:
        return len(self.fused)

    def describe(self) -> dict:
        """What ``loader.stats()["transforms"]`` shows."""
        return {"fused": list(self.names), "as_is": [], "why_not_fused": "",
                "output": "torch.Tensor" if self.pure else "tv_tensors.Image"}

    def _annotations(self, index: int) -> list:
        """The image's annotations (COCO's dicts; VOC: one entry per box); empty: none."""
        if hasattr(self.fused, "anns"):
            return self.fused.anns[self.fused.images[index][0]]
        target = self.fused.target(index)  # (boxes and/or labels: one per object)
        return [{}] * len(next(iter(target.values()), [None]))

    def __getitem__(self, index: int) -> tuple[Any, dict]:
        anns = self._annotations(index)
        if not anns:
            return self._as_is(index)
        saved = torch.get_rng_state()
        try:
            image, target = self.fused[index]
        except Exception as e:  # noqa: BLE001  (torchvision's own code decides: it may open it)
            torch.set_rng_state(saved)
            if not self.failed:
                log.warning("PooledLoader: a sample the fused detection path could not make runs "
                            "as torchvision's own code (%s)", e)
            self.failed += 1
            return self._as_is(index)
        return self._as_torchvision(image, target, anns)

    def _as_is(self, index: int) -> tuple[Any, dict]:
        self.fallbacks += 1
        return self.dataset[index]

    def _as_torchvision(self, image: np.ndarray, target: dict, anns: list) -> tuple[Any, dict]:
        from torchvision import tv_tensors
        pure = self.pure
        img = torch.from_numpy(image)
        out: dict[str, Any] = {}
        for key in ("image_id", "boxes", "masks", "labels"):  # torchvision's order
            if key not in target:
                continue
            value = target[key]
            if key == "image_id":
                out[key] = value
            elif key == "boxes":
                boxes = torch.from_numpy(value)
                out[key] = boxes if pure else tv_tensors.BoundingBoxes(
                    boxes, format="XYXY", canvas_size=tuple(image.shape[1:]))
            elif key == "masks":
                masks = torch.from_numpy(np.asarray(value))  # a DeferredArray filled here
                out[key] = masks if pure else masks.as_subclass(tv_tensors.Mask)
            else:
                out[key] = torch.from_numpy(value)
        for key in self.raw_keys:
            out[key] = [ann[key] for ann in anns]
        return (img if pure else img.as_subclass(tv_tensors.Image)), out

    def __repr__(self) -> str:
        return f"FusedDetection({self.dataset!r}, fused={self.names})"


__all__ = ["FusedDetection", "translate"]
