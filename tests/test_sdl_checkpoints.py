"""Checkpoints of torchdata's StatefulDataLoader load into a PooledLoader of the same
configuration (issue 36, point 9): run side by side with StatefulDataLoader (uninterrupted, and
resumed from its own state), the PooledLoader resumed from that state gives what the resumed
StatefulDataLoader gives (the same samples in the same batches, and with workers the same random
draws), and the uninterrupted run's samples; its own states after that resume (JSON round trip)
resume again, twice. Our states carry every key of StatefulDataLoader's layout."""
from __future__ import annotations

import io
import itertools
import json
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pooled_loader import PooledLoader
from pooled_loader.resume.state import StateMismatch
from resume_datasets import Noisy, Stream

sdl_module = pytest.importorskip("torchdata.stateful_dataloader")
StatefulDataLoader = sdl_module.StatefulDataLoader

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")]
logging.getLogger("torchdata").setLevel(logging.ERROR)  # its fast-forward notice


class CountingStream(IterableDataset):
    """Per worker: items `worker * 1000 + k`, k < n + worker, each with a draw from the worker's
    numpy RNG; its own state is the next k."""

    def __init__(self, n: int = 9):
        self.n, self.start, self.next_k = n, 0, 0

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        k, self.start = self.start, 0
        while k < self.n + wid:
            self.next_k = k + 1
            yield wid * 1000 + k, np.random.rand()
            k += 1

    def state_dict(self) -> dict:
        return {"next": self.next_k}

    def load_state_dict(self, state: dict) -> None:
        self.start = self.next_k = state["next"]


CASES = {  # dataset, loader arguments, whether later epochs match StatefulDataLoader's order
    "map-shuffled": (lambda: Noisy(11), {"shuffle": True, "generator": True}),
    "map-sequential": (lambda: Noisy(11), {}),
    "iterable-stateful": (lambda: CountingStream(9), {}),
    "iterable-without-state": (lambda: Stream(7), {}),
}


def build(cls, case: str, workers: int, persistent: bool = False, snapshot_every: int = 1):
    make_ds, kwargs = CASES[case]
    kwargs = dict(kwargs)
    if kwargs.pop("generator", False):
        kwargs["generator"] = torch.Generator().manual_seed(7)
    torch.manual_seed(0)
    return cls(make_ds(), batch_size=2, num_workers=workers, snapshot_every_n_steps=snapshot_every,
               persistent_workers=persistent and workers > 0, **kwargs)


def rows(batch) -> list:
    """A batch as comparable rows: (sample, draw...) or the sample alone."""
    if isinstance(batch, (list, tuple)):
        return [tuple(float(v) for v in np.hstack([np.ravel(x) for x in r]))
                for r in zip(*[t.tolist() for t in batch])]
    return [float(v) for v in batch.tolist()]


def samples(batches) -> list:
    return [[r[0] if isinstance(r, tuple) else r for r in b] for b in batches]


def epochs(loader, n: int) -> list[list]:
    return [[rows(b) for b in loader] for _ in range(n)]


def torch_roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def sdl_state(case, workers, persistent, snapshot_every, done_epochs, steps):
    loader = build(StatefulDataLoader, case, workers, persistent, snapshot_every)
    for _ in range(done_epochs):
        list(loader)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return torch_roundtrip(loader.state_dict())


def check_against_sdl(case, workers, persistent, snapshot_every, done_epochs, steps):
    truth = epochs(build(StatefulDataLoader, case, workers, persistent, snapshot_every),
                   done_epochs + 2)
    state = sdl_state(case, workers, persistent, snapshot_every, done_epochs, steps)
    theirs = build(StatefulDataLoader, case, workers, persistent, snapshot_every)
    theirs.load_state_dict(state)
    theirs = epochs(theirs, 2)
    ours = build(PooledLoader, case, workers, persistent)
    ours.load_state_dict(state)
    it = iter(ours)
    first = [rows(next(it)) for _ in range(min(1, len(theirs[0])))]
    second = json.loads(json.dumps(ours.state_dict()))
    ours_rest = first + [rows(b) for b in it]
    ours_next = [rows(b) for b in ours]
    # the rest of the epoch: StatefulDataLoader's samples, and with workers its draws too
    # (0 workers draw from this process; map-style batches it replays after its snapshot are
    # skipped here without being loaded: docs/resume.md)
    same_draws = workers > 0 and (snapshot_every == 1 or not CASES[case][1] and case.startswith(
        "iterable"))
    compare = (lambda bs: bs) if same_draws else samples
    assert compare(ours_rest) == compare(theirs[0])
    assert samples(ours_rest) == samples(truth[done_epochs][steps:])
    if CASES[case][1].get("shuffle"):  # docs/resume.md: later shuffles are PooledLoader's
        assert sorted(i for b in samples(ours_next) for i in b) == list(range(11))
    else:
        assert compare(ours_next) == compare(theirs[1])
    # our own states after the conversion resume too: a second save, then a third (the same
    # samples; fresh workers draw afresh, as after any resume without per_sample_seed)
    compare = samples
    again = build(PooledLoader, case, workers, persistent)
    again.load_state_dict(second)
    it = iter(again)
    head = [rows(next(it)) for _ in range(min(1, len(ours_rest) - len(first)))]
    third = json.loads(json.dumps(again.state_dict()))
    assert compare(head + [rows(b) for b in it]) == compare(ours_rest[len(first):])
    last = build(PooledLoader, case, workers, persistent)
    last.load_state_dict(third)
    assert compare([rows(b) for b in last]) == compare(ours_rest[len(first) + len(head):])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("workers,persistent", [(0, False), (1, False), (2, False), (2, True)])
@pytest.mark.parametrize("snapshot_every", [1, 3])
def test_a_mid_epoch_statefuldataloader_state_resumes_as_statefuldataloader(
        case, workers, persistent, snapshot_every):
    check_against_sdl(case, workers, persistent, snapshot_every, done_epochs=0, steps=4)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("workers", [0, 2])
def test_an_end_of_epoch_statefuldataloader_state_starts_the_next_epoch_as_it_does(case,
                                                                                  workers):
    truth = epochs(build(StatefulDataLoader, case, workers), 3)
    state = sdl_state(case, workers, False, 1, done_epochs=1, steps=0)
    assert state["_iterator_finished"] is False  # a new iter() is made: not finished yet
    finished = build(StatefulDataLoader, case, workers)
    list(finished)
    state = torch_roundtrip(finished.state_dict())
    assert state["_iterator_finished"] is True
    theirs = build(StatefulDataLoader, case, workers)
    theirs.load_state_dict(state)
    ours = build(PooledLoader, case, workers)
    ours.load_state_dict(state)
    got, expected = epochs(ours, 2), epochs(theirs, 2)
    if CASES[case][1].get("shuffle"):  # a new pass: PooledLoader's order (docs/resume.md)
        assert sorted(i for b in samples(got[0]) for i in b) == list(range(11))
    elif case == "iterable-stateful":  # what its end state gives next: issue 36, point 1
        for e in got:
            seen = [i for b in samples(e) for i in b]
            assert len(set(seen)) == len(seen)
    else:
        assert [samples(e) for e in got] == [samples(e) for e in expected]
        assert [samples(e) for e in got] == [samples(e) for e in truth[1:]]


def test_our_states_have_every_key_statefuldataloader_tools_read():
    for case in ("map-shuffled", "iterable-stateful"):
        for workers in (0, 2):
            theirs = build(StatefulDataLoader, case, workers)
            ours = build(PooledLoader, case, workers)
            for loader in (theirs, ours):  # before the first batch, then after two
                loader.state_dict()
            states = []
            for loader in (theirs, ours):
                it = iter(loader)
                next(it)
                next(it)
                states.append(loader.state_dict())
            theirs_state, ours_state = states
            assert set(theirs_state) <= set(ours_state), (case, workers)
            if workers:
                snap, our_snap = theirs_state["_snapshot"], ours_state["_snapshot"]
                assert set(snap) <= set(our_snap)
                assert set(snap["_main_snapshot"]) <= set(our_snap["_main_snapshot"])
                assert set(our_snap["_worker_snapshots"]) == {"worker_0", "worker_1"}
                for key, entry in snap["_worker_snapshots"].items():
                    assert set(entry) <= set(our_snap["_worker_snapshots"][key])
    # every worker has its entry, also before it delivered anything
    loader = build(PooledLoader, "map-sequential", 2)
    state = loader.state_dict()
    assert set(state["_snapshot"]["_worker_snapshots"]) == {"worker_0", "worker_1"}
    assert list(itertools.chain(*samples(rows(b) for b in loader)))  # and it still loads
    fresh = build(PooledLoader, "map-sequential", 2)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert len(list(fresh)) == 6


def test_statefuldataloader_states_that_cannot_be_converted_say_why():
    state = sdl_state("iterable-stateful", 2, False, 1, 0, 3)
    with pytest.raises(StateMismatch, match="saved with num_workers=2, this loader has "
                                            "num_workers=1"):
        build(PooledLoader, "iterable-stateful", 1).load_state_dict(state)
    state = sdl_state("map-sequential", 2, False, 1, 0, 1)
    with pytest.raises(StateMismatch, match="this loader shuffles"):
        # a StatefulDataLoader without shuffle, resumed by a shuffling loader
        state["_snapshot"]["_main_snapshot"]["_sampler_iter_state"] = {"samples_yielded": 2}
        build(PooledLoader, "map-shuffled", 2).load_state_dict(state)
    broken = sdl_state("map-shuffled", 2, False, 1, 0, 1)
    broken["_snapshot"]["_snapshot_step"] = -1
    with pytest.raises(StateMismatch, match="'_snapshot_step' should be a non-negative integer"):
        build(PooledLoader, "map-shuffled", 2).load_state_dict(broken)
    broken = sdl_state("map-shuffled", 2, False, 1, 0, 1)
    broken["_snapshot"]["_main_snapshot"]["_sampler_iter_state"]["sampler_iter_state"][
        "generator"] = [1, 2, 3]
    with pytest.raises(StateMismatch, match="generator state should be a 1-d uint8 tensor"):
        build(PooledLoader, "map-shuffled", 2).load_state_dict(broken)
    broken = sdl_state("map-shuffled", 2, False, 1, 0, 1)
    del broken["_snapshot"]["_worker_snapshots"]["worker_1"]
    with pytest.raises(StateMismatch, match="should hold worker_0 .. worker_1"):
        build(PooledLoader, "map-shuffled", 2).load_state_dict(broken)
    # a stream without state whose other worker ended: its turns are not recorded
    loader = StatefulDataLoader(Stream(1), batch_size=1, num_workers=2)
    it = iter(loader)
    for _ in range(3):  # worker 0 gives 1 item and ends, worker 1 gives 2 of its 2
        next(it)
    state = loader.state_dict()
    assert state["_snapshot"]["_worker_snapshots"]["worker_0"]["fetcher_state"]["fetcher_ended"]
    with pytest.raises(StateMismatch, match="when it ended is not recorded"):
        PooledLoader(Stream(1), batch_size=1, num_workers=2).load_state_dict(state)


def test_distributed_statefuldataloader_states_resume_per_rank_then_on_another_world_size(
        monkeypatch):
    """Ranks through RANK/WORLD_SIZE: each rank's StatefulDataLoader state (DistributedSampler,
    epoch 1) resumes that rank exactly; the states we save after it merge onto 3 ranks, and the
    epoch is covered once."""
    from torch.utils.data import DistributedSampler

    from pooled_loader.resume.state import merge_rank_states
    n, world = 13, 2

    def sdl(rank):
        ds = Noisy(n)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(1)
        return StatefulDataLoader(ds, batch_size=2, sampler=sampler, num_workers=2)

    def ours(rank, size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
        loader = PooledLoader(Noisy(n), batch_size=2, distributed=True, shuffle=True,
                              num_workers=2)
        loader.set_epoch(1)
        return loader

    before, seconds = [], []
    for rank in range(world):
        truth = [rows(b) for b in sdl(rank)]
        loader = sdl(rank)
        it = iter(loader)
        before += samples([rows(next(it)) for _ in range(2)])
        state = torch_roundtrip(loader.state_dict())
        theirs = sdl(rank)
        theirs.load_state_dict(state)
        theirs = [rows(b) for b in theirs]
        resumed = ours(rank, world)
        resumed.load_state_dict(state)
        it = iter(resumed)
        got = [rows(next(it))]
        before += samples(got)
        seconds.append(json.loads(json.dumps(resumed.state_dict())))
        got += [rows(b) for b in it]
        assert got == theirs  # samples and each worker's draws, as StatefulDataLoader's
        assert samples(got) == samples(truth[2:])
    merged = merge_rank_states(seconds)
    after = []
    for rank in range(3):
        loader = ours(rank, 3)
        loader.load_state_dict(merged)
        after += samples([rows(b) for b in loader])
    seen = [i for b in before + after for i in b]
    assert set(seen) == set(range(n)) and len(seen) - n < world + 3  # padding repeats a few


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["stateful-sampler", "stateful-batch-sampler"])
def test_states_of_torchdatas_own_samplers_resume_in_the_same_samplers(workers, kind):
    """The same sampler objects in both loaders: torchdata's StatefulDistributedSampler (its
    state comes back to it) and torchdata's BatchSampler as batch_sampler (its iterator's)."""
    from torchdata.stateful_dataloader.sampler import BatchSampler as TorchdataBatchSampler
    from torchdata.stateful_dataloader.sampler import RandomSampler as TorchdataRandomSampler
    from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

    def make(cls):
        ds = Noisy(13)
        if kind == "stateful-sampler":
            sampler = StatefulDistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
            sampler.set_epoch(1)
            return cls(ds, batch_size=2, sampler=sampler, num_workers=workers)
        shuffle = TorchdataRandomSampler(ds, generator=torch.Generator().manual_seed(3))
        return cls(ds, batch_sampler=TorchdataBatchSampler(shuffle, 2, False),
                   num_workers=workers)
    truth = [rows(b) for b in make(StatefulDataLoader)]
    saver = make(StatefulDataLoader)
    it = iter(saver)
    for _ in range(2):
        next(it)
    state = torch_roundtrip(saver.state_dict())
    ours = make(PooledLoader)
    ours.load_state_dict(state)
    assert samples(rows(b) for b in ours) == samples(truth[2:])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_statefuldataloader_state_claiming_more_batches_than_an_epoch_is_refused_at_once(
        workers):
    """Found by the state fuzzer: `_num_yielded` of 10**18 made the load replay for minutes. A
    map-style epoch has its length: more delivered batches than that is a corrupt state."""
    if workers:
        state = {"_snapshot": {"_snapshot_step": 10**18, "_last_yielded_worker_id": 0,
                               "_main_snapshot": {"_num_workers": 2, "_sampler_iter_yielded": 0,
                                                  "_base_seed": 1, "_index_sampler_state": None,
                                                  "_sampler_iter_state": None},
                               "_worker_snapshots": {f"worker_{k}": {
                                   "worker_id": k, "dataset_state": None,
                                   "fetcher_state": None} for k in range(2)}},
                 "_steps_since_snapshot": 0, "_iterator_finished": False}
    else:
        state = {"_iterator_finished": False, "_num_yielded": 10**18,
                 "_sampler_iter_yielded": 2, "_index_sampler_state": None,
                 "_sampler_iter_state": None, "dataset_state": None, "fetcher_state": None}
    loader = PooledLoader(list(range(40)), batch_size=4, num_workers=workers)
    with pytest.raises(StateMismatch, match="more than the 10 of an epoch"):
        loader.load_state_dict(state)
