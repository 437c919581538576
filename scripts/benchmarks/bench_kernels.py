#!/usr/bin/env python
"""Benchmark of the fused crop -> resize -> flip -> CHW step (pooled_loader.vision.kernels).

Typical ImageNet case: src 400x500 HWC uint8, RandomResizedCrop-like boxes (8-100% of the area,
aspect 3/4..4/3), out 3x224x224 uint8 (or float32 normalized with --float), flip with p=0.5,
single thread.  The same boxes go through every path:

  c          pooled_loader.vision.kernels.crop_resize_flip_chw_c (compiled, with the Python
             argument checks)
  c_raw      the compiled _kernels function called directly (no Python checks)
  opencv     cv2.resize (INTER_AREA shrinking / INTER_LINEAR enlarging) into a scratch,
             cv2.flip(dst=), transpose copy into out (np.copyto) -- the plain OpenCV-with-dst path
  fallback   pooled_loader.vision.kernels.crop_resize_flip_chw_opencv (the library's fallback:
             one pass per axis when one shrinks and the other enlarges, cv2.split into the planes)
  pillow     Image.resize(BILINEAR, box=), transpose(FLIP_LEFT_RIGHT), np.asarray, copy to CHW
  c_before   with --baseline DIR: the compiled _kernels of another built checkout (e.g.
             `git worktree add /tmp/before <commit>` + build_ext --inplace there), called
             directly like c_raw: the kernel before a change, in the same run

Rounds interleave the paths (the machine may be shared); ops/s are medians over rounds.
Quality: mean/max abs difference of each path's uint8 output against Pillow's over the boxes.

    python scripts/benchmarks/bench_kernels.py [--rounds 7] [--boxes 200] [--float] [--json out.json]
                                    [--baseline OTHER_CHECKOUT] [--sources N]

--sources N: N copies of the source image at distinct addresses, box i reading copy i % N, so that
(with N = --boxes) every box reads an image that is not in the CPU cache, as the cache path does
(a memory-mapped cache file) -- the default, one source, stays in cache after the first box.
"""
import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def make_src(H=400, W=500, seed=0):
    """Photo-like content (smooth colour field + edges + noise); speed does not depend on it."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, (H // 20 + 2, W // 20 + 2, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize((W, H), Image.BICUBIC)).astype(np.int16)
    img[::37] = 255
    img[:, ::41] = 0
    img = img + rng.integers(-8, 9, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def rrc_boxes(H, W, n, seed=1, size=224):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        area = H * W * rng.uniform(0.08, 1.0)
        ar = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w = min(max(int(round(np.sqrt(area * ar))), 1), W)
        h = min(max(int(round(np.sqrt(area / ar))), 1), H)
        out.append(((int(rng.integers(0, W - w + 1)), int(rng.integers(0, H - h + 1)), w, h),
                    bool(rng.integers(2))))
    return out


def load_baseline_kernels(checkout):
    """The compiled _kernels module of another (built) checkout, under another module name."""
    import glob
    import importlib.machinery
    import importlib.util

    found = glob.glob(os.path.join(checkout, "pooled_loader", "vision", "_kernels*.so"))
    if not found:
        raise SystemExit(f"no built _kernels*.so under {checkout}/pooled_loader/vision "
                         f"(run python setup.py build_ext --inplace there)")
    loader = importlib.machinery.ExtensionFileLoader("baseline._kernels", found[0])
    spec = importlib.util.spec_from_file_location("baseline._kernels", found[0], loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def make_paths(src, out_dtype, size, baseline=None):
    import cv2
    from PIL import Image

    from pooled_loader.vision import kernels as K

    cv2.setNumThreads(1)
    oh = ow = size
    is_float = out_dtype == np.float32
    mean, std = (MEAN, STD) if is_float else (None, None)
    paths = {}

    if K._kernels is not None:
        raw = K._kernels.crop_resize_flip_chw
        m3 = tuple(MEAN) if is_float else None
        s3 = tuple(STD) if is_float else None

        def c(box, flip, out):
            K.crop_resize_flip_chw_c(src, box, out, flip, mean, std)

        def c_raw(box, flip, out):
            raw(src, box[0], box[1], box[2], box[3], out, flip, m3, s3)

        paths["c"] = c
        paths["c_raw"] = c_raw

    if baseline is not None:
        before = baseline.crop_resize_flip_chw
        m3b = tuple(MEAN) if is_float else None
        s3b = tuple(STD) if is_float else None

        def c_before(box, flip, out):
            before(src, box[0], box[1], box[2], box[3], out, flip, m3b, s3b)

        paths["c_before"] = c_before

    hwc = np.empty((oh, ow, 3), np.uint8)
    hwc2 = np.empty((oh, ow, 3), np.uint8)
    chw = np.empty((3, oh, ow), np.uint8)
    scale = (1.0 / (255.0 * np.array(STD))).astype(np.float32).reshape(3, 1, 1)
    bias = (-np.array(MEAN) / np.array(STD)).astype(np.float32).reshape(3, 1, 1)

    def opencv(box, flip, out):
        x0, y0, w, h = box
        interp = cv2.INTER_AREA if (w >= ow and h >= oh) else cv2.INTER_LINEAR
        r = cv2.resize(src[y0:y0 + h, x0:x0 + w], (ow, oh), dst=hwc, interpolation=interp)
        if flip:
            r = cv2.flip(r, 1, dst=hwc2)
        if is_float:
            np.copyto(chw, r.transpose(2, 0, 1))
            np.copyto(out, chw)
            np.multiply(out, scale, out=out)
            np.add(out, bias, out=out)
        else:
            np.copyto(out, r.transpose(2, 0, 1))

    paths["opencv"] = opencv

    def fallback(box, flip, out):
        K.crop_resize_flip_chw_opencv(src, box, out, flip, mean, std)

    paths["fallback"] = fallback

    pim = Image.fromarray(src)  # the decoded image, as a PIL pipeline would have it

    def pillow(box, flip, out):
        x0, y0, w, h = box
        im = pim.resize((ow, oh), Image.BILINEAR, box=(x0, y0, x0 + w, y0 + h))
        if flip:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
        a = np.asarray(im)
        if is_float:
            np.copyto(chw, a.transpose(2, 0, 1))
            np.copyto(out, chw)
            np.multiply(out, scale, out=out)
            np.add(out, bias, out=out)
        else:
            np.copyto(out, a.transpose(2, 0, 1))

    paths["pillow"] = pillow
    return paths


def quality(src, boxes, size, baseline=None):
    """Mean/max abs diff of each path's uint8 output vs Pillow's, over the boxes."""
    paths = make_paths(src, np.uint8, size, baseline)
    ref = np.empty((3, size, size), np.uint8)
    out = np.empty((3, size, size), np.uint8)
    res = {}
    for name, fn in paths.items():
        if name == "pillow":
            continue
        means, maxes = [], []
        for box, flip in boxes:
            paths["pillow"](box, flip, ref)
            fn(box, flip, out)
            d = np.abs(out.astype(np.int16) - ref.astype(np.int16))
            means.append(float(d.mean()))
            maxes.append(int(d.max()))
        res[name] = {"mean_abs_diff_avg": round(statistics.fmean(means), 3),
                     "mean_abs_diff_worst_box": round(max(means), 3),
                     "max_abs_diff": max(maxes)}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--boxes", type=int, default=200)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--float", action="store_true", help="float32 normalized output")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline", help="another built checkout: its kernel runs as c_before")
    ap.add_argument("--sources", type=int, default=1,
                    help="copies of the source, used in turn (N = --boxes: none in CPU cache)")
    args = ap.parse_args(argv)

    src = make_src()
    H, W = src.shape[:2]
    boxes = rrc_boxes(H, W, args.boxes, size=args.size)
    dtype = np.float32 if args.float else np.uint8
    baseline = load_baseline_kernels(args.baseline) if args.baseline else None
    srcs = [src] + [src.copy() for _ in range(args.sources - 1)]
    path_sets = [make_paths(s, dtype, args.size, baseline) for s in srcs]
    paths = path_sets[0]
    out = np.empty((3, args.size, args.size), dtype)
    names = list(paths)
    for name in names:  # warm up (scratch, weights, caches)
        for box, flip in boxes[:20]:
            paths[name](box, flip, out)

    rates = {n: [] for n in names}      # wall clock
    cpu_rates = {n: [] for n in names}  # this process's CPU time (robust on a shared machine)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for i, (box, flip) in enumerate(boxes):
                path_sets[i % len(path_sets)][name](box, flip, out)
            t1, c1 = time.perf_counter(), time.process_time()
            rates[name].append(len(boxes) / (t1 - t0))
            cpu_rates[name].append(len(boxes) / max(c1 - c0, 1e-9))

    med = {n: statistics.median(v) for n, v in rates.items()}
    cmed = {n: statistics.median(v) for n, v in cpu_rates.items()}
    q = quality(src, boxes, args.size, baseline)
    print(f"src {H}x{W} HWC uint8 ({len(srcs)} cop{'y' if len(srcs) == 1 else 'ies'}), out 3x{args.size}x{args.size} {np.dtype(dtype).name}, "
          f"{len(boxes)} RRC boxes (8-100% area), flip p=0.5, 1 thread, {args.rounds} rounds")
    isa = ""
    try:
        from pooled_loader.vision import _kernels
        isa = f", compiled ISA {_kernels.ISA}"
    except ImportError:
        pass
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs{isa}")
    print(f"{'path':10s} {'ops/s median':>13s} {'min':>7s} {'max':>7s} {'us/op':>7s} "
          f"{'cpu ops/s':>10s}   vs Pillow: mean abs diff (avg / worst box), max abs diff")
    for n in names:
        v = rates[n]
        qs = q.get(n)
        qtxt = (f"{qs['mean_abs_diff_avg']:.3f} / {qs['mean_abs_diff_worst_box']:.3f}, "
                f"{qs['max_abs_diff']}" if qs else "(reference)")
        print(f"{n:10s} {med[n]:13.0f} {min(v):7.0f} {max(v):7.0f} {1e6 / med[n]:7.1f} "
              f"{cmed[n]:10.0f}   {qtxt}")
    if "c" in med:
        for label, m in (("wall", med), ("cpu", cmed)):
            print(f"ratio ({label}) c/opencv = {m['c'] / m['opencv']:.2f}x, c/fallback = "
                  f"{m['c'] / m['fallback']:.2f}x, c/pillow = {m['c'] / m['pillow']:.2f}x")
            if "c_before" in m:
                print(f"ratio ({label}) c_raw/c_before = {m['c_raw'] / m['c_before']:.2f}x "
                      f"(this kernel vs the baseline's, both called directly)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ops_per_s_median": med, "ops_per_s_all": rates,
                       "cpu_ops_per_s_median": cmed, "quality_vs_pillow": q,
                       "size": args.size, "dtype": np.dtype(dtype).name, "boxes": len(boxes),
                       "rounds": args.rounds, "sources": len(srcs), "machine": platform.processor() or platform.machine(),
                       "loadavg": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
