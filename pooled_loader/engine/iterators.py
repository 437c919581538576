"""The iterators behind ``PooledLoader``: one epoch's walk over the sampler, batches handed out
as zero-copy views of pool slots. Each takes what it needs of its loader as one `epoch.EpochSpec`
(and hands the epoch's position back through it); none holds the loader.

- ``_IterBase``: what both iterators share (the sampler, the position, seeds, building batches).
- ``InProcessIter`` (``num_workers=0``) runs ``worker.BatchMaker`` in this process: the very data
  path the workers run, without processes.
- ``worker_iter.WorkerIter`` (``num_workers > 0``) runs it in worker processes.
- ``HostTransformIter`` applies ``device_transform`` on the host when there is no CUDA device.

Every iterator the loader hands out has the same lifecycle (``Stage`` forwards it through a
wrapper): ``_reset(spec)`` starts the next epoch on persistent workers, ``_stop()`` stops the
workers (nothing in process), ``_workers`` lists the worker processes.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, IterDataPipe, MapDataPipe
from torch.utils.data import dataloader as torch_dataloader
from torch.utils.data.graph_settings import apply_sharding

from ..core.constants import SMALL_BATCH_BYTES, SMALL_LEAF_BYTES, SMALL_LEAF_SHARE
from .epoch import EpochSpec
from .interrupts import install_interrupt_guard
from .layout import as_type, unflatten
from .messages import BatchLayout, Restore
from .pool import ArenaMap, SlotRef
from .position import EpochPosition, Resume, SamplerCursor
from .skip_budget import EpochSkips
from ..core.seeds import rng_fingerprint
from ..core.stateful import follows_stateful
from .slot_collate import Collated
from .worker import BatchMaker, SampleFailure, WorkerConfig, seed_datapipe


class Stage(torch_dataloader._BaseDataLoaderIter):
    """An iterator around the epoch's iterator `inner` (or around another stage): forwards the
    lifecycle every iterator of the loader has. Subclasses define `__next__`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self) -> "Stage":
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def _reset(self, spec: EpochSpec) -> None:
        self.inner._reset(spec)

    def _stop(self) -> None:
        self.inner._stop()

    @property
    def _workers(self) -> list:
        return self.inner._workers


class HandedOut(Stage):
    """Around a stage that prefetches batches from the epoch's iterator `base`
    (cuda.DeviceIter): a batch counts as delivered for `state_dict()` only when this hands it
    to the training loop."""

    def __init__(self, stage: Stage, base: "_IterBase") -> None:
        super().__init__(stage)
        self.base = base
        base.defer_delivery()

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.base.commit_delivery(everything=True)
            raise
        self.base.commit_delivery()
        return batch


class HostTransformIter(Stage):
    """device_transform without a CUDA device: applied on the host after each batch."""

    def __init__(self, base: Iterator, transform: Callable) -> None:
        super().__init__(base)
        self.transform = transform

    def __next__(self) -> Any:
        return self.transform(next(self.inner))


class RestOrNext(Stage):
    """The first epoch after `load_state_dict` of a mid-epoch state then `set_epoch` of another
    epoch (ours, or the sampler's own: `Resume.moves_on`): the rest of the saved epoch; if
    nothing of it was left (saved inside its last step, as verl and many trainers save, then
    restarted at the next epoch), `start_next()` starts the epoch set, from the saved one's end
    (its sampler pass and datasets' end states)."""

    def __init__(self, it: Iterator, start_next: Callable[[], Iterator]) -> None:
        super().__init__(it)
        self.start_next, self.fresh = start_next, True

    def __next__(self) -> Any:
        fresh, self.fresh = self.fresh, False
        try:
            return next(self.inner)
        except StopIteration:
            if not fresh:
                raise
        self.inner = self.start_next()
        return next(self.inner)


def _restore_dataset_first(dataset: Any, restore: dict[int, Restore]) -> None:
    """With 0 workers, load the dataset's end-of-epoch state before the next epoch draws its
    base seed, as the uninterrupted run kept it: a dataset whose state is torch's RNG then sees
    the same draws. Its restore then loads nothing more of it."""
    mine = restore.get(0)
    if mine is not None and mine.dataset_state is not None and follows_stateful(dataset):
        dataset.load_state_dict(mine.dataset_state)
        restore[0] = dataclasses.replace(mine, dataset_state=None)


def _base_seed(spec: EpochSpec) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=spec.generator).item())


class _IterBase(torch_dataloader._BaseDataLoaderIter):
    """What both iterators share: turning done-messages into batches, and bookkeeping.

    A `_BaseDataLoaderIter` by type only (its __init__ is not run), for tools that recognise
    DataLoader iterators that way, e.g. Lightning's CombinedLoader when it is pickled."""

    _workers: list = []  # the worker processes (none in process)

    def __init__(self, spec: EpochSpec) -> None:
        install_interrupt_guard()
        self._deferred = False  # a prefetching stage hands batches out (`defer_delivery`)
        self._pool = spec.pool
        self._stats = spec.stats
        self._iterable = isinstance(spec.dataset, IterableDataset)
        self._index_sampler = spec.index_sampler
        self._last_yield: float | None = None
        self._dataset = spec.dataset
        self._num_workers = spec.num_workers
        # Small leaves are copied out of their slot at hand-out (see _build), except from a
        # pinned pool (the whole batch stays pinned) and for the ragged helpers, whose
        # per-sample views of the slot are what they promise.
        self._small_copied = not (spec.pinned or spec.ragged)
        self._reset_length_check(spec)
        # A datapipe's shared seed, then the sampler, then the base seed, as DataLoader does
        # (even without workers), so a seeded generator gives DataLoader's exact shuffle order.
        self._datapipe_group = None
        if isinstance(spec.dataset, IterDataPipe) and dist.is_available() \
                and dist.is_initialized():
            self._datapipe_group = dist.new_group(backend="gloo")
        self._shared_seed = self._seed_datapipe(spec)
        self._cursor = None if self._iterable else SamplerCursor(self._index_sampler)
        # distributed=True with per_sample_seed: samples are seeded from the sampler's seed and
        # epoch, the same on every rank and world size (an elastic resume is bit-identical)
        self._elastic = spec.elastic if spec.per_sample_seed else None
        self._seed = 0
        self._seed_epoch = 0
        self._begin_epoch(spec, first=True)
        if spec.pin_memory and spec.pin_memory_device:
            warnings.warn("pin_memory_device is deprecated, the current accelerator will be used "
                          f"as the device,ignore pin_memory_device='{spec.pin_memory_device}'.",
                          stacklevel=3)  # torch's words, missing space included
        if spec.pin_memory and not torch.cuda.is_available():
            warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                          "then device pinned memory won't be used.", stacklevel=3)

    def __iter__(self) -> "_IterBase":
        return self

    def _reset(self, spec: EpochSpec) -> None:
        """The next epoch on these workers (only persistent workers are reset)."""
        raise NotImplementedError(f"{type(self).__name__} runs one epoch")

    def _stop(self) -> None:
        """Stop the workers, if any (idempotent)."""

    def defer_delivery(self) -> None:
        """A stage after this iterator prefetches: a batch counts as delivered only at
        `commit_delivery()`, when that stage hands it to the training loop."""
        self._deferred = self._epoch_position.deferred = True

    def commit_delivery(self, everything: bool = False) -> None:
        """The stage after this iterator handed out one more batch (or all, at its end)."""
        self._epoch_position.commit(everything)

    def _seed_datapipe(self, spec: EpochSpec) -> int | None:
        """A new shared seed for a datapipe graph (broadcast from rank 0), applied here; workers
        apply it to their copies. None for other datasets."""
        if not isinstance(spec.dataset, IterDataPipe):
            return None
        seed = torch_dataloader._share_dist_seed(spec.generator, self._datapipe_group)
        seed_datapipe(spec.dataset, seed)
        return seed

    def __getstate__(self) -> Any:
        raise NotImplementedError("{} cannot be pickled", self.__class__.__name__)  # as torch's

    def _reset_length_check(self, spec: EpochSpec) -> None:
        """DataLoader remembers len(dataset) if len(loader) was asked for (an iterable dataset's
        `__len__`), and warns on every batch beyond it."""
        self._num_yielded = 0
        self._len_called = spec.len_called

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

    def _begin_epoch(self, spec: EpochSpec, first: bool) -> Resume | None:
        """Start the sampler and the position of an epoch, from a loaded state if there is one
        (returned). Without one: the sampler first, then (first epoch) the base seed, as
        DataLoader does (even without workers), so a seeded generator gives its exact order.

        With one, as StatefulDataLoader: a loaded state makes a new iterator, which draws a base
        seed (discarded for the saved one) before the sampler starts, so a sampler drawing from
        torch's global RNG after `torch.manual_seed` takes the seed it took in the saved run;
        but not when that RNG is as it was when the state was saved (the script restored it,
        docs/resume.md): the uninterrupted run drew nothing more there, nor does the resume. A
        state saved at an epoch's end replays that epoch's sampler pass to its end (a generator
        moves on as it did), keeps the datasets' end states where DataLoader keeps datasets
        between epochs (in this process with 0 workers; in persistent workers), and starts the
        next epoch."""
        resume = spec.resume
        if resume is not None and resume.rng_check != rng_fingerprint(spec.generator):
            _base_seed(spec)
        persistent = self._num_workers > 0 and spec.persistent_workers
        restore = None
        if resume is not None and not resume.finished:
            self._seed, self._seed_epoch = resume.base_seed, resume.seed_epoch
            self._sampler_iter = None if self._iterable else self._cursor.restore(
                resume.sampler_state, resume.sampler_skip)
            restore = resume.restores()
        else:
            if resume is not None:  # saved at the end of its epoch
                if not self._iterable:
                    self._cursor.run_out(resume.sampler_state, resume.sampler_skip)
                if persistent or self._num_workers == 0:
                    restore = resume.restores(new_epoch=True, set_epoch=spec.loader_epoch)
                if self._num_workers == 0:  # this process's dataset, before the seed is drawn
                    _restore_dataset_first(spec.dataset, restore)
            self._sampler_iter = None if self._iterable else iter(self._index_sampler)
            if resume is not None and persistent:
                self._seed, self._seed_epoch = resume.base_seed, resume.seed_epoch + 1
            elif first or resume is not None:
                self._seed, self._seed_epoch = _base_seed(spec), 0
            else:
                self._seed_epoch += 1
        position = EpochPosition.starting(
            iterable=self._iterable, num_workers=spec.num_workers, base_seed=self._seed,
            seed_epoch=self._seed_epoch, snapshot_every=spec.snapshot_every,
            resume=None if resume is None or resume.finished else resume, restore=restore)
        position.deferred = self._deferred
        position.prepare = weakref.WeakMethod(self._prepare_state)
        self._skips = EpochSkips(spec.max_skip_fraction, self._epoch_samples(spec))
        self._epoch_position = position
        self._next_place = position.delivered_prefix  # the next task's place in the epoch
        self._peeked: tuple[int, Any] | None = None
        spec.publish(position)
        return resume

    def _epoch_samples(self, spec: EpochSpec) -> int | None:
        """The samples of a map-style epoch (for the skip budget), None when unknown."""
        if self._iterable:
            return None
        try:
            return len(self._index_sampler) * (spec.batch_size if spec.auto_collation else 1)
        except TypeError:
            return None

    def _count_skips(self, skipped: list, samples: int) -> None:
        """The skip budget, at each delivered batch (`skip_budget.EpochSkips`)."""
        if skipped or self._skips.fraction is not None:
            self._skips.add(skipped, samples)

    def _sample_epoch(self) -> int:
        """The epoch per-sample seeds are drawn for."""
        return self._elastic.epoch if self._elastic is not None else self._seed_epoch

    def _prepare_state(self) -> None:
        """Before a state is taken: start the sampler's pass (see `_prime_sampler`)."""
        if not self._iterable and self._epoch_position.sampler_snapshot == (0, None):
            self._prime_sampler()

    def _prime_sampler(self) -> None:
        """Asked for a state before the first task: draw the first indices now, so that the
        sampler's pass has started and its state (a shuffle's seed) can be saved. Harmless to the
        order: the base seed is already drawn, as it would be before the first batch."""
        if self._peeked is None and self._next_place == 0 and self._sampler_iter is not None:
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
        epoch = self._epoch_position
        while True:
            place = self._next_place
            epoch.dispatching(place, self._cursor, self._sampler_iter)
            payload = next(self._sampler_iter)
            epoch.dispatched(place, self._cursor, self._sampler_iter)
            self._next_place += 1
            if place not in epoch.delivered_ahead:
                return place, payload

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
        # Kept labels must not keep the slot of the images (docs/loader.md, "Kept batches are safe")
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
                arrays.append(as_type(torch.from_numpy(raw).view(getattr(torch, leaf.dtype))
                                      .view(leaf.shape), leaf.cls))
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


def worker_config(spec: EpochSpec, iterable: bool, seed: int, *,
                  worker_init_fn: Callable | None, start_method: str,
                  restores: dict[int, Restore] | None, generation: int = 0,
                  shared_seed: int | None = None, watch: Any = None) -> WorkerConfig:
    """The workers' configuration for one start (the in-process maker's too: start_method
    "none"), built once."""
    elastic = spec.elastic if spec.per_sample_seed else None
    return WorkerConfig(dataset=spec.dataset, iterable=iterable,
                        auto_collation=spec.auto_collation, batch_size=spec.batch_size,
                        drop_last=spec.drop_last, collate_fn=spec.collate_fn, ragged=spec.ragged,
                        worker_init_fn=worker_init_fn, num_workers=spec.num_workers,
                        base_seed=seed, on_error=spec.on_error, start_method=start_method,
                        per_sample_seed=spec.per_sample_seed,
                        sample_base=None if elastic is None else elastic.seed,
                        snapshot_every=spec.snapshot_every, restores=restores,
                        generation=generation, shared_seed=shared_seed, watch=watch,
                        max_consecutive_skips=spec.max_consecutive_skips,
                        # in process, a batch already built in memory (a custom collate's, a
                        # `__getitems__` batch's stacks) needs no slot unless the pool is pinned
                        # for a device copy; the ragged helpers write into a slot themselves
                        pass_collated=start_method == "none" and not spec.pinned
                        and not spec.ragged)


class InProcessIter(_IterBase):
    """num_workers=0: the same data path, run in the main process."""

    def __init__(self, spec: EpochSpec) -> None:
        super().__init__(spec)
        pool = self._pool

        def request_slot(task_id: int, nbytes: int, old: SlotRef) -> SlotRef:
            pool.release(old)
            return pool.acquire(nbytes)

        cfg = worker_config(spec, self._iterable, self._seed, worker_init_fn=None,
                            start_method="none", restores=None)
        if isinstance(spec.dataset, (IterDataPipe, MapDataPipe)):  # shard by rank, as DataLoader
            world_size, rank = torch_dataloader._get_distributed_settings()
            apply_sharding(spec.dataset, world_size, rank)
        self._maker = BatchMaker(cfg, ArenaMap(), request_slot)
        self._maker.reset_iterator(self._epoch_position.resume_stream(0))
        self._epoch_position.stream_started(0, self._maker.snapshot(), self._maker.items)
        self._task = 0

    def _prepare_state(self) -> None:
        """Before a state is taken: as the base class, then, before the first batch, the
        dataset's state again: priming the sampler may have drawn from torch's RNG (a shuffle's
        seed), which the dataset, in this process, draws from after it."""
        super()._prepare_state()
        if self._task == 0 and self._epoch_position.num_yielded == 0:
            self._epoch_position.stream_started(0, self._maker.snapshot(), self._maker.items)

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
                self._epoch_position.finish()
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
            self._epoch_position.delivered_end(0, self._maker.end_position())
            self._epoch_position.finish()
            self._epoch_done()
            raise StopIteration
        self._stats.record_batch(0, self._maker.stages, result.num_samples,
                                 time.perf_counter() - built, self._maker.spans, track=0)
        batch = self._build(result) if type(result) is not Collated else self._count(result)
        self._count_skips(self._maker.skipped, result.num_samples)
        if self._iterable:
            self._epoch_position.delivered_batch(0, self._maker.position)
        else:
            self._epoch_position.delivered_task(position, 0, self._maker.position)
        self._mark_wait(started)
        self._check_length()
        return batch
