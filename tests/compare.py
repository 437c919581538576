"""Recursive equality of batches (tensors, arrays, containers), types included."""
import numpy as np
import torch


def assert_same(a, b, path="batch"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor) and a.is_nested:  # no .shape; compared component-wise
        assert a.is_nested == b.is_nested, f"{path}: nested != not nested"
        parts_a, parts_b = a.unbind(), b.unbind()
        assert len(parts_a) == len(parts_b), f"{path}: {len(parts_a)} != {len(parts_b)} components"
        for i, (x, y) in enumerate(zip(parts_a, parts_b)):
            assert_same(x, y, f"{path}.unbind()[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        # subclasses (type checked above) compared as plain tensors: no __torch_function__ detour
        assert torch.equal(a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor)), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.array_equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
