"""Distributed helpers: who am I, and how the loader splits a map-style dataset across ranks.

``PooledLoader(..., distributed=True)`` builds its sampler with :func:`make_distributed_sampler`
(``elastic.ElasticDistributedSampler``: torch's ``DistributedSampler``, every rank gets
``ceil(len / world)`` indices, padded by repetition unless ``drop_last``, reshuffled by
``sampler.set_epoch``, and its epoch can be resumed on another world size).
:func:`warn_if_undistributed` (at a loader's first ``iter()``, when accelerate or Lightning
have put their own sampler in) is the loader's guard against the common mistake of running DDP
with ``shuffle=True`` and no distributed sampler, where every rank trains on the whole dataset.
:func:`warn_if_starved` (at a loader's first ``iter()``) says when a rank or a worker is left
with no data by the split (a tiny dataset over many ranks or workers), naming the counts.

Iterable datasets split themselves; :class:`pooled_loader.webdataset.WebDataset` does so with
:func:`rank_and_world` and declares it with the attribute ``splits_by_rank = True``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch.distributed as dist
from torch.utils.data import DistributedSampler, IterableDataset, Sampler

from .core.ranks import _dist_ready, empty_rank_message, rank_and_world  # noqa: F401

__all__ = ["rank_and_world", "make_distributed_sampler", "shards_by_rank",
           "warn_if_undistributed", "warn_if_starved", "empty_rank_message"]

_warned_undistributed = False


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
    from .resume.elastic import ElasticDistributedSampler  # torch's order, resumable on any world size
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


def _length(obj: Any) -> Optional[int]:
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def warn_if_starved(dataset: Any, sampler: Any, index_sampler: Any, *, num_workers: int,
                    batch_size: Optional[int], drop_last: bool) -> Optional[str]:
    """Warn, naming the counts, when this rank gets no sample, some of its workers get none (an
    iterable dataset that splits itself by rank and worker, e.g. WebDataset), or its samples make
    no batch (``drop_last``). A rank left with nothing by such a dataset is the dataset's to report
    (:func:`empty_rank_message`; WebDataset does). Every split here gives each rank the same
    count, so nothing is uneven: the warning is about data that no one reads. Returns the
    message (None: no warning)."""
    if isinstance(dataset, IterableDataset):
        message = _starved_workers(dataset, num_workers, batch_size, drop_last)
    else:
        message = _starved_rank(dataset, sampler, index_sampler, batch_size, drop_last)
    if message is not None:
        warnings.warn(f"PooledLoader: {message}", UserWarning, stacklevel=4)
    return message


def _starved_workers(dataset: Any, num_workers: int, batch_size: Optional[int],
                     drop_last: bool) -> Optional[str]:
    samples = _length(dataset)  # this rank's share
    if not getattr(dataset, "splits_by_rank", False) or not samples:
        return None
    _, world = rank_and_world()
    shards = len(getattr(dataset, "urls", ()) or ())
    where = (f"{type(dataset).__name__} has "
             f"{getattr(dataset, 'samples_per_epoch', samples * world)} samples"
             + (f" in {shards} shard(s)" if shards else "")
             + f" over {world} rank(s), {samples} per rank")
    workers = max(num_workers, 1)
    largest = -(-samples // workers)  # the largest worker's piece of the rank's share
    if samples < workers:
        return (f"{where}, and {workers} workers per rank: {workers - samples} worker(s) of "
                f"each rank read nothing. Use num_workers={samples} or fewer.")
    if drop_last and batch_size and largest < batch_size:
        return (f"{where}, split over {workers} worker(s) of at most {largest} each: with "
                f"batch_size={batch_size} and drop_last=True every worker's batch is dropped "
                "(0 batches). Use fewer workers, a smaller batch_size, or drop_last=False.")
    return None


def _starved_rank(dataset: Any, sampler: Any, index_sampler: Any, batch_size: Optional[int],
                  drop_last: bool) -> Optional[str]:
    samples = _length(dataset)
    if not samples or not drop_last:
        return None
    split = next((p for p in (sampler, getattr(index_sampler, "sampler", None))
                  if p is not None and hasattr(p, "num_replicas")), None)
    per_rank = _length(split) if split is not None else samples
    where = f"{samples} samples"
    if split is not None:
        where += f" over {split.num_replicas} rank(s)"
    if per_rank == 0:
        return (f"{where} with drop_last=True: every rank gets {samples} // "
                f"{split.num_replicas} = 0 samples per epoch. Use fewer ranks or "
                "drop_last=False (which pads by repeating samples).")
    if batch_size and _length(index_sampler) == 0:
        if split is not None:
            where += f", {per_rank} per rank"
        return (f"{where}: with "
                f"batch_size={batch_size} and drop_last=True the epoch has 0 batches. Use a "
                "smaller batch_size or drop_last=False.")
    return None
