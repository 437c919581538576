"""Per-sample seeds (``per_sample_seed=True``): a seed for each (base seed, epoch, index), and the
seeding of the global RNGs a transform draws from.

Why splitmix64: neighbouring indices or epochs must give unrelated seeds (``base + index`` gives
overlapping streams), the result must be the same in every process (no ``hash()``), and it costs
a few microseconds per sample. The cache's epoch variants (pooled_loader.cache.fingerprint) use
the same mixer.
"""
from __future__ import annotations

import contextvars
import hashlib
import random
import zlib
from typing import Any

import numpy as np
import torch

__all__ = ["splitmix64", "sample_seed", "seed_globals", "rng_fingerprint", "loader_epoch",
           "LOADER_EPOCH"]

# The epoch of the batch a PooledLoader is making in this thread: its count of epochs (the
# `seed_epoch` per-sample seeds use), the same in every worker and kept across a resume. Set by
# the engine around each batch; a dataset whose draws follow the epoch reads `loader_epoch()`.
LOADER_EPOCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("pooled_loader_epoch",
                                                                         default=None)

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """splitmix64's output mix: a 64-bit integer to an unrelated-looking 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _index_key(index: Any) -> int:
    if isinstance(index, (int, np.integer)):
        return int(index) & _MASK64
    return zlib.crc32(repr(index).encode())  # stable across processes, unlike hash()


def sample_seed(base_seed: int, epoch: int, index: Any) -> int:
    """A 63-bit seed for one sample: splitmix64 chained over (base seed, epoch, index), so that
    neighbouring indices or epochs give unrelated seeds (unlike base + index)."""
    x = splitmix64(base_seed & _MASK64)
    x = splitmix64(x ^ (epoch & _MASK64))
    return splitmix64(x ^ _index_key(index)) >> 1


def seed_globals(seed: int) -> None:
    """Seed the global RNGs a transform draws from: `random`, `numpy.random` and torch's CPU
    generator. Not `torch.manual_seed`: it also seeds every accelerator backend and costs ~100x
    more, per sample; workers draw on the CPU."""
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.default_generator.manual_seed(seed)


def rng_fingerprint(generator: torch.Generator | None) -> str:
    """A 64-bit digest of the state of the RNG a loader draws its base seeds from (`generator`,
    or torch's global one): a resume tells from it whether the script restored that RNG as it
    was when the state was saved (docs/resume.md). About 20 us."""
    state = (generator if generator is not None else torch.default_generator).get_state()
    return hashlib.blake2b(state.numpy().tobytes(), digest_size=8).hexdigest()


def loader_epoch() -> int | None:
    """The epoch of the batch a PooledLoader is making here (0, 1, ... as the loader counts its
    epochs; restored by `load_state_dict`), or None outside one (DataLoader, direct indexing)."""
    return LOADER_EPOCH.get()
