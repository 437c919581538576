"""Shard streams that survive dropped connections: local files, ``http(s)://``, ``pipe:`` and
fsspec URLs, opened at a byte offset.

Why this module exists: object stores, proxies and long transfers reset connections routinely.
``open_shard(url, offset)`` returns a buffered binary stream whose reads never see such a failure:

- A connection reset, a timeout, a transient HTTP status (408, 429, 5xx) or a short read (the
  connection closed before ``Content-Length`` bytes arrived) makes the stream reconnect at the
  byte where it stopped: at once the first time, then after a backoff (``backoff_s``, doubling
  up to ``MAX_BACKOFF_S``) for each further failure in a row.
- Reconnecting uses an HTTP ``Range`` request where the server honours it (206). A server that
  ignores ``Range`` (200) is read again from the start and the bytes already delivered are
  discarded, so the reader sees every byte exactly once either way. ``pipe:`` commands are run
  again the same way; local files and fsspec files seek.
- A server that trickles cannot hold a reader (the per-read timeout ``timeout_s`` never fires when
  each byte comes within it). A connection keeps up while the bytes it delivered since it last kept
  up cover ``min_bytes_per_s`` (default ``core.constants.REMOTE_MIN_BYTES_PER_S``) over the time
  waited since; one that goes a window ``W`` without keeping up is dropped like a reset. The URL
  fails, whatever ``retries`` remain, once it has gone ``STALL_WINDOWS`` (3) windows without
  progress (new bytes that bring it back to the minimum rate), across reconnections and backoffs; a
  backoff that would reach that gives up at once. ``W`` is ``rate_window_s``, by default
  ``min(core.constants.REMOTE_RATE_WINDOW_S, timeout_s)``, so a trickle ends a read after at most
  ``3 x min(30 s, timeout_s)`` of waiting: 6 s for ``open_shard(url, timeout_s=2)``, 90 s by
  default. Only the time spent inside the stream counts (connecting, reading, backing off), not the
  consumer's between reads. The deadline this sets ends every socket read of an HTTP
  connection (the status line and headers, a chunk-size line that ``http.client`` reads within
  one read, the body, the bytes discarded where Range is ignored), its TCP connect, and every
  wait on a ``pipe:`` command's output; the status line and headers must also arrive within
  ``timeout_s`` of connecting. An fsspec file is judged between its reads (one read is bounded
  by the filesystem's own timeouts). Not cut short: the DNS lookup, and a TLS handshake and a
  proxy's reply to ``CONNECT`` (``timeout_s`` per read).
- ``retries`` bounds the consecutive failed attempts (new bytes at the minimum rate reset the
  count, so a long transfer that is cut now and then still completes). When they, or the time
  without progress, run out, the read raises ``RemoteReadError`` (a ``SampleError``) naming the
  URL, the byte offset, the attempts, the time without progress and the last error (for a
  trickle: the bytes, seconds and bytes/s seen, and what to lower or raise). A missing file or
  an HTTP 4xx other than 408/429 fails at once.

Which URL goes where: ``pipe:CMD`` runs ``CMD`` in a shell; ``http://``/``https://`` use the
standard library (redirects and proxies as ``urllib`` handles them); ``file://`` and plain paths
are local files; any other ``scheme://`` (``s3://``, ``gs://``, ``memory://``...) goes through
fsspec, installed with the ``integrations`` extra (plus the filesystem's own package, e.g.
``s3fs``).

``open_shard(url, offset, end=E)`` stops at byte ``E`` (exclusive): an HTTP request then asks for
``Range: bytes=offset-(E-1)`` only, so one sample of a shard (pooled_loader.shards.index gives
its offsets) costs one short response. ``stream.raw.size`` is the URL's total size once known
(from the file, ``Content-Length`` or ``Content-Range``; ``None`` for ``pipe:``).

``IO_STATS`` counts, per process, the opens and bytes read of every URL (tests use it to show that
a resumed dataset does not read consumed shards again).
"""

from __future__ import annotations

import collections
import io
import os
import select
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any, BinaryIO, Callable, Optional

from ..core import constants
from ..core.errors import SampleError
from ..core.safe_open import UnsafeFileError, open_regular_stat
from . import deadlines
from .urls import local_path

__all__ = ["open_shard", "RemoteReadError", "IO_STATS", "RETRIES", "BACKOFF_S", "is_seekable_url"]

RETRIES = 5  # consecutive failed attempts before giving up on a URL
BACKOFF_S = 0.5  # wait before the first retry; doubles after each failure
MAX_BACKOFF_S = 8.0
TIMEOUT_S = 60.0  # a stalled connection counts as a failure after this long without data
STALL_WINDOWS = 3  # rate windows a URL may go without progress, reconnections included
BUFFER_BYTES = 1 << 20  # large reads: tarfile asks for 10 KB at a time
TRANSIENT_HTTP = frozenset({408, 429, 500, 502, 503, 504})

# Per process: url -> opens / bytes read. Bounded by the number of URLs.
IO_STATS: dict[str, collections.Counter] = {"opens": collections.Counter(),
                                             "bytes": collections.Counter()}


class RemoteReadError(SampleError):
    """A shard could not be read: retries exhausted, or a permanent failure (404, no file)."""


class _Transient(Exception):
    """A failure worth retrying that is not an OSError (HTTP 5xx, short read, pipe exit)."""


class _Opened:
    """What an opener returns: a raw file positioned ``skip`` bytes before the wanted offset,
    the total size when known, and ``set_deadline(t)``: each later read of ``raw`` ends by
    ``t`` (a ``time.monotonic()`` value), raising ``deadlines.DeadlinePassed``; a reader that
    cannot cut a read short (local, fsspec) ignores it."""

    def __init__(self, raw: Any, size: Optional[int] = None, skip: int = 0,
                 close: Optional[Callable[[], None]] = None,
                 set_deadline: Optional[Callable[[Optional[float]], None]] = None) -> None:
        self.raw, self.size, self.skip = raw, size, skip
        self._close = close or raw.close
        self.set_deadline = set_deadline or (lambda deadline: None)

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail again
            pass


def _open_local(path: str, offset: int, timeout: float, end: Optional[int] = None,
                deadline: Optional[float] = None) -> _Opened:
    # A FIFO would block in open() and a link to /dev/zero never end: regular files only.
    fd, st = open_regular_stat(path, follow=True, what="local shard")
    f = os.fdopen(fd, "rb")
    f.seek(offset)
    return _Opened(f, st.st_size)


def _open_http(url: str, offset: int, timeout: float, end: Optional[int] = None,
               deadline: Optional[float] = None) -> _Opened:
    """``deadline``: the stream's, which the connect and the headers may not outlast."""
    last = "" if end is None else str(end - 1)
    headers = {"Range": f"bytes={offset}-{last}"} if offset or end is not None else {}
    try:
        resp, set_deadline = deadlines.urlopen(url, headers, timeout, deadline)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # asked at (or past) the end: nothing left to read
            total = (exc.headers.get("Content-Range") or "").rpartition("/")[2]
            return _Opened(io.BytesIO(b""), int(total) if total.isdigit() else offset)
        if exc.code in TRANSIENT_HTTP:
            raise _Transient(f"HTTP {exc.code} {exc.reason}") from exc
        raise RemoteReadError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    length = resp.headers.get("Content-Length")
    if resp.status == 206:
        content_range = resp.headers.get("Content-Range", "")  # bytes START-END/TOTAL
        try:
            span, total = content_range.split(" ", 1)[1].split("/")
            start = int(span.split("-")[0])
        except (IndexError, ValueError):
            resp.close()
            raise RemoteReadError(f"{url}: bad Content-Range {content_range!r}") from None
        if start != offset:
            resp.close()
            raise RemoteReadError(f"{url}: asked for byte {offset}, server sent {content_range}")
        size = int(total) if total != "*" else None
        if size is None and length and end is None:
            size = offset + int(length)
        return _Opened(deadlines.Body(resp), size, close=resp.close,
                       set_deadline=set_deadline)
    # 200: the server ignored Range; read from the start and discard what was delivered.
    return _Opened(deadlines.Body(resp), int(length) if length else None, skip=offset,
                   close=resp.close, set_deadline=set_deadline)


def _open_pipe(url: str, offset: int, timeout: float, end: Optional[int] = None,
               deadline: Optional[float] = None) -> _Opened:
    # Unbuffered: each read is one read(2) of what the command has written, not a wait until a
    # 1 MiB buffer fills.
    proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE, bufsize=0)
    assert proc.stdout is not None

    def close() -> None:
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    reader = _PipeReader(proc, url)
    return _Opened(reader, None, skip=offset, close=close, set_deadline=reader.set_deadline)


class _PipeReader:
    """A command's stdout, each read waited on until the deadline set, whose end counts as a
    failure when the command exits non-zero."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url
        self.deadline: Optional[float] = None

    def set_deadline(self, deadline: Optional[float]) -> None:
        self.deadline = deadline

    def readinto(self, buf: memoryview) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise deadlines.DeadlinePassed("the command wrote nothing by the read's deadline")
        n = self.proc.stdout.readinto(buf)
        if n == 0 and self.proc.wait() != 0:
            raise _Transient(f"command exited with status {self.proc.returncode}")
        return n

    def close(self) -> None:
        self.proc.stdout.close()


def _open_fsspec(url: str, offset: int, timeout: float, end: Optional[int] = None,
                 deadline: Optional[float] = None) -> _Opened:
    try:
        import fsspec
    except ImportError:
        raise RemoteReadError(
            f"{url}: reading this URL needs fsspec: pip install 'pooled-loader[integrations]' "
            "(plus the filesystem's package, e.g. s3fs or gcsfs)") from None
    try:
        f = fsspec.open(url, "rb").open()
    except FileNotFoundError:
        raise
    except (ImportError, ValueError) as exc:  # unknown protocol, or its package missing
        raise RemoteReadError(f"{url}: fsspec cannot open it: {exc}") from exc
    f.seek(offset)
    return _Opened(f, getattr(f, "size", None))


def _opener(url: str) -> Callable[..., _Opened]:
    if url.startswith("pipe:"):
        return _open_pipe
    if local_path(url) is not None:
        return lambda u, off, t, end=None, deadline=None: _open_local(local_path(u), off, t)
    if urllib.parse.urlsplit(url).scheme in ("http", "https"):
        return _open_http
    return _open_fsspec


def is_seekable_url(url: str) -> bool:
    """Whether reopening ``url`` at an offset costs nothing extra (local and fsspec files; http
    servers that honour Range also resume cheaply, but that is only known when asked)."""
    return not url.startswith("pipe:") and urllib.parse.urlsplit(url).scheme not in ("http",
                                                                                     "https")


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, UnsafeFileError, RemoteReadError)):
        return False
    return isinstance(exc, (_Transient, OSError, HTTPException, TimeoutError))


class ResilientStream(io.RawIOBase):
    """A read-only raw stream over ``url`` from byte ``offset`` that reconnects on failure.

    ``tell()`` is the absolute byte position in the URL's content; reading ends at ``end`` when
    given (exclusive). ``window_s`` is the rate window ``W``; ``stall_s`` (``STALL_WINDOWS x
    W``) the most time the stream goes without progress before it fails (module docstring)."""

    def __init__(self, url: str, offset: int = 0, *, retries: int = RETRIES,
                 backoff_s: float = BACKOFF_S, timeout_s: float = TIMEOUT_S,
                 end: Optional[int] = None, min_bytes_per_s: Optional[float] = None,
                 rate_window_s: Optional[float] = None) -> None:
        super().__init__()
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if end is not None and end < offset:
            raise ValueError(f"{url}: end {end} is before offset {offset}")
        self.url, self.pos, self.end = url, int(offset), end
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.attempts = 0  # connections made, for messages and tests
        self.min_rate = constants.REMOTE_MIN_BYTES_PER_S if min_bytes_per_s is None \
            else min_bytes_per_s
        self.window_s = float(min(constants.REMOTE_RATE_WINDOW_S, timeout_s)
                              if rate_window_s is None else rate_window_s)
        if not self.window_s > 0:
            raise ValueError(f"{url}: the rate window must be above 0 s, got {self.window_s} "
                             "(rate_window_s, else min(REMOTE_RATE_WINDOW_S, timeout_s))")
        self.stall_s = STALL_WINDOWS * self.window_s
        self._clock = deadlines.InsideClock()
        # Marks on self._clock, and the bytes received since each: when the stream last kept up
        # (made progress; judged across reconnections, so that a burst on each new connection
        # is not progress), and when the current connection's window began (its headers came
        # in, or it last kept up: each connection gets a whole window).
        self._kept_up_at = self._window_from = 0.0
        self._progress = self._got = 0
        self._open = _opener(url)
        self._conn: Optional[_Opened] = None
        self._size: Optional[int] = None
        self._failures = 0
        with self._clock:
            self._connect()

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    @property
    def size(self) -> Optional[int]:
        """The URL's total size in bytes once known (``None`` for ``pipe:`` commands)."""
        return self._size

    def _connect(self) -> None:
        while True:
            try:
                self.attempts += 1
                IO_STATS["opens"][self.url] += 1
                deadline = time.monotonic() + self.stall_s - self._stalled()
                conn = self._open(self.url, self.pos, self.timeout_s, self.end, deadline)
                self._window_from, self._got = self._clock.now(), 0
                try:
                    self._discard(conn, conn.skip)
                except BaseException:
                    conn.close()
                    raise
                if None not in (self._size, conn.size) and conn.size != self._size:
                    conn.close()  # another file now: its bytes must not be spliced onto these
                    raise RemoteReadError(f"{self.url}: was {self._size} bytes, is {conn.size} "
                                          "on reconnecting: the file changed while it was read")
                self._conn, self._size = conn, conn.size
                return
            except BaseException as exc:  # noqa: BLE001 - sorted by _retryable
                self._failed(exc)

    def _discard(self, conn: _Opened, nbytes: int) -> None:
        buf = memoryview(bytearray(min(nbytes, BUFFER_BYTES) or 1))
        while nbytes > 0:
            n = self._read(conn, buf[:min(nbytes, len(buf))], fresh=False)
            if not n:
                raise _Transient(f"ended {nbytes} bytes before the resume offset")
            nbytes -= n

    def _stalled(self) -> float:
        """Seconds spent inside the stream since it last made progress."""
        return self._clock.now() - self._kept_up_at

    def _failed(self, exc: BaseException) -> None:
        """Re-raise a permanent failure; after a transient one wait, or give up when the
        retries are spent or the backoff would reach ``stall_s`` without progress."""
        if not _retryable(exc):
            if isinstance(exc, (RemoteReadError, OSError)):  # OSErrors name their file
                raise exc
            raise RemoteReadError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        self._failures += 1
        wait = 0.0 if self._failures < 2 else min(  # the first failure in a row: at once
            MAX_BACKOFF_S, self.backoff_s * 2 ** (self._failures - 2))
        stalled = self._stalled()
        if self._failures > self.retries or stalled + wait >= self.stall_s:
            raise RemoteReadError(
                f"{self.url}: giving up at byte {self.pos} after {self._failures} failed attempts "
                f"({self.attempts} connections in all) and {stalled:.1f} s without progress (at "
                f"most {STALL_WINDOWS} x {self.window_s} s, whatever retries remain); last "
                f"error: {type(exc).__name__}: {exc}") from exc
        time.sleep(wait)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        if self.end is not None:
            view = view[:max(0, self.end - self.pos)]
        if not len(view):
            return 0
        with self._clock:
            while True:
                if self._conn is None:
                    self._connect()
                try:
                    n = self._read(self._conn, view, fresh=True)
                    want = self._size if self.end is None or self._size is None else min(
                        self._size, self.end)
                    if not n and want is not None and self.pos < want:
                        raise _Transient(f"connection closed at byte {self.pos} of {want}")
                except BaseException as exc:  # noqa: BLE001 - sorted by _failed
                    self._conn.close()
                    self._conn = None
                    self._failed(exc)
                    continue
                if n:
                    self.pos += n
                    IO_STATS["bytes"][self.url] += n
                return n

    def _read(self, conn: _Opened, view: memoryview, *, fresh: bool) -> int:
        """One read of ``conn``, ended by the deadline at which the connection would have gone
        ``window_s`` without keeping up, or the stream ``stall_s`` without progress. New bytes
        (``fresh``) that bring the stream back to the minimum rate since it last did are
        progress and reset the count of failures; bytes read again to be discarded are not,
        but the time a connection spends re-sending them at the rate is no stall either."""
        began = self._clock.now()
        left = min(self.window_s - (began - self._window_from), self.stall_s - self._stalled())
        conn.set_deadline(time.monotonic() + left)
        try:
            n = conn.raw.readinto(view) or 0
        except deadlines.DeadlinePassed:
            raise self._too_slow() from None
        now = self._clock.now()
        if fresh and n:
            self._progress += n
            if self._progress >= self.min_rate * self._stalled():
                self._kept_up_at, self._progress, self._failures = now, 0, 0
        self._got += n
        if n and self._got >= self.min_rate * (now - self._window_from):  # the connection is
            self._window_from, self._got = now, 0  # keeping up: its window starts again
            if not fresh:
                self._kept_up_at += now - began
        elif now - self._window_from >= self.window_s or self._stalled() >= self.stall_s:
            raise self._too_slow()
        return n

    def _too_slow(self) -> _Transient:
        """The failure of a connection that fell behind the minimum rate (bytes, seconds and
        bytes/s since it last kept up, and what to change)."""
        waited = max(self._clock.now() - self._window_from, 1e-9)
        return _Transient(
            f"received {self._got} bytes in {waited:.1f} s of waiting ({self._got / waited:.1f} "
            f"B/s), slower than the minimum of {self.min_rate} bytes/s over a window of "
            f"{self.window_s} s; if the link is really this slow, lower "
            "pooled_loader.core.constants.REMOTE_MIN_BYTES_PER_S (or pass "
            "open_shard(min_bytes_per_s=...)), or allow a longer window with a larger "
            "timeout_s or rate_window_s (the window is min(REMOTE_RATE_WINDOW_S, timeout_s))")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        super().close()


def open_shard(url: str, offset: int = 0, *, retries: int = RETRIES,
               backoff_s: float = BACKOFF_S, timeout_s: float = TIMEOUT_S,
               end: Optional[int] = None, min_bytes_per_s: Optional[float] = None,
               rate_window_s: Optional[float] = None) -> BinaryIO:
    """A buffered binary stream of ``url`` from byte ``offset`` (to ``end``, exclusive, when
    given) that reconnects on failure (see the module docstring).

    Args:
        retries: consecutive failed attempts before giving up.
        backoff_s: the wait before the second retry in a row; doubles up to ``MAX_BACKOFF_S``.
        timeout_s: the per-read timeout, the time allowed for the status line and headers, and
            the cap of the default rate window.
        min_bytes_per_s: the minimum rate (default ``core.constants.REMOTE_MIN_BYTES_PER_S``).
        rate_window_s: ``W``, the time a connection may go without keeping up with the minimum
            rate (default ``min(core.constants.REMOTE_RATE_WINDOW_S, timeout_s)``). The stream
            fails after ``STALL_WINDOWS x W`` without progress, whatever ``retries`` remain.

    Raises ``RemoteReadError`` naming the URL when it cannot be read."""
    raw = ResilientStream(url, offset, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s,
                          end=end, min_bytes_per_s=min_bytes_per_s, rate_window_s=rate_window_s)
    size = BUFFER_BYTES if end is None else max(1, min(BUFFER_BYTES, end - offset))
    return io.BufferedReader(raw, size)
