"""Which samples each (rank, worker) of a WebDataset reads in an epoch: the split of the epoch
policy in pooled_loader.webdataset's docstring (steps 2 and 3, and explicit mode).

Pure functions of the shard list, the counts, the seed and epoch, and the slot, so every rank and
worker computes the same split without talking to the others. ``slot_share`` is also how an
elastic resume re-deals the rest of an epoch (pooled_loader.shards.elastic).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["slot_share", "Piece", "plan_piece"]


def slot_share(total: int, rank: int, world: int, worker: int, workers: int) -> tuple[int, int]:
    """``(first position, count)`` of slot (``rank``, ``worker``) when ``total`` positions are
    split: rank ``r`` of ``world`` owns ``[r*B, (r+1)*B)`` with ``B = total // world`` (the last
    ``total % world`` go unseen, so every rank gets the same count), and worker ``k`` of
    ``workers`` a contiguous piece of ``B // workers`` of them (+1 for the first
    ``B % workers``)."""
    per_rank = total // world
    count = per_rank // workers + (1 if worker < per_rank % workers else 0)
    start = rank * per_rank + per_rank // workers * worker + min(worker, per_rank % workers)
    return start, count


@dataclass(frozen=True)
class Piece:
    """What one worker reads in an epoch."""

    quota: int  # samples it yields
    shards: list[str]  # the shards it cycles through, in order
    first: int = 0  # index in `shards` of the shard holding its first sample
    skip: int = 0  # samples of that shard before its first one
    last: int = 0  # index in `shards` of the last shard its piece reaches (prefetching stops)
    order: list[int] = field(default_factory=list)  # counted mode: `shards` as url indices


def plan_piece(urls: Sequence[str], sizes: Optional[Sequence[int]], samples_per_epoch: int, *,
               seed: int, epoch: int, shuffle_shards: bool, rank: int, world: int, worker: int,
               workers: int) -> Piece:
    """The piece of slot (``rank``, ``worker``) in ``epoch``. ``sizes``: each url's sample count
    (counted mode: the epoch's stream is the non-empty shards in the epoch's order), or None
    (explicit mode: the shards are dealt round-robin to the ``world * workers`` slots; a slot
    without one of its own reads the whole list rotated by its slot index)."""
    start, quota = slot_share(samples_per_epoch, rank, world, worker, workers)
    if quota == 0:
        return Piece(0, [])
    order = list(range(len(urls)))
    if shuffle_shards:
        random.Random(seed + epoch).shuffle(order)
    if sizes is None:
        shards = [urls[i] for i in order]
        slot, nslots = rank * workers + worker, world * workers
        own = shards[slot::nslots]
        if not own:
            r = slot % len(shards)
            own = shards[r:] + shards[:r]
        return Piece(quota, own, last=len(own) - 1)
    order = [i for i in order if sizes[i] > 0]  # empty or unreadable when counted
    first = 0
    while start >= sizes[order[first]]:  # find the shard holding position `start`
        start -= sizes[order[first]]
        first += 1
    last, left = first, start + quota
    while last < len(order) - 1 and left > sizes[order[last]]:
        left -= sizes[order[last]]
        last += 1
    return Piece(quota, [urls[i] for i in order], first, start, last, order)
