"""Pinned pool and GPU staging: ordering logic tested on the CPU; CUDA paths skip without CUDA."""
import gc

import pytest
import torch

from loader_datasets import Images
from pooled_loader import PooledLoader
from pooled_loader.cuda import DeviceIter, NormalizeImages

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


class ManualEvent:
    def __init__(self):
        self.complete = False


class ManualBackend:
    """Stands in for the CUDA runtime: copies are clones, events complete when the test says."""

    def __init__(self):
        self.events, self.handed_over = [], []

    def copy(self, t):
        return t.clone()

    def side_stream(self):
        import contextlib
        return contextlib.nullcontext()

    def record(self):
        self.events.append(ManualEvent())
        return self.events[-1]

    def hand_over(self, event, tensors):
        self.handed_over.append(event)

    def done(self, event):
        return event.complete

    def wait(self, event):
        event.complete = True


def test_host_slots_are_released_only_after_their_copy_completed():
    loader = PooledLoader(Images(40), batch_size=4, pool_slots=8)
    backend = ManualBackend()
    it = DeviceIter(iter(loader), torch.device("cpu"), depth=2, backend=backend)
    first = next(it)
    assert len(backend.events) == 2  # two batches in flight (depth 2)
    assert backend.handed_over == [backend.events[0]]  # consumer waits on the copy event
    gc.collect()
    assert loader.stats()["slots_in_use"] == 2  # copies not complete: both host slots held
    backend.events[0].complete = True
    second = next(it)  # finished copies are released before new ones start
    gc.collect()
    assert loader.stats()["slots_in_use"] == 2  # batch 1 and the new batch 2 still copying
    for e in backend.events:
        e.complete = True
    rest = list(it)
    gc.collect()
    assert loader.stats()["slots_in_use"] == 0
    got = [first, second] + rest
    assert [int(b[1][0]) for b in got] == list(range(0, 40, 4))
    assert all(torch.equal(b[0][:, 0, 0, 0].long(), b[1] % 251) for b in got)


def test_close_waits_for_copies_before_letting_slots_go():
    loader = PooledLoader(Images(40), batch_size=4)
    backend = ManualBackend()
    it = DeviceIter(iter(loader), torch.device("cpu"), depth=3, backend=backend)
    next(it)
    it.close()
    assert all(e.complete for e in backend.events)
    gc.collect()
    assert loader.stats()["slots_in_use"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_normalize_images_matches_reference(dtype, channels_last):
    x = torch.randint(0, 256, (3, 3, 7, 5), dtype=torch.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    batch = NormalizeImages(mean, std, dtype, channels_last)({"img": x, "label": torch.arange(3)})
    ref = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert batch["img"].dtype == dtype
    assert torch.allclose(batch["img"].float(), ref, atol=tol, rtol=tol)
    assert batch["img"].is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(batch["label"], torch.arange(3))


def test_normalize_images_rejects_bad_arguments():
    with pytest.raises(ValueError, match="both mean and std"):
        NormalizeImages(mean=[0.5])
    with pytest.raises(ValueError, match="zeros"):
        NormalizeImages([0.5], [0.0])
    with pytest.raises(ValueError, match="channels"):
        NormalizeImages([0.5, 0.5], [1.0, 1.0])(torch.zeros(1, 3, 2, 2, dtype=torch.uint8))


def test_device_transform_without_cuda_runs_on_the_host():
    class CHW(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.full((3, 4, 4), i, dtype=torch.uint8), i

    loader = PooledLoader(CHW(), batch_size=4, num_workers=2,
                          device_transform=NormalizeImages(dtype=torch.float32))
    images, labels = next(iter(loader))
    assert images.dtype == torch.float32
    assert torch.allclose(images[:, 0, 0, 0], labels.float() / 255)


@needs_cuda
def test_pinned_pool_batches_are_pinned():
    loader = PooledLoader(Images(16), batch_size=4, num_workers=2, pin_memory=True)
    for images, labels in loader:
        assert images.is_pinned() and labels.is_pinned()
    assert loader.stats()["allocations_after_warmup"] == 0


@needs_cuda
def test_device_batches_equal_host_batches_and_kept_ones_stay_correct():
    host = list(PooledLoader(Images(64), batch_size=8, shuffle=True,
                             generator=torch.Generator().manual_seed(1)))
    kept = list(PooledLoader(Images(64), batch_size=8, shuffle=True, num_workers=2,
                             device="cuda", generator=torch.Generator().manual_seed(1)))
    torch.cuda.synchronize()
    for (hi, hl), (di, dl) in zip(host, kept):
        assert di.is_cuda and torch.equal(di.cpu(), hi) and torch.equal(dl.cpu(), hl)


def test_released_slots_wait_for_their_fence_before_reuse():
    loader = PooledLoader(Images(40), batch_size=4, pool_slots=2)
    it = iter(loader)
    pool = loader._pool
    fences = []

    class Fence:
        done = False
    pool.release_fence = lambda: fences.append(Fence()) or fences[-1]
    pool.fence_done = lambda f: f.done
    waited = []
    pool.fence_wait = lambda f: waited.append(f)
    images, labels = next(it)
    del images, labels
    gc.collect()
    assert len(fences) == 1 and pool.stats()["slots_in_use"] == 1  # fenced: not free yet
    fences[0].done = True
    assert pool.stats()["slots_in_use"] == 0
    # when no slot is free, acquire waits for the oldest fence instead of growing the pool
    batches = [next(it) for _ in range(2)]
    del batches
    gc.collect()
    grown = pool.stats()["grown"]
    next(it), next(it)
    assert pool.stats()["grown"] == grown and len(waited) >= 1
