"""Resume on another number of ranks (issue 25): ranks as real processes (forked with
RANK/WORLD_SIZE, and spawned gloo ranks) save their states after k batches; a world of another
size loads `merge_rank_states` of them all; the union of what was delivered before and after is
exactly one epoch, each sample once, with equal batch counts per rank."""
from __future__ import annotations

import collections
import json
import multiprocessing
import os

import numpy as np
import pytest

from elastic_ranks import forked_rank, gloo_rank, make
from pooled_loader.resume.elastic import ElasticDistributedSampler, merge_rank_states
from pooled_loader.resume.state import StateMismatch
from ranks import run_ranks
from resume_datasets import Noisy

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def run_world(world: int, phase: str, workdir: str, cfg: dict) -> list[dict]:
    """Every rank of `world` in its own forked process; what each delivered."""
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=forked_rank, args=(r, world, phase, workdir, cfg))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world, f"a rank of {phase} failed"
    return [json.load(open(os.path.join(workdir, f"{phase}_{r}.json"))) for r in range(world)]


def samples(outputs: list[dict]) -> dict[int, list]:
    """index -> the noise drawn for it, every time it was delivered."""
    seen = collections.defaultdict(list)
    for out in outputs:
        for index, noise in out["batches"]:
            for i, n in zip(index, noise):
                seen[i].append(n)
    return seen


def check_epoch(before: list[dict], after: list[dict], cfg: dict, full: list[dict] | None):
    n, new_world = cfg["n"], len(after)
    got = samples(before + after)
    if cfg["drop_last"]:  # missing: the tails each world drops, each rank's last partial batch
        assert all(len(v) == 1 for v in got.values())
        assert n - len(got) < len(before) + new_world * cfg["batch"]
    else:  # padding repeats a few samples so that ranks get equal counts
        assert set(got) == set(range(n))
        extra = sum(len(v) - 1 for v in got.values())
        assert extra < len(before) + new_world
    counts = {len(out["batches"]) for out in after}
    assert len(counts) == 1, f"ranks delivered {counts} batches: DDP would hang"
    assert {out["len"] for out in after} == counts
    if full is not None:  # per_sample_seed: each sample's draws as in the uninterrupted run
        reference = samples(full)
        for i, draws in got.items():
            assert all(d == reference[i][0] for d in draws), i


@pytest.mark.parametrize("old,new", [(4, 3), (2, 5)])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("per_sample_seed,workers,drop_last", [
    (True, 0, False), (False, 2, True)])
def test_state_saved_on_n_ranks_resumes_on_m_ranks(tmp_path, old, new, steps, per_sample_seed,
                                                   workers, drop_last):
    cfg = dict(n=61, batch=4, workers=workers, drop_last=drop_last, epoch=2, steps=steps,
               per_sample_seed=per_sample_seed)
    full = run_world(old, "full", str(tmp_path), cfg) if per_sample_seed else None
    before = run_world(old, "save", str(tmp_path), cfg)
    after = run_world(new, "resume", str(tmp_path), cfg)
    check_epoch(before, after, cfg, full)


def test_gloo_ranks_resume_on_another_world_size(tmp_path):
    cfg = dict(n=37, batch=3, workers=1, drop_last=False, epoch=0, steps=2,
               per_sample_seed=True)
    for world, phase in ((2, "full"), (2, "save"), (3, "resume")):
        run_ranks(gloo_rank, world, (world, phase, str(tmp_path), cfg), deadline_s=180)
    load = lambda phase, w: [json.load(open(tmp_path / f"{phase}_{r}.json"))  # noqa: E731
                             for r in range(w)]
    check_epoch(load("save", 2), load("resume", 3), cfg, load("full", 2))


def test_resumed_twice_within_an_epoch_still_gives_each_sample_once(tmp_path):
    cfg = dict(n=50, batch=2, workers=0, drop_last=True, epoch=1, steps=2,
               per_sample_seed=False)
    first = run_world(3, "save", str(tmp_path), cfg)
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    # the 2-rank world resumes, delivers 2 batches, saves; a 4-rank world resumes from that
    states = [json.load(open(tmp_path / f"state_{r}.json")) for r in range(3)]
    merged = merge_rank_states(states)
    outs = []
    for r in range(2):
        os.environ.update(RANK=str(r), WORLD_SIZE="2")
        try:
            loader = make(cfg)
            loader.load_state_dict(merged)
            loader.set_epoch(cfg["epoch"])
            it = iter(loader)
            got = [[b[0].tolist(), b[1].tolist()] for b in (next(it), next(it))]
            outs.append({"batches": got, "len": len(loader)})
            with open(second_dir / f"state_{r}.json", "w") as f:
                json.dump(loader.state_dict(), f)
            del it
        finally:
            del os.environ["RANK"], os.environ["WORLD_SIZE"]
    last = run_world(4, "resume", str(second_dir), cfg)
    check_epoch(first + outs, last, cfg, None)


def two_rank_states(monkeypatch, steps: int) -> list[dict]:
    """The states of both ranks of a 2-rank world after `steps` batches (in-process ranks)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    states = []
    for r in range(2):
        monkeypatch.setenv("RANK", str(r))
        loader = make(dict(n=20, batch=2, workers=0, drop_last=False, per_sample_seed=False))
        it = iter(loader)
        for _ in range(steps):
            next(it)
        states.append(loader.state_dict())
    return states


def test_a_single_state_suffices_for_lockstep_ranks(monkeypatch):
    states = two_rank_states(monkeypatch, 2)
    assert merge_rank_states([states[1]], lockstep=True)["rounds"] == \
        merge_rank_states(states)["rounds"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    loader = make(dict(n=20, batch=2, workers=0, drop_last=False, per_sample_seed=False))
    loader.load_state_dict(states[0])  # another world size: taken as lockstep
    rest = [i for b in loader for i in b[0].tolist()]
    assert len(rest) == 4  # 12 of 20 left, dealt 4 per rank


def test_states_that_cannot_be_merged_or_honoured_say_what_differs(monkeypatch):
    states = two_rank_states(monkeypatch, 1)
    with pytest.raises(StateMismatch, match=r"missing \[1\]"):
        merge_rank_states([states[0]])
    with pytest.raises(StateMismatch, match="no state given"):
        merge_rank_states([])
    other = json.loads(json.dumps(states[1]))
    other["_pooled"]["dataset_len"] = 21
    with pytest.raises(StateMismatch, match="dataset_len=21, state 0 has 20"):
        merge_rank_states([states[0], other])
    merged = merge_rank_states(states)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(StateMismatch, match="dataset_len=20, this loader has dataset_len=22"):
        make(dict(n=22, batch=2, workers=0, drop_last=False,
                  per_sample_seed=False)).load_state_dict(merged)
    bad = json.loads(json.dumps(merged))
    bad["rounds"][0]["consumed"]["0"] = [[5, 10 ** 9]]
    with pytest.raises(StateMismatch, match=r"'rounds\[0\]\.consumed\.0\[0\]\[1\]' is 10+, more"):
        make(dict(n=20, batch=2, workers=0, drop_last=False,
                  per_sample_seed=False)).load_state_dict(bad)


def test_elastic_sampler_gives_distributed_samplers_order_and_redeals_a_plan():
    from torch.utils.data import DistributedSampler
    ds = Noisy(23)
    for drop_last in (False, True):
        served = []
        for rank in range(4):
            ours = ElasticDistributedSampler(ds, num_replicas=4, rank=rank, seed=3,
                                             drop_last=drop_last)
            theirs = DistributedSampler(ds, num_replicas=4, rank=rank, seed=3,
                                        drop_last=drop_last)
            ours.set_epoch(5), theirs.set_epoch(5)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            served += list(ours)
        # a plan that consumed nothing: the 4-rank epoch's samples, re-dealt to 3 ranks
        plan = {"epoch": 5, "rounds": [{"world": 4, "drop_last": drop_last, "consumed": {}}]}
        shares = []
        for rank in range(3):
            s = ElasticDistributedSampler(ds, num_replicas=3, rank=rank, seed=3,
                                          drop_last=drop_last)
            s.set_plan(plan)
            shares.append(list(s))
        assert len({len(x) for x in shares}) == 1
        dealt = sum(shares, [])
        if drop_last:  # 20 served by 4 ranks; 18 of them dealt to 3
            assert len(dealt) == len(set(dealt)) == 18 and set(dealt) <= set(served)
        else:
            assert set(dealt) == set(served) == set(range(23))


@pytest.mark.parametrize("old,new", [((4, 2), (3, 1)), ((2, 1), (5, 3)), ((2, 2), (2, 3))])
@pytest.mark.parametrize("buffer", [0, 4])
def test_webdataset_state_of_n_ranks_resumes_on_m_ranks_and_other_workers(tmp_path, old, new,
                                                                          buffer):
    from test_webdataset import make_shards
    shards = str(tmp_path / "shards")
    make_shards(shards, [9, 14, 5, 11, 8])  # 47 samples
    (old_world, old_workers), (new_world, new_workers) = old, new
    work = tmp_path / "run"
    work.mkdir()
    cfg = dict(shards=shards, buffer=buffer, batch=2, epoch=1, steps=2, workers=old_workers)
    before = run_world(old_world, "save", str(work), cfg)
    after = run_world(new_world, "resume", str(work), dict(cfg, workers=new_workers))
    ids = [i for out in before + after for b, _ in out["batches"] for i in b]
    assert len(ids) == len(set(ids)), "a sample was read twice"
    # the old world leaves 47 % old_world unseen, the new one what its split cannot share
    assert 47 - len(ids) < old_world + new_world * new_workers
    per_rank = {sum(len(b) for b, _ in out["batches"]) for out in after}
    assert len(per_rank) == 1, f"ranks yielded {per_rank} samples: DDP would hang"
