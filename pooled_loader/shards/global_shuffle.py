"""Global shuffle for WebDataset (``shuffle="global"``): one permutation of all samples per
(seed, epoch), read sample by sample through the shard indexes (pooled_loader.shards.index).

Why: shard-order shuffling plus a buffer leaves an epoch's order close to the shards' order (a
dataset written sorted by class stays clumped; scripts/checks/shuffle_quality.py measures it). Reading
by offset makes every order as cheap to produce as any other, at one seek (local or cached
shard) or one HTTP Range request (remote, uncached) per sample.

Order and split
---------------
``N`` samples (the indexes' counts, shards in their listed order: global id ``g`` is sample
``g - first[s]`` of shard ``s``). Epoch ``e`` draws ``P = permutation(N)`` from numpy's
``default_rng([seed, e])``; all ranks draw the same one. As ``DistributedSampler`` without
padding, ``B = N // W`` samples per rank (every rank yields the same count; the last ``N % W``
positions go unseen this epoch). Rank ``r`` of ``W``, worker ``k`` of ``K``: the slot reads the
positions ``q_j = r + W * (k + K * j)`` for ``j = 0, 1, ...`` while ``k + K * j < B`` (its
"strided share", ``B // K`` long, +1 for ``k < B % K``), i.e. samples ``P[q_j]`` in that order.

State (``WebDataset.state_dict()`` in this mode; plain JSON, small, the same for any ``N``)::

    {"version": 1, "mode": "global", "seed": S, "epoch": E, "samples": N, "shards": n,
     "rank": r, "world_size": W, "worker": k, "num_workers": K,
     "consumed": c, "done": d, "skipped": x}

``consumed``: the slot has read the first ``c`` positions of its share (``q_0 .. q_{c-1}``);
``done``: it yielded ``d`` samples (``d < c`` after skipped ones, ``on_error="skip"``: a
skipped sample is replaced by the share's next position, wrapping round to ``q_0`` after the
last, so ``c`` may exceed the share's length). The epoch's consumed positions are therefore a
pure function of the states of all ``W * K`` slots, which is what an elastic resume on another
``W'``/``K'`` needs to re-deal the rest (``consumed_positions``).
"""

from __future__ import annotations

import bisect
import collections
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

from ..core.constants import MAX_WORLD_SIZE
from ..core.errors import SampleError, ShardIndexError
from .cache import is_cacheable
from .index import read_sample
from .samples import Sample, error_reason
from ..core.state_checks import StateChecks
from .state import check_keys

if TYPE_CHECKING:
    from .cache import ShardCache
    from .index import ShardIndex

__all__ = ["GlobalOrder", "GlobalReader", "consumed_positions", "use_cache", "fresh_state",
           "resumed_state", "STATE_KEYS"]

STATE_VERSION = 1
STATE_KEYS = ("version", "mode", "seed", "epoch", "samples", "shards", "rank", "world_size",
              "worker", "num_workers", "consumed", "done")
_STATE = StateChecks("WebDataset global-shuffle state")
OPEN_SHARDS = 8  # cached shards a worker keeps pinned between samples (most recently used)


class GlobalOrder:
    """Where each global sample lives, and each slot's share of an epoch's permutation."""

    def __init__(self, indexes: list["ShardIndex"], seed: int) -> None:
        self.indexes, self.seed = indexes, seed
        self.first = [0]
        for ix in indexes:
            self.first.append(self.first[-1] + len(ix))
        self.total = self.first[-1]

    def locate(self, g: int) -> tuple[int, int]:
        """(shard, sample of that shard) of global sample ``g``."""
        s = bisect.bisect_right(self.first, g) - 1
        return s, g - self.first[s]

    def share(self, epoch: int, rank: int, world: int, worker: int, nworkers: int) -> np.ndarray:
        """The global ids slot (rank, worker) reads this epoch, in order (module docstring)."""
        per_rank = self.total // world
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.total)
        return perm[rank + world * worker: world * per_rank: world * nworkers]


def use_cache(cache: Optional["ShardCache"], indexes: list["ShardIndex"]) -> bool:
    """Whether global reads go through ``cache``: only when every shard fits its budget
    (random samples from a smaller cache would evict and download a shard per sample)."""
    if cache is None:
        return False
    total = sum(ix.shard_bytes for ix in indexes)
    if cache.limit is not None and total > cache.limit:
        warnings.warn(f"WebDataset(shuffle='global'): the shards ({total} bytes) exceed "
                      f"cache_limit ({cache.limit}): samples are read by Range requests, not "
                      "cached", RuntimeWarning, stacklevel=3)
        return False
    return True


def consumed_positions(state: dict) -> range:
    """The permutation positions one slot's state has consumed (its first ``consumed`` share
    positions, capped at the share), as a range of positions of the epoch's permutation."""
    w, k, nk, r = state["world_size"], state["worker"], state["num_workers"], state["rank"]
    per_rank = state["samples"] // w
    share = len(range(k, per_rank, nk))
    start, step = r + w * k, w * nk
    return range(start, start + step * min(state["consumed"], share), step)


def fresh_state(*, seed: int, epoch: int, samples: int, shards: int, rank: int,
                world_size: int, worker: int, num_workers: int, skipped: int) -> dict:
    """The state of slot (``rank``, ``worker``) before its first sample of ``epoch``."""
    return {"version": STATE_VERSION, "mode": "global", "seed": seed, "epoch": epoch,
            "samples": samples, "shards": shards, "rank": rank, "world_size": world_size,
            "worker": worker, "num_workers": num_workers, "consumed": 0, "done": 0,
            "skipped": skipped}


def resumed_state(fresh: dict, resume: Optional[dict]) -> dict:
    """Where the slot whose ``fresh_state`` is ``fresh`` starts: there, or where ``resume`` (a
    state of the same slot and epoch) stopped. Raises ``ValueError`` when it does not fit."""
    state = dict(fresh)
    if resume is not None:
        check_fits(resume, state)
        state.update(consumed=int(resume["consumed"]), done=int(resume["done"]))
    return state


class GlobalReader:
    """Reads a slot's share of an epoch's permutation, one sample by offset at a time: from the
    shard's cached copy (``cache``: given only when every shard fits it, see ``use_cache``),
    else from its URL (a local seek or an HTTP Range request)."""

    def __init__(self, urls: list[str], indexes: list["ShardIndex"], seed: int,
                 cache: Optional["ShardCache"], *, retries: int, backoff_s: float,
                 max_sample_bytes: Optional[int] = None) -> None:
        self.urls, self.indexes, self.cache = urls, indexes, cache
        self.order = GlobalOrder(indexes, seed)
        self.retries, self.backoff_s = retries, backoff_s
        self.max_sample_bytes = max_sample_bytes

    def samples(self, state: dict, apply: Callable[[Sample], tuple[bool, Any]],
                fail: Callable[[str, str, BaseException], None]) -> Iterator[tuple[Any, dict]]:
        """``(output, state after it)`` for each sample left of the slot ``state`` describes
        (``resumed_state``). ``apply(sample)`` gives ``(ok, output)``; ``fail(url, what, exc)``
        raises, or counts a skip (``on_error="skip"``): a sample not ok is one skip either way,
        replaced by the share's next position."""
        state = dict(state)
        ids = self.order.share(state["epoch"], state["rank"], state["world_size"],
                               state["worker"], state["num_workers"])
        quota = len(ids)
        handles: collections.OrderedDict = collections.OrderedDict()
        idle = 0
        try:
            while state["done"] < quota:
                g = int(ids[state["consumed"] % quota])
                state["consumed"] += 1
                ok, out = self._read(handles, *self.order.locate(g), apply, fail)
                if not ok:
                    state["skipped"] += 1
                    idle += 1
                    if idle > quota:
                        raise SampleError(f"no usable sample in a whole pass over this worker's "
                                          f"{quota} samples; {state['skipped']} skipped")
                    continue
                idle = 0
                state["done"] += 1
                yield out, dict(state)
        finally:
            for h in handles.values():
                h.close()

    def _read(self, handles: collections.OrderedDict, shard: int, i: int,
              apply: Callable[[Sample], tuple[bool, Any]],
              fail: Callable[[str, str, BaseException], None]) -> tuple[bool, Any]:
        url, offset = self.urls[shard], self.indexes[shard].offsets[i]
        try:
            src = self._source(handles, shard)
            sample = read_sample(src, self.indexes[shard], i, name=url, retries=self.retries,
                                 backoff_s=self.backoff_s,
                                 max_sample_bytes=self.max_sample_bytes)
        except ShardIndexError:
            raise  # not one bad sample: skipping would repeat others in place of the shard's
        except Exception as exc:  # noqa: BLE001 - reported with the shard and offset
            fail(url, f"sample at byte {offset}: {error_reason(exc)}", exc)
            return False, None
        sample["__url__"] = url
        return apply(sample)

    def _source(self, handles: collections.OrderedDict, shard: int) -> str:
        """What to read shard ``shard`` from: its cached copy (kept pinned among the last
        ``OPEN_SHARDS``), else its URL."""
        url = self.urls[shard]
        if self.cache is None:
            return url
        if shard in handles:
            handles.move_to_end(shard)
            return handles[shard].path
        ix = self.indexes[shard]
        h = self.cache.open(url, size=ix.shard_bytes, sha256=ix.sha256) \
            if is_cacheable(url) else None
        if h is None:
            return url
        handles[shard] = h
        if len(handles) > OPEN_SHARDS:
            handles.popitem(last=False)[1].close()
        return h.path


def check_complete(state: dict) -> None:
    """Raise ``ValueError`` saying what is missing when ``state`` is not a whole state, or
    naming the key whose value it cannot hold: a slot of its world, and counts within the
    slot's share (``done``) and the positions it can have passed (``consumed``)."""
    check_keys(state, STATE_KEYS, STATE_VERSION, "WebDataset global-shuffle state")
    c = _STATE
    c.seed_value(state["seed"], "seed")
    c.count(state, "epoch")
    c.count(state, "shards")
    samples = c.count(state, "samples")
    world = c.integer(state, "world_size", 1, MAX_WORLD_SIZE, " (constants.MAX_WORLD_SIZE)")
    c.integer(state, "rank", 0, world - 1, f" (the last of {world} ranks)")
    workers = c.integer(state, "num_workers", 1)
    worker = c.integer(state, "worker", 0, workers - 1, f" (the last of {workers} workers)")
    share = max(samples // world - worker + workers - 1, 0) // workers  # len(range(k, B, K))
    done = c.count(state, "done", share, " (the samples of this slot's share)")
    c.count_value(state.get("skipped", 0), "skipped")
    # a state is taken after a sample: before each of the `done`, at most `share` skips
    c.int_value(state["consumed"], "consumed", done, done * (share + 1),
                " ('done' samples, each after at most a pass of skipped ones)")


def check_fits(state: dict, mine: dict) -> None:
    """Raise ``ValueError`` saying what differs when ``state`` is not this slot's."""
    check_complete(state)
    differ = [f"{k}: state {state[k]!r}, dataset {mine[k]!r}" for k in
              ("seed", "epoch", "samples", "shards", "rank", "world_size", "worker",
               "num_workers") if state[k] != mine[k]]
    if differ:
        raise ValueError("WebDataset state does not fit this dataset: " + "; ".join(differ))
