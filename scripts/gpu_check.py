#!/usr/bin/env python
"""GPU acceptance check for pinned slots and GPU staging (run on a CUDA machine, < 4 minutes).

    python scripts/gpu_check.py [--batches 200]

Prints PASS/FAIL lines with figures; exits 1 if any check fails, 0 when all pass, and 0 with
"SKIP: no CUDA device" on a machine without CUDA.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.cuda import NormalizeImages  # noqa: E402

SHAPE = (3, 224, 224)
RESULTS: list[bool] = []


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


def check_bit_identical() -> None:
    cpu = [(x.clone(), y.clone()) for x, y in loader(512, 64)]
    gpu = [(x.cpu(), y.cpu()) for x, y in loader(512, 64, device="cuda")]
    same = len(cpu) == len(gpu) and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                        for a, b in zip(cpu, gpu))
    report("GPU batches bit-identical to the CPU path (same seed)", same,
           f"{len(gpu)} batches of 64")


def check_no_allocations(batches: int) -> None:
    batch = 64
    ld = loader(batch * batches, batch, device="cuda", persistent_workers=True,
                device_transform=NormalizeImages([0.5] * 3, [0.25] * 3, torch.float16))
    for _ in ld:  # warm-up epoch
        pass
    torch.cuda.synchronize()
    segs0 = torch.cuda.memory_stats()["segment.all.allocated"]
    regs0 = ld._pool.counters["host_registers"]
    slots0 = ld.stats()["slots_allocated"]
    n = 0
    for x, y in ld:
        n += 1
        assert x.is_cuda and x.dtype == torch.float16
    torch.cuda.synchronize()
    segs = torch.cuda.memory_stats()["segment.all.allocated"] - segs0
    regs = ld._pool.counters["host_registers"] - regs0
    slots = ld.stats()["slots_allocated"] - slots0
    report("no cudaMalloc / cudaHostRegister / slot allocation after warm-up",
           segs == 0 and regs == 0 and slots == 0 and n >= 200,
           f"{n} batches: {segs} new device segments, {regs} host registers, {slots} new slots")
    ld.close()


def timed_copy(src: torch.Tensor, dst: torch.Tensor, reps: int = 20) -> float:
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * reps / (time.perf_counter() - start) / 1e9


def check_bandwidth() -> None:
    ld = loader(256, 256, Plain, pin_memory=True)
    x, _ = next(iter(ld))
    dst = torch.empty(x.shape, dtype=x.dtype, device="cuda")
    slot = statistics.median(timed_copy(x, dst) for _ in range(3))
    pinned = torch.empty(x.shape, dtype=x.dtype).pin_memory()
    plain = statistics.median(timed_copy(pinned, dst) for _ in range(3))
    pageable = statistics.median(timed_copy(x.clone(), dst) for _ in range(3))
    report("slots are pinned", bool(x.is_pinned()), f"is_pinned={x.is_pinned()}")
    report("slot H2D bandwidth >= 90% of a pinned tensor copy", slot >= 0.9 * plain,
           f"slot {slot:.1f} GB/s, pinned {plain:.1f} GB/s ({slot / plain:.0%})")
    report("slot H2D bandwidth >= 3x an unpinned copy", slot >= 3 * pageable,
           f"slot {slot:.1f} GB/s, pageable {pageable:.1f} GB/s ({slot / pageable:.1f}x)")


def make_step(target_ms: float = 10.0):
    """A synthetic training step of about `target_ms` GPU time (matmuls, calibrated)."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)

    def run(reps: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            a.mm(a)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000
    run(10)
    per = run(50) / 50
    reps = max(1, round(target_ms / per))

    def step(batch: torch.Tensor) -> None:
        for _ in range(reps):
            a.mm(a)
        batch.float().mean()  # the step reads the batch
    return step, reps * per


def check_overlap() -> None:
    step, step_ms = make_step()
    batches = 60
    workers = max(2, min(8, (os.cpu_count() or 2) - 2))
    ld = loader(64 * (batches + 5), 64, Plain, workers, device="cuda", persistent_workers=True)
    resident = [x for x, _ in ld][:batches]  # data already on the GPU
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x in resident:
        step(x)
    torch.cuda.synchronize()
    base = time.perf_counter() - start
    it = iter(ld)
    step(next(it)[0])  # start the pipeline
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _, (x, _) in zip(range(batches), it):
        step(x)
    torch.cuda.synchronize()
    loaded = time.perf_counter() - start
    report("copies overlap a ~10 ms step: within 5% of data-resident time",
           loaded <= 1.05 * base,
           f"step {step_ms:.1f} ms; resident {base * 1000 / batches:.2f} ms/batch, "
           f"through the loader {loaded * 1000 / batches:.2f} ms/batch ({loaded / base - 1:+.1%})")
    ld.close()


def check_retention() -> None:
    kept = list(loader(100 * 16, 16, device="cuda", pool_slots=6))
    torch.cuda.synchronize()
    reference = list(loader(100 * 16, 16))
    ok = len(kept) == 100 and all(torch.equal(k[0].cpu(), r[0]) and torch.equal(k[1].cpu(), r[1])
                                  for k, r in zip(kept, reference))
    report("100 kept GPU batches stay correct", ok, f"{len(kept)} batches kept")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    for check in (check_bit_identical, lambda: check_no_allocations(args.batches),
                  check_bandwidth, check_overlap, check_retention):
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - a crashing check is a failing check
            report(getattr(check, "__name__", "check"), False, f"{type(exc).__name__}: {exc}")
    print(f"{sum(RESULTS)}/{len(RESULTS)} checks passed in {time.perf_counter() - start:.0f} s")
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
