"""pooled_loader.mix.dataset: weighted mixing of datasets, through PooledLoader with real worker processes
(forked), real tar shards (WebDataset) and real token files; ranks are simulated as the
library sees them without a process group (RANK/WORLD_SIZE in the environment)."""
from __future__ import annotations

import collections
import copy
import itertools
import json
import math
import time

import numpy as np
import pytest
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from pooled_loader import PooledLoader
from pooled_loader.core.errors import SkipBudgetExceeded
from pooled_loader.resume.elastic import merge_rank_states
from pooled_loader.mix.dataset import Mix
from pooled_loader.mix.order import Order, rest_after, share_of
from pooled_loader.core.seeds import splitmix64
from pooled_loader.ragged.tokens import TokenDataset, write_tokens
from test_webdataset import make_shards, sample_id


class Ids(Dataset):
    """Item i is base + i (so every sample names its source and index)."""

    def __init__(self, base: int, n: int, fail: frozenset = frozenset(), sleep_s: float = 0.0):
        self.base, self.n, self.fail, self.sleep_s = base, n, fail, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.int64:
        if i in self.fail:
            raise OSError(f"cannot read item {i}")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return np.int64(self.base + i)


class Stream(IterableDataset):
    """base + 0..n-1, split over workers round-robin (its own mechanism)."""

    def __init__(self, base: int, n: int):
        self.base, self.n = base, n

    def __iter__(self):
        info = get_worker_info()
        k, w = (info.id, info.num_workers) if info else (0, 1)
        return iter(np.int64(self.base + i) for i in range(k, self.n, w))


SIZES = {"a": 300, "b": 120, "c": 50}
BASES = {"a": 0, "b": 1000, "c": 2000}
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}


def three(**kw) -> Mix:
    sources = {n: Ids(BASES[n], SIZES[n]) for n in SIZES}
    return Mix(sources, dict(WEIGHTS), **{"batch_size": 8, **kw})


def run(mix, workers=2, batches=None, state=None, batch_size=8, **kwargs):
    """(batches as lists, the loader) of an epoch, from `state` if given."""
    loader = PooledLoader(mix, batch_size=batch_size, num_workers=workers, **kwargs)
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if batches is not None and len(out) == batches:
            break
    return out, loader


def flat(batches):
    return [x for b in batches for x in b]


def source_of(x: int) -> str:
    return "a" if x < 1000 else "b" if x < 2000 else "c" if x < 3000 else "w"


# -- the order ------------------------------------------------------------------------------------
def test_vectorised_mixer_is_seeds_splitmix64():
    from pooled_loader.mix.order import _mix64
    x = np.array([0, 1, 12345, (1 << 63) + 5, (1 << 64) - 1], dtype=np.uint64)
    assert _mix64(x).tolist() == [splitmix64(int(v)) for v in x]


def test_rest_after_leaves_each_position_once():
    rounds = [{"slots": 2, "batch": 3, "passed": {"0": 4, "1": 6}},
              {"slots": 3, "batch": 2, "passed": {"0": 2, "1": 1, "2": 0}}]
    rest = rest_after(40, rounds)
    passed = set(range(40)) - set(rest.tolist())
    assert len(passed) == 4 + 6 + 2 + 1
    shares = [share_of(rest, k, 4, 5) for k in range(4)]
    assert sorted(np.concatenate(shares).tolist()) == rest.tolist()


def test_realised_fractions_within_binomial_tolerance():
    mix = three(stop="never", samples_per_epoch=10_000, with_source=True)
    loader = PooledLoader(mix, batch_size=8, num_workers=2)
    names = [n for batch in loader for n in batch[1]]
    assert len(names) == 10_000
    counts = collections.Counter(names)
    for name, w in WEIGHTS.items():
        sigma = math.sqrt(w * (1 - w) / 10_000)
        assert abs(counts[name] / 10_000 - w) < 4 * sigma, (name, counts)
    figures = loader.stats()["mix"]
    assert {n: s["samples"] for n, s in figures["sources"].items()} == dict(counts)
    assert figures["sources"]["a"]["weight_fraction"] == pytest.approx(0.5)


def test_zero_and_two_workers_give_identical_batches():
    zero, _ = run(three(), workers=0)
    two, _ = run(three(), workers=2)
    three_workers, _ = run(three(), workers=3)
    assert zero == two == three_workers
    assert len(flat(zero)) > 100


def test_same_seed_same_order_other_epoch_other_order():
    first, _ = run(three(seed=5), workers=0)
    again, _ = run(three(seed=5), workers=0)
    mix = three(seed=5)
    mix.set_epoch(1)
    other, _ = run(mix, workers=0)
    assert first == again and first != other


# -- stop modes -----------------------------------------------------------------------------------
def test_first_exhausted_stops_at_the_first_draw_of_an_empty_source():
    batches, loader = run(three(shuffle=False))
    got = collections.Counter(source_of(x) for x in flat(batches))
    assert got["c"] == SIZES["c"] and got["a"] < SIZES["a"] and got["b"] < SIZES["b"]
    assert sorted(x for x in flat(batches) if source_of(x) == "c") == list(range(2000, 2050))
    order = Order(seed=0, epoch=0, sizes=[300, 120, 50], weights=lambda _: (0.5, 0.3, 0.2),
                  static=True, stop="first_exhausted", limit=None, batch=8)
    assert order.length() == len(flat(batches))
    assert loader.stats()["mix"]["sources"]["c"]["exhausted"]


def test_all_exhausted_reads_every_item_of_every_source_once():
    batches, loader = run(three(stop="all_exhausted"))
    assert sorted(flat(batches)) == sorted(BASES[n] + i for n in SIZES for i in range(SIZES[n]))
    assert all(s["exhausted"] for s in loader.stats()["mix"]["sources"].values())


def test_never_cycles_with_a_new_order_each_pass():
    batches, _ = run(three(stop="never", samples_per_epoch=1000))
    items = flat(batches)
    assert len(items) == 1000
    c = [x for x in items if source_of(x) == "c"]
    assert len(c) > 2 * SIZES["c"]
    assert sorted(c[:50]) == sorted(c[50:100]) == list(range(2000, 2050))
    assert c[:50] != c[50:100]


def test_iterable_source_all_exhausted_each_item_once_with_two_workers():
    mix = Mix({"a": Ids(0, 200), "w": Stream(5000, 90)}, {"a": 1, "w": 1}, batch_size=4,
              stop="all_exhausted")
    batches, _ = run(mix, workers=2, batch_size=4)
    assert sorted(flat(batches)) == list(range(200)) + list(range(5000, 5090))


def test_iterable_source_first_exhausted_never_repeats():
    mix = Mix({"a": Ids(0, 500), "w": Stream(5000, 40)}, {"a": 1, "w": 1}, batch_size=4)
    items = flat(run(mix, workers=2, batch_size=4)[0])
    assert len(set(items)) == len(items)
    assert 0 < len([x for x in items if x >= 5000]) <= 40


def test_webdataset_source_with_resume(tmp_path):
    from pooled_loader.shards.webdataset import WebDataset
    shards = make_shards(str(tmp_path / "s"), [30, 25, 40])

    def mix():
        web = WebDataset(shards, transform=lambda s: np.int64(10_000 + sample_id(s)), seed=1)
        return Mix({"a": Ids(0, 400), "b": Ids(1000, 300), "web": web},
                   {"a": 0.4, "b": 0.3, "web": 0.3}, batch_size=8, stop="all_exhausted")
    full, _ = run(mix())
    assert sorted(x for x in flat(full) if x >= 10_000) == list(range(10_000, 10_095))
    for cut in (1, 9, 40):
        head, loader = run(mix(), batches=cut)
        state = json.loads(json.dumps(loader.state_dict()))
        rest, _ = run(mix(), state=state)
        assert head + rest == full, cut


# -- resume ---------------------------------------------------------------------------------------
def _end_of_c(full):
    """The batch holding source c's last item."""
    return max(k for k, b in enumerate(full) for x in b if source_of(x) == "c") + 1


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_resume_at_many_points_equals_the_uninterrupted_run(stop):
    full, _ = run(three(stop=stop))
    for cut in sorted({1, 2, len(full) // 2, _end_of_c(full), len(full) - 1, len(full)}):
        head, loader = run(three(stop=stop), batches=cut)
        state = json.loads(json.dumps(loader.state_dict()))
        rest, _ = run(three(stop=stop), state=state)
        assert head + rest == full, (stop, cut)


def test_resume_of_a_resumed_run():
    full, _ = run(three())
    head, loader = run(three(), batches=3)
    state = json.loads(json.dumps(loader.state_dict()))
    middle, loader = run(three(), state=state, batches=5)
    state = json.loads(json.dumps(loader.state_dict()))
    rest, _ = run(three(), state=state)
    assert head + middle + rest == full


def test_a_state_saved_before_mix_had_drop_last_still_resumes():
    """States saved by the previous release have no 'drop_last': they load (their positions read
    the same) and continue the uninterrupted run."""
    def without_drop_last(node):
        if isinstance(node, dict):
            mix = str(node.get("format", "")).startswith("pooled_loader.mix/")
            return {k: without_drop_last(v) for k, v in node.items()
                    if not (mix and k == "drop_last")}
        if isinstance(node, list):
            return [without_drop_last(v) for v in node]
        return node

    full, _ = run(three())
    head, loader = run(three(), batches=4)
    state = json.loads(json.dumps(loader.state_dict()))
    old = without_drop_last(state)
    assert old != state  # the key was there to remove
    rest, _ = run(three(), state=old)
    assert head + rest == full


def test_resume_bit_identical_with_per_sample_seed():
    class Noisy(Ids):
        def __getitem__(self, i):
            return np.float64(super().__getitem__(i)) + np.random.rand()

    def mix():
        return Mix({"a": Noisy(0, 100), "b": Noisy(1000, 80)}, {"a": 1, "b": 1}, batch_size=4,
                   per_sample_seed=True)
    full, _ = run(mix(), batch_size=4)
    zero, _ = run(mix(), workers=0, batch_size=4)
    head, loader = run(mix(), batches=7, batch_size=4)
    rest, _ = run(mix(), state=json.loads(json.dumps(loader.state_dict())), batch_size=4)
    assert head + rest == full == zero


def test_weights_changed_at_epoch_2_are_kept_by_a_resume():
    def epoch(mix, e, state=None, batches=None):
        loader = PooledLoader(mix, batch_size=8, num_workers=2)
        if state is not None:
            loader.load_state_dict(state)
        else:
            loader.set_epoch(e)
        out = []
        for batch in loader:
            out.append(batch.tolist())
            if len(out) == batches:
                break
        return out, loader

    mix = three(stop="never", samples_per_epoch=400)
    epoch(mix, 0)
    mix.set_epoch(2)
    mix.set_weights({"a": 0.1, "b": 0.1, "c": 0.8})
    full2, _ = epoch(mix, 2)
    full3, _ = epoch(mix, 3)
    assert collections.Counter(map(source_of, flat(full2)))["c"] > 250
    head, loader = epoch(mix, 2, batches=10)
    state = json.loads(json.dumps(loader.state_dict()))
    fresh = three(stop="never", samples_per_epoch=400)  # the constructor's weights
    rest, _ = epoch(fresh, 2, state=state)
    assert head + rest == full2
    assert epoch(fresh, 3)[0] == full3  # the state's schedule stays in force


def test_weights_as_a_callable_of_step():
    def curriculum(step):
        return {"a": 1.0, "b": 0.0, "c": 0.0} if step < 10 else {"a": 0.0, "b": 1.0, "c": 0.0}

    mix = Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, curriculum, batch_size=8,
              stop="never", samples_per_epoch=160)
    batches, _ = run(mix)
    assert all(source_of(x) == "a" for b in batches[:10] for x in b)
    assert all(source_of(x) == "b" for b in batches[10:] for x in b)
    assert batches == run(mix, workers=0)[0]


def _default_mix(**kw) -> Mix:
    """Three sources and no batch_size: the mix takes the loader's."""
    return Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, dict(WEIGHTS), **kw)


def test_the_default_order_does_not_depend_on_workers_or_prefetch():
    """Nobody repeats the loader's batch size to the Mix: without it, 0 or 2 workers and any
    prefetch give the same batches (before, 2 workers took blocks of 1 and the sequence of
    sources moved at sample 1, with one more batch)."""
    def batches(workers, **kw):
        loader = PooledLoader(_default_mix(), batch_size=8, num_workers=workers, **kw)
        return [b.tolist() for b in loader]

    zero = batches(0)
    assert len(zero) > 10
    assert batches(2) == zero
    assert batches(2, prefetch_factor=1) == zero
    assert batches(2, prefetch_factor=5, persistent_workers=True) == zero


def test_the_default_order_is_one_sequence_over_ranks(monkeypatch):
    """Rank r of R takes global batches r, r + R, ...: interleaved, the ranks' batches are the
    one-rank sequence."""
    one = [b.tolist() for b in PooledLoader(_default_mix(), batch_size=8, num_workers=2)]
    ranks, _ = _ranks(monkeypatch, 2, make=lambda: _default_mix(stop="first_exhausted",
                                                                   drop_last=None))
    interleaved = [b for pair in itertools.zip_longest(*ranks) for b in pair if b is not None]
    assert interleaved == one


def test_a_mix_batch_size_that_disagrees_with_the_loader_is_refused():
    with pytest.raises(ValueError, match=r"Mix\(batch_size=4\) disagrees with the loader's "
                                         r"batch_size=8"):
        PooledLoader(_default_mix(batch_size=4), batch_size=8, num_workers=2)
    with pytest.raises(ValueError, match="batch_size=None"):
        PooledLoader(_default_mix(batch_size=4), batch_size=None, num_workers=2)
    PooledLoader(_default_mix(batch_size=8), batch_size=8)  # the same: fine
    PooledLoader(_default_mix(batch_size=1), batch_size=None)  # one sample a step: blocks of 1


def test_a_state_saved_with_blocks_of_one_resumes_in_them():
    """A state of the earlier default (a Mix without batch_size took blocks of 1, whatever the
    loader's) continues the saved run exactly, with a warning that says why its order follows
    num_workers; a Mix given its batch size still refuses it."""
    def old_loader():
        loader = PooledLoader(_default_mix(), batch_size=8, num_workers=2)
        loader.dataset.batch_size = 1  # the earlier release's default, under any loader
        return loader

    full = [b.tolist() for b in old_loader()]
    loader, head = old_loader(), []
    for batch in loader:
        head.append(batch.tolist())
        if len(head) == 5:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = PooledLoader(_default_mix(), batch_size=8, num_workers=2)
    with pytest.warns(UserWarning, match="saved with batch_size=1, not the loader's 8"):
        resumed.load_state_dict(copy.deepcopy(state))
    assert head + [b.tolist() for b in resumed] == full
    with pytest.raises(ValueError, match="batch_size"):
        PooledLoader(_default_mix(batch_size=8), batch_size=8, num_workers=2).load_state_dict(
            copy.deepcopy(state))


# -- elastic --------------------------------------------------------------------------------------
def _ranks(monkeypatch, world, steps=None, states=None, make=None):
    """Every rank's batches (each rank a loader with 2 workers over `make()`, by default three
    sources, every position once), and their states."""
    out, saved = [], []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        mix = make() if make else three(stop="all_exhausted", drop_last=None)
        loader = PooledLoader(mix, batch_size=8, num_workers=2, distributed=True)
        if states is not None:
            loader.load_state_dict(merge_rank_states(states))
        got, it = [], iter(loader)  # alive while the state is taken: it waits for every
        for batch in it:  # worker's start state (one that delivered nothing has no other)
            got.append(batch.tolist())
            if len(got) == steps:
                break
        out.append(got)
        saved.append(json.loads(json.dumps(loader.state_dict())))
        del it
    return out, saved


def test_two_ranks_resume_on_three_with_every_sample_once(monkeypatch):
    full, _ = _ranks(monkeypatch, 2)
    everything = sorted(BASES[n] + i for n in SIZES for i in range(SIZES[n]))
    assert sorted(flat(full[0]) + flat(full[1])) == everything
    head, states = _ranks(monkeypatch, 2, steps=5)
    rest, states3 = _ranks(monkeypatch, 3, states=states)
    assert sorted(flat(head[0]) + flat(head[1]) + sum(map(flat, rest), [])) == everything


def test_three_ranks_then_resumed_again_on_one(monkeypatch):
    everything = sorted(BASES[n] + i for n in SIZES for i in range(SIZES[n]))
    head, states = _ranks(monkeypatch, 2, steps=4)
    middle, states = _ranks(monkeypatch, 3, steps=3, states=states)
    rest, _ = _ranks(monkeypatch, 1, states=states)
    got = sum(map(flat, head), []) + sum(map(flat, middle), []) + flat(rest[0])
    assert sorted(got) == everything


# -- failures and accounting ----------------------------------------------------------------------
def test_a_failing_source_is_counted_and_never_starves_the_others():
    def mix(fail):
        return Mix({"a": Ids(0, 300), "b": Ids(1000, 120, fail=fail), "c": Ids(2000, 50)},
                   dict(WEIGHTS), batch_size=8, on_error="skip", shuffle=False)
    clean = flat(run(mix(frozenset()))[0])
    bad = frozenset(range(0, 120, 3))  # 40 of ~470: past the default skip budget (10%)
    items, loader = run(mix(bad), max_skip_fraction=None)
    items = flat(items)
    # the others keep their draws (with workers, a short position moves the batch boundaries)
    assert sorted(x for x in clean if x - 1000 not in bad) == sorted(items)
    assert [x for x in clean if x - 1000 not in bad] == flat(
        run(mix(bad), workers=0, max_skip_fraction=None)[0])
    with pytest.raises(SkipBudgetExceeded, match="mix source 'b'"):
        run(mix(bad))
    figures = loader.stats()
    failed = len([x for x in clean if x >= 1000 and x < 2000 and x - 1000 in bad])
    assert figures["mix"]["sources"]["b"]["failed"] == failed == figures["skipped"]
    assert "source 'b' failed" in loader.report()


def test_a_failing_source_raises_with_its_name_by_default():
    mix = Mix({"a": Ids(0, 30), "b": Ids(1000, 30, fail=frozenset({0}))}, {"a": 1, "b": 1},
              shuffle=False)
    with pytest.raises(Exception, match="Mix source 'b', item 0"):
        run(mix, workers=0)


def test_tokens_are_counted_where_lengths_are_known(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, size=rng.integers(1, 9)) for _ in range(60)]
    write_tokens(tmp_path / "t", docs)
    tokens = TokenDataset(tmp_path / "t")
    mix = Mix({"tok": tokens, "a": Ids(0, 200)}, {"tok": 1, "a": 1}, with_source=True,
              batch_size=1)
    loader = PooledLoader(mix, batch_size=None, num_workers=2)
    seen = sum(len(sample) for sample, name in loader if name == "tok")
    figures = loader.stats()["mix"]["sources"]
    assert figures["tok"]["tokens"] == seen > 0 and figures["a"]["tokens"] is None


def test_report_names_a_starving_source():
    mix = Mix({"fast": Ids(0, 400), "slow": Ids(1000, 400, sleep_s=0.003)},
              {"fast": 0.8, "slow": 0.2}, stop="never", samples_per_epoch=200, batch_size=8)
    _, loader = run(mix, workers=0)
    assert "'slow' STARVES the mix" in loader.report()
    assert "'fast' STARVES" not in loader.report()


# -- hostile states -------------------------------------------------------------------------------
def _saved_state():
    _, loader = run(three(), batches=3)
    return json.loads(json.dumps(loader.state_dict()))


@pytest.mark.parametrize("key,value", [
    ("passed", -1), ("passed", "7"), ("passed", 1 << 60), ("passed", True), ("epoch", -2),
    ("per_source.a.samples", -5), ("per_source.b.items", 2.5), ("per_source.c.exhausted", 1),
    ("schedule", [[0, {"a": -1.0, "b": 1.0, "c": 1.0}]]), ("schedule", [[0, {"a": 1.0}]]),
    ("rounds", [{"slots": 0, "batch": 8, "passed": {}}]),
    ("rounds", [{"slots": 2, "batch": 8, "passed": {"5": 1}}]), ("format", "other"),
    ("per_source.a", None), ("world_size", 0), ("per_source.a.items", 10 ** 9),
    ("schedule", [[5, {"a": 1.0, "b": 1.0, "c": 1.0}]]), ("schedule", []),
])
def test_hostile_states_raise_value_error_naming_the_key(key, value):
    state = _saved_state()
    worker = state["_snapshot"]["_worker_snapshots"]["worker_0"]
    node = worker["dataset_state"]
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = value
    loader = PooledLoader(three(), batch_size=8, num_workers=2)
    with pytest.raises(ValueError) as err:
        loader.load_state_dict(state)
    assert key.split(".")[-1] in str(err.value) or key.split(".")[0] in str(err.value)


def test_a_state_of_another_mix_is_refused():
    state = _saved_state()
    other = Mix({n: Ids(BASES[n], SIZES[n]) for n in SIZES}, dict(WEIGHTS), batch_size=8,
                seed=9)
    with pytest.raises(ValueError, match="seed"):
        PooledLoader(other, batch_size=8, num_workers=2).load_state_dict(copy.deepcopy(state))


@pytest.mark.parametrize("kwargs,match", [
    ({"stop": "sometimes"}, "stop must be one of"), ({"stop": "never"}, "samples_per_epoch"),
    ({"batch_size": 0}, "batch_size"), ({"on_error": "ignore"}, "on_error"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        three(**kwargs)


def test_bad_weights():
    with pytest.raises(ValueError, match="naming each source"):
        Mix({"a": Ids(0, 3)}, {"b": 1.0})
    with pytest.raises(ValueError, match="finite"):
        Mix({"a": Ids(0, 3)}, {"a": float("nan")})
    with pytest.raises(ValueError, match="every weight is 0"):
        Mix({"a": Ids(0, 3)}, {"a": 0})


def test_a_state_saved_at_the_end_of_an_epoch_resumes_into_the_next():
    def epoch_of(loader, e):
        loader.set_epoch(e)
        return [b.tolist() for b in loader]

    loader = PooledLoader(three(), batch_size=8, num_workers=2)
    epoch_of(loader, 0)
    state = json.loads(json.dumps(loader.state_dict()))
    expected = epoch_of(PooledLoader(three(), batch_size=8, num_workers=2), 1)
    resumed = PooledLoader(three(), batch_size=8, num_workers=2)
    resumed.load_state_dict(state)
    assert epoch_of(resumed, 1) == expected


def test_persistent_workers_follow_set_epoch():
    def epochs(**kw):
        loader = PooledLoader(three(), batch_size=8, num_workers=2, **kw)
        out = []
        for e in range(2):
            loader.set_epoch(e)
            out.append([b.tolist() for b in loader])
        return out

    persistent = epochs(persistent_workers=True)
    assert persistent == epochs() and persistent[0] != persistent[1]


def test_a_source_named_with_a_dot_resumes():
    # The state's keys under per_source are source names, read whole (a dot in one is not a
    # path step, as it was while mix/state.py split dotted keys itself).
    def make():
        return Mix({"train.en": Ids(0, 40), "val": Ids(1000, 20)}, {"train.en": 1, "val": 1},
                   seed=1)
    full, _ = run(make(), workers=0)
    got, loader = run(make(), workers=0, batches=3)
    rest, _ = run(make(), workers=0, state=json.loads(json.dumps(loader.state_dict())))
    assert got + rest == full
