"""Reads that end by a deadline, for ``remote``'s streams: the sockets of HTTP connections
made through ``urllib``, and the clock that tells the stream's own time from its consumer's.

Why this module exists: a server can trickle a byte at a time, each well within a per-read
timeout, so a per-read timeout alone never ends a read. Here every socket read of an HTTP
connection ends by a deadline (``time.monotonic()``): the status line and headers by
``timeout_s`` after the connection (or the stream's deadline, if sooner), each body read by the
one the stream sets before it, including the socket reads ``http.client`` makes inside one read
(a chunk-size line is read to its end). What it refuses: a read past its deadline raises
``DeadlinePassed``; it never judges a rate (``remote.ResilientStream`` does). Not cut short: the
DNS lookup, a TLS handshake and a proxy's reply to ``CONNECT`` (per read, ``timeout_s`` only).
"""

from __future__ import annotations

import contextvars
import http.client
import io
import time
import urllib.request
from typing import Any, Callable, Optional

from ..core import working_on

__all__ = ["DeadlinePassed", "urlopen", "Body", "InsideClock"]


class DeadlinePassed(TimeoutError):
    """A read or connect reached the deadline its reader was given (not the per-read timeout)."""


# The deadline of the stream whose request `urlopen` is making in this thread: the connections
# urllib makes for it (redirects included) end their connect and headers by then.
_STREAM_DEADLINE: contextvars.ContextVar[Optional[float]] = contextvars.ContextVar(
    "pooled_loader_stream_deadline", default=None)


class _DeadlineSocket:
    """An HTTP connection's socket as ``http.client`` sees it, each read of which ends by a
    deadline (a ``time.monotonic()`` value) while one is set, so that a server trickling a byte
    at a time within the per-read timeout cannot hold a reader forever. First the one for the
    status line and headers: ``timeout_s`` after the connection is made, or the stream's
    ``deadline`` if sooner. Then (``set_deadline``) the one the stream sets before each body
    read; it also cuts the socket reads ``http.client`` makes inside one read (a chunk-size line
    is read up to its end, a byte per socket read if the server trickles it). Each socket read
    has the per-read timeout too. Closed when both the connection and the response's file have
    let go of it (as ``socket.makefile`` counts)."""

    def __init__(self, sock: Any, timeout: float, deadline: Optional[float] = None) -> None:
        self.sock, self.timeout = sock, timeout
        self.deadline: Optional[float] = time.monotonic() + timeout
        self.why = f"no complete status line and headers within {timeout} s (timeout_s) of " \
            "connecting"
        if deadline is not None and deadline < self.deadline:
            self.deadline = deadline
            self.why = "no complete status line and headers when the time allowed without " \
                "progress ran out"
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
        raise DeadlinePassed(self.why)

    def set_deadline(self, deadline: Optional[float]) -> None:
        """Each later read ends by ``deadline`` (None: by the per-read timeout only)."""
        self.deadline, self.why = deadline, "the read's deadline passed"
        if deadline is None:
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
        """``base`` whose socket is a ``_DeadlineSocket``, and whose connect (and TLS
        handshake's reads) end by the stream's deadline too."""

        def connect(self) -> None:
            timeout, deadline = self.timeout, _STREAM_DEADLINE.get()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlinePassed("no connection when the time allowed without progress "
                                          "ran out")
                self.timeout = min(timeout, left)
            try:
                super().connect()
            finally:
                self.timeout = timeout
            self.sock = _DeadlineSocket(self.sock, timeout, deadline)
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


def urlopen(url: str, headers: dict[str, str], timeout: float, deadline: Optional[float]
            ) -> tuple[Any, Optional[Callable[[Optional[float]], None]]]:
    """``urllib``'s response to a GET of ``url`` (proxies and redirects as usual, not through an
    opener installed with ``urllib.request.install_opener``): its connect and headers end by
    ``deadline`` (the stream's, a ``time.monotonic()`` value; None: none) and the headers within
    ``timeout`` of the connection; each read has the per-read timeout ``timeout``. Returned with
    the ``set_deadline`` of its body's reads (None if the response was not read through a
    connection of this module). Raises what ``urllib`` raises (``HTTPError``, ``URLError``) and
    ``DeadlinePassed``."""
    working_on.reading(url)  # a worker stuck on this server is named by its URL
    if not _OPENER:
        _OPENER.append(urllib.request.build_opener(_HTTPHandler, _HTTPSHandler))
    token = _STREAM_DEADLINE.set(deadline)
    try:
        resp = _OPENER[0].open(urllib.request.Request(url, headers=headers), timeout=timeout)
    finally:
        _STREAM_DEADLINE.reset(token)
    reader = getattr(getattr(resp, "fp", None), "raw", None)
    if not isinstance(reader, _DeadlineReader):
        return resp, None
    reader.owner.set_deadline(None)  # the headers are in: the stream sets each body read's
    return resp, reader.owner.set_deadline


class Body:
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


class InsideClock:
    """Seconds spent inside a stream's own calls (connecting, reading, backing off), entered
    with ``with``: the consumer's time between reads does not count, so a slow consumer is not
    a slow server."""

    def __init__(self) -> None:
        self._spent, self._entered = 0.0, None

    def __enter__(self) -> "InsideClock":
        self._entered = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._spent += time.monotonic() - self._entered
        self._entered = None

    def now(self) -> float:
        return self._spent + (0.0 if self._entered is None else time.monotonic() - self._entered)
