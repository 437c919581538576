"""Where an epoch stands, as the main process knows it: the machinery that advances an epoch
keeps its position here, and `pooled_loader.resume` turns it into a checkpoint and back.

The main process owns the truth: the position is "batches handed to the training loop", never what
workers have prefetched (prefetched, undelivered batches are simply rebuilt after a resume).

- Map-style: the main process knows every task's indices. The position is the sampler's state
  (asked in the main process when the sampler or batch_sampler has `state_dict`, taken every
  `snapshot_every_n_steps` batches: `SamplerCursor`) plus how many sampler items the delivered
  batches consumed since; a resume restores the sampler and fast-forwards it without loading
  anything.
- Iterable: each worker counts the items its delivered batches consumed and, every
  `snapshot_every_n_steps` of its batches, piggybacks its dataset's (or iterator's) `state_dict()`
  on the Done message (`messages.StreamPosition`): `WorkerStream`. A resume hands each worker a
  `messages.Restore`: the state to load and the items consumed since, to skip.

`EpochPosition` is updated by the iterators at dispatch and at delivery; `Resume` is a parsed
state (`resume.state.parse`) that the next iterator starts from.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

from torch.utils.data import BatchSampler

from ..core.errors import StateMismatch
from ..core.stateful import follows_stateful
from .messages import Restore
from .sampler import ResumableRandomSampler

__all__ = ["EpochPosition", "Resume", "SamplerCursor", "WorkerStream", "epoch_sampler"]


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
        if follows_stateful(sampler_iter):
            return "iter", sampler_iter
        if follows_stateful(self.index_sampler):
            return "sampler", self.index_sampler
        inner = getattr(self.index_sampler, "sampler", None)
        if type(self.index_sampler) is BatchSampler and follows_stateful(inner):
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
            if not follows_stateful(it):
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

    @property
    def has_state(self) -> bool:
        return self.dataset_state is not None or self.iter_state is not None

    def advance(self, position: Any) -> None:
        """A batch whose Done carried `position` (a `messages.StreamPosition`)."""
        self.items = position.items
        if position.snapshot is not None:
            self.dataset_state, self.iter_state = position.snapshot
            self.items_at_snapshot = position.items

    def end(self, position: Any) -> None:
        """The stream ended; `position` holds the state after that end. The items count stays
        that of the batches before it (drop_last may have dropped the last items read)."""
        self.ended = True
        if position is not None and position.snapshot is not None:
            self.dataset_state, self.iter_state = position.snapshot
            self.items_at_snapshot = self.items

    def restore(self, new_epoch: bool = False, set_epoch: int | None = None) -> Restore:
        """What a worker starting here loads: the latest state, then the items consumed since,
        to skip."""
        return Restore(dataset_state=self.dataset_state, iter_state=self.iter_state,
                       items=self.items, skip=self.items - self.items_at_snapshot,
                       new_epoch=new_epoch, set_epoch=set_epoch)


@dataclass
class EpochPosition:
    """What the main process knows about the epoch being delivered; `resume.state.build_state`
    turns it into the loader's state dict. Updated by the iterators at dispatch and delivery."""

    iterable: bool
    num_workers: int
    base_seed: int
    seed_epoch: int  # the epoch per-sample seeds are drawn for (the state's "_pooled.epoch")
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
    # iterable: per-worker streams and who delivered last (to keep the interleaving)
    streams: dict[int, WorkerStream] = field(default_factory=dict)
    last_worker: int = -1
    started: bool = True  # False: a state of an older version taken before any iter()
    # what each worker (0: the main process) restores when it starts: a resumed epoch's streams
    # and dataset states, or those of a finished epoch (`Restore.new_epoch`)
    restore: dict[int, Restore] | None = None
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
    def starting(cls, *, iterable: bool, num_workers: int, base_seed: int, seed_epoch: int,
                 snapshot_every: int, resume: "Resume | None" = None,
                 restore: dict[int, Restore] | None = None) -> "EpochPosition":
        """The position at an epoch's start, or where `resume` (mid-epoch) says it stands;
        `restore` is what the workers load as they start."""
        p = cls(iterable=iterable, num_workers=num_workers, base_seed=base_seed,
                seed_epoch=seed_epoch,
                snapshot_every=snapshot_every, last_worker=max(num_workers - 1, 0),
                restore=restore)
        if resume is not None:
            p.num_yielded = resume.num_yielded
            p.delivered_prefix = resume.delivered_prefix
            p.delivered_ahead = set(resume.delivered_ahead)
            p.sampler_snapshot = (resume.sampler_snapshot_step, resume.sampler_state)
            p.streams = {w: dataclasses.replace(s) for w, s in resume.streams.items()}
            p.last_worker = resume.last_worker
        return p

    def resume_stream(self, worker_id: int) -> Restore | None:
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
        if snapshot is not None and (restored is None or restored.new_epoch):
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
        s.advance(position)

    def _delivered_end(self, worker_id: int, position: Any) -> None:
        self.stream(worker_id).end(position)

    # -- before a state is taken ---------------------------------------------------------------
    def ready_for_state(self) -> None:
        """Let the iterator start the sampler's pass and collect its workers' start states
        (`prepare`); raise if workers it dropped never sent theirs."""
        prepare = self.prepare() if self.prepare is not None else None
        if prepare is not None and not self.finished:
            prepare()
        if self.unsettled and not self.finished:
            raise RuntimeError(
                f"state_dict(): worker(s) {self.unsettled} had not sent their start state when "
                f"the iterator was dropped (their start took longer than the loader's timeout, "
                f"or 60 s); keep the iterator alive until state_dict() (`it = iter(loader)`)")


@dataclass
class Resume:
    """A validated state, ready for the next iterator to continue from."""

    finished: bool
    base_seed: int
    seed_epoch: int  # the epoch per-sample seeds were drawn for
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
    # the next iter() starts the epoch set instead (`iterators.RestOrNext`)
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

    def restores(self, new_epoch: bool = False,
                 set_epoch: int | None = None) -> dict[int, Restore]:
        """What each worker restores: its stream (or its dataset's state) as saved; with
        `new_epoch`, the states of a finished epoch, after which the next epoch starts (its
        dataset told `set_epoch` again, as a persistent worker is, when the loader has one)."""
        return {w: s.restore(new_epoch, set_epoch) for w, s in self.streams.items()}
