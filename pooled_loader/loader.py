"""`PooledLoader`: torch's DataLoader, with batches built by workers straight into recycled
shared-memory slots.

It subclasses `torch.utils.data.DataLoader`, so construction, argument checks, samplers, `len()`
and `isinstance(loader, DataLoader)` are exactly torch's; only the iterator is ours.

The loader holds the arguments, the pool and the statistics; the iterators that run an epoch are
in ``engine/iterators.py`` (in-process) and ``engine/worker_iter.py`` (worker processes), and take
what they need as one frozen `engine.epoch.EpochSpec`, handing back the epoch's
`engine.position.EpochPosition`; ``resume/state.py`` turns that into a state and back; the
figures of ``stats()``/``report()`` are in ``observability/stats.py``.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Generic, Iterator, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.collate import default_collate, default_convert

from .core.constants import DEFAULT_PREFETCH_FACTOR, FIRST_SLOT_BYTES, default_pool_slots
from .core.errors import StateMismatch
from .core.hooks import hooks_of
from .core.seeds import rng_fingerprint
from .core.state_checks import StateChecks
from .engine.epoch import EpochSpec
from .engine.failover import Failover
from .engine.iterators import HandedOut, HostTransformIter, InProcessIter, RestOrNext
from .engine.pool import SlotPool
from .engine.position import EpochPosition, Resume, WorkerStream, epoch_sampler
from .engine.sampler import ResumableRandomSampler
from .engine.skip_budget import DEFAULT_MAX_CONSECUTIVE_SKIPS, DEFAULT_MAX_SKIP_FRACTION
from .engine.worker_iter import WorkerIter
from .observability.stats import LoaderStats, report_text
from .observability.trace import DEFAULT_TRACE_BATCHES, TraceRecorder
from .ragged.collate import RaggedCollate
from .resume.keys import ELASTIC, LOADER_EPOCH, POOLED
from .resume.state import Limits, build_state, check_sampler_state, parse
from .resume.yielded import honour_adjustment

T_co = TypeVar("T_co", covariant=True)

GROW_WARNING = (
    "PooledLoader: every slot of the pool is in use ({slots} slots): batches are being kept "
    "(or not yet freed) by the training loop, so the pool grows. Nothing is overwritten; to size "
    "the pool up front, pass pool_slots= (num_workers * prefetch_factor + batches you keep).")


def _maybe_folder(dataset: Any) -> bool:
    """Whether ``dataset`` may be a folder dataset the fused image path reads (a torchvision
    or pooled_loader ImageFolder), checked without importing either."""
    return any(c.__module__.startswith(("torchvision.datasets", "pooled_loader.vision"))
               for c in type(dataset).__mro__)


def _check_failure_options(restarts: Any, timeout: Any, fraction: Any, consecutive: Any) -> None:
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if not (isinstance(restarts, int) and not isinstance(restarts, bool) and restarts >= 0):
        raise ValueError(f"max_worker_restarts must be a non-negative integer, got {restarts!r}")
    if not number(timeout) or not timeout >= 0:
        raise ValueError(f"worker_timeout must be a non-negative number of seconds (0: no "
                         f"watchdog), got {timeout!r}")
    if fraction is not None and (not number(fraction) or not 0 <= fraction <= 1):
        raise ValueError(f"max_skip_fraction must be None or a number in [0, 1], got {fraction!r}")
    if consecutive is not None and not (isinstance(consecutive, int)
                                        and not isinstance(consecutive, bool) and consecutive >= 0):
        raise ValueError("max_consecutive_skips must be None or a non-negative integer, got "
                         f"{consecutive!r}")


_STATE = StateChecks("PooledLoader.load_state_dict: the state")
_MERGED = StateChecks("PooledLoader.load_state_dict: the merged state")


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
        trace: a path: keep the spans of the last `trace_batches` batches (every sample's stages
            in every worker, the main process's waits) and write them there as a Chrome trace
            (Perfetto, chrome://tracing) at the end of every epoch and at `close()`. See also
            `trace()` and `pooled_loader.observability.trace`.

        max_worker_restarts: replace a worker process that dies (any signal, the OOM killer, a
            segfault) or hangs (see `worker_timeout`) up to this many times in the loader's life:
            the new worker builds again the batches the old one owed, from the same indices and
            seeds, so the batches are the uninterrupted run's (bit-identical with
            `per_sample_seed=True`); one warning per replacement, counted in
            `stats()["worker_replacements"]`. Past it, the loader raises naming them all.
            Default 0: a dead worker ends the run, as in DataLoader (docs/failures.md).
        worker_timeout: seconds a worker may work on one batch without answering; then its stack
            and the sample and file it is on are logged and it is killed (replaced under
            `max_worker_restarts`, else a `WorkerError` says why). 0 (default): no watchdog.
        max_skip_fraction, max_consecutive_skips: the budget of `on_error="skip"`: past this
            fraction of an epoch's samples (judged after 32 skips) or this many samples in a row
            whose load failed, the loader raises `SkipBudgetExceeded` naming the last ones.
            Defaults 0.1 and 32; None: no bound.

    `state_dict()`/`load_state_dict()` checkpoint the position mid-epoch (docs/resume.md).
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
                 per_sample_seed: bool = False, trace: str | None = None,
                 trace_batches: int = DEFAULT_TRACE_BATCHES,
                 accelerate_transforms: bool = True, max_worker_restarts: int = 0,
                 worker_timeout: float = 0,
                 max_skip_fraction: float | None = DEFAULT_MAX_SKIP_FRACTION,
                 max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS) -> None:
        _check_failure_options(max_worker_restarts, worker_timeout, max_skip_fraction,
                               max_consecutive_skips)
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
        # e.g. mix.Mix: blocks of the loader's batch size, whatever num_workers
        hooks_of(dataset).pooled_batch_size(self.batch_size)
        # Checked at the first iter(): accelerate and Lightning replace the sampler after this.
        self._check_undistributed = bool(shuffle_requested) and not distributed
        self._starved_checked = False  # warn_if_starved, at the first iter()
        self._replay_watch: Any = None  # replay_watch.ReplayWatch, after a load
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
        self.trace_path, self.trace_batches = trace, trace_batches
        if trace is not None:
            self._stats.trace = TraceRecorder(trace, trace_batches)
        self._epoch: int | None = None  # the last set_epoch()
        self.snapshot_every_n_steps = snapshot_every_n_steps or 0
        self.per_sample_seed = bool(per_sample_seed)
        # a torchvision ImageFolder + Compose run on the fused image path (docs/vision.md)
        self.accelerate_transforms = bool(accelerate_transforms)
        self._fused: Any = None  # the FusedFolder of the latest epoch, or None
        self._fused_line: str | None = None  # the line logged about it
        self._epoch_position: EpochPosition | None = None  # the latest epoch's (kept after it)
        self._pass_epoch: int | None = None  # the sampler's own epoch when that epoch began
        self._resume: Resume | None = None  # loaded, for the next iter()
        self._resume_raw: dict | None = None
        self._state_iterator: Iterator | None = None  # made by state_dict() before any iter()
        # docs/failures.md: dead or hung workers replaced, hangs named, the skip budget
        self._failover = Failover(max_worker_restarts)
        self.max_worker_restarts = max_worker_restarts
        self.worker_timeout = float(worker_timeout)
        self.max_skip_fraction = max_skip_fraction
        self.max_consecutive_skips = max_consecutive_skips

    # -- checkpoint and resume ------------------------------------------------------------------
    def _state_check(self) -> dict:
        """What a saved state must agree with (docs/resume.md)."""
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

    def _state_limits(self) -> Limits:
        def length(obj: Any) -> int | None:
            try:
                return len(obj)
            except (TypeError, NotImplementedError):
                return None
        iterable = isinstance(self.dataset, IterableDataset)
        return Limits(index_len=None if iterable else length(self._index_sampler),
                      dataset_len=length(self.dataset) if iterable else None,
                      batch_size=self.batch_size if self._auto_collation else 1,
                      num_workers=self.num_workers)

    def state_dict(self) -> dict:
        """The position after the last batch handed to the training loop (not what workers have
        prefetched), as plain JSON-serialisable data (as long as your sampler's and dataset's own
        `state_dict` are). Cheap: no worker is asked at this point.

        Before the first `iter()`, as StatefulDataLoader does, the iterator that `iter()` will
        return is made now (its base seed drawn, its sampler's pass and its workers started), so
        the state records the shuffle and seeds of the epoch that follows."""
        if self._epoch_position is None and self._resume_raw is None:
            self._state_iterator = self._get_iterator()
            if self.persistent_workers and self.num_workers > 0:
                self._iterator = self._state_iterator
        if self._epoch_position is None:
            return copy.deepcopy(self._resume_raw)
        elastic = self._elastic_sampler()
        return build_state(self._epoch_position, self._state_check(),
                           loader_epoch=self._epoch, rng_check=rng_fingerprint(self.generator),
                           sampler_epoch=self._pass_epoch,
                           elastic=None if elastic is None else {
                               "epoch": elastic.epoch, "seed": elastic.seed,
                               "shuffle": elastic.shuffle, "plan": elastic.plan})

    def _elastic_sampler(self) -> Any:
        from .resume.elastic import ElasticDistributedSampler
        for part in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if isinstance(part, ElasticDistributedSampler):
                return part
        return None

    def _load_elastic(self, state: dict, sampler: Any) -> bool:
        """A merged state (`elastic.merge_rank_states`), or one rank's state from another world
        size or rank: the rest of its epoch, re-dealt to this rank of this world size. False
        when `state` is this rank's own state (the exact path)."""
        from .resume.elastic import check_merged, is_merged, merge_rank_states, plan_from
        if not is_merged(state):
            pooled = state.get(POOLED) if isinstance(state, dict) else None
            if not isinstance(pooled, dict) or (pooled.get("world_size"), pooled.get("rank")) \
                    == (sampler.num_replicas, sampler.rank):
                return False
            state = merge_rank_states([state], lockstep=True)
        mine = {"dataset_len": len(self.dataset), "seed": sampler.seed,
                "shuffle": sampler.shuffle, "drop_last": self.drop_last,
                "per_sample_seed": self.per_sample_seed}
        check_merged(state, mine)
        epoch = _MERGED.count(state, "epoch")
        sampler.set_plan(None if state.get("finished") else plan_from(state))
        self.set_epoch(epoch)
        self._epoch_position = self._resume = self._resume_raw = None
        return True

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` continue from `state` (from `state_dict()`, possibly through a
        JSON or torch.save round trip). Raises ValueError (`resume.StateMismatch`) naming what
        differs when the state does not fit this loader, or the key and what is wrong when it is
        corrupt."""
        self._drop_state_iterator()
        if state == {}:  # torchdata's convention: nothing to restore
            self._resume = self._resume_raw = None
            return
        from .resume.sdl_compat import from_sdl, is_sdl_state
        if is_sdl_state(state):  # a torchdata StatefulDataLoader checkpoint
            state = from_sdl(state, self)
        from .resume.elastic import is_merged
        if is_merged(state) and state.get("iterable"):
            self._load_merged_streams(state)
            return
        state = honour_adjustment(state)  # counts lowered by accelerate (see yielded.py)
        elastic = self._elastic_sampler()
        if elastic is not None and self._load_elastic(state, elastic):
            return
        resume = parse(state, self._state_check(), self._state_limits())
        if not isinstance(self.dataset, IterableDataset):
            check_sampler_state(self._index_sampler, resume.sampler_state)
        # e.g. mix.Mix: checks its states here and takes their weights
        hooks_of(self.dataset).pooled_check_states(
            [s.dataset_state for s in resume.streams.values()])
        if state[POOLED].get(LOADER_EPOCH) is not None:
            self.set_epoch(_STATE.count(state, f"{POOLED}.{LOADER_EPOCH}"))
        if elastic is not None:  # a resumed epoch's plan (elastic), then the count inside it
            from .resume.elastic import check_plan
            plan = (state[POOLED].get(ELASTIC) or {}).get("plan")
            check_plan(plan, len(self.dataset))
            elastic.set_plan(plan)
        self._epoch_position = None
        self._resume = resume if resume.started else None
        self._resume_raw = copy.deepcopy(state)
        from .resume.replay_watch import ReplayWatch  # HF datasets replay a loaded state (see there)
        self._replay_watch = ReplayWatch.after_load(
            self.dataset, self.num_workers == 0 or self.persistent_workers,
            any(s.dataset_state is not None for s in resume.streams.values()))

    def _load_merged_streams(self, state: dict) -> None:
        """A merged iterable state (WebDataset shards): every worker of this rank loads the same
        merged dataset state and takes its own share of the rest of the epoch."""
        if not isinstance(self.dataset, IterableDataset) or not callable(
                getattr(self.dataset, "load_state_dict", None)):
            raise StateMismatch("PooledLoader.load_state_dict: a merged stream state needs an "
                                "iterable dataset that loads it (pooled_loader.webdataset)")
        merged = state.get("dataset_state")
        # Validated here, in the main process, on a copy: the dataset itself must not keep it
        # as pending (every later epoch's workers would inherit and replay it).
        copy.copy(self.dataset).load_state_dict(merged)
        streams = {} if state.get("finished") else {
            w: WorkerStream(w, dataset_state=merged) for w in range(max(self.num_workers, 1))}
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
        self.set_epoch(merged["epoch"])
        self._epoch_position = None
        self._resume_raw = copy.deepcopy(state)
        self._resume = Resume(finished=False, base_seed=seed, seed_epoch=0, num_yielded=0,
                              sampler_state=None, sampler_skip=0, delivered_prefix=0,
                              delivered_ahead=set(), last_worker=max(self.num_workers - 1, 0),
                              streams=streams, sampler_snapshot_step=0, started=True)

    def _take_resume(self) -> Resume | None:
        """The loaded state, for the iterator starting now (used once)."""
        resume, self._resume, self._resume_raw = self._resume, None, None
        return resume

    def _publish_position(self, position: EpochPosition) -> None:
        """The position of the epoch an iterator has just begun (what `state_dict()` reads)."""
        self._epoch_position = position
        self._pass_epoch = self._sampler_epoch()

    def _sampler_epoch(self) -> int | None:
        """The own epoch of the sampler that picks the order (`position.epoch_sampler`), or
        None."""
        part = epoch_sampler(self._index_sampler)
        return None if part is None else part.epoch

    def _drop_state_iterator(self) -> None:
        """Forget an iterator made by state_dict() before the first iter()."""
        it, self._state_iterator = self._state_iterator, None
        if it is None:
            return
        if self._iterator is it:
            self._iterator = None
        it._stop()

    def _start_set_epoch(self) -> Iterator:
        """The saved epoch had nothing left (`RestOrNext`): its state now, at its end, is an
        end-of-epoch state; start the next epoch from it as from a loaded one."""
        check = self._state_check()
        state = build_state(self._epoch_position, check, loader_epoch=self._epoch, exposed=False)
        self._resume = parse(state, check, self._state_limits())
        self._resume.rng_check = rng_fingerprint(self.generator)  # nothing to discard here
        return self._iter_epoch()

    def __iter__(self) -> Iterator:
        watch = getattr(self, "_replay_watch", None)  # absent in loaders unpickled from before
        if watch is not None and not watch.before_pass():
            self._replay_watch = None
        it, self._state_iterator = self._state_iterator, None
        if it is not None:  # made by state_dict() before this first iter(): its epoch
            return it
        if self._resume is not None and self._resume.moves_on(self._sampler_epoch()):
            return RestOrNext(self._iter_epoch(), self._start_set_epoch)
        return self._iter_epoch()

    def _iter_epoch(self) -> Iterator:
        # DataLoader.__iter__, with the next epoch's spec for a persistent iterator
        if self.persistent_workers and self.num_workers > 0:
            if self._iterator is None:
                self._iterator = self._get_iterator()
            else:
                self._iterator._reset(self._epoch_spec())
            return self._iterator
        return self._get_iterator()

    # -- public extras --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the sampler and the dataset (and to persistent workers).

        After `load_state_dict`, another epoch than the state's (a state saved inside an
        epoch's last step, restarted at the next epoch): the next `iter()` gives the rest of
        the saved epoch, or, when nothing of it is left, the epoch set (docs/resume.md)."""
        resume = self._resume
        if resume is not None and not resume.finished and epoch != self._epoch:
            resume.advance = True
        self._epoch = epoch
        for target in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler",
                                                                 None), self.dataset):
            setter = getattr(target, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def stats(self) -> dict:
        """Pool statistics and where the time goes (docs/observability.md)."""
        figures = self._stats.snapshot(self._pool.stats() if self._pool is not None else {})
        figures["worker_replacements"] = len(self._failover.replacements)
        figures["replacements"] = [r.describe() for r in self._failover.replacements]
        if self._fused is not None:
            figures["transforms"] = self._fused.describe()
        # e.g. mix.Mix: figures["mix"] from the delivered states
        position = self._epoch_position
        streams = position.streams.values() if position is not None else ()
        figures.update(hooks_of(self.dataset).pooled_figures(
            [s.dataset_state for s in streams], figures))
        return figures

    def reset_stats(self) -> None:
        """Start the time and traffic figures of `stats()`/`report()` afresh (pool figures stay)."""
        self._stats.reset()

    def report(self) -> str:
        """One paragraph: whether the loader or the training step is the bottleneck, the
        loader's slowest stage and its fix, and (after `pooled_loader.stats.gather`) the
        straggler ranks."""
        return report_text(self.stats(), self._stats.ranks)

    def trace(self, path: str, batches: int = DEFAULT_TRACE_BATCHES) -> None:
        """Record the next `batches` batches and write them to `path` as a Chrome trace once
        they are delivered (or at the epoch's end or `close()`, if that comes first). Replaces
        the trace given to the constructor. Spans are recorded for batches dispatched from now
        on: the ones already prefetched are not in it."""
        self._stats.trace = TraceRecorder(path, batches, limit=batches)

    def close(self) -> None:
        """Stop persistent workers now (they also stop when the loader is garbage collected).
        Batches still held stay valid; the pool's memory goes when the last one is dropped."""
        self._drop_state_iterator()
        iterator, self._iterator = self._iterator, None
        if iterator is not None:
            iterator._stop()
        self._stats.epoch_done()  # writes the trace, if one is recorded
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self) -> dict:
        """For pickle and copy.deepcopy, as DataLoader: the arguments, the statistics and a loaded
        state travel; the pool, the workers and the live epoch's position do not (a copy makes
        its own on its first iter())."""
        state = self.__dict__.copy()
        state.update(_pool=None, _iterator=None, _epoch_position=None, _state_iterator=None)
        return state

    # -- iterator plumbing ---------------------------------------------------------------------
    def _default_slots(self) -> int:
        if self.pool_slots is not None:
            return self.pool_slots
        return default_pool_slots(self.num_workers, self.prefetch_factor)

    def _get_pool(self) -> SlotPool:
        if self._pool is None:
            self._pool = SlotPool(FIRST_SLOT_BYTES, self._default_slots(), GROW_WARNING)
        return self._pool

    def _pins_pool(self) -> bool:
        """Whether batches come from a pinned pool (a CUDA device, or pin_memory with CUDA)."""
        on_cuda = self.device is not None and self.device.type == "cuda"
        return on_cuda or (self.pin_memory and torch.cuda.is_available())

    def _epoch_spec(self) -> EpochSpec:
        """What the iterator starting (or restarting) an epoch now takes from this loader; a
        loaded state goes with it, once."""
        return EpochSpec(  # the dataset first: reading it may take the collate_fn over
            dataset=self._worker_dataset(), index_sampler=self._index_sampler, generator=self.generator,
            num_workers=self.num_workers, batch_size=self.batch_size, drop_last=self.drop_last,
            auto_collation=self._auto_collation, collate_fn=self._pooled_collate(),
            ragged=isinstance(self.collate_fn, RaggedCollate), on_error=self.on_error,
            per_sample_seed=self.per_sample_seed, elastic=self._elastic_sampler(),
            snapshot_every=self.snapshot_every_n_steps,
            persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor or DEFAULT_PREFETCH_FACTOR,
            timeout=self.timeout, worker_init_fn=self.worker_init_fn,
            multiprocessing_context=self.multiprocessing_context, in_order=self.in_order,
            pin_memory=self.pin_memory, pin_memory_device=self.pin_memory_device,
            pinned=self._pins_pool(), len_called=self._IterableDataset_len_called,
            loader_epoch=self._epoch, pool=self._get_pool(), stats=self._stats,
            resume=self._take_resume(), publish=self._publish_position,
            failover=self._failover, worker_timeout=self.worker_timeout,
            max_skip_fraction=self.max_skip_fraction,
            max_consecutive_skips=self.max_consecutive_skips)

    def _worker_dataset(self) -> Any:
        """The dataset the workers read: a torchvision folder dataset whose transform runs on
        the fused image path (``vision.torchvision_fused``), a wrapped torchvision detection
        dataset on the fused detection path (``vision.detection_fused``), or the user's own.
        Read again at every epoch, as DataLoader's workers see a transform changed between
        epochs."""
        self._fused = None
        if self.accelerate_transforms and not isinstance(self.dataset, IterableDataset) \
                and _maybe_folder(self.dataset):
            from .vision.torchvision_fused import translate
            self._fused, self._fused_line = translate(self.dataset, self._fused_line,
                                                      collate_fn=self._pooled_collate()
                                                      if self._auto_collation else None)
            if self._fused is None:  # a wrapped torchvision detection dataset (issue 38)
                from .vision.detection_fused import translate as detection
                self._fused, line = detection(self.dataset, self._fused_line)
                self._fused_line = line or self._fused_line
        return self.dataset if self._fused is None else self._fused

    def _pooled_collate(self) -> Callable | None:
        """None when the collate function is the one DataLoader picks by default (we then
        collate into the slot); an explicit default_collate without batching or default_convert
        with it runs as any other collate function, as in DataLoader."""
        default = default_collate if self._auto_collation else default_convert
        if self.collate_fn is default or getattr(self._fused, "mix", None) is not None:
            return None  # (a MixUp/CutMix collate the fused dataset runs in the slot)
        return self.collate_fn

    def _get_iterator(self) -> Iterator:
        if self._check_undistributed:
            self._check_undistributed = False
            from .distributed import warn_if_undistributed
            warn_if_undistributed(True, self.sampler, self.batch_sampler)
        if not getattr(self, "_starved_checked", True):
            self._starved_checked = True
            from .distributed import warn_if_starved
            warn_if_starved(self.dataset, self.sampler, self._index_sampler,
                            num_workers=self.num_workers, batch_size=self.batch_size,
                            drop_last=self.drop_last)
        if self.num_workers == 0:
            it: Iterator = InProcessIter(self._epoch_spec())
        else:
            self.check_worker_number_rationality()
            it = WorkerIter(self._epoch_spec())
        on_cuda = self.device is not None and self.device.type == "cuda"
        if self._pins_pool():
            from .engine.cuda import DeviceIter, backend_for, pin_pool
            backend = backend_for(self)
            pin_pool(self._pool, backend)  # after forking the workers: see pooled_loader.cuda
            if on_cuda:
                depth = self.prefetch_factor or DEFAULT_PREFETCH_FACTOR
                return HandedOut(DeviceIter(it, self.device, depth=depth,
                                            transform=self.device_transform, backend=backend),
                                 it)
        if self.device_transform is not None:
            return HostTransformIter(it, self.device_transform)
        return it
