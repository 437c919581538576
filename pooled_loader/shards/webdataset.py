"""WebDataset-format tar shards as an ``IterableDataset`` that never hangs DDP.

A shard's tar members are grouped into samples, counted and located by
``pooled_loader.shards.samples`` (as ``webdataset.tariterators`` groups them; a corrupt or
truncated shard is an error, never a hang or silently lost samples); this module decides *which*
samples each (rank, worker) reads.

Epoch policy
------------
Every rank yields exactly the same number of samples per epoch, and every rank's workers split
that number the same way, so every rank produces the same number of batches (no DDP hang at the
last step) even with uneven shards or fewer shards than ranks x workers.

Counted mode (default, ``samples_per_epoch=None``):

1. The samples of every shard are counted once, in ``__init__`` (local ``.tar``: tar headers
   only, no data read; other URLs: one streaming pass, so pass ``samples_per_epoch`` for large
   remote datasets) and cached per process by path, size and mtime. Total: ``N``. Shards with no
   samples (or none readable, under ``on_error="skip"``) are left out of the reading.
2. Epoch ``e`` orders the shards by a permutation drawn from ``Random(seed + e)`` (the listed
   order if ``shuffle_shards=False``); all ranks draw the same one. The concatenation of the shards
   in that order is the epoch's stream, positions ``0 .. N-1``.
3. Rank ``r`` of ``W`` owns positions ``[r*B, (r+1)*B)`` with ``B = N // W``. Inside a rank,
   worker ``k`` of ``K`` owns a contiguous piece of ``B // K`` positions (+1 for the first
   ``B % K`` workers). A worker reads only the shards its piece overlaps; in the first one it
   starts at its first sample's byte offset (found from the tar headers of a local shard; other
   URLs read past the samples before it).
4. Only the last ``N % W < W`` positions go unseen: an epoch covers ``W*B/N >= 1 - (W-1)/N`` of
   the samples, each at most once.
5. If a sample or shard is skipped (``on_error="skip"``) or a shard is shorter than counted, the
   worker keeps reading past its piece (wrapping round to the start of the stream) until it has
   its quota, so the counts stay equal across ranks. A whole pass over the shards without one
   usable sample raises ``SampleError`` rather than spinning.

Explicit mode (``samples_per_epoch=S``, nothing is counted): ``B = S // W``, split over workers
as above. The epoch's shard order is dealt round-robin to the ``W*K`` (rank, worker) slots; a slot
reads its own shards in a cycle until it has its quota; a slot with no shard of its own (fewer
shards than slots) reads the whole list rotated by its slot index. Coverage is only as good as the
shards are many and even; use counted mode when that matters.

Rank and world size come from ``torch.distributed`` when it is initialised, else from the
environment (``RANK``/``WORLD_SIZE``); a worker started by spawn uses what the main process saw
when it pickled the dataset. Worker id and count come from ``torch.utils.data.get_worker_info()``.

Shuffling: with ``shuffle_buffer > 0`` a worker shuffles its own samples through a buffer of that
size, seeded from ``(seed, epoch, rank, worker)``. ``set_epoch(e)`` must be called before each
epoch (``PooledLoader.set_epoch`` forwards it), as with ``DistributedSampler``.

Reading: shards are read as a stream by ``pooled_loader.shards.remote.open_shard`` (local paths,
``http(s)://``, ``pipe:`` and, with fsspec installed, ``s3://``, ``gs://``, ...). A dropped
connection or short read in mid-shard is retried with backoff (``retries``, ``retry_backoff_s``)
and resumes at the byte where it stopped (HTTP Range; a server without Range support is read again
and the bytes already delivered are discarded), so every sample arrives exactly once. With
``cache_dir=`` remote shards are read from a local copy kept under a byte budget
(``pooled_loader.shards.cache``; counting goes through it too), and ``prefetch_shards=N`` downloads
a worker's next N shards (up to the end of its piece) while it reads one. ``shuffle="global"``
replaces all of the above ordering with one permutation of every sample, read by offset through the
shard indexes (``pooled_loader.shards.global_shuffle``, which documents its order, split and state).

Checkpoint and resume: ``state_dict()`` gives this process's position after the last sample its
iterator yielded (the shuffle buffer stored as the positions of its samples, so a resume gives
exactly the uninterrupted order), and ``load_state_dict(state)`` before ``iter()`` continues from
it; pooled_loader.shards.state documents the state and its checks, pooled_loader.shards.elastic the
resume on another number of ranks or workers.

Errors: a missing or truncated shard, or a sample the transform fails on (e.g. a missing
extension), raises ``pooled_loader.errors.SampleError`` naming the shard and key. With
``on_error="skip"`` it is skipped instead, counted in ``dataset.skipped`` (per process: each worker
counts its own), listed by ``dataset.pop_skips()`` (for a loader to forward to its statistics from
each worker) and warned about once per shard. A shard index that no longer fits its shard is a
``ShardIndexError`` naming both: with ``on_error="skip"`` a counted skip (the shard left out) when
found in ``__init__``; found while reading, raised even then (skipping would repeat samples).
"""

from __future__ import annotations

import os
import random
import warnings
from contextlib import nullcontext
from itertools import islice
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from . import global_shuffle, remote, elastic as wds_elastic, plan as wds_plan, state as wds_state
from ..core.ranks import empty_rank_message, rank_and_world
from ..core.errors import SampleError, ShardIndexError
from ..core.hooks import LoaderHooks
from .cache import Prefetcher, ShardCache, parse_bytes
from .index import load_indexes, samples_from
from .samples import (Sample, Urls, count_samples, count_shard, error_reason, expand_shards,
                      is_local_tar, local_sample_offset)
from .state import Position, ShareCursor

__all__ = ["WebDataset", "count_samples", "expand_shards"]

_SKIP_LOG_MAX = 10_000  # skips kept for pop_skips() between calls (the count stays exact)


class WebDataset(IterableDataset, LoaderHooks):
    """WebDataset tar shards split across ranks and workers with equal counts per rank.

    Args:
        urls: shard URLs: brace pattern, ``::``-separated list, directory of ``.tar`` files,
            a list of these, or anything ``webdataset`` can open (``pipe:``, ``http://``...).
        transform: called on each sample ``{ext: bytes, "__key__": str, "__url__": str}``; its
            result is what the dataset yields (``None``: the dict itself).
        shuffle_shards: reshuffle the shard order every epoch from ``seed + epoch``.
        shuffle_buffer: per-worker sample shuffle buffer size (0: off).
        seed: base seed of all shuffling; same seed and epoch give the same order.
        samples_per_epoch: total samples per epoch over all ranks; skips counting the shards
            (see the module docstring for the coverage this gives).
        on_error: ``"raise"`` a ``SampleError`` naming shard and key, or ``"skip"`` and count
            the sample in ``self.skipped``.
        retries: consecutive failed attempts to read a shard (connection reset, short read, HTTP
            5xx) before giving up on it; 90 s without progress fails sooner (``shards.remote``).
        retry_backoff_s: the first retry is immediate; a second failure in a row waits this
            long, and the wait doubles with each further one.
        shuffle: ``"shards"`` (shard order + ``shuffle_buffer``, as above) or ``"global"``: one
            permutation of all samples per epoch, read by offset; needs a shard index next to
            every shard (``python -m pooled_loader shards index``); see
            ``pooled_loader.shards.global_shuffle``.
        cache_dir: keep downloaded remote shards in this folder, shared by all processes that
            use it (``pooled_loader.shards.cache``); local shards are read in place.
        cache_limit: the cache's byte budget: an int or ``"50GB"``, ``"512MiB"``... (None: no
            budget). Least-recently-used shards that no reader has open are evicted.
        prefetch_shards: download the next N shards of each worker's order in the background
            while it reads one (needs ``cache_dir``: they are kept there).
        index: read every shard's index (``X.tar.idx.json``; always with ``shuffle="global"``):
            the counts come from it (no shard is read to count them), checked against each local
            shard then and each sample as read; the cache checks downloads' size and SHA-256.
        max_sample_bytes: the most member data (decompressed) one sample may hold, an int or
            ``"1GiB"``...; default ``core.constants.MAX_SAMPLE_BYTES`` (256 MiB). Checked from the
            tar headers before a member is read: a larger sample is an error naming the shard,
            the sample and the member (a counted skip with ``on_error="skip"``).
    """

    splits_by_rank = True  # pooled_loader.distributed: no DistributedSampler needed

    def __init__(
        self,
        urls: Urls,
        transform: Optional[Callable[[Sample], Any]] = None,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        seed: int = 0,
        samples_per_epoch: Optional[int] = None,
        on_error: str = "raise",
        retries: int = remote.RETRIES,
        retry_backoff_s: float = remote.BACKOFF_S,
        shuffle: str = "shards",
        cache_dir: Optional[Union[str, os.PathLike]] = None,
        cache_limit: Union[int, str, None] = None,
        prefetch_shards: int = 0,
        index: bool = False,
        max_sample_bytes: Union[int, str, None] = None,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if shuffle not in ("shards", "global"):
            raise ValueError(f"shuffle must be 'shards' or 'global', got {shuffle!r}")
        if prefetch_shards < 0 or (prefetch_shards and cache_dir is None):
            raise ValueError(f"prefetch_shards={prefetch_shards}: must be >= 0, and prefetching "
                             "needs cache_dir= (the shards fetched ahead are kept there)")
        if samples_per_epoch is not None and samples_per_epoch < 0:
            raise ValueError(f"samples_per_epoch must be >= 0, got {samples_per_epoch}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if shuffle == "global" and (samples_per_epoch is not None or shuffle_buffer):
            raise ValueError("shuffle='global' draws its own order of all indexed samples: "
                             "leave samples_per_epoch and shuffle_buffer unset")
        if index and samples_per_epoch is not None:
            raise ValueError("index=True counts the samples from the indexes: leave "
                             "samples_per_epoch unset")
        limit = None if cache_limit is None else parse_bytes(cache_limit, "cache_limit")
        self.max_sample_bytes = (None if max_sample_bytes is None
                                 else parse_bytes(max_sample_bytes, "max_sample_bytes"))
        self.urls = expand_shards(urls)
        self.transform = transform
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.on_error = on_error
        self.retries = int(retries)
        self.retry_backoff_s = float(retry_backoff_s)
        self.epoch = 0
        # The running iteration, for state_dict(); a dict in global mode (global_shuffle).
        self._cursor: Optional[Union[ShareCursor, dict]] = None
        self._runs: Optional[dict] = None  # the running iteration of an elastic resume
        self._order: list[int] = []  # counted mode: the epoch's shards (url indices) in order
        self._resume: Optional[dict] = None  # set by load_state_dict(), used by the next iter
        self.skipped = 0
        self._skip_log: list[tuple[str, str]] = []
        self._warned: set[str] = set()
        self._rank_world = rank_and_world()
        self.shuffle = shuffle
        self.prefetch_shards = int(prefetch_shards)
        self._prefetcher: Optional[Prefetcher] = None
        self._last_shard = 0  # prefetching stops there: the last shard of this worker's piece
        self.shard_sizes: Optional[list[int]] = None
        self.indexes = None
        if index or shuffle == "global":
            self.indexes = load_indexes(self.urls, skip=self._fail if on_error == "skip" else None,
                                        retries=self.retries, backoff_s=self.retry_backoff_s)
            self.shard_sizes = [len(ix) for ix in self.indexes]
            samples_per_epoch = sum(self.shard_sizes)
        self.cache = None if cache_dir is None else ShardCache(  # made once all is checked
            cache_dir, limit, retries=self.retries, backoff_s=self.retry_backoff_s)
        self._index_of = dict(zip(self.urls, self.indexes or ()))
        self._global: Optional[global_shuffle.GlobalReader] = None
        if shuffle == "global":
            cache = self.cache if global_shuffle.use_cache(self.cache, self.indexes) else None
            self._global = global_shuffle.GlobalReader(
                self.urls, self.indexes, self.seed, cache, retries=self.retries,
                backoff_s=self.retry_backoff_s, max_sample_bytes=self.max_sample_bytes)
        if samples_per_epoch is None:
            self.shard_sizes = [self._count_shard(u) for u in self.urls]
            samples_per_epoch = sum(self.shard_sizes)
        self.samples_per_epoch = int(samples_per_epoch)
        self._empty_warned = False
        self._warn_if_empty()

    def _warn_if_empty(self) -> None:
        """Once: every rank would read nothing (too few samples for the world size)."""
        message = empty_rank_message(self.samples_per_epoch, len(self.urls), self._rank_world[1])
        if message is not None and not self._empty_warned:
            self._empty_warned = True
            warnings.warn(f"WebDataset: {message}", UserWarning, stacklevel=3)

    # -- bookkeeping -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle to use (call before iterating)."""
        self.epoch = int(epoch)
        if get_worker_info() is None:  # a spawned worker cannot see the process group
            self._rank_world = rank_and_world()
            self._warn_if_empty()

    def _worker(self) -> tuple[int, int]:
        info = get_worker_info()
        return (info.id, info.num_workers) if info is not None else (0, 1)

    def __getstate__(self) -> dict:
        # Pickled in the main process for spawned workers, which cannot see its process group.
        if get_worker_info() is None:
            self._rank_world = rank_and_world()
        state = self.__dict__.copy()
        state["_prefetcher"] = None  # threads do not cross processes
        return state

    def _current_rank_world(self) -> tuple[int, int]:
        if get_worker_info() is None or (dist.is_available() and dist.is_initialized()):
            return rank_and_world()
        return self._rank_world

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return self.samples_per_epoch // self._current_rank_world()[1]

    def _fail(self, url: str, what: str, exc: Optional[BaseException] = None) -> None:
        """Raise a SampleError, or (on_error="skip") count it and warn once per shard."""
        if isinstance(exc, ShardIndexError):
            raise exc  # not one bad shard: skipping would read others twice in its place
        msg = f"shard {url}: {what}"
        if self.on_error == "raise":
            raise SampleError(msg) from exc
        self.skipped += 1
        if len(self._skip_log) < _SKIP_LOG_MAX:
            self._skip_log.append((f"shard {url}", what))
        if url not in self._warned:
            self._warned.add(url)
            warnings.warn(f"skipping: {msg}", RuntimeWarning, stacklevel=2)

    def pop_skips(self) -> list[tuple[str, str]]:
        """``(where, reason)`` of each skip since the last call (in this process), for a loader
        to forward to its statistics; ``self.skipped`` keeps the running total."""
        log, self._skip_log = self._skip_log, []
        return log

    def _count_shard(self, url: str) -> int:
        try:
            with self._source(url) as src:
                count, error = count_shard(src, retries=self.retries,
                                           backoff_s=self.retry_backoff_s,
                                           max_sample_bytes=self.max_sample_bytes)
        except Exception as exc:  # noqa: BLE001 - the cache's download failed: reported below
            count, error = 0, error_reason(exc)
        if error:
            self._fail(url, error)
        return count

    # -- planning ----------------------------------------------------------------------------
    def _plan(self) -> wds_plan.Piece:
        rank, world = self._current_rank_world()
        wid, nworkers = self._worker()
        return wds_plan.plan_piece(
            self.urls, self.shard_sizes, self.samples_per_epoch, seed=self.seed,
            epoch=self.epoch, shuffle_shards=self.shuffle_shards, rank=rank, world=world,
            worker=wid, workers=nworkers)

    def _source(self, url: str) -> Any:
        """A context manager giving where to read ``url`` from: its cached copy (pinned while
        inside), else ``url``."""
        if self.cache is None:
            return nullcontext(url)
        ix = self._index_of.get(url)
        return self.cache.reading(url, size=ix and ix.shard_bytes, sha256=ix and ix.sha256)

    def _read_shard(self, url: str, offset: Optional[int], index: int, ahead: Sequence[str] = ()
                    ) -> Iterator[tuple[Sample, Any, Any]]:
        """``shard_samples`` from a position: seek to ``offset``, or (compressed shard) read from
        the start and pass over ``index`` samples; each checked against the shard's index when
        it was read (``samples_from``). ``ahead``: the shards to prefetch next."""
        opts = {"retries": self.retries, "backoff_s": self.retry_backoff_s,
                "max_sample_bytes": self.max_sample_bytes}
        with self._source(url) as src:
            if self._prefetcher is not None:
                self._prefetcher.ahead(list(ahead))
            for item in samples_from(src, offset, index, url=url,
                                     index=self._index_of.get(url), **opts):
                item[0]["__url__"] = url  # not the cached copy's path
                yield item

    def _raw(self, shards: list[str], pos: Position, skip: int
             ) -> Iterator[tuple[Sample, tuple]]:
        """``(sample, (shard, offset, index))`` from ``pos`` on (passing over ``skip`` samples in
        the first shard), wrapping round forever; ``pos`` always points after the last sample
        yielded. Raises once a whole pass over the shards read nothing."""
        while True:
            url = shards[pos.shard]
            key, passing = None, skip > 0
            try:
                ahead = shards[pos.shard + 1:min(pos.shard + 1 + self.prefetch_shards,
                                                 self._last_shard + 1)]
                for sample, start, after in self._read_shard(url, pos.offset, pos.index, ahead):
                    key = sample["__key__"]
                    here = [pos.shard, start, pos.index]
                    pos.offset, pos.index = after, pos.index + 1
                    if skip:
                        skip -= 1
                        continue
                    pos.got = True
                    yield sample, here
            except Exception as exc:  # noqa: BLE001 - reported with shard and key
                where = f"after key {key!r}" if key is not None else "at the start"
                self._fail(url, f"{error_reason(exc)} ({where})", exc)
            skip = 0
            pos.visits += 1
            pos.idle = 0 if pos.got else pos.idle + (not passing)
            if pos.idle >= len(shards):
                raise SampleError(f"no readable sample in a whole pass over {len(shards)} "
                                  f"shards (first: {shards[0]})")
            pos.shard, pos.offset, pos.index, pos.got = (pos.shard + 1) % len(shards), 0, 0, False

    def _apply(self, sample: Sample) -> tuple[bool, Any]:
        if self.transform is None:
            return True, sample
        try:
            return True, self.transform(sample)
        except Exception as exc:  # noqa: BLE001 - reported with shard and key
            if isinstance(exc, KeyError) and exc.args and exc.args[0] not in sample:
                exts = sorted(k for k in sample if not k.startswith("__"))
                what = f"missing extension {exc.args[0]!r} (has {exts})"
            else:
                what = f"transform failed: {error_reason(exc)}"
            self._fail(sample.get("__url__", "?"), f"key {sample.get('__key__')!r}: {what}", exc)
            return False, None

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if self.shuffle == "global":
            if resume is not None and resume.get("mode") != "global":
                raise ValueError("WebDataset state is from shuffle='shards', this dataset has "
                                 "shuffle='global'")
            if resume is not None and resume["epoch"] != self.epoch:
                resume = None  # as in shard mode: a state from another epoch is ignored
            state = global_shuffle.resumed_state(self._global_state(), resume)
            self._cursor = state
            for out, after in self._global.samples(state, self._apply, self._fail):
                self._cursor = after  # state_dict() gives the state after the last yield
                yield out
            return
        if self.prefetch_shards:
            self._prefetcher = Prefetcher(self.cache, self.prefetch_shards)
        try:
            if resume is not None and resume.get("mode") in (wds_elastic.MERGED,
                                                             wds_elastic.RUNS) \
                    and resume["epoch"] == self.epoch:
                yield from self._iter_runs(resume)
            else:
                yield from self._iter_shards(resume)
        finally:
            if self._prefetcher is not None:
                self._prefetcher.close()
                self._prefetcher = None

    def _iter_shards(self, resume: Optional[dict]) -> Iterator[Any]:
        self._runs = None
        piece = self._plan()
        quota, shards, first, skip = piece.quota, piece.shards, piece.first, piece.skip
        self._order, self._last_shard = piece.order, piece.last
        rank, _ = self._current_rank_world()
        rng = random.Random(f"{self.seed}/{self.epoch}/{rank}/{self._worker()[0]}")
        cur = ShareCursor(quota, Position(first), rng, start=(first, skip))
        # a merged or runs state reaches here only from another epoch (see __iter__)
        runs = resume is not None and resume.get("mode") in (wds_elastic.MERGED, wds_elastic.RUNS)
        if resume is not None and not runs and resume["epoch"] == self.epoch \
                and resume["position"]:
            wds_state.check_fits(resume, self._config(), quota, shards, self._index_of,
                                 self.shard_sizes and dict(zip(self.urls, self.shard_sizes)))
            skip = 0
            cur = self._restore(resume, quota, shards, rng)
        elif resume is not None and resume["epoch"] != self.epoch and (runs or (
                resume["position"] and resume["done"] < resume["quota"])):
            warnings.warn(f"WebDataset: the loaded state is from epoch {resume['epoch']} but the "
                          f"dataset is at epoch {self.epoch} (set_epoch after load_state_dict?): "
                          "starting this epoch from its beginning", RuntimeWarning, stacklevel=2)
        self._cursor = cur
        if quota == 0:
            return
        if skip and is_local_tar(shards[first]):  # start inside the first shard: seek there
            offset = local_sample_offset(shards[first], skip)
            if offset is not None:
                cur.pos.offset, cur.pos.index, skip = offset, skip, 0
        raw = self._raw(shards, cur.pos, skip)
        size = self.shuffle_buffer
        buf, held = cur.buffer, cur.held
        # Rounds: the first reads this worker's piece (`quota` samples); a later one reads on to
        # replace samples the transform skipped. A buffer is drained at the end of each round.
        while cur.done < quota:
            if cur.round_left == 0 and not buf:
                if cur.rounds:
                    if cur.done > cur.before:
                        cur.mark = cur.pos.visits
                    elif cur.pos.visits - cur.mark > len(shards):
                        raise SampleError(f"no usable sample in a whole pass over {len(shards)} "
                                          f"shards (first: {shards[0]}); {self.skipped} skipped")
                cur.rounds += 1
                cur.round_left, cur.before, cur.draining = quota - cur.done, cur.done, False
            if cur.round_left:
                sample, here = next(raw)
                cur.round_left -= 1
                if size > 1:
                    if len(buf) < size:
                        buf.append(sample)
                        held.append(here)
                        continue
                    i = rng.randrange(size)
                    buf[i], sample, held[i] = sample, buf[i], here
            else:
                if not cur.draining:
                    order = list(range(len(buf)))
                    rng.shuffle(order)
                    buf[:] = [buf[j] for j in order]
                    held[:] = [held[j] for j in order]
                    cur.draining = True
                sample = buf.pop(0)
                held.pop(0)
            ok, out = self._apply(sample)
            if ok:
                cur.done += 1
                yield out

    def _iter_runs(self, resume: dict) -> Iterator[Any]:
        """The rest of an epoch resumed from a merged state (this slot's share of it) or from a
        state taken while reading one: its runs in order, no shuffle buffer (`shards.elastic`)."""
        rank, world = self._current_rank_world()
        wid, nworkers = self._worker()
        if resume["mode"] == wds_elastic.MERGED:
            runs, quota = wds_elastic.slot_runs(resume["runs"], rank, world, wid, nworkers)
            done = 0
        else:
            runs, quota, done = resume["rest"], resume["quota"], resume["done"]
        self._cursor = None
        self._runs = {"runs": runs, "raw": 0, "quota": quota, "done": done}
        for url_index, first, count in runs:
            url = self.urls[url_index]
            offset = 0 if not first else (
                local_sample_offset(url, first) if is_local_tar(url) else None)
            got = 0
            try:
                for sample, _, _ in islice(self._read_shard(url, offset, first), count):
                    got += 1
                    self._runs["raw"] += 1
                    ok, out = self._apply(sample)
                    if ok:
                        self._runs["done"] += 1
                        yield out
            except Exception as exc:  # noqa: BLE001 - reported with the shard
                self._fail(url, f"{error_reason(exc)} (resumed at sample {first + got})", exc)
                self._runs["raw"] += count - got
                continue
            if got < count:
                self._fail(url, f"has {first + got} samples, {first + count} were counted")
                self._runs["raw"] += count - got

    def _rest(self, cur: ShareCursor) -> Optional[list]:
        """The runs this worker has not read yet (its piece's rest, its buffer's samples), for
        an elastic merge; None where they are not exact (explicit mode, skipped samples)."""
        if self.shard_sizes is None or self.skipped or cur.rounds > 1:
            return None
        order = self._order
        if cur.rounds == 0:
            rest = wds_elastic.runs_from(order, self.shard_sizes, *cur.start, cur.quota)
        else:
            rest = wds_elastic.runs_from(order, self.shard_sizes, cur.pos.shard,
                                         cur.pos.index, cur.round_left)
        return rest + [[order[shard], index, 1] for shard, _, index in cur.held]

    # -- checkpoint and resume -----------------------------------------------------------------
    def _config(self) -> dict:
        rank, world = self._current_rank_world()
        wid, nworkers = self._worker()
        return {"rank": rank, "world_size": world, "worker": wid, "num_workers": nworkers,
                "seed": self.seed, "shards": len(self.urls),
                "samples_per_epoch": self.samples_per_epoch,
                "shuffle_shards": self.shuffle_shards, "shuffle_buffer": self.shuffle_buffer}

    def _global_state(self) -> dict:
        """This (rank, worker)'s global-shuffle state before its first sample of the epoch."""
        rank, world = self._current_rank_world()
        wid, nworkers = self._worker()
        return global_shuffle.fresh_state(
            seed=self.seed, epoch=self.epoch, samples=self.samples_per_epoch,
            shards=len(self.urls), rank=rank, world_size=world, worker=wid,
            num_workers=nworkers, skipped=self.skipped)

    def state_dict(self) -> dict:
        """This process's position: after the last sample its iterator yielded (plain JSON data).

        Called by the loader inside each worker (each worker reads its own piece). Records the
        shard, the byte offset of its next sample, the shuffle buffer's samples as positions and
        the shuffle RNG; layout: pooled_loader.shards.state's docstring."""
        if self.shuffle == "global":  # layout: pooled_loader.shards.global_shuffle's docstring
            if self._cursor is not None and self._cursor["epoch"] == self.epoch:
                return dict(self._cursor)
            return self._global_state()
        state = {"version": wds_state.STATE_VERSION, "epoch": self.epoch, "skipped": self.skipped,
                 **self._config(), "quota": 0, "done": 0, "position": None}
        if self._runs is not None:  # reading the runs of an elastic resume
            r = self._runs
            state.update(mode=wds_elastic.RUNS, quota=r["quota"], done=r["done"],
                         rest=wds_elastic.drop_first(r["runs"], r["raw"]))
            return state
        cur = self._cursor
        if cur is None:
            if self._resume is None and self.shard_sizes is not None and not self.skipped:
                # before the epoch's first sample (a worker that has not read yet): its whole
                # piece remains, so an elastic merge (or a Mix's) can hand it to another slot
                piece = self._plan()
                state["rest"] = wds_elastic.runs_from(piece.order, self.shard_sizes,
                                                      piece.first, piece.skip, piece.quota)
            return state
        # the buffer is the RNG's only user
        state.update(wds_state.cursor_state(cur, keep_rng=self.shuffle_buffer > 1),
                     rest=self._rest(cur))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` continue from ``state`` (from ``state_dict()`` of the same
        rank and worker). Sets the epoch to the state's. Raises ``ValueError`` saying what
        differs when the state does not fit this dataset, or what is missing when it is corrupt."""
        if not isinstance(state, dict):
            raise ValueError(f"WebDataset state must be a dict, got {type(state).__name__}")
        if state.get("mode") == "global" or self.shuffle == "global":
            if state.get("mode") != "global" or self.shuffle != "global":
                mode = "global" if state.get("mode") == "global" else "shards"
                raise ValueError(f"WebDataset state is from shuffle={mode!r}, this dataset has "
                                 f"shuffle={self.shuffle!r}")
            global_shuffle.check_complete(state)
            self.epoch = int(state["epoch"])
            self._resume = state
            return
        wds_state.check_complete(state, self.shuffle_buffer)
        if state.get("mode") in (wds_elastic.MERGED, wds_elastic.RUNS):
            # a merged state (`elastic.merge_stream_states`) or one taken while reading one
            wds_state.check_runs_state(state, self._config(), len(self.urls),
                                       self.shuffle_buffer, self.shard_sizes)
        else:
            self.skipped = int(state.get("skipped", self.skipped))
        self.epoch = int(state["epoch"])
        self._resume = state

    def _restore(self, state: dict, quota: int, shards: list[str], rng: random.Random
                 ) -> ShareCursor:
        cur = wds_state.cursor_from_state(state, quota, rng)
        # The shuffle buffer is stored as positions: read those samples again (one seek each).
        for shard, offset, index in state["buffer"]:
            url = shards[shard]
            try:
                sample = next(iter(self._read_shard(url, offset, index)))[0]
            except Exception as exc:  # noqa: BLE001 - reported with the shard
                raise SampleError(f"shard {url}: cannot re-read the shuffle buffer's sample at "
                                  f"byte {offset} on resume: {error_reason(exc)}") from exc
            cur.buffer.append(sample)
            cur.held.append([shard, offset, index])
        return cur
