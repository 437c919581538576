"""Length-aware samplers for ragged data: little padding, batches that fit a token budget.

- `LengthGroupedSampler(lengths, batch_size)`: a sampler (pass it as `sampler=` with the same
  `batch_size`). Each epoch's shuffled order is cut into *mega-batches* of `mega_batch_mult *
  batch_size` samples, each sorted by length, longest first, so the samples of one batch have
  similar lengths and padding stays small; with `shuffle`, the batches inside a mega-batch are
  shuffled too.
- `TokenBudgetBatchSampler(lengths, max_tokens)`: a batch sampler (pass it as `batch_sampler=`).
  Samples are taken in the same length-sorted mega-batch order and each batch holds as many as
  fit `max_tokens`, counted after padding (`longest * count`) or, with `packing=True`, after
  packing (the sum of lengths); the batches' order is shuffled.

Both take `lengths` as a precomputed sequence or array, or as a sample count with a cheap
`len_fn(index)`, and never load a sample. They are distributed-aware like `DistributedSampler`
(`num_replicas`/`rank` default to torch.distributed's, or RANK/WORLD_SIZE; `set_epoch`; every
rank gets the same number of batches, padded by repetition unless `drop_last`), seeded per
epoch from (`seed`, epoch), and resumable: `state_dict()` is {"epoch", "seed", "yielded"} and
`load_state_dict` makes the next pass continue after the yielded items.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from ..core.ranks import rank_and_world
from ..core.state_checks import SEED_RANGE, StateChecks

__all__ = ["LengthGroupedSampler", "TokenBudgetBatchSampler"]

DEFAULT_MEGA_BATCH_MULT = 50
"""Batches per mega-batch (HF transformers' LengthGroupedSampler uses 50): a sorted mega-batch
holds runs of near-equal lengths while the epoch stays shuffled. Larger values pad less and
shuffle less: for log-normal lengths (16-4096) in batches of 32, padding is about 17% with 50,
6% with 200 and 3% with 400 (tests/test_samplers.py); a token budget pads about 3% at 50."""


def _lengths_array(lengths: Sequence[int] | np.ndarray | int,
                   len_fn: Callable[[int], int] | None) -> np.ndarray:
    if len_fn is not None:
        if not isinstance(lengths, (int, np.integer)) or lengths < 0:
            raise TypeError("with len_fn=, pass the number of samples as lengths (an int), e.g. "
                            "LengthGroupedSampler(len(dataset), 32, len_fn=dataset.length)")
        out = np.fromiter((len_fn(i) for i in range(int(lengths))), dtype=np.int64,
                          count=int(lengths))
    else:
        try:
            out = np.asarray(lengths)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"lengths must be a sequence of ints: {exc}") from None
        if out.ndim != 1 or (out.size and out.dtype.kind not in "iu"):
            raise TypeError(f"lengths must be a 1-D sequence of ints, got an array of shape "
                            f"{out.shape} and dtype {out.dtype}")
        out = out.astype(np.int64, copy=False)
    if out.size and out.min() < 0:
        raise ValueError(f"lengths must not be negative: sample {int(np.argmin(out))} has "
                         f"length {int(out.min())}")
    return out


class _LengthOrder:
    """Lengths, ranks, epoch and the resumable position shared by both samplers."""

    def __init__(self, lengths, len_fn, shuffle: bool, seed: int, num_replicas: int | None,
                 rank: int | None, drop_last: bool, mega_batch_mult: int):
        self.lengths = _lengths_array(lengths, len_fn)
        if num_replicas is None or rank is None:
            env_rank, env_world = rank_and_world()
            num_replicas = env_world if num_replicas is None else num_replicas
            rank = env_rank if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas={num_replicas}; rank should "
                             f"be in the interval [0, {num_replicas - 1}]")
        if mega_batch_mult < 1:
            raise ValueError(f"mega_batch_mult must be at least 1, not {mega_batch_mult}")
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.mega_batch_mult = int(mega_batch_mult)
        self.epoch = 0
        self._yielded = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass shuffles for (call it before each epoch, as with
        DistributedSampler)."""
        self.epoch = int(epoch)

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch])

    def _sorted_mega_batches(self, order: np.ndarray, chunk: int) -> np.ndarray:
        """`order` with each run of `chunk` indices sorted by length, longest first (stable)."""
        out = order.copy()
        for start in range(0, len(order), chunk):
            piece = order[start:start + chunk]
            out[start:start + chunk] = piece[np.argsort(-self.lengths[piece], kind="stable")]
        return out

    def _deal(self, items: list, world: int) -> list:
        """Every rank's share of `items`, striding like DistributedSampler: padded by repeating
        from the start (or cut with drop_last) to a multiple of `world`."""
        if self.drop_last:
            items = items[:len(items) - len(items) % world]
        elif items and len(items) % world:
            extra = world - len(items) % world
            items = items + (items * (extra // len(items) + 1))[:extra]
        return items[self.rank::world]

    def _items(self) -> list:
        raise NotImplementedError

    def __iter__(self) -> Iterator:
        items = self._items()
        skip, self._skip = self._skip, 0
        self._yielded = skip
        for item in items[skip:]:
            self._yielded += 1
            yield item

    def state_dict(self) -> dict:
        """The current pass: its epoch and seed, and how many items it has given."""
        return {"epoch": self.epoch, "seed": self.seed, "yielded": self._yielded,
                "num_samples": int(len(self.lengths))}

    def _pass_len(self, epoch: int, seed: int) -> int:
        """Items of the pass of (`epoch`, `seed`)."""
        return len(self)

    def check_state_dict(self, state: Any, checks: StateChecks | None = None) -> None:
        """Raise ValueError naming the key unless `state` is a pass of this sampler (`checks`:
        how to name the keys, e.g. under the loader's state)."""
        name = type(self).__name__
        c = checks or StateChecks(f"{name}.load_state_dict: the state")
        if not isinstance(state, dict) or not {"epoch", "seed", "yielded"} <= set(state):
            raise ValueError(f"{c.where}: expected a dict with epoch, seed and yielded, got "
                             f"{state!r:.200}")
        n = len(self.lengths)
        if state.get("num_samples", n) != n:
            raise ValueError(f"{c.where} is for {state['num_samples']!r:.40} samples, this "
                             f"sampler has {n}")
        epoch = c.count_value(state["epoch"], "epoch", SEED_RANGE[1])
        seed = c.count_value(state["seed"], "seed", SEED_RANGE[1])  # numpy seeds are >= 0
        c.count_value(state["yielded"], "yielded", self._pass_len(epoch, seed),
                      " (the items of that epoch's pass)")

    def load_state_dict(self, state: dict) -> None:
        """The next pass continues the saved one, after the items it had given."""
        self.check_state_dict(state)
        self.epoch, self.seed = state["epoch"], state["seed"]
        self._skip = self._yielded = state["yielded"]


class LengthGroupedSampler(_LengthOrder, Sampler[int]):
    """Indices in length-sorted mega-batches (see the module docstring); use with the same
    `batch_size` in the loader."""

    def __init__(self, lengths: Sequence[int] | np.ndarray | int, batch_size: int,
                 shuffle: bool = True, seed: int = 0, *, len_fn: Callable[[int], int] | None = None,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False, mega_batch_mult: int = DEFAULT_MEGA_BATCH_MULT):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        super().__init__(lengths, len_fn, shuffle, seed, num_replicas, rank, drop_last,
                         mega_batch_mult)
        self.batch_size = int(batch_size)

    def __len__(self) -> int:
        n, world = len(self.lengths), self.num_replicas
        return n // world if self.drop_last else -(-n // world)

    def _items(self) -> list:
        rng = self._rng()
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        mine = np.asarray(self._deal(order.tolist(), self.num_replicas), dtype=np.int64)
        chunk = self.batch_size * self.mega_batch_mult
        grouped = self._sorted_mega_batches(mine, chunk)
        if self.shuffle:  # batches inside each mega-batch in random order; they stay whole
            batches = [grouped[i:i + self.batch_size] for i in range(0, len(grouped),
                                                                      self.batch_size)]
            per_mega = self.mega_batch_mult
            for start in range(0, len(batches), per_mega):
                full = [b for b in batches[start:start + per_mega] if len(b) == self.batch_size]
                rng.shuffle(full)
                batches[start:start + len(full)] = full
            grouped = np.concatenate(batches) if batches else grouped
        return grouped.tolist()


class TokenBudgetBatchSampler(_LengthOrder, Sampler[list]):
    """Batches of as many samples as fit `max_tokens` (see the module docstring)."""

    def __init__(self, lengths: Sequence[int] | np.ndarray | int, max_tokens: int,
                 shuffle: bool = True, seed: int = 0, *, len_fn: Callable[[int], int] | None = None,
                 packing: bool = False, max_batch_size: int | None = None,
                 num_replicas: int | None = None, rank: int | None = None,
                 drop_last: bool = False, mega_batch_mult: int = DEFAULT_MEGA_BATCH_MULT):
        super().__init__(lengths, len_fn, shuffle, seed, num_replicas, rank, drop_last,
                         mega_batch_mult)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
        too_long = np.flatnonzero(self.lengths > max_tokens)
        if too_long.size:
            raise ValueError(
                f"TokenBudgetBatchSampler: {too_long.size} samples are longer than max_tokens="
                f"{max_tokens} (sample {int(too_long[0])} has {int(self.lengths[too_long[0]])} "
                "tokens); raise max_tokens, or cut or drop those samples in the dataset")
        self.max_tokens, self.packing = int(max_tokens), bool(packing)
        self.max_batch_size = max_batch_size
        # mega-batches of about mega_batch_mult batches of typical samples
        typical = max(1, int(np.median(self.lengths))) if self.lengths.size else 1
        self._chunk = self.mega_batch_mult * max(1, self.max_tokens // typical)
        self._cache: tuple[int, int, list] | None = None

    def _batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch (computed once per epoch and seed)."""
        if self._cache is not None and self._cache[:2] == (self.epoch, self.seed):
            return self._cache[2]
        rng = self._rng()
        n = len(self.lengths)
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        # every rank groups the same global order, then takes its share of whole batches
        grouped = self._sorted_mega_batches(order, self._chunk).tolist()
        batches, batch, longest, total = [], [], 0, 0
        cap = self.max_batch_size or n or 1
        for index in grouped:
            length = int(self.lengths[index])
            new_longest, new_total = max(longest, length), total + length
            cost = new_total if self.packing else new_longest * (len(batch) + 1)
            if batch and (cost > self.max_tokens or len(batch) >= cap):
                batches.append(batch)
                batch, new_longest, new_total = [], length, length
            batch.append(index)
            longest, total = new_longest, new_total
        if batch:
            batches.append(batch)
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        mine = self._deal(batches, self.num_replicas)
        self._cache = (self.epoch, self.seed, mine)
        return mine

    def __len__(self) -> int:
        return len(self._batches())

    def _pass_len(self, epoch: int, seed: int) -> int:
        kept = self.epoch, self.seed
        self.epoch, self.seed = epoch, seed
        try:
            return len(self._batches())
        finally:
            self.epoch, self.seed = kept

    def _items(self) -> list:
        return self._batches()
