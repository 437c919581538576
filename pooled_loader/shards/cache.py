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
  process that reserves space. A part file becomes ``<key>`` by ``rename`` only once every
  write's count, its size on disk and (when a shard index gives one) its SHA-256 are checked, so
  a shard under its final name is always complete: a ``kill -9`` or a full disk mid-download
  leaves no final name (a full disk: no part file either, and an ``OSError`` naming the folder).
- ``.locks/<key>``: the shard's download lock (exclusive ``flock`` while one process downloads
  it; the others wait, then find it cached) and its record: the device, inode, size and SHA-256
  of the file renamed into place. ``.budget.lock``: held while space is reserved, shards are
  evicted or a download is renamed into place.

**The cache owns only what it wrote.** ``cache_dir`` may hold other files (local shards, a
README, folders): a file counts as the cache's, towards the budget and for eviction, only if
its name is a key's, it is a regular file of this user with one link, and its record names its
inode and size; all of that is checked again, on the open file, before each eviction. Anything
else is never counted, served or deleted (a file of an earlier version's cache, which had no
records, is left for the user to delete). A cached copy is served only if it passes the same
checks and matches the index's size and SHA-256 when one is given; a link, FIFO or device
planted at a key's name is never opened (``O_NOFOLLOW|O_NONBLOCK``), only replaced by the next
download's ``rename``. Lock files are opened the same way (a planted link there is an
``UnsafeFileError`` naming it).

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
- **Hit rate below the dataset's size**: with a budget of a fraction ``f`` of the shards, an epoch
  in the *same* order as the last would hit nothing (LRU's cyclic-scan pathology: each shard is
  evicted just before it comes round again). ``WebDataset`` reshuffles the shard order every epoch,
  which gives about ``0.7 f**2`` hits (measured: 9% at f = 40%, 44% at 80%; BENCHMARKS.md): a shard
  still cached when the epoch starts is hit only if the new order reaches it before the misses have
  pushed it out, and the cache's content at the start is only the last epoch's final fraction ``f``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import threading
import time
import urllib.parse
import warnings
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator, Optional, Union

from . import remote
from ..core.errors import SampleError, ShardIndexError
from ..core.safe_open import (UnsafeFileError, create_exclusive, open_own, open_regular,
                        open_regular_stat, write_all)
from .samples import INDEX_SUFFIX
from .urls import local_path

__all__ = ["ShardCache", "CachedShard", "Prefetcher", "parse_bytes", "cache_key", "is_cacheable"]

COPY_CHUNK = 1 << 18  # written as it arrives (an HTTP read blocks until its buffer is full)
MAX_NAMES = 1 << 16  # URLs whose cache names a process remembers (then it starts afresh)
MAX_PREFETCH_THREADS = 4  # concurrent background downloads per process, whatever prefetch_shards
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_KEY = re.compile(r"^[0-9a-f]{16}-[A-Za-z0-9._-]{1,80}$")  # what cache_key() makes, only that
_PART = re.compile(r"^\.([0-9a-f]{16}-[A-Za-z0-9._-]{1,80})\.part-(\d{1,20})-[0-9a-f]{12}$")
# a cache hit's open: never through a link, a FIFO opens at once; the descriptor only holds the
# shard's lock and sets its mtime (readers open the path themselves), so O_NONBLOCK stays
_PIN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
RECORD_BYTES = 256  # a record is one short line: device, inode, size, SHA-256
_RECORD = re.compile(r"(\d{1,20}) (\d{1,20}) (\d{1,20}) ([0-9a-f]{64})\n")


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
    """Whether ``url`` goes through the cache: not a local file (``urls.local_path``) nor a
    ``pipe:`` command (whose size is never known before it has run)."""
    return local_path(url) is None and not url.startswith("pipe:")


def _touch(fd: int) -> None:
    """Set the open file's mtime, the LRU clock, to now (through the descriptor, so never a
    link's target; explicitly: the kernel's own "now" for utime is only as fine as its timer
    tick, so two opens a millisecond apart could tie)."""
    now = time.time_ns()
    os.utime(fd, ns=(now, now))


@contextlib.contextmanager
def _flocked(path: str, mode: int, *, create: bool = True,
             writable: bool = False) -> Iterator[Optional[int]]:
    """An flock on ``path`` while inside: a lock file (created if missing, ``0o644``), or with
    ``create=False`` an existing cache entry. Either must be a regular file of this user with
    one link, never followed through a link (``UnsafeFileError`` naming it otherwise); yields
    None if ``mode`` has LOCK_NB and the lock is taken."""
    if create:
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CREAT
        fd = open_own(path, flags, 0o644, what="shard cache lock file")
    else:
        fd = open_regular(path, own=True, what="shard cache entry")
    try:
        try:
            fcntl.flock(fd, mode)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


def _same_file(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` (not followed) is still the file ``st`` describes."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)


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


def _check_own_dir(path: str) -> None:
    """Refuse a cache subfolder that is a link or not this user's (lock files would go there)."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UnsafeFileError(errno.EPERM, "the shard cache's lock folder is a link or not a "
                              "folder of this user: refusing to use it; remove it", path)


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
        _check_own_dir(os.path.join(self.dir, ".locks"))
        self._budget_lock = os.path.join(self.dir, ".budget.lock")
        # Per process: hits, downloads, bypass (streamed, not cached), evictions, bytes.
        self.stats: Counter = Counter()
        self._warned: set[str] = set()
        # key -> the record last read: a record changes only with the file it names (a new
        # download is a new inode), so while the file is that one it need not be read again.
        self._known: dict[str, tuple[int, int, int, str]] = {}
        # key -> (device, inode, size, index size, index sha256) of the file last served: the
        # same file asked for with the same index passes without _mismatch
        self._verified: dict[str, tuple] = {}
        self._names: dict[str, tuple[str, str]] = {}  # url -> (key, path)

    def path(self, url: str) -> str:
        return os.path.join(self.dir, cache_key(url))

    # -- reading -----------------------------------------------------------------------------
    def open(self, url: str, *, size: Optional[int] = None, sha256: Optional[str] = None,
             wait: bool = True) -> Optional[CachedShard]:
        """The cached shard of ``url``, downloaded first if needed, pinned until closed; or
        None when it is not cached (does not fit the budget now, size unknown, or ``wait=False``
        and another thread or process is downloading it). ``size``/``sha256`` (from a shard
        index) are checked on download, and against a cached copy's record when it is opened.
        Raises ``RemoteReadError``/``SampleError`` naming the URL when the download fails or
        does not match, ``OSError`` (ENOSPC) naming the folder when the disk is full."""
        named = self._names.get(url)
        if named is None:  # a hash and a regex per URL: once per process
            if len(self._names) >= MAX_NAMES:
                self._names.clear()
            key = cache_key(url)
            named = self._names[url] = (key, os.path.join(self.dir, key))
        key, path = named
        shard = self._pin(url, key, path, size, sha256, locked=False)
        if shard is not None:
            self.stats["hits"] += 1
            return shard
        lock = os.path.join(self.dir, ".locks", key)
        with _flocked(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB),
                      writable=True) as fd:
            if fd is None:
                return None
            # Another process may have fetched it meanwhile; a copy that fails its checks now
            # (the download lock is held: nobody is replacing it) is dropped.
            shard = self._pin(url, key, path, size, sha256, locked=True)
            if shard is not None:
                self.stats["hits"] += 1
                return shard
            shard = self._download(url, path, size, sha256, fd)
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

    def _pin(self, url: str, key: str, path: str, size: Optional[int], sha256: Optional[str],
             *, locked: bool) -> Optional[CachedShard]:
        """``path`` pinned (a shared flock) if it is the copy this cache renamed into place
        (its record names its inode and size) and matches ``size``/``sha256``; else None.
        Never opens a link, FIFO or device (a planted one is warned about and left for the
        download's rename to replace); with ``locked`` a copy of ours that fails is dropped."""
        while True:
            got = self._open_locked(url, path)
            if got is None:
                return None
            fd, st = got
            if st.st_nlink:
                break
            os.close(fd)  # evicted (or replaced) between open and lock: look again
        if self._verified.get(key) == (st.st_dev, st.st_ino, st.st_size, size, sha256):
            _touch(fd)  # checked before as this very file: the record is not read again
            return CachedShard(url, path, fd)
        try:
            why = self._mismatch(key, st, size, sha256)
            if why is None:
                self._verified[key] = (st.st_dev, st.st_ino, st.st_size, size, sha256)
                _touch(fd)
                return CachedShard(url, path, fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if locked:
            if why.startswith("not the copy"):  # not ours to delete: the rename replaces it
                self._warn_once(url, f"{path} is {why}: not used; the shard is fetched again")
            else:
                self._drop(path, st, why)
        return None

    def _open_locked(self, url: str, path: str) -> Optional[tuple[int, os.stat_result]]:
        """``path`` opened (never through a link, a FIFO opening at once) and share-locked, with
        its ``fstat`` taken under the lock: a regular file of this user with at most one link
        (none: it was evicted while we locked it); None when it is missing or not such a file
        (warned: the download's rename replaces it). A hit costs an open, a non-blocking flock
        and one fstat; a lock held by another (an eviction, a foreign file) takes the careful
        way: checked before waiting for it."""
        try:
            fd = os.open(path, _PIN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            fd = -1
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                st = os.fstat(fd)
            except BlockingIOError:
                st = None
            if (st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
                    and st.st_nlink <= 1):
                return fd, st
            os.close(fd)
        try:  # the careful way: refused with its reason, or checked before the wait for a lock
            fd, st = open_regular_stat(path, own=True, what="cached shard")
        except FileNotFoundError:
            return None
        except UnsafeFileError as e:
            self._warn_once(url, f"{path}: {e.strerror}: not used; the shard is fetched again")
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd, os.fstat(fd)

    def _mismatch(self, key: str, st: os.stat_result, size: Optional[int],
                  sha256: Optional[str]) -> Optional[str]:
        """Why the cached file ``st`` of ``key`` must not be served, or None."""
        rec = self._known.get(key)
        if rec is None or rec[:3] != (st.st_dev, st.st_ino, st.st_size):
            rec = self._record(key)  # read again: another process may have fetched it anew
            if rec is not None:
                self._known[key] = rec
        if rec is None or rec[:2] != (st.st_dev, st.st_ino):
            return "not the copy this cache downloaded (no record of it in .locks/)"
        if st.st_size != rec[2]:
            return f"{st.st_size} bytes where {rec[2]} were downloaded (changed since)"
        if size is not None and st.st_size != size:
            return f"{st.st_size} bytes, the shard index says {size}"
        if sha256 is not None and rec[3] != sha256:
            return f"SHA-256 {rec[3]} at download, the shard index says {sha256}"
        return None

    def _record(self, key: str) -> Optional[tuple[int, int, int, str]]:
        """``(device, inode, size, sha256)`` of the file this cache renamed into place as
        ``key``, from ``.locks/KEY``; None if there is none (or it is not one of ours)."""
        try:
            fd = open_regular(os.path.join(self.dir, ".locks", key), own=True,
                              max_bytes=RECORD_BYTES, what="shard cache record")
        except (FileNotFoundError, UnsafeFileError):
            return None
        try:
            line = os.read(fd, RECORD_BYTES).decode("ascii", "replace")
        finally:
            os.close(fd)
        m = _RECORD.fullmatch(line)
        if m is None:
            return None
        return int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4)

    def _drop(self, path: str, st: os.stat_result, why: str) -> None:
        """Delete our copy ``path`` (the file ``st``) unless a reader has it open."""
        with _flocked(self._budget_lock, fcntl.LOCK_EX):
            try:
                with _flocked(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False) as fd:
                    if fd is not None and _same_file(path, st):
                        warnings.warn(f"shard cache: {path} has {why}: downloading it again",
                                      RuntimeWarning, stacklevel=4)
                        os.unlink(path)
            except (FileNotFoundError, UnsafeFileError):
                pass

    # -- downloading -------------------------------------------------------------------------
    def _download(self, url: str, path: str, size: Optional[int], sha256: Optional[str],
                  lock_fd: int) -> Optional[CachedShard]:
        stream = remote.open_shard(url, retries=self.retries, backoff_s=self.backoff_s)
        part_fd, part = -1, ""
        try:
            total = stream.raw.size
            if size is not None and total is not None and total != size:
                raise ShardIndexError(f"shard {url}: the server has {total} bytes but its "
                                      f"shard index {url}{INDEX_SUFFIX} says {size}: the index "
                                      "is stale; rebuild it")
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
                part_fd, part = create_exclusive(self.dir, f".{cache_key(url)}.part-{total}-")
                fcntl.flock(part_fd, fcntl.LOCK_EX)  # held: this download is alive
            digest = self._copy(stream, part_fd, url, total, part)  # always hashed: recorded
            if sha256 is not None and digest != sha256:
                raise ShardIndexError(f"shard {url}: SHA-256 {digest} does not match its "
                                      f"shard index {url}{INDEX_SUFFIX} ({sha256}): the index "
                                      "is stale or the server's copy differs; rebuild it")
            st = os.fstat(part_fd)
            if st.st_size != total:  # every write was counted; this is the last word
                raise SampleError(f"shard {url}: {st.st_size} of {total} bytes on disk in "
                                  f"{part}")
            line = f"{st.st_dev} {st.st_ino} {total} {digest}\n".encode()
            os.ftruncate(lock_fd, 0)
            if os.pwrite(lock_fd, line, 0) != len(line):
                raise OSError(errno.ENOSPC, "short write of the shard's record",
                              os.path.join(self.dir, ".locks", cache_key(url)))
            with _flocked(self._budget_lock, fcntl.LOCK_EX):
                os.rename(part, path)
                part = ""
                fcntl.flock(part_fd, fcntl.LOCK_SH)  # pinned before anyone may evict it
                _touch(part_fd)
            shard, part_fd = CachedShard(url, path, part_fd), -1
            key = os.path.basename(path)  # what this process knows of the file: hits need not
            self._known[key] = (st.st_dev, st.st_ino, total, digest)  # read the record back
            self._verified[key] = (st.st_dev, st.st_ino, total, size, sha256)
            self.stats["bytes"] += total
            return shard
        finally:
            stream.close()
            if part:
                with contextlib.suppress(OSError):
                    os.unlink(part)
            if part_fd >= 0:
                os.close(part_fd)

    def _copy(self, stream, fd: int, url: str, total: int, part: str) -> str:
        h = hashlib.sha256()
        done = 0
        buf = bytearray(COPY_CHUNK)
        view = memoryview(buf)
        while done <= total:
            n = stream.readinto(view)
            if not n:
                break
            if done + n > total:
                raise SampleError(f"shard {url}: more than the {total} bytes announced")
            try:
                write_all(fd, view[:n], part)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise OSError(e.errno, f"shard cache: no space left in {self.dir} for {url} "
                              f"({done} of {total} bytes written; nothing kept): free space "
                              "there or set cache_limit below the free space", part) from e
            h.update(view[:n])
            done += n
        if done != total:
            raise SampleError(f"shard {url}: got {done} of {total} bytes")
        return h.hexdigest()

    def _warn_once(self, url: str, what: str) -> None:
        if url not in self._warned:
            self._warned.add(url)
            warnings.warn(f"shard cache: {url}: {what}", RuntimeWarning, stacklevel=4)

    # -- the budget (callers hold the budget lock) -------------------------------------------
    def usage(self) -> int:
        """Bytes held: this cache's complete shards plus the reservations of live downloads."""
        return sum(size for _, size, _ in self._entries())

    def _owns(self, name: str, st: os.stat_result) -> bool:
        """Whether ``name`` (``st``, not followed) is a complete shard this cache wrote: a key's
        name, a regular file of this user with one link, and its record names it."""
        if not (_KEY.match(name) and stat.S_ISREG(st.st_mode) and st.st_nlink == 1
                and st.st_uid == os.geteuid()):
            return False
        rec = self._record(name)
        return rec is not None and rec[:3] == (st.st_dev, st.st_ino, st.st_size)

    def _entries(self) -> list[tuple[str, int, float]]:
        """(path, bytes, mtime) of this cache's complete shards, and (part, reserved, inf) of
        live downloads; deletes part files left over by killed processes. Any other file or
        folder in ``cache_dir`` is not the cache's: never counted, never deleted."""
        out = []
        for entry in os.scandir(self.dir):
            m = _PART.match(entry.name)
            if m is None:
                if _KEY.match(entry.name):
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if self._owns(entry.name, st):
                        out.append((entry.path, st.st_size, st.st_mtime))
                continue
            try:
                with _flocked(entry.path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False) as fd:
                    if fd is not None:  # nobody downloads into it: its process died
                        if _same_file(entry.path, os.fstat(fd)):
                            os.unlink(entry.path)
                        continue
            except (FileNotFoundError, UnsafeFileError):
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
            if self._evict(path):
                used -= size
                self.stats["evictions"] += 1
        return used + nbytes <= self.limit

    def _evict(self, path: str) -> bool:
        """Delete ``path`` if it is still this cache's shard (checked again, on the open file)
        and no reader has it open."""
        try:
            with _flocked(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False) as fd:
                if fd is None:
                    return False  # pinned: a reader has it open
                st = os.fstat(fd)
                if not (self._owns(os.path.basename(path), st) and _same_file(path, st)):
                    return False
                os.unlink(path)
                return True
        except (FileNotFoundError, UnsafeFileError):
            return False

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["stats"], state["_warned"], state["_known"] = Counter(), set(), {}
        state["_verified"], state["_names"] = {}, {}
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


