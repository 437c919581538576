"""WebDataset-format tar shards as an ``IterableDataset`` that never hangs DDP.

Tar reading and grouping files into samples by key are done by the ``webdataset`` package
(``webdataset.tariterators``); this module decides *which* samples each (rank, worker) reads.

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
   ``B % K`` workers). A worker reads only the shards its piece overlaps, reading past the samples
   before its piece in the first one (at most one shard re-read per worker per epoch).
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

Errors: a missing or truncated shard, or a sample the transform fails on (e.g. a missing
extension), raises ``pooled_loader.errors.SampleError`` naming the shard and key. With
``on_error="skip"`` it is skipped instead, counted in ``dataset.skipped`` (per process: each worker
counts its own), listed by ``dataset.pop_skips()`` (for a loader to forward to its statistics from
each worker) and warned about once per shard.
"""

from __future__ import annotations

import os
import random
import re
import tarfile
import warnings
from itertools import islice
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.shardlists import expand_urls
from webdataset.gopen import gopen
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from .distributed import rank_and_world
from .errors import SampleError

__all__ = ["WebDataset", "count_samples", "expand_shards"]

Sample = dict[str, Any]
Urls = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

_COUNT_CACHE: dict[tuple, int] = {}
_SKIP_LOG_MAX = 10_000  # skips kept for pop_skips() between calls (the count stays exact)
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # tar_file_iterator's default skip_meta


def expand_shards(urls: Urls) -> list[str]:
    """Shard URLs from a brace pattern (``data-{0000..0099}.tar``, ``a.tar::b.tar``), a directory
    (its ``*.tar`` files, sorted) or a list of either."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            out.extend(sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(".tar")))
        else:
            out.extend(expand_urls(item))
    if not out:
        raise ValueError(f"no shards in {urls!r}")
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return f"KeyError: {exc.args[0]!r}"
    first = exc.args[0] if exc.args else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _is_local_tar(url: str) -> bool:
    return "://" not in url and not url.startswith("pipe:") and url.endswith(".tar")


def _wds_samples(url: str) -> Iterator[Sample]:
    """The samples of one shard, read and grouped by ``webdataset`` (errors propagate)."""
    stream = gopen(url)
    try:
        yield from group_by_keys(tar_file_expander([{"url": url, "stream": stream}]))
    finally:
        stream.close()


def _scan_local_tar(path: str) -> tuple[int, Optional[str]]:
    """Count a local tar's samples from its headers alone, grouping names exactly as
    ``webdataset.tariterators.group_by_keys`` does. Returns ``(count, error)``; on a truncated or
    corrupt tar, ``count`` is what ``webdataset`` yields before it fails (the sample in progress
    when the read fails is lost)."""
    size = os.path.getsize(path)
    count, last = 0, None
    try:
        with tarfile.open(path, mode="r:") as tf:
            for info in tf:
                if info.offset_data + info.size > size:
                    raise tarfile.ReadError(f"member {info.name!r} runs past the end of the file")
                name = info.name
                if not info.isreg() or ("/" not in name and name.startswith("__")
                                        and name.endswith("__")) or _SKIP_META.match(name):
                    continue
                prefix, _ = base_plus_ext(name)
                if prefix is not None and prefix != last:
                    count, last = count + 1, prefix
    except (tarfile.TarError, OSError, EOFError) as exc:
        return max(count - 1, 0), _reason(exc)
    return count, None


def count_samples(url: str) -> int:
    """Number of samples ``webdataset`` yields from one shard (cached per process).

    Raises ``SampleError`` naming the shard when it is missing, truncated or unreadable."""
    count, error = _count(url)
    if error:
        raise SampleError(f"shard {url}: {error}")
    return count


def _count(url: str) -> tuple[int, Optional[str]]:
    if _is_local_tar(url):
        try:
            st = os.stat(url)
        except OSError as exc:
            return 0, _reason(exc)
        key: tuple = (os.path.abspath(url), st.st_size, st.st_mtime_ns)
    else:
        key = (url,)
    if key in _COUNT_CACHE:
        return _COUNT_CACHE[key], None
    if _is_local_tar(url):
        count, error = _scan_local_tar(url)
    else:
        count, error = 0, None
        try:
            for _ in _wds_samples(url):
                count += 1
        except Exception as exc:  # noqa: BLE001 - reported with the shard name
            error = _reason(exc)
    if error is None:
        _COUNT_CACHE[key] = count
    return count, error


def _shuffled(samples: Iterator[Sample], size: int, rng: random.Random) -> Iterator[Sample]:
    """Shuffle through a buffer of ``size`` samples (``size <= 1``: unchanged)."""
    if size <= 1:
        yield from samples
        return
    buf: list[Sample] = []
    for sample in samples:
        if len(buf) < size:
            buf.append(sample)
            continue
        i = rng.randrange(size)
        buf[i], sample = sample, buf[i]
        yield sample
    rng.shuffle(buf)
    yield from buf


class WebDataset(IterableDataset):
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
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if samples_per_epoch is not None and samples_per_epoch < 0:
            raise ValueError(f"samples_per_epoch must be >= 0, got {samples_per_epoch}")
        self.urls = expand_shards(urls)
        self.transform = transform
        self.shuffle_shards = shuffle_shards
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        self.on_error = on_error
        self.epoch = 0
        self.skipped = 0
        self._skip_log: list[tuple[str, str]] = []
        self._warned: set[str] = set()
        self._rank_world = rank_and_world()
        self.shard_sizes: Optional[list[int]] = None
        if samples_per_epoch is None:
            self.shard_sizes = [self._count_shard(u) for u in self.urls]
            samples_per_epoch = sum(self.shard_sizes)
        self.samples_per_epoch = int(samples_per_epoch)

    # -- bookkeeping -------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shard order and shuffle to use (call before iterating)."""
        self.epoch = int(epoch)
        if get_worker_info() is None:  # a spawned worker cannot see the process group
            self._rank_world = rank_and_world()

    def __getstate__(self) -> dict:
        # Pickled in the main process for spawned workers, which cannot see its process group.
        if get_worker_info() is None:
            self._rank_world = rank_and_world()
        return self.__dict__.copy()

    def _current_rank_world(self) -> tuple[int, int]:
        if get_worker_info() is None or (dist.is_available() and dist.is_initialized()):
            return rank_and_world()
        return self._rank_world

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return self.samples_per_epoch // self._current_rank_world()[1]

    def _fail(self, url: str, what: str, exc: Optional[BaseException] = None) -> None:
        """Raise a SampleError, or (on_error="skip") count it and warn once per shard."""
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
        count, error = _count(url)
        if error:
            self._fail(url, error)
        return count

    # -- planning ----------------------------------------------------------------------------
    def _plan(self) -> tuple[int, list[str], int, int]:
        """(quota, shards to cycle through, index of the first, samples to pass over in it)."""
        rank, world = self._current_rank_world()
        info = get_worker_info()
        wid, nworkers = (info.id, info.num_workers) if info is not None else (0, 1)
        per_rank = self.samples_per_epoch // world
        quota = per_rank // nworkers + (1 if wid < per_rank % nworkers else 0)
        if quota == 0:
            return 0, [], 0, 0
        order = list(range(len(self.urls)))
        if self.shuffle_shards:
            random.Random(self.seed + self.epoch).shuffle(order)
        shards = [self.urls[i] for i in order]
        if self.shard_sizes is None:  # explicit mode: deal shards round-robin to the slots
            slot, nslots = rank * nworkers + wid, world * nworkers
            own = shards[slot::nslots]
            if not own:
                r = slot % len(shards)
                own = shards[r:] + shards[:r]
            return quota, own, 0, 0
        sizes = self.shard_sizes
        order = [i for i in order if sizes[i] > 0]  # empty or unreadable when counted
        start = rank * per_rank + per_rank // nworkers * wid + min(wid, per_rank % nworkers)
        first = 0
        while start >= sizes[order[first]]:  # find the shard holding position `start`
            start -= sizes[order[first]]
            first += 1
        return quota, [self.urls[i] for i in order], first, start

    def _raw(self, shards: list[str], first: int, skip: int, visits: list[int]) -> Iterator[Sample]:
        """Samples of ``shards`` from ``shards[first]`` (passing over ``skip`` samples in it),
        wrapping round forever; counts finished shard visits in ``visits[0]``; raises once a
        whole pass over the shards read nothing."""
        i, idle = first, 0
        while True:
            url = shards[i]
            got, key, passing = False, None, skip > 0
            try:
                for sample in _wds_samples(url):
                    key = sample["__key__"]
                    if skip:
                        skip -= 1
                        continue
                    got = True
                    yield sample
            except Exception as exc:  # noqa: BLE001 - reported with shard and key
                where = f"after key {key!r}" if key is not None else "at the start"
                self._fail(url, f"{_reason(exc)} ({where})", exc)
            skip = 0
            visits[0] += 1
            idle = 0 if got else idle + (not passing)
            if idle >= len(shards):
                raise SampleError(f"no readable sample in a whole pass over {len(shards)} "
                                  f"shards (first: {shards[0]})")
            i = (i + 1) % len(shards)

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
                what = f"transform failed: {_reason(exc)}"
            self._fail(sample.get("__url__", "?"), f"key {sample.get('__key__')!r}: {what}", exc)
            return False, None

    def __iter__(self) -> Iterator[Any]:
        quota, shards, first, skip = self._plan()
        if quota == 0:
            return
        rank, _ = self._current_rank_world()
        info = get_worker_info()
        rng = random.Random(f"{self.seed}/{self.epoch}/{rank}/{info.id if info else 0}")
        visits = [0]
        raw = self._raw(shards, first, skip, visits)
        done, mark = 0, 0
        while done < quota:  # first round: this worker's piece; later rounds replace skips
            before = done
            for sample in _shuffled(islice(raw, quota - done), self.shuffle_buffer, rng):
                ok, out = self._apply(sample)
                if ok:
                    done += 1
                    yield out
            if done > before:
                mark = visits[0]
            elif visits[0] - mark > len(shards):
                raise SampleError(f"no usable sample in a whole pass over {len(shards)} shards "
                                  f"(first: {shards[0]}); {self.skipped} skipped")
