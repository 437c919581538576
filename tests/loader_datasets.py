"""Small datasets for the loader tests (importable, so spawned workers can unpickle them)."""
from __future__ import annotations

import collections
import os
import random
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

Point = collections.namedtuple("Point", ["x", "y"])


class Structured(Dataset):
    """Samples with every kind of leaf: tensors of several dtypes, ndarrays, numbers, strings."""

    def __init__(self, n: int = 37):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return {
            "image": torch.randint(0, 255, (3, 8, 6), generator=g, dtype=torch.uint8),
            "feat": np.arange(5, dtype=np.float32) * i,
            "half": torch.full((2,), i, dtype=torch.bfloat16),
            "label": i,
            "weight": float(i) / 3,
            "flag": i % 2 == 0,
            "np_scalar": np.int32(i),
            "name": f"sample-{i}",
            "pair": (torch.tensor([i, -i]), Point(i, np.float64(i) * 2)),
        }


class Images(Dataset):
    """uint8 HWC images whose pixels encode the index (for checking batches are not mixed)."""

    def __init__(self, n: int = 64, shape=(32, 32, 3)):
        self.n, self.shape = n, shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.shape, i % 251, dtype=np.uint8), i


class Growing(Dataset):
    """Samples whose shape changes with the index (every `every` samples), to force regrowth."""

    def __init__(self, n: int = 48, every: int = 16):
        self.n, self.every = n, every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        side = 8 * (1 + i // self.every)
        return torch.full((side, side), float(i)), i


class WorkerReport(Dataset):
    """Returns what the worker knows about itself: info, seeds, and RNG draws."""

    def __init__(self, n: int = 16):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        from pooled_loader import get_worker_info as ours
        mine = ours()
        assert (info is None and mine is None) or (info.id == mine.id and info.seed == mine.seed)
        wid = -1 if info is None else info.id
        seed = -1 if info is None else info.seed
        return {"index": i, "worker": wid, "seed": seed, "pid": os.getpid(),
                "torch_draw": torch.randint(0, 2**30, (1,)).item(),
                "random_draw": random.randint(0, 2**30),
                "numpy_draw": int(np.random.randint(0, 2**30)),
                "num_workers": -1 if info is None else info.num_workers}


class Counting(IterableDataset):
    """Iterable dataset sharded by worker: worker k yields k, k + W, k + 2W, ..."""

    def __init__(self, n: int = 50):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([i]), i


class Failing(Dataset):
    """Raises for the chosen indices."""

    def __init__(self, bad=(5,), n: int = 20):
        self.bad, self.n = set(bad), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i in self.bad:
            raise ValueError(f"sample {i} is broken on purpose")
        return np.full((4,), i, dtype=np.int64)


class Dying(Dataset):
    """Kills its worker at index `at` with `how`: a signal number or ("exit", code)."""

    def __init__(self, how, at: int = 3, n: int = 40):
        self.how, self.at, self.n = how, at, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info() is not None:
            if isinstance(self.how, tuple):
                os._exit(self.how[1])
            os.kill(os.getpid(), self.how)
            time.sleep(5)
        return np.zeros(4, dtype=np.int64)


class Slow(Dataset):
    def __init__(self, delay: float, n: int = 8):
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return i


class Epochs(Dataset):
    """Remembers set_epoch (forwarded by the loader, also to persistent workers)."""

    def __init__(self, n: int = 8):
        self.n, self.epoch = n, -1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.epoch, i


class Big(Dataset):
    """Samples of `mb` megabytes each."""

    def __init__(self, n: int = 8, mb: float = 4.75):
        self.n, self.numel = n, int(mb * 2**20)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.numel, i, dtype=np.uint8)


def list_collate(samples):
    """A custom collate_fn returning numpy arrays and a list of ints."""
    return np.stack([s[0] for s in samples]), [s[1] for s in samples]


class WritesInPlace(Dataset):
    """Implements the zero-copy protocol: writes each sample into the row it is given."""

    def __init__(self, n: int = 24):
        self.n = n
        self.calls = {"into": 0, "getitem": 0}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.calls["getitem"] += 1
        return np.full((4, 4), i, dtype=np.float32), i

    def getitem_into(self, i: int, out):
        image_out, label_out = out
        assert label_out is None and image_out.shape == (4, 4) and image_out.flags.writeable
        self.calls["into"] += 1
        image_out[...] = i
        # an info leaf only the worker process knows: which protocol produced the sample
        return image_out, i


class IntoCounter(WritesInPlace):
    """Reports, in the sample, whether it came through getitem_into."""

    def __getitem__(self, i: int):
        return np.full((4, 4), i, dtype=np.float32), i, "getitem"

    def getitem_into(self, i: int, out):
        image_out = out[0]
        image_out[...] = i
        return image_out, i, "into"
