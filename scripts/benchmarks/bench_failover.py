#!/usr/bin/env python
"""Worker failover (issue 50): what ``max_worker_restarts`` / ``worker_timeout`` cost when
nothing fails, how long replacing a SIGKILLed worker takes, and the throughput while a worker is
killed every second; the batches must stay those of the uninterrupted run.

    python scripts/benchmarks/bench_failover.py [--data DIR] [--n 1536] [--rounds 3]
        [--epochs 3] [--storm-s 8] [--passes P] [--kill-every 1.0] [--batch 64] [--workers 2]
        [--quick] [--json PATH]

Data: ``--data DIR`` (default ``/tmp/pooled_failover``), made when missing by
``scripts/tools/make_dataset.py`` (``--n`` JPEGs, 10 classes). The pipeline is torchvision's
uint8 recipe, which PooledLoader recognises and runs on its fused path:
``datasets.ImageFolder(root, loader=torchvision.io.decode_image, transform=v2.Compose(
[v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()]))``. Every loader:
``PooledLoader(ds, batch_size=64, num_workers=2, per_sample_seed=True, persistent_workers=True,
generator=torch.Generator().manual_seed(0))``, shuffled, built afresh for every run (and closed
after it), so that all runs of a part give the same batch sequence. "failover" is that loader
with ``max_worker_restarts=3, worker_timeout=30`` (part 3: ``max_worker_restarts=100000``),
"plain" the same without them (defaults 0 and 0).

1. **Cost when nothing fails.** Per round, plain and failover alternate (order reversed in odd
   rounds); each runs one untimed warm-up epoch (worker start, first-batch sizing), then
   ``--epochs`` timed epochs. Figures: images/s of the timed epochs, and CPU ms per image of the
   whole tree (this process's ``process_time`` plus the workers' utime + stime from
   ``/proc/PID/stat``: steadier than wall time on a shared machine). The cost is 1 - the median
   of the per-round ratios failover / plain (goal <= 1 %). The loop only counts images and
   hashes the labels (the label sequences of both must match).
2. **Time to replace a worker.** Per round, a failover loader's epoch without a kill and one
   where worker ``round % workers`` is SIGKILLed (``os.kill(it._workers[k].pid, SIGKILL)``,
   from the loop, after half the epoch's batches), alternating; both after a warm-up epoch.
   A thread polls ``it._workers[k]`` every 0.2 ms from the kill: "kill -> new live worker" is
   when its pid has changed and ``is_alive()`` holds (the GIL's switch interval, 5 ms, bounds
   the resolution: the replacement is made by the main thread inside ``next()``). Also: kill
   -> the next batch the loop receives, the longest wait for a batch after the kill, and the
   extra epoch time (kill epoch - no-kill epoch of the same round; median over rounds).
3. **A kill every second.** One epoch of several passes over the data (a
   ``RandomSampler(num_samples=passes * n)``; ``--passes``, else as many as make the epoch
   last about ``--storm-s`` seconds at part 1's plain rate, at least 2), with and without a
   background thread that SIGKILLs a random live worker (state not zombie in ``/proc``, a
   child of this process) every ``--kill-every`` seconds; alternating, a fresh loader each
   (worker start inside the epoch, the same for both), both with
   ``max_worker_restarts=100000, worker_timeout=30``. images/s of each, their ratio, kills and
   replacements, and the tree's CPU (this process, its live workers from ``/proc``, the reaped
   ones from ``RUSAGE_CHILDREN``): per image, and the extra per kill (work lost and rebuilt,
   process start); part 2 reports the extra CPU of one kill the same way. Every kill before the
   last batch should give one replacement and one WARNING line; a kill the loader never sees
   (no batch left to wait for) is a NOTE, not a failure.

Parts 2 and 3 hash every batch (labels and the image bytes, xxh3 or sha1, in this process: the
same work in both runs of a pair); the kill runs' batches must equal the no-kill runs'
(bit-identical with ``per_sample_seed=True``), else the script prints FAIL and exits 1. The
loader's WARNING lines (one per replacement, logger ``pooled_loader``) are counted, not printed;
the first is shown. ``--quick``: a 512-image dataset (``/tmp/pooled_failover_quick``), 1 round,
1 timed epoch, ``--storm-s 5``: a smoke run of about half a minute on 2 cores.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import hashlib
import json
import logging
import math
import os
import platform
import random
import resource
import shlex
import signal
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))

from pooled_loader import PooledLoader  # noqa: E402

try:
    import xxhash

    def _digest(data) -> bytes:
        return xxhash.xxh3_128(data).digest()
    HASH = "xxh3_128"
except ImportError:  # not a dependency of the library: hashlib's sha1 (releases the GIL too)
    def _digest(data) -> bytes:
        return hashlib.sha1(data).digest()
    HASH = "sha1"

SEED = 0
FAILOVER = dict(max_worker_restarts=3, worker_timeout=30)
CLK_TCK = os.sysconf("SC_CLK_TCK")


class CountWarnings(logging.Handler):
    """The loader's log lines (logger "pooled_loader"): counted and kept, not printed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


LOG = CountWarnings()


def dataset(root: str):
    from torchvision import datasets
    from torchvision.io import decode_image
    from torchvision.transforms import v2
    return datasets.ImageFolder(root, loader=decode_image, transform=v2.Compose([
        v2.RandomResizedCrop(224), v2.RandomHorizontalFlip()]))


def make_loader(ds, a: argparse.Namespace, failover: dict | None,
                passes: int = 1) -> PooledLoader:
    kw = dict(batch_size=a.batch, num_workers=a.workers, per_sample_seed=True,
              persistent_workers=True, generator=torch.Generator().manual_seed(SEED))
    if passes > 1:
        kw["sampler"] = torch.utils.data.RandomSampler(
            ds, num_samples=passes * len(ds), generator=torch.Generator().manual_seed(SEED))
    else:
        kw["shuffle"] = True
    return PooledLoader(ds, **kw, **(failover or {}))


def batch_digest(images: torch.Tensor, labels: torch.Tensor) -> bytes:
    return _digest(labels.numpy().tobytes()) + _digest(memoryview(images.numpy()).cast("B"))


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def live_child(pid: int | None) -> bool:
    """A running (not zombie) child of this process. Read from /proc: a Process.is_alive() from
    another thread would reap a dead worker with waitpid behind the loader's back."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X", "x") and int(fields[1]) == os.getpid()


class TreeCPU:
    """CPU seconds (user + system) of this process and of the loader's workers since it was made:
    this process's ``process_time``, the workers alive now from ``/proc/PID/stat`` (a killed one
    not reaped yet too), and the ones the loader has reaped meanwhile (``RUSAGE_CHILDREN``: their
    whole life, less what the ones alive at the start had used by then)."""

    def __init__(self, it) -> None:
        self.it = it
        self.start = self._parts()

    def _parts(self) -> tuple[float, float, float]:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        live = sum(proc_cpu_s(p.pid) for p in list(self.it._workers) if p.pid)
        return time.process_time(), kids.ru_utime + kids.ru_stime, live

    def seconds(self) -> float:
        return sum(b - a for a, b in zip(self.start, self._parts()))


class HangGuard:
    """A run that takes longer than `seconds`: dump every thread's stack and exit (code 1)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self):
        faulthandler.dump_traceback_later(self.seconds, exit=True)
        return self

    def __exit__(self, *exc) -> None:
        faulthandler.cancel_dump_traceback_later()


def close(loader: PooledLoader) -> None:
    loader.close()
    gc.collect()


def replacements(loader: PooledLoader) -> tuple[int, list[str]]:
    s = loader.stats()
    return s["worker_replacements"], s["replacements"]


# -- 1. cost when nothing fails ------------------------------------------------------------------
def cost_run(ds, a, failover: dict | None) -> dict:
    loader = make_loader(ds, a, failover)
    with HangGuard(a.hang_s):
        for _ in loader:  # warm-up: workers start, first batch sized
            pass
        it = iter(loader)
        pids = [p.pid for p in it._workers]
        cpu = TreeCPU(it)
        t0, n, labels = time.perf_counter(), 0, []
        for e in range(a.epochs):
            if e:
                it = iter(loader)
            for images, y in it:
                n += len(y)
                labels.append(_digest(y.numpy().tobytes()))
        wall = time.perf_counter() - t0
        cpu_s = cpu.seconds()
        same_workers = [p.pid for p in it._workers] == pids
    got = replacements(loader)[0]
    close(loader)
    return {"rate": n / wall, "cpu_ms": cpu_s / n * 1e3, "images": n,
            "labels": _digest(b"".join(labels)).hex(), "replacements": got,
            "same_workers": same_workers}


# -- 2. time to replace one worker ---------------------------------------------------------------
def watch_replacement(it, k: int, old_pid: int, t_kill: float, out: dict,
                      stop: threading.Event) -> None:
    while not stop.is_set():
        p = it._workers[k]
        if p.pid is not None and p.pid != old_pid and p.is_alive():
            out["new_live_s"] = time.perf_counter() - t_kill
            out["new_pid"] = p.pid
            return
        time.sleep(0.0002)


def kill_run(ds, a, kill: int | None) -> dict:
    """One epoch after a warm-up; `kill`: the worker SIGKILLed after half the batches."""
    loader = make_loader(ds, a, FAILOVER)
    warned = len(LOG.lines)
    with HangGuard(a.hang_s):
        for _ in loader:
            pass
        it = iter(loader)
        half = len(loader) // 2
        digests, waits, n, out = [], [], 0, {}
        stop = threading.Event()
        poller = None
        t_kill = None
        cpu = TreeCPU(it)
        t0 = last = time.perf_counter()
        for i, (images, y) in enumerate(it):
            now = time.perf_counter()
            waits.append((now - last, t_kill is not None))
            if t_kill is not None and "next_batch_s" not in out:
                out["next_batch_s"] = now - t_kill
            n += len(y)
            digests.append(batch_digest(images, y))
            if kill is not None and i + 1 == half:
                old = it._workers[kill].pid
                t_kill = time.perf_counter()
                os.kill(old, signal.SIGKILL)
                poller = threading.Thread(target=watch_replacement,
                                          args=(it, kill, old, t_kill, out, stop), daemon=True)
                poller.start()
            last = time.perf_counter()
        wall = time.perf_counter() - t0
        cpu_s = cpu.seconds()
        stop.set()
        if poller is not None:
            poller.join()
    got, described = replacements(loader)
    close(loader)
    after = [w for w, killed in waits if killed]
    return {"wall": wall, "cpu_s": cpu_s, "images": n, "digests": digests, "replacements": got,
            "described": described, "warnings": len(LOG.lines) - warned,
            "new_live_s": out.get("new_live_s"), "next_batch_s": out.get("next_batch_s"),
            "max_wait_after_kill_s": max(after) if after else None,
            "median_wait_s": statistics.median(w for w, _ in waits)}


# -- 3. a kill every second ---------------------------------------------------------------------
def killer(it, every: float, rng: random.Random, kills: list, stop: threading.Event) -> None:
    while not stop.wait(every):
        live = [p.pid for p in list(it._workers) if live_child(p.pid)]
        if not live:
            continue
        pid = rng.choice(live)
        try:
            os.kill(pid, signal.SIGKILL)
            kills.append(time.perf_counter())
        except ProcessLookupError:
            pass


def storm_run(ds, a, kill_every: float | None, seed: int) -> dict:
    loader = make_loader(ds, a, dict(max_worker_restarts=100000, worker_timeout=30),
                         passes=a.passes)
    warned = len(LOG.lines)
    kills: list[float] = []
    stop = threading.Event()
    with HangGuard(a.hang_s):
        it = iter(loader)
        thread = None
        if kill_every:
            thread = threading.Thread(target=killer, daemon=True,
                                      args=(it, kill_every, random.Random(seed), kills, stop))
        digests, n = [], 0
        cpu = TreeCPU(it)
        t0 = last = time.perf_counter()
        if thread is not None:
            thread.start()
        for images, y in it:
            last = time.perf_counter()
            n += len(y)
            digests.append(batch_digest(images, y))
        end = time.perf_counter()
        stop.set()
        if thread is not None:
            thread.join()
        cpu_s = cpu.seconds()
    got, described = replacements(loader)
    close(loader)
    late = sum(t > last for t in kills)  # after the last batch: nothing left to wait for
    return {"rate": n / (end - t0), "wall": end - t0, "cpu_ms": cpu_s / n * 1e3,
            "cpu_s": cpu_s, "images": n, "digests": digests,
            "kills": len(kills) - late, "late_kills": late, "replacements": got,
            "described": described, "warnings": len(LOG.lines) - warned}


# -- report ---------------------------------------------------------------------------------------
def med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def fmt(x, nd=0, unit="") -> str:
    return "-" if x is None else f"{x:,.{nd}f}{unit}"


def per_round(xs, nd=0, scale=1.0) -> str:
    return ", ".join("-" if x is None else f"{x * scale:.{nd}f}" for x in xs)


def first_difference(a: list[bytes], b: list[bytes]) -> str:
    if len(a) != len(b):
        return f"{len(a)} batches against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            what = "labels" if x[:16] != y[:16] else "images"
            return f"batch {i} differs ({what})"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="ImageFolder of JPEGs, made when missing "
                                   "(default /tmp/pooled_failover, --quick: ..._quick)")
    ap.add_argument("--n", type=int, help="images to make when --data is missing (1536; "
                                           "--quick 512)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every part (3)")
    ap.add_argument("--epochs", type=int, default=None, help="timed epochs per run, part 1 (3)")
    ap.add_argument("--passes", type=int, default=None,
                    help="passes over the data in part 3's epoch (default: --storm-s)")
    ap.add_argument("--storm-s", type=float, default=None,
                    help="part 3's epoch length to aim at, seconds (8; --quick 5)")
    ap.add_argument("--kill-every", type=float, default=1.0, help="part 3's kill interval (s)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=300,
                    help="a run longer than this dumps the stacks and exits 1")
    ap.add_argument("--quick", action="store_true", help="smoke run: 512 images, 1 round")
    ap.add_argument("--json", help="write every run's figures there")
    a = ap.parse_args(argv)
    if a.rounds is not None and a.rounds < 1:
        ap.error("--rounds must be at least 1")
    a.data = a.data or ("/tmp/pooled_failover_quick" if a.quick else "/tmp/pooled_failover")
    a.n = a.n or (512 if a.quick else 1536)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.epochs = a.epochs or (1 if a.quick else 3)
    a.storm_s = a.storm_s or (5.0 if a.quick else 8.0)

    logger = logging.getLogger("pooled_loader")
    logger.addHandler(LOG)
    logger.propagate = False
    if not os.path.isdir(a.data):
        from make_dataset import make_dataset
        make_dataset(a.data, n=a.n, progress=False)
    ds = dataset(a.data)
    n_img = len(ds)
    print(f"{n_img} images in {a.data}, batch {a.batch}, {a.workers} workers, {a.rounds} "
          f"round(s), {os.cpu_count()} cores, torch {torch.__version__}, Python "
          f"{platform.python_version()}, batch hash {HASH}", flush=True)
    failures: list[str] = []
    notes: list[str] = []
    differs = False

    # 1.
    cost = {"plain": [], "failover": []}
    for r in range(a.rounds):
        order = [("plain", None), ("failover", FAILOVER)]
        if r % 2:
            order.reverse()
        for name, opts in order:
            cost[name].append(cost_run(ds, a, opts))
            x = cost[name][-1]
            print(f"1. round {r} {name:<8} {x['rate']:7.0f} img/s {x['cpu_ms']:.2f} CPU ms/img",
                  flush=True)
        p, f = cost["plain"][-1], cost["failover"][-1]
        if p["labels"] != f["labels"] or p["images"] != f["images"]:
            differs = True
            failures.append(f"part 1 round {r}: the failover loader's labels differ from plain's")
        if f["replacements"] or not f["same_workers"]:
            failures.append(f"part 1 round {r}: {f['replacements']} replacement(s) without a "
                            "failure")
    ratios = [f["rate"] / p["rate"] for p, f in zip(cost["plain"], cost["failover"])]
    cpu_ratios = [f["cpu_ms"] / p["cpu_ms"] for p, f in zip(cost["plain"], cost["failover"])]

    # 2.
    kills = {"none": [], "kill": []}
    for r in range(a.rounds):
        k = r % a.workers
        order = [("none", None), ("kill", k)]
        if r % 2:
            order.reverse()
        for name, victim in order:
            kills[name].append(kill_run(ds, a, victim))
            x = kills[name][-1]
            line = f"2. round {r} {name:<4} epoch {x['wall']:.2f} s, {x['cpu_s']:.2f} CPU-s"
            if victim is not None:
                line += (f", worker {k} killed: new live worker after "
                         f"{fmt(ms(x['new_live_s']), 1, ' ms')}, next batch after "
                         f"{fmt(ms(x['next_batch_s']), 1, ' ms')}, {x['replacements']} "
                         "replacement(s)")
            print(line, flush=True)
        base, hit = kills["none"][-1], kills["kill"][-1]
        diff = first_difference(base["digests"], hit["digests"])
        if diff:
            differs = True
            failures.append(f"part 2 round {r}: the kill epoch's {diff} from the no-kill epoch")
        if hit["replacements"] != 1 or hit["warnings"] != 1 or hit["new_live_s"] is None:
            failures.append(f"part 2 round {r}: one kill gave {hit['replacements']} "
                            f"replacement(s), {hit['warnings']} WARNING line(s), new worker "
                            f"{'seen' if hit['new_live_s'] is not None else 'never seen'}")
    extra = [h["wall"] - b["wall"] for b, h in zip(kills["none"], kills["kill"])]
    extra_cpu = [h["cpu_s"] - b["cpu_s"] for b, h in zip(kills["none"], kills["kill"])]

    # 3.
    if not a.passes:
        plain_rate = med(x["rate"] for x in cost["plain"]) or 0
        a.passes = max(2, math.ceil(a.storm_s * plain_rate / n_img))
    storm = {"none": [], "kill": []}
    for r in range(a.rounds):
        order = [("none", None), ("kill", a.kill_every)]
        if r % 2:
            order.reverse()
        for name, every in order:
            storm[name].append(storm_run(ds, a, every, seed=r))
            x = storm[name][-1]
            print(f"3. round {r} {name:<4} {x['rate']:7.0f} img/s over {x['wall']:.1f} s, "
                  f"{x['cpu_ms']:.2f} CPU ms/img"
                  + (f", {x['kills']} kills, {x['replacements']} replacements"
                     if every else ""), flush=True)
        base, hit = storm["none"][-1], storm["kill"][-1]
        diff = first_difference(base["digests"], hit["digests"])
        if diff or hit["images"] != a.passes * n_img:
            differs = True
            failures.append(f"part 3 round {r}: the killed epoch's {diff or 'length'} differs "
                            "from the no-kill epoch's")
        counts = (f"part 3 round {r}: {hit['kills']} kills before the last batch "
                  f"(+{hit['late_kills']} after it), {hit['replacements']} replacements, "
                  f"{hit['warnings']} WARNING lines")
        if hit["replacements"] > hit["kills"] or hit["warnings"] != hit["replacements"]:
            failures.append(counts)
        elif hit["replacements"] < hit["kills"]:
            notes.append(counts + " (a worker killed when no batch was left to wait for)")
    storm_ratio = [h["rate"] / b["rate"] for b, h in zip(storm["none"], storm["kill"])]
    per_kill = [(h["cpu_s"] - b["cpu_s"]) / h["kills"] if h["kills"] else None
                for b, h in zip(storm["none"], storm["kill"])]

    # table
    print(f"\n{n_img} JPEGs, torchvision ImageFolder(decode_image) + v2 RandomResizedCrop(224) "
          f"+ RandomHorizontalFlip (fused), batch {a.batch}, {a.workers} workers, "
          f"per_sample_seed=True, {a.rounds} round(s), {os.cpu_count()} cores, load average at "
          f"the end {os.getloadavg()[0]:.1f}; medians over rounds\n")
    fo = "max_worker_restarts=3, worker_timeout=30"
    rows = [
        ("1. images/s, plain (defaults 0, 0)", fmt(med(x["rate"] for x in cost["plain"])),
         per_round([x["rate"] for x in cost["plain"]])),
        (f"1. images/s, {fo}", fmt(med(x["rate"] for x in cost["failover"])),
         per_round([x["rate"] for x in cost["failover"]])),
        ("1. **cost when nothing fails** (1 - failover/plain images/s; goal <= 1 %)",
         fmt((1 - med(ratios)) * 100, 1, " %"), per_round([(1 - x) * 100 for x in ratios], 1)),
        ("1. CPU ms/image (tree), plain / failover",
         f"{fmt(med(x['cpu_ms'] for x in cost['plain']), 2)} / "
         f"{fmt(med(x['cpu_ms'] for x in cost['failover']), 2)}",
         per_round([(x - 1) * 100 for x in cpu_ratios], 1) + " (% more CPU)"),
        ("2. kill -> new live worker process (pid changed, is_alive())",
         fmt(ms(med(x["new_live_s"] for x in kills["kill"])), 1, " ms"),
         per_round([x["new_live_s"] for x in kills["kill"]], 1, 1e3)),
        ("2. kill -> next batch received by the loop",
         fmt(ms(med(x["next_batch_s"] for x in kills["kill"])), 1, " ms"),
         per_round([x["next_batch_s"] for x in kills["kill"]], 1, 1e3)),
        ("2. longest wait for a batch after the kill (no-kill median wait)",
         f"{fmt(ms(med(x['max_wait_after_kill_s'] for x in kills['kill'])), 0, ' ms')} "
         f"({fmt(ms(med(x['median_wait_s'] for x in kills['none'])), 0, ' ms')})",
         per_round([x["max_wait_after_kill_s"] for x in kills["kill"]], 0, 1e3)),
        ("2. epoch time, no kill", fmt(med(x["wall"] for x in kills["none"]), 2, " s"),
         per_round([x["wall"] for x in kills["none"]], 2)),
        ("2. **extra epoch time for one SIGKILL** (kill epoch - no-kill epoch)",
         fmt(med(extra) * 1e3, 0, " ms"), per_round(extra, 0, 1e3)),
        ("2. extra CPU for one SIGKILL (tree: kill epoch - no-kill epoch)",
         fmt(ms(med(extra_cpu)), 0, " ms"), per_round(extra_cpu, 0, 1e3)),
        (f"3. images/s, {a.passes} passes ({a.passes * n_img} images), no kills",
         fmt(med(x["rate"] for x in storm["none"])),
         per_round([x["rate"] for x in storm["none"]])),
        (f"3. images/s, a SIGKILL every {a.kill_every:g} s",
         fmt(med(x["rate"] for x in storm["kill"])),
         per_round([x["rate"] for x in storm["kill"]])),
        ("3. **throughput under kills** (killed / no-kill images/s)",
         fmt(med(storm_ratio), 3, "x"), per_round(storm_ratio, 3)),
        ("3. CPU ms/image (tree), no kills / kills",
         f"{fmt(med(x['cpu_ms'] for x in storm['none']), 2)} / "
         f"{fmt(med(x['cpu_ms'] for x in storm['kill']), 2)}",
         ", ".join(f"{b['cpu_ms']:.2f}/{h['cpu_ms']:.2f}"
                   for b, h in zip(storm["none"], storm["kill"]))),
        ("3. CPU per kill (tree: killed run - no-kill run, over the kills)",
         fmt(ms(med(per_kill)), 0, " ms"), per_round(per_kill, 0, 1e3)),
        ("3. kills / replacements (stats()['worker_replacements'])",
         f"{med(x['kills'] for x in storm['kill']):.0f} / "
         f"{med(x['replacements'] for x in storm['kill']):.0f}",
         ", ".join(f"{x['kills']}/{x['replacements']}" for x in storm["kill"])),
        ("batch sequences equal (1: labels; 2, 3: labels + image bytes against the no-kill "
         "run)", "FAIL" if differs else "PASS", ""),
    ]
    print("| measurement | median | per round |")
    print("| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\ncommand: python scripts/benchmarks/bench_failover.py {shlex.join(sys.argv[1:])}")
    if LOG.lines:
        print(f"\n{len(LOG.lines)} WARNING line(s) from logger 'pooled_loader'; the first:\n"
              f"  {LOG.lines[0].splitlines()[0]}")
    described = [d for x in kills["kill"] + storm["kill"] for d in x["described"]]
    if described:
        print(f"a replacement as stats()['replacements'] lists it: {described[0]}")
    for f in notes:
        print(f"NOTE: {f}")
    for f in failures:
        print(f"FAIL: {f}")
    print("PASS" if not failures else f"FAIL ({len(failures)} check(s))")
    if a.json:
        def strip(runs):
            return [{k: v for k, v in x.items() if k != "digests"} for x in runs]
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "argv": sys.argv, "cost": cost,
                       "kills": {k: strip(v) for k, v in kills.items()},
                       "storm": {k: strip(v) for k, v in storm.items()},
                       "failures": failures, "notes": notes}, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
