"""Replacing a worker that died or hung, without changing the data (docs/failures.md).

Every batch is a function of its indices and seeds, and the main process knows which tasks each
worker still owed: a new worker, started as the old one was (same id, `worker_init_fn`, seeds),
builds those tasks again into the same slots. For an iterable dataset the new worker first
restores the old one's stream where its last answered batch left it (`worker_iter` follows each
worker's stream as `position.WorkerStream`, as of its answers), so its next batches are the ones
the old worker would have built.

`Failover` is the loader's count of replacements (kept across epochs: `max_worker_restarts` bounds
a run), and the words of the log line and of the final error.
"""
from __future__ import annotations

import logging
import signal
from dataclasses import dataclass

from .processes import describe_exit

__all__ = ["Failover", "Replacement", "cause_of_exit"]

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

    def lost_message(self, r: Replacement, exitcode: int | None, hung_s: float | None,
                     worker_timeout: float, stack: str, unreplayable: bool) -> str:
        """The error of a worker that is not replaced (logging its stack)."""
        if hung_s is None:
            text = describe_exit(r.worker_id, r.pid, exitcode)
        else:
            text = (f"PooledLoader worker {r.worker_id} (pid {r.pid}) made no progress on its "
                    f"batch for {hung_s:.1f} s (worker_timeout={worker_timeout}) and was "
                    "killed.")
        if r.where or r.reading:
            text += f" It was loading {r.where or 'a batch'}"
            text += f", reading {r.reading}." if r.reading else "."
        if unreplayable:
            text += (" It cannot be replaced: its IterableDataset has no state_dict(), so a new "
                     "worker cannot resume its stream where it stood (give the dataset "
                     "state_dict/load_state_dict, or use pooled_loader.webdataset).")
        elif not self.enabled:
            text += (" Pass max_worker_restarts=N to replace a dead or hung worker and go on "
                     "with the same batches.")
        text += self.history()
        if stack:
            log.warning("PooledLoader worker %d's stack:\n%s", r.worker_id, stack)
            text += f"\nIts stack (faulthandler):\n{stack}"
        return text

    def history(self) -> str:
        """Every replacement of the run, for the error that ends it."""
        if not self.replacements:
            return ""
        lines = "; ".join(r.describe() for r in self.replacements)
        return (f" PooledLoader had already replaced {len(self.replacements)} worker(s) in this "
                f"run (max_worker_restarts={self.max_restarts}): {lines}.")
