#!/usr/bin/env python
"""Ray Data image pipelines, same run, same local Ray cluster: what Ray's docs teach, ours on
Ray (``pooled_loader.ray``), PooledLoader alone, and torch's DataLoader.

    python scripts/benchmarks/bench_ray.py [--data DIR] [--n 2048] [--rounds 3] [--cpus N]
        [--concurrency K] [--batch 64] [--only a,b,c,dl]

One ``ray.init(num_cpus=N)`` (N: ``os.cpu_count()`` unless ``--cpus``), no dashboard, progress
bars off. ImageNet-like JPEGs (``scripts/tools/make_dataset.py``, made under ``--data`` when it
is not there), one transform for every row: torchvision v1 ``Compose([RandomResizedCrop(224),
RandomHorizontalFlip(), ToTensor(), Normalize(ImageNet)])``, batches of 64:

- (a) Ray's docs: ``ray.data.read_images(root, include_paths=True, mode="RGB")``, then
  ``map_batches(fn, batch_size=64, batch_format="numpy")`` where ``fn`` gives each row its label
  from its folder's name (as Ray's image-classification example does) and applies the
  torchvision transform to each image of the batch (``Image.fromarray``, then ``np.stack``),
  consumed by ``iter_torch_batches(batch_size=64)``. A function UDF: Ray runs it as tasks fused
  with the read (Ray's default concurrency).
- (b) ours: ``read_image_folder(root).map_batches(transform(t), batch_size=64,
  batch_format="numpy")`` (tasks, as docs/ray.md teaches: Ray's long-lived workers, the read
  and the UDF fused in one task) consumed by ``from_ray(ds, batch_size=64, columns=("image",
  "label", "row_id"))`` (``row_id`` only for the check below). ``--concurrency K`` runs the UDF's
  class on K actors instead: ``read_image_folder(root, num_cpus=R).map_batches(type(udf),
  concurrency=K, num_cpus=min(1, (N - R) / K), ...)`` (R: ``--read-cpus``, default 0.25; with
  Ray's defaults, reads and actors of 1 CPU, and K = N, the actors hold every CPU, the reads are
  never scheduled and the first epoch hangs; hence R and the actors' share).
- (c) ``PooledLoader(ImageFolder(root, transform=t), batch_size=64, num_workers=N,
  shuffle=True)`` (the fused path serves it by itself); dl: the same with torch's DataLoader.

Each round, each row runs a warm-up epoch and then the timed one, in this process against the
same cluster (row order reversed in odd rounds). The warm-up starts Ray's worker processes and
imports; Ray Data builds a fresh executor per epoch, so with ``--concurrency`` the map_batches
actors of (b) are started again inside every epoch, timed one included (column "1st batch": the
wait for the first batch).
Figures: images/s (wall clock of the epoch) and images per CPU-second: user + system CPU
seconds, during the epoch, of this process (less the meter's own thread), its descendants and
every Ray process (raylet, gcs_server, ray::* workers and actors, Ray's Python agents), sampled
by psutil every 0.2 s so that a process exiting mid-epoch (an actor torn down when the epoch
ends) counts up to its last sample (the error: at most its last 0.2 s). For (c) and dl the CPU
is this process and its loader workers; the idle Ray cluster's CPU during their epochs is shown
apart ("idle Ray"), not counted. Medians over rounds; ratios are taken per round, then the
median. (a) and (b) must deliver every image exactly once per epoch (row ids counted), or the
script fails.

From the measured images per CPU-second: the CPU cores that would feed one 8-GPU node at
50,000 images/s (cores = 50,000 / images per CPU-second).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ROWS = {"a": "(a) Ray docs: read_images + map_batches(torchvision) + iter_torch_batches",
        "b": "(b) ours: read_image_folder + map_batches(transform) + from_ray",
        "c": "(c) PooledLoader(ImageFolder), no Ray",
        "dl": "DataLoader(ImageFolder), no Ray"}
GOALS = {"b/a": 2.5, "b/c": 0.8}
NODE_RATE = 50_000  # images/s one 8-GPU node eats
INTERVAL = 0.2  # seconds between CPU samples


# -- CPU of the whole cluster -------------------------------------------------------------------
def _ray_like(name: str, cmdline: list[str]) -> bool:
    """A process of Ray's: its workers/actors (proctitle ``ray::...``), raylet, gcs_server and
    Ray's Python agents (log monitor, dashboard agent, runtime-env agent...)."""
    if name.startswith("ray::") or name in ("raylet", "gcs_server"):
        return True
    cmd = " ".join(cmdline)
    return cmd.startswith("ray::") or f"{os.sep}ray{os.sep}" in cmd


class ClusterCPU:
    """User + system CPU seconds of this process and its descendants (which, with a local
    ``ray.init``, are every process of this Ray cluster: gcs_server, raylet, Ray's agents, and
    the raylet's workers and actors) between start() and stop(), split into "ray" (the processes
    that are Ray's by name or command line, and theirs) and "local" (this process, less this
    meter's thread, and its other descendants: loader workers). Ray processes that are not
    descendants belong to another cluster on a shared machine: not counted (``others``: how
    many were seen).

    Sampled every INTERVAL seconds: a process counts from its first sample (0 when born after
    start()) to its last. A process gone by stop() (an actor torn down at the end of the epoch,
    a loader worker) is counted through its parent's reaped-children CPU (``cutime``) when the
    parent waited for it, else up to its last sample (the error: at most its last INTERVAL)."""

    def __init__(self) -> None:
        import psutil
        self.psutil, self.me = psutil, psutil.Process()
        self._ray_cache: dict[tuple[int, float], bool] = {}
        self._first: dict[tuple[int, float], tuple[float, float]] = {}  # (cpu, cutime)
        self._last: dict[tuple[int, float], tuple[float, float, int, str]] = {}  # + ppid, group
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.meter_s = 0.0  # the sampler thread's own CPU
        self.samples = 0
        self.others = 0  # Ray processes on this machine that are not this cluster's

    def _is_ray(self, proc, key, name: str) -> bool:
        got = self._ray_cache.get(key)
        if got is None:
            try:
                cmdline = proc.cmdline()
            except self.psutil.Error:
                cmdline = []
            got = self._ray_cache[key] = _ray_like(name, cmdline)
        return got

    def _snapshot(self) -> dict[tuple[int, float], tuple[float, float, int, str]]:
        ps, me = self.psutil, self.me.pid
        procs = {p.info["pid"]: p for p in ps.process_iter(["pid", "ppid", "name",
                                                             "create_time"])}
        group: dict[int, str | None] = {me: "local"}

        def which(pid: int) -> str | None:
            """'ray', 'local' or None (not ours), by the process and its ancestors."""
            if pid in group:
                return group[pid]
            p = procs.get(pid)
            if p is None:
                return None
            parent = p.info["ppid"]
            group[pid] = None  # cycles cannot happen, but stay safe
            up = which(parent) if parent and parent != pid else None
            if up is not None and self._is_ray(p, (pid, p.info["create_time"]),
                                               p.info["name"] or ""):
                up = "ray"
            group[pid] = up
            return up

        out, others = {}, 0
        for pid, p in procs.items():
            g = which(pid)
            if g is None:
                others += self._is_ray(p, (pid, p.info["create_time"]), p.info["name"] or "")
                continue
            try:
                t = p.cpu_times()
            except ps.Error:
                continue
            out[(pid, p.info["create_time"])] = (t.user + t.system,
                                                 t.children_user + t.children_system,
                                                 p.info["ppid"], g)
        self.others = max(self.others, others)
        return out

    def _take(self, first: bool = False) -> dict:
        snap = self._snapshot()
        self.samples += 1
        for key, v in snap.items():
            if first:
                self._first[key] = v[:2]
            self._last[key] = v
        return snap

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(INTERVAL):
            self._take()
        self.meter_s = time.thread_time() - t0

    def start(self) -> None:
        self._first.clear()
        self._last.clear()
        self.samples = self.others = 0
        self._stop.clear()
        self._take(first=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        t0 = time.thread_time()
        self._stop.set()
        self._thread.join()
        end = self._take()
        meter = self.meter_s + (time.thread_time() - t0)
        split = {"ray": 0.0, "local": 0.0, "gone": 0}
        gone: dict[int, list] = {}  # parent pid -> its children gone by the end
        for key, (cpu, cut, ppid, g) in self._last.items():
            f_cpu, f_cut = self._first.get(key, (0.0, 0.0))
            if key in end:
                split[g] += cpu - f_cpu
            else:
                gone.setdefault(ppid, []).append((cpu - f_cpu, f_cpu + f_cut, g))
                split["gone"] += 1
        for key, (cpu, cut, ppid, g) in end.items():
            reaped = cut - self._first.get(key, (0.0, 0.0))[1]
            kids = gone.pop(key[0], [])
            # the parent's cutime holds its waited-for children's whole lives: less what they
            # had at start(); a parent that did not wait for them: their sampled share
            split[g] += max(reaped - sum(k[1] for k in kids), sum(k[0] for k in kids), 0.0)
        for kids in gone.values():  # their parent is gone too, or not ours
            for seen, _, g in kids:
                split[g] += seen
        split["local"] -= meter
        split["meter"] = meter
        return split


# -- the pipelines ------------------------------------------------------------------------------
def make_transform():
    import torchvision.transforms as T
    return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                      T.Normalize(MEAN, STD)])


def list_folder(root: str) -> tuple[list[str], dict[str, int]]:
    """ImageFolder's classes and files (its order), as ``class/file`` keys."""
    from torchvision.datasets import ImageFolder
    ds = ImageFolder(root)
    keys = [os.path.relpath(p, root).replace(os.sep, "/") for p, _ in ds.samples]
    return keys, ds.class_to_idx


def docs_dataset(root: str, t, batch: int):
    """(a): Ray's documented way. Each row also carries ``id`` (its ImageFolder index, looked up
    from its path) for the exactly-once check."""
    import ray.data
    from PIL import Image
    keys, class_to_idx = list_folder(root)
    index = {k: i for i, k in enumerate(keys)}

    def preprocess(b: dict) -> dict:
        paths = [str(p) for p in b["path"]]
        tail = ["/".join(p.replace(os.sep, "/").rsplit("/", 2)[-2:]) for p in paths]
        return {"image": np.stack([t(Image.fromarray(img)).numpy() for img in b["image"]]),
                "label": np.array([class_to_idx[k.split("/")[0]] for k in tail], np.int64),
                "id": np.array([index[k] for k in tail], np.int64)}

    ds = ray.data.read_images(root, include_paths=True, mode="RGB")
    return ds.map_batches(preprocess, batch_size=batch, batch_format="numpy"), len(keys)


def run_docs(state: dict, n: int, batch: int) -> tuple[int, float]:
    got, first = [], None
    t0 = time.perf_counter()
    for b in state["ds"].iter_torch_batches(batch_size=batch):
        if first is None:
            first = time.perf_counter() - t0
        got.append(b["id"].numpy())
    check_once("a", np.concatenate(got) if got else np.zeros(0, np.int64), n)
    return n, first


def actor_cpus(cpus: int, concurrency: int, read_cpus: float) -> float:
    """CPUs each map_batches actor of (b) reserves: 1, or less when K actors and one read task
    would not fit in the cluster (Ray Data then never schedules the reads: the epoch hangs)."""
    return min(1.0, (cpus - read_cpus) / concurrency)


def ours_loader(root: str, t, batch: int, concurrency: int, cpus: int, read_cpus: float):
    """(b): our reader, our UDF on K actors, our consumer."""
    from pooled_loader.ray import from_ray, read_image_folder
    from pooled_loader.ray.udf import transform
    if concurrency == 0:  # tasks (the default): Ray's long-lived workers, read and UDF fused
        ds = read_image_folder(root).map_batches(transform(t), batch_size=batch,
                                                 batch_format="numpy")
    else:
        ds = read_image_folder(root, num_cpus=read_cpus).map_batches(
            type(transform(t)), concurrency=concurrency,
            num_cpus=actor_cpus(cpus, concurrency, read_cpus),
            batch_size=batch, batch_format="numpy")
    return from_ray(ds, batch_size=batch, columns=("image", "label", "row_id"))


def run_ours(state: dict, n: int, batch: int) -> tuple[int, float]:
    got, first = [], None
    t0 = time.perf_counter()
    for images, labels, rows in state["loader"]:
        if first is None:
            first = time.perf_counter() - t0
        got.append(np.asarray(rows))
    check_once("b", np.concatenate(got) if got else np.zeros(0, np.int64), n)
    return n, first


def run_loader(state: dict, n: int, batch: int) -> tuple[int, float]:
    count, first = 0, None
    t0 = time.perf_counter()
    for images, labels in state["loader"]:
        if first is None:
            first = time.perf_counter() - t0
        count += len(images)
    if count != n:
        raise SystemExit(f"error: {state['name']} delivered {count} images, expected {n}")
    return count, first


def check_once(name: str, ids: np.ndarray, n: int) -> None:
    """Every image of the epoch exactly once, or exit loudly."""
    counts = np.bincount(ids, minlength=n) if len(ids) else np.zeros(n, np.int64)
    if len(ids) != n or len(counts) != n or not (counts == 1).all():
        missing = int((counts[:n] == 0).sum())
        repeated = int((counts > 1).sum())
        raise SystemExit(f"error: ({name}) delivered {len(ids)} rows for {n} images: "
                         f"{missing} missing, {repeated} repeated, "
                         f"{max(0, len(counts) - n)} out of range")


def _join(xs, nd: int = 1) -> str:
    return ", ".join(f"{x:.{nd}f}" for x in xs)


# -- the run ------------------------------------------------------------------------------------
def epoch(meter: ClusterCPU, run, state: dict, n: int, batch: int) -> dict:
    gc.collect()
    meter.start()
    t0 = time.perf_counter()
    count, first = run(state, n, batch)
    wall = time.perf_counter() - t0
    cpu = meter.stop()
    return {"images": count, "wall": wall, "first": first, **cpu, "samples": meter.samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=None, help="ImageFolder of JPEGs (default: "
                    "/tmp/pooled_ray_<n>, made with scripts/tools/make_dataset.py)")
    ap.add_argument("--n", type=int, default=2048, help="images to make when --data is absent")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpus", type=int, default=os.cpu_count(), help="ray.init(num_cpus=N) "
                    "and the workers of (c) and dl")
    ap.add_argument("--concurrency", type=int, default=0,
                    help="run (b)'s UDF on K map_batches actors (default 0: as tasks)")
    ap.add_argument("--read-cpus", type=float, default=0.25,
                    help="num_cpus of (b)'s read tasks (Ray's default is 1: with K = N actors "
                    "of 1 CPU the reads never run and the epoch hangs; the actors then reserve "
                    "(N - this) / K each)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--only", default="", help="comma-separated rows: a,b,c,dl")
    a = ap.parse_args()
    names = [x for x in ROWS if not a.only or x in a.only.split(",")]
    bad = [x for x in a.only.split(",") if x and x not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; known: {', '.join(ROWS)}")
    data = os.path.abspath(a.data or f"/tmp/pooled_ray_{a.n}")
    if not os.path.isdir(data):
        from make_dataset import make_dataset
        print(f"making {a.n} JPEGs in {data}", flush=True)
        make_dataset(data, n=a.n, progress=False)
    print("command: python scripts/benchmarks/bench_ray.py " + " ".join(sys.argv[1:]), flush=True)

    import psutil  # noqa: F401 - the meter needs it; fail here, not after Ray started
    import ray
    import ray.data
    import torch
    import torchvision
    from torch.utils.data import DataLoader

    from pooled_loader import PooledLoader

    ray.init(num_cpus=a.cpus, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)

    t = make_transform()
    keys, _ = list_folder(data)
    n = len(keys)
    meter = ClusterCPU()
    states: dict[str, dict] = {}
    runs = {"a": run_docs, "b": run_ours, "c": run_loader, "dl": run_loader}

    def fresh(name: str) -> dict:
        """A row's pipeline for one round: Ray's datasets are lazy plans (each epoch a new
        execution), the loaders are made anew (their workers start in the warm-up)."""
        if name == "a":
            if "a" not in states:
                ds, count = docs_dataset(data, t, a.batch)
                if count != n:
                    raise SystemExit(f"error: (a) lists {count} images, ImageFolder {n}")
                states["a"] = {"name": "a", "ds": ds}
            return states["a"]
        if name == "b":
            return {"name": "b", "loader": ours_loader(data, t, a.batch, a.concurrency, a.cpus,
                                                       a.read_cpus)}
        folder = torchvision.datasets.ImageFolder(data, transform=t)
        cls = PooledLoader if name == "c" else DataLoader
        return {"name": name, "loader": cls(folder, batch_size=a.batch, num_workers=a.cpus,
                                            shuffle=True)}

    print(f"{n} images in {data}; batch {a.batch}; Ray {ray.__version__} with num_cpus="
          f"{a.cpus}; (b) " + (f"on {a.concurrency} actors of "
          f"{actor_cpus(a.cpus, a.concurrency, a.read_cpus):.3g} CPU, reads of {a.read_cpus:g} "
          "CPU" if a.concurrency else "as tasks") + f"; torch {torch.__version__}, torchvision "
          f"{torchvision.__version__}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.2f}",
          flush=True)
    res: dict[str, list[dict]] = {x: [] for x in names}
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            state = fresh(name)
            warm = epoch(meter, runs[name], state, n, a.batch)
            got = epoch(meter, runs[name], state, n, a.batch)
            loader = state.get("loader")
            if loader is not None:
                close = getattr(loader, "close", None)
                if callable(close):
                    close()
            del state, loader
            got["warm_wall"] = warm["wall"]
            used = got["local"] + (got["ray"] if name in ("a", "b") else 0.0)
            got["cpu"] = used
            got["per_cpu"] = got["images"] / used
            got["rate"] = got["images"] / got["wall"]
            res[name].append(got)
            print(f"round {r} {name:2s}: {got['rate']:6.0f} img/s  {got['per_cpu']:6.1f} "
                  f"img/CPU-s  CPU {used:6.2f}s (Ray {got['ray']:.2f}s, local {got['local']:.2f}"
                  f"s, meter {got['meter']:.2f}s, {got['gone']} gone, {meter.others} other Ray "
                  f"processes)  wall {got['wall']:.2f}s  1st batch "
                  f"{got['first']:.2f}s  warm-up wall {warm['wall']:.2f}s  load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    ray.shutdown()

    med = {k: {f: statistics.median(x[f] for x in v) for f in
               ("rate", "per_cpu", "cpu", "ray", "first", "wall")} for k, v in res.items() if v}

    def ratio(num: str, den: str, field: str) -> tuple[float, list[float]] | None:
        if num not in res or den not in res:
            return None
        per = [x[field] / y[field] for x, y in zip(res[num], res[den])]
        return statistics.median(per), per

    print(f"\n{n} images, batch {a.batch}, Ray num_cpus={a.cpus}, (b) "
          f"{f'on {a.concurrency} actors' if a.concurrency else 'as tasks'}, {a.rounds} rounds (medians), one warm-up epoch before each timed "
          f"one; load average at the end {os.getloadavg()[0]:.1f}")
    print("| row | images/s | images/CPU-s | CPU-s/epoch | of which Ray | 1st batch s "
          "| img/CPU-s per round |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for k, m in med.items():
        ray_s = f"{m['ray']:.2f}" if k in ("a", "b") else f"(idle Ray {m['ray']:.2f}, not counted)"
        print(f"| {ROWS[k]} | {m['rate']:,.0f} | {m['per_cpu']:.1f} | {m['cpu']:.2f} | {ray_s} "
              f"| {m['first']:.2f} | {_join(x['per_cpu'] for x in res[k])} |")
    print()
    print("| ratio | per CPU-second | images/s | goal (per CPU-second) |")
    print("| --- | ---: | ---: | --- |")
    for num, den in (("b", "a"), ("b", "c"), ("c", "dl"), ("a", "dl")):
        cpu, rate = ratio(num, den, "per_cpu"), ratio(num, den, "rate")
        if cpu is None:
            continue
        goal = GOALS.get(f"{num}/{den}")
        verdict = "" if goal is None else f"{'PASS' if cpu[0] >= goal else 'MISS'} >= {goal}x"
        print(f"| ({num})/({den}) | {cpu[0]:.2f}x ({_join(cpu[1], 2)}) "
              f"| {rate[0]:.2f}x ({_join(rate[1], 2)}) | {verdict} |")
    print()
    for k in ("a", "b", "c"):
        if k in med:
            print(f"cores to feed one 8-GPU node at {NODE_RATE:,} img/s with "
                  f"{ROWS[k].split(':')[0]}: {NODE_RATE / med[k]['per_cpu']:,.0f} "
                  f"(at {med[k]['per_cpu']:.1f} images per CPU-second)")


if __name__ == "__main__":
    main()
