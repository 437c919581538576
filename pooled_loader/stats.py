"""Where the time goes: the counters a loader shares with its iterators, and the figures and
verdict that ``PooledLoader.stats()`` and ``report()`` make of them.

Iterators count (batches, samples, bytes, seconds waited for data and spent in the training
loop, each worker's busy seconds); the loader adds the pool's own figures. The verdict compares
the share of time the training loop waited with ``constants.BOTTLENECK_WAIT_SHARE``.
"""
from __future__ import annotations

import collections
import logging
import time

from .constants import BOTTLENECK_WAIT_SHARE

log = logging.getLogger("pooled_loader")


class LoaderStats:
    """Where the time goes and what moved, shared by the loader and its iterators."""

    def __init__(self) -> None:
        self.skipped_seen: set = set()
        self.reset()

    def reset(self) -> None:
        self.counters: collections.Counter = collections.Counter()
        self.worker_busy_s: collections.Counter = collections.Counter()
        self.started = time.perf_counter()

    def record_skips(self, skipped: list) -> None:
        for index, reason in skipped:
            self.counters["skipped"] += 1
            if index not in self.skipped_seen:
                self.skipped_seen.add(index)
                log.warning("PooledLoader skipped sample %r: %s", index, reason)

    def snapshot(self, pool: dict) -> dict:
        """The figures of ``PooledLoader.stats()``, given the pool's own (``SlotPool.stats()``)."""
        c = self.counters
        elapsed = time.perf_counter() - self.started
        busy = dict(self.worker_busy_s)
        return {
            **pool,
            "batches": c["batches"], "samples": c["samples"], "bytes_moved": c["bytes"],
            "skipped": c["skipped"], "wait_s": c["wait_s"], "consumer_s": c["consumer_s"],
            "worker_busy_s": busy,
            "worker_busy_fraction": {w: b / elapsed for w, b in busy.items()} if elapsed else {},
            "elapsed_s": elapsed,
        }


def report_text(s: dict) -> str:
    """The paragraph of ``PooledLoader.report()`` for the figures ``s`` of ``stats()``:
    whether the loader or the training step is the bottleneck."""
    wait_s, consumer_s = s["wait_s"], s["consumer_s"]
    total = wait_s + consumer_s
    if not s["batches"] or total <= 0:
        return "PooledLoader: no batches yet."
    share = wait_s / total
    verdict = ("the LOADER is the bottleneck: the training loop waited for data "
               f"{share:.0%} of the time; add workers, use a cache, or lighten the transform"
               if share > BOTTLENECK_WAIT_SHARE else
               f"the TRAINING STEP is the bottleneck: it waited for data only {share:.0%} "
               "of the time; the loader keeps up")
    busy = ", ".join(f"worker {w}: {f:.0%}" for w, f in
                     sorted(s["worker_busy_fraction"].items()))
    return (f"PooledLoader: {s['batches']} batches, {s['samples']} samples, "
            f"{s['bytes_moved'] / 1e9:.2f} GB; waited {wait_s:.2f}s, the loop ran "
            f"{consumer_s:.2f}s: {verdict}. Worker busy: {busy or 'n/a'}. Pool: "
            f"{s.get('slots')} slots, {s.get('slots_in_use')} in use, grown "
            f"{s.get('grown')} times; skipped samples: {s['skipped']}.")
