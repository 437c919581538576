"""Per-stage timings inside the process that builds batches (a worker, or the main process with
``num_workers=0``): always on, a few ``perf_counter_ns`` calls per sample.

``CLOCK`` is this process's one ``StageClock``. ``engine.worker.BatchMaker`` times the dataset's
``__getitem__`` (or ``next()`` of an iterable dataset), writing rows into the slot ("collate")
and waiting for a bigger slot ("slot_wait"; "slot_sizing" the first time, when the pool sizes
its slots from the first batch); ``vision.compose.Compose`` times each of its stages
("decode", "crop_resize", "flip", ...) with ``CLOCK.add``. Those ops run *inside* ``__getitem__``,
so ``BatchMaker`` books ``getitem`` as its time minus theirs (``nested_ns``): the stages of a batch
do not overlap and add up to the worker's busy time.

A batch's figures travel to the main process on its ``engine.messages.Done`` (``stages``:
seconds per stage; ``spans`` only while a trace is recorded, see ``trace.py``): no extra messages.
"""
from __future__ import annotations

import collections
from time import perf_counter_ns
from typing import Any, Callable

from ..core.constants import FIRST_SLOT_BYTES

__all__ = ["CLOCK", "StageClock", "perf_counter_ns"]

Span = tuple  # (stage, start_ns, duration_ns, sample index or None)


class StageClock:
    """Accumulates the nanoseconds of named stages for the batch being built, and, while
    ``spans`` is a list (tracing), one span per timed piece of work."""

    def __init__(self) -> None:
        self.ns: collections.Counter = collections.Counter()  # stage -> ns, this batch
        self.nested_ns = 0  # booked by ops that run inside __getitem__ (Compose), this batch
        self.slot_ns = 0  # spent asking the main process for a bigger slot, this batch
        self.spans: list[Span] | None = None

    def begin(self, trace: bool) -> None:
        """Start a batch: empty accumulators; record spans if ``trace``."""
        self.ns.clear()
        self.nested_ns = self.slot_ns = 0
        self.spans = [] if trace else None

    def add(self, stage: str, start_ns: int, end_ns: int) -> int:
        """Book ``stage`` from ``start_ns`` to ``end_ns`` as work nested inside the dataset's
        ``__getitem__`` (a vision op); returns ``end_ns`` so calls can chain."""
        d = end_ns - start_ns
        self.ns[stage] += d
        self.nested_ns += d
        if self.spans is not None:
            self.spans.append((stage, start_ns, d, None))
        return end_ns

    def book(self, stage: str, start_ns: int, end_ns: int, index: Any = None) -> None:
        """Book ``stage`` (work of the batch maker itself, not nested in another stage)."""
        self.ns[stage] += end_ns - start_ns
        if self.spans is not None:
            self.spans.append((stage, start_ns, end_ns - start_ns, index))

    def fetched(self, start_ns: int, end_ns: int, index: Any) -> int:
        """One sample fetched from the dataset in ``[start_ns, end_ns)``: its span when tracing;
        returns the nanoseconds, which the caller adds to the batch's ``getitem`` time."""
        if self.spans is not None:
            self.spans.append(("getitem", start_ns, end_ns - start_ns, index))
        return end_ns - start_ns

    def timing(self, stage: str) -> "_Timing":
        """``with CLOCK.timing(stage):`` books the block's time as ``stage`` (less any slot
        request inside it)."""
        return _Timing(self, stage)

    def slot_requests(self, request_slot: Callable) -> Callable:
        """``request_slot(task_id, nbytes, old)``, each call booked as "slot_wait", or as
        "slot_sizing" when ``old`` is a first, page-sized slot (the pool sizing its slots from
        the first batch: once per worker, not a sign of trouble)."""
        def call(task_id: int, nbytes: int, old: Any) -> Any:
            start = perf_counter_ns()
            try:
                return request_slot(task_id, nbytes, old)
            finally:
                end = perf_counter_ns()
                self.slot_ns += end - start
                sizing = old.nbytes <= FIRST_SLOT_BYTES
                self.book("slot_sizing" if sizing else "slot_wait", start, end)
        return call

    def collating(self) -> "Collating":
        """The timer of one default collate, starting now
        (``engine.slot_collate.SlotCollate._collate``)."""
        return Collating(self)

    def finish(self, getitem_ns: int, start_ns: int,
               task_id: int) -> tuple[dict[str, float], list[Span] | None]:
        """End the batch begun at ``start_ns``: seconds per stage (``getitem`` = ``getitem_ns``
        less the nested ops) and the spans recorded, with the batch's own (None when not
        tracing)."""
        ns = self.ns
        if getitem_ns:
            ns["getitem"] += max(0, getitem_ns - self.nested_ns)
        stages = {k: v * 1e-9 for k, v in ns.items() if v}
        spans, self.spans = self.spans, None
        if spans is not None:
            spans.append(("batch", start_ns, perf_counter_ns() - start_ns, task_id))
        return stages, spans


class _Timing:
    """`StageClock.timing`'s context manager (a class: a generator-based one costs ~2 us a
    batch, a tenth of DataLoader's whole in-process overhead)."""

    __slots__ = ("clock", "stage", "slot0", "start")

    def __init__(self, clock: StageClock, stage: str) -> None:
        self.clock, self.stage = clock, stage

    def __enter__(self) -> None:
        self.slot0 = self.clock.slot_ns
        self.start = perf_counter_ns()

    def __exit__(self, *exc: Any) -> None:
        end = perf_counter_ns()
        self.clock.book(self.stage, self.start, end - (self.clock.slot_ns - self.slot0))


class Collating:
    """Default collate fetches a sample, writes its row, fetches the next, ...: the time between
    fetches is collate's (rows written, structure checked), so two clock reads per sample time
    both stages. ``fetch_ns`` is added to by the caller (inlined: it runs per sample)."""

    def __init__(self, clock: StageClock) -> None:
        self.clock = clock
        self.spans = clock.spans
        self.slot0 = clock.slot_ns
        self.fetch_ns = 0
        self.start = self.last = perf_counter_ns()

    def span(self, start_ns: int, end_ns: int, index: Any) -> None:
        """Tracing: the collate work since the last fetch, then this sample's fetch."""
        self.spans.append(("collate", self.last, start_ns - self.last, None))
        self.spans.append(("getitem", start_ns, end_ns - start_ns, index))
        self.last = end_ns

    def done(self) -> int:
        """Book the collate time (all but the fetches and any slot request); returns the
        fetches' nanoseconds, for the batch's ``getitem`` time."""
        end = perf_counter_ns()
        clock = self.clock
        slot_ns = clock.slot_ns - self.slot0
        clock.ns["collate"] += max(0, end - self.start - self.fetch_ns - slot_ns)
        if self.spans is not None:
            self.spans.append(("collate", self.last, end - self.last, None))
        return self.fetch_ns


CLOCK = StageClock()
