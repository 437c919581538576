"""Collate helpers for samples whose arrays differ in shape (token lists, images of any size, box
lists): pass one as `collate_fn`.

    loader = PooledLoader(ds, batch_size=32, num_workers=4, collate_fn=pad(pad_value=0))
    for batch in loader:            # a sample that is one 1-D array gives one Padded
        logits = model(batch.values, attention_mask=batch.mask)

- `pad(pad_value=0, to_multiple_of=None)`: each ragged array becomes `Padded(values, lengths,
  mask)`: `values` is [batch, *max shape] padded with `pad_value` (each padded dimension rounded
  up to `to_multiple_of`), `lengths` [batch] int64 (for 1-D samples; [batch, ndim] shapes
  otherwise) and `mask` [batch, *max shape] bool, True on real elements.
- `packed()`: each ragged array becomes `Packed(values, cu_seqlens, position_ids)`: the samples
  concatenated along their first dimension (1-D samples give one 1-D tensor), `cu_seqlens`
  [batch + 1] int32 (FlashAttention's varlen layout) and `position_ids` [total] int64, restarting
  at 0 in every sample.
- `as_list()`: each ragged array becomes a tuple of per-sample tensors, and the sample's
  containers are kept: a batch of (image, boxes) is what the detection idiom
  `tuple(zip(*batch))` gives, (images, boxes), with tensors.

With PooledLoader the worker writes the output (padding included) straight into the batch's slot
and the batch is handed out as views of it; with a DataLoader (or called directly) the helper is
an ordinary collate function giving the same values. Arrays with at least one dimension are
ragged unless `ragged=` names the ragged fields (top-level keys or indices of the sample); the
other arrays are stacked, numbers become tensors and strings are gathered, as default_collate
does. `dtype=` (e.g. torch.int64) writes the ragged fields' values in that dtype. How batches are planned and written: `pooled_loader.ragged.slots`.
"""
from __future__ import annotations

from typing import Any, Collection, NamedTuple

import numpy as np
import torch

from . import slots as _ragged
from ..engine.layout import _TORCH_TO_NUMPY, Leaf, as_numpy


class Padded(NamedTuple):
    """A padded ragged field: values [batch, *max shape], lengths, mask (True on real data)."""

    values: torch.Tensor
    lengths: torch.Tensor
    mask: torch.Tensor


class Packed(NamedTuple):
    """A packed ragged field: samples concatenated, cu_seqlens (int32) and position ids."""

    values: torch.Tensor
    cu_seqlens: torch.Tensor
    position_ids: torch.Tensor


class RaggedCollate:
    """Base of the helpers: a collate function PooledLoader's workers carry out into the slot."""

    keeps_containers = False  # default_collate's rule: a batch of tuples comes out as a list

    def __init__(self, ragged: Collection | None = None, dtype: torch.dtype | None = None):
        if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype == torch.bfloat16
                                  or dtype not in _TORCH_TO_NUMPY):
            raise TypeError(f"dtype= takes a torch dtype (not bfloat16) to write ragged fields "
                            f"as, e.g. torch.int64, not {dtype!r}")
        self.dtype = dtype
        if ragged is not None and (isinstance(ragged, (str, bytes)) or not all(
                isinstance(k, (str, int)) for k in ragged)):
            raise TypeError("ragged= takes a collection of top-level keys or indices, e.g. "
                            f"ragged=('boxes',), not {ragged!r}")
        self.ragged = None if ragged is None else frozenset(ragged)

    def __call__(self, samples: list) -> Any:
        return _ragged.collate_in_memory(self, list(samples))

    def pooled_layout(self, samples: list, indices: Any, ref: Any, slot_of: Any,
                      request_slot: Any) -> Any:
        """The worker's path (`worker.BatchMaker`): the batch written into slot `ref`."""
        return _ragged.write_batch(self, samples, indices, ref, slot_of, request_slot)

    def form_plan(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        """(output leaves, writer, spec node) of one ragged field; see `ragged.plan`."""
        raise NotImplementedError

    def values_leaf(self, leaf: Leaf, shape: tuple) -> Leaf:
        """The output leaf of a ragged field's values: `dtype=` if given (numpy casts while
        writing, so a uint16 token file becomes int64 with no extra copy), else the input's."""
        if self.dtype is None:
            return _ragged.out_leaf(leaf, shape)
        return Leaf("tensor", tuple(int(n) for n in shape), str(self.dtype).split(".")[1])

    def _args(self) -> str:
        args = [] if self.ragged is None else [f"ragged={sorted(self.ragged, key=str)!r}"]
        return ", ".join(args + ([] if self.dtype is None else [f"dtype={self.dtype}"]))

    def __repr__(self) -> str:
        return f"{type(self).__name__.lstrip('_')}({self._args()})"


def _ndims(column: list[np.ndarray], where: tuple) -> int:
    ndim = column[0].ndim
    for j, a in enumerate(column):
        if a.ndim != ndim:
            raise ValueError(f"{_ragged._where(where)}: {_ragged._sample_name(where[2], j)} has "
                             f"{a.ndim} dimensions, {_ragged._sample_name(where[2], 0)} {ndim}")
    return ndim


class _Pad(RaggedCollate):
    def __init__(self, pad_value: float = 0, to_multiple_of: int | None = None,
                 ragged: Collection | None = None, dtype: torch.dtype | None = None):
        super().__init__(ragged, dtype)
        if to_multiple_of is not None and (not isinstance(to_multiple_of, int)
                                           or to_multiple_of < 1):
            raise ValueError(f"to_multiple_of must be a positive int, not {to_multiple_of!r}")
        self.pad_value = pad_value
        self.to_multiple_of = to_multiple_of

    def __repr__(self) -> str:
        args = [f"pad_value={self.pad_value!r}"]
        if self.to_multiple_of is not None:
            args.append(f"to_multiple_of={self.to_multiple_of}")
        return f"pad({', '.join(args + ([self._args()] if self._args() else []))})"

    def form_plan(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        _ragged.same_dtype(column, where)
        ndim = _ndims(column, where)
        shapes = np.array([a.shape for a in column], dtype=np.int64).reshape(len(column), ndim)
        longest = shapes.max(axis=0) if len(column) else np.zeros(ndim, np.int64)
        if self.to_multiple_of:
            m = self.to_multiple_of
            longest = (longest + m - 1) // m * m
        full = (len(column),) + tuple(int(n) for n in longest)
        values = self.values_leaf(leaf, full)
        lengths = Leaf("tensor", (len(column),) if ndim == 1 else (len(column), ndim), "int64")
        mask = Leaf("tensor", full, "bool")
        torch_dtype = getattr(torch, values.dtype)
        fill = as_numpy(torch.tensor([self.pad_value], dtype=torch_dtype))[0]

        def write(views: list[np.ndarray]) -> None:
            out, out_lengths, out_mask = views
            out_lengths[...] = shapes.reshape(out_lengths.shape)
            if ndim == 1:  # the common case: one fill, one copy per sample, one mask op
                out.fill(fill)
                for j, a in enumerate(column):
                    out[j, :a.shape[0]] = a
                np.less(np.arange(full[1])[None, :], shapes, out=out_mask)
                return
            out.fill(fill)
            out_mask.fill(False)
            for j, a in enumerate(column):
                inside = (j,) + tuple(slice(0, n) for n in a.shape)
                out[inside] = a
                out_mask[inside] = True
        node = ("namedtuple", Padded, [("leaf", 0), ("leaf", 1), ("leaf", 2)])
        return [values, lengths, mask], write, node


class _Packed(RaggedCollate):
    def __repr__(self) -> str:
        return f"packed({self._args()})"

    def form_plan(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        _ragged.same_dtype(column, where)
        _ndims(column, where)
        rest = column[0].shape[1:]
        for j, a in enumerate(column):
            if a.shape[1:] != rest:
                raise ValueError(
                    f"{_ragged._where(where)}: packed() joins samples along their first dimension, "
                    f"but {_ragged._sample_name(where[2], j)} has shape {a.shape} and "
                    f"{_ragged._sample_name(where[2], 0)} {column[0].shape}; use pad() or "
                    "as_list() for this field")
        lengths = np.array([a.shape[0] for a in column], dtype=np.int64)
        cu = np.zeros(len(column) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        total = int(cu[-1])
        if total > _ragged.MAX_CU_SEQLEN:
            raise ValueError(f"{self!r}: {total} rows in one batch do not fit int32 cu_seqlens; "
                             "use smaller batches")
        values = self.values_leaf(leaf, (total,) + rest)
        cu_leaf = Leaf("tensor", (len(column) + 1,), "int32")
        pos_leaf = Leaf("tensor", (total,), "int64")

        def write(views: list[np.ndarray]) -> None:
            out, out_cu, out_pos = views
            for j, a in enumerate(column):
                out[cu[j]:cu[j + 1]] = a
            out_cu[...] = cu
            np.subtract(np.arange(total, dtype=np.int64), np.repeat(cu[:-1], lengths),
                        out=out_pos)
        node = ("namedtuple", Packed, [("leaf", 0), ("leaf", 1), ("leaf", 2)])
        return [values, cu_leaf, pos_leaf], write, node


class _AsList(RaggedCollate):
    keeps_containers = True  # as tuple(zip(*batch)): a batch of (image, boxes) is a tuple
    def __repr__(self) -> str:
        return f"as_list({self._args()})"

    def form_plan(self, column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
        leaves = [self.values_leaf(Leaf("ndarray", a.shape, a.dtype.str) if leaf.kind ==
                                   "ndarray" else leaf, a.shape) for a in column]
        if leaf.kind == "tensor":
            _ragged.same_dtype(column, where)  # a tensor leaf's dtype name is the first one's

        def write(views: list[np.ndarray]) -> None:
            for j, (dst, a) in enumerate(zip(views, column)):
                _ragged.put(dst, a, where, j)
        node = ("seq", tuple, [("leaf", j) for j in range(len(column))])
        return leaves, write, node


def pad(pad_value: float = 0, to_multiple_of: int | None = None,
        ragged: Collection | None = None, dtype: torch.dtype | None = None) -> RaggedCollate:
    """Pad ragged fields to the batch's longest: `Padded(values, lengths, mask)` per field."""
    return _Pad(pad_value, to_multiple_of, ragged, dtype)


def packed(ragged: Collection | None = None, dtype: torch.dtype | None = None) -> RaggedCollate:
    """Concatenate ragged fields: `Packed(values, cu_seqlens, position_ids)` per field."""
    return _Packed(ragged, dtype)


def as_list(ragged: Collection | None = None, dtype: torch.dtype | None = None) -> RaggedCollate:
    """Hand out ragged fields as a tuple of per-sample tensors (`tuple(zip(*batch))` style)."""
    return _AsList(ragged, dtype)


__all__ = ["pad", "packed", "as_list", "Padded", "Packed", "RaggedCollate"]
