"""pooled_loader.mix.dataset resumed on another world size with a WebDataset source: the mix's merged
state carries the source's own merged state (its remaining samples), and the resumed mix reads
each source's rest once: real worker processes, real tar shards; ranks as the library sees them
without a process group (RANK/WORLD_SIZE in the environment)."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from pooled_loader import PooledLoader
from pooled_loader.resume.elastic import merge_rank_states
from pooled_loader.mix.dataset import Mix
from pooled_loader.shards.webdataset import WebDataset
from test_mix import Ids, Stream, flat
from test_webdataset import make_shards, sample_id

SHARDS = [30, 25, 41, 17]  # 113 web samples: ids 10_000..10_112


def web_id(sample) -> np.int64:
    return np.int64(10_000 + sample_id(sample))


def blend(shards, **kw) -> Mix:
    sources = {"a": Ids(0, 160), "web": WebDataset(shards, transform=web_id, seed=3),
               "b": Ids(1000, 70)}
    return Mix(sources, {"a": 0.4, "web": 0.35, "b": 0.25}, batch_size=4,
               stop="all_exhausted", drop_last=None, **kw)


def ranks(monkeypatch, shards, world, steps=None, states=None):
    """Every rank's samples (2 workers each) and its saved state."""
    out, saved = [], []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        loader = PooledLoader(blend(shards), batch_size=4, num_workers=2, distributed=True)
        if states is not None:
            loader.load_state_dict(json.loads(json.dumps(merge_rank_states(states))))
        got, it = [], iter(loader)  # held while the state is taken (see below)
        for k, batch in enumerate(it):
            got += batch.tolist()
            if k + 1 == steps:
                break
        out.append(got)
        # with its iterator alive, state_dict() waits for every worker's start state: a worker
        # that delivered nothing yet (steps=1) still has its whole share recorded
        saved.append(json.loads(json.dumps(loader.state_dict())))
        del it
    return [x for r in out for x in r], saved


@pytest.fixture
def shards(tmp_path):
    return make_shards(str(tmp_path / "s"), SHARDS)


def every_id_once(got, expected):
    repeated = [x for x, n in collections.Counter(got).items() if n > 1]
    assert not repeated, f"read twice: {sorted(repeated)[:10]}"
    assert sorted(got) == sorted(expected), (len(got), len(expected))


@pytest.mark.parametrize("steps", [1, 6])
def test_two_ranks_resume_on_three_with_every_sample_once(monkeypatch, shards, steps):
    full, _ = ranks(monkeypatch, shards, 2)
    # the uninterrupted run: every map-style item, and the web samples counted mode reads
    # (2 ranks: 113 // 2 * 2); each once
    assert len(set(full)) == len(full) and len([x for x in full if x >= 10_000]) == 112
    head, states = ranks(monkeypatch, shards, 2, steps=steps)
    rest, _ = ranks(monkeypatch, shards, 3, states=states)
    every_id_once(head + rest, full)


def test_three_ranks_then_one_then_every_sample_once(monkeypatch, shards):
    full, _ = ranks(monkeypatch, shards, 3)
    assert len([x for x in full if x >= 10_000]) == 111  # 113 // 3 * 3
    head, states = ranks(monkeypatch, shards, 3, steps=4)
    middle, states = ranks(monkeypatch, shards, 2, steps=3, states=states)
    rest, _ = ranks(monkeypatch, shards, 1, states=states)
    every_id_once(head + middle + rest, full)


def test_a_mix_with_an_iterable_source_without_elastic_state_is_refused_naming_it(
        monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    mix = Mix({"a": Ids(0, 50), "w": Stream(5000, 40)}, {"a": 1, "w": 1}, batch_size=4)
    loader = PooledLoader(mix, batch_size=4, num_workers=2)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    with pytest.raises(ValueError, match="source 'w' is an iterable dataset without an elastic"):
        merge_rank_states([loader.state_dict()])


def test_a_hostile_merged_source_state_is_refused_naming_the_key(monkeypatch, shards):
    _, states = ranks(monkeypatch, shards, 2, steps=2)
    merged = json.loads(json.dumps(merge_rank_states(states)))
    merged["dataset_state"]["per_source"]["web"]["state"]["runs"][0] = [0, -1, "x"]
    loader = PooledLoader(blend(shards), batch_size=4, num_workers=2)
    with pytest.raises(ValueError, match=r"per_source\.web\.state\.runs\[0\]"):
        loader.load_state_dict(merged)
