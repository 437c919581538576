"""PooledLoader behaves like torch's DataLoader: same batches, order, samplers, seeds, errors."""
import warnings

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, SubsetRandomSampler

from compare import assert_same
from loader_datasets import Counting, Epochs, Images, Structured, WorkerReport, list_collate
from pooled_loader import PooledLoader

WORKERS = [0, 2]


def both(dataset, **kw):
    return list(DataLoader(dataset, **kw)), list(PooledLoader(dataset, **kw))


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("batch_size,drop_last", [(4, False), (4, True), (1, False), (None, False)])
def test_batches_equal_dataloader(num_workers, batch_size, drop_last):
    expected, got = both(Structured(), batch_size=batch_size, drop_last=drop_last,
                         num_workers=num_workers)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert_same(a, b)


@pytest.mark.parametrize("num_workers", WORKERS)
def test_custom_collate_runs_in_worker_and_keeps_types(num_workers):
    expected, got = both(Images(10), batch_size=3, collate_fn=list_collate, num_workers=num_workers)
    for a, b in zip(expected, got):
        assert_same(a, b)


def test_shuffle_with_seeded_generator_same_order_for_0_and_2_workers_and_dataloader():
    orders = []
    for cls, workers in [(PooledLoader, 0), (PooledLoader, 2), (DataLoader, 2)]:
        loader = cls(Images(50), batch_size=5, shuffle=True, num_workers=workers,
                     generator=torch.Generator().manual_seed(7))
        orders.append([int(i) for _, idx in loader for i in idx])
    assert orders[0] == orders[1] == orders[2]
    assert orders[0] != list(range(50)) and sorted(orders[0]) == list(range(50))


def test_len_and_samplers():
    ds = Images(23)
    assert len(PooledLoader(ds, batch_size=5)) == 5
    assert len(PooledLoader(ds, batch_size=5, drop_last=True)) == 4
    sampler = SubsetRandomSampler([1, 3, 5, 7], generator=torch.Generator().manual_seed(0))
    got = [int(i) for _, idx in PooledLoader(ds, batch_size=2, sampler=sampler, num_workers=2)
           for i in idx]
    assert sorted(got) == [1, 3, 5, 7]
    bs = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
    got = [idx.tolist() for _, idx in PooledLoader(ds, batch_sampler=bs, num_workers=2)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("dataset,kwargs", [
    (Images(3), dict(shuffle=True, sampler=SequentialSampler(range(3)))),
    (Images(3), dict(batch_sampler=[[0]], batch_size=2)),
    (Images(3), dict(num_workers=-1)),
    (Images(3), dict(prefetch_factor=2)),
    (Images(3), dict(persistent_workers=True)),
    (Images(3), dict(timeout=-1)),
    (Counting(4), dict(shuffle=True)),
    (Counting(4), dict(sampler=[0, 1])),
    (Counting(4), dict(batch_sampler=[[0]])),
])
def test_invalid_arguments_raise_the_same_errors(dataset, kwargs):
    with pytest.raises(ValueError) as theirs:
        DataLoader(dataset, **kwargs)
    with pytest.raises(ValueError) as ours:
        PooledLoader(dataset, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_own_arguments_are_checked():
    with pytest.raises(ValueError, match="on_error"):
        PooledLoader(Images(3), on_error="ignore")
    with pytest.raises(ValueError, match="pool_slots"):
        PooledLoader(Images(3), pool_slots=0)


def test_worker_info_and_seeds_match_dataloader():
    def run(cls):
        loader = cls(WorkerReport(12), batch_size=2, num_workers=3,
                     generator=torch.Generator().manual_seed(3))
        return [b for b in loader]
    expected, got = run(DataLoader), run(PooledLoader)
    for a, b in zip(expected, got):
        a.pop("pid"), b.pop("pid")
        assert_same(a, b)
    seeds = {int(w): int(s) for batch in got for w, s in zip(batch["worker"], batch["seed"])}
    base = seeds[0]
    assert seeds == {0: base, 1: base + 1, 2: base + 2}
    assert set(int(n) for b in got for n in b["num_workers"]) == {3}


def test_worker_info_is_none_in_main_process():
    from pooled_loader import get_worker_info
    assert get_worker_info() is None
    batch = next(iter(PooledLoader(WorkerReport(2), batch_size=2)))
    assert batch["worker"].tolist() == [-1, -1]


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_sharding_and_order_match_dataloader(num_workers, drop_last):
    expected, got = both(Counting(23), batch_size=4, num_workers=num_workers, drop_last=drop_last)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert_same(a, b)


def test_iterable_dataset_without_batching():
    expected, got = both(Counting(7), batch_size=None, num_workers=2)
    for a, b in zip(expected, got):
        assert_same(a, b)


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_contexts(start_method):
    expected = list(DataLoader(Structured(9), batch_size=4))
    got = list(PooledLoader(Structured(9), batch_size=4, num_workers=2,
                            multiprocessing_context=start_method))
    for a, b in zip(expected, got):
        assert_same(a, b)


def test_persistent_workers_keep_processes_and_get_set_epoch():
    loader = PooledLoader(Epochs(6), batch_size=3, num_workers=2, persistent_workers=True)
    first_pids = {p.pid for p in iter(loader)._workers}
    for epoch in range(3):
        loader.set_epoch(epoch)
        epochs = [int(e) for es, _ in loader for e in es]
        assert epochs == [epoch] * 6
    assert {p.pid for p in loader._iterator._workers} == first_pids


def test_persistent_workers_restart_cleanly_after_break():
    loader = PooledLoader(Images(40), batch_size=4, num_workers=2, persistent_workers=True)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    got = [int(i) for _, idx in loader for i in idx]
    assert got == list(range(40))


def test_break_mid_epoch_does_not_grow_the_pool_nor_blame_kept_batches():
    """After a break, the abandoned epoch's tasks still hold slots until their answers arrive:
    the next epoch must wait for them, not grow the pool with a warning about kept batches."""
    loader = PooledLoader(Images(200), batch_size=4, num_workers=2, persistent_workers=True)
    for round_ in range(3):
        for i, _ in enumerate(loader):
            if i == 1:
                break
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the pool's "batches are being kept" warning
            got = [int(i) for _, idx in loader for i in idx]
        assert got == list(range(200))
    assert loader._pool.counters["grown_dry"] == 0
    loader.close()


def test_in_order_false_yields_every_batch_once():
    got = [tuple(idx.tolist()) for _, idx in
           PooledLoader(Images(30), batch_size=4, num_workers=2, in_order=False)]
    assert sorted(i for b in got for i in b) == list(range(30))


def test_pin_memory_without_cuda_warns_like_dataloader():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.warns(UserWarning, match="pin_memory"):
        batches = list(PooledLoader(Images(4), batch_size=2, pin_memory=True))
    assert len(batches) == 2


def test_is_a_dataloader():
    assert isinstance(PooledLoader(Images(2)), DataLoader)
