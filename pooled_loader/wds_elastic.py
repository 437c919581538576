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

from typing import Any, Sequence

from .wds_plan import slot_share

Run = list  # [shard index in urls, first sample, count]

__all__ = ["merge_stream_states", "slot_runs", "drop_first", "runs_from", "MERGED"]

MERGED = "merged"  # WebDataset state["mode"] of a merged state
RUNS = "runs"  # WebDataset state["mode"] of a state taken while reading runs
_SAME = ("seed", "shards", "samples_per_epoch", "shuffle_shards", "epoch")


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


def _take(runs: Sequence[Run], start: int, n: int) -> list[Run]:
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


def merge_stream_states(states: Sequence[dict]) -> dict:
    """One WebDataset state holding the rest of an epoch, from the states of all its (rank,
    worker) slots (a pure function). Raises ValueError naming what differs or is missing."""
    if not states:
        raise ValueError("merge_stream_states: no state given")
    first = states[0]
    slots = set()
    runs: list[Run] = []
    for k, state in enumerate(states):
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
        world, workers = state.get("world_size"), state.get("num_workers")
        if (world, workers) != (first.get("world_size"), first.get("num_workers")):
            raise ValueError(f"merge_stream_states: state {k} is from {world} rank(s) x "
                             f"{workers} worker(s), state 0 from {first.get('world_size')} x "
                             f"{first.get('num_workers')}")
        slot = (state.get("rank"), state.get("worker"))
        if slot in slots:
            raise ValueError(f"merge_stream_states: two states of rank {slot[0]}, worker "
                             f"{slot[1]}")
        slots.add(slot)
        runs += [list(r) for r in state["rest"]]
    expected = {(r, w) for r in range(first["world_size"]) for w in range(first["num_workers"])}
    if slots != expected:
        raise ValueError(f"merge_stream_states: expected one state per (rank, worker) of "
                         f"{first['world_size']} x {first['num_workers']}; missing "
                         f"{sorted(expected - slots)}")
    return {"version": first["version"], "mode": MERGED,
            **{key: first[key] for key in _SAME}, "shuffle_buffer": first.get("shuffle_buffer"),
            "runs": runs, "skipped": 0}


def slot_runs(runs: Sequence[Run], rank: int, world: int, worker: int,
              workers: int) -> tuple[list[Run], int]:
    """(runs, quota) of slot (rank, worker) when the samples of `runs` are split as counted mode
    splits an epoch."""
    start, quota = slot_share(sum(r[2] for r in runs), rank, world, worker, workers)
    return _take(runs, start, quota), quota


def check_runs(runs: Any, nurls: int, where: str) -> None:
    """Refuse runs that name no shard, negative samples, or too many runs to be real."""
    if not isinstance(runs, list) or len(runs) > 1 << 24:
        raise ValueError(f"WebDataset state is corrupt: '{where}' should be a list of runs")
    for k, run in enumerate(runs):
        if not (isinstance(run, list) and len(run) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in run)
                and run[0] < nurls and run[2] > 0):
            raise ValueError(f"WebDataset state is corrupt: '{where}[{k}]' should be "
                             f"[shard < {nurls}, first sample, count > 0], got {run!r:.80}")
