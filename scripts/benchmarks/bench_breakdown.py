#!/usr/bin/env python
"""Where one image's time goes in the JPEG pipeline: decode, kernel, the rest (one core).

    python scripts/benchmarks/bench_breakdown.py [--data data/imagenet2k] [--n 400] [--reps 5]
                                      [--baseline OTHER_CHECKOUT] [--cached]

For the first ``n`` JPEGs, with the same RandomResizedCrop(224) boxes and flips (seeded), in this
process (one thread, CPU time, median of ``reps`` passes, the variants interleaved):

- ``compose``: the whole per-sample transform, ``Compose([DecodeImage(), RandomResizedCrop(224),
  RandomHorizontalFlip(), ToCHW()])(data, out)``;
- ``decode``: header + box sampling + the decode Compose does (with the ROI decoder: only the
  crop's region, at the DCT scale; else the whole image at the DCT scale);
- ``kernel``: the fused crop-resize-flip-CHW kernel alone, on those decoded images;
- ``full decode``: the decode-alone ceiling, the whole image at full size (simplejpeg);
- ``entropy floor`` (ROI decoder only): a one-pixel region on the crop's last row, at the same
  DCT scale: libjpeg must Huffman-decode every row down to it across the full width (no restart
  markers to seek to), so this is the part of ``decode`` no region decoding can remove.

"Rest" of the loader's cost = 1 / (images per CPU-second of scripts/benchmarks/bench_images.py's ``ours``)
minus decode minus kernel.  ``--cached``: the same for the cache path's tail, RandomResizedCrop
from a source resized to max side 512 (the kernel alone; there is no decode).

``--baseline DIR`` runs the same measurement in another checkout (a subprocess with its
pooled_loader) and prints both, so before/after come from the same run; the two are alternated
``reps`` times.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkout_script(root: str) -> str:
    """This script in checkout `root` (scripts/benchmarks/, or scripts/ before the folders),
    else this file."""
    for sub in (("scripts", "benchmarks"), ("scripts",)):
        path = os.path.join(root, *sub, "bench_breakdown.py")
        if os.path.exists(path):
            return path
    return os.path.abspath(__file__)


def measure(data_dir: str, n: int, reps: int, cached: bool) -> dict:
    """Per-image CPU microseconds (medians over reps) for this process's pooled_loader."""
    import simplejpeg

    import pooled_loader.vision as V
    from pooled_loader.vision import decode as D
    from pooled_loader.vision.compose import dct_factor, scale_box
    from pooled_loader.vision.kernels import crop_resize_flip_chw

    paths = sorted(glob.glob(os.path.join(data_dir, "*", "*.jp*g")))[:n]
    datas = [open(p, "rb").read() for p in paths]
    rrc = V.RandomResizedCrop(224)
    out = np.empty((3, 224, 224), np.uint8)
    if cached:  # the cache path's sources: decoded, resized to max side 512 (uint8 HWC)
        front = V.Compose([V.DecodeImage(), V.Resize(max_side=512)])
        srcs = [np.ascontiguousarray(front(d)) for d in datas]
        rng = random.Random(0)
        jobs = []
        for s in srcs:
            random.seed(rng.random())
            jobs.append((s, rrc.box(*s.shape[:2]), rng.random() < 0.5))
        tail = V.Compose([rrc, V.RandomHorizontalFlip(), V.ToCHW()])

        def run_kernel():
            for s, box, flip in jobs:
                crop_resize_flip_chw(s, box, out, flip)

        def run_compose():
            random.seed(1)
            for s in srcs:
                tail(s, out)

        steps = {"kernel": run_kernel, "compose": run_compose}
    else:
        bufs = {}

        def alloc(nbytes, key=0):
            b = bufs.get(key)
            if b is None or b.size < nbytes:
                b = bufs[key] = np.empty(nbytes, np.uint8)
            return b[:nbytes]

        def plan(data, box_seed):  # header, the crop box (seeded) and the DCT scale Compose picks
            hdr = D.read_header(data)
            random.seed(box_seed)
            box = rrc.box(hdr.height, hdr.width)
            return hdr, box, dct_factor(box, (224, 224)) if hdr.jpeg else 1

        def decode_one(data, box_seed):
            hdr, box, factor = plan(data, box_seed)
            if hasattr(D, "decode_crop_into"):
                c = D.decode_crop_into(data, hdr, alloc, factor, box, (224, 224))
                return c.image, c.box
            img = D.decode_into(data, hdr, alloc, factor)
            full = (hdr.height, hdr.width)
            return img, (scale_box(box, full, img.shape[:2]) if img.shape[:2] != full else box)

        decoded = []
        for i, d in enumerate(datas):  # kept for the kernel step (copies: the buffer is reused)
            img, box = decode_one(d, i)
            decoded.append((img.copy(), box, i % 2 == 0))

        def run_decode():
            for i, d in enumerate(datas):
                decode_one(d, i)

        def run_kernel():
            for img, box, flip in decoded:
                crop_resize_flip_chw(img, box, out, flip)

        tf = V.Compose([V.DecodeImage(), rrc, V.RandomHorizontalFlip(), V.ToCHW()])

        def run_compose():
            random.seed(1)
            for d in datas:
                tf(d, out)

        fullbuf = np.empty(64 << 20, np.uint8)

        def run_full_decode():
            for d in datas:
                h, w = simplejpeg.decode_jpeg_header(d)[:2]
                simplejpeg.decode_jpeg(d, buffer=fullbuf[: h * w * 3])

        steps = {"decode": run_decode, "kernel": run_kernel, "compose": run_compose,
                 "full decode": run_full_decode}
        if getattr(D, "_jpeg", None) is not None:
            floor_jobs = []
            for i, d in enumerate(datas):
                hdr, box, factor = plan(d, i)
                x0, y0, bw, bh = (scale_box(box, (hdr.height, hdr.width),
                                            D.scaled_size(hdr, factor))
                                  if factor > 1 else box)
                floor_jobs.append((d, factor, x0, y0 + bh - 1))

            def run_entropy_floor():  # one pixel at the crop's last row: entropy decoding only
                for d, factor, x, y in floor_jobs:
                    D._jpeg.decode(d, fullbuf, factor, x, y, 1, 1)

            steps["entropy floor"] = run_entropy_floor
    for fn in steps.values():  # warm-up: buffers, plans, caches
        fn()
    times = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            t = time.process_time()
            fn()
            times[k].append((time.process_time() - t) / len(datas) * 1e6)
    res = {k: statistics.median(v) for k, v in times.items()}
    info = V.backend_info() if hasattr(V, "backend_info") else {"jpeg_decoder": "simplejpeg"}
    return {"us_per_image": res, "backends": info, "images": len(datas)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "imagenet2k"))
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cached", action="store_true", help="the cache path's tail instead")
    ap.add_argument("--baseline", default=None, help="another checkout to measure alike")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child mode
    a = ap.parse_args(argv)
    if a.one:
        print("BREAKDOWN " + json.dumps(measure(a.data, a.n, 1, a.cached)), flush=True)
        return 0
    roots = {"this": ROOT}
    if a.baseline:
        roots["baseline"] = os.path.abspath(a.baseline)
    runs = {k: [] for k in roots}
    for _ in range(a.reps):  # alternate the checkouts; one pass each, in a fresh process
        for name, root in roots.items():
            cmd = [sys.executable, checkout_script(root), "--one", "--data", a.data,
                   "--n", str(a.n)]
            if a.cached:
                cmd.append("--cached")
            env = dict(os.environ, PYTHONPATH=root)
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
            line = [x for x in p.stdout.splitlines() if x.startswith("BREAKDOWN ")]
            if not line:
                raise SystemExit(f"{name} failed:\n{p.stderr[-2000:]}")
            runs[name].append(json.loads(line[0][len("BREAKDOWN "):]))
    print(f"{a.n} JPEGs from {a.data}; {'cache path tail' if a.cached else 'JPEG pipeline'}; "
          f"us per image, CPU time, one thread, median of {a.reps} alternating runs; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    summary = {}
    for name, recs in runs.items():
        keys = recs[0]["us_per_image"].keys()
        med = {k: statistics.median(r["us_per_image"][k] for r in recs) for k in keys}
        summary[name] = med
        print(f"  {name:9s} " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
              + f"   [{recs[0]['backends']}]")
    if "baseline" in summary:
        b, t = summary["baseline"], summary["this"]
        print("  speedup   " + "  ".join(f"{k} {b[k] / t[k]:.2f}x" for k in t if k in b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
