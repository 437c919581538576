#!/usr/bin/env python
"""The main job on a small embedded default: build a demo JPEG dataset, then run PooledLoader
against torch DataLoader (image pipeline, then raw transport) and print the tables.

    python scripts/demo.py [--n 512] [--data data/demo] [--workers 2] [--batch 128]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "benchmarks"), os.path.join(HERE, "tools"),
                 os.path.dirname(HERE)]

import bench  # noqa: E402
import bench_images  # noqa: E402
from make_dataset import make_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="demo images to make")
    parser.add_argument("--data", default=os.path.join(os.path.dirname(HERE), "data", "demo"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    marker = os.path.join(args.data, f".complete-{args.n}")
    if not os.path.exists(marker):
        print(f"Making {args.n} ImageNet-like JPEGs in {args.data} ...", flush=True)
        make_dataset(args.data, n=args.n, classes=10, seed=0)
        open(marker, "w").close()
    print("\n== Image pipeline: decode + RandomResizedCrop(224) + flip -> uint8 CHW ==", flush=True)
    status = bench_images.main(["--data", args.data, "--only", "ours,torch_pil", "--epochs", "3",
                                "--batch", str(args.batch), "--workers", str(args.workers),
                                "--require", "ours"])
    if status:
        return status  # PooledLoader could not run: bench_images printed why, on one line
    print("\n== Transport only: precomputed 224x224x3 uint8 samples ==", flush=True)
    try:
        return bench.main(["--samples", "4096", "--rounds", "1", "--batch", str(args.batch),
                           "--workers", str(args.workers)])
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        print(f"error: the transport benchmark failed: {lines[-1] if lines else exc}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
