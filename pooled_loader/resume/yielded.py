"""The batch counts that torchdata's StatefulDataLoader keeps at the top of its state, where
tools that wrap a loader read and correct them.

accelerate's ``DataLoaderDispatcher`` (an iterable dataset on several processes) asks the loader
for its state before fetching each of its ``num_processes`` batches, so the state it keeps is
``num_processes - 1`` batches ahead of what the processes were given; it corrects that by
lowering ``_num_yielded`` and ``_sampler_iter_yielded`` at the top level of the state
(``adjust_state_dict_for_prefetch``). :func:`expose` puts our counts there;
:func:`honour_adjustment` turns a lowered count back into our position, by undoing the last
batches delivered: the last sampler items (map-style), or the items each worker's stream gave
for them, newest first, in the order the workers took turns (iterable).
"""
from __future__ import annotations

import copy
from typing import Any

from ..core.errors import StateMismatch
from .keys import (DATASET_STATE, FETCHER_ENDED, FETCHER_STATE, INDEX_SAMPLER_STATE,
                   ITERATOR_FINISHED, LAST_YIELDED_WORKER_ID, LEN_CALLED, MAIN_SNAPSHOT,
                   NUM_WORKERS, NUM_YIELDED, POOLED, SAMPLER_ITER_STATE, SAMPLER_ITER_YIELDED,
                   SHARED_SEED, SNAPSHOT, SNAPSHOT_STEP, WORKER_SNAPSHOTS)

__all__ = ["NUM_YIELDED", "expose", "honour_adjustment"]

SAMPLER_YIELDED = SAMPLER_ITER_YIELDED  # StatefulDataLoader's top-level counts


WRITTEN = "top_level_num_yielded"  # in "_pooled": the count as we wrote it




def expose(state: dict) -> dict:
    """`state` (with an entry per worker in `_worker_snapshots`: `state.build_state`) with the
    delivered batch count (and sampler items) at its top level, and every key of
    StatefulDataLoader's layout present: with 0 workers the single-process layout's top-level keys
    (the same values as inside)."""
    snap = state[SNAPSHOT]
    main = snap[MAIN_SNAPSHOT]
    state[NUM_YIELDED] = state[POOLED][WRITTEN] = snap[SNAPSHOT_STEP]
    state[SAMPLER_YIELDED] = main[SAMPLER_ITER_YIELDED]
    main[SAMPLER_ITER_STATE] = main[SHARED_SEED] = main[LEN_CALLED] = None
    if main[NUM_WORKERS] == 0:
        only = snap[WORKER_SNAPSHOTS]["worker_0"]
        state.update({INDEX_SAMPLER_STATE: main[INDEX_SAMPLER_STATE], SAMPLER_ITER_STATE: None,
                      SHARED_SEED: None, LEN_CALLED: None, DATASET_STATE: only[DATASET_STATE],
                      FETCHER_STATE: only[FETCHER_STATE] if state[POOLED].get("iterable")
                      else None})
    return state


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _lowered_by(state: Any) -> int:
    """Batches by which a tool lowered the top-level count since we wrote it (0: untouched,
    absent, or a state whose own counts are not sound: parse() then says what is wrong)."""
    if not isinstance(state, dict) or not isinstance(state.get(SNAPSHOT), dict) \
            or not isinstance(state.get(POOLED), dict):
        return 0
    written, top = state[POOLED].get(WRITTEN), state.get(NUM_YIELDED)
    if not (_is_count(written) and _is_count(top)) or state[SNAPSHOT].get(SNAPSHOT_STEP) \
            != written:
        return 0
    return max(written - top, 0)


def honour_adjustment(state: dict) -> dict:
    """`state` (a copy) with its position moved back by the batches its top-level
    `_num_yielded` was lowered by; `state` itself when it was not lowered."""
    lowered = _lowered_by(state)
    if lowered == 0 or state.get(ITERATOR_FINISHED):
        return state  # a finished epoch resumes as a fresh one whatever its counts
    original, state = state, copy.deepcopy(state)
    snap, pooled = state[SNAPSHOT], state.get(POOLED, {})
    try:
        if pooled.get("iterable"):
            _undo_stream_batches(snap, lowered, pooled.get("batch_size"))
        else:
            _undo_sampler_batches(snap, pooled, lowered)
        snap[SNAPSHOT_STEP] -= lowered
    except (KeyError, TypeError, AttributeError):
        return original  # malformed: resume.parse names the key that is wrong
    return expose(state)  # consistent again: loading it twice moves back once


def _undo_sampler_batches(snap: dict, pooled: dict, lowered: int) -> None:
    main = snap[MAIN_SNAPSHOT]
    prefix = main[SAMPLER_ITER_YIELDED] - lowered
    if pooled.get("delivered_ahead") or prefix < pooled.get("sampler_snapshot_step", 0):
        raise StateMismatch(
            f"PooledLoader.load_state_dict: the state's '{NUM_YIELDED}' was lowered by {lowered} "
            "batches, further back than its sampler snapshot: build the loader with "
            f"snapshot_every_n_steps greater than {lowered} to resume from such states")
    main[SAMPLER_ITER_YIELDED] = prefix


def _undo_stream_batches(snap: dict, lowered: int, batch_size: int | None) -> None:
    workers = snap[WORKER_SNAPSHOTS]
    streams = {entry["worker_id"]: entry for entry in workers.values()}
    if not streams:
        raise StateMismatch(f"PooledLoader.load_state_dict: the state's '{NUM_YIELDED}' was "
                            f"lowered by {lowered} batches but it records none delivered")
    count = max(streams) + 1
    worker = snap[LAST_YIELDED_WORKER_ID]
    per_batch = batch_size or 1
    for _ in range(lowered):
        entry = streams.get(worker)
        if entry is None or entry["items_since_snapshot"] < per_batch \
                or entry[FETCHER_STATE][FETCHER_ENDED]:
            raise StateMismatch(
                f"PooledLoader.load_state_dict: the state's '{NUM_YIELDED}' was lowered by "
                f"{lowered} batches, but worker {worker}'s stream cannot be moved back that far "
                "(its dataset's own state was saved since, or its stream had ended): build the "
                f"loader with snapshot_every_n_steps greater than {lowered}, or 0")
        entry["items"] -= per_batch
        entry["items_since_snapshot"] -= per_batch
        if isinstance(entry.get("batches"), int):
            entry["batches"] -= 1
        # the worker before it in the turns (ended streams take no turn)
        for _ in range(count):
            worker = (worker - 1) % count
            if worker in streams and not streams[worker][FETCHER_STATE][FETCHER_ENDED]:
                break
    snap[LAST_YIELDED_WORKER_ID] = worker
