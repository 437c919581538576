"""Checkpoint and resume: where an epoch stands, as plain JSON-serialisable data.

The main process owns the truth: the position is "batches handed to the training loop", never what
workers have prefetched (prefetched, undelivered batches are simply rebuilt after a resume).

- Map-style: the main process knows every task's indices. The state is the sampler's state (asked
  in the main process when the sampler or batch_sampler has `state_dict`, taken every
  `snapshot_every_n_steps` batches) plus how many sampler items the delivered batches consumed
  since; resume restores the sampler and fast-forwards it without loading anything. The default
  shuffled sampler is `ResumableRandomSampler` (`resume/sampler.py`): torch's RandomSampler
  (same order), whose pass can be replayed from a seed or a generator state.
- Iterable: each worker counts the items its delivered batches consumed and, every
  `snapshot_every_n_steps` of its batches, piggybacks its dataset's (or iterator's) `state_dict()`
  on the Done message (`messages.StreamPosition`). Resume loads that state inside the worker and
  skips the items consumed since; without `state_dict` it skips every consumed item.

The layout follows torchdata's StatefulDataLoader where that costs nothing (its key names: see
`state_dict`), plus a "_pooled" section with what we check on load and the epoch's seeds.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

from torch.utils.data import BatchSampler

from .elastic import merge_rank_states  # noqa: F401 - public here: resume on any world size
from ..core.errors import StateMismatch
from .sampler import ResumableRandomSampler  # public here, as before
from ..core.seeds import sample_seed, seed_globals  # noqa: F401 - imported from here by worker.py
from ..core.state_checks import StateChecks
from .keys import (BASE_SEED, DATASET_ITER_STATE, DATASET_STATE, FETCHER_ENDED,
                         FETCHER_STATE, FORMAT, INDEX_SAMPLER_STATE, ITERATOR_FINISHED,
                         LAST_YIELDED_WORKER_ID, MAIN_SNAPSHOT, NUM_WORKERS, POOLED,
                         SAMPLER_ITER_YIELDED, SNAPSHOT, SNAPSHOT_STEP, STEPS_SINCE_SNAPSHOT,
                         WORKER_ID, WORKER_SNAPSHOTS)
from ..core.stateful import follows_stateful


def has_state(obj: Any) -> bool:
    """torchdata's `Stateful`: `state_dict()` and `load_state_dict(state)` (`stateful.py`)."""
    return follows_stateful(obj)


# -- where the sampler stands ---------------------------------------------------------------------
def epoch_sampler(index_sampler: Any) -> Any:
    """The sampler whose own `epoch` picks the order (torch's DistributedSampler; accelerate's
    SeedableRandomSampler, inside its batch samplers), or None. Trainers set that epoch on the
    sampler itself, past the loader's `set_epoch`."""
    for part in (index_sampler, getattr(index_sampler, "sampler", None),
                 getattr(getattr(index_sampler, "batch_sampler", None), "sampler", None)):
        epoch = getattr(part, "epoch", None)
        if isinstance(epoch, int) and not isinstance(epoch, bool) \
                and callable(getattr(part, "set_epoch", None)):
            return part
    return None


class SamplerCursor:
    """Snapshots and restores the index order of a map-style loader, in the main process.

    The holder of the order's state is, in this order of preference: the sampler iterator (as
    torchdata's samplers give), the index sampler (sampler or batch_sampler), or the sampler inside
    torch's BatchSampler. Without one, the order is replayed by iterating afresh
    (SequentialSampler, DistributedSampler after the same set_epoch)."""

    def __init__(self, index_sampler: Any) -> None:
        self.index_sampler = index_sampler

    def _holder(self, sampler_iter: Any) -> tuple[str, Any] | None:
        if has_state(sampler_iter):
            return "iter", sampler_iter
        if has_state(self.index_sampler):
            return "sampler", self.index_sampler
        inner = getattr(self.index_sampler, "sampler", None)
        if type(self.index_sampler) is BatchSampler and has_state(inner):
            return "inner", inner
        return None

    def before_first(self, sampler_iter: Any) -> dict | None:
        """The state at the start of a pass, when it can be asked before the first index."""
        holder = self._holder(sampler_iter)
        if holder is None or isinstance(holder[1], ResumableRandomSampler):
            return None
        return {holder[0]: holder[1].state_dict()}

    def after(self, sampler_iter: Any, first: bool) -> tuple[dict | None, dict | None]:
        """(state now, state at the pass's start when only now knowable) after an index."""
        holder = self._holder(sampler_iter)
        if holder is None:
            return None, None
        now = {holder[0]: holder[1].state_dict()}
        if first and isinstance(holder[1], ResumableRandomSampler):
            return now, {holder[0]: {**now[holder[0]], "yielded": 0}}
        return now, None

    def check(self, state: Any) -> None:
        """At load: a saved `{kind: sampler state}` (`_index_sampler_state`), checked by its
        holder when it can say what its own state may hold (`check_state_dict`, as ours do)."""
        if state is None:
            return
        path = f"{SNAPSHOT}.{MAIN_SNAPSHOT}.{INDEX_SAMPLER_STATE}"
        if not isinstance(state, dict) or len(state) != 1 \
                or next(iter(state)) not in ("iter", "sampler", "inner"):
            raise _CHECKS.bad(path, 'should be null or {"iter" | "sampler" | "inner": the '
                              'sampler\'s state}')
        kind, value = next(iter(state.items()))
        holder = {"sampler": self.index_sampler,
                  "inner": getattr(self.index_sampler, "sampler", None)}.get(kind)
        check = getattr(holder, "check_state_dict", None)
        if callable(check):
            check(value, _CHECKS.at(f"{path}.{kind}."))

    def restore(self, state: dict | None, skip: int) -> Iterator:
        """A sampler iterator `skip` items after the point `state` describes (or after the start
        of a fresh pass without one). Nothing is loaded: only indices are drawn."""
        kind, value = next(iter(state.items())) if state else (None, None)
        if kind == "sampler":
            self.index_sampler.load_state_dict(value)
        elif kind == "inner":
            self.index_sampler.sampler.load_state_dict(value)
        elif kind not in (None, "iter"):
            raise StateMismatch(f"PooledLoader.load_state_dict: the state is corrupt: unknown "
                                f"sampler state kind {kind!r}")
        it = iter(self.index_sampler)
        if kind == "iter":
            if not has_state(it):
                raise StateMismatch("PooledLoader.load_state_dict: the state holds a sampler "
                                    "iterator's state but this loader's sampler iterator has no "
                                    "load_state_dict")
            it.load_state_dict(value)
        for _ in itertools.islice(it, skip):
            pass
        return it

    def run_out(self, state: dict | None, skip: int) -> None:
        """Replay the pass `state` describes to its end, as a state saved at an epoch's end
        asks (a generator moves on as it did). The epoch set for the next pass stays: accelerate's
        SeedableRandomSampler adds 1 to its own at each pass's end, which its uninterrupted
        run did once already."""
        part = epoch_sampler(self.index_sampler)
        epoch = None if part is None else part.epoch
        for _ in self.restore(state, skip):
            pass
        if part is not None and part.epoch != epoch:
            part.set_epoch(epoch)


@dataclass
class WorkerStream:
    """Where one worker's stream of an iterable dataset stands, as of the delivered batches."""

    worker_id: int
    dataset_state: Any = None  # the last delivered snapshot (None: from the stream's start)
    iter_state: Any = None
    items_at_snapshot: int = 0
    items: int = 0  # items consumed by this worker's delivered batches, this epoch
    ended: bool = False
    batches: int = 0  # this worker's delivered batches, this epoch

    def to_dict(self) -> dict:
        return {WORKER_ID: self.worker_id, DATASET_STATE: self.dataset_state,
                FETCHER_STATE: {DATASET_ITER_STATE: self.iter_state, FETCHER_ENDED: self.ended},
                "items": self.items, "items_since_snapshot": self.items - self.items_at_snapshot,
                "batches": self.batches}


@dataclass
class Progress:
    """What the main process knows about the epoch being delivered; `state()` turns it into the
    loader's state dict. Updated by the iterators at dispatch and at delivery."""

    iterable: bool
    num_workers: int
    base_seed: int
    epoch: int  # the iterator's epoch counter (seeds per-sample RNGs)
    snapshot_every: int
    num_yielded: int = 0
    finished: bool = False
    # map-style: sampler items consumed by the delivered prefix of tasks, the latest sampler
    # snapshot at or before it, the snapshots taken at dispatch, and delivered positions beyond
    # the prefix (in_order=False)
    delivered_prefix: int = 0
    sampler_snapshot: tuple[int, Any] = (0, None)
    pending_snapshots: dict[int, Any] = field(default_factory=dict)
    delivered_ahead: set[int] = field(default_factory=set)
    skip_positions: set[int] = field(default_factory=set)
    # iterable: per-worker streams and who delivered last (to keep the interleaving)
    streams: dict[int, WorkerStream] = field(default_factory=dict)
    last_worker: int = -1
    started: bool = True  # False: a state of an older version taken before any iter()
    resumed: bool = False
    # what each worker (0: the main process) restores when it starts: a resumed epoch's streams
    # and dataset states, or those of a finished epoch marked "new_epoch"
    restore: dict[int, dict] | None = None
    started_workers: set[int] = field(default_factory=set)  # their Started has arrived
    # weak method of the iterator, called before a state is taken: starts the sampler's pass
    # (so its seed is known) and waits for the workers' start states
    prepare: Any = None
    unsettled: list[int] = field(default_factory=list)  # no start state when the iterator went
    # With a prefetching stage after the iterator (cuda.DeviceIter), a batch counts as delivered
    # only when that stage hands it to the loop: deliveries wait in `held` until `commit()`.
    deferred: bool = False
    held: collections.deque = field(default_factory=collections.deque)

    @classmethod
    def starting(cls, *, iterable: bool, num_workers: int, base_seed: int, epoch: int,
                 snapshot_every: int, resume: "Resume | None" = None,
                 restore: dict[int, dict] | None = None) -> "Progress":
        """The position at an epoch's start, or where `resume` (mid-epoch) says it stands;
        `restore` is what the workers load as they start."""
        p = cls(iterable=iterable, num_workers=num_workers, base_seed=base_seed, epoch=epoch,
                snapshot_every=snapshot_every, last_worker=max(num_workers - 1, 0),
                restore=restore)
        if resume is not None:
            p.num_yielded = resume.num_yielded
            p.delivered_prefix = resume.delivered_prefix
            p.delivered_ahead = set(resume.delivered_ahead)
            p.sampler_snapshot = (resume.sampler_snapshot_step, resume.sampler_state)
            p.streams = {w: dataclasses.replace(s) for w, s in resume.streams.items()}
            p.last_worker = resume.last_worker
            p.resumed = True
        return p

    def resume_stream(self, worker_id: int) -> dict | None:
        """What worker `worker_id` restores as it starts (None: nothing, a fresh start)."""
        return (self.restore or {}).get(worker_id)

    def stream_started(self, worker_id: int, snapshot: tuple[Any, Any] | None,
                       items: int) -> None:
        """Worker `worker_id` started its epoch with this state (after any restore). A worker
        that restored a mid-epoch stream keeps the position it restored until it delivers: a
        dataset may apply a loaded state only at its first item (a generator's `__iter__`), so
        its state now could still be the epoch's start."""
        self.started_workers.add(worker_id)
        restored = self.resume_stream(worker_id)
        if snapshot is not None and (restored is None or restored.get("new_epoch")):
            s = self.stream(worker_id)
            s.dataset_state, s.iter_state = snapshot
            s.items = s.items_at_snapshot = items

    def stream_ended(self, worker_id: int) -> bool:
        s = self.streams.get(worker_id)
        return s is not None and s.ended

    # -- map-style ---------------------------------------------------------------------------
    def dispatching(self, position: int, cursor: SamplerCursor, sampler_iter: Any) -> None:
        """About to draw task `position`'s indices: the pass's start state, if askable now."""
        if position == 0 and self.sampler_snapshot == (0, None):
            self.sampler_snapshot = (0, cursor.before_first(sampler_iter))

    def dispatched(self, position: int, cursor: SamplerCursor, sampler_iter: Any) -> None:
        """The sampler just gave task `position`'s indices: snapshot it every n tasks."""
        first = position == 0 and self.sampler_snapshot == (0, None)
        due = bool(self.snapshot_every) and (position + 1) % self.snapshot_every == 0
        if not (first or due):
            return
        now, start = cursor.after(sampler_iter, first)
        if start is not None:
            self.sampler_snapshot = (0, start)
        if now is not None and due:
            self.pending_snapshots[position + 1] = now

    def _record(self, batch: bool, apply: Any, *args: Any) -> None:
        if self.deferred:
            self.held.append((batch, apply, args))
        else:
            apply(*args)

    def commit(self, everything: bool = False) -> None:
        """The stage after the iterator handed out one more batch (or all, at its end)."""
        while self.held:
            batch, apply, args = self.held.popleft()
            apply(*args)
            if batch and not everything:
                return

    def delivered_task(self, position: int, worker_id: int = 0, stream: Any = None) -> None:
        """Task `position` (built by `worker_id`, whose Done carried `stream`) was handed out."""
        self._record(True, self._delivered_task, position, worker_id, stream)

    def delivered_batch(self, worker_id: int, position: Any) -> None:
        """Worker `worker_id`'s batch (whose Done carried `position`) was handed out."""
        self._record(True, self._delivered_batch, worker_id, position)

    def delivered_end(self, worker_id: int, position: Any = None) -> None:
        """Worker `worker_id`'s stream ended; `position` holds its state after that end."""
        self._record(False, self._delivered_end, worker_id, position)

    def finish(self) -> None:
        self._record(False, setattr, self, "finished", True)

    def _delivered_task(self, position: int, worker_id: int, stream: Any) -> None:
        self.num_yielded += 1
        self.last_worker = worker_id
        s = self.stream(worker_id)
        s.batches += 1
        if stream is not None and stream.snapshot is not None:  # the dataset's own state
            s.dataset_state = stream.snapshot[0]
        if position != self.delivered_prefix:
            self.delivered_ahead.add(position)
            return
        self.delivered_prefix += 1
        while self.delivered_prefix in self.delivered_ahead:
            self.delivered_ahead.remove(self.delivered_prefix)
            self.delivered_prefix += 1
        best = None
        for step in [s for s in self.pending_snapshots if s <= self.delivered_prefix]:
            snap = self.pending_snapshots.pop(step)
            if best is None or step > best[0]:
                best = (step, snap)
        if best is not None:
            self.sampler_snapshot = best

    # -- iterable ----------------------------------------------------------------------------
    def stream(self, worker_id: int) -> WorkerStream:
        if worker_id not in self.streams:
            self.streams[worker_id] = WorkerStream(worker_id)
        return self.streams[worker_id]

    def _delivered_batch(self, worker_id: int, position: Any) -> None:
        self.num_yielded += 1
        self.last_worker = worker_id
        s = self.stream(worker_id)
        s.batches += 1
        s.items = position.items
        if position.snapshot is not None:
            s.dataset_state, s.iter_state = position.snapshot
            s.items_at_snapshot = position.items

    def _delivered_end(self, worker_id: int, position: Any) -> None:
        s = self.stream(worker_id)
        s.ended = True
        if position is not None and position.snapshot is not None:
            # the state after the dataset's end of pass; the items count stays that of the
            # delivered batches (drop_last may have dropped the last items read)
            s.dataset_state, s.iter_state = position.snapshot
            s.items_at_snapshot = s.items

    # -- the state ---------------------------------------------------------------------------
    def state(self, check: dict) -> dict:
        prepare = self.prepare() if self.prepare is not None else None
        if prepare is not None and not self.finished:
            prepare()
        if self.unsettled and not self.finished:
            raise RuntimeError(
                f"state_dict(): worker(s) {self.unsettled} had not sent their start state when "
                f"the iterator was dropped (their start took longer than the loader's timeout, "
                f"or 60 s); keep the iterator alive until state_dict() (`it = iter(loader)`)")
        step, sampler_state = self.sampler_snapshot
        main = {NUM_WORKERS: self.num_workers, INDEX_SAMPLER_STATE: sampler_state,
                SAMPLER_ITER_YIELDED: self.delivered_prefix, BASE_SEED: self.base_seed}
        workers = {f"worker_{w}": s.to_dict() for w, s in sorted(self.streams.items())}
        return {
            SNAPSHOT: {SNAPSHOT_STEP: self.num_yielded, LAST_YIELDED_WORKER_ID: self.last_worker,
                       MAIN_SNAPSHOT: main, WORKER_SNAPSHOTS: workers},
            STEPS_SINCE_SNAPSHOT: 0,
            ITERATOR_FINISHED: self.finished,
            POOLED: {"format": FORMAT, **check, "started": self.started, "epoch": self.epoch,
                     "sampler_snapshot_step": step,
                     "delivered_ahead": sorted(self.delivered_ahead)},
        }


# -- reading a state back -------------------------------------------------------------------------
@dataclass
class Resume:
    """A validated state, ready for the next iterator to continue from."""

    finished: bool
    base_seed: int
    epoch: int
    num_yielded: int
    sampler_state: Any
    sampler_skip: int  # sampler items to skip after restoring `sampler_state`
    delivered_prefix: int
    delivered_ahead: set[int]
    last_worker: int
    streams: dict[int, WorkerStream]
    sampler_snapshot_step: int
    started: bool
    # `seeds.rng_fingerprint` of the base seeds' RNG when the state was saved (None: unknown)
    rng_check: str | None = None
    # set_epoch() of another epoch followed the load: if the saved epoch has nothing left,
    # the next iter() starts the epoch set instead (loader._RestOrNext)
    advance: bool = False
    # the `epoch` of the sampler that picks the order (DistributedSampler, accelerate's
    # SeedableRandomSampler) when the saved pass began (None: no such sampler, or an older state)
    sampler_epoch: int | None = None

    def moves_on(self, sampler_epoch: int | None) -> bool:
        """Whether the next iter() gives the rest of the saved epoch or, if none is left, the
        next one: the loader's set_epoch() of another epoch followed the load, or the sampler's
        own epoch is now past the saved pass's (verl sets its DistributedSampler's, not ours;
        a new sampler left at 0 is not a move)."""
        moved = self.sampler_epoch is not None and sampler_epoch is not None \
            and sampler_epoch > self.sampler_epoch
        return not self.finished and (self.advance or moved)

    def stream_dicts(self, new_epoch: bool = False,
                     set_epoch: int | None = None) -> dict[int, dict]:
        """What each worker restores: its stream (or its dataset's state) as saved; with
        `new_epoch`, the states of a finished epoch, after which the next epoch starts (its
        dataset told `set_epoch` again, as a persistent worker is, when the loader has one)."""
        return {w: {**s.to_dict(), "new_epoch": new_epoch, "set_epoch": set_epoch}
                for w, s in self.streams.items()}


@dataclass(frozen=True)
class Limits:
    """What a state's counts cannot exceed on this loader (None: unknown)."""

    index_len: int | None  # items the index sampler gives per epoch (map-style)
    dataset_len: int | None  # len() of an iterable dataset that has one
    batch_size: int | None  # samples per batch at most (1 without auto-collation; None: a
    # batch_sampler decides)
    num_workers: int


_LOAD = "PooledLoader.load_state_dict"
_CHECKS = StateChecks(f"{_LOAD}: the state")  # every key below is named from the state's top


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
    path = f"{POOLED}.delivered_ahead"
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
    fmt = c.get(state, f"{POOLED}.format")
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
    step = c.count(state, f"{POOLED}.sampler_snapshot_step", prefix,
                   f" ('{snap}.{SAMPLER_ITER_YIELDED}')")
    num_yielded = c.count(state, f"{SNAPSHOT}.{SNAPSHOT_STEP}", index_len,
                          " batches: more than the epoch has")
    if iterable and all("batches" in e for e in state[SNAPSHOT][WORKER_SNAPSHOTS].values()):
        delivered = sum(s.batches for s in streams.values())
        if num_yielded != delivered:
            raise c.bad(f"{SNAPSHOT}.{SNAPSHOT_STEP}", f"is {num_yielded} but the workers' "
                        f"streams delivered {delivered} batch(es)")
    ahead = _ahead(state, prefix, index_len)
    rng_check = saved.get("rng_check")
    if rng_check is not None and (not isinstance(rng_check, str) or len(rng_check) != 16
                                  or rng_check.strip("0123456789abcdef")):
        raise c.bad(f"{POOLED}.rng_check", f"should be 16 hex digits, got {rng_check!r:.80}")
    return Resume(finished=finished,
                  base_seed=c.seed_value(c.get(state, f"{snap}.{BASE_SEED}"),
                                         f"{snap}.{BASE_SEED}"),
                  epoch=c.count(state, f"{POOLED}.epoch"),
                  num_yielded=num_yielded,
                  sampler_state=c.get(state, f"{snap}.{INDEX_SAMPLER_STATE}"),
                  sampler_skip=prefix - step, delivered_prefix=prefix,
                  delivered_ahead=ahead,
                  last_worker=c.count(state, f"{SNAPSHOT}.{LAST_YIELDED_WORKER_ID}",
                                      max(saved_workers, 1) - 1, " (no such worker)"),
                  streams=streams, sampler_snapshot_step=step,
                  started=c.flag(state, f"{POOLED}.started") if "started" in saved else True,
                  rng_check=rng_check,
                  sampler_epoch=None if saved.get("sampler_epoch") is None
                  else c.count(state, f"{POOLED}.sampler_epoch"))
