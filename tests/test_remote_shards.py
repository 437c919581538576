"""Remote shards (pooled_loader.shards.remote through pooled_loader.shards.webdataset): http:// from a local
server that cuts and resets its responses, with and without Range support; pipe: commands;
fsspec URLs. Every sample must arrive exactly once."""

from __future__ import annotations

import os
import warnings
from collections import Counter

import pytest
from http_shards import ShardServer
from test_webdataset import flat, make_shards, run_epoch, sample_id

from pooled_loader.shards import remote
from pooled_loader.core.errors import SampleError
from pooled_loader.shards.remote import RemoteReadError, open_shard
from pooled_loader.shards.webdataset import WebDataset

SIZES = [7, 13, 4, 9]  # 33 samples; each shard is several KB of tar blocks
FAST = {"retry_backoff_s": 0.01}


@pytest.fixture
def shard_root(tmp_path):
    make_shards(str(tmp_path), SIZES)
    return str(tmp_path)


def names():
    return [f"shard-{i:04d}.tar" for i in range(len(SIZES))]


def file_bytes(root, name):
    with open(os.path.join(root, name), "rb") as f:
        return f.read()


def test_http_shards_read_like_local_files(shard_root):
    with ShardServer(shard_root) as srv:
        ds = WebDataset(srv.url("shard-{0000..0003}.tar"), transform=sample_id, seed=2)
        assert ds.shard_sizes == SIZES
        local = WebDataset(shard_root, transform=sample_id, seed=2)
        assert run_epoch(ds, 1) == run_epoch(local, 1)  # same order, real workers
    assert sorted(flat(run_epoch(local, 0))) == list(range(33))


@pytest.mark.parametrize("ranges", [True, False])
@pytest.mark.parametrize("reset", [False, True])
def test_stream_survives_cut_responses_byte_exact(shard_root, ranges, reset):
    """With Range, every response is cut after 1500 bytes and the stream resumes at the offset
    (no byte sent twice). Without, the first 3 responses are cut and each retry reads from the
    start, skipping what was delivered (a server that always cuts at the same byte would never
    progress: that gives up, see below). A reset (RST) may also drop bytes already sent, so
    there only the first 3 responses are cut."""
    name = names()[1]
    data = file_bytes(shard_root, name)
    cuts = None if ranges and not reset else 3
    with ShardServer(shard_root, ranges=ranges, cut_after=1500, cuts=cuts, reset=reset) as srv:
        with open_shard(srv.url(name), backoff_s=0.001, retries=3) as f:
            got = f.read()
        assert got == data
        sent = srv.sent(name)
        starts = [start for _, _, start, _ in srv.log]
        if reset:
            assert len(starts) == 4 and (starts == [0] * 4 or ranges)
        elif ranges:
            assert sent == len(data)  # nothing sent twice
            assert starts == list(range(0, len(data), 1500))
        else:
            assert starts == [0] * 4
            assert sent == 3 * 1500 + len(data)


@pytest.mark.parametrize("ranges", [True, False])
def test_dataset_loses_nothing_when_connections_drop(shard_root, ranges):
    """Real workers; the first 3 responses to each shard are cut mid-shard (also while the
    dataset counts the shards): every sample arrives exactly once."""
    with ShardServer(shard_root, ranges=ranges, cut_after=2500, cuts=3) as srv:
        ds = WebDataset(srv.url("shard-{0000..0003}.tar"), transform=sample_id, **FAST)
        assert ds.shard_sizes == SIZES
        srv.clear()  # cut the reading pass too, not only the counting one
        ids = flat(run_epoch(ds, 0))
        assert sorted(ids) == list(range(33))
        srv.settle()
        assert Counter(srv.requests.values()) and min(srv.requests.values()) >= 2
        assert any(start > 0 for _, _, start, _ in srv.log) == ranges


def test_exhausted_retries_name_url_and_attempts(shard_root):
    with ShardServer(shard_root, cut_after=0) as srv:  # every response cut before any byte
        url = srv.url(names()[0])
        with pytest.raises(RemoteReadError, match=r"shard-0000\.tar: giving up at byte 0 "
                                                  r"after 3 failed attempts"):
            open_shard(url, retries=2, backoff_s=0.001).read()
        ds = WebDataset([url], transform=sample_id, samples_per_epoch=7, retries=2, **FAST)
        with pytest.raises(SampleError, match=r"shard http://127\.0\.0\.1:\d+/shard-0000\.tar: "
                                              r"RemoteReadError.*after 3 failed attempts"):
            run_epoch(ds, 0)


def test_exhausted_retries_skip_is_counted(shard_root):
    """on_error="skip": the broken shard is one counted skip, the others are read in full."""
    with ShardServer(shard_root, cut_after=0) as srv:
        urls = [srv.url(n) for n in names()]
        with pytest.warns(RuntimeWarning, match="shard-0000.tar"):
            ds = WebDataset(urls[:1] + [os.path.join(shard_root, n) for n in names()[1:]],
                            transform=sample_id, on_error="skip", retries=1, **FAST)
        assert ds.skipped == 1 and ds.shard_sizes == [0] + SIZES[1:]
        assert "failed attempts" in ds.pop_skips()[0][1]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert sorted(ds) == list(range(7, 33))


def test_missing_url_fails_at_once(shard_root):
    with ShardServer(shard_root) as srv:
        with pytest.raises(RemoteReadError, match="nope.tar: HTTP 404"):
            open_shard(srv.url("nope.tar"))
        assert srv.gets["nope.tar"] == 1  # not retried
        with pytest.raises(SampleError, match="nope.tar.*HTTP 404"):
            WebDataset(srv.url("nope.tar"))


def test_pipe_urls_stream_and_rerun_a_failed_command(shard_root, tmp_path):
    path = os.path.join(shard_root, names()[1])
    ds = WebDataset(f"pipe:cat {path}", transform=sample_id)
    assert sorted(ds) == list(range(7, 20))
    # The command fails half-way the first time: it is run again, the delivered bytes skipped.
    flag = tmp_path / "failed-once"
    cmd = (f"pipe:if [ -e {flag} ]; then cat {path}; "
           f"else touch {flag}; head -c 3000 {path}; exit 3; fi")
    ds = WebDataset(cmd, transform=sample_id, samples_per_epoch=13, **FAST)
    assert sorted(ds) == list(range(7, 20)) and flag.exists()
    with pytest.raises(SampleError, match="exited with status 1"):
        list(WebDataset("pipe:false", samples_per_epoch=1, retries=1, **FAST))


def test_fsspec_urls(shard_root):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for n in names():
        fs.pipe(f"/shards/{n}", file_bytes(shard_root, n))
    try:
        ds = WebDataset("memory://shards/shard-{0000..0003}.tar", transform=sample_id)
        assert ds.shard_sizes == SIZES
        # forked workers inherit the memory filesystem
        assert sorted(flat(run_epoch(ds, 0))) == list(range(33))
    finally:
        fs.rm("/shards", recursive=True)
    local = WebDataset([f"file://{shard_root}/{n}" for n in names()], transform=sample_id)
    assert sorted(flat(run_epoch(local, 0, num_workers=0))) == list(range(33))
    with pytest.raises(SampleError, match="nosuchproto://x.tar"):
        WebDataset("nosuchproto://x.tar")


def test_io_stats_count_opens_and_bytes(shard_root):
    url = os.path.join(shard_root, names()[0])
    before = remote.IO_STATS["opens"][url], remote.IO_STATS["bytes"][url]
    with open_shard(url, 1024) as f:
        f.read()
    assert remote.IO_STATS["opens"][url] == before[0] + 1
    assert remote.IO_STATS["bytes"][url] == before[1] + os.path.getsize(url) - 1024
