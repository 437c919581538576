"""The checkpoint state of a WebDataset worker in counted and explicit mode (``shuffle="shards"``):
what it records, how it is written, and the checks that a loaded one is whole and fits.

``WebDataset.state_dict()`` gives this process's position after the last sample its iterator
yielded, and ``load_state_dict(state)`` before ``iter()`` continues from it. A loader calls them
inside each worker (every (rank, worker) reads its own piece and keeps its own state). The state
(plain JSON data) records the epoch, the shard in this worker's cycle, the byte offset of its next
sample (local files seek to it; remote ones ask for it with a Range request), the round and
counters of pooled_loader.webdataset's epoch policy, and the shuffle RNG. The **shuffle buffer is
stored**, as the positions ``(shard, byte offset, index)`` of the samples it holds (not their
bytes): a resume reads those samples again (one seek or Range request each) and continues with
the same RNG state, so the resumed order is exactly the uninterrupted one. Consumed shards are
never read again. Compressed shards (``.tar.gz``) have no usable byte offsets: they resume by
reading the current shard from its start and passing over the samples already read. A state
taken in another epoch than the dataset's at ``iter()`` (``set_epoch`` after
``load_state_dict``) is ignored: the epoch starts afresh (with a warning if the state was
mid-epoch). A state from another rank, worker, worker count, seed or shard list raises
``ValueError`` saying what differs.

Layout::

    {"version": 1, "epoch": E, "skipped": x, "rank": r, "world_size": W, "worker": k,
     "num_workers": K, "seed": S, "shards": n, "samples_per_epoch": N or null,
     "shuffle_shards": bool, "shuffle_buffer": b, "quota": q, "done": d,
     "position": {"shard", "offset", "index", "visits", "got", "idle"} or null,
     "round": {"left", "count", "before", "mark", "draining"},
     "buffer": [[shard, offset, index], ...], "rng": [version, [625 ints], gauss] or null,
     "rest": runs or null}

``rest`` and the ``"merged"``/``"runs"`` modes are pooled_loader.shards.elastic's (resume on
another world size); ``shuffle="global"`` has its own state (pooled_loader.shards.global_shuffle).
A loaded state is untrusted: every count is checked for type and range before it is used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import elastic as wds_elastic
from .samples import is_local_tar, local_sample_starts
from ..core.state_checks import StateChecks

__all__ = ["STATE_VERSION", "Position", "ShareCursor", "cursor_state", "cursor_from_state",
           "check_state_values", "check_keys", "check_complete", "check_fits", "check_runs_state"]

STATE_VERSION = 1
_POSITION_KEYS = ("shard", "offset", "index", "visits", "got", "idle")
_ROUND_KEYS = ("left", "count", "before", "mark", "draining")


@dataclass
class Position:
    """Where one worker's raw stream stands: the next sample to read is in ``shards[shard]`` at
    byte ``offset`` (``None``: unknown, compressed shard) after ``index`` samples of it."""
    shard: int
    offset: Optional[int] = 0
    index: int = 0
    visits: int = 0  # shard visits finished
    got: bool = False  # this visit yielded a sample
    idle: int = 0  # consecutive visits that yielded nothing


@dataclass
class ShareCursor:
    """Where one worker stands in its share of the epoch (``quota`` samples), as it stood at the
    last sample it yielded: everything ``state_dict()`` needs. It counts the samples yielded
    (``done``), the rounds over its shards (``rounds``) and the raw samples still to read in
    this one; ``pos`` is the raw stream's place in the shards. (Not the loader's epoch position,
    ``resume.state.Progress``.)"""
    quota: int
    pos: Position
    rng: random.Random
    done: int = 0  # samples yielded this epoch
    round_left: int = 0  # raw samples still to read in this round (WebDataset._iter_shards)
    rounds: int = 0
    before: int = 0  # `done` when the round started
    mark: int = 0  # `pos.visits` when a round last yielded something
    draining: bool = False
    buffer: list = field(default_factory=list)  # samples held by the shuffle buffer
    held: list = field(default_factory=list)  # their [shard, offset, index], never mutated
    start: tuple = (0, 0)  # (shard, sample) where this worker's piece begins



_STATE = StateChecks("WebDataset state")
_BLOCK = 512  # tar's block: every member (so every sample) starts on one
_END_MARKER = 2 * _BLOCK  # a tar ends with two zero blocks: no sample starts in them


def check_state_values(state: dict, shuffle_buffer: int) -> None:
    """Types and ranges of a saved state's values (ValueError naming the key): a negative or
    oversized count would yield more than this worker's quota (breaking the equal counts that
    keep DDP from hanging) or skip forever."""
    c = _STATE
    c.count(state, "epoch")
    c.count_value(state.get("skipped", 0), "skipped")
    quota = c.count(state, "quota")
    done = c.count(state, "done", quota, " ('quota': the samples of this worker's epoch)")
    pos = state["position"]
    if pos is None:
        return
    c.dict_value(pos, "position")
    for key in ("shard", "index", "visits", "idle"):
        c.count_value(pos[key], f"position.{key}")
    c.flag_value(pos["got"], "position.got")
    _offset(pos["offset"], "position.offset", None)
    c.dict_value(state["round"], "round")
    c.count(state, "round.left", quota - done, " (the samples this worker has left)")
    c.count(state, "round.before", done, " ('done')")
    c.count(state, "round.count")
    c.count(state, "round.mark", pos["visits"], " ('position.visits')")
    c.flag(state, "round.draining")
    buffer = state["buffer"]
    if not isinstance(buffer, list) or len(buffer) > max(shuffle_buffer, 0):
        raise c.bad("buffer", f"should be a list of at most {shuffle_buffer} (shard, offset, "
                    f"index) entries")
    for k, entry in enumerate(buffer):
        if not isinstance(entry, list) or len(entry) != 3:
            raise c.bad(f"buffer[{k}]", "should be [shard, offset, index]")
        c.count_value(entry[0], f"buffer[{k}].shard")
        _offset(entry[1], f"buffer[{k}].offset", None)
        c.count_value(entry[2], f"buffer[{k}].index")
    _check_rng(state["rng"])


def _offset(value: Any, key: str, shard_bytes: Optional[int]) -> None:
    """A sample's byte offset: null (a compressed shard), or a tar block inside the shard
    (``shard_bytes``: its size, where known), before its end-of-archive marker."""
    if value is None:
        return
    most = None if shard_bytes is None else max(shard_bytes - _END_MARKER, 0)
    _STATE.count_value(value, key, most, f" (the shard has {shard_bytes} bytes, the last "
                       f"{_END_MARKER} its end-of-archive marker)")
    if value % _BLOCK:
        raise _STATE.bad(key, f"is {value}: not a multiple of {_BLOCK}, so no tar member "
                         f"starts there")


def _check_rng(rng: Any) -> None:
    """null, or Python's ``random.getstate()`` as a list: [3, 625 words, gauss or null]."""
    if rng is None:
        return
    ok = (isinstance(rng, list) and len(rng) == 3 and rng[0] == 3
          and isinstance(rng[1], list) and len(rng[1]) == 625
          and all(isinstance(w, int) and not isinstance(w, bool) and 0 <= w < 1 << 32
                  for w in rng[1]) and rng[1][-1] <= 624
          and (rng[2] is None or type(rng[2]) is float))
    if not ok:
        raise _STATE.bad("rng", "should be null or [3, 625 words below 2**32 (the last at "
                         "most 624), null or a float]")


def cursor_state(cur: ShareCursor, keep_rng: bool) -> dict:
    """The part of a state that ``cur`` holds. ``keep_rng``: store the shuffle RNG (625
    numbers, so only when a shuffle buffer draws from it)."""
    pos = cur.pos
    rng = None
    if keep_rng:
        version, internal, gauss = cur.rng.getstate()
        rng = [version, list(internal), gauss]
    return {"quota": cur.quota, "done": cur.done,
            "position": {k: getattr(pos, k) for k in _POSITION_KEYS},
            "round": {"left": cur.round_left, "count": cur.rounds, "before": cur.before,
                      "mark": cur.mark, "draining": cur.draining},
            "buffer": cur.held[:], "rng": rng}


def cursor_from_state(state: dict, quota: int, rng: random.Random) -> ShareCursor:
    """The ``ShareCursor`` a checked ``state`` describes, with ``rng`` set to its RNG state. Its
    shuffle buffer is left empty: the caller reads the samples of ``state["buffer"]`` again."""
    p, r = state["position"], state["round"]
    if state["rng"] is not None:
        version, internal, gauss = state["rng"]
        rng.setstate((version, tuple(internal), gauss))
    return ShareCursor(quota, Position(p["shard"], p["offset"], p["index"], p["visits"],
                                       bool(p["got"]), p["idle"]), rng,
                       done=state["done"], round_left=r["left"], rounds=r["count"],
                       before=r["before"], mark=r["mark"], draining=bool(r["draining"]))


def check_keys(state: dict, keys: Sequence[str], version: int,
               what: str = "WebDataset state") -> None:
    """Raise ``ValueError`` naming what is missing unless ``state`` has every one of ``keys``
    (``"version"`` among them), or naming its version unless that is ``version``."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"{what} is incomplete: missing {missing}")
    if state["version"] != version:
        raise ValueError(f"{what} version {state['version']!r} is not {version}: written by "
                         "another version of pooled_loader")


def check_complete(state: dict, shuffle_buffer: int) -> None:
    """Raise ``ValueError`` saying what is missing, or which value is corrupt, unless ``state``
    is a whole state of this version (a merged or runs state: its own keys, checked by
    ``check_runs_state``)."""
    runs_mode = state.get("mode") in (wds_elastic.MERGED, wds_elastic.RUNS)
    required = ("version", "epoch") + (
        ("runs",) if state.get("mode") == wds_elastic.MERGED else ("quota", "done", "position"))
    check_keys(state, required, STATE_VERSION)
    if runs_mode:
        return
    if state["position"] is not None:
        missing = [k for k in ("round", "buffer", "rng") if k not in state]
        missing += [f"position.{k}" for k in _POSITION_KEYS if k not in state["position"]]
        if missing:
            raise ValueError(f"WebDataset state is incomplete: missing {missing}")
    check_state_values(state, shuffle_buffer)


def check_runs_state(state: dict, mine: dict, nurls: int, shuffle_buffer: int,
                     sizes: Optional[Sequence[int]] = None) -> None:
    """Raise ``ValueError`` unless a merged state (``wds_elastic.merge_stream_states``), or one
    taken while reading one, fits the dataset whose configuration is ``mine`` (``sizes``: each
    url's sample count, which the runs must lie in)."""
    keys = ["seed", "shards", "samples_per_epoch", "shuffle_shards"]
    if state["mode"] == wds_elastic.RUNS:  # this slot's own runs: the same slot only
        keys += ["rank", "world_size", "worker", "num_workers"]
    differ = [f"{k}: state {state.get(k)!r}, dataset {mine[k]!r}" for k in keys
              if state.get(k) != mine[k]]
    if differ:
        raise ValueError("WebDataset state does not fit this dataset: " + "; ".join(differ))
    key = "runs" if state["mode"] == wds_elastic.MERGED else "rest"
    wds_elastic.check_runs(_STATE.get(state, key), nurls, _STATE.at(key), sizes)
    if state["mode"] == wds_elastic.RUNS:
        check_state_values({**state, "position": None}, shuffle_buffer)
    else:
        _STATE.count(state, "epoch")


def check_fits(state: dict, mine: dict, quota: int, shards: Sequence[str],
               index_of: dict, counts: Optional[dict]) -> None:
    """Raise ``ValueError`` saying what differs when ``state`` is not this worker's (``mine``:
    its configuration, ``quota`` its samples this epoch, ``shards`` the shards it reads), or
    naming the position (and shuffle buffer entry) that is not a sample of its shard: sample
    numbers within its count (``counts``: samples per url, counted mode) and byte offsets
    where that sample begins (``_sample_offset``; ``index_of``: the shard indexes)."""
    differ = [f"{k}: state {state[k]!r}, dataset {v!r}" for k, v in mine.items()
              if k in state and state[k] != v]
    if state["quota"] != quota:
        differ.append(f"samples for this worker: state {state['quota']}, dataset {quota}")
    pos = state["position"]
    if not 0 <= pos["shard"] < max(len(shards), 1):
        differ.append(f"shard index {pos['shard']} out of range (worker reads {len(shards)})")
    if differ:
        raise ValueError("WebDataset state does not fit this dataset: " + "; ".join(differ))
    entries = [("position.", pos["shard"], pos["offset"], pos["index"], 0)]
    for k, (shard, offset, index) in enumerate(state["buffer"]):
        if shard >= len(shards):
            raise _STATE.bad(f"buffer[{k}].shard", f"is {shard}: the worker reads "
                             f"{len(shards)} shards")
        entries.append((f"buffer[{k}].", shard, offset, index, 1))
    starts: dict[str, Optional[list[int]]] = {}  # per local shard, read once
    for key, shard, offset, index, held in entries:
        url = shards[shard]
        count = None if counts is None else counts.get(url)
        if count is not None:  # a held sample is one of the shard's; the position may be past
            _STATE.count_value(index, f"{key}index", count - held,
                               f" (shard {url} has {count} samples)")
        if offset is None:
            continue
        ix = index_of.get(url)
        if url not in starts:
            starts[url] = local_sample_starts(url) if is_local_tar(url) else None
        _sample_offset(offset, index, f"{key}offset", url, starts[url], ix)


def _sample_offset(offset: int, index: int, key: str, url: str, starts: Optional[list[int]],
                   ix: Any) -> None:
    """``offset`` must be where sample ``index`` of shard ``url`` begins (``starts``: a local
    tar's sample offsets and its end, from its headers; ``ix``: its index), or (sample 0) the
    shard's start. A remote shard without an index is only checked to be a tar block."""
    if index == 0 and offset == 0:
        return
    if starts is not None:
        if index >= len(starts) or starts[index] != offset:
            where = (f"sample {index} begins at byte {starts[index]}" if index < len(starts)
                     else f"it has {len(starts) - 1} samples")
            raise _STATE.bad(key, f"is {offset}, but in {url} {where}")
        return
    _offset(offset, key, None if ix is None else ix.shard_bytes)
    if ix is not None and index < len(ix.offsets) and ix.offsets[index] != offset:
        raise _STATE.bad(key, f"is {offset}, but {url}'s index puts sample {index} at byte "
                         f"{ix.offsets[index]}")
