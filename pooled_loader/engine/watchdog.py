"""Seeing into a worker that died or stopped answering: what it was loading and its Python stack.

Each worker slot has one anonymous file (memfd) owned by the main process, which outlives the
worker process (a replacement reuses it):
- its first page is the worker's `core.working_on.Board`: the sample index and the file or URL it is
  on, written before the work starts, so it can be read after a crash or during a hang;
- after it, `faulthandler` appends the worker's stacks: on a fatal signal (a segfault in C code)
  by itself, and on the SIGUSR1 the main process sends a worker that made no progress for
  `worker_timeout` seconds (faulthandler's handler is C: it runs while Python code is stuck).

The worker opens the file through ``/proc/<main pid>/fd/<fd>`` (as it maps the pool's arenas), so
it works with every start method and nothing is named in the file system.
"""
from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import time
from dataclasses import dataclass

from ..core import working_on
from ..core.working_on import RECORD_BYTES, Board

__all__ = ["Watch", "WatchSpec", "install", "DUMP_SIGNAL"]

DUMP_SIGNAL = signal.SIGUSR1
DUMP_WAIT_S = 2.0  # how long a stuck worker may take to write its stacks
DUMP_SETTLE_S = 0.05  # no new bytes for this long: the dump is complete
MAX_DUMP_BYTES = 64 * 1024  # read at most this much of one dump


@dataclass(frozen=True)
class WatchSpec:
    """What a worker needs to publish its progress: the main process's pid and one fd per
    worker id (its memfd there)."""

    owner_pid: int
    fds: tuple[int, ...]


class Watch:
    """Main side: one memfd per worker id, its record mapped here to be read."""

    def __init__(self, num_workers: int) -> None:
        self.fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._read_to: list[int] = []
        try:
            for wid in range(num_workers):
                fd = os.memfd_create(f"pooled_loader-watch-{os.getpid()}-{wid}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, RECORD_BYTES)
                self._maps.append(mmap.mmap(fd, RECORD_BYTES))
                self._read_to.append(RECORD_BYTES)
        except BaseException:
            self.close()
            raise

    @property
    def spec(self) -> WatchSpec:
        return WatchSpec(owner_pid=os.getpid(), fds=tuple(self.fds))

    def where(self, worker_id: int) -> tuple[str | None, str | None]:
        """(what worker `worker_id` was loading, the file or URL it was reading)."""
        return Board(self._maps[worker_id]).read()

    def clear(self, worker_id: int) -> None:
        """A new worker takes the slot: forget its predecessor's record."""
        Board(self._maps[worker_id]).idle()

    def new_dump(self, worker_id: int) -> str:
        """Stacks the worker wrote since the last call (a crash's, or an asked one)."""
        fd, start = self.fds[worker_id], self._read_to[worker_id]
        end = os.fstat(fd).st_size
        self._read_to[worker_id] = end
        data = os.pread(fd, min(end - start, MAX_DUMP_BYTES), start) if end > start else b""
        lines = data.decode("utf-8", "replace").strip().splitlines()
        # faulthandler's list of loaded extension modules: one very long line, never the cause
        return "\n".join(line for line in lines if not line.startswith("Extension modules:"))

    def ask_dump(self, worker_id: int, pid: int) -> str:
        """Ask a live worker for its stacks and wait (bounded) for them; "" if none came (a
        process in uninterruptible sleep, e.g. a read of a hung file system, cannot answer)."""
        fd = self.fds[worker_id]
        size = os.fstat(fd).st_size
        try:
            os.kill(pid, DUMP_SIGNAL)
        except ProcessLookupError:
            return self.new_dump(worker_id)
        deadline = time.monotonic() + DUMP_WAIT_S
        changed = None
        while time.monotonic() < deadline:
            now = os.fstat(fd).st_size
            if now != size:
                size, changed = now, time.monotonic()
            elif changed is not None and time.monotonic() - changed >= DUMP_SETTLE_S:
                break
            time.sleep(0.005)
        return self.new_dump(worker_id)

    def close(self) -> None:
        for m in self._maps:
            m.close()
        for fd in self.fds:
            os.close(fd)
        self._maps, self.fds = [], []


def install(spec: WatchSpec, worker_id: int) -> None:
    """Worker side: publish progress into this worker's record, and let faulthandler write the
    stacks after it (on a fatal signal, and on DUMP_SIGNAL)."""
    path = f"/proc/{spec.owner_pid}/fd/{spec.fds[worker_id]}"
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
    record = mmap.mmap(fd, RECORD_BYTES)
    working_on.BOARD = Board(record)
    # The fd stays open for faulthandler (it writes with write(2), appending after the record).
    # Disabled first: enabling an enabled faulthandler (pytest's, inherited through fork) only
    # changes its file, and a fatal-signal handler another library installed after it (torch's
    # worker handlers) would then run instead of it.
    faulthandler.disable()
    faulthandler.enable(file=fd, all_threads=True)
    faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True, chain=False)
