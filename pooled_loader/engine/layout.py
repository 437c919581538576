"""Batch layout: how a batch tree (tuples/lists/dicts of arrays, numbers and other objects) is laid
out in a slot.

A batch is flattened into a *spec* (the container structure, picklable), a list of array *leaves*
(placed in the slot, each aligned) and a list of *metas* (strings and other small objects that
travel in the done-message). The main process rebuilds the tree from the spec with zero-copy views
of the slot.
"""
from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core import trees
from ..core.deferred import DeferredArray
from ..core.constants import ALIGN, round_up

_TORCH_TO_NUMPY = {
    torch.bool: np.dtype(np.bool_), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64), torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
    torch.complex64: np.dtype(np.complex64), torch.complex128: np.dtype(np.complex128),
    torch.bfloat16: np.dtype(np.uint16),  # stored bit-exact; viewed back as bfloat16
    torch.uint16: np.dtype(np.uint16), torch.uint32: np.dtype(np.uint32),
    torch.uint64: np.dtype(np.uint64),
}


@dataclass(frozen=True)
class Leaf:
    """One array of a batch: what the user gets (a torch tensor or an ndarray) and its shape."""

    kind: str  # "tensor" or "ndarray"
    shape: tuple[int, ...]
    dtype: str  # torch dtype name ("float32") for tensors, numpy dtype str ("<f4") for ndarrays
    cls: type | None = None  # a tensor subclass the user gets (None: a plain tensor/ndarray)

    @property
    def storage_dtype(self) -> np.dtype:
        """The numpy dtype the worker writes with (bit-compatible with the user's dtype)."""
        if self.kind == "tensor":
            return _TORCH_TO_NUMPY[getattr(torch, self.dtype)]
        return np.dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.storage_dtype.itemsize  # per batch and leaf: no numpy


_NUMBER_DTYPES = {bool: "bool", int: "int64", float: "float64"}


def leaf_of(value: Any, numbers: bool | str = False) -> Leaf | None:
    """The Leaf describing `value` as it is (no batch dimension), or None if it is not an array.

    With `numbers=True`, Python and numpy scalars count as 0-d tensor leaves (default_collate
    turns a batch of them into a tensor); with `numbers="numpy"` only numpy scalars do (as
    default_convert converts them).
    """
    if numbers:
        if numbers is True and type(value) in _NUMBER_DTYPES:
            return Leaf("tensor", (), _NUMBER_DTYPES[type(value)])
        if isinstance(value, np.number) or isinstance(value, np.bool_):
            torch_dtype = torch.from_numpy(np.asarray(value)).dtype
            return Leaf("tensor", (), str(torch_dtype).split(".")[1])
    if isinstance(value, torch.Tensor):
        # Layouts the pool cannot hold, and subclasses it cannot rebuild (instance attributes,
        # a __torch_function__ that keeps them, a class that does not pickle), stay objects:
        # they travel DataLoader's way and keep their type.
        cls = type(value)
        if (value.dtype not in _TORCH_TO_NUMPY or value.is_sparse or value.is_nested
                or (cls is not torch.Tensor and (value.__dict__ or not slot_subclass(cls)))):
            return None
        return Leaf("tensor", tuple(value.shape), str(value.dtype).split(".")[1],
                    None if cls is torch.Tensor else cls)
    if isinstance(value, (np.ndarray, DeferredArray)) and value.dtype.kind in "biufc":
        return Leaf("ndarray", tuple(value.shape), value.dtype.str)
    return None


@functools.lru_cache(maxsize=64)
def collated_type(cls: type) -> type:
    """The type ``torch.stack`` (default_collate) gives a batch of ``cls`` tensors: torch.Tensor
    for torchvision's tv_tensors (their ``__torch_function__`` unwraps), ``cls`` itself for a
    subclass with torch's default one. Asked of the class once, on an empty instance."""
    return type(torch.stack([torch.empty(0).as_subclass(cls)]))


@functools.lru_cache(maxsize=64)
def slot_subclass(cls: type) -> bool:
    """True when tensors of the subclass ``cls`` (without instance attributes) can go through a
    slot: both it and the type a batch of them collates to are tensor classes that pickle by
    reference (the type travels in the done-message) and that ``as_subclass`` rebuilds with
    nothing lost: torch's own ``__torch_function__`` gives ``ret.as_subclass(cls)`` too."""
    plain = torch.Tensor.__torch_function__.__func__
    try:
        out = collated_type(cls)
        for c in {cls, out}:
            if pickle.loads(pickle.dumps(c)) is not c:
                return False
    except Exception:  # noqa: BLE001  (a class that cannot be probed stays DataLoader's way)
        return False
    return out is torch.Tensor or getattr(out.__torch_function__, "__func__", None) is plain


def as_type(tensor: torch.Tensor, cls: type | None) -> torch.Tensor:
    """``tensor`` (a view of a slot) as the subclass ``cls`` the user gets (None: as it is)."""
    return tensor if cls is None or cls is torch.Tensor else tensor.as_subclass(cls)


def as_numpy(value: Any) -> np.ndarray:
    """A numpy view (no copy) of a tensor or array leaf, in its storage dtype (a deferred array
    as it is: it fills the slot itself)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        if value.dtype == torch.bfloat16:
            value = value.view(torch.int16)
            return value.numpy().view(np.uint16)
        return value.numpy()
    if isinstance(value, DeferredArray):
        return value  # type: ignore[return-value]
    return np.asarray(value)


def place(leaves: list[Leaf]) -> tuple[list[int], int]:
    """Offsets of each leaf in a slot (aligned to ALIGN bytes) and the total bytes needed."""
    offsets, end = [], 0
    for leaf in leaves:
        offsets.append(end)
        end += round_up(leaf.nbytes, ALIGN)
    return offsets, end


def slot_views(slot: np.ndarray, placed: Any) -> list[np.ndarray]:
    """Numpy views (the storage dtype) of each placed ``(leaf, offset)`` in ``slot``."""
    return [slot[off:off + leaf.nbytes].view(leaf.storage_dtype).reshape(leaf.shape)
            for leaf, off in placed]


# ---------------------------------------------------------------------------------------------
# Trees (walked by trees.py): a sample/batch is flattened into (spec, arrays, metas) and rebuilt
# from views. Leaf nodes of the spec: ("leaf", i) for arrays[i], ("meta", i) for metas[i].


def flatten(tree: Any, arrays: list, metas: list, numbers: bool | str = False,
            leaves: list | None = None) -> tuple:
    """Flatten `tree`; appends array leaves to `arrays` (and their `Leaf` to `leaves`, if
    given) and other objects to `metas`.

    With `numbers`, Python/numpy scalars are array leaves too (see `leaf_of`).
    """
    def leaf(value: Any) -> tuple:
        found = leaf_of(value, numbers)
        if found is not None:
            arrays.append(value)
            if leaves is not None:
                leaves.append(found)
            return ("leaf", len(arrays) - 1)
        metas.append(value)
        return ("meta", len(metas) - 1)

    return trees.flatten(tree, leaf)


def unflatten(spec: tuple, arrays: list, metas: list) -> Any:
    """Rebuild the tree described by `spec` from its leaves."""
    return trees.unflatten(spec, lambda node: (arrays if node[0] == "leaf" else metas)[node[1]])


StructureMismatch = trees.Mismatch  # a sample does not have the structure of the samples before it


def extract(spec: tuple, tree: Any, arrays: list, metas: list) -> None:
    """The leaves of `tree` in `spec`'s order: a fast `flatten` for a structure already seen.
    Raises StructureMismatch when the containers differ (leaf types are checked by the caller)."""
    trees.flatten_as(spec, tree, lambda node, value: (
        arrays if node[0] == "leaf" else metas).append(value))


def collated_spec(spec: tuple) -> tuple:
    """The spec of default_collate's output for samples of `spec`: tuples become lists."""
    tag = spec[0]
    if tag == "map":
        return ("map", spec[1], spec[2], [collated_spec(c) for c in spec[3]])
    if tag == "namedtuple":
        return ("namedtuple", spec[1], [collated_spec(c) for c in spec[2]])
    if tag == "seq":
        return ("seq", list if spec[1] is tuple else spec[1], [collated_spec(c) for c in spec[2]])
    return spec


def metas_in_sequences(spec: tuple) -> list[bool]:
    """For each meta of `spec`, in order: whether it sits directly in a list, tuple or namedtuple.
    default_collate gathers such a meta's batch as a tuple (it transposes with zip), and the batch
    of a meta in a dict or at the top as a list."""
    found: list[bool] = []

    def walk(node: tuple, in_sequence: bool) -> None:
        tag = node[0]
        if tag == "meta":
            found.append(in_sequence)
        elif tag == "map":
            for child in node[3]:
                walk(child, False)
        elif tag in ("seq", "namedtuple"):
            for child in node[-1]:
                walk(child, True)
    walk(spec, False)
    return found


def same_structure(a: tuple, b: tuple) -> bool:
    """True when two specs have the same containers and keys (leaf numbering aside)."""
    if a[0] != b[0]:
        return False
    if a[0] == "map":
        return a[2] == b[2] and all(same_structure(x, y) for x, y in zip(a[3], b[3]))
    if a[0] in ("seq", "namedtuple"):
        children_a, children_b = a[-1], b[-1]
        return len(children_a) == len(children_b) and all(
            same_structure(x, y) for x, y in zip(children_a, children_b))
    return True


def empty_like_tree(spec: tuple, arrays: list) -> Any:
    """The `out` tree of the zero-copy protocol: `arrays[i]` at array leaves, None elsewhere."""
    tag = spec[0]
    if tag == "leaf":
        return arrays[spec[1]]
    if tag == "meta":
        return None
    if tag == "map":
        return {k: empty_like_tree(c, arrays) for k, c in zip(spec[2], spec[3])}
    children = [empty_like_tree(c, arrays) for c in spec[-1]]
    return tuple(children) if spec[0] == "namedtuple" or spec[1] is tuple else children
