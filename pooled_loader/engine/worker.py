"""Worker side: build batches straight into pool slots.

`BatchMaker` is the data path (also used in-process when num_workers=0); `worker_loop` is the
process around it. Only small messages travel: tasks name indices and a slot; replies carry the
batch layout (leaf shapes/offsets), strings and other small objects, and timings.
"""
from __future__ import annotations

import collections
import ctypes
import os
import random
import signal
import sys
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data import IterDataPipe
from torch.utils.data.graph_settings import apply_random_seed

from ..core import working_on
from ..core.constants import PR_SET_PDEATHSIG, REPLACEMENT_REDRAWS
from ..core.deferred import FillFailed, accepted
from ..core.hooks import LoaderHooks, hooks_of
from ..core.seeds import LOADER_EPOCH, sample_seed, seed_globals
from ..core.stateful import follows_stateful
from .interrupts import ignore_sigint_in_worker
from .layout import Leaf, slot_views
from .messages import (BatchLayout, Done, End, ErrorInfo, Failed, Forget, NeedSlot, Reset,
                       Restore, SetEpoch, Slot, Started, StreamPosition, Task)
from .pool import ArenaMap, SlotRef
from .skip_budget import SkipRun
from .slot_collate import Collated, SlotCollate
from .watchdog import WatchSpec, install as install_watch
from ..observability.stages import CLOCK, perf_counter_ns

MAX_REPLACEMENTS = 16


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything a worker needs, built once per start of the workers (`iterators.worker_config`;
    one per worker where `close_in_child` differs); pickled once per worker under
    spawn/forkserver."""

    dataset: Any
    iterable: bool
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: Callable | None  # None: the pooled default collate / convert
    ragged: bool  # collate_fn is a `pooled_loader.collate` helper: it writes into the slot itself
    worker_init_fn: Callable | None
    num_workers: int
    base_seed: int
    on_error: str
    start_method: str
    per_sample_seed: bool = False  # seed the global RNGs from (base_seed, epoch, index)
    sample_base: int | None = None  # per_sample_seed's base instead of base_seed (distributed)
    snapshot_every: int = 0  # iterable: send the dataset's state every n own batches (0: never)
    # where each worker's stream (iterable) or its dataset's state (map-style) resumes
    restores: Mapping[int, Restore] | None = None
    generation: int = 0  # the workers' epoch count when they start (echoed by Started)
    close_in_child: tuple[int, ...] = ()  # fds a forked worker closes: the others' pipe ends
    shared_seed: int | None = None  # a datapipe graph's seed, the same in every worker
    # in-process, nothing pinned, no ragged helper: a custom collate's output, and a
    # `__getitems__` batch's stacked columns, handed out as they are (`BatchMaker.slotless`)
    pass_collated: bool = False
    watch: WatchSpec | None = None  # publish progress and stacks for the watchdog (watchdog.py)
    max_consecutive_skips: int | None = None  # on_error="skip": samples in a row (skip_budget.py)


class SampleFailure(Exception):
    """Raised by `BatchMaker` when a sample failed to load; the original error is its cause."""


class BatchMaker(SlotCollate):
    """Builds one batch into one slot; knows nothing about processes. Fetching, seeding,
    streams and states are here; writing a default-collated batch is `SlotCollate`'s."""

    def __init__(self, cfg: WorkerConfig, arenas: ArenaMap,
                 request_slot: Callable[[int, int, SlotRef], SlotRef]):
        self.cfg = cfg
        self.arenas = arenas
        self.request_slot = CLOCK.slot_requests(request_slot)
        self.iterator = None
        self.dataset_len = None
        self.use_into = (not cfg.iterable and cfg.collate_fn is None and cfg.auto_collation
                         and callable(getattr(cfg.dataset, "getitem_into", None)))
        # DataLoader's _MapDatasetFetcher: a batch through __getitems__ when the dataset has it
        # (per-sample seeds and getitem_into need one sample at a time)
        getitems = getattr(cfg.dataset, "__getitems__", None)
        self.getitems = (getitems if not cfg.iterable and cfg.auto_collation and getitems
                         and not self.use_into and not cfg.per_sample_seed else None)
        self.stateful = follows_stateful(cfg.dataset)
        self.hooks = hooks_of(cfg.dataset)
        # a dataset that finishes its batches in the slot (LoaderHooks.pooled_finish_batch)
        self.finishes = (type(self.hooks).pooled_finish_batch
                         is not LoaderHooks.pooled_finish_batch)
        self.ragged = cfg.ragged
        # In-process with nothing pinned, batches whose every path ends in `Collated` need no slot:
        # a custom collate's, and default collate's of `__getitems__` samples (already in memory,
        # so a slot would add a copy nothing reads; DataLoader makes one copy, so do we).
        self.slotless = cfg.pass_collated and (cfg.collate_fn is not None
                                               or self.getitems is not None)
        self._spec: tuple | None = None  # structure and leaves of the last sample seen
        self._leaves: list[Leaf] | None = None
        self.skipped: list[tuple[Any, str]] = []
        self.known_bad: set = set()
        self.skip_run = SkipRun(cfg.max_consecutive_skips)
        self.current_index: Any = None
        self.worker_id = 0
        self.seed_epoch = 0  # per_sample_seed: the epoch of the task being built
        self.items = 0  # iterable: items taken from this epoch's iterator
        self.batches = 0  # iterable: batches built this epoch (for snapshot_every)
        self.position: StreamPosition | None = None  # iterable: after the last batch built
        self.getitem_ns = 0  # the batch's time in the dataset's __getitem__ / next() (stages.py)
        self.stages: dict[str, float] = {}  # seconds per stage of the last batch built
        self.spans: list | None = None  # and its spans, when it was traced
        self.ended = False  # iterable: this epoch's iterator raised StopIteration

    # -- fetching samples ------------------------------------------------------------------------
    def reset_iterator(self, restore: Restore | None = None) -> None:
        """Start this worker's epoch: afresh, or where `restore` says. StatefulDataLoader's
        order: the dataset's state, then iter(), then the iterator's state (a dataset that is its
        own iterator gets its state after iter(), which would reset it), then the items consumed
        after that state are skipped. A `new_epoch` restore (a state saved at an epoch's end)
        loads the states, then starts the next epoch."""
        self.items = self.batches = 0
        self.ended = False
        dataset = self.cfg.dataset
        if restore is not None and restore.dataset_state is not None and self.stateful:
            dataset.load_state_dict(restore.dataset_state)
        setter = getattr(dataset, "set_epoch", None)
        if restore is not None and restore.set_epoch is not None and callable(setter):
            # the next epoch: the loader's set_epoch reached this dataset before it started in
            # the run that saved the state, and its state (a WebDataset's) may set another epoch
            setter(restore.set_epoch)
        if not self.cfg.iterable:
            self.iterator = None
            return
        self.iterator = iter(dataset)
        if restore is None:
            return
        if restore.iter_state is not None and follows_stateful(self.iterator):
            self.iterator.load_state_dict(restore.iter_state)
        if restore.new_epoch:
            self.iterator = iter(dataset)
            return
        self.items = restore.items - restore.skip
        for _ in range(restore.skip):
            if self._next_item() is None:
                break

    def _next_item(self) -> Any:
        """The iterator's next item (None at its end), seeded per item under per_sample_seed."""
        if self.cfg.per_sample_seed:
            seed_globals(sample_seed(self.cfg.base_seed, self.seed_epoch,
                                     (self.worker_id << 40) + self.items))
        if self.ended:  # as DataLoader's fetcher: an ended iterator is not asked again
            return None
        try:
            item = next(self.iterator)
        except StopIteration:
            self.ended = True
            return None
        self.items += 1
        return (item,)

    def snapshot(self) -> tuple[Any, Any] | None:
        """(dataset state, iterator state), where either has `state_dict`; None otherwise. A
        dataset that is its own iterator is saved as the iterator, as StatefulDataLoader does."""
        dataset, it = self.cfg.dataset, self.iterator
        if it is dataset:
            return (None, dataset.state_dict()) if self.stateful else None
        ds_state = dataset.state_dict() if self.stateful else None
        it_state = it.state_dict() if it is not None and follows_stateful(it) else None
        if ds_state is None and it_state is None:
            return None
        return ds_state, it_state

    def end_position(self) -> StreamPosition:
        """After the iterator ended: the state a finished epoch leaves (no state when it cannot
        be read; that error, if it matters, is raised at the next batch)."""
        try:
            snapshot = self.snapshot()
        except Exception:  # noqa: BLE001 - see above
            snapshot = None
        return StreamPosition(items=self.items, snapshot=snapshot)

    def _load(self, index: Any, out: Any) -> Any:
        self.current_index = index
        working_on.sample(index)
        if self.cfg.per_sample_seed:
            base = self.cfg.base_seed if self.cfg.sample_base is None else self.cfg.sample_base
            seed_globals(sample_seed(base, self.seed_epoch, index))
        if out is not None:
            return self.cfg.dataset.getitem_into(index, out)
        return self.cfg.dataset[index]

    def _fetch(self, index: Any, out: Any = None) -> Any:
        try:
            sample = self._load(index, out)
        except Exception as exc:
            if self.cfg.on_error != "skip":
                raise SampleFailure(index) from exc
            try:
                self.skip_run.failed(index, f"{type(exc).__name__}: {exc}")
            except Exception as budget:  # SkipBudgetExceeded: the run ends here
                raise SampleFailure(index) from budget
            return self._replace(index, exc, out)
        self.skip_run.length = 0
        return sample

    def _fetch_batch(self, indices: Any) -> list:
        """The samples of a batch: through `__getitems__` as DataLoader does, or one by one.
        With on_error="skip", a failing `__getitems__` is retried sample by sample."""
        if self.getitems is None:
            if self.cfg.on_error == "skip" or self.cfg.per_sample_seed:
                return [self._fetch(i) for i in indices]
            dataset, samples, index = self.cfg.dataset, [], None
            board = working_on.BOARD
            try:  # _fetch's work without a call per sample (this runs per sample of a batch)
                for index in indices:
                    if board is not None:
                        board.sample(index)
                    samples.append(dataset[index])
            except Exception as exc:
                self.current_index = index
                raise SampleFailure(index) from exc
            return samples
        self.current_index = indices
        working_on.sample(indices)
        try:
            return self.getitems(indices)
        except Exception as exc:
            if self.cfg.on_error != "skip":
                raise SampleFailure(indices) from exc
        return [self._fetch(i) for i in indices]

    def _collated(self, task_id: int, batch: Any, ref: SlotRef,
                  num_samples: int) -> BatchLayout | Collated:
        """A custom collate's output: copied into the slot, or as is in-process."""
        if self.cfg.pass_collated:
            return Collated(batch, num_samples)
        return self._write_tree(task_id, batch, ref, convert=False)

    def _replace(self, index: Any, exc: Exception, out: Any) -> Any:
        """on_error="skip": draw replacement samples, reproducibly from the seed and the index."""
        self.skipped.append((index, f"{type(exc).__name__}: {exc}"))
        self.known_bad.add(index)
        if self.dataset_len is None:
            self.dataset_len = len(self.cfg.dataset)
        rng = random.Random(f"{self.cfg.base_seed}:{index}")
        for _ in range(MAX_REPLACEMENTS):
            other = rng.randrange(self.dataset_len)
            for _ in range(REPLACEMENT_REDRAWS):  # prefer samples this worker has not yet seen fail
                if other not in self.known_bad:
                    break
                other = rng.randrange(self.dataset_len)
            try:
                return self._load(other, out)
            except Exception as exc2:  # noqa: BLE001 - every failure is counted and reported
                self.skipped.append((other, f"{type(exc2).__name__}: {exc2}"))
                self.known_bad.add(other)
        raise SampleFailure(index) from exc

    def _samples(self, payload: Any) -> list | None:
        """Next samples of an iterable dataset (None at its end, honouring drop_last)."""
        want = self.cfg.batch_size if self.cfg.auto_collation else 1
        samples = []
        working_on.item(self.items)
        if not self.cfg.per_sample_seed and CLOCK.spans is None and not self.ended:
            # the common case, one clock reading a batch (spans, seeds: per item, below)
            it, start = self.iterator, perf_counter_ns()
            try:
                for _ in range(want):
                    samples.append(next(it))
            except StopIteration:
                self.ended = True
            finally:
                self.items += len(samples)
            self.getitem_ns += perf_counter_ns() - start
        for _ in range(want - len(samples) if not self.ended else 0):
            start = perf_counter_ns()
            item = self._next_item()
            self.getitem_ns += CLOCK.fetched(start, perf_counter_ns(), self.items)
            if item is None:
                break
            samples.append(item[0])
        if not samples or (self.cfg.auto_collation and self.cfg.drop_last
                           and len(samples) < want):
            return None
        return samples

    # -- building ---------------------------------------------------------------------------------
    def make(self, task_id: int, payload: Any, ref: SlotRef, seed_epoch: int = 0,
             trace: bool = False) -> BatchLayout | Collated | None:
        """Fill `ref` with the batch of `payload`; returns where it lies (the slot may have been
        swapped for a bigger one), or None at the end of an iterable dataset. Leaves the batch's
        stage timings in `stages` (and, if `trace`, its spans in `spans`)."""
        CLOCK.begin(trace)
        self.getitem_ns = 0
        start = perf_counter_ns()
        epoch = LOADER_EPOCH.set(seed_epoch)
        try:
            return self._make_batch(task_id, payload, ref, seed_epoch)
        finally:
            LOADER_EPOCH.reset(epoch)
            self.stages, self.spans = CLOCK.finish(self.getitem_ns, start, task_id)

    def _make_batch(self, task_id: int, payload: Any, ref: SlotRef,
                    seed_epoch: int) -> BatchLayout | None:
        self.skipped = []
        self.seed_epoch = seed_epoch
        if self.cfg.iterable:
            samples = self._samples(payload)
            self.skipped.extend(self.hooks.pop_skips())  # a dataset that skips by itself
            if samples is None:
                return None
            self.batches += 1
            every = self.cfg.snapshot_every
            snapshot = self.snapshot() if every and self.batches % every == 0 else None
            self.position = StreamPosition(items=self.items, snapshot=snapshot)
            if self.cfg.collate_fn is not None and self.cfg.auto_collation:
                return self._write_collated(task_id, samples, None, ref)
            if self.cfg.collate_fn is not None:
                self.current_index = None  # a collate error is no sample's
                with CLOCK.timing("collate"):
                    return self._collated(task_id, self.cfg.collate_fn(samples[0]), ref, 1)
            if not self.cfg.auto_collation:
                with CLOCK.timing("collate"):
                    return self._write_tree(task_id, samples[0], ref, convert=True)
            return self._collate(task_id, samples, ref, fetch=None)
        layout = self._make_map(task_id, payload, ref)
        if self.stateful and self.cfg.snapshot_every:
            # A map-style dataset's own state, after every batch (StatefulDataLoader asks it at
            # its snapshots and replays the batches since; asking each time needs no replay).
            self.position = StreamPosition(items=0, snapshot=self.snapshot())
        return layout

    def _make_map(self, task_id: int, payload: Any, ref: SlotRef) -> BatchLayout:
        if not self.cfg.auto_collation:
            sample = self._timed_fetch(payload)
            with CLOCK.timing("collate"):
                if self.cfg.collate_fn is not None:
                    self.current_index = None
                    return self._collated(task_id, self.cfg.collate_fn(sample), ref, 1)
                return self._write_tree(task_id, sample, ref, convert=True)
        if self.cfg.collate_fn is not None:
            if not self.ragged:
                return self._write_collated(task_id, self._timed_batch(payload), payload, ref)
            with accepted():  # the helper fills deferred arrays straight into the slot
                samples = self._timed_batch(payload)
            return self._write_collated(task_id, samples, payload, ref)
        if self.getitems is not None:
            samples = self._timed_batch(payload)
            with CLOCK.timing("collate"):
                return self._collate_columns(task_id, samples, ref, payload)
        layout = self._collate(task_id, payload, ref, fetch=self._fetch)
        return self._finished(layout) if self.finishes else layout

    def _finished(self, layout: BatchLayout) -> BatchLayout:
        """The dataset's `pooled_finish_batch` on the batch in its slot."""
        views = slot_views(self.arenas.slot(layout.ref), layout.leaves)
        with CLOCK.timing("collate"):
            container = self.hooks.pooled_finish_batch(views)
        if container is not None and layout.spec[0] == "seq":
            return replace(layout, spec=("seq", container, layout.spec[2]))
        return layout

    def _timed_fetch(self, index: Any) -> Any:
        start = perf_counter_ns()
        try:
            return self._fetch(index)
        finally:
            self.getitem_ns += CLOCK.fetched(start, perf_counter_ns(), index)

    def _timed_batch(self, indices: Any) -> list:
        """`_fetch_batch`, its time booked as the batch's getitem (one span for the batch)."""
        start = perf_counter_ns()
        try:
            return self._fetch_batch(indices)
        finally:
            self.getitem_ns += CLOCK.fetched(start, perf_counter_ns(), indices)

    def _write_collated(self, task_id: int, samples: list, indices: Any,
                        ref: SlotRef) -> BatchLayout | Collated:
        """A custom collate_fn's batch, copied into the slot (in-process: as is, `_collated`);
        the ragged helpers of `pooled_loader.collate` write theirs there directly
        (`pooled_loader.ragged.slots`)."""
        with CLOCK.timing("collate"):
            if self.ragged:
                try:
                    return self.cfg.collate_fn.pooled_layout(
                        samples, indices, ref, self.arenas.slot,
                        lambda nbytes, old: self.request_slot(task_id, nbytes, old))
                except FillFailed as exc:  # a sample's error, as if its __getitem__ raised it
                    self.current_index = exc.index
                    raise SampleFailure(exc.index) from exc.__cause__
            self.current_index = None  # a collate error is no sample's
            return self._collated(task_id, self.cfg.collate_fn(samples), ref, len(samples))

def seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed `random`, torch and numpy the way DataLoader does; returns the worker's seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        from torch.utils.data._utils.worker import _generate_state
        np.random.seed(_generate_state(base_seed, worker_id))
    except ImportError:  # older/newer torch without it: an equivalent independent stream
        np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    return seed


def seed_datapipe(dataset: Any, shared_seed: int | None) -> None:
    """Seed the random datapipes of a graph (e.g. Shuffler) from DataLoader's shared seed, as
    DataLoader does in the main process and in every worker; nothing for other datasets."""
    if shared_seed is None or not isinstance(dataset, IterDataPipe):
        return
    rng = torch.Generator()
    rng.manual_seed(shared_seed)
    apply_random_seed(dataset, rng)


def set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """Make torch.utils.data.get_worker_info() (and ours) answer inside this worker."""
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset)


def _exit_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that started it dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def error_message(worker_id: int, exc: BaseException, index: Any) -> ErrorInfo:
    """A picklable description of an exception raised while building a batch."""
    cause = exc.__cause__ if isinstance(exc, SampleFailure) and exc.__cause__ else exc
    text = "".join(traceback.format_exception(type(cause), cause, cause.__traceback__))
    return ErrorInfo(exc_type=type(cause), message=str(cause), traceback=text,
                     worker_id=worker_id, index=index)


def _answer(maker: BatchMaker, worker_id: int, task: Task) -> Done | End | Failed:
    """Build one task's batch; the answer says where it lies, or why there is none."""
    start = perf_counter_ns()
    try:
        batch = maker.make(task.task_id, task.payload, task.ref, task.seed_epoch, task.trace)
    except Exception as exc:  # noqa: BLE001 - reported to the main process
        return Failed(task_id=task.task_id, generation=task.generation,
                      error=error_message(worker_id, exc, maker.current_index), ref=task.ref,
                      skipped=maker.skipped)
    working_on.idle()  # a worker killed from now on was on nothing of this batch
    if batch is None:
        return End(task_id=task.task_id, generation=task.generation, ref=task.ref,
                   position=maker.end_position())
    return Done(task_id=task.task_id, generation=task.generation, batch=batch,
                skipped=maker.skipped,
                busy_s=(perf_counter_ns() - start) * 1e-9, position=maker.position,
                stages=maker.stages, spans=maker.spans)


def _started(maker: BatchMaker, worker_id: int, generation: int, start_error: Any) -> Started:
    """Where this worker's epoch starts; no state when its start failed (the error answers its
    tasks) or when its state cannot be read (raised again where it matters: at its batches)."""
    snapshot = None
    if start_error is None:
        try:
            snapshot = maker.snapshot()
        except Exception:  # noqa: BLE001 - see above
            snapshot = None
    return Started(worker_id=worker_id, generation=generation, snapshot=snapshot,
                   items=maker.items)


def worker_loop(cfg: WorkerConfig, worker_id: int, conn: Any, lifeline: Any) -> None:
    """Body of a worker process: answer tasks until told to stop or the main process is gone."""
    ignore_sigint_in_worker()  # blocked across the start: see pooled_loader.engine.interrupts
    if cfg.start_method == "fork":
        for fd in cfg.close_in_child:
            try:
                os.close(fd)
            except OSError:
                pass
    if cfg.start_method != "forkserver":
        _exit_with_parent()
    if cfg.watch is not None:
        install_watch(cfg.watch, worker_id)
    torch.set_num_threads(1)
    seed = seed_worker(cfg.base_seed, worker_id)
    seed_datapipe(cfg.dataset, cfg.shared_seed)
    set_worker_info(worker_id, cfg.num_workers, seed, cfg.dataset)
    pending: collections.deque = collections.deque()

    def receive() -> Any:
        if pending:
            return pending.popleft()
        ready = wait([conn, lifeline])
        if conn in ready:
            return conn.recv()
        raise EOFError  # lifeline closed: the main process is gone

    def request_slot(task_id: int, nbytes: int, old: SlotRef) -> SlotRef:
        conn.send(NeedSlot(task_id=task_id, nbytes=nbytes, old=old))
        while True:  # other messages wait their turn in `pending`
            if lifeline in wait([conn, lifeline]) and not conn.poll():
                raise EOFError
            msg = conn.recv()
            if type(msg) is Slot and msg.task_id == task_id:
                return msg.ref
            pending.append(msg)

    maker = BatchMaker(cfg, ArenaMap(), request_slot)
    maker.worker_id = worker_id
    # As in DataLoader, a failed worker_init_fn or iter(dataset) is this worker's answer to its
    # tasks (so the main process raises it in task order); a failed iter() is retried each epoch.
    initialised = False
    start_error = None
    try:
        if cfg.worker_init_fn is not None:
            cfg.worker_init_fn(worker_id)
        initialised = True
        maker.reset_iterator((cfg.restores or {}).get(worker_id))
    except Exception as exc:  # noqa: BLE001 - reported to the main process
        start_error = error_message(worker_id, exc, None)
    conn.send(_started(maker, worker_id, cfg.generation, start_error))
    try:
        while True:
            msg = receive()
            if msg is None:
                break
            if type(msg) is Task:
                if start_error is not None:
                    conn.send(Failed(task_id=msg.task_id, generation=msg.generation,
                                     error=start_error,
                                     ref=msg.ref, skipped=[]))
                else:
                    conn.send(_answer(maker, worker_id, msg))
            elif type(msg) is Reset:
                seed_datapipe(cfg.dataset, msg.shared_seed)
                if initialised:  # iter(dataset) is retried each epoch, worker_init_fn is not
                    try:
                        maker.reset_iterator()
                        start_error = None
                    except Exception as exc:  # noqa: BLE001 - reported to the main process
                        start_error = error_message(worker_id, exc, None)
                conn.send(_started(maker, worker_id, msg.generation, start_error))
            elif type(msg) is SetEpoch:
                setter = getattr(cfg.dataset, "set_epoch", None)
                if callable(setter) and msg.loader_epoch is not None:
                    setter(msg.loader_epoch)
                if msg.payload is not None:
                    maker.hooks.pooled_load_epoch(msg.payload)
            elif type(msg) is Forget:
                maker.arenas.forget(msg.owner_pid, msg.arena_id)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        sys.stdout.flush()
