"""Resume as torchdata's StatefulDataLoader promises it (issue 22), run side by side with it on the
same datasets: a map-style dataset's own state, streams with no snapshot yet, samplers drawing
from torch's global RNG, states taken at an epoch's end or before the first iter(), datasets that
are their own iterator, and states that are refused at load."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import RandomSampler

from pooled_loader import PooledLoader
from pooled_loader.resume.state import StateMismatch
from pooled_loader.shards.state import check_state_values
from resume_datasets import (CountingMap, CursorStream, EpochStream, Noisy, SelfIterator,
                             StatefulStream)
from test_resume import plain

tdl = pytest.importorskip("torchdata.stateful_dataloader")
SDL = tdl.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create",
                                        "ignore:'set_vital' is deprecated",
                                        "ignore:PooledLoader. every slot")
LOADERS = [PooledLoader, SDL]
WORKERS = [(0, False), (1, False), (3, False), (1, True), (3, True)]


def roundtrip(state):
    return json.loads(json.dumps(state)) if isinstance(state, dict) and "_pooled" in state \
        else state  # StatefulDataLoader's states hold tensors: not JSON


def epoch(loader):
    return [plain(b) for b in loader]


def take(it, k):
    return [plain(next(it)) for _ in range(k)]


def rest_after(make, k, *, same_loader=False, finish_first=False):
    """(all batches of an uninterrupted epoch, the batches after resuming from the state taken
    after k of them); the resume uses a fresh loader, or the same one (a rollback: with
    `finish_first` the epoch is finished before the state is loaded back)."""
    full = epoch(make())
    loader = make()
    it = iter(loader)
    got = take(it, k)
    state = roundtrip(loader.state_dict())
    if finish_first:
        got += [plain(b) for b in it]
    del it
    target = loader if same_loader else make()
    target.load_state_dict(state)
    return full, got, epoch(target)


# -- 1. a map-style dataset's own state -------------------------------------------------------
@pytest.mark.parametrize("workers,persistent", WORKERS)
def test_map_style_dataset_state_is_restored_in_each_worker(workers, persistent):
    results = {}
    for cls in LOADERS:
        def make():
            return cls(CountingMap(12), batch_size=2, num_workers=workers,
                       persistent_workers=persistent)
        full, _, rest = rest_after(make, 3)
        assert rest == full[3:], cls.__name__
        results[cls] = rest
    assert results[PooledLoader] == results[SDL]


def test_map_style_dataset_state_rolls_back_on_the_same_persistent_loader():
    for cls in LOADERS:
        def make():
            return cls(CountingMap(12), batch_size=2, num_workers=2, persistent_workers=True)
        full, got, rest = rest_after(make, 2, same_loader=True, finish_first=True)
        assert got == full and rest == full[2:], cls.__name__


def test_map_style_dataset_with_state_needs_the_same_worker_count():
    loader = PooledLoader(CountingMap(12), batch_size=2, num_workers=2)
    it = iter(loader)
    take(it, 2)
    state = loader.state_dict()
    with pytest.raises(StateMismatch, match="num_workers=2.*own state_dict.*same num_workers"):
        PooledLoader(CountingMap(12), batch_size=2, num_workers=3).load_state_dict(state)
    # without a dataset state the order alone is restored, on any number of workers
    loader = PooledLoader(Noisy(12), batch_size=2, num_workers=2)
    it = iter(loader)
    take(it, 2)
    PooledLoader(Noisy(12), batch_size=2, num_workers=3).load_state_dict(loader.state_dict())


# -- 2. an iterable stream with no snapshot yet ------------------------------------------------
@pytest.mark.parametrize("snapshot", [1, 100])
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_rolling_back_a_stream_resumes_where_the_state_was_taken(workers, snapshot):
    """The loader keeps its dataset (0 workers) or its workers (persistent); the epoch goes on
    after the state was taken, which moves the dataset's cursor; the state loaded back resumes
    where it was taken, even before any snapshot was delivered."""
    results = {}
    for cls in LOADERS:
        def make():
            return cls(CursorStream(7), batch_size=2, num_workers=workers,
                       persistent_workers=workers > 0, snapshot_every_n_steps=snapshot)
        for k in (0, 1, 3):
            full, got, rest = rest_after(make, k, same_loader=True, finish_first=True)
            assert got == full and rest == full[k:], (cls.__name__, k)
            results[cls, k] = rest
    assert all(results[PooledLoader, k] == results[SDL, k] for k in (0, 1, 3))


# -- 3. a sampler drawing from torch's global RNG ----------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_sampler_on_the_global_rng_resumes_after_manual_seed(workers):
    ds = Noisy(14)
    for cls in LOADERS:
        def make():
            torch.manual_seed(1234)  # re-applied before the resume, as a training script does
            return cls(ds, batch_size=3, sampler=RandomSampler(ds), num_workers=workers)
        full, _, rest = rest_after(make, 2)
        assert [b[0] for b in rest] == [b[0] for b in full[2:]], cls.__name__


# -- 4. a state taken at the end of an epoch ---------------------------------------------------
def next_epoch_after_end_state(make, epochs_before=1):
    """(the next epoch of an uninterrupted run, the first epoch of a loader resumed from the
    state taken after `epochs_before` epochs)."""
    loader = make()
    for _ in range(epochs_before):
        epoch(loader)
    state = roundtrip(loader.state_dict())
    uninterrupted = epoch(loader)
    resumed = make()
    resumed.load_state_dict(state)
    return uninterrupted, epoch(resumed)


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_end_of_epoch_state_continues_with_the_next_shuffle(workers, persistent):
    """Ours gives the very epoch the uninterrupted run gives next. StatefulDataLoader gives a
    new shuffle, not always that one (with 0 workers its resumed iterator misses one draw of
    the generator), but never the finished epoch again."""
    for cls in LOADERS:
        def make():
            return cls(Noisy(10), batch_size=3, shuffle=True, num_workers=workers,
                       persistent_workers=persistent, generator=torch.Generator().manual_seed(5))
        for before in (1, 2):
            loader = make()
            for _ in range(before - 1):
                epoch(loader)
            finished = [b[0] for b in epoch(loader)]
            expected, got = next_epoch_after_end_state(make, before)
            order = [b[0] for b in got]
            assert order != finished and sorted(sum(order, [])) == list(range(10))
            if cls is PooledLoader:
                assert order == [b[0] for b in expected], before


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_end_of_epoch_state_keeps_an_iterable_datasets_epoch_counter(workers, persistent):
    """The next epoch is the uninterrupted run's: the counter moves on where DataLoader keeps
    the dataset between epochs (in-process, persistent workers), and fresh copies of the
    dataset start it again where it does not. StatefulDataLoader agrees except with persistent
    workers, where it gives only the finished epoch's last items again."""
    for cls in LOADERS:
        def make():
            return cls(EpochStream(5), batch_size=2, num_workers=workers,
                       persistent_workers=persistent)
        expected, got = next_epoch_after_end_state(make)
        if cls is PooledLoader or not persistent:
            assert got == expected, cls.__name__


def test_end_of_epoch_state_of_persistent_workers_keeps_their_iterators_rng():
    results = {}
    for cls in LOADERS:
        def make():
            return cls(SelfIterator(6), batch_size=2, num_workers=2, persistent_workers=True)
        expected, got = next_epoch_after_end_state(make)
        assert got == expected, cls.__name__
        results[cls] = got
    assert results[PooledLoader] == results[SDL]


# -- 5. a dataset that is its own iterator -----------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_that_is_its_own_iterator_gets_its_state_after_iter(workers):
    results = {}
    for cls in LOADERS:
        def make():
            return cls(SelfIterator(8), batch_size=2, num_workers=workers)
        full, _, rest = rest_after(make, 3)
        assert rest == full[3:], cls.__name__
        results[cls] = rest
    assert results[PooledLoader] == results[SDL]


# -- 6. a state taken before the first iter() --------------------------------------------------
@pytest.mark.parametrize("per_sample_seed", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_state_before_the_first_iter_replays_the_same_epoch(workers, per_sample_seed):
    def make(cls):
        kw = dict(per_sample_seed=per_sample_seed) if cls is PooledLoader else {}
        return cls(Noisy(10), batch_size=3, shuffle=True, num_workers=workers, **kw)
    for cls in LOADERS if not per_sample_seed else [PooledLoader]:
        loader = make(cls)
        state = roundtrip(loader.state_dict())
        trained = epoch(loader)  # the epoch that followed the saved state
        other = make(cls)
        other.load_state_dict(state)
        again = epoch(other)
        if workers == 0 and not per_sample_seed:  # the draws come from this process's RNGs
            again, trained = [b[0] for b in again], [b[0] for b in trained]
        assert again == trained, cls.__name__


def test_stateful_stream_state_before_any_batch_records_each_workers_start():
    loader = PooledLoader(StatefulStream(6), batch_size=2, num_workers=2, persistent_workers=True)
    state = loader.state_dict()
    snaps = state["_snapshot"]["_worker_snapshots"]
    assert sorted(snaps) == ["worker_0", "worker_1"]
    assert all(s["dataset_state"] == {"next": 0} for s in snaps.values())
    full = epoch(loader)
    loader.load_state_dict(state)
    assert [b[0] for b in epoch(loader)] == [b[0] for b in full]


# -- validation at load ------------------------------------------------------------------------
def mid_epoch_state(dataset, **kw):
    loader = PooledLoader(dataset, batch_size=2, **kw)
    it = iter(loader)
    take(it, 2)
    return loader, json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("path,value,message", [
    ("_snapshot._snapshot_step", 10 ** 18, "_snapshot_step' is 1000000000000000000, more than"),
    ("_snapshot._snapshot_step", -1, "cannot be negative"),
    ("_snapshot._main_snapshot._sampler_iter_yielded", 10 ** 18, "_sampler_iter_yielded' is"),
    ("_snapshot._main_snapshot._sampler_iter_yielded", -3, "cannot be negative"),
    ("_snapshot._last_yielded_worker_id", 7, "no such worker"),
    ("_pooled.delivered_ahead", [999], r"delivered_ahead\[0\]' is 999, more than"),
    ("_snapshot._worker_snapshots", [1], "_worker_snapshots' should be a dict"),
])
def test_malformed_map_states_are_refused_at_load_naming_the_key(path, value, message):
    loader, state = mid_epoch_state(Noisy(12), num_workers=2)
    node = state
    *parents, last = path.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


@pytest.mark.parametrize("key,value,message", [
    ("items", 10 ** 12, "items' is 1000000000000, more than 14"),
    ("items", -2, "cannot be negative"),
    ("items_since_snapshot", 5, "items_since_snapshot' is 5, more than 2"),
    ("batches", 10 ** 18, "_snapshot_step' is 2 but the workers' streams delivered"),
])
def test_malformed_stream_states_are_refused_at_load_naming_the_key(key, value, message):
    class Sized(CursorStream):
        def __len__(self):
            return 14
    loader, state = mid_epoch_state(Sized(7), num_workers=2, snapshot_every_n_steps=0)
    state["_snapshot"]["_worker_snapshots"]["worker_0"][key] = value
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)


def test_webdataset_state_with_a_negative_or_oversized_count_is_refused():
    good = {"version": 1, "epoch": 0, "skipped": 0, "quota": 10, "done": 4,
            "position": {"shard": 0, "offset": 512, "index": 4, "visits": 1, "got": True,
                         "idle": 0},
            "round": {"left": 6, "count": 1, "before": 0, "mark": 0, "draining": False},
            "buffer": [], "rng": None}
    check_state_values(good, 0)
    for change, message in [({"done": -1}, "'done' is -1: it cannot be negative"),
                            ({"done": 11}, "'done' is 11, more than 10"),
                            ({"quota": 10 ** 12, "done": 10 ** 12 + 1}, "more than"),
                            ({"buffer": [[0, 0, 0]]}, "'buffer' should be a list of at most 0"),
                            ({"position": [0]}, "'position' should be a dict")]:
        with pytest.raises(ValueError, match=message):
            check_state_values({**good, **change}, 0)
