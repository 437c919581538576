"""pooled_loader.distributed, and WebDataset under real torch.distributed: 3 gloo ranks on
loopback, each with 2 loader worker processes, over 7 uneven shards."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import webdataset as wds
from ranks import run_ranks
from torch.utils.data import DistributedSampler, IterableDataset

import pooled_loader.distributed as pdist
from pooled_loader import PooledLoader
from pooled_loader.distributed import make_distributed_sampler, warn_if_undistributed
from pooled_loader.core.ranks import rank_and_world
from pooled_loader.shards.webdataset import WebDataset

SIZES = [5, 41, 12, 1, 33, 20, 9]  # 121 samples
WORLD, WORKERS, BATCH = 3, 2, 8


def make_shards(root, sizes):
    """Tar shards with consecutive global ids: key ``%06d``, ``.txt`` = id."""
    os.makedirs(root, exist_ok=True)
    gid = 0
    for s, size in enumerate(sizes):
        with wds.TarWriter(os.path.join(root, f"shard-{s:04d}.tar"), encoder=False) as w:
            for _ in range(size):
                w.write({"__key__": f"{gid:06d}", "txt": str(gid).encode()})
                gid += 1


def sample_id(sample):
    return int(sample["txt"])


# -- without a process group -----------------------------------------------------------------
def test_rank_and_world_from_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_and_world() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world() == (2, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4"):
        rank_and_world()


def test_make_distributed_sampler(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    data = list(range(10))
    sampler = make_distributed_sampler(data, shuffle=False, seed=0, drop_last=False)
    assert isinstance(sampler, DistributedSampler)
    assert list(sampler) == [1, 4, 7, 0]  # ceil(10/3) = 4, padded from the start
    assert len(make_distributed_sampler(data, shuffle=False, drop_last=True)) == 3
    shuffled = make_distributed_sampler(data, shuffle=True, seed=3)
    first = list(shuffled)
    shuffled.set_epoch(1)
    assert first != list(shuffled) and len(first) == 4
    make_shards(str(tmp_path), [3])
    assert make_distributed_sampler(WebDataset(str(tmp_path)), shuffle=True) is None

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="map-style"):
        make_distributed_sampler(Stream(), shuffle=False)


def test_no_warning_without_process_group(monkeypatch):
    monkeypatch.setattr(pdist, "_warned_undistributed", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_undistributed(True, None) is False


# -- 3 real ranks x 2 workers ----------------------------------------------------------------
def rank_main(rank, port, shard_dir, seed, out_dir, worker_start):
    """One rank: two epochs over the shards with a collective per batch, as DDP does (a rank
    with fewer batches would leave the others blocked until the gloo timeout). Its loader
    workers are started with ``worker_start`` ("fork": they inherit the process group;
    "spawn": they only have what the pickled dataset carries; persistent, so that set_epoch
    must reach them)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=30))
    try:
        ds = WebDataset(shard_dir, transform=sample_id, seed=seed, shuffle_buffer=8)
        loader = PooledLoader(ds, batch_size=BATCH, num_workers=WORKERS,
                                multiprocessing_context=worker_start,
                                persistent_workers=worker_start == "spawn")
        epochs = []
        for epoch in range(2):
            (loader if hasattr(loader, "set_epoch") else ds).set_epoch(epoch)
            batches = []
            for batch in loader:
                batches.append([int(i) for i in batch])
                step = torch.ones(1)
                dist.all_reduce(step)
                assert step.item() == WORLD
            counts = [None] * WORLD
            dist.all_gather_object(counts, len(batches))
            epochs.append(batches)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pdist._warned_undistributed = False
            warned = [warn_if_undistributed(True, None), warn_if_undistributed(True, None)]
            pdist._warned_undistributed = False
            warned += [warn_if_undistributed(False, None),
                       warn_if_undistributed(True, DistributedSampler(list(range(4))))]
        map_loader = PooledLoader(list(range(10)), batch_size=2, shuffle=True, distributed=True)
        result = {
            "epochs": epochs, "len": len(ds), "rank_world": list(rank_and_world()),
            "warned": warned, "messages": [str(w.message) for w in caught],
            "map_indices": [int(i) for b in map_loader for i in b],
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(shard_dir, seed, out_dir, worker_start="fork"):
    os.makedirs(out_dir)
    run_ranks(rank_main, WORLD, (shard_dir, seed, out_dir, worker_start), deadline_s=90)
    results = []
    for r in range(WORLD):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.mark.timeout(240)
def test_three_ranks_two_workers_uneven_shards(tmp_path):
    shard_dir = str(tmp_path / "shards")
    make_shards(shard_dir, SIZES)
    runs = [launch(shard_dir, 11, str(tmp_path / "run1"), "fork"),
            launch(shard_dir, 11, str(tmp_path / "run2"), "spawn")]
    res = runs[0]
    n = sum(SIZES)
    assert [r["rank_world"] for r in res] == [[k, WORLD] for k in range(WORLD)]
    orders = []
    for epoch in range(2):
        batches = [r["epochs"][epoch] for r in res]
        assert len({len(b) for b in batches}) == 1, "ranks differ in batch count: DDP would hang"
        ids = [[i for b in rank_batches for i in b] for rank_batches in batches]
        assert all(len(x) == n // WORLD == r["len"] for x, r in zip(ids, res))
        seen = [i for x in ids for i in x]
        assert len(seen) == len(set(seen)), "a sample was read twice in one epoch"
        assert set(seen) <= set(range(n)) and len(set(seen)) >= 0.95 * n
        orders.append(ids)
    assert orders[0] != orders[1] and all(a != b for a, b in zip(*orders))
    # Rerun with the same seed (and spawned loader workers): the very same batches.
    assert [r["epochs"] for r in runs[1]] == [r["epochs"] for r in res], "same seed, new order"
    for r in res:
        assert r["warned"] == [True, False, False, False]
        assert len(r["messages"]) == 1 and "every rank" in r["messages"][0]
    parts = [r["map_indices"] for r in res]  # PooledLoader(distributed=True), map-style
    assert [len(p) for p in parts] == [4, 4, 4]  # ceil(10 / 3), padded by repetition
    assert set(i for p in parts for i in p) == set(range(10))


def test_pooled_loader_distributed_with_webdataset(monkeypatch, tmp_path):
    """distributed=True over a WebDataset: no sampler, the dataset splits itself by rank."""
    cls = PooledLoader
    make_shards(str(tmp_path), SIZES)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = WebDataset(str(tmp_path), transform=sample_id, seed=2)
    loader = cls(ds, batch_size=8, shuffle=True, distributed=True)
    ids = [int(i) for b in loader for i in b]
    assert len(ids) == len(ds) == 60 and len(set(ids)) == 60
