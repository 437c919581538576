"""Trace files: where each batch's time went, as Chrome trace events (open the file in
https://ui.perfetto.dev or chrome://tracing).

``PooledLoader(..., trace="run.trace.json")`` keeps the last ``trace_batches`` batches in a ring
and (re)writes the file at the end of every epoch and at ``close()``;
``loader.trace(path, batches=N)`` records the next N batches and writes ``path`` once they are
delivered (or at the epoch's end, or ``close()``, if that comes first).

While a trace is recorded, each ``engine.messages.Task`` asks its worker for spans, which come back
on the batch's ``Done`` (see ``stages.py``): the worker's "batch" span and, inside it, per sample,
"getitem" (with the vision ops it ran nested in it: "decode", "crop_resize", ...) and "collate";
"slot_wait" when it waited for a bigger slot. The main process adds "wait" (the training loop
waiting for a batch), "step" (the loop's time between batches) and "h2d" (copies to the GPU). Every
process reads the same monotonic clock (``perf_counter_ns``), so the tracks line up.

Layout of the file: one process ("pooled_loader"), one thread track per worker ("worker k",
tid k + 1) and one for the main process ("main", tid 0); spans are complete events (``"ph":
"X"``, microseconds from the first span). Size is bounded by the ring: at most ``batches``
batches of spans, i.e. about ``batches * batch_size * 3`` events.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
from typing import Any

from ..core.safe_open import create_exclusive

DEFAULT_TRACE_BATCHES = 64
"""Batches. The ring of ``PooledLoader(trace=...)``: at batch size 256 about 50,000 events,
a few MB of JSON, which Perfetto opens instantly."""

MAIN_SPANS_PER_BATCH = 3  # wait, step, h2d


class TraceRecorder:
    """The ring of the last ``batches`` batches' spans, and the writer of the trace file."""

    def __init__(self, path: str | os.PathLike, batches: int = DEFAULT_TRACE_BATCHES,
                 limit: int | None = None) -> None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"trace batches must be a positive integer, got {batches!r}")
        self.path = os.fspath(path)
        self.batches: collections.deque = collections.deque(maxlen=batches)  # (track, spans)
        self.main: collections.deque = collections.deque(maxlen=batches * MAIN_SPANS_PER_BATCH)
        self.remaining = limit  # loader.trace(): batches still to record; None: keep going

    @property
    def active(self) -> bool:
        """Whether batches dispatched now should record spans."""
        return self.remaining is None or self.remaining > 0

    def add_batch(self, track: int, spans: list | None) -> None:
        """A delivered batch's spans, built on ``track`` (0: main, k + 1: worker k)."""
        if spans is None or not self.active:
            return
        self.batches.append((track, spans))
        if self.remaining is not None:
            self.remaining -= 1
            if self.remaining == 0:
                self.write()

    def add_main(self, name: str, start_s: float, end_s: float) -> None:
        """A span of the main process, from ``time.perf_counter()`` readings."""
        if self.active and end_s > start_s:
            self.main.append((name, int(start_s * 1e9), int((end_s - start_s) * 1e9), None))

    def events(self) -> list[dict]:
        """The trace events, with metadata naming the process and each track."""
        tracks: dict[int, list] = collections.defaultdict(list)
        for track, spans in self.batches:
            tracks[track].extend(spans)
        tracks[0].extend(self.main)
        starts = [s[1] for spans in tracks.values() for s in spans]
        t0 = min(starts) if starts else 0
        pid = os.getpid()
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                               "args": {"name": "pooled_loader"}}]
        for tid in sorted(tracks):
            name = "main" if tid == 0 else f"worker {tid - 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}})
            for stage, start, dur, index in tracks[tid]:
                event: dict[str, Any] = {"name": stage, "ph": "X", "pid": pid, "tid": tid,
                                         "ts": (start - t0) / 1e3, "dur": dur / 1e3}
                if index is not None:
                    key = "task" if stage == "batch" else "sample"
                    event["args"] = {key: index if isinstance(index, int) else repr(index)[:80]}
                events.append(event)
        return events

    def write(self) -> str:
        """Write the file (atomically: a reader never sees half of it); returns its path.

        The temporary file is a new one of unpredictable name next to it (``O_EXCL``): a link
        planted in the folder is never written through, and a write error leaves no file."""
        folder, name = os.path.split(os.path.abspath(self.path))
        fd, tmp = create_exclusive(folder, f".{name}.", ".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path
