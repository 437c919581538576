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
- ``retries`` bounds the consecutive failed attempts (an attempt that delivers bytes resets the
  count, so a long transfer that is cut now and then still completes). When they are exhausted
  the read raises ``RemoteReadError`` (a ``SampleError``) naming the URL, the byte offset, the
  attempts and the last error. A missing file or an HTTP 4xx other than 408/429 fails at once.

Which URL goes where: ``pipe:CMD`` runs ``CMD`` in a shell; ``http://``/``https://`` use the
standard library (redirects and proxies as ``urllib`` handles them); ``file://`` and plain paths
are local files; any other ``scheme://`` (``s3://``, ``gs://``, ``memory://``...) goes through
fsspec, installed with the ``integrations`` extra (plus the filesystem's own package, e.g.
``s3fs``).

``open_shard(url, offset, end=E)`` stops at byte ``E`` (exclusive): an HTTP request then asks for
``Range: bytes=offset-(E-1)`` only, so one sample of a shard (pooled_loader.shard_index gives
its offsets) costs one short response. ``stream.raw.size`` is the URL's total size once known
(from the file, ``Content-Length`` or ``Content-Range``; ``None`` for ``pipe:``).

``IO_STATS`` counts, per process, the opens and bytes read of every URL (tests use it to show that
a resumed dataset does not read consumed shards again).
"""

from __future__ import annotations

import collections
import io
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any, BinaryIO, Callable, Optional

from .errors import SampleError

__all__ = ["open_shard", "RemoteReadError", "IO_STATS", "RETRIES", "BACKOFF_S", "is_seekable_url"]

RETRIES = 5  # consecutive failed attempts before giving up on a URL
BACKOFF_S = 0.5  # wait before the first retry; doubles after each failure
MAX_BACKOFF_S = 8.0
TIMEOUT_S = 60.0  # a stalled connection counts as a failure after this long without data
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
    and the total size when known."""

    def __init__(self, raw: Any, size: Optional[int] = None, skip: int = 0,
                 close: Optional[Callable[[], None]] = None) -> None:
        self.raw, self.size, self.skip = raw, size, skip
        self._close = close or raw.close

    def close(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail again
            pass


def _open_local(path: str, offset: int, timeout: float, end: Optional[int] = None) -> _Opened:
    f = open(path, "rb")  # noqa: SIM115 - closed by the stream
    f.seek(offset)
    return _Opened(f, os.fstat(f.fileno()).st_size)


def _open_http(url: str, offset: int, timeout: float, end: Optional[int] = None) -> _Opened:
    last = "" if end is None else str(end - 1)
    headers = {"Range": f"bytes={offset}-{last}"} if offset or end is not None else {}
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                      timeout=timeout)
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
        return _Opened(resp, size)
    # 200: the server ignored Range; read from the start and discard what was delivered.
    return _Opened(resp, int(length) if length else None, skip=offset)


def _open_pipe(url: str, offset: int, timeout: float, end: Optional[int] = None) -> _Opened:
    proc = subprocess.Popen(url[len("pipe:"):], shell=True, stdout=subprocess.PIPE)
    assert proc.stdout is not None

    def close() -> None:
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    return _Opened(_PipeReader(proc, url), None, skip=offset, close=close)


class _PipeReader:
    """A command's stdout whose end counts as a failure when the command exits non-zero."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc, self.url = proc, url

    def readinto(self, buf: memoryview) -> int:
        n = self.proc.stdout.readinto(buf)
        if n == 0 and self.proc.wait() != 0:
            raise _Transient(f"command exited with status {self.proc.returncode}")
        return n

    def close(self) -> None:
        self.proc.stdout.close()


def _open_fsspec(url: str, offset: int, timeout: float, end: Optional[int] = None) -> _Opened:
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
    scheme = urllib.parse.urlsplit(url).scheme if "://" in url else ""
    if scheme in ("http", "https"):
        return _open_http
    if scheme in ("", "file"):
        return lambda u, off, t, end=None: _open_local(_local_path(u), off, t)
    return _open_fsspec


def _local_path(url: str) -> str:
    return urllib.request.url2pathname(urllib.parse.urlsplit(url).path) if url.startswith(
        "file://") else url


def is_seekable_url(url: str) -> bool:
    """Whether reopening ``url`` at an offset costs nothing extra (local and fsspec files; http
    servers that honour Range also resume cheaply, but that is only known when asked)."""
    return not url.startswith("pipe:") and urllib.parse.urlsplit(url).scheme not in ("http",
                                                                                     "https")


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError, RemoteReadError)):
        return False
    return isinstance(exc, (_Transient, OSError, HTTPException, TimeoutError))


class ResilientStream(io.RawIOBase):
    """A read-only raw stream over ``url`` from byte ``offset`` that reconnects on failure.

    ``tell()`` is the absolute byte position in the URL's content; reading ends at ``end`` when
    given (exclusive)."""

    def __init__(self, url: str, offset: int = 0, *, retries: int = RETRIES,
                 backoff_s: float = BACKOFF_S, timeout_s: float = TIMEOUT_S,
                 end: Optional[int] = None) -> None:
        super().__init__()
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if end is not None and end < offset:
            raise ValueError(f"{url}: end {end} is before offset {offset}")
        self.url, self.pos, self.end = url, int(offset), end
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.attempts = 0  # connections made, for messages and tests
        self._open = _opener(url)
        self._conn: Optional[_Opened] = None
        self._size: Optional[int] = None
        self._failures = 0
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
                conn = self._open(self.url, self.pos, self.timeout_s, self.end)
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

    @staticmethod
    def _discard(conn: _Opened, nbytes: int) -> None:
        buf = memoryview(bytearray(min(nbytes, BUFFER_BYTES) or 1))
        while nbytes > 0:
            n = conn.raw.readinto(buf[:min(nbytes, len(buf))])
            if not n:
                raise _Transient(f"ended {nbytes} bytes before the resume offset")
            nbytes -= n

    def _failed(self, exc: BaseException) -> None:
        """Re-raise a permanent failure; after a transient one wait, or give up."""
        if not _retryable(exc):
            if isinstance(exc, (RemoteReadError, OSError)):  # OSErrors name their file
                raise exc
            raise RemoteReadError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        self._failures += 1
        if self._failures > self.retries:
            raise RemoteReadError(
                f"{self.url}: giving up at byte {self.pos} after {self._failures} failed attempts "
                f"({self.attempts} connections in all); last error: {type(exc).__name__}: {exc}"
            ) from exc
        if self._failures > 1:  # a connection that had delivered bytes is retried at once
            time.sleep(min(MAX_BACKOFF_S, self.backoff_s * 2 ** (self._failures - 2)))

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        if self.end is not None:
            view = view[:max(0, self.end - self.pos)]
        if not len(view):
            return 0
        while True:
            if self._conn is None:
                self._connect()
            try:
                n = self._conn.raw.readinto(view)
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
                self._failures = 0
                self.pos += n
                IO_STATS["bytes"][self.url] += n
            return n

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        super().close()


def open_shard(url: str, offset: int = 0, *, retries: int = RETRIES,
               backoff_s: float = BACKOFF_S, timeout_s: float = TIMEOUT_S,
               end: Optional[int] = None) -> BinaryIO:
    """A buffered binary stream of ``url`` from byte ``offset`` (to ``end``, exclusive, when
    given) that reconnects on failure (see the module docstring). Raises ``RemoteReadError``
    naming the URL when it cannot be read."""
    raw = ResilientStream(url, offset, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s,
                          end=end)
    size = BUFFER_BYTES if end is None else max(1, min(BUFFER_BYTES, end - offset))
    return io.BufferedReader(raw, size)
