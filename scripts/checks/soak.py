#!/usr/bin/env python
"""Soak test: many epochs with random faults; every batch checked by content; leaks counted.

    python scripts/checks/soak.py --minutes 10 [--seed S] [--json PATH]

Each round builds a PooledLoader with a random configuration (1-3 workers, persistent or not,
batch size, pool size, on_error raise/skip) over a dataset whose sample ``i`` at epoch ``e`` is an
int64 array filled with ``i * 1000 + e`` (so the content names the sample and proves
``set_epoch`` reached the workers) and whose size changes with the epoch (the pool grows). It runs 1-3 epochs with one random fault each: none, a worker SIGKILLed mid-epoch
(WorkerError expected, the next epoch must work; with ``max_worker_restarts``, in a random
part of the rounds, the worker is replaced and the epoch must hold every sample exactly once), exceptions from the dataset (raised, or
skipped with ``on_error="skip"``), every batch kept until the end of the epoch, ``break``
mid-epoch, or a mid-epoch checkpoint (``state_dict()`` through JSON) that a fresh loader resumes
with ``load_state_dict()`` (the epoch must then hold every sample exactly once). Then the loader is closed and dropped, and the process is checked against its state
after warm-up: open fds, child processes, memfd mappings and fds (``/proc/self``), and RSS.

Reports (and exits non-zero on any): hangs (an epoch over ``--epoch-timeout`` dumps every
thread's stack and exits), wrong or duplicated samples, leaks, and the RSS slope per round
after warm-up (least squares; goal under 1 MB).
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from pooled_loader import PooledLoader, WorkerError  # noqa: E402


class Encoded:
    """Sample ``i``: int64 ``[side]`` filled with ``i*1000 + epoch``, and ``i``; ``side`` grows
    with the epoch (the pool's slots must grow). Faults: indices in ``bad`` raise; the worker
    that loads ``kill_at`` SIGKILLs itself (only the first time if ``kill_once`` names a flag
    file that does not exist yet)."""

    def __init__(self, n: int, bad: frozenset = frozenset(), kill_at: int = -1):
        self.n, self.bad, self.kill_at = n, bad, kill_at
        self.kill_once: str | None = None
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.kill_at:
            if self.kill_once is not None:
                if os.path.exists(self.kill_once):
                    return self._sample(i)
                open(self.kill_once, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return self._sample(i)

    def _sample(self, i: int):
        if i in self.bad:
            raise ValueError(f"sample {i} fails on purpose")
        side = 64 * (1 + self.epoch % 3)
        return np.full((side,), i * 1000 + self.epoch, np.int64), i


def check_batch(batch, epoch: int, bad: frozenset, seen: list[int], errors: list[str]) -> None:
    data, labels = batch
    for row, label in zip(data, labels.tolist()):
        values = row[:64].numpy()
        if label in bad:
            errors.append(f"sample {label} should have failed but was delivered")
        if not (values == label * 1000 + epoch).all():
            errors.append(f"sample {label} at epoch {epoch} holds {values[:4]}... (wrong content "
                          "or stale epoch)")
        seen.append(label)


def process_state() -> dict:
    fds = os.listdir("/proc/self/fd")
    memfd_fds = 0
    for fd in fds:
        try:
            memfd_fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        memfd_maps = sum("memfd:pooled_loader" in line for line in f)
    with open("/proc/self/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return {"fds": len(fds), "children": len(mp.active_children()), "memfd_fds": memfd_fds,
            "memfd_maps": memfd_maps, "rss_mb": rss_kb / 1024}


def one_round(rng: random.Random, rnd: int, report: dict) -> None:
    n = rng.choice([40, 96, 200])
    workers = rng.randint(1, 3)
    persistent = rng.random() < 0.5
    skip = rng.random() < 0.3
    batch = rng.choice([1, 3, 8, 16])
    ds = Encoded(n)
    options = dict(batch_size=batch, shuffle=rng.random() < 0.7, num_workers=workers,
                   persistent_workers=persistent, on_error="skip" if skip else "raise",
                   pool_slots=rng.choice([None, 2, 8]), timeout=60,
                   prefetch_factor=rng.choice([1, 2, 4]))
    failover = rng.random() < 0.4  # a killed worker is replaced (docs/failures.md)
    if failover:
        options.update(max_worker_restarts=3, worker_timeout=30)
    flags = tempfile.mkdtemp(prefix="pooled_soak_")
    loader = PooledLoader(ds, **options)
    for epoch in range(rng.randint(1, 3)):
        fault = rng.choice(["none", "kill", "raise", "keep", "break", "resume"])
        if fault == "kill" and persistent:
            fault = "none"  # the dataset copy in persistent workers is fixed at their start
        ds.bad = frozenset(rng.sample(range(n), 2)) if fault == "raise" else frozenset()
        ds.kill_at = rng.randrange(n) if fault == "kill" else -1
        ds.kill_once = os.path.join(flags, f"killed-{epoch}") if failover else None
        if persistent and fault == "raise":
            ds.bad = frozenset()  # as above
            fault = "none"
        loader.set_epoch(epoch + rnd * 10)
        report["epochs"] += 1
        report["faults"][fault] = report["faults"].get(fault, 0) + 1
        seen: list[int] = []
        kept = []
        stop_at = (rng.randrange(1, max(2, n // batch)) if fault in ("break", "resume")
                   else None)
        state = None
        try:
            for k, b in enumerate(loader):
                check_batch(b, epoch + rnd * 10, ds.bad, seen, report["wrong"])
                if fault == "keep":
                    kept.append((b, list(seen[-len(b[1]):])))
                if stop_at is not None and k + 1 >= stop_at:
                    if fault == "resume":  # a checkpoint, then a fresh loader finishes the epoch
                        state = json.loads(json.dumps(loader.state_dict()))
                    break
            if state is not None:
                resumed = PooledLoader(ds, **options)
                resumed.set_epoch(epoch + rnd * 10)
                resumed.load_state_dict(state)
                for b in resumed:
                    check_batch(b, epoch + rnd * 10, ds.bad, seen, report["wrong"])
                resumed.close()
                stop_at = None  # the epoch is complete again: check that every sample came once
        except WorkerError:
            if fault != "kill" or failover:  # a replaced worker raises nothing
                raise
            continue
        except ValueError as e:
            if fault != "raise" or skip or "fails on purpose" not in str(e):
                raise
            continue
        for b, labels in kept:  # batches kept all epoch are intact
            if b[1].tolist() != labels:
                report["wrong"].append(f"a kept batch changed: {labels[:4]} -> "
                                       f"{b[1].tolist()[:4]}")
        if fault == "kill" and not failover:
            report["wrong"].append(f"round {rnd}: a worker SIGKILLed at sample {ds.kill_at} "
                                   "gave no WorkerError")
        if fault == "kill" and failover:
            report["replaced"] += os.path.exists(ds.kill_once)
        dups = len(seen) - len(set(seen))
        if dups and not (skip and ds.bad):
            report["wrong"].append(f"round {rnd} epoch {epoch}: {dups} duplicated samples")
        if stop_at is None:
            expect = set(range(n)) - set(ds.bad)
            missing = expect - set(seen)
            if missing:
                report["wrong"].append(f"round {rnd} epoch {epoch}: {len(missing)} samples "
                                       f"never delivered (e.g. {sorted(missing)[:3]})")
        report["batches"] += len(seen)
    loader.close()
    shutil.rmtree(flags, ignore_errors=True)


def soak(seconds: float, seed: int, epoch_timeout: float) -> dict:
    rng = random.Random(seed)
    warnings.simplefilter("ignore")  # pool growth warnings are expected
    report: dict = {"seed": seed, "rounds": 0, "epochs": 0, "batches": 0, "faults": {},
                    "replaced": 0, "wrong": [], "leaks": [], "rss_mb": []}
    start = time.monotonic()
    baseline = None
    warmup = max(3, int(seconds / 30))
    while time.monotonic() - start < seconds:
        faulthandler.dump_traceback_later(epoch_timeout * 3, exit=True)
        one_round(rng, report["rounds"], report)
        faulthandler.cancel_dump_traceback_later()
        gc.collect()
        deadline = time.monotonic() + 10  # workers of a closed loader are reaped
        while mp.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        state = process_state()
        report["rounds"] += 1
        report["rss_mb"].append(state["rss_mb"])
        if report["rounds"] == warmup:
            baseline = state
        elif baseline is not None:
            for key in ("fds", "children", "memfd_fds", "memfd_maps"):
                if state[key] > baseline[key]:
                    report["leaks"].append(f"round {report['rounds']}: {key} "
                                           f"{baseline[key]} -> {state[key]}")
    rss = report["rss_mb"][warmup:]
    report["rss_slope_mb_per_round"] = (float(np.polyfit(np.arange(len(rss)), rss, 1)[0])
                                        if len(rss) >= 3 else None)
    report["seconds"] = time.monotonic() - start
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--epoch-timeout", type=float, default=60)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.randrange(2**31)
    report = soak(a.seconds if a.seconds is not None else a.minutes * 60, seed, a.epoch_timeout)
    slope = report["rss_slope_mb_per_round"]
    print(f"soak seed {seed}: {report['rounds']} rounds, {report['epochs']} epochs, "
          f"{report['batches']} samples checked in {report['seconds']:.0f}s; faults "
          f"{report['faults']} ({report['replaced']} killed workers replaced); 0 hangs; {len(report['wrong'])} wrong; "
          f"{len(report['leaks'])} leaks; RSS slope "
          f"{'n/a' if slope is None else f'{slope:+.3f} MB/round'} "
          f"({report['rss_mb'][0]:.0f} -> {report['rss_mb'][-1]:.0f} MB)")
    for line in (report["wrong"] + report["leaks"])[:20]:
        print("  " + line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if report["wrong"] or report["leaks"] else 0


if __name__ == "__main__":
    sys.exit(main())
