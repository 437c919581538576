#!/usr/bin/env python
"""Image-loading benchmark: our PooledLoader against its peers, in one run.

    python scripts/benchmarks/bench_images.py --data DIR [--epochs 3] [--warmup 1] [--rounds 1]
                                   [--only NAME,...] [--json OUT] [--batch 256] [--workers 2]
                                   [--baseline OTHER_CHECKOUT] [--pillow-simd PYTHON]

Every loader (see scripts/benchmarks/peers.py: ours, ours_cached, torch_pil, torch_decode_jpeg,
webdataset, dali, dali_fused,
ffcv_jpg, ffcv_raw, ceiling, ceiling_dct) does decode + RandomResizedCrop(224) + flip -> uint8 CHW
batches over the same ImageFolder. Each runs in its own fresh Python process (so one library's
threads, JIT or crash cannot touch another's numbers), does `warmup` untimed epochs and then
`epochs` timed ones; its figure is the median images/s of the timed epochs. With --rounds R the
whole comparison is repeated R times (loaders interleaved, so slow drift in machine load spreads
over all of them) and the figure is the median over the R per-round medians. A loader whose library
is missing is listed as unavailable with the reason; the others still run.
With --baseline DIR, ours and ours_cached also run from that checkout (rows "...@before", right
after their own row in even rounds and right before it in odd ones), so a change is measured
against the code before it in the same run.  The backends each checkout uses
(pooled_loader.vision.backend_info(): ROI decoder or simplejpeg, kernel ISA) are printed first.
With --pillow-simd PYTHON (an interpreter whose Pillow is Pillow-SIMD, e.g. a venv made with
`--system-site-packages` and `CC="cc -mavx2" pip install --no-binary :all: pillow-simd`), the
torch DataLoader + Pillow recipe also runs there, as row "torch_pil@simd", right after torch_pil.

The table's "x ours" column is this loader's images/s divided by ours from the same round
(median over rounds); "ceiling" rows are an upper bound, not a loader.  Load averages before and
after each loader are recorded in the JSON, as the machine may be shared.

On a shared machine wall-clock images/s moves with other people's jobs, so the harness also
reports images per CPU-second: the CPU time (user + system) of the loader's whole process tree
(main process, threads, workers) during the timed epochs.  "x N cores" is that times the usable
cores: a projection for otherwise idle cores, an upper bound, not a measurement.  For the
ceiling rows CPU-seconds are those of the one-core loop.

Make a dataset first: python scripts/tools/make_dataset.py data/imagenet2k --n 2000
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers  # noqa: E402

ORDER = ["ours", "ours_cached", "torch_pil", "torch_decode_jpeg", "webdataset", "dali",
         "dali_fused", "ffcv_jpg",
         "ffcv_raw", "ceiling", "ceiling_dct"]


BASELINE_SUFFIX = "@before"
SIMD_SUFFIX = "@simd"


def run_one(name: str, a) -> dict:
    script, peer = os.path.join(HERE, "peers.py"), name
    if name.endswith(BASELINE_SUFFIX):  # the same loader from the --baseline checkout
        script = os.path.join(a.baseline, "scripts", "benchmarks", "peers.py")
        if not os.path.exists(script):  # a checkout from before scripts/ had folders
            script = os.path.join(a.baseline, "scripts", "peers.py")
        peer = name[:-len(BASELINE_SUFFIX)]
    python = sys.executable
    if name.endswith(SIMD_SUFFIX):  # the same loader under the Pillow-SIMD interpreter
        python, peer = a.pillow_simd, name[:-len(SIMD_SUFFIX)]
    cmd = [python, script, peer, "--data", a.data,
           "--batch", str(a.batch), "--workers", str(a.workers), "--epochs", str(a.epochs),
           "--warmup", str(a.warmup)]
    rec = {"name": name, "loadavg_before": os.getloadavg(), "started": time.time()}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timed out after {a.timeout}s", None
    rec["wall_s"] = round(time.perf_counter() - t0, 2)
    rec["loadavg_after"] = os.getloadavg()
    result = None
    for line in out.splitlines():
        if line.startswith("PEER_RESULT "):
            result = json.loads(line[len("PEER_RESULT "):])
    if result is None:
        tail = "\n".join((err or "").strip().splitlines()[-6:])
        rec.update(status="failed", error=f"exit {rc}: {tail}")
    else:
        rec.update({k: v for k, v in result.items() if k != "name"})
        if rec.get("rates"):
            rec["median"] = statistics.median(rec["rates"])
        cpu = [n / c for n, c in zip(rec.get("images", []), rec.get("cpu_s", [])) if c]
        if cpu:
            rec["per_cpu_s"] = cpu
            rec["median_per_cpu_s"] = statistics.median(cpu)
    return rec


def _backends(root: str) -> str:
    """pooled_loader.vision.backend_info() of the checkout at ``root``, as its loaders see it."""
    code = ("import pooled_loader.vision as v; "
            "print(v.backend_info() if hasattr(v, 'backend_info') else 'no backend_info()')")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, cwd=root)
        return p.stdout.strip() or p.stderr.strip().splitlines()[-1]
    except (subprocess.SubprocessError, IndexError) as e:
        return f"backends unknown ({e})"


def _fmt(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="ImageFolder of JPEGs")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs per loader (>= 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed epochs first")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole comparison")
    ap.add_argument("--only", default="", help="comma-separated loader names")
    ap.add_argument("--skip", default="", help="comma-separated loader names to leave out")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per loader run")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--require", default="",
                    help="comma-separated loader names that must run: exit 1 with the reason "
                         "on one line if one of them could not")
    ap.add_argument("--baseline", default=None,
                    help="another checkout (built), e.g. `git worktree add /tmp/before <commit>`: "
                         "its ours/ours_cached also run, as ours@before / ours_cached@before, "
                         "interleaved with ours in every round")
    ap.add_argument("--pillow-simd", default=None, metavar="PYTHON",
                    help="an interpreter with Pillow-SIMD: torch_pil also runs there "
                         "(row torch_pil@simd)")
    a = ap.parse_args(argv)
    a.data = os.path.abspath(a.data)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(ORDER)
    skip = {n.strip() for n in a.skip.split(",") if n.strip()}
    bad = [n for n in names if n not in peers.PEERS]
    if bad:
        ap.error(f"unknown loader(s) {bad}; known: {', '.join(ORDER)}")
    names = [n for n in names if n not in skip]
    if a.pillow_simd and "torch_pil" in names:
        names.insert(names.index("torch_pil") + 1, "torch_pil" + SIMD_SUFFIX)
    if a.baseline:
        a.baseline = os.path.abspath(a.baseline)
        for n in ("ours_cached", "ours"):  # each right after its own row
            if n in names:
                names.insert(names.index(n) + 1, n + BASELINE_SUFFIX)
    n_images = len(peers.list_images(a.data)[0])
    print(f"# {n_images} images in {a.data}; batch {a.batch}, {a.workers} workers; "
          f"{a.warmup} warm-up + {a.epochs} timed epochs; {a.rounds} round(s); "
          f"{peers.usable_cores()} usable cores; load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"# pooled_loader {_backends(os.path.dirname(HERE))}", flush=True)
    if a.baseline:
        print(f"# baseline ({BASELINE_SUFFIX} rows) {a.baseline}: {_backends(a.baseline)}",
              flush=True)

    def round_order(r: int) -> list[str]:
        """names, with each @before row moved ahead of its own row in odd rounds: the VM's
        speed drifts within a round, so a fixed order would favour one side."""
        if r % 2 == 0 or not a.baseline:
            return names
        order = list(names)
        for i, n in enumerate(order):
            if n.endswith(BASELINE_SUFFIX) and i > 0 and order[i - 1] + BASELINE_SUFFIX == n:
                order[i - 1], order[i] = order[i], order[i - 1]
        return order

    runs = []
    for r in range(a.rounds):
        for name in round_order(r):
            rec = run_one(name, a)
            rec["round"] = r
            runs.append(rec)
            if rec["status"] == "ok":
                rates = ", ".join(f"{x:.0f}" for x in rec["rates"])
                pc = rec.get("median_per_cpu_s")
                print(f"  round {r} {name:12s} {rec['median']:8.0f} images/s  [{rates}]  "
                      f"{_fmt(pc)} images/CPU-s  "
                      f"load {rec['loadavg_before'][0]:.2f}->{rec['loadavg_after'][0]:.2f}",
                      flush=True)
            else:
                print(f"  round {r} {name:12s} {rec['status']}: "
                      f"{rec.get('error', '').splitlines()[-1] if rec.get('error') else ''}",
                      flush=True)

    summary = {}
    cores = peers.usable_cores()
    for name in names:
        mine = [x for x in runs if x["name"] == name]
        ok = [x for x in mine if x["status"] == "ok"]
        s = {"status": "ok" if ok else mine[-1]["status"],
             "per_round": [x.get("median") for x in mine]}
        if ok:
            s["median"] = statistics.median(x["median"] for x in ok)
            s["all_epochs"] = [v for x in ok for v in x["rates"]]
        else:
            s["error"] = mine[-1].get("error")
        pcs = [x["median_per_cpu_s"] for x in ok if x.get("median_per_cpu_s")]
        s["per_cpu_s"] = statistics.median(pcs) if pcs else None
        # images per CPU-second x usable cores: what the loader would do on otherwise idle
        # cores if it kept them all busy (an upper bound; not measured wall-clock)
        s["cpu_projected"] = s["per_cpu_s"] * cores if s["per_cpu_s"] else None
        # ratio to ours within each round, then the median of those
        ratios, cratios = [], []
        for x in ok:
            o = [y for y in runs if y["name"] == "ours" and y["round"] == x["round"]
                 and y["status"] == "ok"]
            if o:
                ratios.append(x["median"] / o[0]["median"])
                if x.get("median_per_cpu_s") and o[0].get("median_per_cpu_s"):
                    cratios.append(x["median_per_cpu_s"] / o[0]["median_per_cpu_s"])
        s["x_ours"] = statistics.median(ratios) if ratios else None
        s["x_ours_per_cpu_s"] = statistics.median(cratios) if cratios else None
        summary[name] = s

    print()
    print(f"| loader | images/s | x ours | images/CPU-s | x ours | x{cores} cores | per round |")
    print(f"| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in names:
        s = summary[name]
        if s["status"] == "ok":
            pr = ", ".join(_fmt(v) for v in s["per_round"])
            print(f"| {name} | {_fmt(s['median'])} | {_fmt(s['x_ours'], 2)} "
                  f"| {_fmt(s['per_cpu_s'])} | {_fmt(s['x_ours_per_cpu_s'], 2)} "
                  f"| {_fmt(s['cpu_projected'])} | {pr} |")
        else:
            err = (s.get("error") or "").strip().splitlines()
            print(f"| {name} | {s['status']} | - | - | - | - | {err[-1][:110] if err else ''} |")
    print()

    if a.json:
        doc = {"config": {"data": a.data, "images": n_images, "batch": a.batch,
                          "workers": a.workers, "epochs": a.epochs, "warmup": a.warmup,
                          "rounds": a.rounds, "size": peers.SIZE},
               "host": {"usable_cores": peers.usable_cores(), "cpu_count": os.cpu_count(),
                        "python": platform.python_version(), "platform": platform.platform(),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
               "summary": summary, "runs": runs}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.json}")
    for name in (n.strip() for n in a.require.split(",") if n.strip()):
        s = summary.get(name)
        if s is not None and s["status"] != "ok":
            err = (s.get("error") or "").strip().splitlines()
            print(f"error: {name} could not run ({s['status']}): {err[-1] if err else 'no reason'}",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
