"""`EpochSpec`: everything an epoch's iterator takes from its `PooledLoader`, in one object.

The loader builds one each time an iterator starts or restarts an epoch (``iter(loader)``, a
persistent iterator's next epoch, ``state_dict()`` before the first ``iter()``); the iterator reads
it then and keeps no reference to it or to the loader, so data flows one way: arguments, the
pool, the statistics and a loaded state in; the epoch's position back through ``publish``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # types only: this module imports nothing of the package at run time
    import torch

__all__ = ["EpochSpec"]


@dataclass(frozen=True, kw_only=True)
class EpochSpec:
    """One epoch's inputs (from the loader's arguments and state) and its one output; built
    once, never changed."""

    dataset: Any
    index_sampler: Any  # the loader's batch sampler, or its sampler without auto-collation
    generator: "torch.Generator | None"
    num_workers: int
    batch_size: int | None
    drop_last: bool
    auto_collation: bool
    collate_fn: Callable | None  # None: the pooled default collate (or convert)
    ragged: bool  # collate_fn is a `pooled_loader.collate` helper writing into the slot itself
    on_error: str
    per_sample_seed: bool
    elastic: Any  # the ElasticDistributedSampler seeding samples (per_sample_seed), or None
    snapshot_every: int
    persistent_workers: bool
    prefetch_factor: int
    timeout: float
    worker_init_fn: Callable | None
    multiprocessing_context: Any
    in_order: bool
    pin_memory: bool
    pin_memory_device: str
    pinned: bool  # batches come from a pinned pool (a CUDA device, or pin_memory with CUDA)
    len_called: int | None  # len(loader) of an iterable dataset, once asked (DataLoader's check)
    loader_epoch: int | None  # the last `set_epoch()`, forwarded to persistent workers' datasets
    pool: Any  # the loader's `pool.SlotPool`
    stats: Any  # the loader's `stats.LoaderStats`
    resume: Any  # the loaded `position.Resume` this epoch starts from (handed over once), or None
    publish: Callable[[Any], None]  # takes the epoch's `position.EpochPosition` (state_dict's)
    # failures (docs/failures.md): the loader's `failover.Failover` (replacements of a run),
    # seconds without progress before a worker is named and killed (0: never), the skip budget
    failover: Any = None
    worker_timeout: float = 0.0
    max_skip_fraction: float | None = None
    max_consecutive_skips: int | None = None
