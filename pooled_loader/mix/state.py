"""A mix's state: its layout, its checks, the elastic merge, the accounting (`pooled_loader.mix`).

One (rank, worker) *slot* of a mix saves (``Mix.state_dict()``, inside its worker)::

    {"format": FORMAT, "sources": [names], "seed", "epoch", "stop", "samples_per_epoch",
     "batch_size", "shuffle", "drop_last", "rank", "world_size", "worker", "num_workers",
     "schedule": [[from_epoch, {name: weight} or null (a callable)], ...],
     "passed": positions of the slot's share passed (yielded, failed or skipped),
     "ended": its epoch has ended, "rounds": the elastic plan (below),
     "per_source": {name: {"samples", "tokens", "failed", "exhausted",
                           "passes", "items", "state"}}}

``samples``/``tokens``/``failed`` are what the slot delivered this epoch (the loader sums the
delivered states of its workers for ``stats()["mix"]``); ``passes``/``items``/``state`` are where
an iterable source's iterator stands (restarts, items taken this pass, its own ``state_dict()``).

Elastic: :func:`merge_mix_states` turns the states of every slot of one epoch into one *merged*
state that appends a round ``{"slots", "batch", "passed": {slot: count}}`` to the plan; a slot that
loads it reads its share of the positions no earlier slot passed (``order.rest_after``). An
iterable source is split by its own (rank, worker) mechanism, so which of its items a slot holds
does not follow from the positions: its slots' own states are merged by its own elastic merge
(``shards.elastic.merge_stream_states``: a WebDataset in counted mode lists its remaining samples),
and each slot of the resumed mix reads a contiguous piece of those (:func:`slot_source_state`),
none left out; a source without such a state makes the mix unmergeable (the merge names it).

Every number read from a state is checked (type and range) by ``core.state_checks`` and a bad one
raises ``StateMismatch`` (a ValueError) naming its dotted key. Imports ``core.state_checks`` and
``shards.elastic`` only (``resume/elastic.py`` imports this module for the merge).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..core.state_checks import StateChecks
from ..shards.elastic import RUNS, merge_stream_states, take_runs

__all__ = ["FORMAT", "MERGED", "check_state", "merge_mix_states", "account", "is_mix_state"]

FORMAT = "pooled_loader.mix/1"
MERGED = "pooled_loader.mix.merged/1"
MAX_ROUNDS = 64  # elastic resumes within one epoch; bounds what a (hostile) state can replay
MAX_SLOTS = 1 << 20  # ranks x workers
MAX_RUNS_OF_SOURCE = 1 << 24  # runs of an iterable source's merged state (shards.elastic.MAX_RUNS)
MAX_COUNT = 1 << 53  # any position or count: beyond it floats (JSON) are no longer exact
SAME = ("sources", "seed", "stop", "samples_per_epoch", "batch_size", "shuffle", "drop_last",
        "iterable")
COUNTS = ("samples", "tokens", "failed", "passes", "items")
STARVE_TIME_FACTOR = 2.0
"""Ratio. A source whose share of the mix's read time exceeds this multiple of its share of the
samples, and half of the read time, starves the mix (report() names it)."""


def is_mix_state(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") in (FORMAT, MERGED)


FIX = "pass a state saved by PooledLoader.state_dict() with this Mix (a JSON round trip is fine)"
CHECKS = StateChecks("Mix state", fix=FIX)
"""The checks of a slot's or a merged state loaded by a Mix (``core.state_checks``: each bad
key named by its dotted path)."""


def check_weights(weights: Any, names: Sequence[str], where: str) -> dict[str, float]:
    """A dict name -> finite weight >= 0 naming every source, some weight positive."""
    if not isinstance(weights, dict) or set(weights) != set(names):
        raise ValueError(f"{where}: weights must be a dict naming each source once "
                         f"({sorted(names)}), got {weights!r:.120}")
    out = {}
    for name in names:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                or w < 0:
            raise ValueError(f"{where}: the weight of {name!r} must be a finite number >= 0, "
                             f"got {w!r:.80}")
        out[name] = float(w)
    if not any(out.values()):
        raise ValueError(f"{where}: every weight is 0: no source would be drawn")
    return out


def check_schedule(state: dict, names: Sequence[str], c: StateChecks = CHECKS) -> list:
    value = c.list_value(c.get(state, "schedule"), "schedule", 4096)
    if not value:
        raise c.bad("schedule", "should be a list of [from_epoch, weights], not empty")
    out, last = [], -1
    for k, entry in enumerate(value):
        key = f"schedule[{k}]"
        if not isinstance(entry, list) or len(entry) != 2:
            raise c.bad(key, "should be [from_epoch, weights or null]")
        first = entry[0]
        if isinstance(first, bool) or not isinstance(first, int) or first <= last \
                or first > MAX_COUNT or (k == 0 and first != 0):
            raise c.bad(key, f"has from_epoch {first!r:.40}: epochs must increase from 0")
        last = first
        weights = None
        if entry[1] is not None:
            try:
                weights = check_weights(entry[1], names, "Mix state")
            except ValueError as exc:
                raise c.bad(key, str(exc)) from None
        out.append([first, weights])
    return out


def check_rounds(state: dict, c: StateChecks = CHECKS) -> list[dict]:
    rounds = c.list_value(c.get(state, "rounds"), "rounds", MAX_ROUNDS)
    for k, round_ in enumerate(rounds):
        r = c.at(f"rounds[{k}].")
        if not isinstance(round_, dict):
            raise r.bad("", "should be {slots, batch, passed}")
        slots = r.integer(round_, "slots", 1, MAX_SLOTS)
        r.integer(round_, "batch", 1, MAX_COUNT)
        passed = round_.get("passed")
        if not isinstance(passed, dict) or len(passed) > slots:
            raise r.bad("passed", "should map each slot to its count")
        for slot, count in passed.items():
            if not (isinstance(slot, str) and slot.isdigit() and int(slot) < slots):
                raise r.bad("passed", f"names slot {slot!r:.20} of {slots}")
            r.count_value(count, f"passed.{slot}", MAX_COUNT)
    return rounds


def check_state(state: Any, mine: dict, slot: tuple[int, int, int, int] | None,
                c: StateChecks = CHECKS) -> dict:
    """`state` validated against this mix's configuration `mine` (the SAME keys) and, for a
    slot's own state, `slot` = (rank, world_size, worker, num_workers). Returns it. A bad value
    raises `StateMismatch` (a ValueError) naming its key; `c` says whose state it is."""
    if not isinstance(state, dict):
        raise ValueError(f"Mix state must be a dict, got {type(state).__name__}")
    fmt = state.get("format")
    if fmt not in (FORMAT, MERGED):
        raise c.bad("format", f"is {fmt!r:.60}, expected {FORMAT!r} or {MERGED!r}")
    for key in SAME:
        if key == "drop_last" and key not in state:
            continue  # saved before Mix had drop_last: its positions read the same
        if c.get(state, key) != mine[key]:
            raise ValueError(f"Mix state does not fit this Mix: it was saved with {key}="
                             f"{state[key]!r:.120}, this Mix has {key}={mine[key]!r:.120}")
    names = mine["sources"]
    c.count(state, "epoch", MAX_COUNT)
    check_schedule(state, names, c)
    check_rounds(state, c)
    per = c.get(state, "per_source")
    if not isinstance(per, dict) or set(per) != set(names):
        raise c.bad("per_source", f"should hold one entry per source ({names})")
    sources = {name: c.at(f"per_source.{name}.") for name in names}  # a name may hold a dot
    for name, s in sources.items():
        s.dict_value(per[name], "")
    if fmt == MERGED:
        for name, s in sources.items():
            for count in ("samples", "tokens", "failed"):
                s.count(per[name], count, MAX_COUNT)
        for name in mine["iterable"]:
            check_source_runs(state, name, c)
        return state
    here = (c.count(state, "rank", MAX_SLOTS - 1), c.integer(state, "world_size", 1, MAX_SLOTS),
            c.count(state, "worker", MAX_SLOTS - 1),
            c.integer(state, "num_workers", 1, MAX_SLOTS))
    if slot is not None and here != slot:
        raise ValueError(f"Mix state does not fit this slot: it is rank {here[0]} of {here[1]}, "
                         f"worker {here[2]} of {here[3]}; this is rank {slot[0]} of {slot[1]}, "
                         f"worker {slot[2]} of {slot[3]}. Resume on the same world size and "
                         f"num_workers, or merge every rank's state (merge_rank_states)")
    passed = c.count(state, "passed", MAX_COUNT)
    if mine["samples_per_epoch"] is not None and passed > mine["samples_per_epoch"]:
        raise c.bad("passed", f"is {passed}, more than samples_per_epoch")
    c.flag(state, "ended")
    for name, s in sources.items():
        for count in COUNTS:
            s.count(per[name], count, MAX_COUNT)
        for count in ("items", "passes"):  # each item or restart took one of its positions
            if per[name][count] > passed:
                raise s.bad(count, f"is more than the {passed} positions passed")
        s.flag(per[name], "exhausted")
        s.get(per[name], "state")
    return state


# -- elastic --------------------------------------------------------------------------------------
def merge_mix_states(states: Sequence[dict],
                     checks: Sequence[StateChecks] | None = None) -> dict:
    """One merged state for the rest of an epoch, from the states of all its (rank, worker)
    slots (a pure function). Raises ValueError naming what differs or is missing, the key that
    is malformed (``checks[k]``: how to name state ``k``'s keys), or the iterable sources that
    make the mix unmergeable."""
    if not states:
        raise ValueError("merge_mix_states: no state given")
    checks = checks or [StateChecks(f"merge_mix_states: state {k}", fix=FIX)
                        for k in range(len(states))]
    first = states[0]
    for k, state in enumerate(states):
        if not is_mix_state(state) or state.get("format") != FORMAT:
            raise ValueError(f"merge_mix_states: state {k} is not a Mix slot's state")
    mine = {key: first.get(key) for key in SAME}
    slots, world, workers = {}, first.get("world_size"), first.get("num_workers")
    for k, (state, c) in enumerate(zip(states, checks)):
        check_state(state, mine, None, c)
        for key in ("epoch", "schedule", "rounds", "world_size", "num_workers"):
            if state[key] != first[key]:
                raise ValueError(f"merge_mix_states: state {k} has {key}={state[key]!r:.80}, "
                                 f"state 0 has {first[key]!r:.80}")
        slot = state["rank"] + world * state["worker"]
        if slot in slots:
            raise ValueError(f"merge_mix_states: two states of rank {state['rank']}, worker "
                             f"{state['worker']}")
        slots[slot] = state
    expected = world * workers
    if len(slots) != expected:
        missing = sorted(set(range(expected)) - set(slots))
        raise ValueError(f"merge_mix_states: expected one state per (rank, worker) of "
                         f"{world} x {workers}; missing slots {missing}")
    if len(first["rounds"]) >= MAX_ROUNDS:
        raise ValueError(f"merge_mix_states: more than {MAX_ROUNDS} resumes within one epoch")
    round_ = {"slots": expected, "batch": first["batch_size"],
              "passed": {str(s): st["passed"] for s, st in sorted(slots.items())}}
    per = {name: {c: sum(st["per_source"][name][c] for st in slots.values())
                  for c in ("samples", "tokens", "failed")} for name in mine["sources"]}
    for name in mine["iterable"]:
        per[name]["state"] = _merge_source(name, [slots[s]["per_source"][name]["state"]
                                                  for s in sorted(slots)])
    return {"format": MERGED, **mine, "epoch": first["epoch"], "schedule": first["schedule"],
            "rounds": first["rounds"] + [round_], "per_source": per,
            "ended": all(st["ended"] for st in slots.values())}


def _merge_source(name: str, states: list) -> dict:
    """An iterable source's merged state: its own elastic merge of every slot's state (a
    `pooled_loader.webdataset.WebDataset` in counted mode lists its remaining samples)."""
    if not all(isinstance(st, dict) and isinstance(st.get("rest"), list) for st in states):
        raise ValueError(
            f"merge_mix_states: source {name!r} is an iterable dataset without an elastic state "
            f"(remaining samples, 'rest'): only pooled_loader.webdataset.WebDataset in counted "
            f"mode, whose epoch skipped no sample, resumes on another world size; a mix with "
            f"{name!r} resumes on the same world size and num_workers")
    try:
        return merge_stream_states(states)
    except ValueError as exc:
        raise ValueError(f"merge_mix_states: source {name!r}: {exc}") from None


def check_source_runs(state: dict, name: str, c: StateChecks = CHECKS) -> list:
    """The runs (``[shard, first, count]``) of iterable source `name` in a merged state."""
    s = c.at(f"per_source.{name}.")
    key = "state.runs"
    runs = s.list_value(s.get(state["per_source"][name], key), key, MAX_RUNS_OF_SOURCE)
    for k, run in enumerate(runs):
        if not (isinstance(run, list) and len(run) == 3 and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNT
                for v in run)):
            raise s.bad(f"{key}[{k}]", "should be [shard, first sample, count]")
    return runs


def slot_source_state(merged: dict, slot: int, slots: int,
                      where: tuple[int, int, int, int]) -> dict:
    """What slot `slot` of `slots` (rank, world, worker, workers = `where`) reads of an iterable
    source's merged state: a contiguous piece of its remaining samples, none left out (a
    WebDataset state in "runs" mode: that slot's own runs)."""
    runs = merged["runs"]
    total = sum(r[2] for r in runs)
    start, end = total * slot // slots, total * (slot + 1) // slots
    rank, world, worker, workers = where
    keep = ("version", "epoch", "seed", "shards", "samples_per_epoch", "shuffle_shards",
            "shuffle_buffer")
    return {**{k: merged.get(k) for k in keep}, "skipped": 0, "rank": rank,
            "world_size": world, "worker": worker, "num_workers": workers,
            "quota": end - start, "done": 0, "position": None, "mode": RUNS,
            "rest": take_runs(runs, start, end - start)}


# -- accounting -----------------------------------------------------------------------------------
def account(states: Sequence[Any], names: Sequence[str], weights: dict[str, float] | None,
            read_s: dict[str, float], with_lengths: set[str]) -> dict:
    """``stats()["mix"]``: per source the samples, tokens (None unless `with_lengths` names it)
    and failures of the delivered slot `states` (this epoch), the realised and requested
    fractions and the read seconds; `notes`
    for report(): exhausted, failing and starving sources."""
    totals = {n: {"samples": 0, "tokens": 0, "failed": 0, "exhausted": False} for n in names}
    for state in states:
        if not is_mix_state(state) or state.get("format") != FORMAT:
            continue
        for name in names:
            got, into = state["per_source"].get(name, {}), totals[name]
            for count in ("samples", "tokens", "failed"):
                into[count] += got.get(count, 0)
            into["exhausted"] = into["exhausted"] or bool(got.get("exhausted"))
    samples = sum(t["samples"] for t in totals.values())
    wsum = sum(weights.values()) if weights else 0.0
    time_sum = sum(read_s.get(n, 0.0) for n in names)
    notes = []
    for name, t in totals.items():
        if name not in with_lengths:
            t["tokens"] = None  # its items' lengths are not known
        t["fraction"] = t["samples"] / samples if samples else 0.0
        t["weight_fraction"] = weights[name] / wsum if wsum else None
        t["read_s"] = read_s.get(name, 0.0)
        time_share = t["read_s"] / time_sum if time_sum else 0.0
        if samples and time_share > 0.5 and time_share > STARVE_TIME_FACTOR * t["fraction"]:
            notes.append(f"Mix: source {name!r} STARVES the mix: it gives {t['fraction']:.0%} of "
                         f"the samples but takes {time_share:.0%} of the mix's read time "
                         f"({1e3 * t['read_s'] / max(t['samples'], 1):.2f} ms a sample): "
                         f"speed up its reads (more workers, a cache, local shards).")
        if t["failed"]:
            notes.append(f"Mix: source {name!r} failed {t['failed']} read(s) (skipped, "
                         f"on_error='skip'); the other sources kept their draws.")
        if t["exhausted"]:
            notes.append(f"Mix: source {name!r} is exhausted this epoch.")
    return {"sources": totals, "samples": samples, "notes": notes}
