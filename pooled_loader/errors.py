"""Public import path: re-exports ``pooled_loader.core.errors``, where this module lives since the
regroup (issue 41)."""
from __future__ import annotations

from .core.errors import (SampleError, ShardFormatError, ShardIndexError, WorkerError,
                          PoolAllocationError, StateMismatch, ClassMismatchError, CacheError,
                          CacheFormatError, CacheRecordError, CacheIncompleteError,
                          CacheMismatchError, CacheSampleError, SkipBudgetExceeded)  # noqa: F401
