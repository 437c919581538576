"""Writing a batch column by column: samples already in memory (a dataset's `__getitems__`)
are stacked into their slot one leaf at a time, by one `torch.stack`/`numpy.stack` call and one
copy per leaf instead of a copy per sample and leaf (cheaper than checking every value in
Python first). A column whose values are not all tensors (or all ndarrays) of the first
sample's shape and dtype goes the row-by-row way, which converts numbers and checks every value
(see ``slot_collate._leaf_check``) and names the sample that differs."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from .layout import _TORCH_TO_NUMPY, Leaf, StructureMismatch, as_type

__all__ = ["flat_columns", "stack", "stacked_tensor", "tensor_dict_batch", "write_column"]


def flat_columns(spec: tuple, samples: list) -> tuple[list, list] | None:
    """(leaf columns, other columns) of samples that are dicts with (at least) the first one's
    keys, one pass per key (default_collate also reads only the first sample's keys); None when
    they are not (the caller then walks each sample's tree and says where it differs)."""
    if spec[0] != "map" or spec[1] is not dict or any(c[0] not in ("leaf", "meta")
                                                         for c in spec[3]):
        return None
    try:
        columns = [[s[k] for s in samples] for k in spec[2]]
    except (KeyError, TypeError, IndexError):
        return None
    leaves = [None] * sum(c[0] == "leaf" for c in spec[3])
    metas = [None] * (len(columns) - len(leaves))
    for (kind, i), column in zip(spec[3], columns):
        (leaves if kind == "leaf" else metas)[i] = column
    return leaves, metas


def stack(column: list) -> Any:
    """All of `column` stacked by one call (a tensor, an ndarray, or the numbers as they are),
    or None when its values are not all arrays of the first one's type, shape and dtype
    (stacking would fail, promote or convert): `write_column` then takes the checked way."""
    first = column[0]
    try:
        if type(first) is torch.Tensor:
            result = torch.stack(column)  # not under no_grad: entering it costs ~5 us a column
            ok = type(result) is torch.Tensor and result.dtype == first.dtype
        elif type(first) is np.ndarray:
            result = np.stack(column)
            ok = result.dtype == first.dtype and all(type(v) is np.ndarray for v in column)
        elif isinstance(first, np.generic):
            result = np.array(column)
            ok = result.dtype == first.dtype and result.ndim == 1
        elif type(first) in (int, float, bool):
            kind = type(first)
            if not all(type(v) is kind for v in column):
                return None
            return column  # numbers: numpy converts the list as it writes it
        else:
            return None
    except (RuntimeError, TypeError, ValueError):
        return None
    return result if ok and result.shape[1:] == first.shape else None


def write_column(view: np.ndarray, out_leaf: Leaf, column: list,
                 check: Callable[[Any], np.ndarray], stacked: Any) -> int | None:
    """Write `column` (one value per sample, `stacked`: what `stack` made of it) into `view`
    ([batch, ...] in the slot). Returns the position of the first value that does not fit the
    first one, or None when all did."""
    if stacked is not None:
        if isinstance(stacked, torch.Tensor):
            out = torch.from_numpy(view).view(getattr(torch, out_leaf.dtype))
            out.copy_(stacked)
        elif isinstance(stacked, list):
            view[:] = stacked
        else:
            np.copyto(view, stacked.view(view.dtype) if stacked.dtype != view.dtype else stacked,
                      casting="no")
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


def stacked_tensor(out_leaf: Leaf, column: list,
                   check: Callable[[Any], np.ndarray]) -> torch.Tensor | int:
    """`column` as one tensor of its own (`out_leaf`: the collated shape and dtype), for a batch
    handed out without a slot: the tensor `torch.stack` made as it is, else a new one written
    the checked way. Returns the position of the first value that does not fit instead."""
    stacked = stack(column)
    dtype = getattr(torch, out_leaf.dtype)
    if type(stacked) is torch.Tensor:
        return stacked
    if type(stacked) is np.ndarray and stacked.dtype == out_leaf.storage_dtype:
        tensor = torch.from_numpy(stacked)
        return tensor if tensor.dtype == dtype else tensor.view(dtype)
    raw = np.empty(out_leaf.shape, out_leaf.storage_dtype)
    bad = write_column(raw, out_leaf, column, check, stacked)
    return bad if bad is not None else as_type(torch.from_numpy(raw).view(dtype), out_leaf.cls)


def tensor_dict_batch(samples: list) -> dict | None:
    """default_collate of dicts whose values are all plain CPU tensors (what HF datasets'
    `__getitems__` gives in the torch format): one `torch.stack` per key of the first sample,
    nothing else walked. None when a sample is anything else, or a stack fails, promotes or
    gives a subclass: the general way then checks every value and names what differs."""
    first = samples[0]
    if type(first) is not dict:
        return None
    batch = {}
    for key, value in first.items():
        if (type(value) is not torch.Tensor or value.dtype not in _TORCH_TO_NUMPY
                or value.device.type != "cpu" or value.is_sparse or value.is_nested):
            return None
        try:
            column = [s[key] for s in samples]
        except (KeyError, TypeError, IndexError):
            return None
        stacked = stack(column)
        if stacked is None:
            return None
        batch[key] = stacked
    return batch
