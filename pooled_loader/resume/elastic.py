"""Resume a map-style epoch on another number of ranks (elastic resume).

One global order per (seed, epoch), independent of ranks and workers: the permutation torch's
``DistributedSampler`` draws (``randperm(n)`` from ``seed + epoch``, or ``0..n-1``), padded by
repetition to a multiple of the world size (or cut to one with ``drop_last``); rank ``r`` of ``N``
takes positions ``r, r + N, r + 2N, ...``. :class:`ElasticDistributedSampler` is that sampler
(``PooledLoader(..., distributed=True)`` builds it), the very same order, plus a *plan*.

A rank's state says how many batches of its share it delivered (the loader's
``_sampler_iter_yielded`` and ``delivered_ahead``). :func:`merge_rank_states` turns the states of
all ``N`` ranks into one *round*: ``{"world": N, "drop_last": d, "consumed": {rank: [[a, b], ...]}}``,
ranges of share positions each rank consumed. It is a pure function of the states, so every rank
computes the same result. Loading it on rank ``m`` of ``M`` sets the plan: the samples of the
round's order not consumed (each once: a padded duplicate of a consumed sample counts as
consumed), in global order, padded or cut to a multiple of ``M`` as ``drop_last`` says, then
strided over the ``M`` ranks. Every rank thus gets the same number of samples (the same number
of batches: no DDP hang), and the ``M`` ranks together get exactly the samples not yet consumed.
A plan resumed again (mid-plan, on yet another world size) appends a round; its rounds replay in
order. ``set_epoch`` with another epoch drops the plan: the next epochs follow the ``M``-rank
split of the same global order.

With lockstep ranks (DDP: every rank delivered the same number of batches, in order), one rank's
state says what all consumed, so any single state suffices (``merge_rank_states([state])``, done
by ``load_state_dict`` itself); with ``in_order=False`` or uneven ranks, merge all states.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from ..core.constants import MAX_WORLD_SIZE
from ..core.errors import StateMismatch
from ..mix.state import is_mix_state, merge_mix_states
from ..core.state_checks import StateChecks
from ..shards.elastic import merge_stream_states
from .keys import (BASE_SEED, MAIN_SNAPSHOT, POOLED, SAMPLER_ITER_YIELDED, SNAPSHOT,
                         WORKER_SNAPSHOTS)

FORMAT = "pooled_loader.elastic/1"  # a merged state
MAX_ROUNDS = 64  # resumes within one epoch; bounds what a (hostile) state can make us replay

__all__ = ["ElasticDistributedSampler", "merge_rank_states", "is_merged", "FORMAT"]


def _fit(order: np.ndarray, world: int, drop_last: bool) -> np.ndarray:
    """DistributedSampler's padding (repeat from the start) or cut to a multiple of `world`."""
    n = len(order)
    if drop_last and n % world:
        return order[:n // world * world]
    total = math.ceil(n / world) * world
    if total == n or n == 0:
        return order
    reps = math.ceil((total - n) / n)
    return np.concatenate([order] + [order] * reps)[:total]


def _consumed_positions(round_: dict, length: int) -> np.ndarray:
    world = round_["world"]
    share = length // world  # `length` is fitted to the world: share positions past it do not
    parts = [int(r) + world * np.arange(a, min(b, share), dtype=np.int64)  # JSON keys: str
             for r, ranges in round_["consumed"].items() for a, b in ranges]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _after_round(order: np.ndarray, round_: dict, n: int) -> np.ndarray:
    """The samples of `order` (unique ids below `n`, fitted to the round's world) that the round
    did not consume, each once, in order. Padding only repeats samples of `order`, so what is
    left is `order`'s served part minus the consumed positions and the consumed ids."""
    fitted = _fit(order, round_["world"], round_["drop_last"])
    mask = np.ones(len(fitted), dtype=bool)
    mask[_consumed_positions(round_, len(fitted))] = False
    gone = np.zeros(n, dtype=bool)
    gone[fitted[~mask]] = True
    served = order[:len(fitted)]  # with drop_last the tail past the fitted length is not served
    return served[mask[:len(served)] & ~gone[served]]


class ElasticDistributedSampler(DistributedSampler):
    """torch's DistributedSampler (the same order for the same seed and epoch) whose epoch can be
    resumed on another number of ranks; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._plan: dict | None = None
        self._share_cache: tuple[Any, np.ndarray] | None = None

    def _base_order(self) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).numpy()

    def _share(self) -> np.ndarray:
        key = (id(self._plan), self.epoch, self.rank, self.num_replicas)
        if self._share_cache is None or self._share_cache[0] != key:
            order = self._base_order()
            for round_ in self._plan["rounds"]:
                order = _after_round(order, round_, len(self.dataset))
            fitted = _fit(order, self.num_replicas, self.drop_last)
            self._share_cache = (key, fitted[self.rank::self.num_replicas])
        return self._share_cache[1]

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if self._plan is not None and self._plan["epoch"] != epoch:
            self._plan = None  # a new epoch: the plain M-rank split of the global order

    def __iter__(self) -> Iterator[int]:
        if self._plan is None:
            return super().__iter__()
        return iter(self._share().tolist())

    def __len__(self) -> int:
        return super().__len__() if self._plan is None else len(self._share())

    @property
    def plan(self) -> dict | None:
        """The resumed epoch's plan, or None. The loader's state carries it (`_pooled.elastic`),
        and the position inside it is the loader's count, as for a plain sampler."""
        return self._plan

    def set_plan(self, plan: dict | None) -> None:
        """Run the rest of `plan["epoch"]` as `plan["rounds"]` say (None: no plan)."""
        self._plan = plan
        self._share_cache = None
        if plan is not None:
            super().set_epoch(plan["epoch"])


# -- merging states -------------------------------------------------------------------------------
def is_merged(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == FORMAT


def _bad(message: str) -> StateMismatch:
    return StateMismatch(f"merge_rank_states: {message}")


def _share_most(dataset_len: int, world: int) -> int:
    """Samples of one rank's share at most (a resumed plan's shares are shorter)."""
    return -(-dataset_len // world)


def _rank_view(state: Any, k: int) -> dict:
    """What merging needs from one rank's loader state (each value checked, naming its key)."""
    if not isinstance(state, dict) or not isinstance(state.get(POOLED), dict):
        raise _bad(f"state {k} is not a PooledLoader.state_dict()")
    pooled = state[POOLED]
    for key in ("world_size", "rank", "dataset_len", "batch_size", "drop_last",
                "per_sample_seed"):
        if key not in pooled:
            raise _bad(f"state {k} has no '{POOLED}.{key}': it was not saved by a loader with "
                       f"distributed=True")
    if not isinstance(pooled.get("elastic"), dict):
        raise _bad(f"state {k} has no '{POOLED}.elastic' section: its sampler is not an "
                   f"ElasticDistributedSampler (PooledLoader(..., distributed=True))")
    c = StateChecks(f"merge_rank_states: state {k}")
    world = c.integer(state, f"{POOLED}.world_size", 1, MAX_WORLD_SIZE,
                      " (constants.MAX_WORLD_SIZE)")
    rank = c.integer(state, f"{POOLED}.rank", 0, world - 1, f" (the last of {world} ranks)")
    n = c.count(state, f"{POOLED}.dataset_len")
    batch = None if pooled["batch_size"] is None else c.integer(state, f"{POOLED}.batch_size", 1)
    share = _share_most(n, world)
    batches = -(-share // (batch or 1))  # a share's batches at most
    prefix = c.count(state, f"{SNAPSHOT}.{MAIN_SNAPSHOT}.{SAMPLER_ITER_YIELDED}", batches,
                     f" batches of '{POOLED}.batch_size' {batch} in a share of at most "
                     f"{share} samples")
    path = f"{POOLED}.delivered_ahead"
    ahead = c.list_value(pooled.get("delivered_ahead", []), path, batches)
    for j, p in enumerate(ahead):
        c.int_value(p, f"{path}[{j}]", prefix + 1, batches - 1, " (the share's last batch)")
    c.seed_value(c.get(state, f"{SNAPSHOT}.{MAIN_SNAPSHOT}.{BASE_SEED}"),
                 f"{SNAPSHOT}.{MAIN_SNAPSHOT}.{BASE_SEED}")
    e = f"{POOLED}.elastic"
    plan = pooled["elastic"].get("plan")
    check_plan(plan, n, c.at(f"{e}.plan."))
    return {"world": world, "rank": rank, "prefix": prefix, "ahead": sorted(set(ahead)),
            "share": share, "finished": state.get("_iterator_finished") is True, "plan": plan,
            "same": {"dataset_len": n, "epoch": c.count(state, f"{e}.epoch"),
                     "seed": c.seed_value(c.get(state, f"{e}.seed"), f"{e}.seed"),
                     "shuffle": c.flag(state, f"{e}.shuffle"),
                     "drop_last": c.flag(state, f"{POOLED}.drop_last"), "batch_size": batch,
                     "per_sample_seed": c.flag(state, f"{POOLED}.per_sample_seed")}}


def merge_rank_states(states: Sequence[dict], *, lockstep: bool = False) -> dict:
    """One state for resuming an epoch on any number of ranks, from every rank's
    `PooledLoader.state_dict()` (a pure function: the same result on every rank).

    With `lockstep=True` a single state stands for all ranks of its world size (each delivered
    the same batches, in order); otherwise `states` must hold ranks 0..N-1 once each. Raises
    ValueError (`StateMismatch`) naming what differs between the states or what is missing."""
    if not states:
        raise _bad("no state given")
    if isinstance(states[0], dict) and isinstance(states[0].get(POOLED), dict) \
            and states[0][POOLED].get("iterable"):
        return _merge_streams(states)
    views = [_rank_view(s, k) for k, s in enumerate(states)]
    first = views[0]
    for k, v in enumerate(views[1:], 1):
        for key, value in first["same"].items():
            if v["same"][key] != value:
                raise _bad(f"state {k} has {key}={v['same'][key]!r}, state 0 has {value!r}")
        if v["world"] != first["world"] or v["plan"] != first["plan"]:
            raise _bad(f"state {k} was saved on {v['world']} ranks (or another resumed plan) "
                       f"than state 0 ({first['world']})")
    world = first["world"]
    if lockstep:
        if len(views) != 1:
            raise _bad("lockstep=True takes exactly one state")
        if first["ahead"]:
            raise _bad("a state with batches delivered out of order (in_order=False) does not "
                       "say what the other ranks consumed: merge every rank's state")
        views = [dict(first, rank=r) for r in range(world)]
    ranks = sorted(v["rank"] for v in views)
    if ranks != list(range(world)):
        missing = sorted(set(range(world)) - set(ranks))
        raise _bad(f"expected the states of ranks 0..{world - 1} once each; missing "
                   f"{missing}, got ranks {ranks}")
    rounds = list((first["plan"] or {}).get("rounds", []))
    if len(rounds) >= MAX_ROUNDS:
        raise _bad(f"more than {MAX_ROUNDS} resumes within one epoch")
    batch, share = first["same"]["batch_size"] or 1, first["share"]
    consumed = {}  # share positions, cut at the share's end (a last batch may be short)
    for v in views:
        ranges = [[0, min(v["prefix"] * batch, share)]] if v["prefix"] else []
        ranges += [[min(p * batch, share), min((p + 1) * batch, share)] for p in v["ahead"]]
        consumed[str(v["rank"])] = ranges
    rounds.append({"world": world, "drop_last": first["same"]["drop_last"],
                   "consumed": consumed})
    return {"format": FORMAT, **first["same"], "rounds": rounds,
            "finished": all(v["finished"] for v in views)}


def _merge_streams(states: Sequence[dict]) -> dict:
    """Iterable loaders: the datasets' states of every worker of every rank, merged by
    `shards.elastic.merge_stream_states` (WebDataset in counted mode) or
    `mix.state.merge_mix_states` (a mix of map-style sources)."""
    dataset_states, checks = [], []
    for k, state in enumerate(states):
        try:
            workers = state[SNAPSHOT][WORKER_SNAPSHOTS]
            items = [(key, w["dataset_state"], w["items_since_snapshot"])
                     for key, w in workers.items()]
        except (KeyError, TypeError, AttributeError):
            raise _bad(f"state {k} is incomplete: '{SNAPSHOT}.{WORKER_SNAPSHOTS}' lacks its "
                       f"workers' states") from None
        for key, dataset_state, since in items:
            if dataset_state is None:
                raise _bad(f"state {k}, {key}: no dataset state. Only a dataset whose states "
                           f"can be merged (pooled_loader.webdataset.WebDataset, counted mode) "
                           f"resumes on another world size")
            if since:
                raise _bad(f"state {k}, {key}: {since} item(s) since its last snapshot; take "
                           f"the states with snapshot_every_n_steps=1 (the default)")
            dataset_states.append(dataset_state)
            checks.append(StateChecks(f"merge_rank_states: state {k}",
                                      f"{SNAPSHOT}.{WORKER_SNAPSHOTS}.{key}.dataset_state."))
    try:
        if is_mix_state(dataset_states[0]):  # pooled_loader.mix.Mix
            merged = merge_mix_states(dataset_states, checks)
        else:
            merged = merge_stream_states(dataset_states, checks)
    except StateMismatch:
        raise
    except ValueError as exc:
        raise _bad(str(exc)) from None
    return {"format": FORMAT, "iterable": True, "epoch": merged["epoch"],
            "dataset_state": merged,
            "finished": all(s.get("_iterator_finished") is True for s in states)}


def plan_from(merged: dict) -> dict:
    """The sampler plan of a merged state."""
    return {"epoch": merged["epoch"], "rounds": merged["rounds"]}


def check_plan(plan: Any, dataset_len: int, checks: StateChecks | None = None) -> None:
    """Refuse a plan (a state's `_pooled.elastic.plan`) whose epoch or rounds are malformed."""
    c = checks or _LOADED.at("_pooled.elastic.plan.")
    if plan is None:
        return
    c.dict_value(plan, "")
    c.count(plan, "epoch")
    _check_rounds(c.get(plan, "rounds"), dataset_len, c.at("rounds"))


def check_merged(merged: dict, mine: dict) -> None:
    """Refuse a merged state that another dataset, seed or configuration wrote (`mine`: this
    loader's values), or whose counts or rounds are malformed."""
    for key in ("dataset_len", "seed", "shuffle", "drop_last", "per_sample_seed"):
        if merged.get(key) != mine[key]:
            raise StateMismatch(
                f"PooledLoader.load_state_dict: the merged state does not fit this loader: it "
                f"has {key}={merged.get(key)!r}, this loader has {key}={mine[key]!r}")
    c = StateChecks("PooledLoader.load_state_dict: the merged state")
    n = c.count(merged, "dataset_len")
    if merged.get("batch_size") is not None:
        c.integer(merged, "batch_size", 1)
    if "finished" in merged:
        c.flag(merged, "finished")
    _check_rounds(c.get(merged, "rounds"), n, c.at("rounds"))


_LOADED = StateChecks("PooledLoader.load_state_dict: the state")


def _rank_of(key: Any, world: int) -> int | None:
    """A round's rank key (a decimal string, as JSON keeps it, or an int), if in the world."""
    if isinstance(key, str) and key.isdigit() and str(int(key)) == key:
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < world:
        return key
    return None


def _check_rounds(rounds: Any, dataset_len: int, c: StateChecks) -> None:
    """Each round: a world of 1..MAX_WORLD_SIZE ranks, and per rank of it, sorted disjoint
    ranges of share positions (a range may end past the share, by less than a dataset)."""
    c.list_value(rounds, "", MAX_ROUNDS)
    if not rounds:
        raise c.bad("", f"should hold 1..{MAX_ROUNDS} rounds")
    for k, round_ in enumerate(rounds):
        r = c.at(f"[{k}].")
        r.dict_value(round_, "")
        world = r.integer(round_, "world", 1, MAX_WORLD_SIZE, " (constants.MAX_WORLD_SIZE)")
        r.flag(round_, "drop_last")
        most = _share_most(dataset_len, world) + dataset_len
        for rank, ranges in r.section(round_, "consumed").items():
            key = f"consumed.{rank}"
            if _rank_of(rank, world) is None:
                raise r.bad(key, f"names rank {rank!r}, not one of the round's ranks "
                            f"0..{world - 1}")
            end = 0
            for j, pair in enumerate(r.list_value(ranges, key)):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise r.bad(f"{key}[{j}]", f"should be [start, end], got {pair!r:.80}")
                start = r.int_value(pair[0], f"{key}[{j}][0]", 0, most,
                                    " (a share plus a dataset)")
                if start < end:
                    raise r.bad(f"{key}[{j}]", f"starts at {start}, inside the range before it "
                                f"(ranges must be sorted and disjoint)")
                end = r.int_value(pair[1], f"{key}[{j}][1]", start, most,
                                  " (a share plus a dataset)")
