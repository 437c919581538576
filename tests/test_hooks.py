"""The dataset hooks the loader calls (`core/hooks.LoaderHooks`, issue 46): declared once, found by
type instead of looked up by name, and honoured for the datasets that declare them."""
from __future__ import annotations

import warnings

from torch.utils.data import Dataset, IterableDataset

from pooled_loader import PooledLoader
from pooled_loader.core.hooks import LoaderHooks, hooks_of
from pooled_loader.mix import Mix
from pooled_loader.shards.webdataset import WebDataset
from test_webdataset import make_shards


def id_but_seven(sample):
    """Transform: the sample's id; sample 7 is broken."""
    gid = int(sample["txt"])
    if gid == 7:
        raise ValueError("sample 7 is broken")
    return gid


class Plain(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class AllSix:
    """Every hook's name, without declaring them: not taken for the hooks."""

    def __init__(self) -> None:
        self.calls: list = []

    def pooled_batch_size(self, batch_size):
        self.calls.append(("batch_size", batch_size))

    def pooled_check_states(self, states):
        self.calls.append(("check", states))

    def pooled_figures(self, states, figures):
        return {"mine": len(states)}

    def pop_skips(self):
        return [("here", "why")]

    def pooled_epoch(self):
        return {"w": 1}

    def pooled_load_epoch(self, payload):
        self.calls.append(("load", payload))


class Counting(IterableDataset, LoaderHooks):
    """An iterable dataset that declares two hooks by subclassing and keeps the defaults of the
    other four."""

    def __init__(self) -> None:
        self.sizes: list = []

    def pooled_batch_size(self, batch_size):
        self.sizes.append(batch_size)

    def pooled_figures(self, states, figures):
        return {"counting": {"workers": len(states)}}

    def __iter__(self):
        return iter(range(8))


def test_datasets_declare_the_hooks_and_others_get_defaults_that_do_nothing():
    plain = Plain()
    defaults = hooks_of(plain)
    assert defaults is not plain
    assert defaults.pop_skips() == [] and defaults.pooled_epoch() is None
    assert defaults.pooled_figures([], {}) == {}
    assert defaults.pooled_batch_size(4) is None and defaults.pooled_check_states([]) is None
    assert defaults.pooled_load_epoch({"x": 1}) is None
    undeclared = AllSix()
    assert hooks_of(undeclared) is not undeclared and hooks_of(undeclared).pop_skips() == []
    mix = Mix({"a": range(4), "b": range(4)}, weights={"a": 1, "b": 1})
    assert hooks_of(mix) is mix


def test_asking_never_writes_to_the_datasets_class():
    class Mine(Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            return i

    before = set(vars(Mine))
    hooks_of(Mine())
    PooledLoader(Mine(), batch_size=1)
    assert set(vars(Mine)) == before  # torchvision's wrapper classes are compared so


def test_a_subclass_keeps_the_defaults_it_does_not_override():
    ds = Counting()
    loader = PooledLoader(ds, batch_size=4, num_workers=2)
    assert ds.sizes == [4]
    assert sorted(int(i) for b in loader for i in b) == sorted(list(range(8)) * 2)  # per worker
    assert loader.stats()["counting"] == {"workers": 2}


def test_a_webdataset_skip_found_in_a_worker_reaches_the_loaders_statistics(tmp_path):
    make_shards(str(tmp_path / "s"), [6, 6])
    ds = WebDataset(str(tmp_path / "s"), transform=id_but_seven, on_error="skip",
                    shuffle_shards=False)
    assert hooks_of(ds) is ds
    loader = PooledLoader(ds, batch_size=4, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = sorted(int(i) for b in loader for i in b)
    assert 7 not in got and len(got) == 12  # the worker reads on to keep its count
    assert loader.stats()["skipped"] == 1
