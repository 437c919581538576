"""Who am I in a distributed job: rank and world size from torch.distributed or torchrun's
environment, and the message for a split that leaves every rank empty.

The layers below the loader (shards, mix, samplers) need only this, not the samplers and
warnings of ``pooled_loader.distributed`` (which builds on resume/)."""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist


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


def empty_rank_message(samples: int, shards: int, world: int) -> Optional[str]:
    """What to say when `samples` (in `shards` shards) split over `world` ranks leave every rank
    with none (each rank gets samples // world, so that ranks yield equal counts); None when
    they do not."""
    if samples // world > 0:
        return None
    return (f"{samples} samples in {shards} shard(s) over {world} rank(s): every rank reads 0 "
            f"samples per epoch (each gets {samples} // {world}, so that ranks yield equal "
            f"counts). Use at most {samples} ranks, or more data.")
