"""The loader's checkpoint state: built from an epoch's position (`build_state`) and read back
(`parse`), as plain JSON-serialisable data.

Where an epoch stands is the machinery's (`engine.position`: the sampler's cursor, each worker's
stream, what was delivered); this module is its format. The layout follows torchdata's
StatefulDataLoader where that costs nothing (its key names: `keys.py`; the counts tools correct:
`yielded.py`), plus a "_pooled" section with what we check on load and the epoch's seeds.
`sdl_compat.py` reads StatefulDataLoader's own checkpoints; `elastic.py` merges the states of
several ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import StateMismatch
from ..core.seeds import sample_seed, seed_globals  # noqa: F401 - released import path
from ..core.state_checks import StateChecks
from ..engine.position import EpochPosition, Resume, WorkerStream
from ..engine.sampler import ResumableRandomSampler  # noqa: F401 - released import path
from .elastic import merge_rank_states  # noqa: F401 - released import path
from .keys import (BASE_SEED, DATASET_ITER_STATE, DATASET_STATE, DELIVERED_AHEAD, ELASTIC,
                   FETCHER_ENDED, FETCHER_STATE, FORMAT, FORMAT_KEY, INDEX_SAMPLER_STATE,
                   ITERATOR_FINISHED, LAST_YIELDED_WORKER_ID, LOADER_EPOCH, MAIN_SNAPSHOT,
                   NUM_WORKERS, POOLED, RNG_CHECK, SAMPLER_EPOCH, SAMPLER_ITER_YIELDED,
                   SAMPLER_SNAPSHOT_STEP, SEED_EPOCH, SNAPSHOT, SNAPSHOT_STEP, STARTED,
                   STEPS_SINCE_SNAPSHOT, WORKER_ID, WORKER_SNAPSHOTS)
from .yielded import expose

__all__ = ["Limits", "build_state", "check_sampler_state", "parse"]

_LOAD = "PooledLoader.load_state_dict"
_CHECKS = StateChecks(f"{_LOAD}: the state")  # every key below is named from the state's top


# -- the state of a position ----------------------------------------------------------------------
def _stream_dict(s: WorkerStream) -> dict:
    return {WORKER_ID: s.worker_id, DATASET_STATE: s.dataset_state,
            FETCHER_STATE: {DATASET_ITER_STATE: s.iter_state, FETCHER_ENDED: s.ended},
            "items": s.items, "items_since_snapshot": s.items - s.items_at_snapshot,
            "batches": s.batches}


def build_state(position: EpochPosition, check: dict, *, loader_epoch: int | None,
                rng_check: str | None = None, sampler_epoch: int | None = None,
                elastic: dict | None = None, exposed: bool = True) -> dict:
    """The loader's state at `position` (`PooledLoader.state_dict()`): `check` is what a load
    compares with its loader (`PooledLoader._state_check`), `loader_epoch` the last
    `set_epoch()`, `rng_check` the base seeds' RNG fingerprint, `sampler_epoch` the own epoch of
    the sampler that picks the order, `elastic` what `merge_rank_states` needs besides the
    counts. `exposed`: in StatefulDataLoader's whole layout (an entry for every worker, one that
    has delivered nothing included), with the counts tools correct at the top
    (`yielded.expose`); without, only for this process to parse back."""
    position.ready_for_state()
    step, sampler_state = position.sampler_snapshot
    main = {NUM_WORKERS: position.num_workers, INDEX_SAMPLER_STATE: sampler_state,
            SAMPLER_ITER_YIELDED: position.delivered_prefix, BASE_SEED: position.base_seed}
    workers = {f"worker_{w}": _stream_dict(s) for w, s in sorted(position.streams.items())}
    pooled = {FORMAT_KEY: FORMAT, **check, STARTED: position.started,
              SEED_EPOCH: position.seed_epoch, SAMPLER_SNAPSHOT_STEP: step,
              DELIVERED_AHEAD: sorted(position.delivered_ahead), LOADER_EPOCH: loader_epoch,
              RNG_CHECK: rng_check}
    if sampler_epoch is not None:
        pooled[SAMPLER_EPOCH] = sampler_epoch
    if elastic is not None:
        pooled[ELASTIC] = elastic
    state = {
        SNAPSHOT: {SNAPSHOT_STEP: position.num_yielded,
                   LAST_YIELDED_WORKER_ID: position.last_worker,
                   MAIN_SNAPSHOT: main, WORKER_SNAPSHOTS: workers},
        STEPS_SINCE_SNAPSHOT: 0,
        ITERATOR_FINISHED: position.finished,
        POOLED: pooled,
    }
    if not exposed:
        return state
    for w in range(max(position.num_workers, 1)):
        workers.setdefault(f"worker_{w}", _stream_dict(WorkerStream(w)))
    return expose(state)


# -- reading a state back -------------------------------------------------------------------------
def check_sampler_state(index_sampler: Any, state: Any) -> None:
    """At load: a saved `{kind: sampler state}` (`_index_sampler_state`, `SamplerCursor`'s),
    checked by its holder when it can say what its own state may hold (`check_state_dict`, as
    ours do)."""
    if state is None:
        return
    path = f"{SNAPSHOT}.{MAIN_SNAPSHOT}.{INDEX_SAMPLER_STATE}"
    if not isinstance(state, dict) or len(state) != 1 \
            or next(iter(state)) not in ("iter", "sampler", "inner"):
        raise _CHECKS.bad(path, 'should be null or {"iter" | "sampler" | "inner": the '
                          'sampler\'s state}')
    kind, value = next(iter(state.items()))
    holder = {"sampler": index_sampler,
              "inner": getattr(index_sampler, "sampler", None)}.get(kind)
    check = getattr(holder, "check_state_dict", None)
    if callable(check):
        check(value, _CHECKS.at(f"{path}.{kind}."))


@dataclass(frozen=True)
class Limits:
    """What a state's counts cannot exceed on this loader (None: unknown)."""

    index_len: int | None  # items the index sampler gives per epoch (map-style)
    dataset_len: int | None  # len() of an iterable dataset that has one
    batch_size: int | None  # samples per batch at most (1 without auto-collation; None: a
    # batch_sampler decides)
    num_workers: int


def _check_fits(saved: dict, check: dict, streams: dict[int, WorkerStream]) -> None:
    for key, mine in check.items():
        theirs = saved.get(key, "<missing>")
        if theirs == mine:
            continue
        if key == "num_workers" and not check["iterable"]:
            if all(s.dataset_state is None for s in streams.values()):
                continue  # map-style: elastic (the order does not depend on the workers)
            raise StateMismatch(
                f"{_LOAD}: the state does not fit this loader: it was saved with "
                f"num_workers={theirs!r}, this loader has num_workers={mine!r}, and the dataset "
                f"has its own state_dict (each worker's copy keeps its own state, as in "
                f"StatefulDataLoader): resume with the same num_workers.")
        raise StateMismatch(
            f"{_LOAD}: the state does not fit this loader: it was saved "
            f"with {key}={theirs!r}, this loader has {key}={mine!r}. "
            + ("An iterable dataset's streams are split per worker: resume with the same "
               "num_workers." if key == "num_workers" else
               "Build the loader as it was when the state was saved."))


def _streams(state: Any, limits: Limits, saved_workers: int) -> dict[int, WorkerStream]:
    c = _CHECKS
    path = f"{SNAPSHOT}.{WORKER_SNAPSHOTS}"
    entries = c.section(state, path)
    slots = max(saved_workers, 1)
    if len(entries) > slots:
        raise c.bad(path, f"has {len(entries)} entries for {slots} worker(s)")
    streams = {}
    for key, entry in entries.items():
        where = f"{path}.{key}"
        c.section(state, where)
        wid = c.count(state, f"{where}.{WORKER_ID}", slots - 1, " (no such worker)")
        if key != f"worker_{wid}" or wid in streams:
            raise c.bad(where, f"holds the stream of worker {wid}")
        items = c.count(state, f"{where}.items", limits.dataset_len,
                        " items: the dataset's whole length")
        since = c.count(state, f"{where}.items_since_snapshot", items,
                        " (the items it consumed in all)")
        batches = None
        if "batches" in entry:
            batches = c.count(state, f"{where}.batches", limits.index_len,
                              " batches: more than the epoch has")
            if limits.batch_size is not None and items > batches * limits.batch_size:
                raise c.bad(f"{where}.items", f"is {items}: {batches} batch(es) of at most "
                            f"{limits.batch_size} cannot hold them")
        fetcher = c.section(state, f"{where}.{FETCHER_STATE}")
        ended = c.flag(state, f"{where}.{FETCHER_STATE}.{FETCHER_ENDED}")
        streams[wid] = WorkerStream(wid, dataset_state=c.get(state, f"{where}.{DATASET_STATE}"),
                                    iter_state=c.get(fetcher, DATASET_ITER_STATE),
                                    items_at_snapshot=items - since, items=items,
                                    ended=ended, batches=batches or 0)
    return streams


def _ahead(state: Any, prefix: int, index_len: int | None) -> set[int]:
    """`_pooled.delivered_ahead`: distinct positions after the delivered prefix, in the epoch."""
    path = f"{POOLED}.{DELIVERED_AHEAD}"
    ahead = _CHECKS.list_value(_CHECKS.get(state, path), path, index_len)
    last = index_len - 1 if index_len is not None else None
    for k, p in enumerate(ahead):
        _CHECKS.int_value(p, f"{path}[{k}]", prefix + 1, last, " (the epoch's last position)")
    if len(set(ahead)) != len(ahead):
        raise _CHECKS.bad(path, "lists a position twice")
    return set(ahead)


def parse(state: Any, check: dict, limits: Limits) -> Resume:
    """Validate `state` against this loader's `check` values and `limits`; raise StateMismatch
    (a ValueError) naming the key and what is wrong, or what differs from this loader."""
    if not isinstance(state, dict):
        raise StateMismatch(f"{_LOAD} expects the dict returned by "
                            f"state_dict(), got {type(state).__name__}")
    c = _CHECKS
    fmt = c.get(state, f"{POOLED}.{FORMAT_KEY}")
    if fmt != FORMAT:
        raise StateMismatch(f"{_LOAD}: unknown state format {fmt!r} "
                            f"(this version reads {FORMAT!r})")
    saved = c.section(state, POOLED)
    c.section(state, SNAPSHOT)
    finished = c.flag(state, ITERATOR_FINISHED)
    snap = f"{SNAPSHOT}.{MAIN_SNAPSHOT}"
    c.section(state, snap)
    saved_workers = c.count(state, f"{snap}.{NUM_WORKERS}")
    streams = _streams(state, limits, saved_workers)
    _check_fits(saved, check, streams)
    iterable = check["iterable"]
    index_len = None if iterable else limits.index_len
    prefix = c.count(state, f"{snap}.{SAMPLER_ITER_YIELDED}", index_len,
                     " (the sampler's length)")
    step = c.count(state, f"{POOLED}.{SAMPLER_SNAPSHOT_STEP}", prefix,
                   f" ('{snap}.{SAMPLER_ITER_YIELDED}')")
    num_yielded = c.count(state, f"{SNAPSHOT}.{SNAPSHOT_STEP}", index_len,
                          " batches: more than the epoch has")
    if iterable and all("batches" in e for e in state[SNAPSHOT][WORKER_SNAPSHOTS].values()):
        delivered = sum(s.batches for s in streams.values())
        if num_yielded != delivered:
            raise c.bad(f"{SNAPSHOT}.{SNAPSHOT_STEP}", f"is {num_yielded} but the workers' "
                        f"streams delivered {delivered} batch(es)")
    ahead = _ahead(state, prefix, index_len)
    rng_check = saved.get(RNG_CHECK)
    if rng_check is not None and (not isinstance(rng_check, str) or len(rng_check) != 16
                                  or rng_check.strip("0123456789abcdef")):
        raise c.bad(f"{POOLED}.{RNG_CHECK}", f"should be 16 hex digits, got {rng_check!r:.80}")
    return Resume(finished=finished,
                  base_seed=c.seed_value(c.get(state, f"{snap}.{BASE_SEED}"),
                                         f"{snap}.{BASE_SEED}"),
                  seed_epoch=c.count(state, f"{POOLED}.{SEED_EPOCH}"),
                  num_yielded=num_yielded,
                  sampler_state=c.get(state, f"{snap}.{INDEX_SAMPLER_STATE}"),
                  sampler_skip=prefix - step, delivered_prefix=prefix,
                  delivered_ahead=ahead,
                  last_worker=c.count(state, f"{SNAPSHOT}.{LAST_YIELDED_WORKER_ID}",
                                      max(saved_workers, 1) - 1, " (no such worker)"),
                  streams=streams, sampler_snapshot_step=step,
                  started=c.flag(state, f"{POOLED}.{STARTED}") if STARTED in saved else True,
                  rng_check=rng_check,
                  sampler_epoch=None if saved.get(SAMPLER_EPOCH) is None
                  else c.count(state, f"{POOLED}.{SAMPLER_EPOCH}"))
