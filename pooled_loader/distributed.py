"""Distributed helpers: who am I, and how the loader splits a map-style dataset across ranks.

``PooledLoader(..., distributed=True)`` builds its sampler with :func:`make_distributed_sampler`
(``elastic.ElasticDistributedSampler``: torch's ``DistributedSampler``, every rank gets
``ceil(len / world)`` indices, padded by repetition unless ``drop_last``, reshuffled by
``sampler.set_epoch``, and its epoch can be resumed on another world size).
:func:`warn_if_undistributed` (at a loader's first ``iter()``, when accelerate or Lightning
have put their own sampler in) is the loader's guard against the common mistake of running DDP
with ``shuffle=True`` and no distributed sampler, where every rank trains on the whole dataset.

Iterable datasets split themselves; :class:`pooled_loader.webdataset.WebDataset` does so with
:func:`rank_and_world` and declares it with the attribute ``splits_by_rank = True``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

__all__ = ["rank_and_world", "make_distributed_sampler", "shards_by_rank",
           "warn_if_undistributed"]

_warned_undistributed = False


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` when it is initialised, else from the
    environment variables ``RANK`` / ``WORLD_SIZE`` (as set by torchrun), else ``(0, 1)``."""
    if _dist_ready():
        return dist.get_rank(), dist.get_world_size()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"invalid RANK={rank} / WORLD_SIZE={world} in the environment")
    return rank, world


def make_distributed_sampler(
    dataset: Any, shuffle: bool, seed: int = 0, drop_last: bool = False
) -> Optional[DistributedSampler]:
    """The sampler behind ``PooledLoader(..., distributed=True)``.

    Map-style datasets get a ``DistributedSampler`` for this process's rank (taken from
    :func:`rank_and_world`, so it also works under torchrun's environment before/without
    ``init_process_group``). An iterable dataset that splits itself across ranks
    (``splits_by_rank = True``) needs no sampler: returns ``None``. Any other iterable dataset
    raises ``ValueError``, because the loader cannot split a stream it does not index.
    """
    if isinstance(dataset, IterableDataset):
        if getattr(dataset, "splits_by_rank", False):
            return None
        raise ValueError(
            "distributed=True needs a map-style dataset (or an IterableDataset that splits "
            f"itself across ranks and sets splits_by_rank = True); got {type(dataset).__name__}"
        )
    from .elastic import ElasticDistributedSampler  # torch's order, resumable on any world size
    rank, world = rank_and_world()
    return ElasticDistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def shards_by_rank(*samplers: Any) -> bool:
    """Whether any of these samplers, batch samplers, or the samplers inside them, gives each
    rank its own share: torch's ``DistributedSampler`` (and Lightning's wrappers of it), or any
    sampler with ``num_replicas``/``rank`` or ``num_processes``/``process_index`` (accelerate's
    ``BatchSamplerShard``)."""
    seen = [s for s in samplers if s is not None]
    while seen:
        part = seen.pop()
        if isinstance(part, DistributedSampler) or (
                hasattr(part, "num_replicas") and hasattr(part, "rank")) or (
                hasattr(part, "num_processes") and hasattr(part, "process_index")):
            return True
        seen += [getattr(part, name) for name in ("sampler", "batch_sampler")
                 if getattr(part, name, None) is not None and getattr(part, name) is not part]
    return False


def warn_if_undistributed(shuffle: bool, sampler: Optional[Sampler],
                          batch_sampler: Any = None) -> bool:
    """Warn (once per process) when ``torch.distributed`` runs with more than one rank,
    ``shuffle=True`` and neither sampler shards by rank (:func:`shards_by_rank`): every rank
    would then see the whole dataset. Returns whether it warned on this call."""
    global _warned_undistributed
    if _warned_undistributed or not shuffle or shards_by_rank(sampler, batch_sampler):
        return False
    if not _dist_ready() or dist.get_world_size() < 2:
        return False
    _warned_undistributed = True
    warnings.warn(
        f"torch.distributed is initialised with {dist.get_world_size()} ranks but the loader "
        "shuffles without a DistributedSampler: every rank will iterate over the whole dataset. "
        "Pass distributed=True (or sampler=DistributedSampler(dataset)).",
        UserWarning,
        stacklevel=4,
    )
    return True
