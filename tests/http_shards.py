"""A local HTTP file server for tests (127.0.0.1 only) that can cut its responses short, reset
connections and ignore Range requests, and logs what it sent."""

from __future__ import annotations

import collections
import itertools
import os
import re
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        srv = self.server.shards
        name = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
        with srv.lock:
            srv.gets[name] += 1
            arrival = next(srv.arrivals)  # responses are logged when done, listed in this order
        path = os.path.join(srv.root, name)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        size = os.path.getsize(path)
        start = 0
        asked = self.headers.get("Range")
        stop = size  # exclusive
        if asked and srv.ranges:
            first, last = re.fullmatch(r"bytes=(\d+)-(\d*)", asked).groups()
            start = int(first)
            if last:
                stop = min(size, int(last) + 1)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(stop - start))
        self.send_header("Accept-Ranges", "bytes" if srv.ranges else "none")
        self.end_headers()
        with srv.lock:
            srv.requests[name] += 1
            cut = srv.cut_after if srv.cuts is None or srv.requests[name] <= srv.cuts else None
        limit = stop - start if cut is None else min(stop - start, cut)
        with open(path, "rb") as f:
            f.seek(start)
            sent = 0
            while sent < limit:
                chunk = f.read(min(1 << 14 if srv.rate else 1 << 16, limit - sent))
                if srv.rate:
                    srv.throttle(len(chunk))
                self.wfile.write(chunk)
                sent += len(chunk)
        with srv.lock:
            srv.responses.append((arrival, (name, asked, start, sent)))
        if sent < stop - start:
            self.wfile.flush()
            if srv.reset:  # RST instead of FIN: the client sees ECONNRESET
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()
            else:
                self.connection.shutdown(socket.SHUT_WR)
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    shards: "ShardServer"


class ShardServer:
    """Serves ``root`` on 127.0.0.1. The first ``cuts`` responses to each file (``None``: all)
    stop after ``cut_after`` bytes (``reset``: with a connection reset). ``ranges=False``
    ignores Range headers (answers 200 with the whole file). ``rate``: all responses together
    send about that many bytes per second (one slow link shared by every connection).
    ``log``: (file, Range header, start, bytes sent) per response, in the order the requests
    arrived (a response is complete only later: a worker that read one shard to its end and asked
    for the next may see the second logged first, as its server thread ran first)."""

    def __init__(self, root: str, *, ranges: bool = True, cut_after: Optional[int] = None,
                 cuts: Optional[int] = None, reset: bool = False,
                 rate: Optional[float] = None) -> None:
        self.root, self.ranges, self.cut_after, self.cuts, self.reset = (
            root, ranges, cut_after, cuts, reset)
        self.rate = rate
        self._link_free_at = 0.0  # when the throttled link has sent what it was given
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # responses with a body
        self.gets: collections.Counter = collections.Counter()  # every GET, 404s included
        self.arrivals = itertools.count()
        self.responses: list[tuple[int, tuple]] = []  # (arrival number, log entry)
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.shards = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def throttle(self, nbytes: int) -> None:
        """Wait until a link of ``self.rate`` bytes/s shared by all responses has sent
        ``nbytes`` more."""
        with self.lock:
            now = time.monotonic()
            self._link_free_at = max(now, self._link_free_at) + nbytes / self.rate
            wait = self._link_free_at - now
        time.sleep(wait)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def settle(self) -> None:
        """Wait until every response served is logged (a response is logged after its last
        byte, so possibly after the client has read it)."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.responses) == sum(self.requests.values()):
                    return
            time.sleep(0.01)

    def clear(self) -> None:
        self.settle()
        with self.lock:
            self.responses.clear()
            self.requests.clear()

    @property
    def log(self) -> list[tuple]:
        with self.lock:
            return [entry for _, entry in sorted(self.responses)]

    def sent(self, name: str) -> int:
        """Bytes sent of ``name``, once every response is logged."""
        self.settle()
        return sum(n for f, _, _, n in self.log if f == name)

    def __enter__(self) -> "ShardServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
