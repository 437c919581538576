"""pooled_loader.shards.remote against a hostile server on 127.0.0.1 (issue 35): one that trickles its
body, or its headers, a byte at a time, each byte well within the per-read timeout."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pooled_loader.core import constants
from pooled_loader.core.errors import SampleError
from pooled_loader.shards.remote import RemoteReadError, open_shard
from pooled_loader.shards.webdataset import WebDataset

BODY = 100_000


class _Trickle(BaseHTTPRequestHandler):
    """Announces BODY bytes, then sends one every ``gap`` seconds (Range is ignored)."""

    gap = 0.05

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", str(BODY))
        self.end_headers()
        try:
            for _ in range(BODY):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(self.gap)
        except OSError:  # the client gave up
            pass


class _TrickleHeaders(_Trickle):
    """Starts a header line, then adds one byte to it every ``gap`` seconds."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            for _ in range(60_000):
                self.wfile.write(b"a")
                self.wfile.flush()
                time.sleep(self.gap)
        except OSError:
            pass


def _serve(handler):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/slow.tar"


@pytest.fixture
def trickle():
    srv, url = _serve(_Trickle)
    yield url
    srv.shutdown()
    srv.server_close()


@pytest.mark.timeout(60)  # it used to wait for the header line (one byte per 50 ms) for ~1 hour
def test_a_server_that_trickles_its_headers_is_given_up_on_after_timeout_s():
    srv, url = _serve(_TrickleHeaders)
    try:
        began = time.monotonic()
        with pytest.raises(RemoteReadError, match=r"slow\.tar.*2 failed attempts.*status line "
                                                  r"and headers within 1\.0 s"):
            open_shard(url, retries=1, backoff_s=0.0, timeout_s=1.0)
        assert time.monotonic() - began < 20
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def quick_rate(monkeypatch):
    """The documented knobs, scaled down so a test takes seconds: 1 s of waiting at 100 B/s."""
    monkeypatch.setattr(constants, "REMOTE_RATE_WINDOW_S", 1.0)
    monkeypatch.setattr(constants, "REMOTE_MIN_BYTES_PER_S", 100)


@pytest.mark.timeout(60)  # it used to read (one byte per 50 ms) for about 80 minutes
def test_a_server_that_trickles_bytes_is_given_up_on_naming_the_url_and_the_knob(
        trickle, quick_rate):
    began = time.monotonic()
    with pytest.raises(RemoteReadError) as info:
        with open_shard(trickle, retries=2, backoff_s=0.0) as f:
            f.read()
    message = str(info.value)
    assert trickle in message and "3 failed attempts" in message
    assert "slower than the minimum of 100 bytes/s" in message
    assert "REMOTE_MIN_BYTES_PER_S" in message
    assert time.monotonic() - began < 30  # about 3 x 1 s of waiting


@pytest.mark.timeout(60)
def test_a_dataset_over_a_trickling_server_fails_naming_the_shard(trickle, quick_rate):
    ds = WebDataset([trickle], samples_per_epoch=1, retries=1, retry_backoff_s=0.0)
    with pytest.raises(SampleError, match=r"slow\.tar.*slower than the minimum"):
        list(ds)


def test_a_slow_consumer_is_not_a_slow_server(tmp_path, monkeypatch):
    """Only the time spent waiting inside reads counts: a reader that stops for longer than
    the window between reads of a fast server is not cut off."""
    from http_shards import ShardServer
    monkeypatch.setattr(constants, "REMOTE_RATE_WINDOW_S", 0.2)
    monkeypatch.setattr(constants, "REMOTE_MIN_BYTES_PER_S", 10_000)
    payload = bytes(range(256)) * 4096  # 1 MiB
    (tmp_path / "x.bin").write_bytes(payload)
    with ShardServer(str(tmp_path)) as srv:
        f = open_shard(srv.url("x.bin"), retries=0)
        head = f.read(1000)
        time.sleep(0.6)  # the consumer's own time
        rest = f.read()
        assert head + rest == payload and f.raw.attempts == 1
        f.close()
