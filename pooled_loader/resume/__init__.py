"""Checkpoint state of a loader: the state and its cursor (state), the resumable sampler (sampler),
resume on another world size (elastic), state keys (keys), StatefulDataLoader checkpoints
(sdl_compat), accelerate's corrected counts (yielded) and HF datasets that replay a state
(replay_watch).

Imports core/, observability/, shards/ and mix/ (their states, to merge them).

``pooled_loader.resume`` is a public import path: it re-exports ``pooled_loader.resume.state``
(the module it was before the regroup)."""
from __future__ import annotations

from .state import (has_state, SamplerCursor, WorkerStream, Progress, Resume, Limits, parse,
                    merge_rank_states, ResumableRandomSampler, sample_seed, seed_globals)  # noqa: F401
