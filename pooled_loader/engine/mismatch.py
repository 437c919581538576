"""The error for a batch whose samples the default collate cannot stack: DataLoader's own words
(what torch's ``default_collate`` raises for the same two samples), the key where the samples
first differ, and what each has there."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import default_collate

__all__ = ["mismatch_message"]

RULE = ("PooledLoader's default collate needs every sample of a batch to have the same "
        "structure and array shapes/dtypes")


def _what(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(value, torch.Tensor) else "ndarray"
        return f"{kind} of shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, (str, bytes)):
        return f"{type(value).__name__} {value[:20]!r}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys {list(value)[:8]}"
    if isinstance(value, Sequence):
        return f"{type(value).__name__} of length {len(value)}"
    return f"{type(value).__name__} {value!r:.40}"


def _difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """(path, a's value, b's value) where the two samples first differ, or None."""
    if type(a) is not type(b) and not (isinstance(a, Mapping) and isinstance(b, Mapping)):
        return path, a, b
    if isinstance(a, Mapping):
        if list(a) != list(b):
            return path, a, b
        for key in a:
            found = _difference(a[key], b[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (torch.Tensor, np.ndarray, np.generic)):
        return None if (a.shape == b.shape and a.dtype == b.dtype) else (path, a, b)
    if isinstance(a, Sequence) and not isinstance(a, (str, bytes)):
        if len(a) != len(b):
            return path, a, b
        for k, (x, y) in enumerate(zip(a, b)):
            found = _difference(x, y, f"{path}[{k}]")
            if found:
                return found
    return None


def _torch_words(a: Any, b: Any) -> str | None:
    try:
        default_collate([a, b])
    except Exception as exc:  # noqa: BLE001 - its message is what we want
        return f"{exc}"
    return None


def mismatch_message(first: Any, other: Any, first_name: Any, other_name: Any) -> str:
    """Why `other` cannot be collated with `first` (samples named by their indices)."""
    words = _torch_words(first, other)
    found = _difference(first, other, "")
    where = ""
    if found is not None:
        path, a, b = found
        key = f"at {path}" if path else "as a whole"
        where = (f" (default collate, {key}: sample {other_name} has {_what(b)}, sample "
                 f"{first_name} has {_what(a)})")
    if words is None:  # torch would promote or convert: we never do it silently
        return f"{RULE}, but sample {other_name} differs from sample {first_name}{where}"
    return f"{words}{where}; {RULE}"
