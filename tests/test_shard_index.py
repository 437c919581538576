"""pooled_loader.shards.index (the sidecar index, its CLI, untrusted index files) and
pooled_loader.shards.global_shuffle through WebDataset(shuffle="global"): real worker processes,
local files, HTTP Range requests and the shard cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from http_shards import ShardServer
from test_webdataset import fake_worker, flat, make_image_folder, make_shards, run_epoch, \
    sample_id

from pooled_loader import PooledLoader
from pooled_loader.shards import writer as shards
from pooled_loader.core.errors import ShardFormatError
from pooled_loader.shards.global_shuffle import consumed_positions
from pooled_loader.shards.index import (INDEX_SUFFIX, MAX_INDEX_BYTES, ShardIndexError,
                                       build_index, load_index, parse_index, write_index)
from pooled_loader.shards.samples import shard_samples
from pooled_loader.shards.webdataset import WebDataset

SIZES = [5, 41, 12, 1, 33, 20, 9]  # uneven on purpose; 121 samples
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def indexed(tmp_path):
    paths = make_shards(str(tmp_path / "s"), SIZES)
    assert shards.main(["index", str(tmp_path / "s")]) == 0
    return paths


def test_the_index_cli_gives_offsets_that_read_exactly_each_sample(tmp_path, capsys):
    paths = make_shards(str(tmp_path / "s"), SIZES)
    proc = subprocess.run([sys.executable, "-m", "pooled_loader", "shards", "index",
                           str(tmp_path / "s" / "shard-{0000..0006}.tar")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [p + INDEX_SUFFIX for p in paths]
    gid = 0
    for path, n in zip(paths, SIZES):
        ix = load_index(path)
        assert len(ix) == n and ix.shard_bytes == os.path.getsize(path)
        for off, size in zip(ix.offsets, ix.sizes):
            got = [s for s, _, _ in shard_samples(path, off, end=off + size)]
            assert [int(s["txt"]) for s in got] == [gid]
            gid += 1
    off, size = ix.offsets[-1], ix.sizes[-1]  # a slice that ends inside the sample: truncated
    with pytest.raises(ShardFormatError, match="truncated shard"):
        list(shard_samples(paths[-1], off, end=off + size - 512))
    proc = subprocess.run([sys.executable, "-m", "pooled_loader", "shards", "index",
                           "http://127.0.0.1:9/x.tar"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "works on local shards" in proc.stderr


def test_shards_write_writes_the_index_too(tmp_path):
    src = str(tmp_path / "img")
    make_image_folder(src, per_class=3)
    paths = shards.write_shards(src, str(tmp_path / "o" / "x-%02d.tar"), 4, progress=False)
    for p in paths:
        assert load_index(p) == build_index(p)
    ds = WebDataset(paths, shuffle="global")
    assert sorted(s["__key__"] for s in ds) == sorted(
        s["__key__"] for s in WebDataset(paths, shuffle_shards=False))


def _index_doc(path):
    with open(path + INDEX_SUFFIX) as f:
        return json.load(f)


@pytest.mark.parametrize("damage, message", [
    (lambda d: b"{not json", "not JSON"),
    (lambda d: json.dumps(dict(d, format="other/9")).encode(), "format is 'other/9'"),
    (lambda d: json.dumps(dict(d, shard_bytes=True)).encode(), "shard_bytes must be an int"),
    (lambda d: json.dumps(dict(d, sizes=d["sizes"][:-1])).encode(), "same length"),
    (lambda d: json.dumps(dict(d, offsets=d["offsets"][::-1])).encode(), "out of order"),
    (lambda d: json.dumps(dict(d, sizes=[d["shard_bytes"]] * len(d["sizes"]))).encode(),
     "runs past the shard"),
    (lambda d: json.dumps(dict(d, offsets=[0] * 10**5, sizes=[512] * 10**5)).encode(),
     "cannot fit in"),
    (lambda d: json.dumps(dict(d, shard_bytes=d["shard_bytes"] + 512)).encode(), "stale"),
    (lambda d: json.dumps(dict(d, sha256="abc")).encode(), "sha256 must be"),
    (lambda d: json.dumps(dict(d, shard_mtime_ns="1")).encode(), "shard_mtime_ns must be an int"),
    (lambda d: b" " * (MAX_INDEX_BYTES + 1), "larger than"),
])
def test_a_bad_index_file_gives_an_error_naming_it(indexed, damage, message):
    path = indexed[1]
    data = damage(_index_doc(path))
    with open(path + INDEX_SUFFIX, "wb") as f:
        f.write(data)
    with pytest.raises(ShardIndexError, match=f"shard index {path}{INDEX_SUFFIX}: .*{message}"):
        load_index(path)
    with pytest.raises(ShardIndexError, match="shards index PATTERN"):
        WebDataset(indexed, shuffle="global")


def test_global_shuffle_without_an_index_says_how_to_make_one(tmp_path):
    paths = make_shards(str(tmp_path / "s"), [3, 4])
    with pytest.raises(ShardIndexError, match=r"shard-0000\.tar has no readable index .*"
                                              r"python -m pooled_loader shards index"):
        WebDataset(paths, shuffle="global")
    with pytest.raises(ValueError, match="leave samples_per_epoch and shuffle_buffer unset"):
        WebDataset(paths, shuffle="global", shuffle_buffer=10)
    with pytest.raises(ValueError, match="shuffle must be 'shards' or 'global'"):
        WebDataset(paths, shuffle="yes")
    assert sorted(WebDataset(paths, transform=sample_id)) == list(range(7))  # today's way
    assert parse_index(b'{"format": "pooled_loader.shard_index/1", "shard_bytes": 0, '
                       b'"sha256": null, "offsets": [], "sizes": []}', "x").offsets == ()


@pytest.mark.parametrize("world, nworkers", [(1, 2), (2, 2), (3, 1)])
def test_global_shuffle_gives_every_sample_once_per_epoch_over_ranks_and_workers(
        indexed, monkeypatch, world, nworkers):
    per_rank = 121 // world
    epochs = []
    for epoch in (0, 1):
        got = []
        for rank in range(world):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", str(world))
            ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=5)
            assert len(ds) == per_rank
            ids = flat(run_epoch(ds, epoch, num_workers=nworkers))
            assert len(ids) == per_rank  # every rank the same count
            got.append(ids)
        every = [i for ids in got for i in ids]
        assert len(set(every)) == len(every) == world * per_rank  # each at most once
        epochs.append(every)
    assert epochs[0] != epochs[1]  # a new permutation each epoch
    assert sorted(epochs[0]) != list(range(world * per_rank)) or world == 1
    monkeypatch.setenv("RANK", "0")
    again = WebDataset(indexed, transform=sample_id, shuffle="global", seed=5)
    assert flat(run_epoch(again, 0, num_workers=nworkers)) == epochs[0][:per_rank]


def test_global_order_mixes_shards_unlike_shard_order(indexed):
    """Within the first 20 samples, shard order reads at most 3 shards; a permutation of all
    samples reads (almost surely) from 5 or more of the 7."""
    shard_of = {}
    gid = 0
    for s, n in enumerate(SIZES):
        for _ in range(n):
            shard_of[gid] = s
            gid += 1
    ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=1)
    first = list(ds)[:20]
    assert len({shard_of[i] for i in first}) >= 5


def test_global_shuffle_over_http_reads_one_range_per_sample(indexed, tmp_path):
    root = os.path.dirname(indexed[0])
    with ShardServer(root) as srv:
        urls = [srv.url(os.path.basename(p)) for p in indexed]
        ds = WebDataset(urls, transform=sample_id, shuffle="global", seed=2)
        local = WebDataset(indexed, transform=sample_id, shuffle="global", seed=2)
        srv.clear()
        ids = flat(run_epoch(ds, 3))
        assert ids == flat(run_epoch(local, 3))  # the same order as from local disk
        srv.settle()
        tars = [(n, r) for n, r, _, _ in srv.log if n.endswith(".tar")]
        assert len(tars) == 121 and all(r and r.startswith("bytes=") and not r.endswith("-")
                                        for _, r in tars)  # bounded Range requests
        # each sample's bytes, and the shard's first bytes before its first sample and the
        # end-of-archive marker after its last (read to check the index covers the shard)
        assert sum(sent for name, _, _, sent in srv.log if name.endswith(".tar")) == sum(
            sum(ix.sizes) + ix.offsets[0] + 1024 for ix in map(load_index, indexed))
        # With a cache that holds the shards: downloaded once (checked against the index's
        # size and SHA-256), later epochs make no request.
        cached = WebDataset(urls, transform=sample_id, shuffle="global", seed=2,
                            cache_dir=str(tmp_path / "c"), cache_limit="1MB")
        srv.clear()
        assert flat(run_epoch(cached, 3)) == ids
        srv.settle()
        assert sorted(srv.requests) == sorted(os.path.basename(p) for p in indexed)
        assert all(r is None for _, r, _, _ in srv.log)  # whole shards
        srv.clear()
        assert sorted(flat(run_epoch(cached, 4))) == list(range(121))
        srv.settle()
        assert sum(srv.requests.values()) == 0
        with pytest.warns(RuntimeWarning, match="exceed cache_limit"):
            WebDataset(urls, shuffle="global", cache_dir=str(tmp_path / "d"), cache_limit=4096)


def take(ds, k):
    it = iter(ds)
    got = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    return got, state


def test_global_shuffle_resumes_exactly_at_every_step(indexed, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fake_worker(monkeypatch, 1, 2)

    def make():
        ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=9)
        ds.set_epoch(4)
        return ds

    full = list(make())
    assert len(full) == 30  # 60 per rank, 30 for the second worker
    for k in range(len(full) + 1):
        got, state = take(make(), k)
        assert got == full[:k]
        assert (state["mode"], state["consumed"], state["done"], state["epoch"]) == (
            "global", k, k, 4)
        assert len(json.dumps(state)) < 400  # small, whatever the dataset's size
        ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=9)
        ds.load_state_dict(state)  # sets the epoch
        assert list(ds) == full[k:], k
    # The consumed positions are a pure function of the state (for an elastic re-deal).
    assert list(consumed_positions(state)) == list(range(1 + 2 * 1, 1 + 2 * 1 + 4 * 30, 4))
    bad = dict(state, seed=1)
    ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=9)
    ds.load_state_dict(bad)
    with pytest.raises(ValueError, match="seed: state 1, dataset 9"):
        list(ds)
    with pytest.raises(ValueError, match="state is from shuffle='shards'"):
        WebDataset(indexed, shuffle="global").load_state_dict(
            WebDataset(indexed).state_dict())


def test_global_shuffle_resumes_through_the_loader_with_real_workers(indexed):
    def make():
        ds = WebDataset(indexed, transform=sample_id, shuffle="global", seed=3)
        loader = PooledLoader(ds, batch_size=4, num_workers=2, snapshot_every_n_steps=2)
        loader.set_epoch(1)
        return loader

    full = [b.tolist() for b in make()]
    assert sorted(i for b in full for i in b) == list(range(121))
    loader = make()
    it = iter(loader)
    got = [next(it).tolist() for _ in range(7)]
    state = json.loads(json.dumps(loader.state_dict()))
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [b.tolist() for b in resumed] == full
