"""A local disk cache of remote shards with a byte budget, shared by every process of a machine.

Why: without it every epoch downloads every shard again. ``WebDataset(urls, cache_dir=D,
cache_limit="50GB")`` keeps each downloaded shard in ``D``; all workers and ranks that use ``D``
share it (one download per shard), later epochs read the local copy.

Layout of the cache folder (everything is plain files; nothing needs cleaning up by hand):

- ``<key>``: a complete shard. ``key`` is the first 16 hex digits of the URL's SHA-1, ``-``, and
  the URL's file name (so a ``.tar`` stays ``.tar`` and is read as a local tar).
- ``.<key>.part-<bytes>-<token>``: a download in progress, which reserves ``<bytes>`` of the
  budget from before its first byte is written. Its downloader holds an exclusive ``flock`` on
  it; a part file nobody holds is left over from a killed process and is deleted by the next
  process that reserves space. A part file becomes ``<key>`` by ``rename`` only once its size
  (and its SHA-256 when a shard index gives one) is checked, so a shard under its final name is
  always complete: a ``kill -9`` mid-download leaves only a part file.
- ``.locks/<key>``: the shard's download lock (exclusive ``flock`` while one process downloads
  it; the others wait, then find it cached). ``.budget.lock``: held while space is reserved,
  shards are evicted or a download is renamed into place.

The rules:

- **Budget**: the bytes of complete shards plus the reservations of live downloads never exceed
  ``cache_limit`` (apparent file sizes). A download whose size is not known up front (no
  ``Content-Length``) or larger than the budget is not cached: it is streamed from its URL.
  ``pipe:`` commands and local files are never cached. The folder must be on a local
  filesystem (``flock`` between machines on NFS is not to be relied on).
- **Pinning**: a reader holds a shared ``flock`` on the shard file while it reads it (and checks,
  after locking, that the name still points at that file). Eviction takes an exclusive lock
  without waiting, so a shard that any process is reading is never evicted.
- **LRU**: every open sets the shard's mtime to now; to make room, the oldest unpinned shards
  go first. When all that is left is pinned (e.g. a budget smaller than workers x (1 + prefetch)
  shards), the shard is streamed from its URL instead of cached (counted in ``stats["bypass"]``).
- **Hit rate below the dataset's size**: with a budget of a fraction ``f`` of the shards, an
  epoch in the *same* order as the last would hit nothing (LRU's cyclic-scan pathology: each
  shard is evicted just before it comes round again). ``WebDataset`` reshuffles the shard order
  every epoch, which gives about ``0.7 f**2`` hits (measured: 9% at f = 40%, 44% at 80%;
  BENCHMARKS.md): a shard still cached when the epoch starts is hit only if the
  new order reaches it before the misses have pushed it out, and the cache's content at the
  start is only the last epoch's final fraction ``f``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import threading
import time
import urllib.parse
import warnings
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional, Union

from . import remote
from .errors import SampleError

__all__ = ["ShardCache", "CachedShard", "Prefetcher", "parse_bytes", "cache_key", "is_cacheable"]

COPY_CHUNK = 1 << 18  # written as it arrives (an HTTP read blocks until its buffer is full)
MAX_PREFETCH_THREADS = 4  # concurrent background downloads per process, whatever prefetch_shards
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PART = re.compile(r"^\.(.+)\.part-(\d+)-[0-9a-f]+$")


def parse_bytes(value: Union[int, str], what: str = "cache_limit") -> int:
    """Bytes from an int or a string such as ``"50GB"`` (10**9) or ``"512MiB"`` (2**20)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} must be an int of bytes or a string like '50GB', "
                         f"got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r}: give an int of bytes or a number "
                             "with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '50GB' "
                             "or '512MiB'")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{what} must be > 0 bytes, got {value}")
    return value


def cache_key(url: str) -> str:
    """The file name of ``url``'s shard in the cache."""
    name = os.path.basename(urllib.parse.urlsplit(url).path) or "shard"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[-80:].lstrip(".") or "shard"
    return f"{hashlib.sha1(url.encode()).hexdigest()[:16]}-{safe}"


def is_cacheable(url: str) -> bool:
    """Whether ``url`` goes through the cache: remote URLs, not local paths, ``file://`` or
    ``pipe:`` commands (whose size is never known before they have run)."""
    return "://" in url and not url.startswith(("file://", "pipe:"))


def _touch(path: str) -> None:
    """Set ``path``'s mtime, the LRU clock, to now (explicitly: the kernel's own "now" for
    utime is only as fine as its timer tick, so two opens a millisecond apart could tie)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


@contextlib.contextmanager
def _flocked(path: str, mode: int) -> Iterator[Optional[int]]:
    """An flock on ``path`` (created if missing) while inside; yields None if ``mode`` has
    LOCK_NB and the lock is taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


class CachedShard:
    """A cached shard held open (pinned: it cannot be evicted) until ``close()``."""

    def __init__(self, url: str, path: str, fd: int) -> None:
        self.url, self.path, self._fd = url, path, fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "CachedShard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class ShardCache:
    """Shards of remote URLs kept in ``cache_dir`` under a byte budget ``limit`` (None: no
    budget); see the module docstring for the rules. Safe to share between processes and
    threads; picklable (workers get a copy that uses the same folder)."""

    def __init__(self, cache_dir: Union[str, os.PathLike], limit: Union[int, str, None] = None,
                 *, retries: int = remote.RETRIES, backoff_s: float = remote.BACKOFF_S) -> None:
        self.dir = os.path.abspath(os.fspath(cache_dir))
        self.limit = None if limit is None else parse_bytes(limit)
        self.retries, self.backoff_s = retries, backoff_s
        os.makedirs(os.path.join(self.dir, ".locks"), exist_ok=True)
        self._budget_lock = os.path.join(self.dir, ".budget.lock")
        # Per process: hits, downloads, bypass (streamed, not cached), evictions, bytes.
        self.stats: Counter = Counter()
        self._warned: set[str] = set()

    def path(self, url: str) -> str:
        return os.path.join(self.dir, cache_key(url))

    # -- reading -----------------------------------------------------------------------------
    def open(self, url: str, *, size: Optional[int] = None, sha256: Optional[str] = None,
             wait: bool = True) -> Optional[CachedShard]:
        """The cached shard of ``url``, downloaded first if needed, pinned until closed; or
        None when it is not cached (does not fit the budget now, size unknown, or ``wait=False``
        and another thread or process is downloading it). ``size``/``sha256`` (from a shard
        index) are checked on download. Raises ``RemoteReadError``/``SampleError`` naming the
        URL when the download fails or does not match."""
        path = self.path(url)
        shard = self._pin(url, path, size)
        if shard is not None:
            self.stats["hits"] += 1
            return shard
        lock = os.path.join(self.dir, ".locks", cache_key(url))
        with _flocked(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB)) as fd:
            if fd is None:
                return None
            shard = self._pin(url, path, size)  # another process may have fetched it meanwhile
            if shard is not None:
                self.stats["hits"] += 1
                return shard
            shard = self._download(url, path, size, sha256)
        self.stats["downloads" if shard is not None else "bypass"] += 1
        return shard

    @contextlib.contextmanager
    def reading(self, url: str, *, size: Optional[int] = None,
                sha256: Optional[str] = None) -> Iterator[str]:
        """The local path to read ``url`` from while inside (pinned), or ``url`` itself when it
        is a local file already or cannot be cached now."""
        if not is_cacheable(url):
            yield url
            return
        shard = self.open(url, size=size, sha256=sha256)
        if shard is None:
            yield url
            return
        with shard:
            yield shard.path

    def _pin(self, url: str, path: str, size: Optional[int]) -> Optional[CachedShard]:
        while True:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                break
            os.close(fd)  # evicted (or replaced) between open and lock: look again
        try:
            if size is not None and st.st_size != size:
                os.close(fd)
                self._drop(path, f"{st.st_size} bytes, the shard index says {size}")
                return None
            _touch(path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return CachedShard(url, path, fd)

    def _drop(self, path: str, why: str) -> None:
        with _flocked(self._budget_lock, fcntl.LOCK_EX), \
                _flocked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as fd:
            if fd is not None:
                warnings.warn(f"shard cache: {path} has {why}: downloading it again",
                              RuntimeWarning, stacklevel=3)
                os.unlink(path)

    # -- downloading -------------------------------------------------------------------------
    def _download(self, url: str, path: str, size: Optional[int],
                  sha256: Optional[str]) -> Optional[CachedShard]:
        stream = remote.open_shard(url, retries=self.retries, backoff_s=self.backoff_s)
        part_fd, part = -1, ""
        try:
            total = stream.raw.size
            if size is not None and total is not None and total != size:
                raise SampleError(f"shard {url}: the server has {total} bytes but its shard "
                                  f"index says {size}: the index is stale; rebuild it")
            total = size if total is None else total
            if total is None:
                self._warn_once(url, "its size is not known before reading (no "
                                     "Content-Length): streamed, not cached")
                return None
            if self.limit is not None and total > self.limit:
                self._warn_once(url, f"{total} bytes exceed the cache budget of {self.limit}: "
                                     "streamed, not cached")
                return None
            with _flocked(self._budget_lock, fcntl.LOCK_EX):
                if not self._make_room(total):
                    return None
                part = os.path.join(self.dir, f".{cache_key(url)}.part-{total}-"
                                              f"{secrets.token_hex(6)}")
                part_fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fcntl.flock(part_fd, fcntl.LOCK_EX)  # held: this download is alive
            digest = self._copy(stream, part_fd, url, total, sha256 is not None)
            if sha256 is not None and digest != sha256:
                raise SampleError(f"shard {url}: SHA-256 {digest} does not match its shard "
                                  f"index ({sha256}): the index is stale or the server's copy "
                                  "differs; rebuild the index")
            with _flocked(self._budget_lock, fcntl.LOCK_EX):
                os.rename(part, path)
                part = ""
                fcntl.flock(part_fd, fcntl.LOCK_SH)  # pinned before anyone may evict it
                _touch(path)
            shard, part_fd = CachedShard(url, path, part_fd), -1
            self.stats["bytes"] += total
            return shard
        finally:
            stream.close()
            if part:
                with contextlib.suppress(OSError):
                    os.unlink(part)
            if part_fd >= 0:
                os.close(part_fd)

    @staticmethod
    def _copy(stream, fd: int, url: str, total: int, hashed: bool) -> Optional[str]:
        h = hashlib.sha256() if hashed else None
        done = 0
        buf = bytearray(COPY_CHUNK)
        view = memoryview(buf)
        while done <= total:
            n = stream.readinto(view)
            if not n:
                break
            if done + n > total:
                raise SampleError(f"shard {url}: more than the {total} bytes announced")
            os.write(fd, view[:n])
            if h is not None:
                h.update(view[:n])
            done += n
        if done != total:
            raise SampleError(f"shard {url}: got {done} of {total} bytes")
        return h.hexdigest() if h is not None else None

    def _warn_once(self, url: str, what: str) -> None:
        if url not in self._warned:
            self._warned.add(url)
            warnings.warn(f"shard cache: {url}: {what}", RuntimeWarning, stacklevel=4)

    # -- the budget (callers hold the budget lock) -------------------------------------------
    def usage(self) -> int:
        """Bytes held: complete shards plus the reservations of live downloads."""
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[str, int, float]]:
        """(path, bytes, mtime) of complete shards, and (part, reserved, inf) of live
        downloads; deletes part files left over by killed processes."""
        out = []
        for entry in os.scandir(self.dir):
            if not entry.is_file(follow_symlinks=False):
                continue
            m = _PART.match(entry.name)
            if m is None:
                if not entry.name.startswith("."):  # keys never start with a dot; locks do
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    out.append((entry.path, st.st_size, st.st_mtime))
                continue
            with _flocked(entry.path, fcntl.LOCK_EX | fcntl.LOCK_NB) as fd:
                if fd is not None:  # nobody downloads into it: its process died
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    continue
            out.append((entry.path, int(m.group(2)), float("inf")))
        return out

    def _make_room(self, nbytes: int) -> bool:
        """Evict least-recently-used unpinned shards until ``nbytes`` more fit the budget."""
        if self.limit is None:
            self._entries()  # still clean up after killed downloads
            return True
        entries = sorted(self._entries(), key=lambda e: e[2])
        used = sum(size for _, size, _ in entries)
        for path, size, mtime in entries:
            if used + nbytes <= self.limit or mtime == float("inf"):
                break
            with _flocked(path, fcntl.LOCK_EX | fcntl.LOCK_NB) as fd:
                if fd is None:
                    continue  # pinned: a reader has it open
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            used -= size
            self.stats["evictions"] += 1
        return used + nbytes <= self.limit

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["stats"], state["_warned"] = Counter(), set()
        return state


class Prefetcher:
    """Downloads the next shards of a reader's order into a ``ShardCache`` in the background.

    ``ahead(urls)`` is told the shards the reader will read next, nearest first; it keeps at
    most ``depth`` of them downloading or downloaded-and-pinned (bounded bytes: ``depth``
    shards, within the cache's budget), on at most ``MAX_PREFETCH_THREADS`` threads. A shard the
    budget cannot hold now, or one another process is already fetching, is skipped: the reader
    gets it itself. Download errors are left for the reader to meet (and report) itself."""

    def __init__(self, cache: ShardCache, depth: int) -> None:
        self.cache, self.depth = cache, depth
        self._pool = ThreadPoolExecutor(min(depth, MAX_PREFETCH_THREADS),
                                        thread_name_prefix="shard-prefetch")
        self._jobs: dict[str, Future] = {}
        self._lock = threading.Lock()

    def ahead(self, urls: list[str]) -> None:
        wanted = [u for u in dict.fromkeys(urls) if is_cacheable(u)][:self.depth]
        with self._lock:
            for url in list(self._jobs):
                if url not in wanted:
                    self._release(self._jobs.pop(url))
            for url in wanted:
                if url not in self._jobs:
                    self._jobs[url] = self._pool.submit(self._fetch, url)

    def _fetch(self, url: str) -> Optional[CachedShard]:
        try:
            return self.cache.open(url, wait=False)
        except Exception:  # noqa: BLE001 - the reader meets the error when it opens the shard
            return None

    @staticmethod
    def _release(job: Future) -> None:
        if not job.cancel():
            job.add_done_callback(lambda f: f.result() and f.result().close())

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                self._release(job)
            self._jobs.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


