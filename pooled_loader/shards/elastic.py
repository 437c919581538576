"""Resume a WebDataset epoch on another number of ranks or workers (elastic resume, counted mode).

Every (rank, worker) of counted mode reads contiguous *runs* of the epoch's stream:
``[shard, first, count]`` is ``count`` samples of ``urls[shard]`` from its sample ``first``. A
worker's state lists the runs it has not read yet (``"rest"``: what remains of its piece, plus
the samples its shuffle buffer holds, as runs of one). :func:`merge_stream_states` takes the
states of every (rank, worker) of one epoch and returns one *merged* state: all remaining runs,
in the epoch's order. It is a pure function of the states: every rank computes the same result.

A dataset that loads a merged state (``WebDataset.load_state_dict``, in each worker of each new
rank) takes its slot's share with :func:`slot_runs`: the remaining samples, ``R`` in all, are
split as counted mode splits an epoch: rank ``m`` of ``M`` gets ``R // M`` (the last ``R % M``
are not read, as counted mode leaves ``N % W`` unseen: every rank yields the same count), and its
workers contiguous pieces of that. The rest of the epoch is read in that order, without the
sample shuffle buffer. A state taken in this mode lists its own remaining runs again, so it can
be resumed (on the same or yet another world size) the same way.

Exact only when every sample counted was read (no ``on_error="skip"`` skips, shards as long as
counted): a state whose epoch skipped samples has no ``rest`` and is refused by the merge.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..core.constants import MAX_WORLD_SIZE
from ..core.state_checks import StateChecks
from .plan import slot_share

Run = list  # [shard index in urls, first sample, count]

__all__ = ["merge_stream_states", "slot_runs", "drop_first", "runs_from", "take_runs", "MERGED",
           "RUNS"]

MERGED = "merged"  # WebDataset state["mode"] of a merged state
RUNS = "runs"  # WebDataset state["mode"] of a state taken while reading runs
_SAME = ("seed", "shards", "samples_per_epoch", "shuffle_shards", "epoch")
MAX_RUNS = 1 << 24  # runs in a state: more than a real epoch's pieces and buffers could leave


def runs_from(order: Sequence[int], sizes: Sequence[int], shard: int, index: int,
              left: int) -> list[Run]:
    """The next `left` samples of the stream `order` (url indices, `sizes[url]` samples each)
    from sample `index` of its `shard`-th entry, as runs (wrapping round, as a worker does)."""
    runs = []
    while left > 0 and order:
        url = order[shard % len(order)]
        take = min(sizes[url] - index, left)
        if take > 0:
            runs.append([url, index, take])
            left -= take
        shard, index = shard + 1, 0
    return runs


def drop_first(runs: Sequence[Run], n: int) -> list[Run]:
    """`runs` without their first `n` samples."""
    out = []
    for url, first, count in runs:
        if n >= count:
            n -= count
            continue
        out.append([url, first + n, count - n])
        n = 0
    return out


def take_runs(runs: Sequence[Run], start: int, n: int) -> list[Run]:
    """Samples `start .. start + n - 1` of the concatenated `runs`."""
    out = []
    for url, first, count in runs:
        if n <= 0:
            break
        if start >= count:
            start -= count
            continue
        take = min(count - start, n)
        out.append([url, first + start, take])
        n -= take
        start = 0
    return out


def _slot_of(state: Any, c: StateChecks, first: dict, nstates: int) -> tuple[int, int]:
    """(rank, worker) of one (rank, worker)'s state, its counts checked; the world it names
    must have exactly as many slots as there are states."""
    world = c.integer(state, "world_size", 1, MAX_WORLD_SIZE, " (constants.MAX_WORLD_SIZE)")
    workers = c.integer(state, "num_workers", 1, nstates, f" (the {nstates} states given)")
    if (world, workers) != (first.get("world_size"), first.get("num_workers")):
        raise ValueError(f"merge_stream_states: {c.where} is from {world} rank(s) x {workers} "
                         f"worker(s), the first from {first.get('world_size')} x "
                         f"{first.get('num_workers')}")
    if world * workers != nstates:
        raise ValueError(f"merge_stream_states: expected one state per (rank, worker) of "
                         f"{world} x {workers}, got {nstates} states")
    return (c.integer(state, "rank", 0, world - 1, f" (the last of {world} ranks)"),
            c.integer(state, "worker", 0, workers - 1, f" (the last of {workers} workers)"))


def merge_stream_states(states: Sequence[dict],
                        checks: Optional[Sequence[StateChecks]] = None) -> dict:
    """One WebDataset state holding the rest of an epoch, from the states of all its (rank,
    worker) slots (a pure function). Raises ValueError naming what differs or is missing, or
    the key that is malformed (``checks[k]``: how to name state ``k``'s keys)."""
    if not states:
        raise ValueError("merge_stream_states: no state given")
    checks = checks or [StateChecks(f"merge_stream_states: state {k}")
                        for k in range(len(states))]
    first = states[0]
    slots = set()
    runs: list[Run] = []
    origin: list[tuple[int, int]] = []  # (state, run) each merged run comes from
    for k, (state, c) in enumerate(zip(states, checks)):
        if not isinstance(state, dict) or state.get("rest") is None:
            raise ValueError(
                f"merge_stream_states: state {k} has no remaining runs ('rest'): it is from "
                f"explicit mode (samples_per_epoch=), or its epoch skipped samples "
                f"(on_error='skip') or found a shard shorter than counted; resume it on the same "
                f"world size and num_workers instead")
        for key in _SAME:
            if state.get(key) != first.get(key):
                raise ValueError(f"merge_stream_states: state {k} has {key}="
                                 f"{state.get(key)!r}, state 0 has {first.get(key)!r}")
        slot = _slot_of(state, c, first, len(states))
        if slot in slots:
            raise ValueError(f"merge_stream_states: two states of rank {slot[0]}, worker "
                             f"{slot[1]}")
        slots.add(slot)
        c.count(state, "epoch")
        check_runs(state["rest"], c.count(state, "shards"), c.at("rest"))
        runs += [list(r) for r in state["rest"]]
        origin += [(k, j) for j in range(len(state["rest"]))]
    overlap = _first_overlap(runs)
    if overlap is not None:
        (k, j), (k2, j2) = origin[overlap[0]], origin[overlap[1]]
        raise checks[k].bad(f"rest[{j}]", f"{runs[overlap[0]]} overlaps run {j2} of state {k2}: "
                            f"those samples would be read twice")
    return {"version": first["version"], "mode": MERGED,
            **{key: first[key] for key in _SAME}, "shuffle_buffer": first.get("shuffle_buffer"),
            "runs": runs, "skipped": 0}


def slot_runs(runs: Sequence[Run], rank: int, world: int, worker: int,
              workers: int) -> tuple[list[Run], int]:
    """(runs, quota) of slot (rank, worker) when the samples of `runs` are split as counted mode
    splits an epoch."""
    start, quota = slot_share(sum(r[2] for r in runs), rank, world, worker, workers)
    return take_runs(runs, start, quota), quota


def _first_overlap(runs: Sequence[Run]) -> Optional[tuple[int, int]]:
    """Indices of two runs that share a sample (None: disjoint)."""
    order = sorted(range(len(runs)), key=lambda i: (runs[i][0], runs[i][1]))
    for a, b in zip(order, order[1:]):
        if runs[a][0] == runs[b][0] and runs[a][1] + runs[a][2] > runs[b][1]:
            return a, b
    return None


def check_runs(runs: Any, nurls: int, c: StateChecks,
               sizes: Optional[Sequence[int]] = None) -> None:
    """Refuse runs that name no shard, a sample outside it (``sizes``: each url's samples,
    where known), a sample twice, or too many runs to be real (``c``: names the list)."""
    c.list_value(runs, "", MAX_RUNS)
    for k, run in enumerate(runs):
        if not isinstance(run, list) or len(run) != 3:
            raise c.bad(f"[{k}]", f"should be [shard, first sample, count], got {run!r:.80}")
        url = c.int_value(run[0], f"[{k}][0]", 0, nurls - 1, " (the last shard)")
        size = None if sizes is None else sizes[url]
        why = f" (shard {url} has {size} samples)"
        first = c.int_value(run[1], f"[{k}][1]", 0, None if size is None else size - 1, why)
        c.int_value(run[2], f"[{k}][2]", 1, None if size is None else size - first, why)
    overlap = _first_overlap(runs)
    if overlap is not None:
        a, b = overlap
        raise c.bad(f"[{b}]", f"{runs[b]} overlaps [{a}] {runs[a]}: those samples would be "
                    f"read twice")
