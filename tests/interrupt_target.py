"""Target of tests/test_interrupts.py: trains "forever" through scenarios that keep the loader in
its risky moments (workers starting and stopping, batches dropped, the pool growing, a worker
dying, a full pipe, workers being replaced), and reports each KeyboardInterrupt it catches and
whether workers are left.

Protocol on stdout: ``go K`` when trial K starts (SIGINT may come from then on), then
``interrupted K LEFT`` once the KeyboardInterrupt was caught and LEFT worker processes remain
after 10 s (0 expected).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loader_datasets import Images  # noqa: E402

from pooled_loader import PooledLoader, WorkerError  # noqa: E402


class Suicidal(Images):
    """A worker SIGKILLs itself at sample `at` (the loader raises WorkerError; we go on)."""

    def __init__(self, n: int, at: int):
        super().__init__(n, (16, 16, 3))
        self.at = at

    def __getitem__(self, i):
        if i == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class Flaky(Images):
    """Each load SIGKILLs its worker with probability 9/256, drawn from os.urandom (so that a
    replacement, seeded as its predecessor, does not die at the same place): under
    max_worker_restarts the loader is replacing workers most of the time."""

    def __getitem__(self, i):
        if os.urandom(1)[0] < 9:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class BigKeys(Dataset):
    """Indices are (i, padding) tuples of ~200 kB: a task fills the worker's pipe, so the main
    process blocks in send while the worker sleeps."""

    def __len__(self):
        return 1000

    def __getitem__(self, key):
        time.sleep(0.02)
        return np.full((8,), key[0], np.int64)


class BigSampler:
    def __init__(self, pad: int = 50_000):
        self.pad = pad

    def __iter__(self):
        pad = list(range(self.pad))
        for i in range(1000):
            yield (i, pad)

    def __len__(self):
        return 1000


def short_epochs():  # non-persistent: workers fork and shut down every few batches
    loader = PooledLoader(Images(8, (16, 16, 3)), batch_size=2, num_workers=2)
    while True:
        for _ in loader:
            pass


def dropped_batches():  # a batch's lease dies on every step
    loader = PooledLoader(Images(10**6, (32, 32, 3)), batch_size=4, num_workers=2,
                          persistent_workers=True)
    for _ in loader:
        time.sleep(0.001)


def kept_batches():  # the pool runs dry and grows; kept batches are dropped in bulk
    loader = PooledLoader(Images(10**6, (32, 32, 3)), batch_size=4, num_workers=2)
    kept = []
    for b in loader:
        kept.append(b)
        if len(kept) > 40:
            kept.clear()


def dying_worker():
    while True:
        try:
            for _ in PooledLoader(Suicidal(40, at=int(time.time() * 1000) % 40), batch_size=2,
                                  num_workers=2):
                pass
        except WorkerError:
            pass


def full_pipe():
    loader = PooledLoader(BigKeys(), batch_size=None, sampler=BigSampler(), num_workers=2,
                          prefetch_factor=4)
    while True:
        for _ in loader:
            pass


def replaced_workers():  # issue 50: Ctrl-C while a dead worker is being replaced
    loader = PooledLoader(Flaky(10**6, (16, 16, 3)), batch_size=2, num_workers=2,
                          max_worker_restarts=10**9)
    for _ in loader:
        pass


SCENARIOS = [short_epochs, dropped_batches, kept_batches, dying_worker, full_pipe,
             replaced_workers]


def workers_left(within: float) -> int:
    deadline = time.monotonic() + within
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(mp.active_children())


def main() -> None:
    import warnings
    warnings.simplefilter("ignore")  # pool growth warnings
    k = 0
    while True:
        try:
            print(f"go {k}", flush=True)
            SCENARIOS[k % len(SCENARIOS)]()
        except KeyboardInterrupt:
            pass
        print(f"interrupted {k} {workers_left(10.0)}", flush=True)
        k += 1


if __name__ == "__main__":
    main()
