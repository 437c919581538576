"""pooled_loader: a drop-in torch DataLoader whose data path allocates nothing in steady state.

``PooledLoader`` and ``SlotPool`` are loaded on first use (PEP 562), so that importing one
sub-package (``pooled_loader.vision``, ``pooled_loader.engine.worker``) loads only what it imports
itself, never the loader and everything it composes."""
from __future__ import annotations

from typing import Any

import torch.utils.data

from .core.errors import PoolAllocationError, SampleError, SkipBudgetExceeded, WorkerError
from .integrations import maybe_patch_accelerate

maybe_patch_accelerate()  # so that accelerator.prepare(loader) keeps a PooledLoader

__all__ = ["PooledLoader", "SlotPool", "SampleError", "WorkerError", "PoolAllocationError",
           "SkipBudgetExceeded", "get_worker_info"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "PooledLoader":
        from .loader import PooledLoader as value
    elif name == "SlotPool":
        from .engine.pool import SlotPool as value
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"PooledLoader", "SlotPool"})


def get_worker_info() -> Any:
    """Inside a worker: its id, num_workers, seed and dataset copy (torch's answer is the same);
    None in the main process."""
    return torch.utils.data.get_worker_info()
