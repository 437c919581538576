"""Checkpoint and resume (issue 9): state_dict()/load_state_dict() mid-epoch, per_sample_seed."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from pooled_loader import PooledLoader
from pooled_loader.resume.state import ResumableRandomSampler, StateMismatch, sample_seed
from resume_datasets import Noisy, SeededPermutation, StatefulStream, Stream

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create",
                                        "ignore:PooledLoader. every slot")


def plain(batch):
    """A batch as nested Python lists (tensors and arrays compared bit for bit)."""
    if isinstance(batch, (list, tuple)):
        return [plain(x) for x in batch]
    if isinstance(batch, dict):
        return {k: plain(v) for k, v in batch.items()}
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch.tolist()
    return batch


def epoch_with_states(loader):
    """One uninterrupted epoch: its batches and JSON round-tripped states: states[k] is taken
    after k batches (states[len(batches)] inside the last step), states[-1] after the end."""
    it = iter(loader)
    states = [json.loads(json.dumps(loader.state_dict()))]
    batches = []
    for batch in it:
        batches.append(plain(batch))
        states.append(json.loads(json.dumps(loader.state_dict())))
    states.append(json.loads(json.dumps(loader.state_dict())))
    return batches, states


def resumed(loader, state):
    loader.load_state_dict(state)
    return [plain(b) for b in loader]


MAP_CASES = [(0, False)] + [(w, p) for w in (1, 3) for p in (False, True)]


@pytest.mark.parametrize("snapshot", [1, 5])
@pytest.mark.parametrize("workers,persistent", MAP_CASES)
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_interrupt_at_every_step_resumes_the_remaining_batches(kind, workers, persistent,
                                                               snapshot):
    def make():
        if kind == "map":
            return PooledLoader(Noisy(11), batch_size=2, shuffle=True,
                                generator=torch.Generator().manual_seed(5), num_workers=workers,
                                persistent_workers=persistent, snapshot_every_n_steps=snapshot,
                                per_sample_seed=True)
        return PooledLoader(Stream(3 if workers == 3 else 5), batch_size=2, num_workers=workers,
                            persistent_workers=persistent, snapshot_every_n_steps=snapshot,
                            per_sample_seed=True)

    loader = make()
    batches, states = epoch_with_states(loader)
    assert len(batches) == (6 if kind == "map" else {0: 3, 1: 3, 3: 7}[workers])
    for k, state in enumerate(states):
        target = loader if persistent else make()  # persistent: the same workers resume
        got = resumed(target, state)
        if k == len(states) - 1:  # after the end: a fresh full epoch
            assert sorted(i for b in got for i in b[0]) == sorted(i for b in batches
                                                                   for i in b[0])
        else:  # inside the last step (k == len(batches)): nothing remains
            assert got == batches[k:], f"resumed after {k} of {len(batches)} batches"


def test_interrupting_a_persistent_loader_and_loading_into_it_continues_exactly():
    loader = PooledLoader(Noisy(13), batch_size=3, shuffle=True, num_workers=2,
                          persistent_workers=True, per_sample_seed=True)
    full, _ = epoch_with_states(loader)
    loader.load_state_dict(_[0])  # the same epoch again from its start
    it = iter(loader)
    first = [plain(next(it)) for _ in range(2)]
    state = loader.state_dict()
    del it  # interrupted: prefetched batches are dropped
    assert resumed(loader, state) == full[2:]
    assert first == full[:2]


@pytest.mark.parametrize("options", [
    dict(in_order=False), dict(drop_last=True), dict(batch_size=None),
    dict(collate_fn=lambda samples: [s[0] for s in samples]),
], ids=["in_order=False", "drop_last", "batch_size=None", "collate_fn"])
def test_options_resume_without_losing_or_repeating_batches(options):
    kw = dict(batch_size=3, shuffle=True, num_workers=2, per_sample_seed=True,
              persistent_workers=True)
    kw.update(options)
    loader = PooledLoader(Noisy(14), **kw)
    batches, states = epoch_with_states(loader)
    for k in (1, len(batches) // 2, len(batches) - 1):
        got = resumed(loader, states[k])
        if options.get("in_order", True):
            assert got == batches[k:]
        else:  # delivery order depends on timing; nothing is lost or repeated
            key = lambda b: json.dumps(b)  # noqa: E731
            assert sorted(map(key, batches[:k] + got)) == sorted(map(key, batches))


def test_set_epoch_and_several_epochs_resume_in_the_right_epoch():
    loader = PooledLoader(Noisy(9), batch_size=2, shuffle=True, num_workers=2,
                          persistent_workers=True, per_sample_seed=True,
                          generator=torch.Generator().manual_seed(1))
    epochs = []
    for e in range(2):
        loader.set_epoch(e)
        epochs.append(epoch_with_states(loader))
    (b0, _), (b1, s1) = epochs
    assert b0 != b1
    fresh = PooledLoader(Noisy(9), batch_size=2, shuffle=True, num_workers=2,
                         persistent_workers=True, per_sample_seed=True)
    fresh.load_state_dict(s1[2])
    assert fresh._epoch == 1  # set_epoch of the saved epoch is replayed
    assert [plain(b) for b in fresh] == b1[2:]


def test_stateful_sampler_is_asked_in_the_main_process_and_restored():
    sampler = SeededPermutation(10)
    loader = PooledLoader(Noisy(10), batch_size=2, sampler=sampler, num_workers=2,
                          snapshot_every_n_steps=2, per_sample_seed=True)
    batches, states = epoch_with_states(loader)
    assert sampler.state_calls > 0
    assert states[3]["_snapshot"]["_main_snapshot"]["_index_sampler_state"] == {"inner": {"pos": 4}}
    other = PooledLoader(Noisy(10), batch_size=2, sampler=SeededPermutation(10), num_workers=2,
                         snapshot_every_n_steps=2, per_sample_seed=True)
    assert resumed(other, states[3]) == batches[3:]


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_iterable_dataset_is_restored_inside_its_worker(workers):
    loader = PooledLoader(StatefulStream(6), batch_size=2, num_workers=workers)
    batches, states = epoch_with_states(loader)
    state = states[2]
    snap = state["_snapshot"]["_worker_snapshots"]["worker_0"]
    assert snap["dataset_state"] is not None and snap["items_since_snapshot"] == 0
    got = resumed(PooledLoader(StatefulStream(6), batch_size=2, num_workers=workers), state)
    assert [b[0] for b in got] == [b[0] for b in batches[2:]]
    restored_in = {pid for b in got for pid in b[1]}
    if workers:
        assert os.getpid() not in restored_in and -1 not in restored_in
    else:
        assert restored_in == {os.getpid()}


def test_state_is_plain_json_and_torch_save_works(tmp_path):
    loader = PooledLoader(Noisy(10), batch_size=2, shuffle=True,
                          generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt") == state


def test_bad_states_give_clear_errors():
    loader = PooledLoader(Noisy(10), batch_size=2, shuffle=True)
    it = iter(loader)
    next(it)
    good = loader.state_dict()
    with pytest.raises(StateMismatch, match="dataset_len=10, this loader has dataset_len=12"):
        PooledLoader(Noisy(12), batch_size=2, shuffle=True).load_state_dict(good)
    with pytest.raises(StateMismatch, match="batch_size=2, this loader has batch_size=3"):
        PooledLoader(Noisy(10), batch_size=3, shuffle=True).load_state_dict(good)
    broken = json.loads(json.dumps(good))
    del broken["_snapshot"]["_main_snapshot"]["_sampler_iter_yielded"]
    with pytest.raises(StateMismatch, match="incomplete or corrupt.*_sampler_iter_yielded"):
        loader.load_state_dict(broken)
    broken = json.loads(json.dumps(good))
    broken["_snapshot"]["_main_snapshot"]["_base_seed"] = "7"
    with pytest.raises(StateMismatch, match="_base_seed' should be an integer"):
        loader.load_state_dict(broken)
    with pytest.raises(StateMismatch, match="expects the dict"):
        loader.load_state_dict([1, 2])
    with pytest.raises(StateMismatch, match="_pooled.format' is missing"):
        loader.load_state_dict({"_snapshot": {}})
    assert isinstance(StateMismatch("x"), ValueError)


def test_map_style_state_loads_into_another_worker_count_exactly_with_per_sample_seed():
    def make(workers):
        return PooledLoader(Noisy(15), batch_size=4, shuffle=True, num_workers=workers,
                            per_sample_seed=True, generator=torch.Generator().manual_seed(2))
    batches, states = epoch_with_states(make(2))
    for workers in (0, 3):
        assert resumed(make(workers), states[2]) == batches[2:]


def test_iterable_state_with_another_worker_count_is_refused():
    loader = PooledLoader(Stream(5), batch_size=2, num_workers=2)
    _, states = epoch_with_states(loader)
    with pytest.raises(StateMismatch, match="num_workers=2, this loader has num_workers=1.*"
                                            "same num_workers"):
        PooledLoader(Stream(5), batch_size=2, num_workers=1).load_state_dict(states[1])


def test_per_sample_seed_makes_batches_identical_for_any_worker_count():
    def epoch(workers):
        loader = PooledLoader(Noisy(17), batch_size=4, shuffle=True, num_workers=workers,
                              per_sample_seed=True, generator=torch.Generator().manual_seed(9))
        return [plain(b) for b in loader]
    reference = epoch(0)
    assert epoch(1) == reference and epoch(3) == reference
    noise = [n for b in reference for n in b[1]]
    assert len({tuple(n) for n in noise}) == len(noise)  # samples got unrelated draws


def test_sample_seeds_are_unrelated_for_neighbours():
    seeds = {sample_seed(0, e, i) for e in range(3) for i in range(1000)}
    assert len(seeds) == 3000 and all(0 <= s < 2 ** 63 for s in seeds)
    assert sample_seed(1, 0, 5) != sample_seed(0, 0, 5)


def test_resumable_random_sampler_gives_torch_random_sampler_order():
    for gen_seed in (None, 4):
        for replacement in (False, True):
            torch.manual_seed(11)
            g1 = None if gen_seed is None else torch.Generator().manual_seed(gen_seed)
            ours = list(ResumableRandomSampler(range(50), replacement=replacement, generator=g1))
            torch.manual_seed(11)
            g2 = None if gen_seed is None else torch.Generator().manual_seed(gen_seed)
            theirs = list(torch.utils.data.RandomSampler(range(50), replacement=replacement,
                                                         generator=g2))
            assert ours == theirs


def test_shuffled_pooled_loader_still_matches_dataloader_order():
    kw = dict(batch_size=3, shuffle=True)
    ours = [b[0].tolist() for b in PooledLoader(Noisy(20), generator=torch.Generator()
                                                .manual_seed(3), **kw)]
    theirs = [b[0].tolist() for b in torch.utils.data.DataLoader(
        Noisy(20), generator=torch.Generator().manual_seed(3), **kw)]
    assert ours == theirs


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_resume_semantics_match_torchdata_stateful_dataloader(kind):
    """Before the first batch, at every step, inside the last step and after the end, the
    remaining batches are those StatefulDataLoader gives."""
    tdl = pytest.importorskip("torchdata.stateful_dataloader")
    from loader_datasets import Counting

    def remaining(cls, k, after_end=False):
        ds = Noisy(9) if kind == "map" else Counting(9)
        make = lambda: cls(ds, batch_size=2, num_workers=2)  # noqa: E731
        loader = make()
        it = iter(loader)
        for _ in range(k):
            next(it)
        if after_end:
            for _ in it:
                pass
        state = loader.state_dict()
        del it
        resumed = make()
        resumed.load_state_dict(state)
        out = [plain(b) for b in resumed]
        return [b[0] for b in out] if kind == "map" else out

    for k in (0, 2, 5):  # before the first batch, mid-epoch, inside the last step
        assert remaining(PooledLoader, k) == remaining(tdl.StatefulDataLoader, k), k
    assert remaining(PooledLoader, 5, True) == remaining(tdl.StatefulDataLoader, 5, True)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_staged_ahead_for_the_device_count_only_once_handed_out(workers):
    from test_cuda import ManualBackend  # the CUDA runtime's stand-in: copies are clones
    from pooled_loader.engine.cuda import DeviceIter
    from pooled_loader.engine.iterators import HandedOut
    loader = PooledLoader(Noisy(12), batch_size=2, num_workers=workers)
    base = loader._get_iterator()
    it = HandedOut(DeviceIter(base, "cpu", depth=3, backend=ManualBackend()), base)
    got = [next(it)[0].tolist() for _ in range(2)]
    assert base._epoch_position.held  # the device stage holds batches not yet handed out
    state = loader.state_dict()
    assert state["_snapshot"]["_snapshot_step"] == 2
    rest = resumed(PooledLoader(Noisy(12), batch_size=2, num_workers=workers), state)
    assert got + [b[0] for b in rest] == [[i, i + 1] for i in range(0, 12, 2)]
    assert sum(1 for _ in it) == 4 and loader.state_dict()["_iterator_finished"]
