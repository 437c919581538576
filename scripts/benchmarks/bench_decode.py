#!/usr/bin/env python
"""Compare JPEG decoders on one core: full-size and DCT-downscaled decode, images/s.

    python scripts/benchmarks/bench_decode.py [DIR] [--n 200] [--reps 5] [--turbojpeg-lib PATH]

DIR holds JPEGs (searched recursively; default: data/imagenet2k, made by scripts/tools/make_dataset.py
if missing).

Decoders: simplejpeg (into a reused buffer), PyTurboJPEG (needs the libturbojpeg shared library,
version >= 3.0 for PyTurboJPEG 2.x; pass its path if it is not on the loader path), OpenCV ``imdecode`` and Pillow (with ``draft`` for
the scaled rows). Reports the median over ``--reps`` passes of images/s by this process's CPU
time (one thread; robust when other work shares the machine).
"""
from __future__ import annotations

import argparse
import glob
import io
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(dir_: str, n: int) -> list[bytes]:
    paths = sorted(glob.glob(os.path.join(dir_, "**", "*.jp*g"), recursive=True))[:n]
    if not paths:
        raise SystemExit(f"no JPEGs under {dir_}")
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(f.read())
    return out


def _decoders(lib: str | None):
    import cv2
    import simplejpeg
    from PIL import Image

    cv2.setNumThreads(1)
    buf = np.empty(64 << 20, np.uint8)

    def sj(data: bytes, d: int):
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        oh, ow = -(-h // d), -(-w // d)
        return simplejpeg.decode_jpeg(data, min_factor=d, min_height=oh, min_width=ow,
                                      buffer=buf[: oh * ow * 3])

    def cv(data: bytes, d: int):
        flag = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2,
                4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}[d]
        return cv2.imdecode(np.frombuffer(data, np.uint8), flag)

    def pil(data: bytes, d: int):
        im = Image.open(io.BytesIO(data))
        if d > 1:
            im.draft("RGB", (im.width // d, im.height // d))
        return np.asarray(im.convert("RGB"))

    decs = {"simplejpeg": sj}
    try:
        from turbojpeg import TJPF_RGB, TurboJPEG

        tj = TurboJPEG(lib) if lib else TurboJPEG()

        def pytj(data: bytes, d: int):
            return tj.decode(data, pixel_format=TJPF_RGB,
                             scaling_factor=None if d == 1 else (1, d))
        decs["PyTurboJPEG"] = pytj
    except Exception as e:  # library missing: say so, keep going
        print(f"PyTurboJPEG unavailable: {e.__class__.__name__}: {str(e).splitlines()[0]}")
    decs["cv2.imdecode"] = cv
    decs["Pillow"] = pil
    return decs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", default=os.path.join(ROOT, "data", "imagenet2k"))
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--turbojpeg-lib", default=os.environ.get("TURBOJPEG_LIB"))
    a = p.parse_args(argv)
    if not glob.glob(os.path.join(a.dir, "**", "*.jp*g"), recursive=True):
        sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))
        from make_dataset import make_dataset

        make_dataset(a.dir, n=max(a.n, 2000), classes=10, progress=False)
    datas = _load(a.dir, a.n)
    print(f"{len(datas)} JPEGs from {a.dir}, mean {np.mean([len(d) for d in datas]) / 1e3:.0f} kB;"
          f" median of {a.reps} passes; images/s by CPU time, one thread; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    head = "".join(f"{'1/' + str(d):>10s}" for d in (1, 2, 4, 8))
    print(f"{'decoder':14s}{head}  (images/s)")
    for name, fn in _decoders(a.turbojpeg_lib).items():
        row = []
        for d in (1, 2, 4, 8):
            fn(datas[0], d)  # warm-up
            rates = []
            for _ in range(a.reps):
                t = time.process_time()  # CPU time: robust on a shared machine
                for data in datas:
                    fn(data, d)
                rates.append(len(datas) / max(time.process_time() - t, 1e-9))
            row.append(statistics.median(rates))
        print(f"{name:14s}" + "".join(f"{r:10.0f}" for r in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
