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
- A connection slower than ``constants.REMOTE_MIN_BYTES_PER_S`` over the time spent waiting on
  it (judged once that passes ``REMOTE_RATE_WINDOW_S``) is a failure too: a server that trickles
  a byte at a time within the per-read timeout (``timeout_s``) cannot hold a reader forever.
  The status line and headers must arrive within ``timeout_s`` of the connection in all.
  Not bounded beyond ``timeout_s`` per read: the TCP connect and a TLS handshake.
- ``retries`` bounds the consecutive failed attempts (an attempt that delivers bytes at the
  minimum rate resets the count, so a long transfer that is cut now and then still completes). When they are exhausted
  the read raises ``RemoteReadError`` (a ``SampleError``) naming the URL, the byte offset, the
  attempts and the last error. A missing file or an HTTP 4xx other than 408/429 fails at once.

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
import http.client
import io
import os
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
    # A FIFO would block in open() and a link to /dev/zero never end: regular files only.
    fd, st = open_regular_stat(path, follow=True, what="local shard")
    f = os.fdopen(fd, "rb")
    f.seek(offset)
    return _Opened(f, st.st_size)


def _open_http(url: str, offset: int, timeout: float, end: Optional[int] = None) -> _Opened:
    last = "" if end is None else str(end - 1)
    headers = {"Range": f"bytes={offset}-{last}"} if offset or end is not None else {}
    try:
        resp = _opener_with_deadline().open(urllib.request.Request(url, headers=headers),
                                            timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # asked at (or past) the end: nothing left to read
            total = (exc.headers.get("Content-Range") or "").rpartition("/")[2]
            return _Opened(io.BytesIO(b""), int(total) if total.isdigit() else offset)
        if exc.code in TRANSIENT_HTTP:
            raise _Transient(f"HTTP {exc.code} {exc.reason}") from exc
        raise RemoteReadError(f"{url}: HTTP {exc.code} {exc.reason}") from exc
    reader = getattr(getattr(resp, "fp", None), "raw", None)
    if isinstance(reader, _DeadlineReader):
        reader.owner.lift()  # the headers are in: the body is judged by its rate
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
        return _Opened(_Body(resp), size, close=resp.close)
    # 200: the server ignored Range; read from the start and discard what was delivered.
    return _Opened(_Body(resp), int(length) if length else None, skip=offset, close=resp.close)


class _DeadlineSocket:
    """An HTTP connection's socket as ``http.client`` sees it: every read before ``lift()``
    (the status line and headers) must end by one deadline, ``timeout_s`` after the connection
    is made, so a server trickling its headers a byte at a time cannot hold a reader forever;
    afterwards each read has the per-read timeout only. Closed when both the connection and the
    response's file have let go of it (as ``socket.makefile`` counts)."""

    def __init__(self, sock: Any, timeout: float) -> None:
        self.sock, self.timeout = sock, timeout
        self.deadline: Optional[float] = time.monotonic() + timeout
        self._refs = 1

    def sendall(self, data: Any, *args: Any) -> None:
        self.sock.sendall(data, *args)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._refs += 1
        return io.BufferedReader(_DeadlineReader(self))

    def recv_into(self, buf: memoryview) -> int:
        if self.deadline is None:
            return self.sock.recv_into(buf)
        left = self.deadline - time.monotonic()
        if left > 0:
            self.sock.settimeout(min(self.timeout, left))
            try:
                return self.sock.recv_into(buf)
            except TimeoutError:
                if left >= self.timeout:
                    raise  # the per-read timeout, not the deadline
        raise TimeoutError(f"no complete status line and headers within {self.timeout} s "
                           "(timeout_s) of connecting")

    def lift(self) -> None:
        self.deadline = None
        self.sock.settimeout(self.timeout)

    def close(self) -> None:
        self._refs -= 1
        if self._refs == 0:
            self.sock.close()

    def __getattr__(self, name: str) -> Any:  # setsockopt, fileno, ...
        return getattr(self.sock, name)


class _DeadlineReader(io.RawIOBase):
    """The raw file under an HTTP response: reads through its ``_DeadlineSocket``."""

    def __init__(self, owner: _DeadlineSocket) -> None:
        super().__init__()
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        return self.owner.recv_into(buf)

    def close(self) -> None:
        if not self.closed:
            self.owner.close()
        super().close()


def _with_deadline(base: type) -> type:
    class Connection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            super().connect()
            self.sock = _DeadlineSocket(self.sock, self.timeout)
    return Connection


_HTTP_CONNECTION = _with_deadline(http.client.HTTPConnection)
_HTTPS_CONNECTION = _with_deadline(http.client.HTTPSConnection)


class _HTTPHandler(urllib.request.HTTPHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_HTTP_CONNECTION, req, **kwargs)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_HTTPS_CONNECTION, req, **kwargs)


_OPENER: list = []


def _opener_with_deadline() -> urllib.request.OpenerDirector:
    """``urllib``'s opener (proxies and redirects as usual) whose connections bound the time to
    the headers (not one installed with ``urllib.request.install_opener``)."""
    if not _OPENER:
        _OPENER.append(urllib.request.build_opener(_HTTPHandler, _HTTPSHandler))
    return _OPENER[0]


class _Body:
    """An HTTP response's body read one socket read at a time: ``HTTPResponse.readinto`` waits
    until the whole buffer is full, so a server trickling a byte at a time, each within the
    per-read timeout, would never give the stream a chance to judge its rate. With a
    ``Content-Length`` (the usual case) the socket's buffered file is read directly, with no
    copy (``readinto1``, the response's length kept here); else through ``read1``."""

    def __init__(self, resp: Any) -> None:
        self.resp = resp
        fp = getattr(resp, "fp", None)
        direct = resp.length is not None and not resp.chunked and hasattr(fp, "readinto1")
        self._fp, self._left = (fp, resp.length) if direct else (None, None)

    def readinto(self, buf: memoryview) -> int:
        if self._fp is None:
            data = self.resp.read1(len(buf))
            buf[:len(data)] = data
            return len(data)
        n = self._fp.readinto1(buf[:self._left]) if self._left else 0
        self._left -= n
        return n


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
                        NotADirectoryError, UnsafeFileError, RemoteReadError)):
        return False
    return isinstance(exc, (_Transient, OSError, HTTPException, TimeoutError))


class ResilientStream(io.RawIOBase):
    """A read-only raw stream over ``url`` from byte ``offset`` that reconnects on failure.

    ``tell()`` is the absolute byte position in the URL's content; reading ends at ``end`` when
    given (exclusive)."""

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
        self.rate_window_s = constants.REMOTE_RATE_WINDOW_S if rate_window_s is None \
            else rate_window_s
        self._waited, self._got = 0.0, 0  # this connection: seconds inside reads, bytes
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
                began = time.monotonic()
                conn = self._open(self.url, self.pos, self.timeout_s, self.end)
                self._waited, self._got = time.monotonic() - began, 0
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
            began = time.monotonic()
            n = conn.raw.readinto(buf[:min(nbytes, len(buf))])
            self._check_rate(n or 0, time.monotonic() - began)
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
                began = time.monotonic()
                n = self._conn.raw.readinto(view)
                self._check_rate(n, time.monotonic() - began)
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
                if self._got >= self.min_rate * self._waited:  # a trickle does not reset it
                    self._failures = 0
                self.pos += n
                IO_STATS["bytes"][self.url] += n
            return n

    def _check_rate(self, n: int, waited: float) -> None:
        """Count a read; a connection slower than ``min_rate`` bytes/s over the time spent
        waiting on it (once that passes ``rate_window_s``) is a failure: reconnect or give up."""
        self._waited += waited
        self._got += n
        if self._waited >= self.rate_window_s and self._got < self.min_rate * self._waited:
            raise _Transient(
                f"the server sent {self._got} bytes in {self._waited:.1f} s of waiting, slower "
                f"than the minimum of {self.min_rate} bytes/s; if the link is really this slow, "
                "lower pooled_loader.core.constants.REMOTE_MIN_BYTES_PER_S (or pass "
                "open_shard(min_bytes_per_s=...))")

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
    given) that reconnects on failure (see the module docstring). ``min_bytes_per_s`` and
    ``rate_window_s`` default to ``constants.REMOTE_MIN_BYTES_PER_S`` and
    ``REMOTE_RATE_WINDOW_S``. Raises ``RemoteReadError`` naming the URL when it cannot be
    read."""
    raw = ResilientStream(url, offset, retries=retries, backoff_s=backoff_s, timeout_s=timeout_s,
                          end=end, min_bytes_per_s=min_bytes_per_s, rate_window_s=rate_window_s)
    size = BUFFER_BYTES if end is None else max(1, min(BUFFER_BYTES, end - offset))
    return io.BufferedReader(raw, size)
