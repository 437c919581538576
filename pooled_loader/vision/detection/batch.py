"""Detection batches: images stacked or padded to the largest, targets per image or padded.

``detection_collate(images="pad", to_multiple_of=32)`` is a collate function for samples
``(image, target)`` (a CHW image and a dict of per-instance arrays, as
:class:`~pooled_loader.vision.detection.DetectionCompose` makes them). Under ``PooledLoader``
the worker writes the batch straight into the shared-memory slot and the main process gets views
of it (``pooled_loader.ragged.slots``); with a DataLoader it is an ordinary collate function giving the
same values.

- ``images="stack"``: every image has one size (a fixed-size resize): one [B, C, H, W] tensor.
  ``images="pad"``: :class:`ImageBatch` ``(images [B, C, H', W'], sizes [B, 2])``: each image in
  the top-left corner of the largest (rounded up to ``to_multiple_of``), ``pad_value`` around
  it, ``sizes`` its (height, width): what detection models take.
- ``targets="list"``: each field of the target dict is a tuple of per-image tensors (views of the
  slot, as ``collate.as_list`` gives); :func:`per_image` turns the dict of tuples into the list
  of dicts torchvision's models take. ``targets="pad"``: each field becomes :class:`Counted`
  ``(values [B, N_max, ...], counts [B])``, padded with zeros; an instance-mask field whose
  masks have their image's size is padded to the padded image size, so masks and images stay
  aligned.

Numbers (``image_id``) are stacked into a tensor. Imports: pooled_loader.collate, layout, ragged.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from pooled_loader.ragged import slots as _ragged
from pooled_loader.ragged.collate import RaggedCollate, as_list
from pooled_loader.engine.layout import Leaf, as_numpy


class ImageBatch(NamedTuple):
    """Images padded to one size, and each image's own (height, width)."""

    images: torch.Tensor
    sizes: torch.Tensor


class Counted(NamedTuple):
    """A per-instance field padded along its first dimension, with each image's count."""

    values: torch.Tensor
    counts: torch.Tensor


def _round(n: int, m: int | None) -> int:
    return n if not m else (n + m - 1) // m * m


class DetectionCollate(RaggedCollate):
    """See the module docstring; make one with :func:`detection_collate`."""

    keeps_containers = True  # a batch of (image, target) comes out as (images, targets)

    def __init__(self, images: str = "stack", targets: str = "list",
                 to_multiple_of: int | None = None, pad_value: float = 0) -> None:
        if images not in ("stack", "pad") or targets not in ("list", "pad"):
            raise ValueError(f"images must be 'stack' or 'pad' and targets 'list' or 'pad', "
                             f"got {images!r}, {targets!r}")
        if to_multiple_of is not None and (not isinstance(to_multiple_of, int)
                                           or to_multiple_of < 1):
            raise ValueError(f"to_multiple_of must be a positive int, not {to_multiple_of!r}")
        # the image (index 0) is ragged only when padded; every target field always is
        super().__init__(ragged=None if images == "pad" else (1,))
        self.images, self.targets = images, targets
        self.to_multiple_of, self.pad_value = to_multiple_of, pad_value
        self._listed = as_list()
        self._sizes: list | None = None  # this batch's image sizes, from the image's plan

    def __call__(self, samples: list) -> Any:
        self._sizes = None
        return super().__call__(samples)

    def pooled_layout(self, samples: list, indices: Any, ref: Any, slot_of: Any,
                      request_slot: Any) -> Any:
        self._sizes = None
        return super().pooled_layout(samples, indices, ref, slot_of, request_slot)

    def form_plan(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        if where[1] == 0:
            return self._padded_images(column, leaf, where)
        if self.targets == "list":
            return self._listed.form_plan(column, leaf, where)
        return self._counted(column, leaf, where)

    def _padded_images(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        _ragged.same_dtype(column, where)
        for j, a in enumerate(column):
            if a.ndim != 3 or a.shape[0] != column[0].shape[0]:
                raise ValueError(f"{self!r}: image {j} of the batch has shape {a.shape}; "
                                 "images='pad' takes CHW images with one channel count "
                                 "(put ToCHW() in the transform)")
        sizes = np.array([a.shape[1:] for a in column], np.int64)
        self._sizes = [tuple(s) for s in sizes]
        m = self.to_multiple_of
        full = (len(column), column[0].shape[0], _round(int(sizes[:, 0].max()), m),
                _round(int(sizes[:, 1].max()), m))
        values = self.values_leaf(leaf, full)
        fill = as_numpy(torch.tensor([self.pad_value], dtype=getattr(torch, values.dtype)))[0]

        def write(views: list[np.ndarray]) -> None:
            out, out_sizes = views
            for j, a in enumerate(column):
                h, w = a.shape[1:]
                out[j, :, :h, :w] = a
                out[j, :, h:, :].fill(fill)  # padding only: the image's own pixels are written
                out[j, :, :h, w:].fill(fill)
            out_sizes[...] = sizes
        leaves = [values, Leaf("tensor", (len(column), 2), "int64")]
        return leaves, write, ("namedtuple", ImageBatch, [("leaf", 0), ("leaf", 1)])

    def _counted(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        _ragged.same_dtype(column, where)
        ndim = column[0].ndim
        if any(a.ndim != ndim for a in column):
            raise ValueError(f"{self!r}: field {where[1]!r} has arrays of different ranks")
        shapes = np.array([a.shape for a in column], np.int64).reshape(len(column), ndim)
        longest = [int(n) for n in shapes.max(axis=0)]
        sizes = self._sizes
        if ndim == 3 and sizes is not None and all(
                tuple(a.shape[1:]) == s for a, s in zip(column, sizes)):
            # instance masks of their image's size: padded as the images are
            longest[1:] = [_round(n, self.to_multiple_of) for n in longest[1:]]
        full = (len(column), *longest)
        values = self.values_leaf(leaf, full)

        def write(views: list[np.ndarray]) -> None:
            out, counts = views
            out.fill(0)
            for j, a in enumerate(column):
                _ragged.put(out[(j, *(slice(0, n) for n in a.shape))], a, where, j)
            counts[...] = shapes[:, 0]
        leaves = [values, Leaf("tensor", (len(column),), "int64")]
        return leaves, write, ("namedtuple", Counted, [("leaf", 0), ("leaf", 1)])

    def __repr__(self) -> str:
        return (f"detection_collate(images={self.images!r}, targets={self.targets!r}, "
                f"to_multiple_of={self.to_multiple_of}, pad_value={self.pad_value!r})")


def detection_collate(images: str = "stack", targets: str = "list",
                      to_multiple_of: int | None = None, pad_value: float = 0) -> DetectionCollate:
    """A collate function for ``(image, target)`` detection samples; see the module docstring."""
    return DetectionCollate(images, targets, to_multiple_of, pad_value)


def per_image(targets: dict) -> list[dict]:
    """A batch's ``targets`` (a dict of per-image tuples, ``targets="list"``) as one dict per
    image, the form torchvision's detection models take; numbers stacked into a tensor are
    split back per image."""
    n = max((len(v) for v in targets.values() if isinstance(v, (tuple, torch.Tensor))),
            default=0)
    return [{k: v[j] for k, v in targets.items()} for j in range(n)]


__all__ = ["detection_collate", "DetectionCollate", "ImageBatch", "Counted", "per_image"]
