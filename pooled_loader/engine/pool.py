"""The slot pool: batch slots of a few size classes in anonymous shared memory, recycled by
reference counting (the classes: `size_classes.py`).

One *arena* is one `memfd_create` file mapped once: nothing is named in `/dev/shm`, so a killed
process leaks nothing and a small `/dev/shm` does not limit the pool. Workers open an arena through
`/proc/<owner pid>/fd/<fd>` the first time a task names it. Only the main process owns the free list;
a slot returns to it when the last view of the batch that lives in it is gone (`SlotLease`).
"""
from __future__ import annotations

import collections
import errno
import contextlib
import mmap
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from ..core.errors import PoolAllocationError
from ..core.constants import DRY_GROWTH_DIVISOR, DRY_GROWTH_MIN_SLOTS, round_up
from .size_classes import TypicalSize, size_class

PAGE = mmap.PAGESIZE
_LIMITS = (("ulimit -v (address space)", "RLIMIT_AS"), ("ulimit -n (open files)", "RLIMIT_NOFILE"),
           ("ulimit -f (file size)", "RLIMIT_FSIZE"))


def allocation_failure(exc: OSError, nbytes: int, what: str) -> str:
    """Why ``what`` could not map ``nbytes`` of pool memory: the error, the limits in force and
    the fixes. Used in the main process (growing the pool) and in workers (mapping an arena)."""
    import resource

    limits = []
    for name, attr in _LIMITS:
        soft = resource.getrlimit(getattr(resource, attr))[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(f"{name} = {soft if 'open' in name else f'{soft / 2**20:.0f} MiB'}")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        limits.append(f"{len(os.listdir('/proc/self/fd'))} fds open")
    return (f"PooledLoader: {what} could not map {nbytes / 2**20:.1f} MiB of shared memory for "
            f"the batch pool ({exc.strerror or exc}). Limits in force: "
            f"{', '.join(limits) or 'no ulimit; the memory cgroup or the machine is full'}. "
            "Fix: raise the limit, or lower batch_size, prefetch_factor or pool_slots, and keep "
            "fewer batches alive in the training loop (a batch held keeps its slot, so the pool "
            "grows).")


_release_state = threading.local()


@contextlib.contextmanager
def unfenced_releases() -> Iterator[None]:
    """Slots whose leases die on this thread inside the block skip the release fence: for a caller
    that knows no queued copy reads them any more (DeviceIter, once its copy event completed)."""
    previous = getattr(_release_state, "unfenced", False)
    _release_state.unfenced = True
    try:
        yield
    finally:
        _release_state.unfenced = previous


@dataclass(frozen=True)
class SlotRef:
    """What a task message carries to name a slot: enough for a worker to map and write it."""

    arena_id: int
    owner_pid: int
    fd: int
    arena_bytes: int
    offset: int
    nbytes: int
    index: int  # slot number inside the arena


class Arena:
    """One memfd mapping holding `num_slots` slots of `slot_bytes` each (owner side)."""

    def __init__(self, arena_id: int, slot_bytes: int, num_slots: int):
        self.id = arena_id
        self.slot_bytes = round_up(max(slot_bytes, 1), PAGE)
        self.num_slots = num_slots
        self.nbytes = self.slot_bytes * num_slots
        self.fd = os.memfd_create(f"pooled_loader-{os.getpid()}-{arena_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._mmap = mmap.mmap(self.fd, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.address = self.array.ctypes.data
        # The mapping goes when its last view does; the fd when the arena object is collected
        # (the pool and every lease of this arena hold it).
        weakref.finalize(self, os.close, self.fd)

    def slot_ref(self, index: int) -> SlotRef:
        return SlotRef(self.id, os.getpid(), self.fd, self.nbytes, index * self.slot_bytes,
                       self.slot_bytes, index)


class SlotLease:
    """Owner of one slot while a batch lives in it.

    numpy arrays made from it (`array()`) keep it alive through their `.base`, and so do torch
    tensors made from those arrays, so the slot goes back to the pool exactly when the last view is
    gone. `waits` lists extra streams the release fence must cover
    (`pooled_loader.cuda.record_stream`).
    """

    __slots__ = ("arena", "ref", "waits", "_release", "__weakref__", "__array_interface__")

    def __init__(self, arena: Arena, ref: SlotRef, release: Callable[["SlotLease"], None]):
        self.arena = arena
        self.ref = ref
        self.waits: list[Any] = []
        self._release = release
        self.__array_interface__ = {
            "shape": (ref.nbytes,), "typestr": "|u1", "version": 3,
            "data": (arena.address + ref.offset, False),
        }

    def array(self) -> np.ndarray:
        """A uint8 view of the whole slot whose base is this lease."""
        return np.asarray(self)

    def __del__(self) -> None:
        # getattr: a Ctrl-C may have cut __init__ short before _release was set
        release, self._release = getattr(self, "_release", None), None
        if release is not None:
            release(self)


class SlotPool:
    """Slots of a few size classes in memfd arenas; grows (never truncates) when it runs dry or a
    batch is too big for its slots. Tasks get slots of the typical class; a larger batch gets a
    slot of its own class from a small arena (see `pooled_loader.engine.size_classes`)."""

    def __init__(self, slot_bytes: int, num_slots: int, grow_warning: str = ""):
        self._lock = threading.Lock()
        self._arenas: dict[int, Arena] = {}
        self._free: collections.deque[tuple[int, int]] = collections.deque()
        self._returned: collections.deque[tuple[SlotRef, Any]] = collections.deque()  # by __del__
        self._fenced: collections.deque[tuple[SlotRef, Any]] = collections.deque()
        # Set by pooled_loader.cuda on a pinned pool: a released slot may still be read by an
        # async copy queued on the releasing thread's stream, so release records a fence (CUDA
        # events) and the slot is reused only once it has completed. release_fence(lease) runs in
        # SlotLease.__del__ and must not raise.
        self.release_fence: Callable[[SlotLease], Any] | None = None
        self.fence_done: Callable[[Any], bool] = lambda fence: True
        self.fence_wait: Callable[[Any], None] = lambda fence: None
        self._next_arena = 0
        self._typical = TypicalSize()  # tasks get slots of at least this; smaller idle ones retire
        self._grow_warning = grow_warning
        self._warned = False
        self.num_slots_hint = num_slots
        self.on_new_arena: list[Callable[[Arena], Any]] = []  # may raise: the arena is dropped
        self._live_leases: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.on_retire_arena: list[Callable[[Arena], None]] = []
        self.counters = collections.Counter()
        self.allocations_at_warmup: int | None = None
        self._add_arena(slot_bytes, num_slots)

    # -- arenas ---------------------------------------------------------------------------------
    def _add_arena(self, slot_bytes: int, num_slots: int) -> Arena:
        try:
            arena = Arena(self._next_arena, slot_bytes, num_slots)
        except OSError as exc:
            have = sum(a.nbytes for a in self._arenas.values())
            raise PoolAllocationError(allocation_failure(
                exc, round_up(max(slot_bytes, 1), PAGE) * num_slots,
                f"the main process (pool: {have / 2**20:.0f} MiB in {self.capacity()} slots)")
            ) from exc
        self._next_arena += 1
        for hook in self.on_new_arena:  # (pinning) before any slot of it can be handed out
            hook(arena)
        self._arenas[arena.id] = arena
        self._free.extend((arena.id, i) for i in range(num_slots))
        self.counters["slots_allocated"] += num_slots
        self.counters["arenas_allocated"] += 1
        self.counters["peak_bytes"] = max(self.counters["peak_bytes"],
                                          sum(a.nbytes for a in self._arenas.values()))
        return arena

    def _retire_if_idle(self, arena: Arena) -> None:
        if arena.slot_bytes >= self._typical.bytes or arena.id not in self._arenas:
            return
        free_here = [s for s in self._free if s[0] == arena.id]
        if len(free_here) == arena.num_slots:
            for s in free_here:
                self._free.remove(s)
            del self._arenas[arena.id]
            for hook in self.on_retire_arena:
                hook(arena)

    @property
    def slot_bytes(self) -> int:
        return max((a.slot_bytes for a in self._arenas.values()), default=0)  # 0: all retired

    # -- slots ----------------------------------------------------------------------------------
    def _drain_returned(self) -> None:
        while self._returned:
            self._fenced.append(self._returned.popleft())
        while self._fenced:
            ref, fence = self._fenced[0]
            if fence is not None and not self.fence_done(fence):
                break  # fences complete in order on one stream: the rest are later
            self._fenced.popleft()
            arena = self._arenas.get(ref.arena_id)
            if arena is None:
                continue
            self._free.append((ref.arena_id, ref.index))
            self._retire_if_idle(arena)

    def acquire(self, min_bytes: int = 0) -> SlotRef:
        """A free slot of at least `min_bytes` and of the typical class (the smallest such),
        growing the pool when none is free."""
        with self._lock:
            self._drain_returned()
            if min_bytes and not self._typical.seen:  # the first batch sizes the pool
                self._raise_typical(size_class(min_bytes))
            want = max(min_bytes, self._typical.bytes)
            ref = self._pop_free(want)
            if ref is None and self._fenced:  # a copy still reads a released slot: wait, not grow
                self.fence_wait(self._fenced[0][1])
                self._fenced[0] = (self._fenced[0][0], None)
                self._drain_returned()
                ref = self._pop_free(want)
            if ref is not None:
                self.counters["reuses"] += 1
                return ref
            return self._grow(want)

    def _raise_typical(self, nbytes: int) -> None:
        """Tasks now get slots of at least `nbytes`: idle arenas of smaller slots retire."""
        if self._typical.raise_to(nbytes):
            for arena in list(self._arenas.values()):
                self._retire_if_idle(arena)

    def _pop_free(self, want: int) -> SlotRef | None:
        """The free slot of the smallest class holding `want` bytes (the longest free of its
        class), or None."""
        best, best_bytes = -1, 0
        for i, (arena_id, _) in enumerate(self._free):
            slot_bytes = self._arenas[arena_id].slot_bytes
            if slot_bytes >= want and (best < 0 or slot_bytes < best_bytes):
                best, best_bytes = i, slot_bytes
                if slot_bytes == self._typical.bytes:
                    break
        if best < 0:
            return None
        arena_id, index = self._free[best]
        del self._free[best]
        return self._arenas[arena_id].slot_ref(index)

    def _grow(self, want: int) -> SlotRef:
        typical = self._typical.bytes
        if want > typical:  # a batch larger than the typical class: a few slots of its class
            self.counters["grown_size"] += 1
            arena = self._add_arena(size_class(want), DRY_GROWTH_MIN_SLOTS)
        else:
            live = sum(a.num_slots for a in self._arenas.values() if a.slot_bytes >= typical)
            if live >= self.num_slots_hint:  # ran dry: the user keeps batches
                self.counters["grown_dry"] += 1
                if not self._warned and self._grow_warning:
                    self._warned = True
                    warnings.warn(self._grow_warning.format(slots=self.capacity()), stacklevel=4)
                count = max(DRY_GROWTH_MIN_SLOTS, live // DRY_GROWTH_DIVISOR)
            else:  # the typical class grew: the pool's slots at the new size
                self.counters["grown_size"] += 1
                count = max(self.num_slots_hint - live, 1)
            # before any batch size is known: slots like the ones the pool was made with
            arena = self._add_arena(typical or self.slot_bytes, count)
        self._free.remove((arena.id, 0))
        return arena.slot_ref(0)

    def release(self, ref: SlotRef) -> None:
        """Give back a slot that was never leased (a task failed or was dropped)."""
        self._returned.append((ref, None))

    def lease(self, ref: SlotRef, used: int = 0) -> SlotLease:
        """Wrap a filled slot holding a batch of `used` bytes (0: not known); the slot returns to
        the pool when the lease and its views are gone."""
        arena = self._arenas[ref.arena_id]
        if used:
            with self._lock:
                self._raise_typical(self._typical.add(used))
        returned = self._returned
        fence = self.release_fence
        self.counters["batches"] += 1

        def give_back(lease: SlotLease, returned=returned, fence=fence) -> None:
            fenced = fence is not None and not getattr(_release_state, "unfenced", False)
            returned.append((lease.ref, fence(lease) if fenced else None))

        lease = SlotLease(arena, ref, give_back)
        self._live_leases[ref.arena_id, ref.index] = lease
        return lease

    def lease_holding(self, address: int) -> SlotLease | None:
        """The live lease whose slot contains `address`, if any."""
        for lease in list(self._live_leases.values()):
            start = lease.arena.address + lease.ref.offset
            if start <= address < start + lease.ref.nbytes:
                return lease
        return None

    def arenas(self) -> list[Arena]:
        return list(self._arenas.values())

    def capacity(self) -> int:
        return sum(a.num_slots for a in self._arenas.values())

    def mark_warm(self) -> None:
        """Call at the end of the first epoch: later slot allocations are reported separately."""
        if self.allocations_at_warmup is None:
            self.allocations_at_warmup = self.counters["slots_allocated"]

    def stats(self) -> dict:
        with self._lock:
            self._drain_returned()
            capacity = self.capacity()
            free = sum(1 for s in self._free
                       if self._arenas[s[0]].slot_bytes >= self._typical.bytes)
            warm = self.allocations_at_warmup
            return {
                "slots": capacity,
                "slots_in_use": capacity - free,
                "slot_bytes": self.slot_bytes,
                "bytes": sum(a.nbytes for a in self._arenas.values()),
                "peak_bytes": self.counters["peak_bytes"],
                "arenas": len(self._arenas),
                "size_classes": sorted({a.slot_bytes for a in self._arenas.values()}),
                "grown": self.counters["grown_dry"] + self.counters["grown_size"],
                "reuses": self.counters["reuses"],
                "slots_allocated": self.counters["slots_allocated"],
                "allocations_after_warmup": (
                    None if warm is None else self.counters["slots_allocated"] - warm),
            }

    def close(self) -> None:
        """Drop the pool's references; arenas still viewed by user batches live on until freed."""
        with self._lock:
            arenas, self._arenas = self._arenas, {}
            self._free.clear()
        for arena in arenas.values():
            for hook in self.on_retire_arena:
                hook(arena)


# Linux 5.14+ (Python names it from 3.13 on): map a range's pages writable in one call
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ArenaMap:
    """Worker side: arenas mapped on first use, as writable numpy byte arrays.

    A slot's pages are mapped into this process in one ``madvise(MADV_POPULATE_WRITE)`` call the
    first time the slot is handed out here; otherwise the first write to each page of a fresh
    mapping is a page fault of its own (37 for a 150 KB image), and a worker that is not
    persistent maps the pool again every epoch: that was half its system time per sample."""

    populate = True  # False once the kernel refused the call (older than 5.14)

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, np.ndarray]] = {}
        self._populated: set[tuple[int, int, int]] = set()  # (owner, arena, offset)

    def slot(self, ref: SlotRef) -> np.ndarray:
        key = (ref.owner_pid, ref.arena_id)
        entry = self._maps.get(key)
        if entry is None:
            if ref.owner_pid == os.getpid():
                fd = os.dup(ref.fd)
            else:
                fd = os.open(f"/proc/{ref.owner_pid}/fd/{ref.fd}", os.O_RDWR)
            try:
                mm = mmap.mmap(fd, ref.arena_bytes)
            except OSError as exc:
                raise PoolAllocationError(allocation_failure(
                    exc, ref.arena_bytes, f"worker process {os.getpid()}")) from exc
            finally:
                os.close(fd)
            entry = (mm, np.frombuffer(mm, dtype=np.uint8))
            self._maps[key] = entry
        if ArenaMap.populate and key + (ref.offset,) not in self._populated:
            self._populated.add(key + (ref.offset,))
            try:
                entry[0].madvise(MADV_POPULATE_WRITE, ref.offset, ref.nbytes)
            except OSError as exc:  # the writes then fault page by page, as before
                if exc.errno == errno.EINVAL:
                    ArenaMap.populate = False
        return entry[1][ref.offset:ref.offset + ref.nbytes]

    def forget(self, owner_pid: int, arena_id: int) -> None:
        self._maps.pop((owner_pid, arena_id), None)  # unmapped once no view is left
        self._populated = {p for p in self._populated if p[:2] != (owner_pid, arena_id)}
