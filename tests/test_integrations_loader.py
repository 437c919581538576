"""Where users plug PooledLoader in (issue 23): `__getitems__`, an explicit default collate,
pickling, kept labels, a 0-worker custom collate, collate errors; each against DataLoader."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from compare import assert_same
from torch.utils.data import (DataLoader, Dataset, IterableDataset, StackDataset, Subset,
                              default_collate, default_convert, get_worker_info)

from pooled_loader import PooledLoader


class TwoWays(Dataset):
    """`__getitems__` gives other samples than `__getitem__`: DataLoader uses the former."""

    def __len__(self):
        return 21

    def __getitem__(self, i):
        return {"x": np.full(3, i, np.float32), "id": i}

    def __getitems__(self, indices):
        return [{"x": np.full(3, -i, np.float32), "id": 1000 + i} for i in indices]


def both(dataset, **kwargs):
    return [list(cls(dataset, generator=torch.Generator().manual_seed(4), **kwargs))
            for cls in (DataLoader, PooledLoader)]


def check_same(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert_same(a, b)


# -- __getitems__ -------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [None, default_collate, lambda b: [s["id"] for s in b]])
def test_a_batch_is_fetched_through_getitems_as_dataloader_does(num_workers, collate_fn):
    expected, got = both(TwoWays(), batch_size=4, shuffle=True, num_workers=num_workers,
                         collate_fn=collate_fn)
    check_same(expected, got)
    ids = [i for b in got for i in (b["id"].tolist() if isinstance(b, dict) else b)]
    assert sorted(ids) == [1000 + i for i in range(21)]


def test_subset_and_stack_dataset_fetch_through_getitems():
    base = TwoWays()
    for dataset in (Subset(base, [3, 1, 7, 9, 11]), StackDataset(base, base),
                    StackDataset(a=base, b=Subset(base, list(range(21))))):
        for workers in (0, 2):
            check_same(*both(dataset, batch_size=2, num_workers=workers))


def test_without_batching_getitems_is_not_used():
    check_same(*both(TwoWays(), batch_size=None))


def test_hf_dataset_batches_come_through_its_getitems(monkeypatch):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"x": np.arange(40, dtype=np.float32).reshape(10, 4),
                                        "label": np.arange(10)}).with_format("torch")
    calls = []
    original = type(table).__getitems__

    def spy(self, keys):
        calls.append(list(keys))
        return original(self, keys)
    monkeypatch.setattr(type(table), "__getitems__", spy)
    expected = list(DataLoader(table, batch_size=4))
    calls.clear()
    check_same(expected, list(PooledLoader(table, batch_size=4)))
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


# -- an explicit default collate ---------------------------------------------------------------
class Rows(Dataset):
    """Each sample a list of dicts (a dataset that makes its own small batches)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return [{"a": i, "v": np.full(2, i, np.float64)}, {"a": i + 1, "v": np.ones(2)}]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_explicit_default_collate_and_default_convert_behave_as_in_dataloader(num_workers):
    for kwargs in (dict(batch_size=None, collate_fn=default_collate),
                   dict(batch_size=4, collate_fn=default_convert),
                   dict(batch_size=None, collate_fn=default_convert),
                   dict(batch_size=4, collate_fn=default_collate)):
        expected, got = both(Rows(), num_workers=num_workers, **kwargs)
        check_same(expected, got)
    collated = list(PooledLoader(Rows(), batch_size=None, collate_fn=default_collate))[0]
    assert torch.equal(collated["a"], torch.tensor([0, 1]))
    assert isinstance(list(PooledLoader(Rows(), batch_size=4, collate_fn=default_convert))[0],
                      list)


# -- pickling ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers,persistent", [(0, False), (2, False), (2, True)])
def test_an_iterated_loader_pickles_and_deep_copies(num_workers, persistent):
    loader = PooledLoader(TwoWays(), batch_size=4, shuffle=True, num_workers=num_workers,
                          persistent_workers=persistent,
                          generator=torch.Generator().manual_seed(1))
    first = [b["id"].tolist() for b in loader]
    for clone in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(clone) is PooledLoader and clone.batch_size == 4
        assert sorted(i for b in clone for i in b["id"].tolist()) == sorted(sum(first, []))
        clone.close()
    assert sorted(i for b in loader for i in b["id"].tolist()) == sorted(sum(first, []))
    loader.close()


def test_a_lightning_combined_loader_holding_one_pickles():
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.utilities import CombinedLoader
    combined = CombinedLoader({"a": PooledLoader(TwoWays(), batch_size=4, num_workers=1)},
                              mode="max_size_cycle")
    iter(combined)
    for batch, _, _ in combined:
        assert batch["a"]["id"].shape[0] in (4, 1)
    restored = pickle.loads(pickle.dumps(combined))
    assert sum(1 for _ in restored) == 6


# -- kept labels ---------------------------------------------------------------------------------
class Labelled(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        return torch.full((3, 32, 32), i % 256, dtype=torch.uint8), i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_keeping_only_labels_does_not_grow_the_pool(num_workers):
    loader = PooledLoader(Labelled(), batch_size=8, num_workers=num_workers)
    kept = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "every slot of the pool is in use"
        for images, labels in loader:
            assert images[0, 0, 0, 0] == labels[0] % 256
            kept.append(labels)
    assert len(kept) == 50
    assert torch.equal(torch.cat(kept), torch.arange(400))  # intact after their slots' reuse
    stats = loader.stats()
    assert stats["slots"] <= loader._default_slots() and stats["slots_in_use"] <= 1


# -- 0 workers, custom collate ------------------------------------------------------------------
def test_without_workers_a_custom_collates_output_is_handed_out_as_is():
    made = []

    def collate(samples):
        batch = {"x": torch.stack([torch.as_tensor(s["x"]) for s in samples])}
        made.append(batch)
        return batch

    got = list(PooledLoader(TwoWays(), batch_size=5, collate_fn=collate))
    assert len(got) == 5 and all(a is b for a, b in zip(got, made))
    loader = PooledLoader(TwoWays(), batch_size=5, collate_fn=collate)
    list(loader)
    assert loader.stats()["batches"] == 5 and loader.stats()["samples"] == 21


class Mixed(Dataset):
    """`__getitems__` samples of every leaf kind the default collate stacks (rows of one
    tensor, as HF datasets gives them), and strings it keeps as lists."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        rows = torch.arange(len(indices) * 3, dtype=torch.float32).reshape(-1, 3)
        return [{"row": rows[j], "bf": torch.full((2,), i, dtype=torch.bfloat16),
                 "arr": np.full((2, 2), i, np.int16), "np_id": np.int64(i), "id": i,
                 "w": i / 2, "flag": i % 2 == 0, "name": f"s{i}",
                 "pair": (torch.tensor(i), np.float32(i))} for j, i in enumerate(indices)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_without_workers_getitems_batches_take_no_slot_and_equal_dataloaders(shuffle):
    expected, got = both(Mixed(), batch_size=4, shuffle=shuffle)
    check_same(expected, got)
    loader = PooledLoader(Mixed(), batch_size=4)
    kept = list(loader)
    stats = loader.stats()  # no slot taken: none grown or reused, no byte through the pool
    assert (stats["grown"], stats["reuses"], stats["bytes_moved"], stats["batches"]) == (0, 0, 0, 3)
    with_workers = list(PooledLoader(Mixed(), batch_size=4, num_workers=1))
    check_same(with_workers, kept)  # the slot path gives the very same batches


class OneOff(Dataset):
    """Sample 2's tensor has another dtype: DataLoader promotes, PooledLoader refuses."""

    def __len__(self):
        return 4

    def __getitems__(self, indices):
        return [{"x": torch.ones(3, dtype=torch.float64 if i == 2 else torch.float32)}
                for i in indices]


class MissingKey(OneOff):
    def __getitems__(self, indices):
        return [{"x": torch.ones(3)} if i != 3 else {"y": torch.ones(3)} for i in indices]


@pytest.mark.parametrize("dataset,words", [
    (OneOff(), "sample 2 has tensor of shape (3,), torch.float64"),
    (MissingKey(), "sample 3 has dict with keys ['y']")])
def test_a_getitems_batch_is_checked_the_same_with_and_without_workers(dataset, words):
    errors = [str(_error(PooledLoader, dataset, num_workers=w)) for w in (0, 1)]
    assert errors[1].strip().endswith(errors[0])  # a worker's adds its traceback
    assert words in errors[0]


# -- error messages -----------------------------------------------------------------------------
class Ragged(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"image": np.zeros((4, 4), np.float32), "tokens": list(range(1 + i % 2)),
                "rest": [np.zeros(3)] * 30}


def _error(cls, dataset, **kwargs):
    with pytest.raises(Exception) as info:
        list(cls(dataset, batch_size=4, **kwargs))
    return info.value


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_ragged_batch_says_dataloaders_words_and_names_the_key(num_workers):
    theirs = _error(DataLoader, Ragged())
    ours = _error(PooledLoader, Ragged(), num_workers=num_workers)
    assert type(ours) is type(theirs) is RuntimeError
    assert str(theirs) == "each element in list of batch should be of equal size"
    assert str(theirs) in str(ours)
    last_line = str(ours).strip().splitlines()[-1]
    assert "['tokens']" in last_line and "sample 1 has list of length 2" in last_line
    assert len(last_line) < 400
    assert "raised while loading sample index" not in str(ours)


def test_a_collate_error_is_not_blamed_on_a_sample():
    def collate(samples):
        raise ValueError("bad collate")
    for workers in (0, 1):
        error = _error(PooledLoader, TwoWays(), num_workers=workers, collate_fn=collate)
        assert type(error) is ValueError and "bad collate" in str(error)
        assert "sample index" not in str(error)


# -- accelerate's lowered counts (2 real processes: test_integrations_ranks.py) ----------------
class Split(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(first, 40, step))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("iterable", [True, False])
def test_a_lowered_top_level_count_moves_the_resume_point_back(num_workers, iterable):
    def make():
        return PooledLoader(Split() if iterable else list(range(40)), batch_size=4,
                            num_workers=num_workers)
    loader = make()
    it = iter(loader)
    got = [next(it).tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    assert state["_num_yielded"] == 5
    state["_num_yielded"] -= 1  # what accelerate's dispatcher does on 2 processes
    if not iterable:
        state["_sampler_iter_yielded"] -= 1
    again = make()
    again.load_state_dict(state)
    assert [b.tolist() for b in again] == got[-1:] + rest
    untouched = make()
    untouched.load_state_dict(loader.state_dict())  # the finished epoch: a fresh one
    assert len(list(untouched)) == 10
