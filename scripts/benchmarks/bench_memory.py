#!/usr/bin/env python
"""Memory of the file index in workers (copy-on-read) and of the whole image pipeline.

    python scripts/benchmarks/bench_memory.py [--sizes 2000 300000] [--workers 2] [--data DIR]

1. Copy-on-read. A folder of N files (hard links to one small JPEG, 1000 classes) is read for one
   shuffled epoch by PooledLoader workers (persistent, batch 256). Each worker's USS (private
   memory, /proc/PID/smaps) is taken after the first batch and after the epoch; the growth is
   what the worker copied of the parent's memory by touching it. Two indexes over the same files:
   ``vision.ImageFolder`` (file list in numpy buffers, ``pooled_loader.core.file_index``) and the
   torchvision-style reference, a list of ``(path, label)`` tuples read by the same loader.
2. Total PSS (main process + workers, sampled every 0.2 s, peak and mean over two epochs) of the
   ImageNet-style pipeline (decode, RandomResizedCrop 224, flip, CHW uint8; batch 256) with
   PooledLoader + vision against torch DataLoader + Pillow (scripts/benchmarks/peers.py's peer), on ``--data``
   (made with scripts/tools/make_dataset.py when missing). DALI and FFCV are measured when installed.

Every configuration runs in a fresh process. Prints a Markdown table (and ``--json PATH``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts", "benchmarks")]

BATCH = 256
LINKS_PER_FILE = 50_000


# -- 1. copy-on-read ----------------------------------------------------------------------------

def make_linked_folder(root: str, n: int, classes: int = 1000) -> str:
    """``root/n{N}/c{k}/{i}.jpg``: N hard links to a few JPEGs (made once, reused)."""
    import numpy as np
    from PIL import Image

    folder = os.path.join(root, f"n{n}")
    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return folder
    os.makedirs(folder, exist_ok=True)
    pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8)
    for k in range(classes):
        os.makedirs(os.path.join(folder, f"c{k:04d}"), exist_ok=True)
    for i in range(n):
        src = os.path.join(root, f"src{i // LINKS_PER_FILE}.jpg")  # ext4: 65,000 links a file
        if not os.path.exists(src):
            Image.fromarray(pixels).save(src)
        path = os.path.join(folder, f"c{i % classes:04d}", f"{i:07d}.jpg")
        if not os.path.exists(path):
            os.link(src, path)
    open(done, "w").close()
    return folder


class Head:
    """Transform: the first 16 bytes of the file (a fixed-size sample, no decoding)."""

    def __call__(self, data):
        return data[:16].copy()


class ListFolder:
    """torchvision's layout of the index: ``samples``, a list of ``(path, label)`` tuples."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        import numpy as np
        path, label = self.samples[i]
        return np.fromfile(path, np.uint8)[:16].copy(), label


def uss_mb(pid: int) -> float:
    import psutil
    return psutil.Process(pid).memory_full_info().uss / 2**20


def one_cow(kind: str, folder: str, workers: int) -> dict:
    import warnings

    import torch
    from pooled_loader import PooledLoader
    from pooled_loader.vision import ImageFolder

    warnings.simplefilter("ignore")
    ds = ImageFolder(folder, transform=Head())
    if kind == "list":
        ds = ListFolder(list(ds.samples))
    loader = PooledLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers,
                          persistent_workers=True, generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    next(it)
    pids = [p.pid for p in it._workers]
    start = [uss_mb(p) for p in pids]
    seen = BATCH
    t0 = time.perf_counter()
    for batch in it:
        seen += len(batch[1])
    end = [uss_mb(p) for p in pids]
    loader.close()
    assert seen == len(ds), (seen, len(ds))
    return {"kind": kind, "files": len(ds), "growth_mb": [e - s for s, e in zip(start, end)],
            "epoch_s": time.perf_counter() - t0}


# -- 2. total PSS of the image pipeline ------------------------------------------------------------

def tree_pss_mb(pid: int) -> float:
    import psutil
    root = psutil.Process(pid)
    total = 0.0
    for p in [root] + root.children(recursive=True):
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total / 2**20


def one_pss(peer: str, data: str, workers: int, epochs: int = 2) -> dict:
    import warnings

    import peers

    warnings.simplefilter("ignore")
    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(tree_pss_mb(os.getpid()))
            stop.wait(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    run = {"ours": peers.run_ours, "torch": peers.run_torch_pil, "dali": peers.run_dali,
           "ffcv": peers.run_ffcv_jpg}[peer]
    try:
        rates = run(data, batch=BATCH, workers=workers, epochs=epochs, warmup=0)
    except peers.PeerUnavailable as e:
        return {"peer": peer, "unavailable": str(e)}
    finally:
        stop.set()
        thread.join()
    return {"peer": peer, "peak_mb": max(samples), "mean_mb": sum(samples) / len(samples),
            "images_per_s": max(rates)}


# -- driver -----------------------------------------------------------------------------------

def child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", *args], capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2000, 300_000])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tmp", default="/tmp/pooled_loader_bench_memory")
    p.add_argument("--data", default=None, help="JPEG ImageFolder for the PSS part "
                   "(default: 1000 images made in --tmp)")
    p.add_argument("--peers", nargs="+", default=["ours", "torch", "dali", "ffcv"])
    p.add_argument("--skip-pss", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        kind, *rest = a.one
        if kind == "cow":
            print(json.dumps(one_cow(rest[0], rest[1], int(rest[2]))))
        else:
            print(json.dumps(one_pss(rest[0], rest[1], int(rest[2]))))
        return 0
    os.makedirs(a.tmp, exist_ok=True)
    results: dict = {"cow": [], "pss": []}
    print(f"| files | index | per-worker USS growth over one epoch (MB) | epoch s |")
    print("| ---: | --- | --- | ---: |")
    for n in a.sizes:
        folder = make_linked_folder(a.tmp, n)
        for kind in ("fileindex", "list"):
            r = child(["cow", kind, folder, str(a.workers)])
            results["cow"].append(r)
            name = "ImageFolder (numpy index)" if kind == "fileindex" else "list of tuples (ref.)"
            print(f"| {n:,} | {name} | {', '.join(f'{g:.1f}' for g in r['growth_mb'])} | "
                  f"{r['epoch_s']:.1f} |", flush=True)
    if not a.skip_pss:
        data = a.data
        if data is None:
            data = os.path.join(a.tmp, "jpeg1000")
            if not os.path.isdir(data):
                from make_dataset import make_dataset
                make_dataset(data, n=1000, classes=10, seed=0)
        print(f"\n| loader ({a.workers} workers, {data}) | peak PSS MB | mean PSS MB | "
              "images/s |")
        print("| --- | ---: | ---: | ---: |")
        for peer in a.peers:
            r = child(["pss", peer, data, str(a.workers)])
            results["pss"].append(r)
            if "unavailable" in r:
                print(f"| {peer} | not installed: {r['unavailable'][:80]} | | |", flush=True)
            else:
                print(f"| {peer} | {r['peak_mb']:.0f} | {r['mean_mb']:.0f} | "
                      f"{r['images_per_s']:.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
