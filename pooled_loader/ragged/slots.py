"""Ragged batches: samples whose arrays differ in shape, written into one slot (or one buffer).

The collate helpers of `pooled_loader.collate` (`pad`, `packed`, `as_list`) are carried out here.
`plan` looks at a batch's samples and decides the *output*: every array the batch hands out (a
padded tensor and its lengths and mask, a packed tensor with `cu_seqlens` and position ids, or one
tensor per sample), each with its shape and its offset, placed one after the other like a bump
allocator (`layout.place`, every array aligned). `write` then fills those bytes from the samples,
padding included, so the main process only views them (`iterators._IterBase._build`): nothing is
pickled and nothing is padded twice. The same two steps into a private buffer are the helpers'
plain Python path (DataLoader, `num_workers=0` peers), so both paths give the same values.

Leaves: an array leaf with at least one dimension is *ragged* (it takes the helper's form) unless
the helper names its ragged fields (`ragged=("boxes",)`: top-level keys or indices), in which case
other array leaves are *fixed* and stacked as default_collate stacks them. Numbers are stacked
into a tensor; strings and other objects are gathered by default_collate, as in every batch.

The ``collate`` argument of the functions here is a `collate.RaggedCollate` helper, typed `Any`:
`collate.py` imports this module, so this one does not import it back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..core.constants import ALIGN
from ..core.deferred import DeferredArray, FillFailed
from ..core.deferred import put as _put
from ..engine.layout import (Leaf, StructureMismatch, as_numpy, collated_spec, extract, flatten,
                             place, slot_views)
from ..engine.messages import BatchLayout
from ..engine.pool import SlotRef
from ..engine.slot_collate import collate_metas, tensor_dtype

MAX_CU_SEQLEN = 2**31 - 1  # cu_seqlens is int32 (FlashAttention's varlen layout)
# what a later sample's array leaf may be (its kind, shape and dtype are checked by the form)
_ARRAYS = (np.ndarray, torch.Tensor, np.generic, int, float, bool, DeferredArray)


@dataclass
class Plan:
    """One batch's output: its spec, arrays (Leaf, offset), objects, and how to fill the bytes."""

    spec: tuple
    leaves: list[tuple[Leaf, int]]
    metas: list
    nbytes: int
    writers: list[Callable[[list[np.ndarray]], None]]  # each fills its views (given in order)
    counts: list[int]  # how many of `leaves` each writer fills
    num_samples: int


def _leaf_names(spec: tuple, kind: str = "leaf") -> dict[int, Any]:
    """For each array leaf (``kind="meta"``: each object) of a sample spec: the top-level key or
    index it sits under (None for a sample that is a bare array)."""
    names: dict[int, Any] = {}

    def walk(node: Any, top: Any) -> None:
        if type(node) is tuple and node and node[0] == kind:
            names[node[1]] = top
        elif type(node) is tuple and node and node[0] == "map":
            for key, child in zip(node[2], node[3]):
                walk(child, key if top is None else top)
        elif type(node) is tuple and node and node[0] in ("seq", "namedtuple"):
            for i, child in enumerate(node[-1]):
                walk(child, i if top is None else top)
    walk(spec, None)
    return names


def _sample_name(indices: Sequence | None, j: int) -> str:
    return f"sample {indices[j]!r}" if indices is not None else f"sample {j} of the batch"


def plan(collate: Any, samples: list, indices: Sequence | None = None) -> Plan:
    """The output of `collate` for `samples` (`indices` name them in errors)."""
    if not samples:
        raise ValueError(f"{collate!r}: a batch needs at least one sample")
    arrays: list = []
    metas: list = []
    first_leaves: list[Leaf] = []
    spec = flatten(samples[0], arrays, metas, True, first_leaves)
    columns = [[as_numpy(a)] for a in arrays]
    meta_columns = [[m] for m in metas]
    bare = spec == ("leaf", 0)  # each sample is one array (token lists): nothing to walk
    for j in range(1, len(samples)):
        s_arrays: list = [samples[j]] if bare else []
        s_metas: list = []
        try:
            if not bare:
                extract(spec, samples[j], s_arrays, s_metas)
            if len(s_arrays) != len(arrays):
                raise StructureMismatch
        except StructureMismatch:
            raise ValueError(f"{collate!r}: {_sample_name(indices, j)} does not have the structure "
                             f"of {_sample_name(indices, 0)} (every sample of a batch needs the "
                             "same keys and fields)") from None
        for k, value in enumerate(s_arrays):
            if not isinstance(value, _ARRAYS):
                raise ValueError(f"{collate!r}: field {_leaf_names(spec).get(k)!r} of "
                                 f"{_sample_name(indices, j)} is a {type(value).__name__}, not "
                                 "an array like in the first sample")
            columns[k].append(as_numpy(value))
        for col, m in zip(meta_columns, s_metas):
            col.append(m)
    names = _leaf_names(spec)
    out_leaves: list[Leaf] = []
    writers: list[Callable] = []
    counts: list[int] = []
    nodes: list[Any] = []
    for k, (leaf, column) in enumerate(zip(first_leaves, columns)):
        is_ragged = leaf.shape != () and (collate.ragged is None or names[k] in collate.ragged)
        where = (collate, names[k], indices)
        if is_ragged:
            made = collate.form_plan(column, leaf, where)
        else:
            made = _stacked(column, leaf, where)
        node_leaves, writer, node = made
        base = len(out_leaves)
        out_leaves.extend(node_leaves)
        writers.append(writer)
        counts.append(len(node_leaves))
        nodes.append(_renumber(node, base))
    offsets, total = place(out_leaves)
    out_spec = _replace_leaves(spec if collate.keeps_containers else collated_spec(spec), nodes)
    return Plan(spec=out_spec, leaves=list(zip(out_leaves, offsets)),
                metas=_metas(collate, spec, meta_columns), nbytes=total, writers=writers,
                counts=counts, num_samples=len(samples))


def _renumber(node: Any, base: int) -> Any:
    """A form's spec node with its leaf numbers shifted to where its arrays start."""
    if node[0] == "leaf":
        return ("leaf", node[1] + base)
    if node[0] == "namedtuple":
        return ("namedtuple", node[1], [_renumber(c, base) for c in node[2]])
    return ("seq", node[1], [_renumber(c, base) for c in node[2]])


def _replace_leaves(spec: Any, nodes: list) -> Any:
    """`spec` with its k-th ("leaf", k) node replaced by `nodes[k]`."""
    if spec[0] == "leaf":
        return nodes[spec[1]]
    if spec[0] == "meta":
        return spec
    if spec[0] == "map":
        return ("map", spec[1], spec[2], [_replace_leaves(c, nodes) for c in spec[3]])
    return spec[:-1] + ([_replace_leaves(c, nodes) for c in spec[-1]],)


def _where(where: tuple) -> str:
    collate, name, _ = where
    return f"{collate!r}, field {name!r}" if name is not None else f"{collate!r}"


def put(dst: np.ndarray, value: Any, where: tuple, j: int) -> None:
    """``dst[...] = value`` for sample ``j`` of the batch; a deferred array (`deferred.py`) fills
    ``dst`` itself, and its failure is that sample's (`deferred.FillFailed`)."""
    if not isinstance(value, DeferredArray):
        dst[...] = value
        return
    try:
        _put(dst, value)
    except Exception as exc:
        indices = where[2]
        raise FillFailed(indices[j] if indices is not None else j,
                         f"{_where(where)}: {_sample_name(indices, j)}: its deferred array "
                         f"failed to fill: {type(exc).__name__}: {exc}") from exc


def same_dtype(column: list[np.ndarray], where: tuple) -> None:
    """Every sample's array of one field has the first one's dtype (never promoted silently)."""
    dtype = column[0].dtype
    for j, a in enumerate(column):
        if a.dtype != dtype:
            raise ValueError(f"{_where(where)}: {_sample_name(where[2], j)} has dtype {a.dtype}, "
                             f"{_sample_name(where[2], 0)} {dtype}; convert them to one dtype in "
                             "the dataset")


def out_leaf(leaf: Leaf, shape: tuple) -> Leaf:
    """A tensor leaf of `shape` with `leaf`'s dtype (ndarrays become tensors, as in
    default_collate)."""
    return Leaf("tensor", tuple(int(s) for s in shape), tensor_dtype(leaf))


def _stacked(column: list[np.ndarray], leaf: Leaf, where: tuple) -> tuple:
    """A fixed leaf: stacked along a new first dimension, as default_collate does."""
    same_dtype(column, where)
    for j, a in enumerate(column):
        if a.shape != leaf.shape:
            raise ValueError(
                f"{_where(where)}: {_sample_name(where[2], j)} has shape {a.shape}, "
                f"{_sample_name(where[2], 0)} {leaf.shape}; a field that is not ragged must have "
                "one shape in every sample (name it in ragged= to hand it out ragged)")

    def write(views: list[np.ndarray]) -> None:
        dst = views[0]
        for j, a in enumerate(column):
            dst[j] = a
    return [out_leaf(leaf, (len(column),) + leaf.shape)], write, ("leaf", 0)


def write(p: Plan, slot: np.ndarray) -> None:
    """Fill the bytes of plan `p` in `slot` (a uint8 array of at least `p.nbytes`)."""
    views = slot_views(slot, p.leaves)
    start = 0
    for writer, count in zip(p.writers, p.counts):
        writer(views[start:start + count])
        start += count


def write_batch(collate: Any, samples: list, indices: Sequence | None, ref: SlotRef,
                slot_of: Callable[[SlotRef], np.ndarray],
                request_slot: Callable[[int, SlotRef], SlotRef]) -> BatchLayout:
    """The worker's path: plan, swap for a bigger slot if needed, write; the layout to send."""
    p = plan(collate, samples, indices)
    if p.nbytes > ref.nbytes:
        ref = request_slot(p.nbytes, ref)
    write(p, slot_of(ref))
    return BatchLayout(ref=ref, spec=p.spec, leaves=p.leaves, metas=p.metas,
                       num_samples=p.num_samples)


def _metas(collate: Any, spec: tuple, columns: list[list]) -> list:
    """The batch's objects: DataLoader's default_collate of each column, except tensors the
    pool does not hold (a tv_tensors.BoundingBoxes carries its format and canvas size) in a
    ragged field: those stay one per sample, as the field's arrays do (default_collate would
    stack them, and fail on the ragged shapes the field exists for)."""
    names = _leaf_names(spec, "meta")
    per_sample = {k for k, column in enumerate(columns)
                  if (collate.ragged is None or names.get(k) in collate.ragged)
                  and all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in column)}
    return collate_metas(spec, columns, per_sample)


def collate_in_memory(collate: Any, samples: list) -> Any:
    """The plain Python path: the same plan and bytes in a private buffer, as tensors."""
    from ..engine.layout import unflatten

    p = plan(collate, samples)
    raw = np.empty(p.nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN  # the slot's alignment, so every view is aligned too
    buf = raw[start:start + p.nbytes]
    write(p, buf)
    base = torch.from_numpy(buf)
    tensors = [base[off:off + leaf.nbytes].view(getattr(torch, leaf.dtype)).view(leaf.shape)
               for leaf, off in p.leaves]
    return unflatten(p.spec, tensors, p.metas)
