"""Replacing a worker that died or hung, without changing the data (docs/failures.md).

Every batch is a function of its indices and seeds, and the main process knows which tasks each
worker still owed: a new worker, started as the old one was (same id, `worker_init_fn`, seeds),
builds those tasks again into the same slots. For an iterable dataset the new worker first
restores the old one's stream where its last answered batch left it (`Received`), so its next
batches are the ones the old worker would have built.

`Failover` is the loader's count of replacements (kept across epochs: `max_worker_restarts` bounds
a run), and the words of the log line and of the final error.
"""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any

from .messages import Restore, StreamPosition

__all__ = ["Failover", "Received", "Replacement", "cause_of_exit"]

log = logging.getLogger("pooled_loader")


def cause_of_exit(exitcode: int | None) -> str:
    """How a worker process ended, in a few words."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode is None:
        return "closed its pipe"
    return f"exited with code {exitcode}"


@dataclass(frozen=True)
class Replacement:
    """One replaced worker, as the log line and the final error name it."""

    worker_id: int
    pid: int | None
    cause: str  # "killed by SIGKILL", "no progress for 5.0 s (worker_timeout)", ...
    where: str | None  # "sample index 17", "item 40 of its stream"
    reading: str | None  # the file or URL it was reading
    tasks: int  # batches it owed, built again by its replacement

    def describe(self) -> str:
        text = f"worker {self.worker_id} (pid {self.pid}) {self.cause}"
        if self.where:
            text += f" while loading {self.where}"
        if self.reading:
            text += f" reading {self.reading}"
        return text


class Failover:
    """The loader's policy and record: at most `max_restarts` replacements in a run."""

    def __init__(self, max_restarts: int) -> None:
        self.max_restarts = max_restarts
        self.replacements: list[Replacement] = []

    @property
    def enabled(self) -> bool:
        return self.max_restarts > 0

    def allows(self) -> bool:
        return len(self.replacements) < self.max_restarts

    def record(self, r: Replacement, stack: str) -> None:
        self.replacements.append(r)
        text = (f"PooledLoader replaced {r.describe()}; its replacement builds again the "
                f"{r.tasks} batch(es) it owed, from the same indices and seeds "
                f"(replacement {len(self.replacements)} of max_worker_restarts="
                f"{self.max_restarts})")
        log.warning("%s%s", text, f"\n{stack}" if stack else "")

    def history(self) -> str:
        """Every replacement of the run, for the error that ends it."""
        if not self.replacements:
            return ""
        lines = "; ".join(r.describe() for r in self.replacements)
        return (f" PooledLoader had already replaced {len(self.replacements)} worker(s) in this "
                f"run (max_worker_restarts={self.max_restarts}): {lines}.")


@dataclass
class Received:
    """Where one worker's iterable stream stands as of its last *answered* batch (delivered or
    waiting in the main process): what its replacement restores. `snapshot` is the latest
    (dataset state, iterator state) and `items_at_snapshot` the items consumed when it was taken;
    None: the dataset has no state, so its stream cannot be restored."""

    items: int = 0
    snapshot: tuple[Any, Any] | None = None
    items_at_snapshot: int = 0
    ended: bool = False

    @classmethod
    def starting(cls, restore: Restore | None, snapshot: tuple[Any, Any] | None,
                 items: int) -> "Received":
        """At a worker's Started: a mid-epoch restore is where it stands (a dataset may apply
        a loaded state only at its first item); otherwise its state right now."""
        if restore is not None and not restore.new_epoch and (
                restore.dataset_state is not None or restore.iter_state is not None):
            return cls(items=restore.items, snapshot=(restore.dataset_state, restore.iter_state),
                       items_at_snapshot=restore.items - restore.skip)
        return cls(items=items, snapshot=snapshot, items_at_snapshot=items)

    def answered(self, position: StreamPosition | None, ended: bool = False) -> None:
        self.ended = self.ended or ended
        if position is None:
            return
        self.items = position.items
        if position.snapshot is not None:
            self.snapshot, self.items_at_snapshot = position.snapshot, position.items

    @property
    def replayable(self) -> bool:
        """Whether a new worker can stand where this one stands: it has a state, or nothing of
        its stream was consumed yet."""
        return self.snapshot is not None or self.items == 0

    def restore(self) -> Restore | None:
        """The replacement's start: the latest state, then the items consumed since (None: a
        fresh start)."""
        if self.snapshot is None:
            return None
        return Restore(dataset_state=self.snapshot[0], iter_state=self.snapshot[1],
                       items=self.items, skip=self.items - self.items_at_snapshot)
