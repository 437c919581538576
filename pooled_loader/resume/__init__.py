"""A loader's checkpoint format: the state built from an epoch's position and read back
(state), its key names (keys), StatefulDataLoader checkpoints (sdl_compat), accelerate's corrected
counts (yielded), resume on another world size (elastic: merges the states of shards/ and mix/
too, hence above them) and HF datasets that replay a state (replay_watch). Where an epoch stands
is the machinery's (`engine.position`); the default shuffled sampler is `engine.sampler`'s.

Imports core/, observability/, engine/, shards/ and mix/.

``pooled_loader.resume`` is a public import path (the module it was before the regroup):
``merge_rank_states`` and ``ResumableRandomSampler``; ``StateMismatch`` as before."""
from __future__ import annotations

from ..core.errors import StateMismatch
from ..engine.sampler import ResumableRandomSampler
from .elastic import merge_rank_states

__all__ = ["merge_rank_states", "ResumableRandomSampler", "StateMismatch"]
