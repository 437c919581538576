"""pooled_loader: a drop-in torch DataLoader whose data path allocates nothing in steady state."""
from __future__ import annotations

from typing import Any

import torch.utils.data

from .core.errors import PoolAllocationError, SampleError, WorkerError
from .integrations import maybe_patch_accelerate
from .loader import PooledLoader
from .engine.pool import SlotPool

maybe_patch_accelerate()  # so that accelerator.prepare(loader) keeps a PooledLoader

__all__ = ["PooledLoader", "SlotPool", "SampleError", "WorkerError", "PoolAllocationError", "get_worker_info"]
__version__ = "0.1.0"


def get_worker_info() -> Any:
    """Inside a worker: its id, num_workers, seed and dataset copy (torch's answer is the same);
    None in the main process."""
    return torch.utils.data.get_worker_info()
