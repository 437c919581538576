"""`PooledLoader`: torch's DataLoader, with batches built by workers straight into recycled
shared-memory slots.

It subclasses `torch.utils.data.DataLoader`, so construction, argument checks, samplers, `len()`
and `isinstance(loader, DataLoader)` are exactly torch's; only the iterator is ours.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import errno
import functools
import gc
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import time
import warnings
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, IterableDataset, IterDataPipe, MapDataPipe
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data.graph_settings import apply_sharding
from torch.utils.data._utils.collate import default_collate, default_convert

from .constants import (BOTTLENECK_WAIT_SHARE, DEFAULT_PREFETCH_FACTOR, FIRST_SLOT_BYTES,
                        default_pool_slots)
from .errors import PoolAllocationError, WorkerError
from .interrupts import install_interrupt_guard, signals_held_for_start
from .layout import unflatten
from .messages import (BatchLayout, Done, End, ErrorInfo, Failed, Forget, NeedSlot, Reset,
                       SetEpoch, Slot, Task)
from .pool import ArenaMap, SlotPool, SlotRef
from .resume import (Progress, ResumableRandomSampler, Resume, SamplerCursor, StateMismatch,
                     fresh_state, parse)
from .worker import BatchMaker, SampleFailure, WorkerConfig, seed_datapipe, worker_loop

log = logging.getLogger("pooled_loader")
T_co = TypeVar("T_co", covariant=True)

GROW_WARNING = (
    "PooledLoader: every slot of the pool is in use ({slots} slots): batches are being kept "
    "(or not yet freed) by the training loop, so the pool grows. Nothing is overwritten; to size "
    "the pool up front, pass pool_slots= (num_workers * prefetch_factor + batches you keep).")
PICKLE_WARNING = (  # DataLoader's words when a worker cannot be started
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable. Python 3.14+ changed the multiprocessing start "
    "method in non-Mac POSIX platforms to 'forkserver', which requires the worker Process "
    "arguments to be picklable. You can also try multiprocessing.set_start_method('fork').")
SHUTDOWN_TIMEOUT_S = 2.0  # workers hold no locks: terminating after this is safe


@dataclass
class _Worker:
    id: int
    process: Any
    conn: Any
    active: bool = True  # False once an iterable dataset's worker is exhausted
    outstanding: int = 0  # tasks sent and not answered yet (in_order=False balances on this)


def describe_exit(worker_id: int, pid: int | None, exitcode: int | None) -> str:
    """Why a worker process is gone, in DataLoader's own words first (people and tools grep for
    them), then which PooledLoader worker it was and what to do."""
    ours = f"(PooledLoader worker {worker_id}"
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
            name, description = sig.name, signal.strsignal(sig) or sig.name
        except ValueError:
            name = description = f"signal {-exitcode}"
        text = f"DataLoader worker (pid {pid}) is killed by signal: {description}. "
        if name == "SIGBUS":
            text += ("It is possible that dataloader's workers are out of shared memory. "
                     "Please try to raise your shared memory limit. ")
        if name == "SIGKILL":
            ours += (" was killed by SIGKILL: if nobody sent it, the kernel's OOM killer did "
                     "(see `dmesg`); lower num_workers, batch_size, prefetch_factor or what a "
                     "sample holds in memory")
            return f"{text}{ours}.)"
        return (f"{text}{ours} was killed by {name}; rerun with num_workers=0 to see where "
                "it fails.)")
    if exitcode:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
                f"better error trace. {ours} exited unexpectedly with exit code {exitcode}.)")
    return (f"DataLoader worker (pid(s) {pid}) exited unexpectedly {ours} exited with exit code "
            f"{exitcode} while the loader still expected batches from it.)")


def timeout_message(timeout: float) -> str:
    return (f"DataLoader timed out after {timeout} seconds (PooledLoader: no batch came back "
            f"from the workers within timeout={timeout}; raise it, or set timeout=0 to wait "
            "indefinitely)")


def _send_nowait(conn: Any, msg: Any) -> None:
    """Send ``msg`` unless the pipe is full (its worker is about to be terminated anyway)."""
    try:
        os.set_blocking(conn.fileno(), False)
        conn.send(msg)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Forked workers must not collect what they inherit: a finalizer of the main process's
    garbage would run in them (an old iterator's shutdown), and the collector's bookkeeping
    writes would copy the parent's pages (copy-on-read). ``gc.freeze`` across the fork hides
    those objects from the child's collector for good; the parent collects them as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


FDS_PER_WORKER = 3  # this process's end of its socket pair, and its process's two pipe ends
FDS_TO_START = 6  # the lifeline pipe, and a worker's socket end and fork pipes while it starts


def _out_of_fds(num_workers: int) -> str:
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"PooledLoader: not enough file descriptors to start {num_workers} workers: "
            f"{len(os.listdir('/proc/self/fd'))} are open, ulimit -n is {soft}, and the workers "
            f"need about {FDS_PER_WORKER * num_workers + FDS_TO_START} more ({FDS_PER_WORKER} "
            "each, plus one per pool arena). Fix: raise the limit (`ulimit -n 65536`, or "
            "resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or use fewer workers.")


def _check_fd_headroom(num_workers: int) -> None:
    """Fail before starting anything (multiprocessing leaks a pipe when fork's second pipe
    cannot be made)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = FDS_PER_WORKER * num_workers + FDS_TO_START
    if soft != resource.RLIM_INFINITY and len(os.listdir("/proc/self/fd")) + need > soft:
        raise OSError(errno.EMFILE, _out_of_fds(num_workers))


def _join_all(workers: list[_Worker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))


def _shutdown(workers: list[_Worker], lifeline: Any, owner_pid: int | None = None) -> None:
    """Stop worker processes: ask politely, then terminate, then kill. Never hangs: the stop
    message is sent without blocking (a worker's full pipe cannot stall it), each step waits for
    all workers at once, and a Ctrl-C meanwhile cuts the polite wait short and is raised once
    every worker is gone. Does nothing in another process (a forked child that inherited it)."""
    if owner_pid is not None and owner_pid != os.getpid():
        return  # a forked child collected its copy of the iterator: the workers are not its own
    started = [w for w in workers if w.process.pid is not None]
    interrupted = None
    try:
        for w in workers:
            _send_nowait(w.conn, None)
        try:
            lifeline.close()
        except OSError:
            pass
        _join_all(started, SHUTDOWN_TIMEOUT_S)
    except KeyboardInterrupt as exc:
        interrupted = exc
    for stop in ("terminate", "kill"):
        alive = [w for w in started if w.process.is_alive()]
        for w in alive:
            getattr(w.process, stop)()
        _join_all(alive, 1.0)
    for w in workers:
        w.conn.close()
    if interrupted is not None:
        raise interrupted


def _forget_arena_hook(workers: list[_Worker]) -> Callable:
    """Tell workers to unmap a retired arena (holds the workers, never the iterator)."""
    def hook(arena: Any) -> None:
        for w in workers:
            if w.process.is_alive():
                try:
                    w.conn.send(Forget(owner_pid=os.getpid(), arena_id=arena.id))
                except (OSError, ValueError):
                    pass
    return hook


def _reraise(info: ErrorInfo) -> None:
    """Raise a worker's exception in the main process as DataLoader does: same type, torch's own
    words and KeyError/`message=` handling; the first line ("Caught X in DataLoader worker process
    N.") and the last (the original error) are torch's, the sample index comes on a line between."""
    where = f"in DataLoader worker process {info.worker_id}"
    if info.index is not None:
        where += f".\nPooledLoader: raised while loading sample index {info.index!r}"
    wrapper = ExceptionWrapper((info.exc_type, None, None), where=where)
    wrapper.exc_msg = info.traceback
    wrapper.reraise()


class LoaderStats:
    """Where the time goes and what moved, shared by the loader and its iterators."""

    def __init__(self) -> None:
        self.skipped_seen: set = set()
        self.reset()

    def reset(self) -> None:
        self.counters: collections.Counter = collections.Counter()
        self.worker_busy_s: collections.Counter = collections.Counter()
        self.started = time.perf_counter()

    def record_skips(self, skipped: list) -> None:
        for index, reason in skipped:
            self.counters["skipped"] += 1
            if index not in self.skipped_seen:
                self.skipped_seen.add(index)
                log.warning("PooledLoader skipped sample %r: %s", index, reason)


class PooledLoader(DataLoader[T_co], Generic[T_co]):
    """Drop-in `torch.utils.data.DataLoader` whose workers write batches into recycled slots of
    one shared-memory pool.

    Extra keyword arguments:
        pool_slots: slots in the pool (default `num_workers * prefetch_factor + 2`); it grows,
            with one warning, if the training loop keeps more batches than that.
        on_error: "raise" (default) or "skip": a map-style sample whose loading raises is replaced
            by another sample drawn from the dataset (reproducibly from the seed and the index),
            so batches keep their size; skips are logged once per sample and counted in
            `stats()["skipped"]`. A dataset whose `on_error` attribute is "skip" turns it on.
            Iterable datasets skip inside themselves (e.g. `pooled_loader.webdataset`).
        device: a CUDA device: batches arrive there, copied asynchronously on a side stream from
            the pinned pool (see `pooled_loader.cuda`); "cpu"/None keeps them on the host.
        device_transform: a callable applied to each batch after the transfer (on the copy
            stream), e.g. `pooled_loader.cuda.NormalizeImages(mean, std, torch.float16)`; on the
            host when there is no CUDA device.
        distributed: shard a map-style dataset by rank with DistributedSampler semantics.
        snapshot_every_n_steps: as in torchdata's StatefulDataLoader: how often (in batches) the
            sampler (map-style, when it has `state_dict`) or each worker's iterable dataset is
            asked for its state; between snapshots a resume skips forward, so `state_dict()` is
            exact for every value. None or 0: never ask; resume skips from the epoch's start.
        per_sample_seed: seed `random`, `numpy.random` and torch from (base seed, epoch, sample
            index) just before each sample is loaded, so augmentations no longer depend on which
            worker loaded a sample: an epoch's batches are bit-identical for any num_workers and
            after a resume. Default False: DataLoader's per-worker seeding.

    `state_dict()`/`load_state_dict()` checkpoint the position mid-epoch (README, "Checkpoint and
    resume").
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable | None = None, multiprocessing_context: Any = None,
                 generator: torch.Generator | None = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, pin_memory_device: str = "",
                 in_order: bool = True, pool_slots: int | None = None, on_error: str = "raise",
                 device: Any = None, device_transform: Callable | None = None,
                 distributed: bool = False, snapshot_every_n_steps: int | None = 1,
                 per_sample_seed: bool = False) -> None:
        if snapshot_every_n_steps is not None and (
                isinstance(snapshot_every_n_steps, bool) or not isinstance(snapshot_every_n_steps,
                                                                           int)
                or snapshot_every_n_steps < 0):
            raise ValueError("snapshot_every_n_steps must be a non-negative integer or None, got "
                             f"{snapshot_every_n_steps!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if pool_slots is not None and pool_slots < 1:
            raise ValueError(f"pool_slots must be a positive integer, got {pool_slots}")
        if distributed:
            from .distributed import make_distributed_sampler
            if sampler is not None or batch_sampler is not None:
                raise ValueError("distributed=True builds its own DistributedSampler; "
                                 "do not pass sampler or batch_sampler as well")
            sampler = make_distributed_sampler(dataset, shuffle=bool(shuffle), seed=0,
                                               drop_last=drop_last)
            shuffle = None
        shuffle_requested = shuffle
        if (shuffle and sampler is None and batch_sampler is None
                and not isinstance(dataset, IterableDataset)):
            # torch's RandomSampler, same order, whose pass can be saved and replayed
            sampler = ResumableRandomSampler(dataset, generator=generator)
            shuffle = None
        super().__init__(dataset, batch_size, shuffle, sampler, batch_sampler, num_workers,
                         collate_fn, pin_memory, drop_last, timeout, worker_init_fn,
                         multiprocessing_context, generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers,
                         pin_memory_device=pin_memory_device, in_order=in_order)
        if not distributed and shuffle_requested:
            try:
                from .distributed import warn_if_undistributed
                warn_if_undistributed(bool(shuffle_requested), self.sampler)
            except ImportError:
                pass
        self.pool_slots = pool_slots
        # A map-style dataset built with on_error="skip" (e.g. vision.ImageFolder) asks for the
        # same: the loader does the skipping so that batches keep their size.
        if getattr(dataset, "on_error", None) == "skip" and not isinstance(dataset,
                                                                           IterableDataset):
            on_error = "skip"
        self.on_error = on_error
        self.device = torch.device(device) if device is not None else None
        self.device_transform = device_transform
        self._pool: SlotPool | None = None
        self._stats = LoaderStats()
        self._epoch: int | None = None
        self.snapshot_every_n_steps = snapshot_every_n_steps or 0
        self.per_sample_seed = bool(per_sample_seed)
        self._progress: Progress | None = None  # the latest epoch's position (kept after it ends)
        self._resume: Resume | None = None  # loaded, for the next iter()
        self._resume_raw: dict | None = None
        from .integrations import maybe_patch_accelerate
        maybe_patch_accelerate()  # so that accelerator.prepare(self) keeps a PooledLoader

    # -- checkpoint and resume ------------------------------------------------------------------
    def _state_check(self) -> dict:
        """What a saved state must agree with (README, "Checkpoint and resume")."""
        iterable = isinstance(self.dataset, IterableDataset)
        length = None
        if not iterable:
            try:
                length = len(self.dataset)
            except TypeError:  # a map-style dataset without len(), read through its sampler
                pass
        index_sampler = self._index_sampler
        names = [type(index_sampler).__name__]
        inner = getattr(index_sampler, "sampler", None)
        if inner is not None:
            names.append(type(inner).__name__)
        check = {"iterable": iterable, "dataset_len": length, "batch_size": self.batch_size,
                 "drop_last": self.drop_last, "num_workers": self.num_workers,
                 "per_sample_seed": self.per_sample_seed, "sampler": "/".join(names)}
        for part in (index_sampler, inner):
            if hasattr(part, "num_replicas") and hasattr(part, "rank"):  # DistributedSampler
                check.update(world_size=part.num_replicas, rank=part.rank)
        return check

    def state_dict(self) -> dict:
        """The position after the last batch handed to the training loop (not what workers have
        prefetched), as plain JSON-serialisable data (as long as your sampler's and dataset's own
        `state_dict` are). Cheap: no worker is asked at this point."""
        if self._progress is not None:
            state = self._progress.state(self._state_check())
            state["_pooled"]["loader_epoch"] = self._epoch
            return state
        if self._resume_raw is not None:
            return copy.deepcopy(self._resume_raw)
        state = fresh_state(self._state_check(), self.num_workers)
        state["_pooled"]["loader_epoch"] = self._epoch
        return state

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` continue from `state` (from `state_dict()`, possibly through a
        JSON or torch.save round trip). Raises ValueError (`resume.StateMismatch`) naming what
        differs when the state does not fit this loader, or what is missing when it is corrupt."""
        if state == {}:  # torchdata's convention: nothing to restore
            self._resume = self._resume_raw = None
            return
        resume = parse(state, self._state_check())
        loader_epoch = state["_pooled"].get("loader_epoch")
        if loader_epoch is not None:
            if isinstance(loader_epoch, bool) or not isinstance(loader_epoch, int):
                raise StateMismatch("PooledLoader.load_state_dict: the state is corrupt: "
                                    f"'_pooled.loader_epoch' is {loader_epoch!r:.80}")
            self.set_epoch(loader_epoch)
        self._progress = None
        self._resume = resume if resume.started else None
        self._resume_raw = copy.deepcopy(state)

    def _take_resume(self) -> Resume | None:
        """The loaded state, for the iterator starting now (used once)."""
        resume, self._resume, self._resume_raw = self._resume, None, None
        return resume

    # -- public extras --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler and the dataset (and to persistent workers)."""
        self._epoch = epoch
        for target in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler",
                                                                 None), self.dataset):
            setter = getattr(target, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def stats(self) -> dict:
        """Pool statistics and where the time goes (see README, "Statistics")."""
        pool = self._pool.stats() if self._pool is not None else {}
        c = self._stats.counters
        elapsed = time.perf_counter() - self._stats.started
        busy = dict(self._stats.worker_busy_s)
        return {
            **pool,
            "batches": c["batches"], "samples": c["samples"], "bytes_moved": c["bytes"],
            "skipped": c["skipped"], "wait_s": c["wait_s"], "consumer_s": c["consumer_s"],
            "worker_busy_s": busy,
            "worker_busy_fraction": {w: b / elapsed for w, b in busy.items()} if elapsed else {},
            "elapsed_s": elapsed,
        }

    def reset_stats(self) -> None:
        """Start the time and traffic figures of `stats()`/`report()` afresh (pool figures stay)."""
        self._stats.reset()

    def report(self) -> str:
        """One paragraph saying whether the loader or the training step is the bottleneck."""
        s = self.stats()
        wait_s, consumer_s = s["wait_s"], s["consumer_s"]
        total = wait_s + consumer_s
        if not s["batches"] or total <= 0:
            return "PooledLoader: no batches yet."
        share = wait_s / total
        verdict = ("the LOADER is the bottleneck: the training loop waited for data "
                   f"{share:.0%} of the time; add workers, use a cache, or lighten the transform"
                   if share > BOTTLENECK_WAIT_SHARE else
                   f"the TRAINING STEP is the bottleneck: it waited for data only {share:.0%} "
                   "of the time; the loader keeps up")
        busy = ", ".join(f"worker {w}: {f:.0%}" for w, f in
                         sorted(s["worker_busy_fraction"].items()))
        return (f"PooledLoader: {s['batches']} batches, {s['samples']} samples, "
                f"{s['bytes_moved'] / 1e9:.2f} GB; waited {wait_s:.2f}s, the loop ran "
                f"{consumer_s:.2f}s: {verdict}. Worker busy: {busy or 'n/a'}. Pool: "
                f"{s.get('slots')} slots, {s.get('slots_in_use')} in use, grown "
                f"{s.get('grown')} times; skipped samples: {s['skipped']}.")

    def close(self) -> None:
        """Stop persistent workers now (they also stop when the loader is garbage collected).
        Batches still held stay valid; the pool's memory goes when the last one is dropped."""
        iterator, self._iterator = self._iterator, None
        stop = getattr(iterator, "_stop", None)
        if stop is not None:
            stop()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- iterator plumbing ---------------------------------------------------------------------
    def _default_slots(self) -> int:
        if self.pool_slots is not None:
            return self.pool_slots
        return default_pool_slots(self.num_workers, self.prefetch_factor)

    def _get_pool(self) -> SlotPool:
        if self._pool is None:
            self._pool = SlotPool(FIRST_SLOT_BYTES, self._default_slots(), GROW_WARNING)
        return self._pool

    def _pooled_collate(self) -> Callable | None:
        """None when the collate function is torch's default (we then collate into the slot)."""
        if self.collate_fn is default_collate or self.collate_fn is default_convert:
            return None
        return self.collate_fn

    def _get_iterator(self) -> Iterator:
        if self.num_workers == 0:
            it: Iterator = _InProcessIter(self)
        else:
            self.check_worker_number_rationality()
            it = _WorkerIter(self)
        on_cuda = self.device is not None and self.device.type == "cuda"
        if on_cuda or self.pin_memory and torch.cuda.is_available():
            from .cuda import DeviceIter, backend_for, pin_pool
            backend = backend_for(self)
            pin_pool(self._pool, backend)  # after forking the workers: see pooled_loader.cuda
            if on_cuda:
                depth = self.prefetch_factor or DEFAULT_PREFETCH_FACTOR
                return _HandedOut(DeviceIter(it, self.device, depth=depth,
                                             transform=self.device_transform, backend=backend),
                                  it)
        if self.device_transform is not None:
            return _HostTransformIter(it, self.device_transform)
        return it


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


class _HostTransformIter:
    """device_transform without a CUDA device: applied on the host after each batch."""

    def __init__(self, base: Iterator, transform: Callable) -> None:
        self.base, self.transform = base, transform

    def __iter__(self) -> "_HostTransformIter":
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


class _IterBase:
    """What both iterators share: turning done-messages into batches, and bookkeeping."""

    def __init__(self, loader: PooledLoader) -> None:
        install_interrupt_guard()
        self._pool = loader._get_pool()
        self._stats = loader._stats
        self._iterable = isinstance(loader.dataset, IterableDataset)
        self._index_sampler = loader._index_sampler
        self._last_yield: float | None = None
        self._dataset = loader.dataset
        self._num_workers = loader.num_workers
        self._reset_length_check(loader)
        # A datapipe's shared seed, then the sampler, then the base seed, as DataLoader does
        # (even without workers), so a seeded generator gives DataLoader's exact shuffle order.
        self._datapipe_group = None
        if isinstance(loader.dataset, IterDataPipe) and dist.is_available() \
                and dist.is_initialized():
            self._datapipe_group = dist.new_group(backend="gloo")
        self._shared_seed = self._seed_datapipe(loader)
        self._cursor = None if self._iterable else SamplerCursor(self._index_sampler)
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
        DataLoader does (even without workers), so a seeded generator gives its exact order."""
        resume = loader._take_resume()
        if resume is not None and resume.finished:
            resume = None  # the saved epoch had ended: this is a fresh full epoch
        if resume is not None:
            self._seed, self._seed_epoch = resume.base_seed, resume.epoch
            self._sampler_iter = None if self._iterable else self._cursor.restore(
                resume.sampler_state, resume.sampler_skip)
        else:
            self._sampler_iter = None if self._iterable else iter(self._index_sampler)
            if first:
                self._seed = _base_seed(loader)
            else:
                self._seed_epoch += 1
        self._progress = Progress.starting(
            iterable=self._iterable, num_workers=loader.num_workers, base_seed=self._seed,
            epoch=self._seed_epoch, snapshot_every=loader.snapshot_every_n_steps, resume=resume)
        self._progress.deferred = getattr(self, "_deferred", False)
        self._position = self._progress.delivered_prefix  # the next task's place in the epoch
        self._peeked: tuple[int, Any] | None = None
        if not self._iterable:
            self._progress.prime = weakref.WeakMethod(self._prime_sampler)
        loader._progress = self._progress
        return resume

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
        lease = self._pool.lease(layout.ref)
        base = lease.array()
        del lease
        arrays = []
        nbytes = 0
        for leaf, off in layout.leaves:
            raw = base[off:off + leaf.nbytes]
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
        self._last_yield = now

    def _epoch_done(self) -> None:
        self._pool.mark_warm()
        self._last_yield = None


def _worker_config(loader: PooledLoader, iterable: bool, seed: int, *,
                   worker_init_fn: Callable | None, start_method: str) -> WorkerConfig:
    return WorkerConfig(dataset=loader.dataset, iterable=iterable,
                        auto_collation=loader._auto_collation, batch_size=loader.batch_size,
                        drop_last=loader.drop_last, collate_fn=loader._pooled_collate(),
                        worker_init_fn=worker_init_fn, num_workers=loader.num_workers,
                        base_seed=seed, on_error=loader.on_error, start_method=start_method,
                        per_sample_seed=loader.per_sample_seed,
                        snapshot_every=loader.snapshot_every_n_steps)


class _InProcessIter(_IterBase):
    """num_workers=0: the same data path, run in the main process."""

    def __init__(self, loader: PooledLoader) -> None:
        super().__init__(loader)
        pool = self._pool

        def request_slot(task_id: int, nbytes: int, old: SlotRef) -> SlotRef:
            pool.release(old)
            return pool.acquire(nbytes)

        cfg = _worker_config(loader, self._iterable, self._seed, worker_init_fn=None,
                             start_method="none")
        if isinstance(loader.dataset, (IterDataPipe, MapDataPipe)):  # shard by rank, as DataLoader
            world_size, rank = torch_dataloader._get_distributed_settings()
            apply_sharding(loader.dataset, world_size, rank)
        self._maker = BatchMaker(cfg, ArenaMap(), request_slot)
        self._maker.reset_iterator(self._progress.resume_stream(0))
        self._task = 0

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
        ref = self._pool.acquire()
        try:
            result = self._maker.make(self._task, payload, ref, self._seed_epoch)
        except SampleFailure as failure:
            self._pool.release(ref)
            raise failure.__cause__ from None
        except BaseException:
            self._pool.release(ref)
            raise
        finally:
            self._stats.record_skips(self._maker.skipped)
        self._task += 1
        if result is None:
            self._pool.release(ref)
            self._progress.delivered_end(0)
            self._progress.finish()
            self._epoch_done()
            raise StopIteration
        batch = self._build(result)
        if self._iterable:
            self._progress.delivered_batch(0, self._maker.position)
        else:
            self._progress.delivered_task(position)
        self._mark_wait(started)
        self._check_length()
        return batch


class _WorkerIter(_IterBase):
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
        self._cfg.resume_streams = self._progress.resume_streams()
        self._epoch = 0
        self._start_workers()

    # -- workers -----------------------------------------------------------------------------
    def _start_workers(self) -> None:
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
        self._broken = False
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
        self._begin_epoch(loader, first=False)
        streams = self._progress.resume_streams()
        self._cfg.resume_streams = streams
        # Workers seeded from another base seed would not give the saved epoch's randomness.
        self._cfg.base_seed = self._seed
        if (self._broken or any(not p.is_alive() for p in self._workers)
                or self._seed != seed_before):
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
            if self._iterable:
                w.conn.send(Reset(shared_seed=self._shared_seed,
                                  stream=(streams or {}).get(w.id)))

    # -- dispatch and receive --------------------------------------------------------------------
    def _try_dispatch(self) -> None:
        """DataLoader's dispatch: at most prefetch_factor * num_workers batches in flight or
        waiting, workers in turn; with in_order=False a worker already holding its share
        (in flight / active workers) is passed over, so a slow one does not gather tasks."""
        limit = self._prefetch * self._num_workers
        while not self._sampler_done and len(self._tasks) + len(self._ready) < limit:
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
                                      ref=ref, seed_epoch=self._seed_epoch))
            except (BrokenPipeError, ConnectionResetError):  # it died: say how, not EPIPE
                self._worker_died(worker)

    def _handle(self, worker: _Worker, msg: Done | End | Failed | NeedSlot) -> None:
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
                    self._progress.delivered_task(position)
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
