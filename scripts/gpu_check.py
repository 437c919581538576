#!/usr/bin/env python
"""GPU acceptance check for pinned slots and GPU staging (a CUDA machine; meant to take ~1 min).

    python scripts/gpu_check.py [--batches 30]

Each check prints PASS or FAIL with its figures; checks that can be fooled carry a control that
must fail the same bound. Exits 1 if any check fails, 0 when all pass, and 0 with
"SKIP: no CUDA device" on a machine without CUDA.

1. GPU batches are bit-identical to the CPU path (same seed).
2. Asynchrony: with the GPU busy for 50 ms (`torch.cuda._sleep`), `copy_(non_blocking=True)` from
   a slot returns in microseconds and the copy is still queued; control: a blocking copy waits.
3. Bandwidth: a slot copies at >= 90% of the speed of a tensor pinned by torch.
4. Overlap: DeviceIter over pinned batches, with a step of about twice the copy time, stays within
   OVERLAP_BOUND of the time with the data already on the GPU; control: the same with copies on
   the consumer stream (serialised) must exceed the bound.
5. Release fences (pin_memory=True, small pool): the GPU sleeps, `x.to("cuda", non_blocking=True)`,
   x is dropped, later batches reuse its slot: every copy still equals the reference. Again on a
   side stream with `record_stream`; control: on a side stream without it, copies are corrupted.
6. No cudaMalloc, cudaHostRegister or slot allocation after a warm-up epoch, with persistent
   workers and without (each epoch a new iterator on the loader's one copy stream).
7. Kept GPU batches stay correct.
8. With two GPUs: a loader on cuda:1 makes no CUDA context on cuda:0 (else SKIP).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.cuda import (CudaBackend, DeviceIter, NormalizeImages,  # noqa: E402
                                record_stream)

SHAPE = (3, 224, 224)
RESULTS: list[bool] = []
BUSY_MS = 50.0  # GPU sleep ahead of the copy in the asynchrony check
ASYNC_CALL_BOUND_MS = 1.0  # an asynchronous copy call returns well within this
OVERLAP_BOUND = 1.2  # overlapped ~1.0x of data-resident time, serialised ~1.5x (step = 2x copy)
FENCE_SLEEP_MS = 20.0  # GPU sleep before each pin-only copy: a slot reused too early is overwritten
WORKERS = max(2, min(8, (os.cpu_count() or 2) - 2))


def report(name: str, ok: bool, figures: str) -> None:
    RESULTS.append(ok)
    print(f"{'PASS' if ok else 'FAIL'}: {name}: {figures}", flush=True)


class RandomCrops(torch.utils.data.Dataset):
    """uint8 CHW images with a random (worker-seeded) flip and brightness: seeds matter."""

    def __init__(self, n: int):
        rng = np.random.default_rng(0)
        self.n = n
        self.base = [torch.from_numpy(rng.integers(0, 256, SHAPE, dtype=np.uint8))
                     for _ in range(8)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        img = self.base[i % 8]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return (img.int() + torch.randint(0, 8, ())).clamp_(0, 255).to(torch.uint8), i


class Plain(RandomCrops):
    """No per-sample work: isolates the copy path (bandwidth, overlap)."""

    def __getitem__(self, i: int):
        return self.base[i % 8], i


def loader(n: int, batch: int, dataset: type = RandomCrops, workers: int = 2,
           **kw) -> PooledLoader:
    return PooledLoader(dataset(n), batch_size=batch, shuffle=True, num_workers=workers,
                        generator=torch.Generator().manual_seed(0), **kw)


def same_batches(got: list, reference: list) -> tuple[int, int]:
    """(batches equal to the reference, batches compared); lengths must match."""
    if len(got) != len(reference):
        return 0, max(len(got), len(reference))
    equal = sum(all(torch.equal(g.cpu(), r) for g, r in zip(gb, rb))
                for gb, rb in zip(got, reference))
    return equal, len(reference)


def sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: measure how many make 1 ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def check_bit_identical() -> None:
    cpu = [(x.clone(), y.clone()) for x, y in loader(512, 64)]
    gpu = [(x, y) for x, y in loader(512, 64, device="cuda")]
    equal, total = same_batches(gpu, cpu)
    report("GPU batches bit-identical to the CPU path (same seed)", equal == total == 8,
           f"{equal}/{total} batches of 64 equal")


def check_asynchrony(cycles_per_ms: float) -> None:
    ld = loader(256, 256, Plain, pin_memory=True)
    x, _ = next(iter(ld))
    dst = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    dst.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    calls, queued, blocking = [], [], []
    for _ in range(5):
        torch.cuda._sleep(int(BUSY_MS * cycles_per_ms))
        start = time.perf_counter()
        dst.copy_(x, non_blocking=True)
        calls.append((time.perf_counter() - start) * 1000)
        after = torch.cuda.Event()
        after.record()
        queued.append(not after.query())
        torch.cuda.synchronize()
        torch.cuda._sleep(int(BUSY_MS * cycles_per_ms))  # control: a blocking copy must wait
        start = time.perf_counter()
        dst.copy_(x)
        blocking.append((time.perf_counter() - start) * 1000)
    call, control = statistics.median(calls), statistics.median(blocking)
    report(f"slot copy_(non_blocking=True) returns at once while the GPU is busy {BUSY_MS:.0f} ms",
           bool(x.is_pinned()) and call < ASYNC_CALL_BOUND_MS and all(queued)
           and control > 0.8 * BUSY_MS,
           f"{x.numel() / 1e6:.0f} MB: call {call * 1000:.0f} us (bound "
           f"{ASYNC_CALL_BOUND_MS * 1000:.0f} us), still queued after the call {sum(queued)}/5; "
           f"control: blocking copy {control:.1f} ms; is_pinned={x.is_pinned()}")


def copy_ms(src: torch.Tensor, dst: torch.Tensor, reps: int = 10) -> float:
    """Median GPU time of one copy, from CUDA events."""
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def check_bandwidth() -> None:
    ld = loader(256, 256, Plain, pin_memory=True)
    x, _ = next(iter(ld))
    dst = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    pinned = torch.empty(x.shape, dtype=x.dtype).pin_memory()
    slot, plain = copy_ms(x, dst), copy_ms(pinned, dst)
    mb = x.numel() / 1e6  # MB per ms is GB/s
    report("slot H2D bandwidth >= 90% of a torch-pinned tensor", plain / slot >= 0.9,
           f"slot {mb / slot:.1f} GB/s, pinned {mb / plain:.1f} GB/s ({plain / slot:.0%})")


class ConsumerStreamBackend(CudaBackend):
    """Negative control: copies on the consumer's own stream, so they cannot overlap its steps."""

    @property
    def stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)


def make_step(target_ms: float):
    """A synthetic training step of about `target_ms` GPU time (calibrated matmuls) that reads
    its batch."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        a.mm(a)
    start.record()
    for _ in range(20):
        a.mm(a)
    end.record()
    end.synchronize()
    per_ms = start.elapsed_time(end) / 20
    reps = max(1, round(target_ms / per_ms))

    def step(batch: torch.Tensor) -> None:
        for _ in range(reps):
            a.mm(a)
        batch.view(-1)[:1 << 20].float().sum()
    return step, reps * per_ms


def timed_steps(batches, step, count: int) -> float:
    """Seconds per step over `count` steps, GPU work included."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, _ in itertools.islice(batches, count):
        step(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / count


def check_overlap() -> None:
    """The device stage alone: pinned host batches are already made, so the workers' speed does
    not enter; the copy is a large share of the step, so serialised copies cannot hide."""
    batch, distinct, steps = 512, 4, 40
    ld = loader(batch * distinct, batch, Plain, 2, pin_memory=True, pool_slots=distinct + 6)
    host = [(x, y) for x, y in ld]
    copy = copy_ms(host[0][0], torch.empty(host[0][0].shape, dtype=torch.uint8, device="cuda"))
    step, step_ms = make_step(2 * copy)
    resident = [(x.cuda(), y.cuda()) for x, y in host]

    def through(backend_type: type) -> float:
        backend = backend_type("cuda")
        for _ in range(2):  # the first pass warms the caching allocator up
            it = DeviceIter(itertools.chain.from_iterable(itertools.repeat(host, steps)),
                            torch.device("cuda"), depth=2, backend=backend)
            per_step = timed_steps(it, step, steps)
            it.close()
        return per_step
    timed_steps(itertools.cycle(resident), step, steps)
    base = timed_steps(itertools.cycle(resident), step, steps)
    loaded = through(CudaBackend)
    serial = through(ConsumerStreamBackend)
    report(f"copies overlap the step: within {OVERLAP_BOUND:.2f}x of data-resident time, and the "
           "serialised control exceeds it",
           loaded <= OVERLAP_BOUND * base < serial,
           f"copy {copy:.2f} ms ({host[0][0].numel() / 1e6:.0f} MB), step {step_ms:.2f} ms; "
           f"resident {base * 1000:.2f} ms/step, DeviceIter {loaded * 1000:.2f} ms/step "
           f"({loaded / base:.2f}x), control on the consumer stream {serial * 1000:.2f} ms/step "
           f"({serial / base:.2f}x)")


def check_release_fences(cycles_per_ms: float) -> None:
    n, batch = 24 * 16, 16
    reference = [(x.clone(), y.clone()) for x, y in loader(n, batch)]
    side = torch.cuda.Stream()
    sleep = int(FENCE_SLEEP_MS * cycles_per_ms)

    def run(mode: str) -> tuple[int, int]:
        copies = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the small pool grows, with a warning
            for x, y in loader(n, batch, pin_memory=True, pool_slots=2):
                if mode == "current stream":
                    torch.cuda._sleep(sleep)
                    copies.append((x.to("cuda", non_blocking=True),
                                   y.to("cuda", non_blocking=True)))
                    continue
                with torch.cuda.stream(side):
                    torch.cuda._sleep(sleep)
                    copies.append((x.to("cuda", non_blocking=True),
                                   y.to("cuda", non_blocking=True)))
                if mode == "side stream, record_stream":
                    record_stream((x, y), side)
                # x and y are dropped at the next step, outside the stream block
        torch.cuda.synchronize()
        return same_batches(copies, reference)

    for mode in ("current stream", "side stream, record_stream"):
        equal, total = run(mode)
        report(f"pin_memory copies behind a {FENCE_SLEEP_MS:.0f} ms GPU sleep read their own "
               f"batch ({mode})", equal == total == 24, f"{equal}/{total} batches equal")
    equal, total = run("side stream, no record_stream")
    report("control: side-stream copies without record_stream are overwritten (the check can "
           "see a missing fence)", equal < total,
           f"{total - equal}/{total} batches corrupted (expected > 0)")


def check_no_allocations(batches: int, persistent: bool) -> None:
    batch = 64
    ld = loader(batch * batches, batch, workers=WORKERS, device="cuda",
                persistent_workers=persistent,
                device_transform=NormalizeImages([0.5] * 3, [0.25] * 3, torch.float16))
    for _ in ld:  # warm-up epoch
        pass
    torch.cuda.synchronize()
    stats0 = torch.cuda.memory_stats()
    regs0 = ld._pool.counters["host_registers"]
    slots0 = ld.stats()["slots_allocated"]
    n, right = 0, 0
    for _ in range(2):
        for x, y in ld:
            n += 1
            right += x.is_cuda and x.dtype == torch.float16
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    segs = stats["segment.all.allocated"] - stats0["segment.all.allocated"]
    regs = ld._pool.counters["host_registers"] - regs0
    slots = ld.stats()["slots_allocated"] - slots0
    kind = "persistent" if persistent else "non-persistent"
    report(f"no cudaMalloc / cudaHostRegister / slot allocation after warm-up ({kind} workers)",
           segs == 0 and regs == 0 and slots == 0 and n == right == 2 * batches,
           f"2 epochs, {n}/{2 * batches} batches: {segs} new device segments, {regs} host "
           f"registers, {slots} new slots")
    ld.close()


def check_retention() -> None:
    kept = list(loader(60 * 16, 16, device="cuda", pool_slots=6))
    torch.cuda.synchronize()
    reference = list(loader(60 * 16, 16))
    equal, total = same_batches(kept, reference)
    report("60 kept GPU batches stay correct (6-slot pool)", equal == total == 60,
           f"{equal}/{total} batches equal")


def check_second_gpu_only() -> None:
    if torch.cuda.device_count() < 2:
        print("SKIP: a loader on cuda:1 makes no context on cuda:0 (one GPU)", flush=True)
        return
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        from gpu_check import loader
        for kw in ({{"device": "cuda:1"}}, {{"device": "cuda:1", "pin_memory": True}}):
            assert len(list(loader(64, 16, **kw))) == 4
        torch.cuda.synchronize(1)
        print(torch._C._cuda_hasPrimaryContext(0))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    report("a loader on cuda:1 makes no CUDA context on cuda:0",
           out.returncode == 0 and out.stdout.strip().endswith("False"),
           f"context on cuda:0: {out.stdout.strip() or out.stderr.strip()[-300:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=30,
                        help="batches per epoch in the allocation check (default 30)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{WORKERS} workers", flush=True)
    start = time.perf_counter()
    cycles_per_ms = sleep_cycles_per_ms()
    checks = [
        ("bit_identical", check_bit_identical),
        ("asynchrony", lambda: check_asynchrony(cycles_per_ms)),
        ("bandwidth", check_bandwidth),
        ("overlap", check_overlap),
        ("release_fences", lambda: check_release_fences(cycles_per_ms)),
        ("no_allocations_persistent", lambda: check_no_allocations(args.batches, True)),
        ("no_allocations_non_persistent", lambda: check_no_allocations(args.batches, False)),
        ("retention", check_retention),
        ("second_gpu_only", check_second_gpu_only),
    ]
    for name, check in checks:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - a crashing check is a failing check
            report(name, False, f"{type(exc).__name__}: {exc}")
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed in {time.perf_counter() - start:.0f} s")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
