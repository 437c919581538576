"""The tuner's search space and search (``python -m pooled_loader tune``, pooled_loader.tune).

A ``Setting`` is one point of the space (num_workers, batch_size, prefetch_factor, and pool
slots beyond the batches in flight). The search is written as pure functions: ``measure`` (run
one trial) and ``time_left`` are passed in, so it is tested without a loader.

The search is coordinate descent. Start from num_workers = CPU count, prefetch_factor 2, the
default pool (in-flight batches + 2 slots) and the middle batch size; vary one knob at a time with
the others at the best so far; a change is kept when it is faster by more than ``--tolerance``
(noise on a shared machine), or as fast and cheaper (fewer workers, less pool memory). Passes
repeat while they improve and the budget lasts. Each trial starts a fresh loader (fixed shuffle
seed), runs warm-up batches, then measures images/s over at most ``--max-batches`` batches or its
share of the budget (at least ``--min-batches``). ``pool_slots`` is swept as slots beyond the
batches in flight (``num_workers * prefetch_factor``), so it stays meaningful as the other knobs
move. A winner other than the start is then measured again against the start, in turn
(``--confirm-rounds``, so drift in the machine's load hits both alike), and kept only if the
medians agree. The budget is a target: a started trial finishes, and a winner found late is still
checked once.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable

from ..core.constants import default_pool_slots

__all__ = ["KNOBS", "Setting", "recommended_line", "better", "coordinate_descent", "confirm"]

KNOBS = ("num_workers", "batch_size", "prefetch_factor", "pool_extra")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the search space. ``pool_extra``: pool slots beyond the batches in flight."""

    num_workers: int
    batch_size: int
    prefetch_factor: int
    pool_extra: int

    @property
    def pool_slots(self) -> int:
        """Slots: batches in flight (``num_workers * prefetch_factor``, 1 in-process) + extra."""
        return default_pool_slots(self.num_workers, self.prefetch_factor, self.pool_extra)

    def loader_kwargs(self) -> dict:
        """Keyword arguments for ``PooledLoader`` (besides the dataset)."""
        kw: dict[str, Any] = {"batch_size": self.batch_size, "num_workers": self.num_workers}
        if self.num_workers:
            kw.update(prefetch_factor=self.prefetch_factor, persistent_workers=True)
        kw["pool_slots"] = self.pool_slots
        return kw

    def label(self) -> str:
        return (f"w{self.num_workers} p{self.prefetch_factor} s{self.pool_slots} "
                f"b{self.batch_size}")

    def cost(self) -> tuple[int, int]:
        """What a setting costs (workers, pool memory): the cheaper wins a tie."""
        return self.num_workers, self.pool_slots * self.batch_size


def recommended_line(s: Setting) -> str:
    """The ``PooledLoader(...)`` call to paste for setting ``s``."""
    kw = s.loader_kwargs()
    kw = {"batch_size": kw.pop("batch_size"), "shuffle": True, **kw}
    return "PooledLoader(dataset, " + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"



def better(a: dict, b: dict, tol: float) -> bool:
    """Trial ``a`` beats ``b``: faster beyond the tolerance, or as fast and cheaper."""
    ra, rb = a["images_per_s"], b["images_per_s"]
    if ra > rb * (1 + tol):
        return True
    return ra >= rb * (1 - tol) and a["setting"].cost() < b["setting"].cost()


def coordinate_descent(space: dict[str, list[int]], start: Setting,
                       measure: Callable[[Setting, str], dict], tol: float,
                       time_left: Callable[[dict], bool],
                       trials: dict[Setting, dict] | None = None) -> tuple[list[dict], dict]:
    """Vary one knob at a time from ``start``, keeping the best; repeat while a pass improves
    and ``time_left(best trial so far)``. Returns (every trial in order, the best trial).
    Trials are also recorded in ``trials`` as they finish (what is left if interrupted)."""
    trials = {} if trials is None else trials

    def run(s: Setting, knob: str) -> dict:
        trials[s] = {**measure(s, knob), "setting": s, "knob": knob, "id": len(trials)}
        return trials[s]

    best = run(start, "start")
    improved = True
    while improved and time_left(best):
        improved = False
        for knob in KNOBS:
            for value in space[knob]:
                cand = dataclasses.replace(best["setting"], **{knob: value})
                if cand in trials:
                    continue
                if not time_left(best):
                    break
                trial = run(cand, knob)
                if better(trial, best, tol):
                    best, improved = trial, True
    return list(trials.values()), best


def confirm(first: dict, winner: dict, measure: Callable[[Setting, str], dict], rounds: int,
            tol: float, next_id: int) -> tuple[list[dict], dict, dict[str, list[float]]]:
    """Measure the search's winner and its starting point again, ``rounds`` times each,
    interleaved (so drift in the machine's load hits both alike), and keep the winner only if
    the medians still say it is better. Returns (the new trials, the trial to recommend, every
    images/s figure per setting label)."""
    runs: list[dict] = []
    rates = {t["label"]: [t["images_per_s"]] for t in (first, winner)}
    for _ in range(rounds):
        for t in (first, winner):
            run = {**measure(t["setting"], "confirm"), "setting": t["setting"],
                   "knob": "confirm", "id": next_id + len(runs)}
            runs.append(run)
            rates[t["label"]].append(run["images_per_s"])
    med = {t["label"]: {"images_per_s": statistics.median(rates[t["label"]]),
                        "setting": t["setting"]} for t in (first, winner)}
    keep = better(med[winner["label"]], med[first["label"]], tol)
    return runs, winner if keep else first, rates
