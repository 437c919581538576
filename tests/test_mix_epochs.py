"""pooled_loader.mix.dataset across epochs and ranks: persistent workers follow `set_weights`, and every
rank yields the same number of batches in every stop mode (real worker processes; ranks as the
library sees them without a process group: RANK/WORLD_SIZE in the environment)."""
from __future__ import annotations

import numpy as np
import pytest

from pooled_loader import PooledLoader
from pooled_loader.mix.dataset import Mix
from test_mix import BASES, SIZES, WEIGHTS, Ids, _ranks, flat, source_of


def _curriculum(step: int) -> dict:  # module level: it pickles
    return {"a": 0.0, "b": 1.0, "c": 0.0} if step % 2 else {"a": 1.0, "b": 0.0, "c": 0.0}


def _epochs(persistent: bool, change) -> list:
    mix = Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, dict(WEIGHTS), batch_size=8,
              stop="never", samples_per_epoch=160)
    loader = PooledLoader(mix, batch_size=8, num_workers=2, persistent_workers=persistent)
    out = []
    for epoch in range(4):
        loader.set_epoch(epoch)
        if epoch == 2:
            change(mix)
        out.append([b.tolist() for b in loader])
    return out


@pytest.mark.parametrize("change", [
    lambda mix: mix.set_weights({"a": 0.05, "b": 0.05, "c": 0.9}),
    lambda mix: mix.set_weights(_curriculum),
], ids=["dict", "callable"])
def test_persistent_workers_see_set_weights_between_epochs(change):
    persistent = _epochs(True, change)
    assert persistent == _epochs(False, change)
    before = [source_of(x) for x in flat(persistent[1])]
    after = [source_of(x) for x in flat(persistent[2])]
    assert after.count("c") > 2 * before.count("c") or after.count("a") != before.count("a")
    assert persistent[3] != persistent[2]


def test_an_unpicklable_callable_set_later_is_refused_in_persistent_workers():
    with pytest.raises(Exception, match="does not pickle"):
        _epochs(True, lambda mix: mix.set_weights(lambda step: dict(WEIGHTS)))


# -- every rank the same number of batches ---------------------------------------------------------
STOPS = [("first_exhausted", None), ("all_exhausted", None), ("never", 203)]


def _mix(stop, samples, **kw) -> Mix:
    return Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, dict(WEIGHTS), batch_size=8,
               stop=stop, samples_per_epoch=samples, **kw)


def _rank_batches(monkeypatch, world, stop, samples, **kw) -> list:
    out = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        loader = PooledLoader(_mix(stop, samples, **kw), batch_size=8, num_workers=2,
                              distributed=True)
        out.append([b.tolist() for b in loader])
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stop,samples", STOPS)
def test_every_rank_yields_as_many_batches_padding_by_default(monkeypatch, world, stop, samples):
    whole = flat(b.tolist() for b in PooledLoader(_mix(stop, samples), batch_size=8,
                                                  num_workers=0))
    ranks = _rank_batches(monkeypatch, world, stop, samples)
    counts = [len(r) for r in ranks]
    step = 8 * world
    assert counts == [-(-len(whole) // step)] * world, (len(whole), counts)
    got = [x for r in ranks for x in flat(r)]
    assert len(got) == counts[0] * step  # every batch full: the epoch padded to a multiple
    assert set(got) == set(whole)  # padded with its own first samples again
    extra = len(got) - len(whole)
    assert sorted(got) == sorted(whole + whole[:extra])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stop,samples", STOPS)
def test_drop_last_cuts_every_rank_to_as_many_full_batches(monkeypatch, world, stop, samples):
    whole = flat(b.tolist() for b in PooledLoader(_mix(stop, samples), batch_size=8,
                                                  num_workers=0))
    ranks = _rank_batches(monkeypatch, world, stop, samples, drop_last=True)
    keep = len(whole) // (8 * world)
    assert [len(r) for r in ranks] == [keep] * world
    assert all(len(b) == 8 for r in ranks for b in r)
    assert sorted(x for r in ranks for x in flat(r)) == sorted(whole[:keep * 8 * world])


def test_len_is_each_ranks_batches_times_batch_size(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert len(_mix("never", 203)) == 9 * 8
    assert len(_mix("never", 203, drop_last=True)) == 8 * 8


def test_a_finite_mix_with_an_iterable_source_on_ranks_is_refused_naming_it(monkeypatch):
    from test_mix import Stream
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mix = Mix({"a": Ids(0, 50), "w": Stream(5000, 40)}, {"a": 1, "w": 1}, batch_size=4)
    with pytest.raises(Exception, match=r"\['w'\].*drop_last=None"):
        list(PooledLoader(mix, batch_size=4, num_workers=0, distributed=True))
    mix = Mix({"a": Ids(0, 50), "w": Stream(5000, 40)}, {"a": 1, "w": 1}, batch_size=4,
              drop_last=None)
    assert len(list(PooledLoader(mix, batch_size=4, num_workers=0, distributed=True))) > 0


def test_an_elastic_resume_evens_the_ranks_over_what_is_left(monkeypatch):
    def make():
        return _mix("all_exhausted", None)  # drop_last=False: the ranks padded even

    head, states = _ranks(monkeypatch, 2, steps=5, make=make)
    rest, _ = _ranks(monkeypatch, 3, states=states, make=make)
    assert len({len(r) for r in rest}) == 1, [len(r) for r in rest]
    got = flat(sum(head, [])) + flat(sum(rest, []))
    whole = [BASES[n] + i for n in SIZES for i in range(SIZES[n])]
    assert set(got) == set(whole)  # all read; the padding repeats a few
