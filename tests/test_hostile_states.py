"""Hostile loaded states (issue 35, States): every number in a state is checked against what it can
be before anything is allocated or skipped, and refused with a ValueError naming its dotted key.

Each case starts from a real state of a real loader (0 and 2 worker processes, JSON round-tripped),
changes one value, and loads it. Before the checks these were silently wrong (a resumed epoch of
one batch, samples dropped or read twice) or ran out of memory (a world of 10**12 ranks); the
timeouts keep a regression from hanging the suite."""
from __future__ import annotations

import json
import re

import pytest
from test_webdataset import make_shards, sample_id

from elastic_ranks import make as make_elastic
from pooled_loader import PooledLoader
from pooled_loader.shards import writer as shards
from pooled_loader.resume.elastic import merge_rank_states
from pooled_loader.ragged.samplers import LengthGroupedSampler, TokenBudgetBatchSampler
from pooled_loader.shards.webdataset import WebDataset
from resume_datasets import Noisy

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.filterwarnings("ignore:This DataLoader will create")]


def rt(state):
    return json.loads(json.dumps(state))


def put(state, path, value):
    """A copy of `state` with `value` at `path` (dotted keys; digits index lists)."""
    state = rt(state)
    node = state
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return state


def refused(key):
    """pytest.raises for a ValueError that names `key` (quoted, as the messages do)."""
    return pytest.raises(ValueError, match=re.escape(f"'{key}'"))


def state_after(make, batches):
    loader = make()
    it = iter(loader)
    for _ in range(batches):
        next(it)
    state = rt(loader.state_dict())
    del it
    loader.close()
    return state


# -- map-style samplers: the sampler's own position ----------------------------------------------
SAMPLERS = {
    "shuffle": (lambda w: PooledLoader(Noisy(40), batch_size=2, shuffle=True, num_workers=w),
                "inner"),
    "length_grouped": (lambda w: PooledLoader(
        Noisy(40), batch_size=2, num_workers=w,
        sampler=LengthGroupedSampler(list(range(40)), 2, num_replicas=1, rank=0)), "inner"),
    "token_budget": (lambda w: PooledLoader(
        Noisy(40), num_workers=w,
        batch_sampler=TokenBudgetBatchSampler(list(range(1, 41)), 60, num_replicas=1, rank=0)),
        "sampler"),
}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("yielded", [-1, -8, 10 ** 18, True])
def test_a_samplers_yielded_outside_its_pass_is_refused_at_load(workers, sampler, yielded):
    # -1 and -8 sliced from the end of the pass (a resumed epoch of one batch), 10**18 skipped
    # it all, True was taken as 1
    make, kind = SAMPLERS[sampler]
    state = state_after(lambda: make(workers), 3)
    key = f"_snapshot._main_snapshot._index_sampler_state.{kind}.yielded"
    assert isinstance(state["_snapshot"]["_main_snapshot"]["_index_sampler_state"][kind]
                      ["yielded"], int)
    loader = make(workers)
    with refused(key):
        loader.load_state_dict(put(state, key, yielded))
    loader.load_state_dict(state)  # the real one still loads, and gives the rest of the epoch
    assert len(list(loader)) == len(loader) - 3


@pytest.mark.parametrize("key,value", [("seed", 2 ** 64), ("seed", False),
                                       ("generator", "AAAA")])
def test_a_shuffle_samplers_seed_that_no_generator_takes_is_refused(key, value):
    make = SAMPLERS["shuffle"][0]
    path = "_snapshot._main_snapshot._index_sampler_state.inner"
    state = state_after(lambda: make(0), 2)
    state = put(state, path, {key: value, "yielded": 4})
    with refused(f"{path}.{key}"):
        make(0).load_state_dict(state)


@pytest.mark.parametrize("key,value", [("epoch", -1), ("epoch", True), ("seed", -5)])
def test_a_length_samplers_epoch_or_seed_that_numpy_refuses_is_refused_naming_it(key, value):
    make = SAMPLERS["length_grouped"][0]
    path = "_snapshot._main_snapshot._index_sampler_state.inner"
    state = state_after(lambda: make(0), 2)
    with refused(f"{path}.{key}"):
        make(0).load_state_dict(put(state, f"{path}.{key}", value))


# -- elastic (distributed=True) rank states and merged states ------------------------------------
CFG = dict(n=20, batch=2, drop_last=False, per_sample_seed=False)


def rank_states(monkeypatch, workers, steps=2, world=2):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    states = []
    for r in range(world):
        monkeypatch.setenv("RANK", str(r))
        states.append(state_after(lambda: make_elastic(dict(CFG, workers=workers)), steps))
    return states


def loader_of_world(monkeypatch, world, rank, workers=0):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", str(rank))
    return make_elastic(dict(CFG, workers=workers))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_world_of_10_to_the_12_ranks_is_refused_before_any_rank_is_listed(monkeypatch,
                                                                           workers):
    # it was a MemoryError after minutes (a list of 10**12 ranks), in merge_rank_states and in
    # load_state_dict, which merges a single state from another world size itself
    states = rank_states(monkeypatch, workers)
    huge = [put(s, "_pooled.world_size", 10 ** 12) for s in states]
    with refused("_pooled.world_size"):
        merge_rank_states(huge)
    with refused("_pooled.world_size"):
        merge_rank_states(huge[:1], lockstep=True)
    with refused("_pooled.world_size"):
        loader_of_world(monkeypatch, 3, 0, workers).load_state_dict(huge[0])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_size_of_10_to_the_12_is_refused_when_merging(monkeypatch, workers):
    # two batches of 10**12 samples from a share of 10: the consumed range was [0, 2 * 10**12),
    # allocated at the next iter() (terabytes)
    states = [put(s, "_pooled.batch_size", 10 ** 12) for s in rank_states(monkeypatch, workers)]
    with refused("_pooled.batch_size"):
        merge_rank_states(states)


def test_one_batch_larger_than_the_share_consumes_the_share_and_nothing_more(monkeypatch):
    states = rank_states(monkeypatch, 0, steps=1)
    states = [put(s, "_pooled.batch_size", 10 ** 12) for s in states]
    merged = merge_rank_states(states)
    assert all(r == [[0, 10]] for r in merged["rounds"][0]["consumed"].values())
    loader = loader_of_world(monkeypatch, 3, 0)
    loader.load_state_dict(merged)
    assert list(loader) == []  # the 2-rank world's shares were consumed whole


def merged_state(monkeypatch, workers):
    return rt(merge_rank_states(rank_states(monkeypatch, workers)))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("rank", ["2", "7", "-1", "01"])
def test_consumed_ranges_under_a_rank_outside_the_world_are_refused(monkeypatch, workers, rank):
    # rank 7 of 2 marked positions 7, 9, 11 of the other ranks consumed: samples silently dropped
    merged = merged_state(monkeypatch, workers)
    merged["rounds"][0]["consumed"][rank] = [[0, 2]]
    with refused(f"rounds[0].consumed.{rank}"):
        loader_of_world(monkeypatch, 3, 0, workers).load_state_dict(merged)


@pytest.mark.parametrize("path,value,key", [
    ("rounds.0.world", 10 ** 12, "rounds[0].world"),
    ("rounds.0.world", True, "rounds[0].world"),
    ("rounds.0.drop_last", 0, "rounds[0].drop_last"),
    ("rounds.0.consumed.0", [[0, 4], [2, 6]], "rounds[0].consumed.0[1]"),
    ("rounds.0.consumed.0", [[4, 2]], "rounds[0].consumed.0[0][1]"),
    ("rounds.0.consumed.0", [[0, 10 ** 12]], "rounds[0].consumed.0[0][1]"),
    ("rounds.0.consumed.0", [[0, True]], "rounds[0].consumed.0[0][1]"),
    ("batch_size", 0, "batch_size"),
    ("finished", "no", "finished"),
])
def test_a_malformed_merged_state_is_refused_naming_the_key(monkeypatch, path, value, key):
    merged = put(merged_state(monkeypatch, 0), path, value)
    with refused(key):
        loader_of_world(monkeypatch, 3, 0).load_state_dict(merged)


@pytest.mark.parametrize("value", [-1, True, "1"])
def test_a_resumed_plans_epoch_that_is_not_a_count_is_refused(monkeypatch, value):
    # a state saved while a merged epoch runs carries its plan; True was taken as epoch 1
    merged = merged_state(monkeypatch, 0)
    state = state_after(lambda: _loaded(loader_of_world(monkeypatch, 3, 1), merged), 1)
    assert state["_pooled"]["elastic"]["plan"]["epoch"] == 0
    with refused("_pooled.elastic.plan.epoch"):
        loader_of_world(monkeypatch, 3, 1).load_state_dict(
            put(state, "_pooled.elastic.plan.epoch", value))


def _loaded(loader, state):
    loader.load_state_dict(state)
    return loader


def test_rank_state_counts_are_refused_naming_the_key(monkeypatch):
    states = rank_states(monkeypatch, 0)
    for path, value in [("_pooled.rank", 2), ("_pooled.elastic.epoch", True),
                        ("_pooled.elastic.epoch", -1), ("_pooled.delivered_ahead", [1]),
                        ("_pooled.drop_last", "no"),
                        ("_snapshot._main_snapshot._sampler_iter_yielded", 6)]:
        key = path + "[0]" if isinstance(value, list) else path
        with refused(key):
            merge_rank_states([states[0], put(states[1], path, value)])


# -- WebDataset (counted mode) through the loader -------------------------------------------------
SIZES = [6, 11, 4, 9]  # 30 samples


@pytest.fixture
def shard_root(tmp_path):
    make_shards(str(tmp_path), SIZES)
    return str(tmp_path)


def wds_loader(root, workers, buffer=0):
    ds = WebDataset(root, transform=sample_id, seed=3, shuffle_shards=False,
                    shuffle_buffer=buffer)
    return PooledLoader(ds, batch_size=2, num_workers=workers)


def ids(loader):
    return [int(i) for b in loader for i in b]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("key,value", [("position.offset", 10 ** 9),
                                       ("position.offset", 1000),
                                       ("position.index", 10 ** 6),
                                       ("position.got", 1),
                                       ("round.mark", 10 ** 6),
                                       ("round.draining", "no")])
def test_a_webdataset_position_outside_its_shard_is_refused(shard_root, workers, key, value):
    # an offset past the shard's end silently dropped the rest of that shard
    state = state_after(lambda: wds_loader(shard_root, workers), 2)
    path = "_snapshot._worker_snapshots.worker_0.dataset_state"
    assert state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["position"]
    loader = wds_loader(shard_root, workers)
    loader.load_state_dict(put(state, f"{path}.{key}", value))
    with refused(key):
        list(loader)  # a worker checks its dataset's state before reading anything
    loader = wds_loader(shard_root, workers)
    loader.load_state_dict(state)
    assert len(ids(loader)) == 30 - 4


def test_a_shuffle_buffer_entry_past_its_shards_end_is_refused(shard_root):
    def make():
        ds = WebDataset(shard_root, transform=sample_id, seed=3, shuffle_shards=False,
                        shuffle_buffer=4)
        ds.set_epoch(1)
        return ds
    ds = make()
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = rt(ds.state_dict())
    assert state["buffer"]
    for key, value in [("buffer.0.1", 10 ** 9), ("buffer.0.2", 10 ** 6)]:
        ds = make()
        ds.load_state_dict(put(state, key, value))
        with refused("buffer[0]." + ("offset" if key.endswith("1") else "index")):
            list(ds)


def stream_states(root, workers):
    """The state of a one-rank world with `workers` workers after 2 batches, merged."""
    return rt(merge_rank_states([state_after(lambda: wds_loader(root, workers), 2)]))


@pytest.mark.parametrize("workers", [0, 2])
def test_overlapping_or_out_of_shard_runs_of_a_merged_stream_are_refused(shard_root, workers):
    merged = stream_states(shard_root, workers)
    runs = merged["dataset_state"]["runs"]
    assert runs
    for bad, key in [(runs + [runs[-1]], f"runs[{len(runs)}]"),  # read twice
                     ([[0, 0, 7]] + runs[1:], "runs[0][2]"),  # shard 0 has 6 samples
                     ([[9, 0, 1]] + runs[1:], "runs[0][0]")]:
        state = put(merged, "dataset_state.runs", bad)
        with refused(key):
            wds_loader(shard_root, workers).load_state_dict(state)
    loader = wds_loader(shard_root, workers)
    loader.load_state_dict(merged)
    assert len(ids(loader)) == 30 - 4


def test_stream_states_naming_a_world_of_10_to_the_12_are_refused_when_merging(shard_root):
    # the merge listed every (rank, worker) of the world it was told: 10**12 of them
    state = state_after(lambda: wds_loader(shard_root, 2), 2)
    for w in ("worker_0", "worker_1"):
        state = put(state, f"_snapshot._worker_snapshots.{w}.dataset_state.world_size", 10 ** 12)
    with refused("_snapshot._worker_snapshots.worker_0.dataset_state.world_size"):
        merge_rank_states([state])


# -- WebDataset global shuffle through the loader -------------------------------------------------
@pytest.fixture
def indexed_root(tmp_path):
    make_shards(str(tmp_path), SIZES)
    assert shards.main(["index", str(tmp_path)]) == 0
    return str(tmp_path)


def global_loader(root, workers):
    ds = WebDataset(root, transform=sample_id, shuffle="global", seed=5)
    return PooledLoader(ds, batch_size=2, num_workers=workers)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("key,value", [("consumed", 10 ** 18), ("consumed", 1),
                                       ("done", True), ("done", 10 ** 18),
                                       ("world_size", 10 ** 12), ("rank", -1)])
def test_a_global_shuffle_count_outside_the_share_is_refused(indexed_root, workers, key, value):
    # consumed 10**18 restarted the share at position 10**18 % share (samples repeated and
    # lost), done True was taken as 1
    state = state_after(lambda: global_loader(indexed_root, workers), 2)
    path = "_snapshot._worker_snapshots.worker_0.dataset_state"
    assert state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["mode"] \
        == "global"
    loader = global_loader(indexed_root, workers)
    loader.load_state_dict(put(state, f"{path}.{key}", value))
    with refused(key):
        list(loader)
    loader = global_loader(indexed_root, workers)
    loader.load_state_dict(state)
    assert len(ids(loader)) == 30 - 4


def test_a_statefuldataloader_state_of_10_to_the_12_workers_is_refused_before_listing_them():
    # found by the state fuzzer (issue 49's CI run): our state without its '_pooled' key loads
    # as StatefulDataLoader's, whose '_num_workers' of 10**12 built 10**12 worker names (a
    # MemoryError after 4 GB) before the entries were compared
    def make():
        return PooledLoader(Noisy(20), batch_size=3, shuffle=True)
    state = rt(state_after(make, 2))
    del state["_pooled"]
    state = put(state, "_snapshot._main_snapshot._num_workers", 10 ** 12)
    with refused("_snapshot._worker_snapshots"):
        make().load_state_dict(state)
