"""Pinned pool and GPU staging: the ordering logic is tested on the CPU through the backend seam
(ManualBackend stands in for CUDA); CUDA paths skip without CUDA."""
import contextlib
import gc
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from loader_datasets import Images
from pooled_loader import PooledLoader, SlotPool
from pooled_loader.engine import cuda
from pooled_loader.engine.cuda import DeviceIter, NormalizeImages, pin_pool, record_stream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices")


class ManualEvent:
    def __init__(self, streams=()):
        self.complete = False
        self.streams = streams


class ManualBackend:
    """Stands in for the CUDA runtime: copies are clones, events complete when the test says, and
    every pinning call is logged in order."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.log = []  # ("register" | "unregister", address), ("fence" | "wait", event), ...
        self.events, self.fences, self.handed_over = [], [], []
        self.fail_register = None  # an exception register() raises
        self.fail_fence = None  # an exception fence() raises
        self.fail_wait = None  # an exception wait() raises
        self.capture = False

    # pinning
    def register(self, address, nbytes):
        if self.fail_register is not None:
            raise self.fail_register
        self.log.append(("register", address))

    def unregister(self, address):
        self.log.append(("unregister", address))

    def capturing(self):
        return self.capture

    def fence(self, streams=()):
        if self.fail_fence is not None:
            raise self.fail_fence
        self.fences.append(ManualEvent(streams))
        self.log.append(("fence", self.fences[-1]))
        return self.fences[-1]

    def fence_done(self, fence):
        return fence.complete

    def fence_wait(self, fence):
        self.log.append(("wait", fence))
        fence.complete = True

    def synchronize(self, streams=()):
        self.log.append(("synchronize", streams))
        for fence in self.fences:
            fence.complete = True

    # copies
    def copy(self, t):
        return t.clone()

    def side_stream(self):
        return contextlib.nullcontext()

    def record(self):
        self.events.append(ManualEvent())
        return self.events[-1]

    def hand_over(self, event, tensors):
        self.handed_over.append(event)

    def done(self, event):
        return event.complete

    def wait(self, event):
        if self.fail_wait is not None:
            raise self.fail_wait
        event.complete = True


@pytest.fixture
def manual_cuda(monkeypatch):
    """device="cuda" loaders get ManualBackends (listed in creation order) instead of CUDA."""
    made = []

    def make(device):
        made.append(ManualBackend(device))
        return made[-1]
    monkeypatch.setattr(cuda, "CudaBackend", make)
    return made


def kinds(backend):
    return [entry[0] for entry in backend.log]


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


def test_device_iter_drops_host_batches_with_no_fence_so_acquire_never_waits_for_training(
        manual_cuda):
    loader = PooledLoader(Images(40), batch_size=4, num_workers=2, device="cuda")
    batches = 0
    for images, labels in loader:
        batches += 1
        for event in manual_cuda[0].events:  # the GPU finished the copies queued so far
            event.complete = True
    assert batches == 10
    backend, = manual_cuda
    pool = loader._pool
    # the pool was pinned through this backend (every arena, the first 4 KiB one included)
    assert kinds(backend).count("register") == pool.counters["arenas_allocated"] >= 1
    assert backend.fences == []  # a fence here would sit on the training stream
    assert "wait" not in kinds(backend) and "synchronize" not in kinds(backend)
    assert pool.counters["grown_dry"] == 0 and loader.stats()["slots_in_use"] == 0


def test_pin_only_batches_are_fenced_on_release_and_wait_for_it():
    loader = PooledLoader(Images(40), batch_size=4, pool_slots=2)
    it = iter(loader)
    backend = ManualBackend()
    pool = loader._pool
    pin_pool(pool, backend)
    images, labels = next(it)
    del images, labels
    gc.collect()
    assert len(backend.fences) == 1 and pool.stats()["slots_in_use"] == 1  # fenced: not free
    backend.fences[0].complete = True
    assert pool.stats()["slots_in_use"] == 0
    # when no slot is free, acquire waits for the oldest fence instead of growing the pool
    batches = [next(it) for _ in range(2)]
    del batches
    gc.collect()
    grown = pool.stats()["grown"]
    next(it), next(it)
    assert pool.stats()["grown"] == grown and "wait" in kinds(backend)


def test_record_stream_adds_the_stream_to_the_release_fence():
    loader = PooledLoader(Images(8), batch_size=4)
    it = iter(loader)
    backend = ManualBackend()
    pin_pool(loader._pool, backend)
    images, labels = next(it)
    record_stream({"x": images, "y": labels}, "side stream")
    record_stream(images, "side stream")  # recorded once
    del images, labels
    gc.collect()
    assert [f.streams for f in backend.fences] == [("side stream",)]
    with pytest.raises(ValueError, match="not in a slot of a pinned"):
        record_stream(torch.zeros(3), "side stream")


def test_every_epoch_reuses_the_loaders_one_backend(manual_cuda):
    # copies complete only when a DeviceIter closes: enough slots for a whole epoch
    loader = PooledLoader(Images(16), batch_size=4, num_workers=2, device="cuda", pool_slots=8)
    other = PooledLoader(Images(16), batch_size=4, device="cuda", pool_slots=8)
    for epoch in range(3):
        it = iter(loader)
        assert it.inner.backend is manual_cuda[0]  # HandedOut(DeviceIter)
        assert len(list(it)) == 4
    assert len(list(other)) == 4
    assert len(manual_cuda) == 2  # one per loader, whatever the number of epochs
    # pinned once, not every epoch: one registration per arena
    assert kinds(manual_cuda[0]).count("register") == loader._pool.counters["arenas_allocated"]


def test_pool_is_pinned_after_the_workers_are_forked(manual_cuda, monkeypatch):
    seen = []
    loader = PooledLoader(Images(16), batch_size=4, num_workers=2, device="cuda",
                          multiprocessing_context="fork")
    real_pin = cuda.pin_pool

    def pin(pool, backend):
        seen.append(len(multiprocessing.active_children()))
        real_pin(pool, backend)
    monkeypatch.setattr(cuda, "pin_pool", pin)
    assert len(list(loader)) == 4
    assert seen and seen[0] >= 2  # both workers existed before CUDA was touched


def test_closing_waits_for_fences_before_unregistering_an_arena():
    pool = SlotPool(4096, 2)
    backend = ManualBackend()
    pin_pool(pool, backend)
    lease = pool.lease(pool.acquire())
    view = lease.array()
    del lease
    pool.close()
    assert kinds(backend) == ["register"]  # a batch still lives in the arena
    del view
    gc.collect()
    assert kinds(backend) == ["register", "fence", "wait", "unregister"]
    assert backend.log[1][1] is backend.log[2][1]  # the fence waited for is this slot's fence


def test_an_arena_whose_registration_fails_is_never_handed_out():
    pool = SlotPool(4096, 1)
    backend = ManualBackend()
    pin_pool(pool, backend)
    held = pool.lease(pool.acquire())  # the only slot: the next acquire grows the pool
    backend.fail_register = RuntimeError("cudaHostRegister of 0.0 MiB failed: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        pool.acquire()
    assert [a.id for a in pool.arenas()] == [0] and pool.capacity() == 1
    backend.fail_register = None
    ref = pool.acquire()  # grows now, into a registered arena
    assert ref.arena_id != 0 and kinds(backend) == ["register", "register"]
    del held


def test_pinning_that_fails_undoes_its_registrations():
    pool = SlotPool(4096, 1)
    refs = [pool.acquire(), pool.acquire()]  # two arenas
    assert len(pool.arenas()) == 2
    backend = ManualBackend()

    calls = []

    def register(address, nbytes):
        calls.append(address)
        if len(calls) == 2:
            raise RuntimeError("cudaHostRegister failed: out of memory")
        backend.log.append(("register", address))
    backend.register = register
    with pytest.raises(RuntimeError, match="out of memory"):
        pin_pool(pool, backend)
    assert kinds(backend) == ["register", "unregister"]
    assert pool.release_fence is None and pool.on_new_arena == []
    del refs


def test_cuda_errors_are_cleared_and_named(monkeypatch):
    class Error:
        value = 2

    class Runtime:
        @staticmethod
        def cudaGetErrorString(err):
            return "out of memory"
    cleared = []
    monkeypatch.setattr(cuda, "_clear_last_error", lambda: cleared.append(True))
    assert cuda._cuda_error(Runtime, 0, "cudaHostRegister") is None and cleared == []
    error = cuda._cuda_error(Runtime, Error(), "cudaHostRegister of 1.0 MiB")
    assert str(error) == "cudaHostRegister of 1.0 MiB failed: out of memory (CUDA error 2)"
    assert cleared == [True]  # else torch reports it at its next kernel launch


@pytest.mark.parametrize("why", ["error", "capture"])
def test_a_fence_that_cannot_be_recorded_never_raises_and_keeps_the_slot(why, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    pool = SlotPool(4096, 1)
    backend = ManualBackend()
    pin_pool(pool, backend)
    if why == "error":
        backend.fail_fence = RuntimeError("CUDA error: an illegal memory access")
    else:
        backend.capture = True
    view = pool.lease(pool.acquire()).array()
    with contextlib.ExitStack() as stack:
        if why == "error":
            stack.enter_context(pytest.warns(RuntimeWarning, match="could not record"))
        del view  # SlotLease.__del__ runs the fence
        gc.collect()
    assert unraisable == [] and backend.fences == []
    assert pool.stats()["slots_in_use"] == 1  # not reused on trust
    backend.fail_fence, backend.capture = None, False
    ref = pool.acquire()  # nothing else free: synchronize, then reuse (no growth)
    assert ref.arena_id == 0 and kinds(backend)[-1] == "synchronize"
    assert pool.stats()["grown"] == 0


def test_stopping_a_device_iterator_stops_workers_even_if_close_raises():
    loader = PooledLoader(Images(40), batch_size=4, num_workers=2)
    host = iter(loader)
    backend = ManualBackend()
    it = DeviceIter(host, torch.device("cpu"), depth=2, backend=backend)
    next(it)
    backend.fail_wait = RuntimeError("CUDA error: device-side assert")
    with pytest.raises(RuntimeError, match="device-side assert"):
        it._stop()
    for process in host._workers:
        process.join(10)
        assert not process.is_alive()


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
    assert len(kept) == len(host) == 8
    for (hi, hl), (di, dl) in zip(host, kept):
        assert di.is_cuda and torch.equal(di.cpu(), hi) and torch.equal(dl.cpu(), hl)


@needs_cuda
def test_every_epoch_copies_on_the_same_stream():
    loader = PooledLoader(Images(16), batch_size=4, num_workers=2, device="cuda")
    streams = []
    for _ in range(3):
        it = iter(loader)
        assert len(list(it)) == 4
        streams.append(it.backend.stream)
    assert streams[0] == streams[1] == streams[2]


SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time: long enough for a worker to refill a free slot


@needs_cuda
@pytest.mark.parametrize("where", ["current stream", "side stream, record_stream",
                                   "side stream, dropped inside the block"])
def test_pin_only_copies_read_their_batch_not_a_later_one(where):
    reference = [(x.clone(), y.clone()) for x, y in PooledLoader(Images(48), batch_size=4)]
    loader = PooledLoader(Images(48), batch_size=4, num_workers=2, pin_memory=True, pool_slots=2)
    side = torch.cuda.Stream()
    copies = []
    for x, y in loader:
        if where == "current stream":
            torch.cuda._sleep(SLEEP_CYCLES)  # the copy waits on the GPU; x is dropped meanwhile
            copies.append((x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)))
            continue
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            copies.append((x.to("cuda", non_blocking=True), y.to("cuda", non_blocking=True)))
            if where.endswith("inside the block"):
                del x, y
        if where.endswith("record_stream"):
            record_stream((x, y), side)
    torch.cuda.synchronize()
    assert len(copies) == len(reference) == 12
    for (gx, gy), (rx, ry) in zip(copies, reference):
        assert torch.equal(gx.cpu(), rx) and torch.equal(gy.cpu(), ry)


@needs_cuda
def test_a_device_transform_may_return_host_tensors():
    loader = PooledLoader(Images(8), batch_size=4, device="cuda",
                          device_transform=lambda batch: (batch[0], batch[1].cpu()))
    batches = list(loader)
    assert len(batches) == 2 and batches[0][0].is_cuda and not batches[0][1].is_cuda


@needs_two_gpus
def test_a_loader_on_the_second_gpu_makes_no_context_on_the_first():
    script = textwrap.dedent("""
        import torch
        from loader_datasets import Images
        from pooled_loader import PooledLoader
        for kw in ({"device": "cuda:1"}, {"device": "cuda:1", "pin_memory": True}):
            assert len(list(PooledLoader(Images(16), batch_size=4, num_workers=2, **kw))) == 4
        torch.cuda.synchronize(1)
        print("context on cuda:0:", torch._C._cuda_hasPrimaryContext(0))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=os.path.dirname(__file__))
    assert out.returncode == 0, out.stderr
    assert "context on cuda:0: False" in out.stdout
