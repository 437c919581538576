"""Writing a batch column by column: samples already in memory (a dataset's `__getitems__`)
are stacked into their slot one leaf at a time, by one `torch.stack`/`numpy.stack` call per leaf
instead of a copy per sample and leaf. The values of a column must all be tensors (or all
ndarrays) of the first sample's shape and dtype; anything else goes the row-by-row way, which
converts numbers and checks every value (see ``worker._leaf_check``)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .layout import Leaf, StructureMismatch

__all__ = ["flat_columns", "write_column"]


def flat_columns(spec: tuple, samples: list) -> tuple[list, list] | None:
    """(leaf columns, other columns) of samples that are flat dicts with the first one's keys,
    one pass per key; None when they are not (the caller then walks each sample's tree)."""
    if spec[0] != "map" or spec[1] is not dict or any(c[0] not in ("leaf", "meta")
                                                         for c in spec[3]):
        return None
    keys = spec[2]
    first = samples[0].keys()
    if not all(type(s) is dict and s.keys() == first for s in samples):
        return None
    columns = [[s[k] for s in samples] for k in keys]
    leaves = [None] * sum(c[0] == "leaf" for c in spec[3])
    metas = [None] * (len(keys) - len(leaves))
    for (kind, i), column in zip(spec[3], columns):
        (leaves if kind == "leaf" else metas)[i] = column
    return leaves, metas


def _uniform(column: list, kind: type, shape: tuple, dtype: Any) -> bool:
    return all(type(v) is kind and v.shape == shape and v.dtype == dtype for v in column)


def write_column(view: np.ndarray, leaf: Leaf, out_leaf: Leaf, column: list,
                 check: Callable[[Any], np.ndarray]) -> int | None:
    """Write `column` (one value per sample) into `view` ([batch, ...] in the slot). Returns
    the position of the first value that does not fit the first one, or None when all did."""
    first = column[0]
    if type(first) is torch.Tensor and _uniform(column, torch.Tensor, first.shape, first.dtype) \
            and first.device.type == "cpu":
        out = torch.from_numpy(view).view(getattr(torch, out_leaf.dtype))
        torch.stack([v.detach() for v in column] if first.requires_grad else column, out=out)
        return None
    if type(first) is np.ndarray and _uniform(column, np.ndarray, first.shape, first.dtype) \
            and first.dtype == view.dtype:
        np.stack(column, out=view)
        return None
    for j, value in enumerate(column):
        try:
            value = check(value)
        except StructureMismatch:
            return j
        if value.shape:
            np.copyto(view[j], value, casting="no")
        else:
            view[j] = value
    return None
