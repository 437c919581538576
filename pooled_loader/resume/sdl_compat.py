"""Loading torchdata ``StatefulDataLoader`` checkpoints into a ``PooledLoader``.

Why this module exists: a run that switches from StatefulDataLoader to PooledLoader has
checkpoints in StatefulDataLoader's layout. ``PooledLoader.load_state_dict`` recognises such a
state (no ``_pooled`` section) and :func:`from_sdl` rewrites it into ours, for a loader built with
the same arguments, so that the rest of the epoch is what StatefulDataLoader would have given.

What a StatefulDataLoader state holds (torchdata 0.11, ``stateful_dataloader.py``):

- 0 workers: the whole state is current. ``_num_yielded`` batches delivered; the sampler's
  position as its iterator's state (``_sampler_iter_state``: torchdata's ``BatchSampler``
  iterator, ``{"samples_yielded", "sampler_iter_state": {"yielded", "generator"}}`` for its
  ``RandomSampler``); the dataset's (``dataset_state``) and its iterator's
  (``fetcher_state.dataset_iter_state``) own states.
- N workers: ``_snapshot`` (taken every ``snapshot_every_n_steps``): ``_snapshot_step`` batches,
  ``_main_snapshot`` (the sampler, ``_base_seed``, ``_num_workers``), ``_worker_snapshots``
  (``worker_k``: that worker's dataset and iterator states), ``_last_yielded_worker_id``; then
  ``_steps_since_snapshot`` batches that StatefulDataLoader replays (loads and drops) on resume.

How it maps onto ours (pooled_loader.resume):

- Map-style: the delivered batches are ``_num_yielded`` (0 workers) or ``_snapshot_step +
  _steps_since_snapshot``. A shuffle (``RandomSampler``) is saved by StatefulDataLoader as the
  generator's state at the start of the pass: it becomes our ``ResumableRandomSampler``'s pass
  start, and the delivered batches are skipped by drawing indices only (the very permutation, so
  the rest of the epoch is StatefulDataLoader's). A stateful sampler of the same type as the
  loader's gets its own state back; a sampler without state is iterated afresh and skipped, as
  StatefulDataLoader does. Workers are seeded from the saved ``_base_seed`` and take turns after
  ``_last_yielded_worker_id``, as in a resumed StatefulDataLoader.
- Iterable: each worker's dataset and iterator states are restored in that worker, and the
  batches since the snapshot are skipped item by item (``batch_size`` items each) in the order
  the workers took turns. Without any state, every delivered batch is skipped from the stream's
  start, in turns from worker 0, as StatefulDataLoader fast-forwards.

Not convertible (``StateMismatch`` naming the key, or the difference; docs/resume.md): another
``num_workers`` for an iterable dataset or a dataset with its own state; a sampler whose saved
state has no counterpart in the loader's sampler; an iterable dataset without state of which a
worker's stream had ended (when it ended is not recorded). Later epochs follow PooledLoader's own
order: StatefulDataLoader's ``RandomSampler`` draws one permutation per pass before the base
seed, DataLoader's (ours) draws the seed first.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.data import BatchSampler

from ..core.errors import StateMismatch
from ..engine.sampler import ResumableRandomSampler, encode_generator
from .keys import (BASE_SEED, DATASET_ITER_STATE, DATASET_STATE, FETCHER_ENDED,
                         FETCHER_STATE, FORMAT, INDEX_SAMPLER_STATE, ITERATOR_FINISHED,
                         LAST_YIELDED_WORKER_ID, MAIN_SNAPSHOT, NUM_WORKERS, NUM_YIELDED, POOLED,
                         SAMPLER_ITER_STATE, SAMPLER_ITER_YIELDED, SNAPSHOT, SNAPSHOT_STEP,
                         STEPS_SINCE_SNAPSHOT, WORKER_ID, WORKER_SNAPSHOTS)
from ..core.stateful import follows_stateful

__all__ = ["is_sdl_state", "from_sdl"]

# inside torchdata's BatchSampler iterator state
SAMPLES_YIELDED, INNER_STATE, INNER_ITER_STATE = ("samples_yielded", "sampler_state",
                                                  "sampler_iter_state")

_LOAD = "PooledLoader.load_state_dict (a StatefulDataLoader state)"
MAX_GENERATOR_BYTES = 1 << 16  # a CPU generator's state is 5,056 bytes


def is_sdl_state(state: Any) -> bool:
    """Whether `state` is in StatefulDataLoader's layout (and not ours)."""
    if not isinstance(state, dict) or POOLED in state or ITERATOR_FINISHED not in state:
        return False
    return {SNAPSHOT, STEPS_SINCE_SNAPSHOT} <= set(state) or {
        NUM_YIELDED, SAMPLER_ITER_YIELDED, SAMPLER_ITER_STATE} <= set(state)


def _get(node: Any, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            raise StateMismatch(f"{_LOAD} is incomplete: '{path}' is missing")
        node = node[key]
    return node


def _count(node: Any, path: str) -> int:
    value = _get(node, path)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StateMismatch(f"{_LOAD} is corrupt: '{path}' should be a non-negative integer, "
                            f"got {value!r:.80}")
    return value


def _fetcher(entry: Any, path: str) -> tuple[Any, bool]:
    """(iterator state, ended) of a worker entry's `fetcher_state` (None for map-style)."""
    fetcher = _get(entry, FETCHER_STATE)
    if fetcher is None:
        return None, False
    ended = _get(fetcher, FETCHER_ENDED)
    if not isinstance(ended, bool):
        raise StateMismatch(f"{_LOAD} is corrupt: '{path}.{FETCHER_STATE}.{FETCHER_ENDED}' "
                            "should be true or false")
    return fetcher.get(DATASET_ITER_STATE), ended


def _generator_text(state: Any) -> str:
    """A saved generator state (a uint8 tensor), checked, as our states' text."""
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1
            and 0 < state.numel() <= MAX_GENERATOR_BYTES):
        raise StateMismatch(
            f"{_LOAD} is corrupt: its RandomSampler's generator state should be a 1-d uint8 "
            f"tensor of at most {MAX_GENERATOR_BYTES} bytes (Generator.get_state()), got "
            f"{type(state).__name__}")
    return encode_generator(state)


def _sampler_state(main: dict, index_sampler: Any) -> tuple[Any, bool]:
    """(our sampler state, whether it stands at the snapshot rather than at the pass's start)
    from StatefulDataLoader's sampler states in `main` (the snapshot's, or with 0 workers the
    current ones)."""
    iter_state = main.get(SAMPLER_ITER_STATE)
    index_state = main.get(INDEX_SAMPLER_STATE)
    inner = getattr(index_sampler, "sampler", None)
    ours_batches = type(index_sampler) is BatchSampler
    nested = iter_state if isinstance(iter_state, dict) else {}
    if ours_batches and isinstance(inner, ResumableRandomSampler):
        shuffle = nested.get(INNER_ITER_STATE)
        if isinstance(shuffle, dict) and "generator" in shuffle:  # torchdata's RandomSampler
            return {"inner": {"generator": _generator_text(shuffle["generator"]),
                              "yielded": 0}}, False
        if iter_state is not None:
            raise StateMismatch(
                f"{_LOAD}: this loader shuffles (shuffle=True) but the state's sampler was not "
                "StatefulDataLoader's RandomSampler (no generator state in "
                f"'{SAMPLER_ITER_STATE}'): build the loader with the sampler it was saved with")
        return None, False
    if ours_batches and follows_stateful(inner) and INNER_STATE in nested:
        return {"inner": nested[INNER_STATE]}, True
    if follows_stateful(index_sampler) and index_state is not None:
        return {"sampler": index_state}, True
    if iter_state is not None and not (set(nested) <= {SAMPLES_YIELDED}):
        # the user's own batch_sampler with a stateful iterator: restored as such (our cursor
        # refuses it, naming the fix, when this loader's sampler iterator has no state)
        return {"iter": iter_state}, True
    return None, False  # an order that iterating afresh replays (sequential, epoch-seeded)


def _turns(start: int, count: int, workers: int, ended: set[int]) -> tuple[dict[int, int], int]:
    """Batches per worker when `count` batches are taken in turns from worker `start`, workers
    in `ended` taking none; and the worker that took the last one (start - 1 when none)."""
    taken = dict.fromkeys(range(workers), 0)
    last = (start - 1) % workers
    order = [w for w in itertools.islice(itertools.cycle(range(workers)), start, start + workers)
             if w not in ended]
    for k in range(count if order else 0):
        last = order[k % len(order)]
        taken[last] += 1
    return taken, last


def _entries(entries: Any, workers: int, where: str) -> dict[int, tuple[Any, Any, bool]]:
    """worker id -> (dataset state, iterator state, ended) of StatefulDataLoader's worker
    entries, one per worker of `workers`."""
    # the count first: the names expected are built only for as many entries as the state
    # holds (a '_num_workers' of 10**12 would otherwise build 10**12 strings: fuzz, issue 49)
    if not isinstance(entries, dict) or len(entries) != workers or \
            set(entries) != {f"worker_{w}" for w in range(workers)}:
        raise StateMismatch(f"{_LOAD} is corrupt: '{where}' should hold worker_0 .. "
                            f"worker_{workers - 1}, got {sorted(entries or ())!r:.80}")
    parsed = {}
    for key, entry in entries.items():
        wid = _count(entry, WORKER_ID) if isinstance(entry, dict) else -1
        if key != f"worker_{wid}":
            raise StateMismatch(f"{_LOAD} is corrupt: '{where}.{key}' holds worker {wid}")
        parsed[wid] = (_get(entry, DATASET_STATE), *_fetcher(entry, f"{where}.{key}"))
    return parsed


def _streams(parsed: dict[int, tuple[Any, Any, bool]], *, iterable: bool, per_batch: int,
             delivered: int, since: int, last: int, finished: bool) -> tuple[dict, int]:
    """Our `_worker_snapshots` and the worker that delivered last. Iterable: the batches a
    resumed StatefulDataLoader would replay are skipped item by item: every delivered batch from
    the streams' starts, in turns from worker 0, when no state is saved; else the `since`
    batches after the snapshot, in turns after worker `last` (ended streams take none)."""
    workers = len(parsed)
    ended = {w for w, (_, _, e) in parsed.items() if e}
    if not iterable:  # the sampler is fast-forwarded; workers keep their turns
        taken, last = dict.fromkeys(parsed, 0), (last + since) % workers
    elif all(ds is None and it is None for ds, it, _ in parsed.values()):
        if ended and workers > 1 and not finished:
            raise StateMismatch(
                f"{_LOAD}: the dataset has no state_dict and worker {min(ended)}'s stream had "
                "ended; when it ended is not recorded, so the other workers' positions are not "
                "known: finish this epoch with StatefulDataLoader, or give the dataset a "
                "state_dict")
        taken, last = _turns(0, delivered, workers, set())
    else:
        taken, last = _turns((last + 1) % workers, since, workers, ended)
    # each worker's share of the delivered batches, as our states count them: those replayed,
    # plus the batches before the snapshot in turns from worker 0 (not recorded by
    # StatefulDataLoader: only their sum is checked)
    before, _ = _turns(0, max(delivered - sum(taken.values()), 0), workers,
                       ended if len(ended) < workers else set())
    out = {}
    for wid, (ds_state, iter_state, stream_ended) in sorted(parsed.items()):
        items = taken[wid] * per_batch
        out[f"worker_{wid}"] = {
            WORKER_ID: wid, DATASET_STATE: ds_state,
            FETCHER_STATE: {DATASET_ITER_STATE: iter_state, FETCHER_ENDED: stream_ended},
            "items": items, "items_since_snapshot": items,
            "batches": taken[wid] + before[wid]}
    return out, last


def from_sdl(state: dict, loader: Any) -> dict:
    """`state` (StatefulDataLoader's layout) as a PooledLoader state for `loader`, built with the
    arguments the StatefulDataLoader had. Raises StateMismatch naming what cannot be
    converted; `PooledLoader.load_state_dict` then checks the result as any state."""
    check = loader._state_check()
    iterable = check["iterable"]
    finished = _get(state, ITERATOR_FINISHED)
    if not isinstance(finished, bool):
        raise StateMismatch(f"{_LOAD} is corrupt: '{ITERATOR_FINISHED}' should be true or false")
    if SNAPSHOT in state:  # worker processes: a snapshot, and the batches delivered since
        snap = _get(state, SNAPSHOT)
        main = _get(snap, MAIN_SNAPSHOT)
        saved_workers = _count(main, NUM_WORKERS)
        step, since = _count(snap, SNAPSHOT_STEP), _count(state, STEPS_SINCE_SNAPSHOT)
        last, base_seed = _count(snap, LAST_YIELDED_WORKER_ID), _get(main, BASE_SEED)
        sampler_at = _count(main, SAMPLER_ITER_YIELDED)
        parsed = _entries(_get(snap, WORKER_SNAPSHOTS), max(saved_workers, 1),
                          f"{SNAPSHOT}.{WORKER_SNAPSHOTS}")
        if isinstance(base_seed, bool) or not isinstance(base_seed, int):
            raise StateMismatch(f"{_LOAD} is corrupt: '{BASE_SEED}' should be an integer")
    else:  # in the main process: the state is the position itself
        main, saved_workers, since, last, base_seed = state, 0, 0, 0, 0
        step = sampler_at = _count(state, NUM_YIELDED)
        parsed = {0: (state.get(DATASET_STATE), *_fetcher(state, "(top level)"))}
    if iterable and saved_workers != loader.num_workers:
        raise StateMismatch(
            f"{_LOAD}: it was saved with num_workers={saved_workers}, this loader has "
            f"num_workers={loader.num_workers}: an iterable dataset's streams are split per "
            "worker, resume with the same num_workers")
    if last >= len(parsed):
        raise StateMismatch(f"{_LOAD} is corrupt: '{LAST_YIELDED_WORKER_ID}' is {last}, "
                            f"beyond its {len(parsed)} worker(s)")
    delivered = step + since
    if not iterable:  # a map-style epoch has its length: more was never delivered
        try:
            total = len(loader._index_sampler)
        except TypeError:
            total = None
        if total is not None and delivered > total:
            raise StateMismatch(f"{_LOAD} is corrupt: it says {delivered} batches were delivered "
                                f"('{NUM_YIELDED}', or '{SNAPSHOT_STEP}' + "
                                f"'{STEPS_SINCE_SNAPSHOT}'), more than the {total} of an epoch")
    per_batch = (loader.batch_size or 1) if loader._auto_collation else 1
    streams, last = _streams(parsed, iterable=iterable, per_batch=per_batch,
                             delivered=delivered, since=since, last=last, finished=finished)
    sampler_state, at_snapshot = (None, False) if iterable else _sampler_state(
        main, loader._index_sampler)
    return {
        SNAPSHOT: {SNAPSHOT_STEP: delivered, LAST_YIELDED_WORKER_ID: last,
                   MAIN_SNAPSHOT: {NUM_WORKERS: saved_workers,
                                   INDEX_SAMPLER_STATE: sampler_state,
                                   SAMPLER_ITER_YIELDED: 0 if iterable else delivered,
                                   BASE_SEED: base_seed},
                   WORKER_SNAPSHOTS: streams},
        STEPS_SINCE_SNAPSHOT: 0,
        ITERATOR_FINISHED: finished,
        POOLED: {"format": FORMAT, **check, "num_workers": saved_workers, "started": True,
                 "epoch": 0, "delivered_ahead": [], "from": "StatefulDataLoader",
                 "sampler_snapshot_step": min(sampler_at, delivered) if at_snapshot else 0},
    }
