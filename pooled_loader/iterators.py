"""The iterators behind ``PooledLoader``: one epoch's walk over the sampler, batches handed out
as zero-copy views of pool slots.

- ``InProcessIter`` (``num_workers=0``) runs ``worker.BatchMaker`` in this process: the very data
  path the workers run, without processes.
- ``WorkerIter`` starts the worker processes (``worker.worker_loop``), dispatches ``Task``s as
  DataLoader does (at most ``prefetch_factor * num_workers`` in flight), hands out answers in
  task order (or as they come with ``in_order=False``), gives each slot back when its batch is
  dropped, and stops the workers (``processes._shutdown``: politely, then firmly) when the epoch
  ends, on an error, or when the iterator is garbage collected. Messages: ``messages.py``.
- ``HostTransformIter`` applies ``device_transform`` on the host when there is no CUDA device.
"""
from __future__ import annotations

import errno
import functools
import itertools
import multiprocessing
import os
import pickle
import time
import warnings
import weakref
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, IterDataPipe, MapDataPipe
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data.graph_settings import apply_sharding

from .constants import (DEFAULT_PREFETCH_FACTOR, SMALL_BATCH_BYTES, SMALL_LEAF_BYTES,
                        SMALL_LEAF_SHARE)
from .errors import PoolAllocationError, WorkerError
from .interrupts import install_interrupt_guard, signals_held_for_start
from .layout import unflatten
from .messages import (BatchLayout, Done, End, Failed, NeedSlot, Reset, SetEpoch, Slot, Started,
                       Task)
from .pool import ArenaMap, SlotRef
from .processes import (describe_exit, timeout_message, _check_fd_headroom, _forget_arena_hook,
                        _gc_frozen, _out_of_fds, _reraise, _shutdown, _Worker)
from .resume import Progress, Resume, SamplerCursor
from .worker import BatchMaker, Collated, SampleFailure, WorkerConfig, seed_datapipe, worker_loop

if TYPE_CHECKING:
    from .loader import PooledLoader

PICKLE_WARNING = (  # DataLoader's words when a worker cannot be started
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable. Python 3.14+ changed the multiprocessing start "
    "method in non-Mac POSIX platforms to 'forkserver', which requires the worker Process "
    "arguments to be picklable. You can also try multiprocessing.set_start_method('fork').")

class _HandedOut:
    """Around a stage that prefetches batches from our iterator (cuda.DeviceIter): a batch
    counts as delivered for `state_dict()` only when this hands it to the training loop."""

    def __init__(self, stage: Any, base: "_IterBase") -> None:
        self.stage, self.base = stage, base
        base._deferred = True
        base._progress.deferred = True

    def __iter__(self) -> "_HandedOut":
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.stage)
        except StopIteration:
            self.base._progress.commit(everything=True)
            raise
        self.base._progress.commit()
        return batch

    def __len__(self) -> int:
        return len(self.stage)

    def __getattr__(self, name: str) -> Any:  # _reset, _stop, close, _workers, ...
        return getattr(self.stage, name)


class HostTransformIter(torch_dataloader._BaseDataLoaderIter):
    """device_transform without a CUDA device: applied on the host after each batch."""

    def __init__(self, base: Iterator, transform: Callable) -> None:
        self.base, self.transform = base, transform

    def __iter__(self) -> "HostTransformIter":
        return self

    def __next__(self) -> Any:
        return self.transform(next(self.base))

    def __len__(self) -> int:
        return len(self.base)

    def _reset(self, loader: PooledLoader) -> None:
        self.base._reset(loader)

    @property
    def _workers(self) -> list:
        return self.base._workers

    def _stop(self) -> None:
        stop = getattr(self.base, "_stop", None)
        if stop is not None:
            stop()


def _base_seed(loader: DataLoader) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item())


class _IterBase(torch_dataloader._BaseDataLoaderIter):
    """What both iterators share: turning done-messages into batches, and bookkeeping.

    A `_BaseDataLoaderIter` by type only (its __init__ is not run), for tools that recognise
    DataLoader iterators that way, e.g. Lightning's CombinedLoader when it is pickled."""

    def __init__(self, loader: PooledLoader) -> None:
        install_interrupt_guard()
        self._pool = loader._get_pool()
        self._stats = loader._stats
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self._index_sampler = loader._index_sampler
        self._last_yield: float | None = None
        self._dataset = loader.dataset
        self._num_workers = loader.num_workers
        # Small leaves are copied out of their slot at hand-out (see _build), except from a
        # pinned pool (the whole batch stays pinned) and for the ragged helpers, whose
        # per-sample views of the slot are what they promise.
        from .collate import RaggedCollate  # here: collate -> ragged -> worker -> this module
        self._small_copied = not (_pins_pool(loader) or isinstance(loader.collate_fn,
                                                                  RaggedCollate))
        self._reset_length_check(loader)
        # A datapipe's shared seed, then the sampler, then the base seed, as DataLoader does
        # (even without workers), so a seeded generator gives DataLoader's exact shuffle order.
        self._datapipe_group = None
        if isinstance(loader.dataset, IterDataPipe) and dist.is_available() \
                and dist.is_initialized():
            self._datapipe_group = dist.new_group(backend="gloo")
        self._shared_seed = self._seed_datapipe(loader)
        self._cursor = None if self._iterable else SamplerCursor(self._index_sampler)
        # distributed=True with per_sample_seed: samples are seeded from the sampler's seed and
        # epoch, the same on every rank and world size (an elastic resume is bit-identical)
        self._elastic = loader._elastic_sampler() if loader.per_sample_seed else None
        self._seed = 0
        self._seed_epoch = 0
        self._resumed = self._begin_epoch(loader, first=True)
        if loader.pin_memory and loader.pin_memory_device:
            warnings.warn("pin_memory_device is deprecated, the current accelerator will be used "
                          f"as the device,ignore pin_memory_device='{loader.pin_memory_device}'.",
                          stacklevel=3)  # torch's words, missing space included
        if loader.pin_memory and not torch.cuda.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=3)

    def __iter__(self) -> "_IterBase":
        return self

    def _seed_datapipe(self, loader: PooledLoader) -> int | None:
        """A new shared seed for a datapipe graph (broadcast from rank 0), applied here; workers
        apply it to their copies. None for other datasets."""
        if not isinstance(loader.dataset, IterDataPipe):
            return None
        seed = torch_dataloader._share_dist_seed(loader.generator, self._datapipe_group)
        seed_datapipe(loader.dataset, seed)
        return seed

    def __getstate__(self) -> Any:
        raise NotImplementedError("{} cannot be pickled", self.__class__.__name__)  # as torch's

    def _reset_length_check(self, loader: PooledLoader) -> None:
        """DataLoader remembers len(dataset) if len(loader) was asked for (an iterable dataset's
        `__len__`), and warns on every batch beyond it."""
        self._num_yielded = 0
        self._len_called = loader._IterableDataset_len_called

    def _check_length(self) -> None:
        self._num_yielded += 1
        if self._iterable and self._len_called is not None \
                and self._num_yielded > self._len_called:
            message = (f"Length of IterableDataset {self._dataset} was reported to be "
                       f"{self._len_called}(when accessing len(dataloader)), but "
                       f"{self._num_yielded} samples have been fetched. ")
            if self._num_workers > 0:
                message += ("For multiprocessing data-loading, this could be caused by not "
                            "properly configuring the IterableDataset replica at each worker. "
                            "Please see https://pytorch.org/docs/stable/data.html"
                            "#torch.utils.data.IterableDataset for examples.")
            warnings.warn(message, stacklevel=3)

    def _begin_epoch(self, loader: PooledLoader, first: bool) -> Resume | None:
        """Start the sampler and the position of an epoch, from a loaded state if there is one
        (returned). Without one: the sampler first, then (first epoch) the base seed, as
        DataLoader does (even without workers), so a seeded generator gives its exact order.

        With one, as StatefulDataLoader: a loaded state makes a new iterator, which draws a base
        seed (discarded for the saved one) before the sampler starts, so a sampler drawing from
        torch's global RNG after `torch.manual_seed` takes the seed it took in the saved run. A
        state saved at an epoch's end replays that epoch's sampler pass to its end (a generator
        moves on as it did), keeps the datasets' end states where DataLoader keeps datasets
        between epochs (in this process with 0 workers; in persistent workers), and starts the
        next epoch."""
        resume = loader._take_resume()
        if resume is not None:
            _base_seed(loader)
        persistent = self._num_workers > 0 and loader.persistent_workers
        restore = None
        if resume is not None and not resume.finished:
            self._seed, self._seed_epoch = resume.base_seed, resume.epoch
            self._sampler_iter = None if self._iterable else self._cursor.restore(
                resume.sampler_state, resume.sampler_skip)
            restore = resume.stream_dicts()
        else:
            if resume is not None:  # saved at the end of its epoch
                if not self._iterable:
                    for _ in self._cursor.restore(resume.sampler_state, resume.sampler_skip):
                        pass
                if persistent or self._num_workers == 0:
                    restore = resume.stream_dicts(new_epoch=True)
            self._sampler_iter = None if self._iterable else iter(self._index_sampler)
            if resume is not None and persistent:
                self._seed, self._seed_epoch = resume.base_seed, resume.epoch + 1
            elif first or resume is not None:
                self._seed, self._seed_epoch = _base_seed(loader), 0
            else:
                self._seed_epoch += 1
        self._progress = Progress.starting(
            iterable=self._iterable, num_workers=loader.num_workers, base_seed=self._seed,
            epoch=self._seed_epoch, snapshot_every=loader.snapshot_every_n_steps,
            resume=None if resume is None or resume.finished else resume, restore=restore)
        self._progress.deferred = getattr(self, "_deferred", False)
        self._position = self._progress.delivered_prefix  # the next task's place in the epoch
        self._peeked: tuple[int, Any] | None = None
        self._progress.prepare = weakref.WeakMethod(self._prepare_state)
        loader._progress = self._progress
        return resume

    def _sample_epoch(self) -> int:
        """The epoch per-sample seeds are drawn for."""
        return self._elastic.epoch if self._elastic is not None else self._seed_epoch

    def _prepare_state(self) -> None:
        """Before a state is taken: start the sampler's pass (see `_prime_sampler`)."""
        if not self._iterable and self._progress.sampler_snapshot == (0, None):
            self._prime_sampler()

    def _prime_sampler(self) -> None:
        """Asked for a state before the first task: draw the first indices now, so that the
        sampler's pass has started and its state (a shuffle's seed) can be saved. Harmless to the
        order: the base seed is already drawn, as it would be before the first batch."""
        if self._peeked is None and self._position == 0 and self._sampler_iter is not None:
            try:
                self._peeked = self._next_payload()
            except StopIteration:
                pass

    def _next_payload(self) -> tuple[int, Any]:
        """The next task's place in the epoch and its indices (StopIteration at the end).
        Places delivered out of order before a resume (in_order=False) are passed over."""
        if self._peeked is not None:
            peeked, self._peeked = self._peeked, None
            return peeked
        while True:
            position = self._position
            self._progress.dispatching(position, self._cursor, self._sampler_iter)
            payload = next(self._sampler_iter)
            self._progress.dispatched(position, self._cursor, self._sampler_iter)
            self._position += 1
            if position not in self._progress.delivered_ahead:
                return position, payload

    def __len__(self) -> int:
        # torch's answer: never len(loader), whose call on an iterable dataset arms the warning
        return len(self._index_sampler)

    def _build(self, layout: BatchLayout) -> Any:
        """The batch a worker built, as zero-copy views of its slot."""
        lease = self._pool.lease(layout.ref, layout.nbytes)  # its size picks the slots' class
        base = lease.array()
        del lease
        arrays = []
        nbytes = 0
        # Kept labels must not keep the slot of the images (README, "Kept batches are safe")
        small = 0
        if self._small_copied and self._pool.release_fence is None:  # never from a pinned pool
            total = sum(leaf.nbytes for leaf, _ in layout.leaves)
            small = total if total <= SMALL_BATCH_BYTES else min(SMALL_LEAF_BYTES,
                                                                  total // SMALL_LEAF_SHARE)
        for leaf, off in layout.leaves:
            raw = base[off:off + leaf.nbytes]
            if 0 < leaf.nbytes <= small:
                raw = raw.copy()
            nbytes += leaf.nbytes
            if leaf.kind == "tensor":
                arrays.append(torch.from_numpy(raw).view(getattr(torch, leaf.dtype))
                              .view(leaf.shape))
            else:
                arrays.append(raw.view(leaf.storage_dtype).reshape(leaf.shape))
        c = self._stats.counters
        c["batches"] += 1
        c["samples"] += layout.num_samples
        c["bytes"] += nbytes
        return unflatten(layout.spec, arrays, layout.metas)

    def _mark_wait(self, started: float) -> None:
        now = time.perf_counter()
        c = self._stats.counters
        c["wait_s"] += now - started
        if self._last_yield is not None:
            c["consumer_s"] += started - self._last_yield
            self._stats.main_span("step", self._last_yield, started)
        self._stats.main_span("wait", started, now)
        self._last_yield = now

    def _epoch_done(self) -> None:
        self._pool.mark_warm()
        self._last_yield = None
        self._stats.epoch_done()


def _worker_config(loader: PooledLoader, iterable: bool, seed: int, *,
                   worker_init_fn: Callable | None, start_method: str) -> WorkerConfig:
    elastic = loader._elastic_sampler() if loader.per_sample_seed else None
    return WorkerConfig(dataset=loader.dataset, iterable=iterable,
                        auto_collation=loader._auto_collation, batch_size=loader.batch_size,
                        drop_last=loader.drop_last, collate_fn=loader._pooled_collate(),
                        worker_init_fn=worker_init_fn, num_workers=loader.num_workers,
                        base_seed=seed, on_error=loader.on_error, start_method=start_method,
                        per_sample_seed=loader.per_sample_seed,
                        sample_base=None if elastic is None else elastic.seed,
                        snapshot_every=loader.snapshot_every_n_steps)


def _pins_pool(loader: PooledLoader) -> bool:
    """Whether batches come from a pinned pool (a CUDA device, or pin_memory with CUDA)."""
    on_cuda = loader.device is not None and loader.device.type == "cuda"
    return on_cuda or (loader.pin_memory and torch.cuda.is_available())


def _passes_collated(loader: PooledLoader) -> bool:
    """In-process, a batch already built in memory (a custom collate's, a `__getitems__`
    batch's stacks) needs no slot unless the pool is pinned for a device copy: hand it out as
    it is (DataLoader's cost, not a copy more; `BatchMaker.slotless` says which batches)."""
    return not _pins_pool(loader)


class InProcessIter(_IterBase):
    """num_workers=0: the same data path, run in the main process."""

    def __init__(self, loader: PooledLoader) -> None:
        super().__init__(loader)
        pool = self._pool

        def request_slot(task_id: int, nbytes: int, old: SlotRef) -> SlotRef:
            pool.release(old)
            return pool.acquire(nbytes)

        cfg = _worker_config(loader, self._iterable, self._seed, worker_init_fn=None,
                             start_method="none")
        cfg.pass_collated = _passes_collated(loader)
        if isinstance(loader.dataset, (IterDataPipe, MapDataPipe)):  # shard by rank, as DataLoader
            world_size, rank = torch_dataloader._get_distributed_settings()
            apply_sharding(loader.dataset, world_size, rank)
        self._maker = BatchMaker(cfg, ArenaMap(), request_slot)
        self._maker.reset_iterator(self._progress.resume_stream(0))
        self._progress.stream_started(0, self._maker.snapshot(), self._maker.items)
        self._task = 0

    def _release(self, ref: SlotRef | None) -> None:
        if ref is not None:
            self._pool.release(ref)

    def _count(self, result: Collated) -> Any:
        c = self._stats.counters
        c["batches"] += 1
        c["samples"] += result.num_samples
        return result.batch

    def __next__(self) -> Any:
        started = time.perf_counter()
        payload = position = None
        if self._sampler_iter is not None:
            try:
                position, payload = self._next_payload()
            except StopIteration:
                self._progress.finish()
                self._epoch_done()
                raise
        ref = None if self._maker.slotless else self._pool.acquire()
        try:
            built = time.perf_counter()
            result = self._maker.make(self._task, payload, ref, self._sample_epoch(),
                                      self._stats.tracing)
        except SampleFailure as failure:
            self._release(ref)
            raise failure.__cause__ from None
        except BaseException:
            self._release(ref)
            raise
        finally:
            self._stats.record_skips(self._maker.skipped)
        self._task += 1
        if result is None:
            self._release(ref)
            self._progress.delivered_end(0)
            self._progress.finish()
            self._epoch_done()
            raise StopIteration
        self._stats.record_batch(0, self._maker.stages, result.num_samples,
                                 time.perf_counter() - built, self._maker.spans, track=0)
        batch = self._build(result) if type(result) is not Collated else self._count(result)
        if self._iterable:
            self._progress.delivered_batch(0, self._maker.position)
        else:
            self._progress.delivered_task(position, 0, self._maker.position)
        self._mark_wait(started)
        self._check_length()
        return batch


class WorkerIter(_IterBase):
    """num_workers>0: worker processes fill slots; results come back in task order."""

    def __init__(self, loader: PooledLoader) -> None:
        super().__init__(loader)
        self._num_workers = loader.num_workers
        self._prefetch = loader.prefetch_factor or DEFAULT_PREFETCH_FACTOR
        self._timeout = loader.timeout
        self._in_order = loader.in_order
        self._persistent = loader.persistent_workers
        self._ctx = loader.multiprocessing_context or multiprocessing.get_context()
        worker_init_fn = loader.worker_init_fn
        if isinstance(loader.dataset, (IterDataPipe, MapDataPipe)):
            # DataLoader's own wrapper: shard the graph by rank and worker, then the user's init
            world_size, rank = torch_dataloader._get_distributed_settings()
            worker_init_fn = functools.partial(torch_dataloader._sharding_worker_init_fn,
                                               worker_init_fn, world_size, rank)
        self._cfg = _worker_config(loader, self._iterable, self._seed,
                                   worker_init_fn=worker_init_fn,
                                   start_method=self._ctx.get_start_method())
        self._cfg.shared_seed = self._shared_seed
        self._epoch = 0
        self._stopped = False
        self._start_workers()

    # -- workers -----------------------------------------------------------------------------
    def _start_workers(self) -> None:
        self._cfg.resume_streams = self._progress.restore
        self._cfg.epoch = self._epoch
        _check_fd_headroom(self._num_workers)
        lifeline_r, lifeline_w = self._ctx.Pipe(duplex=False)
        self._cfg.close_in_child = [lifeline_w.fileno()]
        workers = []
        try:
            for wid in range(self._num_workers):
                parent, child = self._ctx.Pipe(duplex=True)
                self._cfg.close_in_child.append(parent.fileno())
                proc = self._ctx.Process(target=worker_loop, args=(self._cfg, wid, child,
                                                                   lifeline_r), daemon=True)
                workers.append(_Worker(wid, proc, parent))  # before start: a Ctrl-C stops it
                try:
                    with signals_held_for_start(), _gc_frozen():
                        proc.start()
                except (TypeError, AttributeError, pickle.PicklingError):
                    warnings.warn(PICKLE_WARNING, stacklevel=4)
                    raise
                child.close()
                self._cfg.close_in_child.remove(parent.fileno())
        except BaseException as exc:
            _shutdown(workers, lifeline_w, os.getpid())
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(exc.errno, _out_of_fds(self._num_workers)) from exc
            raise
        finally:
            lifeline_r.close()
        self._worker_states = workers
        # What torch's own tests (and tools written against DataLoader) look at: the processes.
        self._workers = [w.process for w in workers]
        self._lifeline = lifeline_w
        self._broken = self._stopped = False
        self._finalizer = weakref.finalize(self, _shutdown, workers, lifeline_w, os.getpid())
        self._retire_hook = _forget_arena_hook(workers)
        self._pool.on_retire_arena.append(self._retire_hook)
        self._next_task = 0
        self._stale: dict = {}
        self._reset_epoch_state()

    def _reset_epoch_state(self) -> None:
        self._tasks: dict[int, tuple[_Worker, SlotRef]] = {}
        self._task_info: dict[int, tuple[int, int]] = {}  # task id -> (place in epoch, worker)
        self._ready: dict[int, Done | End | Failed] = {}  # answers not yet handed out
        self._next_yield = self._next_task  # task ids grow across epochs: never reused
        self._sampler_done = False
        # A resumed iterable epoch keeps its interleaving: the worker after the one that
        # delivered last goes first, and workers whose stream had ended stay idle.
        first = (self._progress.last_worker + 1) % len(self._worker_states)
        order = self._worker_states[first:] + self._worker_states[:first]
        self._cycle = itertools.cycle(order)
        for w in self._worker_states:
            w.active = not self._progress.stream_ended(w.id)
            w.outstanding = 0

    def _stop(self) -> None:
        self._stopped = True
        if hasattr(self, "_worker_states"):
            if self._retire_hook in self._pool.on_retire_arena:
                self._pool.on_retire_arena.remove(self._retire_hook)
            self._finalizer()
            for tasks in (self._tasks, self._stale):  # workers are gone: nothing writes these
                for task_id in list(tasks):
                    self._pool.release(tasks.pop(task_id)[1])
            self._release_ready()

    def _release_ready(self) -> None:
        """Give back the slots of batches built but never handed out."""
        for answer in self._ready.values():
            if type(answer) is Done:
                self._pool.release(answer.batch.ref)
        self._ready.clear()

    def _shutdown_workers(self) -> None:
        """DataLoader's iterator's name for stopping its workers (torch's tests call it)."""
        self._stop()

    def _stop_on_interrupt(self, exc: BaseException) -> None:
        """Ctrl-C (or SystemExit from a signal handler) may have cut a message in half, and a
        pool that cannot grow leaves a worker waiting for its slot: stop the workers now; the
        next epoch starts fresh ones."""
        if not isinstance(exc, Exception) or isinstance(exc, PoolAllocationError):
            self._broken = True
            self._stop()

    def _reset(self, loader: PooledLoader) -> None:
        """A new epoch on persistent workers (called by DataLoader.__iter__), possibly from a
        loaded state."""
        try:
            self._reset_workers(loader)
        except BaseException as exc:
            self._stop_on_interrupt(exc)
            raise

    def _reset_workers(self, loader: PooledLoader) -> None:
        self._reset_length_check(loader)
        self._shared_seed = self._cfg.shared_seed = self._seed_datapipe(loader)
        seed_before = self._seed
        resume = self._begin_epoch(loader, first=False)
        # Workers seeded from another base seed would not give the saved epoch's randomness, and
        # a loaded state, as in StatefulDataLoader, starts fresh workers (fresh copies of the
        # dataset, RNGs seeded anew) that restore it.
        self._cfg.base_seed = self._seed
        if (self._broken or any(not p.is_alive() for p in self._workers)
                or self._seed != seed_before or resume is not None):
            self._stop()
            self._start_workers()
            return
        self._epoch += 1
        self._stale.update(self._tasks)  # results of these are dropped when they arrive
        self._release_ready()
        self._reset_epoch_state()
        for w in self._worker_states:
            if loader._epoch is not None and hasattr(loader.dataset, "set_epoch"):
                w.conn.send(SetEpoch(epoch=loader._epoch))
            w.conn.send(Reset(epoch=self._epoch, shared_seed=self._shared_seed))

    def _prepare_state(self) -> None:
        """Before a state is taken: also wait for the start state of every worker that has not
        sent it yet (it does so as soon as its epoch starts), as StatefulDataLoader waits for
        its workers' start-up states."""
        super()._prepare_state()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while not (self._stopped or self._broken) and any(
                w.id not in self._progress.started_workers for w in self._worker_states):
            try:
                self._receive(deadline)
            except BaseException as exc:
                self._stop_on_interrupt(exc)
                raise

    # -- dispatch and receive --------------------------------------------------------------------
    def _try_dispatch(self) -> None:
        """DataLoader's dispatch: at most prefetch_factor * num_workers batches in flight or
        waiting, workers in turn; with in_order=False a worker already holding its share
        (in flight / active workers) is passed over, so a slow one does not gather tasks."""
        limit = self._prefetch * self._num_workers
        # An abandoned epoch's tasks (a break) still hold slots until their answers come back:
        # they count, or the new epoch would run the pool dry and grow it.
        while (not self._sampler_done
               and len(self._tasks) + len(self._ready) + len(self._stale) < limit):
            active = sum(w.active for w in self._worker_states)
            for _ in range(self._num_workers):
                worker = next(self._cycle)
                if worker.active and (self._in_order or worker.outstanding < limit // active):
                    break
            else:
                return  # no active worker (or none with room)
            payload = position = None
            if not self._iterable:
                try:
                    position, payload = self._next_payload()
                except StopIteration:
                    self._sampler_done = True
                    return
            ref = self._pool.acquire()
            task_id = self._next_task
            self._next_task += 1
            self._tasks[task_id] = (worker, ref)
            worker.outstanding += 1
            self._task_info[task_id] = (position, worker.id)
            try:
                worker.conn.send(Task(task_id=task_id, epoch=self._epoch, payload=payload,
                                      ref=ref, seed_epoch=self._sample_epoch(),
                                      trace=self._stats.tracing))
            except (BrokenPipeError, ConnectionResetError):  # it died: say how, not EPIPE
                self._worker_died(worker)

    def _handle(self, worker: _Worker, msg: Done | End | Failed | NeedSlot | Started) -> None:
        if type(msg) is Started:
            if msg.epoch == self._epoch:  # not an abandoned epoch's
                self._progress.stream_started(msg.worker_id, msg.snapshot, msg.items)
            return
        if type(msg) is NeedSlot:
            self._pool.release(msg.old)
            ref = self._pool.acquire(msg.nbytes)
            if msg.task_id in self._tasks:
                self._tasks[msg.task_id] = (worker, ref)
            elif msg.task_id in self._stale:
                self._stale[msg.task_id] = (worker, ref)
            worker.conn.send(Slot(task_id=msg.task_id, ref=ref))
            return
        if msg.epoch != self._epoch or msg.task_id not in self._tasks:  # an abandoned epoch's
            self._stale.pop(msg.task_id, None)
            self._pool.release(msg.batch.ref if type(msg) is Done else msg.ref)
            return
        self._tasks.pop(msg.task_id)
        worker.outstanding -= 1
        if type(msg) is Done:
            self._stats.record_skips(msg.skipped)
            self._stats.worker_busy_s[worker.id] += msg.busy_s
            self._stats.record_batch(worker.id, msg.stages, msg.batch.num_samples, msg.busy_s,
                                     msg.spans)
        elif type(msg) is End:
            worker.active = False
            self._pool.release(msg.ref)
        else:
            self._stats.record_skips(msg.skipped)
            self._pool.release(msg.ref)
        self._ready[msg.task_id] = msg

    def _receive(self, deadline: float | None) -> None:
        live = {w.conn: w for w in self._worker_states}
        sentinels = {w.process.sentinel: w for w in self._worker_states}
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(live) + list(sentinels), timeout)
        if not ready:
            self._broken = True
            self._stop()
            raise RuntimeError(timeout_message(self._timeout))
        for obj in ready:
            if obj in live:
                worker = live[obj]
                try:
                    while obj.poll():
                        self._handle(worker, obj.recv())
                except (EOFError, OSError):
                    self._worker_died(worker)
        for obj in ready:
            if obj in sentinels:
                self._worker_died(sentinels[obj])

    def _worker_died(self, worker: _Worker) -> None:
        worker.process.join(1.0)
        self._broken = True
        message = describe_exit(worker.id, worker.process.pid, worker.process.exitcode)
        self._stop()
        raise WorkerError(message)

    def __next__(self) -> Any:
        try:
            return self._next_batch()
        except BaseException as exc:
            self._stop_on_interrupt(exc)
            raise

    def _next_batch(self) -> Any:
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            if self._broken:
                raise RuntimeError("this PooledLoader iterator stopped after an error; "
                                   "start a new epoch with iter(loader)")
            self._try_dispatch()
            answer = self._pop_ready()
            if answer is not None:
                position, worker_id = self._task_info.pop(answer.task_id)
                if type(answer) is End:
                    self._progress.delivered_end(worker_id)
                    continue
                if type(answer) is Failed:
                    _reraise(answer.error)
                batch = self._build(answer.batch)
                if self._iterable:
                    self._progress.delivered_batch(worker_id, answer.position)
                else:
                    self._progress.delivered_task(position, worker_id, answer.position)
                self._mark_wait(started)
                self._check_length()
                return batch
            if not self._tasks and (self._sampler_done or not any(
                    w.active for w in self._worker_states)):
                self._progress.finish()
                self._epoch_done()
                if not self._persistent:
                    self._stop()
                raise StopIteration
            self._receive(deadline)

    def _pop_ready(self) -> Done | End | Failed | None:
        if self._in_order:
            answer = self._ready.pop(self._next_yield, None)
            if answer is not None:
                self._next_yield += 1
            return answer
        if self._ready:
            return self._ready.pop(next(iter(self._ready)))
        return None

    def __del__(self) -> None:
        try:
            self._stop()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
