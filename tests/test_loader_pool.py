"""The slot pool behind PooledLoader: zero-copy batches, recycling, growth, lifetime, stats."""
import gc
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from loader_datasets import Growing, Images
from pooled_loader import PooledLoader, SlotPool


def arena_ranges(loader):
    return [(a.address, a.address + a.nbytes) for a in loader._pool.arenas()]


def inside_pool(loader, tensor):
    ptr = tensor.data_ptr()
    return any(lo <= ptr < hi for lo, hi in arena_ranges(loader))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_are_views_of_the_pool_and_slots_are_recycled(num_workers):
    loader = PooledLoader(Images(64), batch_size=8, num_workers=num_workers,
                          persistent_workers=num_workers > 0)
    for epoch in range(3):
        for images, labels in loader:
            assert inside_pool(loader, images)
            assert not inside_pool(loader, labels)  # small: copied out, so keeping it is cheap
            assert (images[:, 0, 0, 0].long() == labels % 251).all()
    stats = loader.stats()
    assert stats["allocations_after_warmup"] == 0
    assert stats["reuses"] >= 3 * 8 - stats["slots"]
    assert stats["batches"] == 24 and stats["samples"] == 192
    assert stats["slots_in_use"] <= 1


def test_no_named_shared_memory_is_created():
    before = set(os.listdir("/dev/shm"))
    loader = PooledLoader(Images(32), batch_size=8, num_workers=2)
    for _ in loader:
        assert set(os.listdir("/dev/shm")) - before == set()


def test_kept_batches_are_never_overwritten_and_the_pool_grows_with_one_warning():
    loader = PooledLoader(Images(120), batch_size=4, num_workers=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(loader)
        kept += list(loader)  # second epoch while the first is still held
    grow = [w for w in caught if "pool grows" in str(w.message)]
    assert len(grow) == 1 and "pool_slots=" in str(grow[0].message)
    for k, (images, labels) in enumerate(kept):
        assert labels.tolist() == list(range((k % 30) * 4, (k % 30) * 4 + 4))
        assert (images.flatten(1) == (labels % 251).to(torch.uint8)[:, None]).all()
    assert loader.stats()["grown"] >= 1


def test_slot_returns_when_last_view_dies_even_a_slice():
    loader = PooledLoader(Images(16), batch_size=4, pool_slots=3)
    it = iter(loader)
    images, labels = next(it)
    corner = images[0, :2, :2]  # a view keeps the whole slot alive
    del images, labels
    gc.collect()
    assert loader.stats()["slots_in_use"] == 1
    del corner
    gc.collect()
    assert loader.stats()["slots_in_use"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_changing_shapes_grow_slots_and_nothing_is_truncated(num_workers):
    loader = PooledLoader(Growing(48, every=16), batch_size=8, num_workers=num_workers)
    for x, idx in loader:
        side = 8 * (1 + int(idx[0]) // 16)
        assert x.shape == (8, side, side)
        assert torch.equal(x[:, 0, 0], idx.float())
    # these batches (2-18 KiB) all fit the smallest size class: the first slots grow once
    assert loader.stats()["grown"] >= 1 and loader.stats()["slot_bytes"] >= 8 * 24 * 24 * 4


def test_mixed_shapes_inside_one_batch_raise_a_clear_error():
    loader = PooledLoader(Growing(20, every=3), batch_size=4, num_workers=2)
    with pytest.raises(RuntimeError, match="same structure and array shapes"):
        list(loader)


def test_pool_stats_keys():
    loader = PooledLoader(Images(8), batch_size=4)
    list(loader)
    stats = loader.stats()
    for key in ["slots", "slots_in_use", "grown", "bytes", "reuses", "allocations_after_warmup",
                "wait_s", "worker_busy_s", "skipped", "bytes_moved"]:
        assert key in stats
    assert "bottleneck" in loader.report()


def test_slot_pool_direct():
    pool = SlotPool(1000, 2)
    a, b = pool.acquire(), pool.acquire()
    assert a != b and pool.stats()["slots_in_use"] == 2
    c = pool.acquire()  # dry: grows
    assert pool.stats()["grown"] == 1
    big = pool.acquire(10 * 4096)
    assert big.nbytes >= 10 * 4096
    lease = pool.lease(big)
    view = lease.array()
    del lease
    view[:] = 7
    pool.release(a), pool.release(b), pool.release(c)
    assert pool.stats()["slots_in_use"] == 1
    del view
    gc.collect()
    assert pool.stats()["slots_in_use"] == 0


SHM_SCRIPT = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from loader_datasets import Big
    from pooled_loader import PooledLoader
    loader = PooledLoader(Big(n=16, mb=4.75), batch_size=8, num_workers=2)
    for epoch in range(2):
        for batch in loader:
            assert batch.shape == (8, int(4.75 * 2**20)), batch.shape
            assert batch.nbytes > 38 * 10**6
            first = batch[:, 0].tolist()
            assert all((batch[j, -1] == first[j]).item() for j in range(8))
    print("OK", batch.nbytes)
""")


def test_38mb_batches_under_a_64mb_dev_shm():
    """Docker's default /dev/shm (64 MB): DataLoader needs a segment per batch; we need none."""
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("mount namespaces (unshare -m) are not available here")
    script = SHM_SCRIPT.format(tests=os.path.dirname(__file__))
    cmd = ["unshare", "-m", "sh", "-c",
           "mount -t tmpfs -o size=64m tmpfs /dev/shm && exec \"$0\" -c \"$1\"",
           sys.executable, script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("OK")


def test_a_slot_handed_to_a_writer_has_its_pages_mapped_in_one_call():
    """A fresh mapping (a non-persistent worker's, every epoch) would take one page fault per
    page written; ArenaMap.slot maps the slot's pages up front (MADV_POPULATE_WRITE)."""
    import resource

    import numpy as np

    from pooled_loader.engine.pool import Arena, ArenaMap
    if not getattr(ArenaMap, "populate", True):
        pytest.skip("the kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    arena = Arena(0, 8 << 20, 2)
    arena.array[:] = 1  # the pages exist, as in a pool used before: only the mapping is new
    src = np.full(8 << 20, 7, np.uint8)
    for index in (0, 1):
        view = ArenaMap().slot(arena.slot_ref(index))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        np.copyto(view[:src.size], src)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 64, faults  # 2048 pages written; without it, one fault each
        assert (arena.array[index * arena.slot_bytes:][:src.size] == 7).all()
