"""WebDataset.state_dict()/load_state_dict(): resume inside a shard at the byte offset of the next
sample, without reading consumed shards again (local seek, HTTP Range), shuffle buffer included."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest
from http_shards import ShardServer
from test_webdataset import fake_worker, make_shards, sample_id

from pooled_loader.shards import remote
from pooled_loader.shards.webdataset import WebDataset

SIZES = [6, 11, 4, 9]  # 30 samples


@pytest.fixture
def root(tmp_path):
    make_shards(str(tmp_path), SIZES)
    return str(tmp_path)


def take(ds, k):
    """The first k items of a fresh iteration, and the state after them (JSON round-tripped)."""
    it = iter(ds)
    got = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()  # as an interrupted run: its open shard is closed
    return got, state


def resumed(make, state):
    ds = make()
    ds.load_state_dict(state)
    return list(ds)


@pytest.mark.parametrize("buffer", [0, 5])
@pytest.mark.parametrize("shuffle_shards", [False, True])
def test_resume_at_every_step_gives_the_rest_of_the_epoch(root, buffer, shuffle_shards):
    def make():
        ds = WebDataset(root, transform=sample_id, shuffle_buffer=buffer,
                        shuffle_shards=shuffle_shards, seed=4)
        ds.set_epoch(2)
        return ds

    full = list(make())
    assert sorted(full) == list(range(30))
    for k in range(len(full) + 1):
        got, state = take(make(), k)
        assert got == full[:k]
        rest = resumed(lambda: WebDataset(root, transform=sample_id, shuffle_buffer=buffer,
                                          shuffle_shards=shuffle_shards, seed=4), state)
        assert rest == full[k:], k  # the epoch comes from the state


def test_resume_per_worker_and_rank(root, monkeypatch):
    """Each (rank, worker) keeps its own state; a resumed worker continues its own piece."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fake_worker(monkeypatch, 1, 2)
    make = lambda: WebDataset(root, transform=sample_id, shuffle_buffer=3, seed=1)  # noqa: E731
    full = list(make())
    assert len(full) == 7  # 30 / 2 ranks / 2 workers, the second worker gets 7
    got, state = take(make(), 3)
    assert (state["rank"], state["world_size"], state["worker"], state["num_workers"]) == (
        1, 2, 1, 2)
    assert got + resumed(make, state) == full
    fake_worker(monkeypatch, 0, 2)
    ds = make()
    ds.load_state_dict(state)
    with pytest.raises(ValueError, match=r"worker: state 1, dataset 0"):
        list(ds)


def test_mid_shard_resume_does_not_read_consumed_shards(root):
    """Proof by bytes read: after the resume, the shards already consumed are not opened, and
    the current one is read from the next sample's offset, not from its start."""
    paths = [os.path.join(root, f"shard-{i:04d}.tar") for i in range(4)]
    make = lambda: WebDataset(paths, transform=sample_id, shuffle_shards=False)  # noqa: E731
    got, state = take(make(), 6 + 11 + 2)  # 2 samples into the third shard
    assert got == list(range(19))
    assert state["position"]["shard"] == 2 and state["position"]["offset"] > 0
    assert len(json.dumps(state)) < 1000  # small: it travels with every snapshot
    remote.IO_STATS["opens"].clear()
    remote.IO_STATS["bytes"].clear()
    assert resumed(make, state) == list(range(19, 30))
    opens, read = remote.IO_STATS["opens"], remote.IO_STATS["bytes"]
    assert opens[paths[0]] == opens[paths[1]] == 0 and read[paths[0]] == read[paths[1]] == 0
    assert opens[paths[2]] == 1
    assert read[paths[2]] == os.path.getsize(paths[2]) - state["position"]["offset"]


@pytest.mark.parametrize("ranges", [True, False])
def test_remote_resume_uses_range_at_the_offset(root, ranges):
    with ShardServer(root, ranges=ranges) as srv:
        urls = [srv.url(f"shard-{i:04d}.tar") for i in range(4)]

        def make():
            return WebDataset(urls, transform=sample_id, shuffle_shards=False,
                              samples_per_epoch=30)

        got, state = take(make(), 6 + 11 + 2)
        srv.clear()
        assert got + resumed(make, state) == list(range(30))
        srv.settle()
        served = [(name, start) for name, _, start, _ in srv.log]
        offset = state["position"]["offset"]
        assert served[0] == ("shard-0002.tar", offset if ranges else 0)  # no earlier shard
        assert [name for name, _ in served] == ["shard-0002.tar", "shard-0003.tar"]


def test_shuffle_buffer_is_stored_as_positions_and_read_again(root):
    make = lambda: WebDataset(root, transform=sample_id, shuffle_buffer=8,  # noqa: E731
                              shuffle_shards=False)
    full = list(make())
    got, state = take(make(), 10)
    assert len(state["buffer"]) == 8 and all(len(p) == 3 for p in state["buffer"])
    assert len(json.dumps(state)) < 20_000  # positions and the RNG, never sample bytes
    assert got + resumed(make, state) == full


def test_compressed_shards_resume_by_skipping_samples(root, tmp_path):
    gz = tmp_path / "gz"
    gz.mkdir()
    for i in range(4):
        with open(os.path.join(root, f"shard-{i:04d}.tar"), "rb") as src, \
                gzip.open(gz / f"shard-{i:04d}.tar.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    urls = [str(gz / f"shard-{i:04d}.tar.gz") for i in range(4)]
    make = lambda: WebDataset(urls, transform=sample_id, shuffle_buffer=4, seed=3)  # noqa: E731
    full = list(make())
    assert sorted(full) == list(range(30))
    got, state = take(make(), 13)
    assert state["position"]["offset"] is None
    assert got + resumed(make, state) == full


def test_state_from_another_epoch_starts_that_epoch_afresh(root):
    make = lambda: WebDataset(root, transform=sample_id, seed=2)  # noqa: E731
    ds = make()
    ds.set_epoch(0)
    list(ds)
    finished = ds.state_dict()  # after the end of epoch 0
    ds = make()
    ds.load_state_dict(finished)
    assert list(ds) == []  # same epoch: nothing remains
    ds = make()
    ds.load_state_dict(finished)
    ds.set_epoch(1)  # the next epoch, as a training loop does
    epoch1 = make()
    epoch1.set_epoch(1)
    assert list(ds) == list(epoch1)
    _, partial = take(make(), 4)
    ds = make()
    ds.load_state_dict(partial)
    ds.set_epoch(1)
    with pytest.warns(RuntimeWarning, match="state is from epoch 0 but the dataset is at epoch 1"):
        assert list(ds) == list(epoch1)


def test_state_before_iteration_resumes_from_the_start(root):
    ds = WebDataset(root, transform=sample_id)
    state = ds.state_dict()
    assert state["position"] is None and state["done"] == 0
    assert resumed(lambda: WebDataset(root, transform=sample_id), state) == list(
        WebDataset(root, transform=sample_id))


def test_bad_states_are_refused_with_the_reason(root):
    make = lambda **kw: WebDataset(root, transform=sample_id, **kw)  # noqa: E731
    _, state = take(make(), 5)
    with pytest.raises(ValueError, match="must be a dict"):
        make().load_state_dict([1, 2])
    for key in ("position", "done"):
        broken = {k: v for k, v in state.items() if k != key}
        with pytest.raises(ValueError, match=f"incomplete: missing.*{key}"):
            make().load_state_dict(broken)
    with pytest.raises(ValueError, match=r"missing \['position.offset'\]"):
        make().load_state_dict({**state, "position": {k: v for k, v in state["position"].items()
                                                      if k != "offset"}})
    with pytest.raises(ValueError, match="version 99"):
        make().load_state_dict({**state, "version": 99})
    other = make(seed=7)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"does not fit.*seed: state 0, dataset 7"):
        list(other)
    fewer = WebDataset([os.path.join(root, f"shard-{i:04d}.tar") for i in range(3)],
                       transform=sample_id)
    fewer.load_state_dict(state)
    with pytest.raises(ValueError, match=r"shards: state 4, dataset 3"):
        list(fewer)


# -- through PooledLoader's own state_dict (real worker processes) ------------------------------
needs_loader_state = pytest.mark.skipif(
    not hasattr(__import__("pooled_loader").PooledLoader, "state_dict"),
    reason="PooledLoader.state_dict (resumable loading) is not in this version")


@needs_loader_state
@pytest.mark.parametrize("snapshot_every", [1, 3])
def test_loader_resume_mid_shard_over_http_reads_no_consumed_shard(root, snapshot_every,
                                                                   monkeypatch):
    """PooledLoader with 2 workers over http:// shards: the resumed loader gives the rest of the
    epoch; the server log shows each worker start again at its recorded shard and byte offset
    (a Range request) and never ask for a shard it had finished."""
    from pooled_loader import PooledLoader
    with ShardServer(root) as srv:
        urls = [srv.url(f"shard-{i:04d}.tar") for i in range(4)]

        def make():
            ds = WebDataset(urls, transform=sample_id, seed=6, samples_per_epoch=30)
            loader = PooledLoader(ds, batch_size=2, num_workers=2,
                                  snapshot_every_n_steps=snapshot_every)
            loader.set_epoch(1)
            return loader

        full = [b.tolist() for b in make()]
        assert sorted(i for b in full for i in b) == list(range(30))
        loader = make()
        it = iter(loader)
        got = [next(it).tolist() for _ in range(6)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it, loader
        srv.clear()
        resumed = make()
        resumed.load_state_dict(state)
        assert got + [b.tolist() for b in resumed] == full
        srv.settle()
        served = [(name, start) for name, _, start, _ in srv.log]
    snapshots = state["_snapshot"]["_worker_snapshots"]
    positions = [snapshots[f"worker_{w}"]["dataset_state"]["position"] for w in range(2)]
    assert any(p["offset"] > 0 and p["index"] > 0 for p in positions)  # mid-shard
    make_plain = WebDataset(urls, transform=sample_id, seed=6, samples_per_epoch=30)
    make_plain.set_epoch(1)
    for w in range(2):
        pos = snapshots[f"worker_{w}"]["dataset_state"]["position"]
        fake_worker(monkeypatch, w, 2)
        shards = make_plain._plan().shards
        names = [u.rsplit("/", 1)[1] for u in shards]
        mine = [(n, start) for n, start in served if n in names]
        assert mine[0] == (names[pos["shard"]], pos["offset"])  # Range at the offset
        finished = set(names[:pos["shard"]])
        assert not finished & {n for n, _ in mine}, (finished, mine)


def test_a_worker_starting_inside_a_local_shard_seeks_to_its_first_sample(root, monkeypatch):
    """Counted mode: worker 1 of 2 starts at sample 15 of the stream (inside shard 1): it reads
    shard 1 from that sample's offset, not from the start, and never opens shard 0."""
    paths = [os.path.join(root, f"shard-{i:04d}.tar") for i in range(4)]
    fake_worker(monkeypatch, 1, 2)
    remote.IO_STATS["opens"].clear()
    remote.IO_STATS["bytes"].clear()
    ids = list(WebDataset(paths, transform=sample_id, shuffle_shards=False))
    assert ids == list(range(15, 30))
    assert remote.IO_STATS["opens"][paths[0]] == 0
    assert 0 < remote.IO_STATS["bytes"][paths[1]] < os.path.getsize(paths[1]) / 2
