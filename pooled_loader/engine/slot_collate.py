"""Default collate into a slot: what `default_collate` would build, written where the batch lives.

`SlotCollate` is the part of `worker.BatchMaker` that writes a default-collated batch: row by row
while the samples are fetched (`_collate`: each sample's leaves go straight to their row, with
`getitem_into` writing them there itself), column by column for samples already in memory
(`_collate_columns`, from a dataset's `__getitems__`; in-process with nothing pinned, each
column stays the tensor its stack made: `_stacked_as_is`), or an already built tree copied as
is (`_write_tree`: default_convert and custom collates). The checks are the same on every way:
every sample of a batch has the first one's structure, shapes and dtypes, or the error names
both samples and where they differ (`mismatch.py`); numbers and dtypes are never promoted.

What it uses of the maker: ``arenas`` (slots as arrays), ``request_slot`` (a bigger slot),
``use_into`` (the dataset writes samples itself), ``slotless`` (hand batches out in no slot),
``current_index`` (the sample an error is blamed on), ``getitem_ns`` (the fetch time inside a
row-by-row collate) and its cache of the last structure seen (``_spec``, ``_leaves``).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Collection, NamedTuple

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

from .columns import flat_columns, stack, stacked_tensor, tensor_dict_batch, write_column
from .layout import (Leaf, StructureMismatch, as_numpy, collated_spec, collated_type,
                     empty_like_tree, extract, flatten, metas_in_sequences, place,
                     same_structure, slot_views, unflatten)
from .messages import BatchLayout
from .mismatch import mismatch_message
from .pool import ArenaMap, SlotRef
from ..observability.stages import CLOCK, perf_counter_ns

__all__ = ["Collated", "SlotCollate", "collate_metas", "tensor_dtype"]


class Collated(NamedTuple):
    """A batch handed out as it is, in no slot (``WorkerConfig.pass_collated``)."""

    batch: Any
    num_samples: int


class _Rows(NamedTuple):
    """A batch layout placed in one slot, with a writable [batch, ...] view per leaf."""

    leaves: list[Leaf]
    offsets: list[int]
    views: list[np.ndarray]
    nbytes: int


@functools.lru_cache(maxsize=None)  # called per batch and leaf
def _numpy_to_torch_name(dtype: np.dtype) -> str:
    return str(torch.from_numpy(np.empty(0, dtype=dtype)).dtype).split(".")[1]


def tensor_dtype(leaf: Leaf) -> str:
    """The torch dtype name a leaf has once collated (ndarrays become tensors)."""
    return leaf.dtype if leaf.kind == "tensor" else _numpy_to_torch_name(np.dtype(leaf.dtype))


def _collated_leaf(leaf: Leaf, batch: int) -> Leaf:
    """default_collate turns ndarrays into tensors and stacks along a new first dimension (a
    tensor subclass becomes what ``torch.stack`` makes of it)."""
    cls = None if leaf.cls is None else collated_type(leaf.cls)
    return Leaf("tensor", (batch,) + leaf.shape, tensor_dtype(leaf),
                None if cls is torch.Tensor else cls)


def _converted_leaf(leaf: Leaf) -> Leaf:
    """default_convert (batch_size=None) turns ndarrays into tensors, shapes unchanged (a
    tensor subclass stays itself)."""
    return Leaf("tensor", leaf.shape, tensor_dtype(leaf), leaf.cls)


class SlotCollate:
    """Writing default-collated batches into slots (see the module docstring); a base of
    `worker.BatchMaker`, which sets these:"""

    arenas: ArenaMap
    request_slot: Callable[[int, int, SlotRef], SlotRef]
    use_into: bool
    slotless: bool
    current_index: Any
    getitem_ns: int
    _spec: tuple | None
    _leaves: list[Leaf] | None

    def _write_tree(self, task_id: int, tree: Any, ref: SlotRef, convert: bool) -> BatchLayout:
        """Copy every array of an already-built batch into the slot."""
        arrays: list = []
        metas: list = []
        numbers = "numpy" if convert else False
        leaves: list[Leaf] = []
        spec = flatten(tree, arrays, metas, numbers, leaves)
        out_leaves = [_converted_leaf(l) if convert else l for l in leaves]
        offsets, total = place(out_leaves)
        if total > ref.nbytes:
            ref = self.request_slot(task_id, total, ref)
        slot = self.arenas.slot(ref)
        for dst, value in zip(slot_views(slot, zip(out_leaves, offsets)), arrays):
            np.copyto(dst, as_numpy(value), casting="no")  # as_numpy gives the storage dtype
        if convert:  # default_convert, like default_collate, turns tuples into lists
            spec = collated_spec(spec)
        return BatchLayout(ref=ref, spec=spec, leaves=list(zip(out_leaves, offsets)),
                           metas=metas, num_samples=1)

    def _rows(self, slot: np.ndarray, leaves: list[Leaf], batch: int) -> _Rows | None:
        """Per-leaf [batch, ...] views of the slot for this layout, or None if it does not fit."""
        out_leaves = [_collated_leaf(l, batch) for l in leaves]
        offsets, total = place(out_leaves)
        if total > len(slot):
            return None
        return _Rows(out_leaves, offsets, slot_views(slot, zip(out_leaves, offsets)), total)

    def _collate(self, task_id: int, items: list, ref: SlotRef,
                 fetch: Callable | None) -> BatchLayout:
        """default_collate, writing sample j's leaves straight into row j of each batch leaf
        (`items`: indices to `fetch`, or the samples)."""
        batch = len(items)
        collating = CLOCK.collating()  # timings: the time between fetches is collate's
        names = items if fetch is not None else range(batch)
        slot = self.arenas.slot(ref)
        rows = self._rows(slot, self._leaves, batch) if (self._leaves and self.use_into) else None
        guess = rows

        def sample_at(j: int, rows_now: _Rows | None) -> Any:
            if fetch is None:
                return items[j]
            out = None
            if rows_now is not None and self.use_into:
                out = empty_like_tree(self._spec, [v[j, ...] for v in rows_now.views])
            start = perf_counter_ns()
            sample = fetch(items[j], out)
            end = perf_counter_ns()
            collating.fetch_ns += end - start
            if collating.spans is not None:
                collating.span(start, end, items[j])
            return sample

        first = sample_at(0, guess)
        arrays: list = []
        metas: list = []
        leaves: list[Leaf] = []
        spec = flatten(first, arrays, metas, True, leaves)
        if (rows is None or leaves != self._leaves or self._spec is None
                or not same_structure(spec, self._spec)):  # rows None: no getitem_into guess
            self._spec, self._leaves = spec, leaves
            rows = self._rows(slot, leaves, batch)
        pending: list[list] | None = None
        if rows is None:  # too big for this slot: keep samples privately, then ask for a bigger one
            pending = [arrays]
        meta_columns = [[m] for m in metas]
        if pending is None:
            self._write_row(rows, 0, arrays)
        checks = [_leaf_check(a, l) for a, l in zip(arrays, leaves)]
        for j in range(1, batch):
            sample = sample_at(j, rows if pending is None else None)
            s_arrays: list = []
            s_metas: list = []
            try:
                extract(spec, sample, s_arrays, s_metas)
                if len(s_arrays) != len(leaves):
                    raise StructureMismatch
                if pending is not None:
                    for check, value in zip(checks, s_arrays):
                        check(value)
                    pending.append(s_arrays)
                else:
                    self._write_row(rows, j, s_arrays, checks)
            except StructureMismatch:
                self.current_index = None  # the message names both samples
                raise RuntimeError(mismatch_message(first, sample, names[0], names[j])) from None
            for col, m in zip(meta_columns, s_metas):
                col.append(m)
        if pending is not None:
            total = place([_collated_leaf(l, batch) for l in leaves])[1]
            ref = self.request_slot(task_id, total, ref)
            rows = self._rows(self.arenas.slot(ref), leaves, batch)
            for j, s_arrays in enumerate(pending):
                self._write_row(rows, j, s_arrays)
        layout = BatchLayout(ref=ref, spec=collated_spec(spec),
                             leaves=list(zip(rows.leaves, rows.offsets)),
                             metas=collate_metas(spec, meta_columns), num_samples=batch)
        self.getitem_ns += collating.done()
        return layout

    def _collate_columns(self, task_id: int, samples: list, ref: SlotRef,
                         names: Any) -> BatchLayout:
        """default_collate of samples already in memory, one stack per leaf (`columns.py`)."""
        batch = len(samples)
        if self.slotless:  # the common case first: dicts of tensors, stacked as they are
            stacked = tensor_dict_batch(samples)
            if stacked is not None:
                return Collated(stacked, batch)
        arrays: list = []
        metas: list = []
        leaves: list[Leaf] = []
        spec = flatten(samples[0], arrays, metas, True, leaves)
        flat = flat_columns(spec, samples)
        columns, meta_columns = flat or ([[a] for a in arrays], [[m] for m in metas])
        for j in range(1 if flat is None else batch, batch):
            s_arrays: list = []
            s_metas: list = []
            try:
                extract(spec, samples[j], s_arrays, s_metas)
                if len(s_arrays) != len(leaves):
                    raise StructureMismatch
            except StructureMismatch:
                self._mismatch(samples, names, j)
            for col, value in zip(columns, s_arrays):
                col.append(value)
            for col, m in zip(meta_columns, s_metas):
                col.append(m)
        if self.slotless:
            return self._stacked_as_is(spec, leaves, columns, meta_columns, samples, names)
        total = place([_collated_leaf(l, batch) for l in leaves])[1]
        if total > ref.nbytes:
            ref = self.request_slot(task_id, total, ref)
        rows = self._rows(self.arenas.slot(ref), leaves, batch)
        for view, leaf, out_leaf, column in zip(rows.views, leaves, rows.leaves, columns):
            bad = write_column(view, out_leaf, column, _leaf_check(column[0], leaf), stack(column))
            if bad is not None:
                self._mismatch(samples, names, bad)
        return BatchLayout(ref=ref, spec=collated_spec(spec),
                           leaves=list(zip(rows.leaves, rows.offsets)),
                           metas=collate_metas(spec, meta_columns), num_samples=batch)

    def _stacked_as_is(self, spec: tuple, leaves: list[Leaf], columns: list[list],
                       meta_columns: list[list], samples: list, names: Any) -> Collated:
        """`_collate_columns`'s batch with every leaf in a tensor of its own (`slotless`): the
        same checks, values and dtypes as in a slot."""
        batch = len(samples)
        arrays = []
        for leaf, column in zip(leaves, columns):
            tensor = stacked_tensor(_collated_leaf(leaf, batch), column,
                                    _leaf_check(column[0], leaf))
            if type(tensor) is int:
                self._mismatch(samples, names, tensor)
            arrays.append(tensor)
        return Collated(unflatten(collated_spec(spec), arrays, collate_metas(spec, meta_columns)),
                        batch)

    def _mismatch(self, samples: list, names: Any, j: int) -> None:
        self.current_index = None  # the message names both samples
        raise RuntimeError(mismatch_message(samples[0], samples[j], names[0], names[j]))

    @staticmethod
    def _write_row(rows: _Rows, j: int, arrays: list, checks: list | None = None) -> None:
        for k, (view, value) in enumerate(zip(rows.views, arrays)):
            if checks is not None:
                value = checks[k](value)
            else:
                value = as_numpy(value)
            if not value.shape:  # a number: one element of a 1-d leaf
                view[j] = value
                continue
            dst = view[j]
            if value.__array_interface__["data"][0] == dst.__array_interface__["data"][0]:
                continue  # written in place by getitem_into
            np.copyto(dst, value, casting="no")


def collate_metas(spec: tuple, columns: list[list], as_tuples: Collection[int] = ()) -> list:
    """default_collate of what the pool does not hold (strings, tensor subclasses, nested
    tensors, ...), column by column, exactly as DataLoader does it: same results, same errors.
    The columns numbered in ``as_tuples`` stay a tuple of their samples' objects."""
    in_sequence = metas_in_sequences(spec)
    return [tuple(column) if k in as_tuples else default_collate(tuple(column) if seq else column)
            for k, (column, seq) in enumerate(zip(columns, in_sequence))]


def _leaf_check(first: Any, leaf: Leaf) -> Callable[[Any], np.ndarray]:
    """A fast check-and-convert for later samples' values of the leaf `first` started: same
    kind, shape and dtype, or StructureMismatch (default_collate would stack or promote them;
    we never truncate silently)."""
    storage = leaf.storage_dtype
    shape = leaf.shape
    if type(first) in (int, float, bool):
        expected = type(first)

        def check_number(value: Any) -> np.ndarray:
            if type(value) is not expected:
                raise StructureMismatch
            return np.asarray(value, dtype=storage)
        return check_number

    def check_array(value: Any) -> np.ndarray:
        if type(value) is not np.ndarray:
            if not isinstance(value, (np.ndarray, np.generic, torch.Tensor)):
                raise StructureMismatch
            value = as_numpy(value)
        if value.shape != shape:
            raise StructureMismatch
        if value.dtype != storage:
            if leaf.dtype != "bfloat16":
                raise StructureMismatch
            value = value.view(storage)
        return value
    return check_array
