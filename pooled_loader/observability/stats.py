"""Where the time goes: the counters a loader shares with its iterators, and the figures and
verdict that ``PooledLoader.stats()`` and ``report()`` make of them.

Iterators count (batches, samples, bytes, seconds waited for data and spent in the training
loop, seconds issuing copies to the GPU, each worker's busy seconds); each ``engine.messages.Done``
brings its worker's seconds per stage for that batch (``stages.py``), added up here per worker.
The loader adds the pool's own figures. The verdict compares the share of time the training
loop waited with ``core.constants.BOTTLENECK_WAIT_SHARE`` and names the slowest stage with its fix.

Across ranks, :func:`gather` (collective: every rank calls it) collects every rank's figures;
``report()`` then names the straggler ranks: one slow rank stalls every DDP step.
"""
from __future__ import annotations

import collections
import logging
import statistics
import time
from typing import Any

from ..core.constants import BOTTLENECK_WAIT_SHARE
from .trace import TraceRecorder

log = logging.getLogger("pooled_loader")

STRAGGLER_FACTOR = 2.0
"""Ratio. A rank whose wait for data exceeds this multiple of the ranks' median is a straggler."""

STRAGGLER_MIN_WAIT_SHARE = 0.01
"""Fraction of the rank's elapsed time. Waits below this are noise, never a straggler (a median
of 0.1 ms would otherwise make a rank waiting 0.3 ms one)."""

FIXES = {
    "getitem": "the dataset's own __getitem__ (file reads, your code): add workers, or "
               "precompute it once with a cache (python -m pooled_loader cache build)",
    "decode": "JPEG decoding: build a cache (python -m pooled_loader cache build) or store "
              "smaller images (a smaller max_side), or add workers",
    "crop_resize": "crop+resize: add workers, or a cache with a smaller max_side so that "
                   "less is resized",
    "collate": "writing batches into the slot: return arrays in their final dtype and shape "
               "(uint8; normalize on the GPU with cuda.NormalizeImages), or give the dataset "
               "getitem_into",
    "slot_wait": "workers waited for bigger slots (batches outgrow the pool's slots): keep "
                 "batch sizes steady, or pass pool_slots=",
    "h2d": "host-to-device copies: send uint8 and normalize on the GPU "
           "(device_transform=cuda.NormalizeImages(...)), smaller batches of bytes",
}
MIX_FIX = ("reading the mix's source {stage!r} (pooled_loader.mix): add workers, cache or "
           "localise that source, or lighten its transform")
ONE_OFF = ("slot_sizing",)  # once per worker: never named as the slowest stage
OP_FIX = ("the vision op {stage!r}: put flip/ToCHW/Normalize right after the resize (they are "
          "fused into it), or move it to the GPU (device_transform)")


class LoaderStats:
    """Where the time goes and what moved, shared by the loader and its iterators."""

    def __init__(self) -> None:
        self.skipped_seen: set = set()
        self.trace: TraceRecorder | None = None  # set by PooledLoader(trace=)/loader.trace()
        self.ranks: list[dict] | None = None  # every rank's figures, after gather()
        self.reset()

    @property
    def tracing(self) -> bool:
        """Whether batches dispatched now should record spans for the trace."""
        return self.trace is not None and self.trace.active

    def reset(self) -> None:
        self.counters: collections.Counter = collections.Counter()
        self.worker_busy_s: collections.Counter = collections.Counter()
        self.stage_s: dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)  # worker -> stage -> seconds
        self.stage_counts: dict[int, collections.Counter] = collections.defaultdict(
            collections.Counter)  # worker -> batches, samples, busy_s
        self.started = time.perf_counter()

    def record_batch(self, worker_id: int, stages: dict[str, float] | None, samples: int,
                     busy_s: float, spans: list | None = None, track: int | None = None) -> None:
        """A delivered batch's stage seconds (from its ``Done``, or the in-process maker)."""
        if stages:
            seconds = self.stage_s[worker_id]
            for stage, s in stages.items():  # not Counter.update: its checks cost more, per batch
                seconds[stage] += s
        n = self.stage_counts[worker_id]
        n["batches"] += 1
        n["samples"] += samples
        n["busy_s"] += busy_s
        if self.trace is not None and spans is not None:
            self.trace.add_batch(worker_id + 1 if track is None else track, spans)

    def epoch_done(self) -> None:
        """At an epoch's end: (re)write the trace file, if one is recorded."""
        if self.trace is not None and self.trace.batches:
            self.trace.write()

    def main_span(self, name: str, start_s: float, end_s: float) -> None:
        """A span of the main process for the trace (``perf_counter`` seconds)."""
        if self.trace is not None:
            self.trace.add_main(name, start_s, end_s)

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
            "stages": self.stages(),
        }

    def stages(self) -> dict:
        """``stats()["stages"]``: per worker and for all workers together, seconds per stage
        (``total_s``) and milliseconds per sample (``per_sample_ms``); the main process's
        seconds waiting for batches, in the training step and issuing GPU copies, with
        milliseconds per batch."""
        workers = {w: _stage_figures(self.stage_s[w], self.stage_counts[w])
                   for w in sorted(self.stage_counts)}
        every: collections.Counter = collections.Counter()
        counts: collections.Counter = collections.Counter()
        for w in self.stage_counts:
            every.update(self.stage_s[w])
            counts.update(self.stage_counts[w])
        c = self.counters
        main = {"wait": c["wait_s"], "step": c["consumer_s"], "h2d": c["h2d_s"]}
        batches = c["batches"]
        return {"workers": workers, "all": _stage_figures(every, counts),
                "main": {"total_s": main,
                         "per_batch_ms": {k: 1e3 * v / batches if batches else 0.0
                                          for k, v in main.items()}}}


def _stage_figures(seconds: collections.Counter, counts: collections.Counter) -> dict:
    samples = counts["samples"]
    total = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
    return {"batches": counts["batches"], "samples": samples, "busy_s": counts["busy_s"],
            "total_s": total,
            "per_sample_ms": {k: 1e3 * v / samples if samples else 0.0 for k, v in total.items()}}


def slowest_stage(s: dict) -> tuple[str, str] | None:
    """(stage, the sentence naming it and its fix) for the figures ``s`` of ``stats()``: the
    loader's costliest stage in wall-clock terms (a worker stage's seconds over the workers
    that share it, against the main process's GPU copies). None before any batch."""
    st = s.get("stages")
    if not st or not st["all"]["samples"]:
        return None
    workers = max(1, len(st["workers"]))
    wall = {k: v / workers for k, v in st["all"]["total_s"].items() if k not in ONE_OFF}
    wall["h2d"] = st["main"]["total_s"]["h2d"]
    stage = max(wall, key=wall.get)
    if wall[stage] <= 0:
        return None
    busy = sum(st["all"]["total_s"].values()) or 1.0
    if stage == "h2d":
        figure = f"{st['main']['per_batch_ms']['h2d']:.2f} ms per batch in the main process"
    else:
        figure = (f"{st['all']['per_sample_ms'][stage]:.3f} ms per sample, "
                  f"{st['all']['total_s'][stage] / busy:.0%} of the workers' time")
    fix = FIXES.get(stage) or (MIX_FIX.format(stage=stage[4:]) if stage.startswith("mix:")
                               else OP_FIX.format(stage=stage))
    return stage, f"slowest stage: {stage} ({figure}); {fix}"


def report_text(s: dict, ranks: list[dict] | None = None) -> str:
    """The paragraph of ``PooledLoader.report()`` for the figures ``s`` of ``stats()``: whether
    the loader or the training step is the bottleneck, the slowest stage and its fix, and, given
    every rank's figures (``gather``), the straggler ranks."""
    wait_s, consumer_s = s["wait_s"], s["consumer_s"]
    total = wait_s + consumer_s
    if not s["batches"] or total <= 0:
        return "PooledLoader: no batches yet."
    share = wait_s / total
    loader_bound = share > BOTTLENECK_WAIT_SHARE
    verdict = ("the LOADER is the bottleneck: the training loop waited for data "
               f"{share:.0%} of the time; add workers, use a cache, or lighten the transform"
               if loader_bound else
               f"the TRAINING STEP is the bottleneck: it waited for data only {share:.0%} "
               "of the time; the loader keeps up")
    busy = ", ".join(f"worker {w}: {f:.0%}" for w, f in
                     sorted(s["worker_busy_fraction"].items()))
    text = (f"PooledLoader: {s['batches']} batches, {s['samples']} samples, "
            f"{s['bytes_moved'] / 1e9:.2f} GB; waited {wait_s:.2f}s, the loop ran "
            f"{consumer_s:.2f}s: {verdict}. Worker busy: {busy or 'n/a'}. Pool: "
            f"{s.get('slots')} slots, {s.get('slots_in_use')} in use, grown "
            f"{s.get('grown')} times; skipped samples: {s['skipped']}.")
    slowest = slowest_stage(s)
    if slowest is not None:
        text += (f" The loader's {slowest[1]}." if loader_bound else
                 f" (The loader's {slowest[1].split(';')[0]}: nothing to do while the step is "
                 "slower.)")
    for part in ("mix", "ray"):  # pooled_loader.mix's accounting, pooled_loader.ray's waits
        for note in (s.get(part) or {}).get("notes", ()):
            text += " " + note
    if ranks:
        text += " " + ranks_text(ranks)
    return text


def stragglers(ranks: list[dict]) -> list[int]:
    """The ranks (their ``"rank"``) whose wait for data is more than ``STRAGGLER_FACTOR`` times
    the ranks' median (and at least ``STRAGGLER_MIN_WAIT_SHARE`` of their time)."""
    if len(ranks) < 2:
        return []
    median = statistics.median(r["wait_s"] for r in ranks)
    return [r["rank"] for r in ranks
            if r["wait_s"] > STRAGGLER_FACTOR * median
            and r["wait_s"] > STRAGGLER_MIN_WAIT_SHARE * r["elapsed_s"]]


def ranks_text(ranks: list[dict]) -> str:
    """The sentence of ``report()`` about every rank's figures (from ``gather``)."""
    median = statistics.median(r["wait_s"] for r in ranks)
    slow = stragglers(ranks)
    if not slow:
        return (f"Ranks: {len(ranks)}, no straggler (median wait for data {median:.2f}s; "
                f"the most: {max(r['wait_s'] for r in ranks):.2f}s).")
    by_rank = {r["rank"]: r for r in ranks}
    parts = []
    for rank in slow:
        r = by_rank[rank]
        stage = slowest_stage(r)
        parts.append(f"rank {rank} waited {r['wait_s']:.2f}s for data"
                     + (f" (its {stage[1].split(';')[0]})" if stage else ""))
    return (f"Ranks: {len(ranks)}; STRAGGLER ranks {', '.join(map(str, slow))} (wait for data "
            f"> {STRAGGLER_FACTOR:g}x the median {median:.2f}s): " + "; ".join(parts)
            + ". One slow rank stalls every DDP step: give it more workers or lighter data "
            "(check its shards, disk and CPU share).")


def gather(loader: Any, group: Any = None) -> list[dict]:
    """Every rank's ``loader.stats()`` (each with its ``"rank"``), in rank order, under
    ``torch.distributed``; a list of this process's figures alone without a process group.
    Collective: every rank of ``group`` must call it. Afterwards ``loader.report()`` names the
    straggler ranks (print it on rank 0)."""
    import torch.distributed as dist
    figures = loader.stats()
    if not (dist.is_available() and dist.is_initialized()):
        ranks = [{**figures, "rank": 0}]
    else:
        figures["rank"] = dist.get_rank()
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, figures, group=group)
    loader._stats.ranks = ranks
    return ranks
