"""Length-grouped and token-budget samplers (issue 26): coverage, padding, budgets, ranks, resume."""
import json

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from pooled_loader import PooledLoader
from pooled_loader.ragged.collate import pad
from pooled_loader.ragged.samplers import LengthGroupedSampler, TokenBudgetBatchSampler


def lognormal_lengths(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 1.0, size=n), 16, 4096).astype(np.int64)


def padding_fraction(batches, lengths):
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1 - real / padded


def batches_of(indices, size):
    return [indices[i:i + size] for i in range(0, len(indices), size)]


def test_length_grouped_sampler_gives_every_index_once_and_reshuffles_per_epoch():
    lengths = lognormal_lengths(1000)
    sampler = LengthGroupedSampler(lengths, batch_size=16, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(1000)) and len(sampler) == 1000
    assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(sampler) == list(range(1000))


def test_length_grouping_cuts_padding_and_larger_mega_batches_cut_it_under_five_percent():
    lengths = lognormal_lengths(20000)
    random = batches_of(np.random.default_rng(0).permutation(len(lengths)).tolist(), 32)
    grouped = batches_of(list(LengthGroupedSampler(lengths, batch_size=32)), 32)
    wide = batches_of(list(LengthGroupedSampler(lengths, 32, mega_batch_mult=400)), 32)
    assert padding_fraction(grouped, lengths) < padding_fraction(random, lengths) / 3
    assert padding_fraction(wide, lengths) <= 0.05


@pytest.mark.parametrize("packing", [False, True])
def test_token_budget_batches_fit_the_budget_and_cover_the_dataset(packing):
    lengths = lognormal_lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=8192, packing=packing, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        cost = lengths[b].sum() if packing else lengths[b].max() * len(b)
        assert cost <= 8192
    # greedy filling: merging any two neighbours of the same mega-batch would not fit, on average
    # batches use most of the budget
    used = np.mean([(lengths[b].sum() if packing else lengths[b].max() * len(b)) for b in batches])
    assert used > 0.8 * 8192
    if not packing:
        assert padding_fraction(batches, lengths) <= 0.05


def test_ranks_get_equal_batch_counts_and_together_cover_the_dataset():
    lengths = lognormal_lengths(1001)
    for make in (lambda r: TokenBudgetBatchSampler(lengths, 4096, num_replicas=3, rank=r),
                 lambda r: LengthGroupedSampler(lengths, 8, num_replicas=3, rank=r)):
        per_rank = [list(make(r)) for r in range(3)]
        assert len({len(p) for p in per_rank}) == 1
        flat = [i for p in per_rank for x in p for i in (x if isinstance(x, list) else [x])]
        assert set(flat) == set(range(1001))


def test_rank_and_world_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = LengthGroupedSampler(lognormal_lengths(10), 2)
    assert (sampler.rank, sampler.num_replicas, len(sampler)) == (1, 2, 5)
    with pytest.raises(ValueError, match="rank"):
        LengthGroupedSampler(lognormal_lengths(10), 2, num_replicas=2, rank=2)


@pytest.mark.parametrize("make", [lambda l: LengthGroupedSampler(l, 8, seed=4),
                                  lambda l: TokenBudgetBatchSampler(l, 4096, seed=4)])
def test_state_dict_resumes_after_the_yielded_items(make):
    lengths = lognormal_lengths(500)
    sampler = make(lengths)
    sampler.set_epoch(2)
    it = iter(sampler)
    head = [next(it) for _ in range(7)]
    state = json.loads(json.dumps(sampler.state_dict()))
    rest = list(it)
    fresh = make(lengths)
    fresh.load_state_dict(state)
    assert list(fresh) == rest and fresh.epoch == 2 and len(head) == 7
    assert len(list(fresh)) == len(head) + len(rest)  # the pass after is a whole one again
    with pytest.raises(ValueError, match="500 samples"):
        make(lengths[:10]).load_state_dict(state)


def test_len_fn_is_asked_once_per_sample_and_nothing_is_loaded():
    asked = []
    sampler = TokenBudgetBatchSampler(20, 64, len_fn=lambda i: asked.append(i) or i + 1)
    list(sampler), len(sampler), list(sampler)
    assert asked == list(range(20))
    with pytest.raises(TypeError, match="number of samples"):
        LengthGroupedSampler([1, 2], 2, len_fn=len)


def test_bad_lengths_and_budgets_give_clear_errors():
    with pytest.raises(ValueError, match=r"sample 2 has 9000 tokens"):
        TokenBudgetBatchSampler([10, 20, 9000], max_tokens=4096)
    with pytest.raises(ValueError, match="sample 1 has length -3"):
        LengthGroupedSampler([1, -3], 2)
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        LengthGroupedSampler([[1, 2]], 2)
    with pytest.raises(TypeError, match="1-D sequence of ints"):
        TokenBudgetBatchSampler([1.5, 2.0], 8)


class Texts(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.full((int(self.lengths[i]),), i, dtype=torch.int32)


def test_pooled_loader_with_a_token_budget_resumes_mid_epoch_with_workers():
    lengths = lognormal_lengths(400, seed=2) // 8 + 1

    def loader():
        sampler = TokenBudgetBatchSampler(lengths, 2048, seed=9)
        return PooledLoader(Texts(lengths), batch_sampler=sampler, num_workers=2,
                            collate_fn=pad(), snapshot_every_n_steps=2)
    first = loader()
    it = iter(first)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    rest = [b.values for b in it]
    again = loader()
    again.load_state_dict(state)
    resumed = [b.values for b in again]
    assert len(resumed) == len(rest) and all(torch.equal(a, b) for a, b in zip(resumed, rest))
    assert all(b.numel() <= 2048 for b in rest)
