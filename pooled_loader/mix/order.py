"""The global order of a mix: which source each position of an epoch draws (`pooled_loader.mix`).

Why a counter-based draw: the source at global position ``g`` is a function of (seed, epoch,
``g``) and the weights in force, never of which process asks or of how many draws it made
before: splitmix64 of a key made from (seed, epoch), xor ``g``, gives a uniform 53-bit number that
is compared with the cumulative weights of the sources still drawn. So 0 or N workers, any
prefetch and any number of ranks see the same sequence, and a resume needs a position, not a
generator state.

Every (rank, worker) slot computes the whole sequence (vectorised, a few ns a position), so that
for each of its own positions it knows how many times that source was drawn before it: that
*draw number* ``j`` picks item ``j`` of a map-style source's own order (:func:`source_items`), and
a source's count reaching its length is the exhaustion point every slot agrees on. Sources
without a length here (``None``: iterable sources, split by their own mechanism) are never
exhausted globally; the slot that runs out of its share of one handles it (``mix/dataset.py``).

A slot's share is whole blocks of ``batch`` positions: block ``b = g // batch`` belongs to slot
``b % slots``; the slots of rank ``r`` of ``R`` are ``r + R * worker``, so the loader, which takes
its workers' batches in turn, hands rank ``r`` blocks ``r, r + R, r + 2R, ...`` with any number of
workers. An elastic resume (:func:`rest_after`) replaces "all positions" by the positions no
slot of the earlier rounds passed, dealt in blocks the same way.

Imports: numpy and ``core.seeds`` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ..core.seeds import splitmix64

__all__ = ["Order", "Chunk", "source_items", "rest_after", "share_of", "rest_prefix",
           "rest_index", "rest_length", "rest_entries", "STOPS"]

STOPS = ("first_exhausted", "all_exhausted", "never")
CHUNK = 8192  # positions drawn at a time; aligned to multiples of it, so pure in g
_MASK64 = (1 << 64) - 1
_U53 = float(2 ** -53)


def _mix64(x: np.ndarray) -> np.ndarray:
    """`core.seeds.splitmix64`, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def epoch_key(seed: int, epoch: int, salt: int = 0) -> int:
    """A 64-bit key for (seed, epoch, salt): chained splitmix64, as `core.seeds.sample_seed`."""
    x = splitmix64(seed & _MASK64)
    x = splitmix64(x ^ (epoch & _MASK64))
    return splitmix64(x ^ (salt & _MASK64))


def uniforms(key: int, start: int, stop: int) -> np.ndarray:
    """Uniform numbers in [0, 1) for positions start..stop-1 under `key`."""
    g = np.arange(start, stop, dtype=np.uint64)
    return (_mix64(g ^ np.uint64(key)) >> np.uint64(11)).astype(np.float64) * _U53


@dataclass
class Chunk:
    """Positions ``start .. start + len(src) - 1`` of the epoch: the source each draws and its
    draw number within that source (0 for its first draw of the epoch)."""

    start: int
    src: np.ndarray  # int64 source index
    draw: np.ndarray  # int64 draw number


class Order:
    """An epoch's sequence of sources, chunk by chunk (a pure function of its arguments).

    `sizes[s]`: items of source `s` (None: never exhausted here); `weights(step)`: the weights in
    force at global batch `step` (`g // batch`), one float per source; `limit`: positions in the
    epoch at most (`samples_per_epoch`; required with stop "never")."""

    def __init__(self, *, seed: int, epoch: int, sizes: Sequence[int | None],
                 weights: Callable[[int], tuple], static: bool, stop: str, limit: int | None,
                 batch: int) -> None:
        if stop not in STOPS:
            raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
        if stop == "never" and limit is None:
            raise ValueError('stop="never" cycles the sources for ever: pass samples_per_epoch=')
        self.key = epoch_key(seed, epoch)
        self.sizes, self.weights, self.static = list(sizes), weights, static
        self.stop, self.limit, self.batch = stop, limit, batch
        self.active = np.ones(len(self.sizes), dtype=bool)

    def _segment_end(self, g: int, end: int) -> tuple[int, np.ndarray]:
        """(end of the run of positions from `g` whose weights equal those at `g`, weights)."""
        w = np.asarray(self.weights(g // self.batch), dtype=np.float64)
        if self.static:
            return end, w
        step = g // self.batch + 1
        while step * self.batch < end:
            if tuple(self.weights(step)) != tuple(w):
                return step * self.batch, w
            step += 1
        return end, w

    def chunks(self) -> Iterator[Chunk]:
        """The epoch's chunks, from position 0 to its end."""
        n = len(self.sizes)
        counts = np.zeros(n, dtype=np.int64)
        self.active = active = np.ones(n, dtype=bool)  # False: exhausted (read by mix/dataset.py)
        finite = self.stop != "never"
        sized = [s for s in range(n) if self.sizes[s] is not None and finite]
        g = 0
        while self.limit is None or g < self.limit:
            end = (g // CHUNK + 1) * CHUNK
            if self.limit is not None:
                end = min(end, self.limit)
            end, w = self._segment_end(g, end)
            eff = np.where(active, w, 0.0)
            total = float(eff.sum())
            if total <= 0.0:
                return  # no source with a positive weight is left: the epoch ends
            cum = np.cumsum(eff)
            src = np.searchsorted(cum, uniforms(self.key, g, end) * total, side="right")
            np.minimum(src, n - 1, out=src)
            src = src.astype(np.int64)
            draw = np.empty(len(src), dtype=np.int64)
            cut = len(src)
            for s in range(n):
                mask = src == s
                numbers = counts[s] + np.cumsum(mask)[mask] - 1
                draw[mask] = numbers
                if s in sized:
                    over = np.flatnonzero(numbers >= self.sizes[s])
                    if len(over):
                        cut = min(cut, int(np.flatnonzero(mask)[over[0]]))
            if cut:
                yield Chunk(g, src[:cut], draw[:cut])
                counts += np.bincount(src[:cut], minlength=n)
            g += cut
            if cut < len(src):  # position g draws a source that has no item left
                if self.stop == "first_exhausted":
                    return
                active[src[cut]] = False

    def length(self) -> int:
        """Positions in the epoch (walks the whole order: for elastic plans only)."""
        end = 0
        for chunk in self.chunks():
            end = chunk.start + len(chunk.src)
        return end


def source_items(seed: int, epoch: int, source: int, size: int, draws: np.ndarray,
                 shuffle: bool, cache: dict) -> np.ndarray:
    """The indices in a map-style source of its draw numbers `draws`: its own order, a
    permutation per (seed, epoch, source, pass) when `shuffle`, else 0..size-1; pass
    `draw // size` (stop "never" reads a source again, in a new order). `cache` keeps one
    permutation per source."""
    cycles, k = np.divmod(draws, size)
    if not shuffle:
        return k
    out = np.empty(len(draws), dtype=np.int64)
    for cycle in np.unique(cycles).tolist():
        got = cache.get(source)
        if got is None or got[0] != cycle:
            key = epoch_key(seed, epoch, ((source + 1) << 32) + cycle)
            perm = np.random.Generator(np.random.Philox(key=key)).permutation(size)
            got = cache[source] = (cycle, perm)
        mask = cycles == cycle
        out[mask] = got[1][k[mask]]
    return out


def share_of(positions: np.ndarray, slot: int, slots: int, batch: int) -> np.ndarray:
    """The entries of `positions` (an ordered list of global positions) that slot `slot` of
    `slots` owns: whole blocks of `batch` entries, dealt in turn."""
    idx = np.arange(len(positions), dtype=np.int64)
    return positions[(idx // batch) % slots == slot]


def rest_after(length: int, rounds: Sequence[dict]) -> np.ndarray:
    """The positions of an epoch of `length` that no slot of `rounds` passed, in order. Round
    ``{"slots": S, "batch": B, "passed": {slot: p}}``: slot k of S passed the first p entries of
    its share (blocks of B) of what the rounds before left."""
    rest = np.arange(length, dtype=np.int64)
    for round_ in rounds:
        slots, batch = round_["slots"], round_["batch"]
        passed = np.zeros(slots, dtype=np.int64)
        for slot, p in round_["passed"].items():
            passed[int(slot)] = p
        idx = np.arange(len(rest), dtype=np.int64)
        block = idx // batch
        owner = block % slots
        share_pos = (block // slots) * batch + idx % batch
        rest = rest[share_pos >= passed[owner]]
    return rest


def rest_prefix(rounds: Sequence[dict]) -> tuple[np.ndarray, int]:
    """(the rest below `bound`, `bound`): every position at or above `bound` is in the rest
    (no slot of `rounds` passed it), so an epoch without a known end (an iterable source) can be
    dealt lazily. A round's slots passed entries of its rest below (blocks passed + 1) x batch x
    slots, and each round's rest below a value lies within the earlier rounds' bounds."""
    bound = 0
    for round_ in rounds:
        most = max((int(p) for p in round_["passed"].values()), default=0)
        bound += (-(-most // round_["batch"]) + 1) * round_["batch"] * round_["slots"]
    return rest_after(bound, rounds), bound


def rest_index(g: np.ndarray, rest: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray]:
    """(index in the rest, whether in the rest) of positions `g`."""
    if not bound:
        return g, np.ones(len(g), dtype=bool)
    idx = len(rest) + g - bound
    alive = np.ones(len(g), dtype=bool)
    low = g < bound
    if low.any():
        at = np.searchsorted(rest, g[low])
        idx[low] = at
        alive[low] = rest[np.minimum(at, max(len(rest) - 1, 0))] == g[low] if len(rest) else False
    return idx, alive


def rest_length(length: int, rest: np.ndarray, bound: int) -> int:
    """Entries of the rest of an epoch of `length` positions."""
    if length <= bound:
        return int(np.searchsorted(rest, length))
    return len(rest) + length - bound


def rest_entries(idx: np.ndarray, rest: np.ndarray, bound: int) -> np.ndarray:
    """The positions at indices `idx` of the rest."""
    out = idx - len(rest) + bound
    low = idx < len(rest)
    out[low] = rest[idx[low]]
    return out
