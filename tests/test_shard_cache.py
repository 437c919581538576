"""pooled_loader.shards.cache through WebDataset and on its own: a local HTTP server counts the
requests per shard; real worker processes, real files, real flocks, a real kill -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import webdataset as wds
from http_shards import ShardServer
from test_webdataset import flat, make_shards, run_epoch, sample_id

from pooled_loader.core.errors import SampleError
from pooled_loader.shards.cache import ShardCache, cache_key, parse_bytes
from pooled_loader.shards.webdataset import WebDataset

SIZES = [20] * 10  # 200 samples, ten shards of equal size
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


@pytest.fixture
def shard_root(tmp_path):
    make_shards(str(tmp_path / "s"), SIZES)
    return str(tmp_path / "s")


def names(n=len(SIZES)):
    return [f"shard-{i:04d}.tar" for i in range(n)]


def disk_bytes(folder):
    """Every byte in the cache folder: complete shards and downloads in progress."""
    total = 0
    for entry in os.scandir(folder):
        if entry.is_file():
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
    return total


def test_budgets_read_units_and_bad_ones_say_how_to_write_them():
    assert parse_bytes("50GB") == 50 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(" 1.5 kb") == 1500 and parse_bytes(4096) == 4096
    for bad in ("50 GBs", "lots", "", "-1GB"):
        with pytest.raises(ValueError, match=r"cache_limit: cannot read .*e\.g\. '50GB'"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="must be > 0"):
        parse_bytes(0)
    with pytest.raises(ValueError, match="int of bytes"):
        parse_bytes(True)
    with pytest.raises(ValueError, match="cache_limit"):
        WebDataset(["http://127.0.0.1:9/x.tar"], cache_dir="/tmp/x", cache_limit="huge",
                   samples_per_epoch=1)


def test_prefetch_without_cache_dir_says_it_needs_one(shard_root):
    with pytest.raises(ValueError, match="prefetching needs cache_dir"):
        WebDataset(shard_root, prefetch_shards=2)


def test_second_epoch_makes_no_requests_when_the_cache_holds_everything(shard_root, tmp_path):
    cache = str(tmp_path / "cache")
    with ShardServer(shard_root) as srv:
        urls = [srv.url(n) for n in names()]
        ds = WebDataset(urls, transform=sample_id, cache_dir=cache, cache_limit="10MB",
                        prefetch_shards=2)
        assert ds.shard_sizes == SIZES
        srv.settle()
        assert dict(srv.requests) == {n: 1 for n in names()}  # counting filled the cache
        for epoch in (0, 1):
            srv.clear()
            assert sorted(flat(run_epoch(ds, epoch))) == list(range(200))
            srv.settle()
            assert sum(srv.requests.values()) == 0, epoch
        # A fresh dataset (another run) on the same folder downloads nothing either.
        again = WebDataset(urls, transform=sample_id, cache_dir=cache)
        assert sorted(flat(run_epoch(again, 2))) == list(range(200))
        srv.settle()
        assert sum(srv.requests.values()) == 0
    files = sorted(os.listdir(cache))
    assert files == sorted([".budget.lock", ".locks"] + [cache_key(u) for u in urls])


def test_a_budget_of_40_percent_is_never_exceeded_and_every_sample_comes_once(shard_root,
                                                                              tmp_path):
    """Watched from a thread every millisecond while 2 workers read 2 epochs, each pinning its
    shard and prefetching 3: more than the 4 shards the budget holds, so some are streamed."""
    cache = str(tmp_path / "cache")
    shard_bytes = os.path.getsize(os.path.join(shard_root, names()[0]))
    total = shard_bytes * len(SIZES)
    limit = int(0.4 * total)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(cache))
            time.sleep(0.001)

    with ShardServer(shard_root, rate=4e6) as srv:
        ds = WebDataset([srv.url(n) for n in names()], transform=sample_id, cache_dir=cache,
                        cache_limit=limit, prefetch_shards=3, seed=3)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            for epoch in (0, 1):
                assert sorted(flat(run_epoch(ds, epoch))) == list(range(200))
        finally:
            stop.set()
            watcher.join()
    assert 0 < peak[0] <= limit
    assert peak[0] >= 2 * shard_bytes  # it did cache (not everything was streamed past it)


def test_a_pinned_shard_is_never_evicted_and_lru_goes_first(shard_root, tmp_path):
    size = os.path.getsize(os.path.join(shard_root, names()[0]))
    with ShardServer(shard_root) as srv:
        a, b, c = (srv.url(n) for n in names(3))
        cache = ShardCache(tmp_path / "c", 2 * size)
        with cache.open(a) as pa, cache.open(b):
            assert cache.open(c) is None  # both pinned: c is streamed, not cached
            assert cache.stats["bypass"] == 1 and os.path.exists(pa.path)
        assert cache.usage() == 2 * size
        os.utime(cache.path(a), (time.time() - 100, time.time() - 100))  # a: least recent
        with cache.open(c):
            pass
        assert not os.path.exists(cache.path(a)) and os.path.exists(cache.path(b))
        assert cache.stats["evictions"] == 1 and cache.usage() == 2 * size
        with cache.open(b):  # a hit refreshes b's LRU time: c goes next
            pass
        with cache.open(a):
            pass
        assert not os.path.exists(cache.path(c)) and os.path.exists(cache.path(b))
        with pytest.warns(RuntimeWarning, match="exceed the cache budget"):
            assert ShardCache(tmp_path / "tiny", size - 1).open(a) is None


def test_a_wrong_size_or_checksum_is_never_kept(shard_root, tmp_path):
    with ShardServer(shard_root) as srv:
        url = srv.url(names()[0])
        cache = ShardCache(tmp_path / "c")
        with pytest.raises(SampleError, match="SHA-256 .* does not match its shard index"):
            cache.open(url, sha256="0" * 64)
        with pytest.raises(SampleError, match="the server has .* bytes but its shard index"):
            cache.open(url, size=123)
        assert cache.usage() == 0 and not [n for n in os.listdir(tmp_path / "c") if ".part-" in n]
        assert not os.path.exists(cache.path(url))
        with cache.open(url) as shard:
            with open(shard.path, "rb") as f, open(os.path.join(shard_root, names()[0]),
                                                   "rb") as g:
                assert f.read() == g.read()
        # A cached copy that does not have the size its index says is fetched again.
        with open(cache.path(url), "ab") as f:
            f.write(b"x" * 512)
        with pytest.warns(RuntimeWarning, match="downloading it again"):
            with cache.open(url, size=os.path.getsize(os.path.join(shard_root, names()[0]))):
                pass


READER = """
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from test_webdataset import flat, run_epoch, sample_id
from pooled_loader.shards.webdataset import WebDataset
ds = WebDataset({urls!r}, transform=sample_id, cache_dir={cache!r}, prefetch_shards=2)
print(json.dumps(sorted(flat(run_epoch(ds, 0)))))
"""


def test_two_loaders_in_separate_processes_download_each_shard_once(shard_root, tmp_path):
    cache = str(tmp_path / "cache")
    with ShardServer(shard_root, rate=2e5) as srv:  # slow enough that the two overlap
        urls = [srv.url(n) for n in names(4)]
        code = READER.format(repo=REPO, tests=TESTS, urls=urls, cache=cache)
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err
            assert json.loads(out) == list(range(80))
        srv.settle()
        assert dict(srv.requests) == {n: 1 for n in names(4)}
        assert max(srv.gets.values()) == 1


DOWNLOADER = """
import sys
sys.path[:0] = [{repo!r}]
from pooled_loader.shards.cache import ShardCache
ShardCache({cache!r}).open({url!r})
"""


def test_kill_9_during_a_download_leaves_no_usable_partial_shard(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    path = str(root / "big.tar")
    payload = os.urandom(1 << 20)
    with wds.TarWriter(path, encoder=False, mtime=0) as w:
        w.write({"__key__": "000000", "bin": payload, "txt": b"0"})
    cache = str(tmp_path / "cache")
    with ShardServer(str(root), rate=1e6) as srv:  # ~1 s for the whole shard
        url = srv.url("big.tar")
        proc = subprocess.Popen([sys.executable, "-c", DOWNLOADER.format(repo=REPO, cache=cache,
                                                                         url=url)])
        parts: list = []
        while proc.poll() is None:
            parts = [e for e in os.scandir(cache) if ".part-" in e.name] if os.path.isdir(
                cache) else []
            if parts and parts[0].stat().st_size > 0:
                break
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert parts and parts[0].stat().st_size < os.path.getsize(path)  # killed mid-way
        fresh = ShardCache(cache, "10MB")
        assert not os.path.exists(fresh.path(url))  # nothing under the final name
        assert fresh.usage() == 0  # the dead download's reservation is gone, and its file
        assert not [e for e in os.scandir(cache) if ".part-" in e.name]
        # A dataset on that cache downloads it again and reads the whole sample.
        ds = WebDataset([url], cache_dir=cache, cache_limit="10MB")
        (sample,) = list(ds)
        assert sample["bin"] == payload
        assert fresh.usage() == os.path.getsize(path)


def test_with_an_index_nothing_is_read_to_count_and_downloads_are_checked(shard_root,
                                                                         tmp_path):
    from pooled_loader.shards.index import write_index
    for n in names(3):
        write_index(os.path.join(shard_root, n))
    with ShardServer(shard_root) as srv:
        urls = [srv.url(n) for n in names(3)]
        ds = WebDataset(urls, transform=sample_id, index=True, cache_dir=str(tmp_path / "c"),
                        prefetch_shards=1)
        srv.settle()
        assert ds.shard_sizes == SIZES[:3] and not [n for n in srv.requests if
                                                    n.endswith(".tar")]
        assert sorted(flat(run_epoch(ds, 0))) == list(range(60))
        srv.settle()
        assert {n: srv.requests[n] for n in names(3)} == {n: 1 for n in names(3)}
        # The server's copy changes (same size) after the index was made: refused.
        path = os.path.join(shard_root, names(4)[3])
        write_index(path)
        with open(path, "r+b") as f:
            f.seek(600)
            f.write(b"X")
        bad = WebDataset([srv.url(names(4)[3])], index=True, cache_dir=str(tmp_path / "c"))
        with pytest.raises(SampleError, match="SHA-256 .* does not match its shard index"):
            list(bad)


def test_a_missing_remote_shard_is_a_counted_skip_with_the_cache(shard_root, tmp_path):
    with ShardServer(shard_root) as srv:
        urls = [srv.url(n) for n in names(2)] + [srv.url("nope.tar")]
        with pytest.warns(RuntimeWarning, match="nope.tar"):
            ds = WebDataset(urls, transform=sample_id, on_error="skip",
                            cache_dir=str(tmp_path / "c"))
        assert ds.shard_sizes == [20, 20, 0] and ds.skipped == 1
        with pytest.raises(SampleError, match="nope.tar.*HTTP 404"):
            WebDataset(urls, cache_dir=str(tmp_path / "c"))
