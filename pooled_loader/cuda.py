"""Pinned slots and GPU staging.

- `pin_pool`: every arena of a pool is registered once as page-locked memory
  (`cudaHostRegister`), so every batch comes out pinned with no per-batch pinned copy. A slot
  released while an async copy on the current stream may still read it returns to the free list
  only after an event recorded at release has completed (copies the user queues on other streams
  must be synchronised by the user, as for any pinned buffer they free).
- `DeviceIter`: batches go to the GPU by `non_blocking` copies on a side stream; an event recorded
  after each copy is waited on by the consumer's stream before the batch is handed out, so copies
  of batch k+1 overlap the step on batch k. The host slot of a batch is released only once its copy
  event has completed.
- GPU staging memory comes from torch's caching allocator, allocated on the copy stream and marked
  with `record_stream` for the consumer's stream: after warm-up the allocator recycles its blocks
  (no cudaMalloc), and a batch the user keeps is never overwritten, which a fixed ring cannot
  promise without knowing when the user drops a batch.
- `NormalizeImages`: uint8 -> float32/bf16/fp16, (x/255 - mean)/std and channels_last, in two
  kernels (a casting copy into the output layout, then one fused multiply-add).
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .pool import Arena, SlotPool

CUDA_HOST_REGISTER_DEFAULT = 0


def _check(err: Any, what: str) -> None:
    code = getattr(err, "value", err)
    if code not in (0, None):
        raise RuntimeError(f"{what} failed with CUDA error {err}")


def pin_pool(pool: SlotPool) -> None:
    """Register the pool's arenas (and every later one) as pinned memory; unregister on retire
    and when an arena is freed."""
    if not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    registered: set[int] = set()

    def register(arena: Arena) -> None:
        _check(cudart.cudaHostRegister(arena.address, arena.nbytes, CUDA_HOST_REGISTER_DEFAULT),
               f"cudaHostRegister of {arena.nbytes} bytes")
        registered.add(arena.address)
        pool.counters["host_registers"] += 1
        # Before the mapping goes: weakref callbacks run before the arena's attributes are freed.
        weakref.finalize(arena, unregister_address, arena.address)

    def unregister_address(address: int) -> None:
        if address in registered:
            registered.discard(address)
            cudart.cudaHostUnregister(address)

    for arena in pool.arenas():
        register(arena)
    pool.on_new_arena.append(register)

    def fence() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()  # on the releasing thread's current stream, where its copies were queued
        return event
    pool.release_fence = fence
    pool.fence_done = lambda event: event.query()
    pool.fence_wait = lambda event: event.synchronize()


class CudaBackend:
    """The CUDA calls DeviceIter makes (a separate object so the ordering logic is testable)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            out = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
            out.copy_(tensor, non_blocking=True)
        return out

    def side_stream(self) -> Any:
        return torch.cuda.stream(self.stream)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def hand_over(self, event: Any, tensors: list[torch.Tensor]) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in tensors:
            t.record_stream(consumer)

    @staticmethod
    def done(event: Any) -> bool:
        return event.query()

    @staticmethod
    def wait(event: Any) -> None:
        event.synchronize()


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor of a batch tree (dicts, lists, tuples, namedtuples)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return type(tree)({k: map_tensors(v, fn) for k, v in tree.items()})
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*[map_tensors(v, fn) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(v, fn) for v in tree)
    return tree


class DeviceIter:
    """Wraps a host iterator: keeps `depth` batches in flight to the device."""

    def __init__(self, host: Iterator, device: torch.device, depth: int = 2,
                 transform: Callable[[Any], Any] | None = None, backend: Any = None):
        self.base = host
        self.backend = backend if backend is not None else CudaBackend(device)
        self.depth = max(1, depth)
        self.transform = transform
        self._in_flight: collections.deque = collections.deque()  # (device batch, event, tensors)
        self._copying: list[tuple[Any, Any]] = []  # (event, host batch): slot released when done
        self._exhausted = False

    def __iter__(self) -> "DeviceIter":
        return self

    def __len__(self) -> int:
        return len(self.base)

    def _launch(self, host_batch: Any) -> None:
        device_tensors: list[torch.Tensor] = []

        def to_device(t: torch.Tensor) -> torch.Tensor:
            out = self.backend.copy(t)
            device_tensors.append(out)
            return out
        batch = map_tensors(host_batch, to_device)
        if self.transform is not None:
            with self.backend.side_stream():
                batch = self.transform(batch)
            device_tensors = []
            map_tensors(batch, device_tensors.append)
        event = self.backend.record()
        self._copying.append((event, host_batch))
        self._in_flight.append((batch, event, device_tensors))

    def _release_finished_copies(self) -> None:
        self._copying = [(e, b) for e, b in self._copying if not self.backend.done(e)]

    def __next__(self) -> Any:
        self._release_finished_copies()
        while not self._exhausted and len(self._in_flight) < self.depth:
            try:
                self._launch(next(self.base))
            except StopIteration:
                self._exhausted = True
        if not self._in_flight:
            self.close()
            raise StopIteration
        batch, event, tensors = self._in_flight.popleft()
        self.backend.hand_over(event, tensors)
        return batch

    def _reset(self, loader: Any) -> None:
        self.close()
        self.base._reset(loader)
        self._exhausted = False

    def close(self) -> None:
        """Wait for copies still reading host slots, then let the slots go."""
        for event, _ in self._copying:
            self.backend.wait(event)
        self._copying.clear()
        for _, event, _ in self._in_flight:
            self.backend.wait(event)
        self._in_flight.clear()

    def _stop(self) -> None:
        self.close()
        stop = getattr(self.base, "_stop", None)
        if stop is not None:
            stop()


class NormalizeImages:
    """Device-side image step: every uint8 tensor with 4 dims (N, C, H, W) becomes
    `dtype` with `(x / 255 - mean) / std` per channel, optionally in channels_last memory format.
    Other tensors (labels...) pass through."""

    def __init__(self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 dtype: torch.dtype = torch.float32, channels_last: bool = False):
        if (mean is None) != (std is None):
            raise ValueError("give both mean and std, or neither")
        if std is not None and any(s == 0 for s in std):
            raise ValueError(f"std must not contain zeros, got {list(std)}")
        self.mean, self.std = mean, std
        self.dtype = dtype
        self.channels_last = channels_last
        self._consts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _scale_bias(self, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (channels, str(device))
        if key not in self._consts:
            mean = torch.tensor(self.mean if self.mean is not None else [0.0] * channels,
                                dtype=torch.float32)
            std = torch.tensor(self.std if self.std is not None else [1.0] * channels,
                               dtype=torch.float32)
            if mean.numel() != channels or std.numel() != channels:
                raise ValueError(f"mean/std have {mean.numel()}/{std.numel()} values but the "
                                 f"images have {channels} channels")
            scale = (1.0 / (255.0 * std)).view(1, channels, 1, 1)
            bias = (-mean / std).view(1, channels, 1, 1)
            self._consts[key] = (scale.to(device, self.dtype), bias.to(device, self.dtype))
        return self._consts[key]

    def _one(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.uint8 or x.dim() != 4:
            return x
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=fmt)
        out.copy_(x)  # kernel 1: cast (and layout change)
        scale, bias = self._scale_bias(x.shape[1], x.device)
        return torch.addcmul(bias, out, scale, out=out)  # kernel 2: x * scale + bias

    def __call__(self, batch: Any) -> Any:
        return map_tensors(batch, self._one)
