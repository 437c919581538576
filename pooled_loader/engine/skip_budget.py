"""The error budget of ``on_error="skip"``: past it the loader raises instead of skipping on.

Two bounds (docs/failures.md): `max_skip_fraction` of an epoch's samples, judged once more than
FLOOR loads failed (counted in the main process over every worker: `EpochSkips`), and
`max_consecutive_skips` samples in a row whose own
load failed (counted where the order is known, in the worker that loads them: `SkipRun`). Both
name the last skipped samples and their errors.
"""
from __future__ import annotations

import collections
from typing import Any

from ..core.errors import SkipBudgetExceeded

__all__ = ["EpochSkips", "SkipRun", "DEFAULT_MAX_SKIP_FRACTION", "DEFAULT_MAX_CONSECUTIVE_SKIPS"]

DEFAULT_MAX_SKIP_FRACTION = 0.1
DEFAULT_MAX_CONSECUTIVE_SKIPS = 32
LAST_NAMED = 5  # skipped samples named in the error
# skips before the fraction is judged: a handful of bad files in a small epoch is no evidence of
# a systematic failure (and the first skips of an epoch of unknown length are no fraction yet)
FLOOR = 32

_FIX = ("Fix the data (or the mount/URL it comes from), or raise the budget: "
        "PooledLoader(max_skip_fraction=..., max_consecutive_skips=...; None: no bound).")


def _named(last: Any) -> str:
    return "; ".join(f"{index!r}: {reason}" for index, reason in last)


class EpochSkips:
    """Main side: the epoch's skipped loads against `fraction` of its samples (`epoch_samples`,
    or the samples seen so far when the epoch's length is unknown)."""

    def __init__(self, fraction: float | None, epoch_samples: int | None) -> None:
        self.fraction, self.epoch_samples = fraction, epoch_samples
        self.skipped = 0
        self.seen = 0
        self.last: collections.deque = collections.deque(maxlen=LAST_NAMED)

    def add(self, skipped: list, samples: int) -> None:
        """A batch of `samples` was delivered, `skipped` loads failed building it."""
        self.seen += samples
        if not skipped:
            return
        self.skipped += len(skipped)
        self.last.extend(skipped[-LAST_NAMED:])
        if self.fraction is None:
            return
        if self.epoch_samples:
            total, of = self.epoch_samples, f"{self.epoch_samples} samples of the epoch"
        else:
            total = self.seen + self.skipped
            of = f"{total} samples loaded so far"
        if self.skipped > FLOOR and self.skipped > self.fraction * total:
            raise SkipBudgetExceeded(
                f"PooledLoader: on_error='skip' skipped {self.skipped} sample loads this epoch, "
                f"more than max_skip_fraction={self.fraction} of {of}. The last ones: "
                f"{_named(self.last)}. {_FIX}")


class SkipRun:
    """Worker side: samples in a row whose own load failed (a replacement that loads does not end
    the run; a sample loaded at its first try does)."""

    def __init__(self, bound: int | None) -> None:
        self.bound = bound
        self.length = 0
        self.last: collections.deque = collections.deque(maxlen=LAST_NAMED)

    def failed(self, index: Any, reason: str) -> None:
        self.length += 1
        self.last.append((index, reason))
        if self.bound is not None and self.length > self.bound:
            raise SkipBudgetExceeded(
                f"PooledLoader: on_error='skip' skipped {self.length} samples in a row, more than "
                f"max_consecutive_skips={self.bound}. The last ones: {_named(self.last)}. {_FIX}")
