"""Datasets for the resume tests (importable, so spawned workers can unpickle them)."""
from __future__ import annotations

import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class Noisy(Dataset):
    """Index plus draws from the three global RNGs a transform would use (random, numpy, torch)."""

    def __init__(self, n: int = 11):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        noise = np.array([random.random(), np.random.rand(), torch.rand(()).item()])
        return i, noise


class Stream(IterableDataset):
    """Items `worker_id * 1000 + k`, k < n per worker, with a random draw each (no state)."""

    def __init__(self, n: int = 7):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for k in range(self.n + wid):  # uneven streams: the interleaving must survive a resume
            yield wid * 1000 + k, np.random.rand()


class StatefulStream(IterableDataset):
    """A stream with its own state_dict/load_state_dict; `restored_in` tells which process (and
    from what) the state was loaded, so tests can check it ran inside the worker."""

    def __init__(self, n: int = 9):
        self.n = n
        self.start = 0
        self.restored_in = -1
        self.next_k = 0

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        k = self.start
        self.start = 0
        while k < self.n:
            self.next_k = k + 1
            yield wid * 1000 + k, self.restored_in
            k += 1

    def state_dict(self) -> dict:
        return {"next": self.next_k}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["next"]
        self.next_k = self.start
        self.restored_in = os.getpid()


class SeededPermutation(Sampler):
    """A sampler with its own state: a permutation from a seed, and how far it got."""

    def __init__(self, n: int, seed: int = 3):
        self.n, self.seed, self.pos, self.resume_at = n, seed, 0, 0
        self.state_calls = 0
        self.main_pid = os.getpid()

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        order = list(range(self.n))
        random.Random(self.seed).shuffle(order)
        self.pos, self.resume_at = self.resume_at, 0
        while self.pos < self.n:
            self.pos += 1
            yield order[self.pos - 1]

    def state_dict(self) -> dict:
        assert os.getpid() == self.main_pid  # asked in the main process only
        self.state_calls += 1
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state["pos"]


class RandomCropCHW:
    """A random s x s crop of a CHW uint8 image (numpy RNG) and a random flip (torch RNG)."""

    def __init__(self, s: int):
        self.s = s

    def __call__(self, x, out=None):
        s = self.s
        y0 = np.random.randint(0, x.shape[1] - s + 1)
        x0 = np.random.randint(0, x.shape[2] - s + 1)
        crop = x[:, y0:y0 + s, x0:x0 + s]
        if torch.rand(()) < 0.5:
            crop = crop[:, :, ::-1]
        return np.ascontiguousarray(crop)


class CountingMap(Dataset):
    """A map-style dataset with its own state: how many samples this copy has loaded, returned
    with each sample (a curriculum level or a dataset-side RNG behave alike)."""

    def __init__(self, n: int = 12):
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls += 1
        return i, self.calls

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = state["calls"]


class CursorStream(IterableDataset):
    """A stream whose iterator continues from the dataset's cursor (iter() does not rewind it),
    so resuming from the dataset object as it is now, not as saved, lands in the wrong place."""

    def __init__(self, n: int = 10):
        self.n = n
        self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        while self.pos < self.n:
            self.pos += 1
            yield wid * 1000 + self.pos - 1

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class EpochStream(IterableDataset):
    """Items tagged with the dataset's own epoch counter, which moves on when a pass ends."""

    def __init__(self, n: int = 6):
        self.n = n
        self.epoch = 0
        self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        start, self.pos = self.pos, 0
        for k in range(start, self.n):
            self.pos = k + 1
            yield self.epoch * 100 + wid * 1000 + k
        self.epoch += 1
        self.pos = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]


class SelfIterator(IterableDataset):
    """A dataset that is its own iterator: iter() rewinds it and makes its RNG, which lives on
    across epochs; load_state_dict needs that RNG, so it only works after iter()."""

    def __init__(self, n: int = 8, seed: int = 1):
        self.n, self.seed = n, seed

    def __iter__(self):
        self.pos = 0
        if not hasattr(self, "rng"):
            info = get_worker_info()
            self.rng = random.Random(self.seed + (0 if info is None else info.id))
        return self

    def __next__(self):
        if self.pos >= self.n:
            raise StopIteration
        self.pos += 1
        return self.pos - 1, self.rng.randrange(1 << 30)

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {"pos": self.pos, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))  # AttributeError before iter()
        self.pos = state["pos"]


class PassStream(EpochStream):
    """EpochStream (its cursor reset and its pass counted at the end of each pass) whose items
    also carry a draw from the dataset's own RNG, which is in its state too."""

    def __init__(self, n: int = 6, seed: int = 7):
        super().__init__(n)
        self.rng = random.Random(seed)

    def __iter__(self):
        for item in super().__iter__():
            yield item, self.rng.random()

    def state_dict(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {**super().state_dict(), "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        super().load_state_dict(state)


class TorchRngMap(Dataset):
    """Index plus a draw from torch's RNG, whose state is the dataset's state (a transform that
    checkpoints the RNG it draws from): in-process that RNG is the one the shuffle seeds from."""

    def __init__(self, n: int = 10):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return i, torch.rand(()).item()

    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))
