"""Mixing several datasets by weight: deterministic, exactly resumable, elastic, accounted.

``Mix(sources, weights)`` is an ``IterableDataset`` for ``PooledLoader`` (any ``num_workers``,
``distributed=True``). Why a dataset and not a sampler: iterable sources (WebDataset shards) have
no indices to sample, and a dataset plugs into what the loader already has: workers found by
``get_worker_info()``, ranks by ``distributed.rank_and_world()``, resume through the Stateful
protocol (its ``state_dict()`` rides on each worker's batch messages), skips through
``pop_skips()``, per-source read time through the stage clock (stages ``mix:<name>``).

The order (``mix.order``): the source drawn at each global position of an epoch is a pure function
of (seed, epoch, position, weights in force), the same for 0 or N workers and any number of
ranks. A (rank, worker) slot reads whole blocks of ``batch_size`` positions in turn; by default
that is the loader's batch size (``PooledLoader`` tells the mix, ``pooled_batch_size``), so every
rank's batches are the global sequence in order, whatever ``num_workers`` and the prefetch.

Within a source:
- map-style: draw ``j`` of source ``s`` is item ``j`` of its own order (a permutation per (seed,
  epoch, source) with ``shuffle=True``, else 0..n-1). Exact everywhere: the item at a position
  does not depend on workers or ranks; exhaustion is global (all slots agree where it happens).
- iterable (WebDataset, any IterableDataset): each slot iterates its own copy, which splits
  itself across ranks and workers by its own mechanism; at a position drawing it, the slot takes
  its copy's next item. The sequence of *sources* stays global; which item an iterable source
  gives at a position depends on its own split (so on the number of slots), and its exhaustion
  is the slot's own. Resume on the same world size and workers is exact (its ``state_dict()``,
  or skipping the items taken); an elastic merge merges the source's own states (a WebDataset's
  remaining samples, ``mix.state``), and refuses a source without one, naming it.

Ranks: every rank yields as many batches (``drop_last``: pad with the epoch's first positions,
cut, or None: uneven), which needs the epoch's length: known to every slot for map-style sources
and with ``"never"``; a finite mode with an iterable source on several ranks needs None.

Stop modes: ``"first_exhausted"`` ends the epoch at the first draw of a source with no item left;
``"all_exhausted"`` stops drawing exhausted sources (the others fill in) until none is left;
``"never"`` restarts exhausted sources (a new order per pass) and ends the epoch after
``samples_per_epoch`` positions (a cap in the other modes). A source read that raises under
``on_error="skip"`` is counted (``stats()["mix"]``, ``stats()["skipped"]``) and its position
gives no sample: the others keep their draws.

Imports: ``order``, ``state``, ``core`` (ranks, seeds, stateful, errors), ``observability.stages``.
"""
from __future__ import annotations

import copy
import itertools
import pickle
import warnings
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ..core.ranks import rank_and_world
from ..core.errors import SampleError
from ..core.hooks import LoaderHooks
from .order import (Order, rest_entries, rest_index, rest_length, rest_prefix,
                        source_items)
from .state import (FORMAT, MAX_COUNT, MERGED, account, check_state, check_weights,
                    merge_mix_states, slot_source_state)
from ..core.seeds import sample_seed, seed_globals
from ..observability.stages import CLOCK, perf_counter_ns
from ..core.stateful import follows_stateful

__all__ = ["Mix", "merge_mix_states"]

Weights = Mapping[str, float] | Callable[[int], Mapping[str, float]]


class Mix(IterableDataset, LoaderHooks):
    """Draw samples from several datasets by weight.

    Args:
        sources: name -> dataset (map-style with ``len()``, ``pooled_loader.webdataset
            .WebDataset``, ``TokenDataset`` or any IterableDataset).
        weights: name -> weight >= 0 (normalised), or a callable of the global batch number
            (``position // batch_size``) returning such a dict: a curriculum within an epoch.
        seed: the seed of the order and of map-style sources' shuffles.
        stop: ``"first_exhausted"``, ``"all_exhausted"`` or ``"never"`` (see the module doc).
        samples_per_epoch: positions per epoch (over all ranks); required with ``"never"``.
        batch_size: positions a slot takes in turn. None (default): the batch size of the
            ``PooledLoader`` the mix is given to (1 under another loader), which keeps every
            rank's batches in the global order with any ``num_workers``; a number that differs
            from that loader's is refused.
        shuffle: read map-style sources in a seeded permutation per epoch (else in order).
        with_source: yield ``(sample, source_name)`` instead of the sample.
        on_error: ``"raise"`` or ``"skip"`` (count a failing read; its position gives nothing).
        per_sample_seed: seed ``random``/numpy/torch from (seed, epoch, position) before each
            map-style read, so augmentations do not depend on workers or ranks.
        drop_last: on several ranks, give every rank as many batches (DDP needs it), as
            DistributedSampler does: ``False`` pads the epoch with its first positions again,
            ``True`` drops its last ones; ``None`` leaves the ranks uneven (every position
            once). Finite stop modes with an iterable source need ``None``.
    """

    splits_by_rank = True  # pooled_loader.distributed: each rank takes its own share

    def __init__(self, sources: Mapping[str, Any], weights: Weights, *, seed: int = 0,
                 stop: str = "first_exhausted", samples_per_epoch: int | None = None,
                 batch_size: int | None = None, shuffle: bool = True, with_source: bool = False,
                 on_error: str = "raise", per_sample_seed: bool = False,
                 drop_last: bool | None = False) -> None:
        if not isinstance(sources, Mapping) or not sources or not all(
                isinstance(k, str) and k for k in sources):
            raise ValueError("Mix: sources must be a non-empty dict of name (str) -> dataset")
        for name, value in (("batch_size", batch_size), ("samples_per_epoch",
                                                         samples_per_epoch)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"Mix: {name} must be a positive integer, got {value!r}")
        if drop_last not in (True, False, None):
            raise ValueError(f"Mix: drop_last must be True, False or None, got {drop_last!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"Mix: on_error must be 'raise' or 'skip', got {on_error!r}")
        self.names = list(sources)
        self.sources = [sources[n] for n in self.names]
        self.iterable = [isinstance(s, IterableDataset) or not hasattr(s, "__getitem__")
                         for s in self.sources]
        self.sizes = [None if it else len(s) for s, it in zip(self.sources, self.iterable)]
        for name, size in zip(self.names, self.sizes):
            if size == 0:
                raise ValueError(f"Mix: source {name!r} is empty")
        Order(seed=seed, epoch=0, sizes=self.sizes, weights=lambda step: (), static=True,
              stop=stop, limit=samples_per_epoch, batch=batch_size or 1)  # checks stop, limit
        self.seed, self.stop, self.samples_per_epoch = int(seed), stop, samples_per_epoch
        self.batch_given = batch_size  # None: the loader's (pooled_batch_size)
        self.batch_size, self.shuffle, self.with_source = batch_size or 1, bool(shuffle), \
            with_source
        self.on_error, self.per_sample_seed = on_error, bool(per_sample_seed)
        self.drop_last = drop_last
        self.epoch = 0
        self._schedule: list[list] = []  # [from_epoch, weights dict or callable], increasing
        self.set_weights(weights, from_epoch=0)
        self._resume: dict | None = None
        self._live: _Stream | None = None
        self._skips: list[tuple[str, str]] = []
        self._rank_world = rank_and_world()

    # -- configuration --------------------------------------------------------------------------
    def pooled_batch_size(self, batch_size: int | None) -> None:
        """From `PooledLoader` (None: one sample a step): a mix given no `batch_size` takes it,
        so its batches are the global sequence with any `num_workers`; another is refused."""
        if self.batch_given is not None and self.batch_given != (batch_size or 1):
            raise ValueError(
                f"Mix(batch_size={self.batch_given}) disagrees with the loader's batch_size="
                f"{batch_size}, so its batches would depend on num_workers: leave Mix's "
                f"batch_size out (it takes the loader's) or give both the same")
        self.batch_size = batch_size or 1

    def set_weights(self, weights: Weights, from_epoch: int | None = None) -> None:
        """Use `weights` (a dict, or a callable of the global batch number) from epoch
        `from_epoch` on (default: the current epoch, i.e. after `loader.set_epoch(e)`), replacing
        any set for that epoch or later. Recorded in the state, so a resume continues with the
        weights in force. Persistent workers get the schedule with each new epoch (a callable
        set after they started must pickle: a module-level function)."""
        first = self.epoch if from_epoch is None else from_epoch
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"Mix.set_weights: from_epoch must be an integer >= 0, got {first!r}")
        if not callable(weights):
            weights = check_weights(dict(weights) if isinstance(weights, Mapping) else weights,
                                    self.names, "Mix")
        self._schedule = [e for e in self._schedule if e[0] < first] + [[first, weights]]

    def pooled_epoch(self) -> dict:
        """What `PooledLoader` sends persistent workers with each new epoch: the weight
        schedule (`pooled_load_epoch` takes it there), so a `set_weights` between epochs reaches
        them. A callable that does not pickle (a lambda) travels as a marker that raises."""
        schedule = []
        for first, weights in self._schedule:
            if callable(weights):
                try:
                    pickle.dumps(weights)
                except Exception:  # noqa: BLE001 - any pickling failure: it cannot travel
                    weights = _Unsent(first)
            schedule.append([first, weights])
        return {"schedule": schedule}

    def pooled_load_epoch(self, payload: dict) -> None:
        """In a persistent worker: take the main process's weight schedule (`pooled_epoch`)."""
        schedule = []
        for first, weights in payload["schedule"]:
            if isinstance(weights, _Unsent):  # this worker's own (inherited) callable, if any
                mine = [w for e, w in self._schedule if e == first]
                weights = mine[0] if mine and callable(mine[0]) else weights
            schedule.append([first, weights])
        self._schedule = schedule

    def weights_at(self, epoch: int) -> Any:
        """The weights (dict or callable) in force at `epoch`: the last set from it or before."""
        return [w for first, w in self._schedule if first <= epoch][-1]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (forwarded by `PooledLoader.set_epoch`) and pass it to the sources."""
        self.epoch = int(epoch)
        if get_worker_info() is None:
            self._rank_world = rank_and_world()
        for source in self.sources:
            setter = getattr(source, "set_epoch", None)
            if callable(setter):
                setter(epoch)

    def _config(self) -> dict:
        return {"sources": self.names, "seed": self.seed, "stop": self.stop,
                "samples_per_epoch": self.samples_per_epoch, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "iterable": [n for n, it in zip(self.names, self.iterable) if it]}

    def _slot(self) -> tuple[int, int, int, int]:
        """(rank, world_size, worker, num_workers) of this process."""
        if get_worker_info() is None or (dist.is_available() and dist.is_initialized()):
            rank, world = rank_and_world()
        else:  # a spawned worker cannot see the process group: what the main process saw
            rank, world = self._rank_world
        info = get_worker_info()
        return (rank, world) + ((info.id, info.num_workers) if info else (0, 1))

    def __getstate__(self) -> dict:
        if get_worker_info() is None:
            self._rank_world = rank_and_world()
        return {**self.__dict__, "_live": None}

    def __len__(self) -> int:
        """This rank's positions per epoch, when that is known before reading (stop "never",
        or samples_per_epoch); TypeError otherwise, as for any stream."""
        if self.samples_per_epoch is None or self.stop != "never":
            raise TypeError("Mix has no len() unless stop='never' (the epoch's end depends on "
                            "when a source runs out)")
        _, world = self._slot()[:2]
        n, step = self.samples_per_epoch, self.batch_size * world
        if world > 1 and self.drop_last is not None:
            return (n // step if self.drop_last else -(-n // step)) * self.batch_size
        blocks = -(-n // self.batch_size)
        return len(range(0, blocks, world)) * self.batch_size  # at most: the last may be short

    # -- iteration and state --------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] != self.epoch:
            resume = None  # a state of another epoch (a finished one): start this epoch afresh
        self._live = _Stream(self, resume)
        return self._live.run()

    def state_dict(self) -> dict:
        """This slot's position after the last sample its iterator yielded (plain JSON data, as
        long as iterable sources' own states are); the layout is in `pooled_loader.mix.state`."""
        if self._live is not None and self._live.epoch == self.epoch:
            return self._live.state()
        if self._resume is not None:
            return dict(self._resume)
        return _Stream(self, None).state()

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` continue from `state` (this slot's, or a merged one). Sets the
        epoch and the weight schedule to the state's. Raises ValueError naming the key."""
        self._adopt_batch_size(state)
        check_state(state, self._config(), None)
        self._adopt_schedule(state)
        self.epoch = state["epoch"]
        self._resume = state

    def _adopt_batch_size(self, state: Any) -> None:
        """A mix that took the loader's batch size resumes a state saved with another (before
        Mix took the loader's, its default was 1) in the saved run's blocks, with a warning: its
        positions mean those blocks. A mix given its batch size keeps refusing another."""
        saved = state.get("batch_size") if isinstance(state, dict) else None
        if self.batch_given is not None or saved == self.batch_size or isinstance(saved, bool) \
                or not isinstance(saved, int) or not 1 <= saved <= MAX_COUNT:
            return
        warnings.warn(f"Mix: this state was saved with batch_size={saved}, not the loader's "
                      f"{self.batch_size} (a Mix of an earlier release took blocks of 1): the "
                      f"resumed run keeps blocks of {saved}, so its batches depend on "
                      f"num_workers as they did; a new run takes the loader's", stacklevel=3)
        self.batch_size = saved

    def _adopt_schedule(self, state: dict) -> None:
        schedule = []
        for first, weights in state["schedule"]:
            if weights is None:
                weights = self.weights_at(first)
                if not callable(weights):
                    raise ValueError(f"Mix state: the weights of epoch {first} were a callable: "
                                     f"pass the same callable to Mix or set_weights")
            schedule.append([first, weights])
        self._schedule = schedule

    def pooled_check_states(self, states: list) -> None:
        """Called by `PooledLoader.load_state_dict` in the main process with every worker's
        saved state: checks them there (a bad one raises before any worker starts) and takes
        their weight schedule, so the epochs after the resumed one use it too."""
        for state in states:
            if state is not None:
                self._adopt_batch_size(state)
                check_state(state, self._config(), None)
                self._adopt_schedule(state)

    def pop_skips(self) -> list[tuple[str, str]]:
        """``(where, reason)`` of each failed read since the last call, for the loader's
        statistics (and those of iterable sources that skip by themselves)."""
        log, self._skips = self._skips, []
        for name, source in zip(self.names, self.sources):
            pop = getattr(source, "pop_skips", None)
            if callable(pop):
                log += [(f"{name}: {where}", why) for where, why in pop()]
        return log

    def pooled_figures(self, states: list, figures: dict) -> dict:
        """``{"mix": ...}`` for `PooledLoader.stats()`, from its workers' delivered states and
        its figures (per-source read seconds: the ``mix:<name>`` stages)."""
        total = figures.get("stages", {}).get("all", {}).get("total_s", {})
        weights = self.weights_at(self.epoch)
        with_lengths = {n for n, src, it in zip(self.names, self.sources, self.iterable)
                        if not it and callable(getattr(src, "lengths", None))}
        return {"mix": account(states, self.names, None if callable(weights) else weights,
                               {n: total.get(f"mix:{n}", 0.0) for n in self.names},
                               with_lengths)}


class _Unsent:
    """The weights of an epoch that were a callable that does not pickle, in a persistent
    worker that could not be sent it: calling it says what to do."""

    def __init__(self, from_epoch: int) -> None:
        self.from_epoch = from_epoch

    def __call__(self, step: int) -> dict:
        raise ValueError(f"Mix: the weights set for epoch {self.from_epoch} are a callable that "
                         f"does not pickle (a lambda?), so persistent workers cannot get it: "
                         f"pass a module-level function, or set it before the workers start")


class _Stream:
    """One slot's epoch of a mix: the iterator `iter(mix)` returns."""

    def __init__(self, mix: Mix, resume: dict | None) -> None:
        self.mix = mix
        self.epoch = mix.epoch
        self.slot_info = mix._slot()
        rank, world, worker, workers = self.slot_info
        self.slot, self.slots = rank + world * worker, world * workers
        n = len(mix.names)
        self.counts = {c: [0] * n for c in ("samples", "tokens", "failed", "passes", "items")}
        self.exhausted = [False] * n
        self.passed, self.ended, self.rounds = 0, False, []
        self.source_states: list[Any] = [None] * n
        if resume is not None:
            self._restore(resume)
        self._perms: dict = {}  # source -> (pass, its permutation)

    def _restore(self, state: dict) -> None:
        self.rounds = list(state["rounds"])
        per = state["per_source"]
        if state["format"] == MERGED:  # rounds only; the counts so far go to slot 0
            if self.slot == 0:
                for c in ("samples", "tokens", "failed"):
                    self.counts[c] = [per[n][c] for n in self.mix.names]
            self.ended = state["ended"]
            for s, name in enumerate(self.mix.names):  # an iterable source: its piece of the rest
                if self.mix.iterable[s]:
                    self.source_states[s] = slot_source_state(per[name]["state"], self.slot,
                                                              self.slots, self.slot_info)
            return
        check_state(state, self.mix._config(), self.slot_info)
        self.passed, self.ended = state["passed"], state["ended"]
        for c in self.counts:
            self.counts[c] = [per[n][c] for n in self.mix.names]
        self.exhausted = [per[n]["exhausted"] for n in self.mix.names]
        self.source_states = [per[n]["state"] for n in self.mix.names]

    def state(self) -> dict:
        mix = self.mix
        per = {}
        for s, name in enumerate(mix.names):
            source_state = self.source_states[s]
            if mix.iterable[s] and follows_stateful(mix.sources[s]):
                if self.counts["items"][s]:
                    source_state = mix.sources[s].state_dict()
                elif source_state is None:  # before its first item: kept if it lists the
                    fresh = mix.sources[s].state_dict()  # whole piece (for an elastic merge)
                    if isinstance(fresh, dict) and fresh.get("position", 0) is None \
                            and isinstance(fresh.get("rest"), list):
                        source_state = fresh
            per[name] = {**{c: self.counts[c][s] for c in self.counts},
                         "exhausted": self.exhausted[s], "state": source_state}
        rank, world, worker, workers = self.slot_info
        schedule = [[e, None if callable(w) else w] for e, w in mix._schedule]
        return {"format": FORMAT, **mix._config(), "epoch": self.epoch, "rank": rank,
                "world_size": world, "worker": worker, "num_workers": workers,
                "schedule": schedule, "passed": self.passed, "ended": self.ended,
                "rounds": self.rounds, "per_source": per}

    # -- the positions of this slot --------------------------------------------------------------
    def _order(self) -> Order:
        mix = self.mix
        weights = mix.weights_at(self.epoch)
        if callable(weights):
            names, cache = mix.names, {}

            def at(step: int) -> tuple:
                if step not in cache:
                    if len(cache) > 4096:
                        cache.clear()
                    got = check_weights(dict(weights(step)), names, f"Mix weights({step})")
                    cache[step] = tuple(got[n] for n in names)
                return cache[step]
            return Order(seed=mix.seed, epoch=self.epoch, sizes=mix.sizes, weights=at,
                         static=False, stop=mix.stop, limit=mix.samples_per_epoch,
                         batch=mix.batch_size)
        fixed = tuple(weights[n] for n in mix.names)
        return Order(seed=mix.seed, epoch=self.epoch, sizes=mix.sizes, weights=lambda _: fixed,
                     static=True, stop=mix.stop, limit=mix.samples_per_epoch,
                     batch=mix.batch_size)

    def _mine(self, order: Order) -> Iterator[tuple[list, list, list, list]]:
        """(positions, sources, draw numbers, item indices (map-style; -1: iterable)) of this
        slot's share, chunk by chunk, in order: whole blocks of the *rest* (the positions no
        earlier round passed, `order.rest_after`), cut or padded so that every rank gets as
        many blocks (`Mix.drop_last`)."""
        b, slots, slot = self.mix.batch_size, self.slots, self.slot
        rest, bound = rest_prefix(self.rounds)  # the rest below `bound`; all of it above
        target = self._target(order, rest, bound)
        for chunk in order.chunks():
            g = np.arange(chunk.start, chunk.start + len(chunk.src), dtype=np.int64)
            idx, alive = rest_index(g, rest, bound)
            keep = alive & ((idx // b) % slots == slot)
            if target is not None:
                keep &= idx < target
            yield self._with_items(g[keep], chunk.src[keep], chunk.draw[keep])
        if target is not None:
            yield from self._padding(order, rest, bound, target)

    def _target(self, order: Order, rest: np.ndarray, bound: int) -> int | None:
        """The entries of the rest every rank's blocks cover together: a multiple of
        batch_size x world size (None: no cut or padding)."""
        mix, world = self.mix, self.slot_info[1]
        if world == 1 or mix.drop_last is None:
            return None
        iterable = [n for n, it in zip(mix.names, mix.iterable) if it]
        if iterable and mix.stop != "never":
            raise ValueError(
                f"Mix: source(s) {iterable} are iterable datasets, whose end in stop="
                f"{mix.stop!r} is each worker's own, so ranks cannot be given the same number "
                f"of batches (torch DDP would hang): use stop='never' with samples_per_epoch, "
                f"or drop_last=None if the ranks may take different numbers of steps")
        self.rest_length = n = rest_length(order.length(), rest, bound)
        step = mix.batch_size * world
        return (n // step) * step if mix.drop_last else -(-n // step) * step

    def _padding(self, order: Order, rest: np.ndarray, bound: int, target: int) -> Iterator:
        """This slot's entries of the rest beyond its end (up to `target`): the rest's first
        entries again, as DistributedSampler pads with its first indices."""
        n, b = self.rest_length, self.mix.batch_size
        if target <= n or n == 0:
            return
        idx = np.arange(n, target, dtype=np.int64)
        idx = idx[(idx // b) % self.slots == self.slot]
        if not len(idx):
            return
        wanted = rest_entries((idx - n) % n, rest, bound)  # positions, in this slot's order
        src = np.zeros(len(wanted), dtype=np.int64)
        draw = np.zeros(len(wanted), dtype=np.int64)
        for chunk in copy.copy(order).chunks():  # a copy: `order.active` stays the epoch's
            inside = (wanted >= chunk.start) & (wanted < chunk.start + len(chunk.src))
            src[inside] = chunk.src[wanted[inside] - chunk.start]
            draw[inside] = chunk.draw[wanted[inside] - chunk.start]
            if chunk.start + len(chunk.src) > wanted.max():
                break
        yield self._with_items(wanted, src, draw)

    def _with_items(self, g: np.ndarray, src: np.ndarray, draw: np.ndarray) -> tuple:
        mix = self.mix
        items = np.full(len(g), -1, dtype=np.int64)
        for s, size in enumerate(mix.sizes):
            mask = src == s
            if size is not None and mask.any():
                items[mask] = source_items(mix.seed, self.epoch, s, size, draw[mask],
                                           mix.shuffle, self._perms)
        return g.tolist(), src.tolist(), draw.tolist(), items.tolist()

    # -- reading ----------------------------------------------------------------------------------
    def run(self) -> Iterator[Any]:
        """The slot's samples (the generator `iter(mix)` returns)."""
        if self.ended:
            return
        mix = self.mix
        order = self._order()
        stages = [f"mix:{n}" for n in mix.names]
        lengths = [self._lengths(s) for s in range(len(mix.names))]
        iters: dict[int, Iterator] = {s: self._open(s) for s in range(len(mix.names))
                                      if mix.iterable[s] and not self.exhausted[s]}
        last = [-1 if size is None or mix.stop == "never" else size - 1 for size in mix.sizes]
        samples, tokens, passed_skip = self.counts["samples"], self.counts["tokens"], self.passed
        seed, epoch, seeded = mix.seed, self.epoch, mix.per_sample_seed
        skip_on_error, with_source, names = mix.on_error == "skip", mix.with_source, mix.names
        getters = [None if it else src.__getitem__ for src, it in zip(mix.sources, mix.iterable)]
        exhausted = self.exhausted
        clock = CLOCK  # its accumulators are booked inline (as CLOCK.add): the per-sample path
        ns = clock.ns
        for positions, srcs, draws, items in self._mine(order):
            if passed_skip >= len(positions):
                passed_skip -= len(positions)
                continue
            start, passed_skip = passed_skip, 0
            for g, s, j, index in zip(positions[start:], srcs[start:], draws[start:],
                                      items[start:]):
                t0 = perf_counter_ns()
                get = getters[s]
                if get is None:
                    ok, sample = self._next_of(s, iters, order)
                    if ok is None:
                        self.ended = True
                        return
                else:
                    if seeded:
                        seed_globals(sample_seed(seed, epoch, g))
                    try:
                        sample, ok = get(index), True
                    except Exception as exc:  # noqa: BLE001 - counted, or raised with its name
                        if not skip_on_error:
                            raise SampleError(f"Mix source {names[s]!r}, item {index}: "
                                              f"{type(exc).__name__}: {exc}") from exc
                        self._failed(s, index, exc)
                        ok = False
                d = perf_counter_ns() - t0
                ns[stages[s]] += d
                clock.nested_ns += d
                if clock.spans is not None:
                    clock.spans.append((stages[s], t0, d, None))
                self.passed += 1
                if not ok:
                    continue
                samples[s] += 1
                if j == last[s]:
                    exhausted[s] = True  # its last item (the slot that drew it says so)
                if lengths[s] is not None:
                    tokens[s] += int(lengths[s][index])
                yield (sample, names[s]) if with_source else sample
        self.ended = True

    def _lengths(self, s: int) -> np.ndarray | None:
        source = self.mix.sources[s]
        lengths = getattr(source, "lengths", None)
        if self.mix.iterable[s] or not callable(lengths):
            return None
        return np.asarray(lengths())

    def _open(self, s: int) -> Iterator:
        """Source `s`'s iterator where this slot's state left it."""
        source = self.mix.sources[s]
        state = self.source_states[s]
        if state is not None and follows_stateful(source):
            source.load_state_dict(state)
            return iter(source)
        it = iter(source)
        for _ in itertools.islice(it, self.counts["items"][s]):
            pass
        return it

    def _next_of(self, s: int, iters: dict, order: Order) -> tuple[bool | None, Any]:
        """(True, item), (False, None) for a position that gives nothing (a failed read or an
        exhausted source under "all_exhausted"), or (None, None): this slot's epoch ends."""
        mix, it = self.mix, iters.get(s)
        if it is None:
            return self._none_left(order), None
        try:
            item = next(it)
        except StopIteration:
            if mix.stop == "never":
                self.counts["passes"][s] += 1
                self.counts["items"][s] = 0
                self.source_states[s] = None
                iters[s] = it = iter(mix.sources[s])
                try:
                    item = next(it)
                except StopIteration:
                    raise ValueError(f"Mix source {mix.names[s]!r} yields nothing in this "
                                     f"worker: it cannot be restarted") from None
            else:
                self.exhausted[s] = True
                del iters[s]
                return (None if mix.stop == "first_exhausted" else self._none_left(order)), None
        except Exception as exc:  # noqa: BLE001 - counted, or raised with its name
            if mix.on_error != "skip":
                raise
            self._failed(s, f"item {self.counts['items'][s]}", exc)
            self.counts["items"][s] += 1
            return False, None
        self.counts["items"][s] += 1
        return True, item

    def _none_left(self, order: Order) -> bool | None:
        """False while some source can still give this slot a sample, else None."""
        for s in range(len(self.mix.names)):
            if order.active[s] and not self.exhausted[s]:
                return False
        return None

    def _failed(self, s: int, where: Any, exc: Exception) -> None:
        self.counts["failed"][s] += 1
        if len(self.mix._skips) < 10_000:
            self.mix._skips.append((f"mix source {self.mix.names[s]!r}, {where}",
                                    f"{type(exc).__name__}: {exc}"))
