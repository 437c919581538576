"""Deferred arrays: a sample's array whose values are written later, straight into the batch's slot.

Why: a transform that resamples (instance masks, nearest neighbour) would fill a fresh buffer that
the ragged collate (`pooled_loader.ragged.slots`) then copies into the slot. A :class:`DeferredArray`
gives its shape and dtype at once, so the batch can be planned, and writes its values into the
slot's view when the collate writes the batch: one pass instead of two.

A transform makes one only while :func:`accepting` is true: the worker sets it (:func:`accepted`)
around fetching a batch that a `pooled_loader.collate` helper collates; everywhere else it returns
plain arrays. Any other reader still gets the values: ``np.asarray`` materialises one. A deferred
array is filled once (its source is released then); a second fill raises. Imports: numpy.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import numpy as np

_ACCEPTING: contextvars.ContextVar[bool] = contextvars.ContextVar("deferred_accepting",
                                                                  default=False)


class DeferredArray:
    """An array of ``shape`` and ``dtype`` that ``fill_into(out)`` writes into ``out``."""

    def __init__(self, shape: tuple[int, ...], dtype: Any,
                 fill_into: Callable[[np.ndarray], Any]) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self._fill_into: Callable[[np.ndarray], Any] | None = fill_into

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def filled(self) -> bool:
        return self._fill_into is None

    def fill(self, out: np.ndarray) -> None:
        """Write the values into ``out`` (this shape and dtype); once only."""
        fill_into = self._fill_into
        if fill_into is None:
            raise RuntimeError(f"a deferred {self.shape} array was filled already")
        if out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"a deferred {self.shape} {self.dtype} array cannot fill an "
                             f"{out.shape} {out.dtype} one")
        self._fill_into = None  # the source goes with it, filled or failed
        fill_into(out)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        self.fill(out)
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"DeferredArray(shape={self.shape}, dtype={self.dtype}, filled={self.filled})"


class FillFailed(Exception):
    """A deferred array of the sample ``index`` failed to fill; the error is its cause."""

    def __init__(self, index: Any, message: str) -> None:
        super().__init__(message)
        self.index = index


def accepting() -> bool:
    """True while the batch being fetched is collated by a helper that fills deferred arrays."""
    return _ACCEPTING.get()


@contextlib.contextmanager
def accepted() -> Iterator[None]:
    """Within it, :func:`accepting` is true."""
    token = _ACCEPTING.set(True)
    try:
        yield
    finally:
        _ACCEPTING.reset(token)


def put(dst: np.ndarray, value: Any) -> None:
    """``dst[...] = value``, a deferred array filling ``dst`` itself when the dtypes match."""
    if isinstance(value, DeferredArray) and dst.dtype == value.dtype:
        value.fill(dst)
    else:
        dst[...] = value


__all__ = ["DeferredArray", "FillFailed", "accepting", "accepted", "put"]
