"""Slot size classes: which slot size a batch of some bytes gets, and which size the pool hands
out before a batch is built.

Batches of ragged samples vary in bytes. If every slot grew to the largest batch ever seen, one
huge batch would multiply the whole pool's memory. Instead a slot's size is one of a few *size
classes*: powers of two above `SIZE_CLASS_FLOOR`, each doubling split in `CLASS_STEPS` steps, so a
slot wastes under 19% of its bytes (less than the 25% headroom slots had before classes). The
pool (`pool.SlotPool`) keeps arenas of several classes side by side.

A task's slot is chosen before its batch is built, so the pool hands out slots of the *typical*
class: the class of the `TYPICAL_QUANTILE` of the last `RECENT_BATCHES` batches' sizes
(`TypicalSize`). A batch above it asks for a bigger slot (a `NeedSlot` round trip) and gets one
of a small arena of its own class, so a rare huge batch costs a few slots of its size, not a
pool of them. The typical class never goes down: a pool does not shrink and regrow as sizes
fluctuate around a class boundary (which would allocate after warm-up).
"""
from __future__ import annotations

import collections
import math
import mmap

from ..core.constants import round_up

SIZE_CLASS_FLOOR = 1 << 16
"""Bytes. The smallest size class (64 KiB): below it a whole pool of slots is a few MiB, so finer
classes would save nothing worth an extra arena."""

CLASS_STEPS = 4
"""Classes per doubling of size: 2**(1/4) apart, so the class of a batch is less than 1.19x its
bytes."""

RECENT_BATCHES = 64
"""Batches. How many recent batch sizes the typical class is taken from: enough for a stable
quantile, few enough to follow a change of batch size within an epoch's first steps."""

TYPICAL_QUANTILE = 0.9
"""Fraction. The share of recent batches the typical class must hold: the rest (rare long
batches) ask for a bigger slot of their own, so they do not grow every slot."""


def size_class(nbytes: int) -> int:
    """The slot size (page-aligned bytes) of the smallest class holding `nbytes`."""
    if nbytes <= SIZE_CLASS_FLOOR:
        return SIZE_CLASS_FLOOR
    step = max(0, math.ceil(CLASS_STEPS * math.log2(nbytes / SIZE_CLASS_FLOOR)) - 1)
    while True:
        size = round_up(math.ceil(SIZE_CLASS_FLOOR * 2 ** (step / CLASS_STEPS)), mmap.PAGESIZE)
        if size >= nbytes:
            return size
        step += 1


class TypicalSize:
    """The typical class of the recent batches (0 until one is seen); it only grows."""

    def __init__(self) -> None:
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        self.bytes = 0

    @property
    def seen(self) -> bool:
        return bool(self._recent)

    def add(self, nbytes: int) -> int:
        """Record a batch's size; the typical class of the recent batches (for `raise_to`)."""
        self._recent.append(nbytes)
        ordered = sorted(self._recent)
        return size_class(ordered[int(TYPICAL_QUANTILE * (len(ordered) - 1))])

    def raise_to(self, nbytes: int) -> bool:
        """The typical class becomes `nbytes` if that is larger; True when it grew."""
        if nbytes <= self.bytes:
            return False
        self.bytes = nbytes
        return True
