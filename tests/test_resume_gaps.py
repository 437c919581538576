"""Resume that never loses, repeats or reorders (issue 36): end-of-epoch states of datasets that
reset at the end of a pass, states saved inside an epoch's last step and restarted at the next
epoch, a save soon after a resume, 0-worker datasets whose state is torch's RNG, and shuffles on
torch's global RNG. Each scenario runs the uninterrupted run (the truth) and torchdata's
StatefulDataLoader beside ours; states are JSON round-tripped (ours) and every resumed run is
saved and resumed again."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from pooled_loader import PooledLoader
from resume_datasets import Noisy, PassStream, TorchRngMap
from test_resume import plain

tdl = pytest.importorskip("torchdata.stateful_dataloader")
SDL = tdl.StatefulDataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create",
                                        "ignore:'set_vital' is deprecated",
                                        "ignore:PooledLoader. every slot",
                                        "ignore:.*the loaded state is from epoch")


def roundtrip(state):
    """Ours through JSON; StatefulDataLoader's hold tensors (torch.save is its format)."""
    return json.loads(json.dumps(state)) if "_pooled" in state else state


def epoch(loader):
    return [plain(b) for b in loader]


def order(batches):
    """The samples' indices: what a resume must give back (Noisy's draws come from the
    process's global RNGs, which a new process does not share)."""
    return [b[0] if isinstance(b[0], list) else b for b in batches]


def set_epoch(loader, e):
    """Ours forwards set_epoch; for StatefulDataLoader the trainer calls the sampler's and the
    dataset's, as trainers do for DataLoader."""
    if isinstance(loader, PooledLoader):
        return loader.set_epoch(e)
    for target in (loader.sampler, loader.dataset):
        if callable(getattr(target, "set_epoch", None)):
            target.set_epoch(e)


def fresh(make, state):
    loader = make()
    loader.load_state_dict(roundtrip(state))
    return loader


# -- 1. an end-of-epoch state of a dataset that resets itself at the end of a pass ------------
@pytest.mark.parametrize("snapshot", [1, 4])
@pytest.mark.parametrize("workers,persistent", [(0, False), (1, True), (2, True)])
def test_end_of_epoch_state_of_a_self_resetting_stream_gives_the_full_next_epoch(
        workers, persistent, snapshot):
    """The restored dataset is the one after its end-of-pass reset: the next epoch is whole,
    with the next pass's label and RNG draws, where DataLoader keeps the dataset between epochs
    (in-process, persistent workers; fresh copies start afresh anyway), and a state saved after
    that epoch resumes the one after it."""
    for cls in (PooledLoader, SDL):
        def make():
            return cls(PassStream(6), batch_size=2, num_workers=workers,
                       persistent_workers=persistent, snapshot_every_n_steps=snapshot)
        loader = make()
        epoch(loader)
        state = roundtrip(loader.state_dict())
        truth = [epoch(loader), epoch(loader)]
        assert len(truth[0]) == 3 * max(workers, 1)
        truth.append(epoch(loader))
        resumed = fresh(make, state)
        assert epoch(resumed) == truth[0], cls.__name__
        for k in (1, 2):  # a resumed run's end state, resumed, twice
            resumed = fresh(make, resumed.state_dict())
            assert epoch(resumed) == truth[k], (cls.__name__, k)


# -- 2. saved inside an epoch's last step, restarted at the next epoch --------------------------
def _webdataset(root):
    from pooled_loader.shards.webdataset import WebDataset
    from test_webdataset import sample_id
    return WebDataset(root, transform=sample_id, shuffle_buffer=4, seed=3)


def _map_cases(kind):
    ds = Noisy(10)
    if kind == "sampler":
        return lambda cls, **kw: cls(ds, batch_size=3, sampler=DistributedSampler(
            ds, num_replicas=2, rank=1, seed=4), **kw)
    if kind == "generator":
        return lambda cls, **kw: cls(ds, batch_size=3, shuffle=True,
                                     generator=torch.Generator().manual_seed(5), **kw)
    return lambda cls, **kw: cls(ds, batch_size=3, shuffle=True, distributed=True, **kw)


@pytest.mark.parametrize("kind", ["sampler", "generator", "distributed", "webdataset"])
@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_state_saved_inside_the_last_step_restarts_at_the_epoch_set(kind, workers, persistent,
                                                                   tmp_path, monkeypatch):
    """verl's loop: save at the last step, restart with start_epoch = e + 1 and set_epoch(e+1).
    The epoch set is given whole (StatefulDataLoader gives nothing), then the next ones, and a
    state saved inside the resumed epoch's last step restarts the one after it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    if kind == "webdataset":
        from test_webdataset import make_shards
        make_shards(str(tmp_path), [6, 11, 4, 9])

        def build(cls, **kw):
            return cls(_webdataset(str(tmp_path)), batch_size=3, **kw)
    else:
        build = _map_cases(kind)
    results = {}
    for cls in (PooledLoader, SDL):
        if cls is SDL and kind == "distributed":
            continue

        def make():
            return build(cls, num_workers=workers, persistent_workers=persistent)
        loader = make()
        truth, states = [], []
        for e in range(4):
            set_epoch(loader, e)
            truth.append(order(epoch(loader)))
        # the same run, saving inside each epoch's last step
        loader = make()
        for e in range(3):
            set_epoch(loader, e)
            it = iter(loader)
            for _ in range(len(truth[e])):
                next(it)
            states.append(roundtrip(loader.state_dict()))
            assert next(it, None) is None
        rests = []
        for e in range(3):
            resumed = fresh(make, states[e])
            set_epoch(resumed, e + 1)
            rests.append(order(epoch(resumed)))
            if e < 2 and cls is PooledLoader:  # and on past the epoch set
                set_epoch(resumed, e + 2)
                assert order(epoch(resumed)) == truth[e + 2], (kind, e)
        if cls is PooledLoader:  # a resumed run saved at its last step, resumed: twice
            state = states[0]
            for e in (1, 2):
                resumed = fresh(make, state)
                set_epoch(resumed, e)
                it = iter(resumed)
                got = [order([plain(next(it))])[0] for _ in range(len(truth[e]))]
                state = roundtrip(resumed.state_dict())
                assert got == truth[e] and next(it, None) is None, (kind, e)
            resumed = fresh(make, state)
            set_epoch(resumed, 3)
            assert order(epoch(resumed)) == truth[3], kind
        results[cls] = rests
        if cls is PooledLoader:
            assert rests == truth[1:], kind
            same = fresh(make, states[0])  # restarted in the saved epoch: nothing is left
            set_epoch(same, 0)
            assert epoch(same) == [], kind
        else:
            assert all(r in ([], t) for r, t in zip(rests, truth[1:])), kind
    assert all(len(t) > 0 for t in results[PooledLoader])


@pytest.mark.parametrize("when", ["after_load", "before_load"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_last_step_state_resumed_with_the_samplers_own_set_epoch_gives_that_epoch(workers,
                                                                                   when):
    """verl's loop (verl-project/verl #7401): the trainer sets the epoch on its own
    DistributedSampler, never on the loader; saved inside the last step of epoch e, resumed
    with sampler.set_epoch(e + 1): epoch e + 1 whole, then e + 2 (StatefulDataLoader gives an
    empty epoch). A loop that sets no epoch anywhere gets StatefulDataLoader's empty epoch."""
    ds = Noisy(14)

    def make(cls):
        sampler = DistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=4)
        return cls(ds, batch_size=3, sampler=sampler, num_workers=workers), sampler

    def saved_in_last_step(cls, epochs, set_epochs=True):
        loader, sampler = make(cls)
        for e in range(epochs):
            if set_epochs:
                sampler.set_epoch(e)
            it = iter(loader)
            for _ in range(3):  # 7 samples of this rank, 3 batches
                next(it)
            if e == epochs - 1:
                state = roundtrip(loader.state_dict())
            assert next(it, None) is None
        return state

    for cls in (PooledLoader, SDL):
        loader, sampler = make(cls)
        truth = []
        for e in range(4):
            sampler.set_epoch(e)
            truth.append(order(epoch(loader)))
        assert truth[0] != truth[1] != truth[2] != truth[3]
        for e in (0, 1):
            resumed, sampler = make(cls)
            if when == "before_load":
                sampler.set_epoch(e + 1)
            resumed.load_state_dict(saved_in_last_step(cls, e + 1))
            if when == "after_load":
                sampler.set_epoch(e + 1)
            got = order(epoch(resumed))
            if cls is SDL:
                assert got in ([], truth[e + 1]), e
                continue
            assert got == truth[e + 1], (e, got)
            sampler.set_epoch(e + 2)
            assert order(epoch(resumed)) == truth[e + 2], e
        # the control: no epoch set anywhere, as StatefulDataLoader (then the next pass whole)
        loader, _ = make(cls)
        plain_pass = order(epoch(loader))
        resumed, _ = make(cls)
        resumed.load_state_dict(saved_in_last_step(cls, 2, set_epochs=False))
        assert epoch(resumed) == [], cls.__name__
        assert order(epoch(resumed)) == plain_pass, cls.__name__


# -- 3. a save soon after a resume ------------------------------------------------------------
def _streams(kind, root):
    from pooled_loader.shards import writer as shards
    from pooled_loader.shards.webdataset import WebDataset
    from test_webdataset import make_shards, sample_id
    if kind == "hf":
        import datasets
        # (a shuffled HF stream of several shards per worker cannot load its own state back
        # with 2 workers, in StatefulDataLoader too: an HF limit, so the plain stream here)
        ds = datasets.Dataset.from_dict({"x": list(range(40))}).to_iterable_dataset(num_shards=4)
        return lambda: ds
    make_shards(root, [6, 11, 4, 9])
    if kind == "global":
        assert shards.main(["index", root]) == 0
        return lambda: WebDataset(root, transform=sample_id, shuffle="global", seed=3)
    return lambda: WebDataset(root, transform=sample_id, shuffle_buffer=5, seed=3)


def _ids(batches):
    return [b["x"] if isinstance(b, dict) else b for b in batches]


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("kind", ["buffer", "global", "hf"])
def test_a_save_soon_after_a_resume_keeps_the_position_of_workers_yet_to_deliver(
        kind, persistent, tmp_path):
    """Load, take one batch (or none, or two), save, resume again: one worker has delivered
    since the load, the other has not; both must be where the loaded state put them.
    StatefulDataLoader is run beside ours, not asserted: it loses the position too."""
    dataset = _streams(kind, str(tmp_path))
    exact = {}
    for cls in (PooledLoader, SDL):
        def make():
            return cls(dataset(), batch_size=2, num_workers=2, persistent_workers=persistent)
        truth = _ids(epoch(make()))
        assert sorted(sum(truth, [])) == list(range(30 if kind != "hf" else 40))
        loader = make()
        it = iter(loader)
        for _ in range(3):
            next(it)
        state, done = roundtrip(loader.state_dict()), 3
        del it
        for step in (1, 0, 2):  # a second, third and fourth save, each after a resume
            loader = fresh(make, state)
            it = iter(loader)
            for _ in range(step):
                next(it)
            state, done = roundtrip(loader.state_dict()), done + step
            del it
            rest = _ids(epoch(fresh(make, state)))
            exact[cls, step] = rest == truth[done:]
    # StatefulDataLoader repeats samples here too (as this project did before): ours must not
    assert all(exact[PooledLoader, step] for step in (1, 0, 2)), exact


# -- 5. with 0 workers, a dataset whose state is torch's RNG -----------------------------------
@pytest.mark.parametrize("when", ["before_iter", "after_iter", "end"])
def test_a_dataset_whose_state_is_torchs_rng_resumes_exactly(when):
    """In-process, that RNG is also the one the shuffle draws its seed from: the resumed samples
    get the very draws they got (order and values), with 0 workers as with 2."""
    for workers, cls in [(w, c) for w in (0, 2) for c in (PooledLoader, SDL)]:
        def make():
            return cls(TorchRngMap(10), batch_size=3, shuffle=True, num_workers=workers)
        torch.manual_seed(0)
        loader = make()
        if when == "before_iter":
            state, rng = roundtrip(loader.state_dict()), torch.get_rng_state()
            truth = epoch(loader)
        elif when == "after_iter":
            it = iter(loader)
            state, rng = roundtrip(loader.state_dict()), torch.get_rng_state()
            truth = [plain(b) for b in it]
        else:
            epoch(loader)
            state, rng = roundtrip(loader.state_dict()), torch.get_rng_state()
            truth = epoch(loader)
        torch.manual_seed(99)  # another process
        if workers and when == "end":  # the next epoch's worker seeds: docs/resume.md's advice
            torch.set_rng_state(rng)
        got = epoch(fresh(make, state))
        if cls is PooledLoader:
            assert got == truth, workers
            # resumed again from the state of a resumed loader, taken right after its iter()
            # (the global RNG restored each time, as docs/resume.md advises)
            torch.set_rng_state(rng)
            resumed = fresh(make, state)
            it = iter(resumed)
            state2, rng2 = roundtrip(resumed.state_dict()), torch.get_rng_state()
            del it
            torch.manual_seed(98)
            torch.set_rng_state(rng2)
            assert epoch(fresh(make, state2)) == truth, workers
        assert order(got) == order(truth), (cls.__name__, workers)


# -- 6. shuffle=True without a generator, torch's RNG saved and restored ------------------------
def _global_rngs():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_global_rngs(rngs):
    torch.set_rng_state(rngs[0])
    random.setstate(rngs[1])
    np.random.set_state(rngs[2])


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, False), (2, True)])
def test_shuffle_on_the_global_rng_resumes_every_later_epoch_when_the_rng_is_restored(
        workers, persistent):
    """docs/resume.md: save the global RNGs with the state and restore them before resuming;
    then the rest of the epoch and every later one are the uninterrupted run's, in order and
    (ours, with per_sample_seed, as workers' RNGs are not in a state) in every draw, and so
    after a second resume."""
    for cls in (PooledLoader, SDL):
        def make():
            # (with 0 workers the draws are the main process's, restored with it; per-sample
            # seeds would reseed them at every sample)
            kw = dict(per_sample_seed=True) if cls is PooledLoader and workers else {}
            return cls(Noisy(10), batch_size=3, shuffle=True, num_workers=workers,
                       persistent_workers=persistent, **kw)
        torch.manual_seed(0)
        loader = make()
        it = iter(loader)
        for _ in range(2):
            next(it)
        state, rngs = roundtrip(loader.state_dict()), _global_rngs()
        truth = [[plain(b) for b in it], epoch(loader), epoch(loader)]
        # the uninterrupted epoch 1 again, saved after its first batch
        torch.manual_seed(7)
        _set_global_rngs(rngs)
        resumed = fresh(make, state)
        got = [epoch(resumed)]
        it = iter(resumed)
        got.append([plain(next(it))])
        state2, rngs2 = roundtrip(resumed.state_dict()), _global_rngs()
        got[1] += [plain(b) for b in it]
        got.append(epoch(resumed))
        torch.manual_seed(8)
        _set_global_rngs(rngs2)
        again = fresh(make, state2)
        got2 = [epoch(again), epoch(again)]
        if cls is PooledLoader:
            assert got == truth and got2 == [truth[1][1:], truth[2]]
        assert [order(e) for e in got] == [order(e) for e in truth], cls.__name__


@pytest.mark.parametrize("value", [5, "xyz", "0123456789abcdeg", True])
def test_a_malformed_rng_digest_is_refused_at_load_naming_the_key(value):
    loader = PooledLoader(Noisy(10), batch_size=3, shuffle=True)
    it = iter(loader)
    next(it)
    state = roundtrip(loader.state_dict())
    state["_pooled"]["rng_check"] = value
    with pytest.raises(ValueError, match="_pooled.rng_check' should be 16 hex digits"):
        PooledLoader(Noisy(10), batch_size=3, shuffle=True).load_state_dict(state)


@pytest.mark.parametrize("value", [-1, "2", True, 1.5])
def test_a_malformed_sampler_epoch_is_refused_at_load_naming_the_key(value):
    ds = Noisy(10)
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, seed=4)
    loader = PooledLoader(ds, batch_size=3, sampler=sampler)
    it = iter(loader)
    next(it)
    state = roundtrip(loader.state_dict())
    assert state["_pooled"]["sampler_epoch"] == 0
    state["_pooled"]["sampler_epoch"] = value
    with pytest.raises(ValueError, match="_pooled.sampler_epoch"):
        PooledLoader(ds, batch_size=3, sampler=DistributedSampler(
            ds, num_replicas=2, rank=0, seed=4)).load_state_dict(state)
