"""Throughput tuning: sweep num_workers, prefetch_factor, pool_slots and batch_size on your data.

    python -m pooled_loader tune --data DIR [--cache PATH] [--budget-s S] [--out DIR]
                                 [--simulate-step-ms MS] [--workers 1,2,4] [--prefetch 1,2,4]
                                 [--pool-extra 1,2,4] [--batch-sizes 64,128,256]

The dataset is ``ImageFolder(DIR)`` with the standard training pipeline (DecodeImage,
RandomResizedCrop 224, RandomHorizontalFlip, ToCHW), or ``CachedDataset(PATH)`` with the random
tail (RandomResizedCrop + flip + ToCHW, or flip + ToCHW when the cache already stores crops).

Search: coordinate descent from a starting point, each winner measured again against the start
(pooled_loader.tune.search says how).

``--simulate-step-ms`` sleeps that long per batch of the starting batch size (a stand-in training
step, scaled in proportion for other batch sizes, as a step's time grows with its batch), so the
figures say whether the loader or the step is the bottleneck at your step time.

Writes ``OUT/tune.json`` (every trial: settings, images/s, wait fraction, worker busy fractions,
worker milliseconds per sample in each stage, pool slots/occupancy/growth, peak worker RSS, the
loader's report) and ``OUT/tune.png`` (the same, plotted per setting), prints a
table, the best trial's ``loader.report()`` and the ``PooledLoader(...)`` line to paste.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from .._cli import EXIT_ERROR, EXIT_INTERRUPTED, run
from ..core.constants import (BOTTLENECK_WAIT_SHARE, DEFAULT_POOL_EXTRA_SLOTS,
                              DEFAULT_PREFETCH_FACTOR)
from ..loader import PooledLoader
from ..observability.progress import progress_bar
from .report import format_table, write_plot
from .search import KNOBS, Setting, confirm, coordinate_descent, recommended_line

__all__ = ["main", "make_dataset", "run_trial", "failed_trial", "warm_page_cache", "KNOBS",
           "Setting", "coordinate_descent", "confirm", "recommended_line"]

SEED = 0  # every trial's shuffle order (and the page-cache warm-up's)

# ---------------------------------------------------------------------------------------------
# Datasets


def make_dataset(data: str | None, cache: str | None, size: int = 224) -> tuple[Any, dict]:
    """The dataset to tune on and a description of it (kind, path, length, transform)."""
    from ..vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                         RandomResizedCrop, ToCHW)
    if cache:
        from ..cache import CachedDataset
        stored = str(CachedDataset(cache).header.get("source", {}).get("transform", ""))
        crop = [] if "RandomResizedCrop" in stored else [RandomResizedCrop(size)]
        ds: Any = CachedDataset(cache, transform=Compose([*crop, RandomHorizontalFlip(),
                                                          ToCHW()]))
        kind, path = "cache", cache
    else:
        ds = ImageFolder(data, transform=Compose([DecodeImage(), RandomResizedCrop(size),
                                                  RandomHorizontalFlip(), ToCHW()]))
        kind, path = "imagefolder", data
    return ds, {"kind": kind, "path": os.path.abspath(path), "len": len(ds),
                "transform": repr(ds.transform)}


def warm_page_cache(ds: Any, count: int, time_limit_s: float) -> tuple[int, int, float]:
    """Read the first ``count`` samples of the trials' shuffle order once, so the first trial
    is not the only one that reads from disk. Returns (samples, bytes, seconds)."""
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(SEED))[:count]
    t0, n, nbytes = time.perf_counter(), 0, 0
    for i in order.tolist():
        if time.perf_counter() - t0 > time_limit_s:
            break
        if hasattr(ds, "samples"):
            with open(ds.samples[i][0], "rb") as f:
                nbytes += len(f.read())
        elif hasattr(ds, "raw"):
            for leaf in ds.raw(i):
                if hasattr(leaf, "tobytes"):
                    nbytes += len(leaf.tobytes())
        n += 1
    return n, nbytes, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# One trial


def _epochs(loader: PooledLoader) -> Iterator[Any]:
    """Batches forever, epoch after epoch."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if not n:
            raise RuntimeError("the loader yields no batches")
        epoch += 1


def _proc_kb(pid: int | str, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def run_trial(ds: Any, s: Setting, *, time_limit_s: float, warmup: int, min_batches: int,
              max_batches: int, step_s: float = 0.0) -> dict:
    """Build a loader for ``s``, warm it up, and measure it. Returns the trial's figures."""
    t0 = time.perf_counter()
    loader = PooledLoader(ds, shuffle=True, on_error="skip",
                          generator=torch.Generator().manual_seed(SEED), **s.loader_kwargs())
    batches = _epochs(loader)
    try:
        for _ in range(warmup):
            batch = next(batches)
            time.sleep(step_s)
        s0, m0 = loader.stats(), time.perf_counter()
        setup_s = m0 - t0
        n = 0
        while n < max_batches and (n < min_batches or time.perf_counter() - t0 < time_limit_s):
            batch = next(batches)
            n += 1
            time.sleep(step_s)
        del batch
        m1 = time.perf_counter()
        s1 = loader.stats()
        rss_workers = [_proc_kb(p.pid, "VmHWM") for p in multiprocessing.active_children()]
        report = loader.report()
    finally:
        batches.close()
        close = getattr(loader, "close", None)  # stops the workers now (else when collected)
        if close is not None:
            close()
        del batches, loader
    window = m1 - m0
    wait = s1["wait_s"] - s0["wait_s"]
    consumer = s1["consumer_s"] - s0["consumer_s"]
    # busy time is booked when a batch is done, so a batch begun before the window counts in
    # full: capped at 100%
    busy = {int(w): min(1.0, (b - s0["worker_busy_s"].get(w, 0.0)) / window)
            for w, b in s1["worker_busy_s"].items()}
    samples = s1["samples"] - s0["samples"]
    stage_ms = _stage_ms(s0["stages"]["all"], s1["stages"]["all"])
    wait_fraction = wait / (wait + consumer) if wait + consumer > 0 else 1.0
    rss_workers = [k for k in rss_workers if k]
    return {
        **dataclasses.asdict(s), "pool_slots": s.pool_slots, "label": s.label(),
        "step_ms": 1000 * step_s, "images_per_s": samples / window,
        "batches": s1["batches"] - s0["batches"], "samples": samples, "measured_s": window,
        "setup_s": setup_s,
        "wait_s": wait, "consumer_s": consumer, "wait_fraction": wait_fraction,
        "bottleneck": "loader" if wait_fraction > BOTTLENECK_WAIT_SHARE else "step",
        "worker_busy_fraction": busy,
        "worker_busy_mean": sum(busy.values()) / len(busy) if busy else None,
        "stage_ms_per_sample": stage_ms,
        "slots": s1.get("slots"), "slots_in_use": s1.get("slots_in_use"),
        "slot_bytes": s1.get("slot_bytes"), "pool_bytes": s1.get("bytes"),
        "grown": s1.get("grown"), "allocations_after_warmup": s1.get("allocations_after_warmup"),
        "skipped": s1["skipped"],
        "peak_rss_worker_mb": max(rss_workers) / 1024 if rss_workers else None,
        "rss_main_mb": (_proc_kb("self", "VmRSS") or 0) / 1024,
        "load_avg_1min": os.getloadavg()[0],
        "report": report,
    }


def _stage_ms(before: dict, after: dict) -> dict[str, float]:
    """Worker milliseconds per sample and stage between two ``stats()["stages"]["all"]``."""
    samples = after["samples"] - before["samples"]
    if samples <= 0:
        return {}
    ms = {k: 1e3 * (v - before["total_s"].get(k, 0.0)) / samples
          for k, v in after["total_s"].items()}
    return {k: v for k, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v > 0}


def failed_trial(s: Setting, error: BaseException) -> dict:
    """The record of a trial whose loader raised (e.g. a worker killed for memory)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [""]
    # a worker's error carries its traceback: its last line names the type and the reason
    summary = lines[-1] if len(lines) > 1 else f"{type(error).__name__}: {lines[0]}"
    return {**dataclasses.asdict(s), "pool_slots": s.pool_slots, "label": s.label(),
            "images_per_s": 0.0, "error": summary, "error_detail": str(error),
            "load_avg_1min": os.getloadavg()[0]}


# ---------------------------------------------------------------------------------------------
# CLI


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return sorted(set(values))


def _default_workers(cpus: int) -> list[int]:
    powers = [1 << k for k in range(8) if (1 << k) <= 2 * cpus]
    return sorted({*powers, cpus})


def _start(values: list[int], preferred: int) -> int:
    return preferred if preferred in values else values[len(values) // 2]


def _parser() -> argparse.ArgumentParser:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    p = argparse.ArgumentParser(prog="python -m pooled_loader tune",
                                description="Find the fastest PooledLoader settings on your data.")
    p.add_argument("--data", help="ImageFolder root: DIR/CLASS/IMAGE")
    p.add_argument("--cache", help="tune on CachedDataset(PATH) (with the random tail); "
                                   "--data is then not used")
    p.add_argument("--budget-s", type=float, default=120.0,
                   help="time for all trials, seconds (default 120)")
    p.add_argument("--out", default="tune_out", help="folder for tune.json and tune.png")
    p.add_argument("--simulate-step-ms", type=float, default=0.0,
                   help="fake training step: sleep this long per batch of the starting batch "
                        "size, in proportion for other sizes (default 0: none)")
    p.add_argument("--size", type=int, default=224, help="RandomResizedCrop size (default 224)")
    p.add_argument("--workers", type=_ints, default=_default_workers(cpus or 1),
                   help="num_workers values (default: powers of two up to 2x CPUs, and CPUs)")
    p.add_argument("--prefetch", type=_ints, default=[1, 2, 4], help="prefetch_factor values")
    p.add_argument("--pool-extra", type=_ints, default=[1, 2, 4],
                   help="pool slots beyond num_workers*prefetch_factor (default 1,2,4; "
                        "PooledLoader's default is 2)")
    p.add_argument("--batch-sizes", type=_ints, default=[64, 128, 256])
    p.add_argument("--warmup-batches", type=int, default=None,
                   help="batches before measuring (default max(2, num_workers))")
    p.add_argument("--min-batches", type=int, default=3)
    p.add_argument("--max-batches", type=int, default=50)
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="a change must be this much faster to be kept (default 0.03)")
    p.add_argument("--confirm-rounds", type=int, default=2,
                   help="measure the winner and the start this many more times, interleaved, "
                        "and compare medians (default 2; 0: no check)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(cpus=cpus)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pooled_loader tune ...`` (a leading ``"tune"`` in ``argv`` is skipped); the
    exit status: 0, ``EXIT_ERROR`` when every trial failed (after their table),
    ``EXIT_INTERRUPTED`` after Ctrl-C (with what was measured written).

    An error the user can act on (no such folder, no batch size that fits) is raised, as the
    other commands' are: ``python -m pooled_loader`` prints it as one line (``_cli``)."""
    a = _arguments(argv)
    ds, dataset_info = make_dataset(a.data, a.cache, a.size)
    plan = _plan(a, len(ds))
    os.makedirs(a.out, exist_ok=True)
    load_start = os.getloadavg()[0]
    _warm_up(a, ds, dataset_info, plan, load_start)
    outcome = _sweep(a, ds, plan)
    if outcome is None:
        print("interrupted before any trial finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    if "error" in outcome.best:  # the best failed: every trial did
        print(format_table(outcome.trials, outcome.best))
        print(f"error: every trial failed; the first: {outcome.trials[0]['error']}",
              file=sys.stderr)
        return EXIT_ERROR
    outcome.notes += _notes(a, len(ds), plan, load_start, outcome.best)
    result = _result(a, dataset_info, plan, load_start, outcome)
    paths, plotted = _write(a, result, outcome, plan, dataset_info)
    _print_summary(outcome, result, paths, plotted)
    return EXIT_INTERRUPTED if outcome.interrupted else 0


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the sweep tries, and the time each trial gets."""
    space: dict  # knob -> the values to try
    start: Setting
    reserve: int  # trials kept for the confirmation
    planned: int  # trials the budget is split over
    trial_s: float
    step_s: float  # the simulated training step, per batch of start.batch_size


@dataclasses.dataclass
class _Outcome:
    """What the sweep found: every trial, the best, its confirmation and the notes so far."""
    trials: list
    best: dict
    confirmed: dict | None
    notes: list
    interrupted: bool
    elapsed_s: float


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:
        argv = argv[1:]
    p = _parser()
    a = p.parse_args(argv)
    if not a.data and not a.cache:
        p.error("give --data DIR or --cache PATH")
    if 0 in a.prefetch or min(a.batch_sizes) < 1 or a.min_batches < 1:
        p.error("prefetch_factor, batch sizes and --min-batches must be >= 1")
    return a


def _plan(a: argparse.Namespace, samples: int) -> _Plan:
    batch_sizes = [b for b in a.batch_sizes if b <= samples]
    if not batch_sizes:
        raise ValueError(f"every batch size exceeds the dataset ({samples} samples)")
    space = {"num_workers": a.workers, "batch_size": batch_sizes,
             "prefetch_factor": a.prefetch, "pool_extra": a.pool_extra}
    start = Setting(_start(a.workers, a.cpus), _start(batch_sizes, 128),
                    _start(a.prefetch, DEFAULT_PREFETCH_FACTOR),
                    _start(a.pool_extra, DEFAULT_POOL_EXTRA_SLOTS))
    reserve = 2 * max(0, a.confirm_rounds)
    planned = 1 + sum(len(v) - 1 for v in space.values()) + reserve
    return _Plan(space, start, reserve, planned, a.budget_s / planned,
                 a.simulate_step_ms / 1000.0)


def _warm_up(a: argparse.Namespace, ds: Any, dataset_info: dict, plan: _Plan,
             load_start: float) -> None:
    """Say what is tuned and how, and read the trials' first samples once."""
    print(f"tuning on {dataset_info['kind']} {dataset_info['path']} ({len(ds)} samples), "
          f"{a.cpus} CPUs, load {load_start:.1f}; budget {a.budget_s:.0f} s, "
          f"~{plan.planned} trials of ~{plan.trial_s:.1f} s"
          + (f"; simulated step {a.simulate_step_ms:g} ms per batch of "
             f"{plan.start.batch_size}" if plan.step_s else ""))
    most = max(plan.space["batch_size"])
    warm = warm_page_cache(ds, min(len(ds), a.max_batches * most), 0.25 * a.budget_s)
    print(f"page cache: read {warm[0]} samples ({warm[1] / 2**20:.0f} MiB) in {warm[2]:.1f} s")


def _sweep(a: argparse.Namespace, ds: Any, plan: _Plan) -> _Outcome | None:
    """The search and its confirmation, under a progress bar; None when interrupted before
    any trial finished (after one, the trials so far)."""
    bar = progress_bar(total=plan.planned, desc="tune", unit="trial", disable=a.quiet,
                       file=sys.stderr)
    t_start = time.perf_counter()
    measure = _measurer(a, ds, plan, bar)

    def time_left(best: dict) -> bool:
        """Room for another trial, keeping time to confirm a winner other than the start."""
        keep = plan.reserve if best["knob"] != "start" else 0
        return time.perf_counter() - t_start + (0.5 + keep) * plan.trial_s < a.budget_s

    done: dict[Setting, dict] = {}
    notes: list[str] = []
    try:
        trials, best = coordinate_descent(plan.space, plan.start, measure, a.tolerance,
                                          time_left, done)
        confirmed = None
        if best is not trials[0] and "error" not in best and a.confirm_rounds > 0:
            left = a.budget_s - (time.perf_counter() - t_start)
            best, confirmed = _confirm(a, plan, trials, best, measure, left, notes)
    except KeyboardInterrupt:
        bar.close()
        if not done:
            return None
        trials = list(done.values())  # without any confirmation runs
        best = max(trials, key=lambda t: t["images_per_s"])
        notes.append(f"interrupted (Ctrl-C) after {len(trials)} trials: the search is incomplete")
        return _Outcome(trials, best, None, notes, True, time.perf_counter() - t_start)
    bar.close()
    return _Outcome(trials, best, confirmed, notes, False, time.perf_counter() - t_start)


def _measurer(a: argparse.Namespace, ds: Any, plan: _Plan, bar: Any
              ) -> Callable[[Setting, str], dict]:
    """``measure(setting, knob)``: one trial (a failed one recorded, not raised), counted on
    ``bar`` with the best rate so far."""
    best_rate = [0.0]

    def measure(s: Setting, knob: str) -> dict:
        bar.set_description(f"tune {s.label()}")
        warmup = a.warmup_batches if a.warmup_batches is not None else max(2, s.num_workers)
        with warnings.catch_warnings():
            # more workers than CPUs is a deliberate point of the sweep: no warning per trial
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            try:
                t = run_trial(ds, s, time_limit_s=plan.trial_s, warmup=warmup,
                              min_batches=a.min_batches, max_batches=a.max_batches,
                              step_s=plan.step_s * s.batch_size / plan.start.batch_size)
            except Exception as e:  # noqa: BLE001 - one failed setting must not end the sweep
                t = failed_trial(s, e)
                print(f"trial {s.label()} failed: {t['error']}", file=sys.stderr)
        best_rate[0] = max(best_rate[0], t["images_per_s"])
        if bar.n >= bar.total:
            bar.total = bar.n + 1
        bar.update(1)
        bar.set_postfix_str(f"best {best_rate[0]:.0f} img/s")
        return t
    return measure


def _confirm(a: argparse.Namespace, plan: _Plan, trials: list, winner: dict,
             measure: Callable[[Setting, str], dict], left_s: float,
             notes: list) -> tuple[dict, dict]:
    """The search's winner measured again against the start (``trials[0]``), interleaved, in
    the time kept for it (at least one round if the winner came late); the confirmation runs
    join ``trials``. Returns the trial kept and the confirmation's record."""
    first = trials[0]
    rounds = max(1, min(a.confirm_rounds, int(left_s // (2 * plan.trial_s))))
    runs, best, rates = confirm(first, winner, measure, rounds, a.tolerance, len(trials))
    trials += runs
    confirmed = {"rounds": rounds, "images_per_s": rates,
                 "median": {k: statistics.median(v) for k, v in rates.items()},
                 "kept": "winner" if best is winner else "start"}
    if best is not winner:
        notes.append(f"the search's winner ({winner['label']}) was not faster than the start "
                     f"({first['label']}) when measured again: recommending the start")
    return best, confirmed


def _notes(a: argparse.Namespace, samples: int, plan: _Plan, load_start: float,
           best: dict) -> list[str]:
    """What makes the figures less than they seem."""
    notes = []
    if load_start > a.cpus:
        notes.append(f"the machine was busy (load {load_start:.1f} on {a.cpus} CPUs): other "
                     "work shares the CPUs, so the figures are noisy; rerun when it is idle")
    if samples < a.max_batches * best["batch_size"]:
        notes.append(f"the dataset ({samples} samples) is smaller than a trial's batches: epoch "
                     "boundaries (pipeline refills) are part of the figures")
    if not plan.step_s:
        notes.append("no training step was simulated, so the loader is the bottleneck by "
                     "construction; pass --simulate-step-ms to see it against your step")
    return notes


def _result(a: argparse.Namespace, dataset_info: dict, plan: _Plan, load_start: float,
            outcome: _Outcome) -> dict:
    """The record written to ``tune.json``."""
    best, confirmed = outcome.best, outcome.confirmed
    best_rate = confirmed["median"][best["label"]] if confirmed else best["images_per_s"]
    return {
        "version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "dataset": dataset_info,
        "machine": {"cpus": a.cpus, "load_start": load_start, "load_end": os.getloadavg()[0],
                    "python": platform.python_version(), "torch": torch.__version__},
        "settings": {"budget_s": a.budget_s, "simulate_step_ms": a.simulate_step_ms,
                     "size": a.size, "tolerance": a.tolerance, "trial_s": plan.trial_s,
                     "warmup_batches": a.warmup_batches, "min_batches": a.min_batches,
                     "max_batches": a.max_batches, "space": plan.space,
                     "start": dataclasses.asdict(plan.start)},
        "trials": [{k: v for k, v in t.items() if k != "setting"} for t in outcome.trials],
        "best": {"id": best["id"], **dataclasses.asdict(best["setting"]),
                 "pool_slots": best["pool_slots"], "images_per_s": best_rate,
                 "report": best["report"]},
        "confirm": confirmed,
        "recommended": recommended_line(best["setting"]),
        "notes": outcome.notes,
        "elapsed_s": outcome.elapsed_s,
    }


def _write(a: argparse.Namespace, result: dict, outcome: _Outcome, plan: _Plan,
           dataset_info: dict) -> tuple[tuple[str, str], bool]:
    """``OUT/tune.json`` and (with matplotlib) ``OUT/tune.png``: their paths, and whether the
    plot was written."""
    json_path, png_path = os.path.join(a.out, "tune.json"), os.path.join(a.out, "tune.png")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    step = (f", simulated step {a.simulate_step_ms:g} ms / {plan.start.batch_size} images"
            if plan.step_s else "")
    plotted = write_plot(outcome.trials, outcome.best, png_path,
                         f"{dataset_info['kind']} {dataset_info['len']} samples, "
                         f"{a.cpus} CPUs{step}")
    if not plotted:
        print(f"{png_path} not written: the plot needs matplotlib "
              "(pip install 'pooled-loader[tools]')", file=sys.stderr)
    return (json_path, png_path), plotted


def _print_summary(outcome: _Outcome, result: dict, paths: tuple[str, str],
                   plotted: bool) -> None:
    """The table, the best trial and its report, the notes and the line to paste."""
    best, confirmed = outcome.best, outcome.confirmed
    print(format_table(outcome.trials, best))
    print(f"\n{len(outcome.trials)} trials in {outcome.elapsed_s:.0f} s. Best: trial "
          f"{best['id']} ({best['label']}), {result['best']['images_per_s']:.0f} images/s"
          f"{' (median)' if confirmed else ''}; the training loop waited "
          f"{best['wait_fraction']:.0%} of trial {best['id']}'s time.")
    if confirmed:
        print("measured again, interleaved: " + "; ".join(
            f"{k}: median {confirmed['median'][k]:.0f} images/s of "
            + ", ".join(f"{r:.0f}" for r in v) for k, v in confirmed["images_per_s"].items()))
    print("loader.report() of that trial (warm-up included):\n" + best["report"])
    for n in outcome.notes:
        print(f"note: {n}")
    written = " and ".join(paths) if plotted else paths[0]
    print(f"\nwrote {written}\n\npaste:\n    {result['recommended']}")


if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:]))
