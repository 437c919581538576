#!/usr/bin/env python
"""Video clips, same run, same videos: torch DataLoader + torchcodec's clip sampler (its
documented recipe) against PooledLoader(VideoClips).

    python scripts/benchmarks/bench_video.py [--data DIR] [--rounds 3] [--batch 16]
        [--workers 2] [--step 2] [--epochs 10] [--peer torchcodec|none]
        [--seek-mode approximate|exact] [--fresh-workers] [--shm-check] [--json PATH]

Data: ``--data DIR`` (default ``/tmp/pooled_videos``, made when missing by
``scripts/tools/make_videos.py``: 48 H.264 videos, 4 classes, 480x360, 150 frames at 30 fps,
a keyframe every 32 frames). One transform for both loaders, torchvision v2 on a
``tv_tensors.Video``: ``Compose([RandomResizedCrop((224, 224)), RandomHorizontalFlip()])``;
a clip is 16 frames, ``--step`` frames apart (default 2: a clip spans 31 frames of the video).

- (a) the peer, torchcodec's recipe: a map-style Dataset whose ``__getitem__`` makes
  ``torchcodec.decoders.VideoDecoder(path, seek_mode="approximate")`` (torchcodec's advice when
  sampling clips: no scan of the file), calls ``torchcodec.samplers.clips_at_random_indices(
  decoder, num_clips=1, num_frames_per_clip=16, num_indices_between_frames=STEP)``, takes
  ``.data[0]`` (T, C, H, W) uint8 and applies the transform to it as a ``tv_tensors.Video``;
  ``DataLoader(ds, batch_size=B, shuffle=True, num_workers=2, pin_memory=False)``.
- (b) ours: ``PooledLoader(VideoClips(root, frames_per_clip=16, frame_step=STEP,
  transform=<the same Compose>), batch_size=B, num_workers=2, shuffle=True)``.

Both yield (B, 16, 3, 224, 224) uint8 batches (checked). torchcodec loads the system's FFmpeg;
where there is none, this script gives it PyAV's own FFmpeg build (the libraries in
``av.libs``, the ones our decoder runs on) through a directory of symlinks named as torchcodec
links them (``libavutil.so.60`` ...), made in a temporary directory, and re-executes itself
with ``LD_LIBRARY_PATH`` set. Both loaders then decode with the same FFmpeg code.

Each round builds each loader afresh, runs one full warm-up epoch (not measured: it starts the
workers and loads the decoders) and then ``--epochs`` measured epochs; the two loaders
alternate (order reversed in odd rounds), one at a time (the other's workers are gone). Both
run with ``persistent_workers=True``, so that worker start-up (a fork per worker per epoch)
stays out of a 48-clip epoch; ``--fresh-workers`` keeps both loaders' default
(``persistent_workers=False``): workers start and exit inside every measured epoch. An epoch of
48 clips is 3 batches of 16: with 2 workers, one of them idles through the last batch of each
epoch under DataLoader (a batch is one worker's), which costs its clips/s, not its CPU.
Figures of the measured epochs:

- clips/s: clips delivered over the wall time;
- CPU-ms/clip: user + system CPU of the whole process tree (this process, less the memory
  sampler's own thread, and every descendant: the loader workers; this process's own share is
  shown apart), as the sum over the tree of each process's own CPU plus the CPU of the
  children it has reaped (``/proc/PID/stat``: utime + stime + cutime + cstime), at the end
  minus at the start. A worker that exits inside
  the window is counted through its parent's cutime (its time before the window is in its
  start figure, taken off), so this is exact whether workers persist or not;
- peak MB: the largest sum of PSS (``/proc/PID/smaps_rollup``) over the tree, sampled at the
  start, every ``--mem-interval`` seconds (default 1: a read costs ~12 ms of CPU per process
  with torch loaded, in the sampler's thread, whose CPU is not counted) and at the end: shared
  pages (the forked parent's, the pool's memfd, DataLoader's /dev/shm batches) count once in
  all, split between the processes that map them.

Ratios ours/peer are taken per round (clips per CPU-second, and clips/s), then the median;
the goal is >= 1.6x clips per CPU-second.

``--shm-check``: afterwards, batches of 32 clips (32 x 16 x 3 x 224 x 224 uint8, 77 MB) under
Docker's default 64 MB ``/dev/shm``: a child in a private mount namespace (``unshare --mount
--propagation private``, root) mounts a 64 MiB tmpfs on ``/dev/shm`` and runs one epoch of each
loader with 2 workers; DataLoader's workers hand batches over in ``/dev/shm`` segments, the
pool is memfd-backed (docs/loader.md). Where no namespace can be made, a SKIP line says why.
``--rounds 0`` runs the check alone.
"""
from __future__ import annotations

import argparse
import gc
import glob
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

SHIM_ENV = "POOLED_BENCH_VIDEO_FFSHIM"  # set in the re-executed process: the shim's directory
GOAL = 1.6  # ours/peer, clips per CPU-second
INTERVAL = 1.0  # seconds between memory samples (PSS: ~12 ms of CPU per torch process read)
PEER_NAME = "(a) DataLoader + torchcodec"
TRANSFORM_TEXT = "v2.Compose([v2.RandomResizedCrop((224, 224)), v2.RandomHorizontalFlip()])"
OURS_NAME = "(b) PooledLoader(VideoClips)"


# -- data ----------------------------------------------------------------------------------------
def _make_videos_module():
    path = os.path.join(ROOT, "scripts", "tools", "make_videos.py")
    spec = importlib.util.spec_from_file_location("make_videos", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ensure_data(root: str) -> None:
    if os.path.isdir(root):
        return
    print(f"making {root}: 48 videos, 480x360, 150 frames (make_videos.py) ...", flush=True)
    _make_videos_module().make_videos(root, n=48, classes=4, width=480, height=360,
                                      frames_per_video=150)


def video_samples(root: str) -> list[tuple[str, int]]:
    """(path, label) per video, labels numbered as ImageFolder numbers them (sorted classes)."""
    from pooled_loader.video import VIDEO_EXTENSIONS
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    out = []
    for label, c in enumerate(classes):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, c))):
            dirnames.sort()
            out += [(os.path.join(dirpath, f), label) for f in sorted(files)
                    if f.lower().endswith(VIDEO_EXTENSIONS)]
    return out


# -- torchcodec on PyAV's FFmpeg -----------------------------------------------------------------
def av_libs_dir() -> str:
    import av
    return os.path.realpath(os.path.join(os.path.dirname(av.__file__), os.pardir, "av.libs"))


def make_shim(libs: str) -> tuple[str, list[str]]:
    """A temporary directory of symlinks ``libavutil.so.60`` -> ``av.libs/libavutil-HASH.so.60.x.y``
    (the sonames torchcodec's libraries link against). Returns (directory, names)."""
    shim = tempfile.mkdtemp(prefix="ffshim-")
    names = []
    for path in sorted(glob.glob(os.path.join(libs, "lib*.so.*"))):
        m = re.match(r"(lib(?:av|sw)[a-z]+)-[0-9a-f]+\.so\.(\d+)", os.path.basename(path))
        if m:
            name = f"{m.group(1)}.so.{m.group(2)}"
            os.symlink(path, os.path.join(shim, name))
            names.append(name)
    return shim, names


def torchcodec_probe(video: str, seek_mode: str) -> str | None:
    """None when torchcodec decodes ``video``, else why not."""
    try:
        from torchcodec.decoders import VideoDecoder
        VideoDecoder(video, seek_mode=seek_mode)
        return None
    except Exception as e:  # RuntimeError: "Could not load libtorchcodec ..."
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first}"


def setup_peer(a: argparse.Namespace, first_video: str) -> tuple[str, str]:
    """(peer, a line to print). Re-executes this script with the shim when torchcodec is
    installed but cannot load an FFmpeg."""
    if a.peer == "none":
        return "none", "peer: none (--peer none): only PooledLoader runs"
    if importlib.util.find_spec("torchcodec") is None:
        return "none", ("peer: torchcodec is not installed (pip install torchcodec): row (a) is "
                        "skipped, only PooledLoader runs")
    why = torchcodec_probe(first_video, a.seek_mode)
    shim = os.environ.get(SHIM_ENV)
    if why is None:
        if shim:
            from torchcodec._core import get_ffmpeg_library_versions
            import av
            tc = get_ffmpeg_library_versions().get("ffmpeg_version", "?")
            return "torchcodec", (
                f"torchcodec runs on PyAV's FFmpeg {tc} build (av.libs, via the soname shim "
                f"{shim}; PyAV reports FFmpeg {av.ffmpeg_version_info}): the same FFmpeg our "
                "decoder uses, so the decode is the same code")
        return "torchcodec", "torchcodec loads an FFmpeg of its own (the system's)"
    if shim:
        return "none", (f"peer: torchcodec cannot decode even with PyAV's FFmpeg ({why}): row "
                        "(a) is skipped")
    libs = av_libs_dir()
    shim, names = make_shim(libs)
    if not names:
        shutil.rmtree(shim, ignore_errors=True)
        return "none", f"peer: torchcodec cannot load FFmpeg ({why}) and {libs} has no FFmpeg " \
                       "libraries to give it: row (a) is skipped"
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [shim, libs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
    env[SHIM_ENV] = shim
    print(f"torchcodec cannot load an FFmpeg here ({why}); re-executing with PyAV's FFmpeg "
          f"libraries: LD_LIBRARY_PATH={shim}:{libs} ({', '.join(names)})", flush=True)
    os.execve(sys.executable, [sys.executable] + sys.argv, env)
    raise AssertionError("unreachable")


def _remove_shim_at_exit() -> None:
    shim, me = os.environ.get(SHIM_ENV), os.getpid()
    if not shim or not os.path.basename(shim).startswith("ffshim-"):
        return
    import atexit

    def remove() -> None:
        if os.getpid() == me:  # not in forked workers
            shutil.rmtree(shim, ignore_errors=True)
    atexit.register(remove)


# -- the loaders ---------------------------------------------------------------------------------
def make_transform():
    from torchvision.transforms import v2
    return v2.Compose([v2.RandomResizedCrop((224, 224)), v2.RandomHorizontalFlip()])


class TorchcodecClips:
    """torchcodec's recipe as a map-style Dataset: one decoder per item, one random clip."""

    def __init__(self, samples, frames: int, step: int, transform, seek_mode: str) -> None:
        self.samples, self.frames, self.step = samples, frames, step
        self.transform, self.seek_mode = transform, seek_mode

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from torchcodec.decoders import VideoDecoder
        from torchcodec.samplers import clips_at_random_indices
        from torchvision import tv_tensors
        path, label = self.samples[i]
        decoder = VideoDecoder(path, seek_mode=self.seek_mode)
        clip = clips_at_random_indices(decoder, num_clips=1, num_frames_per_clip=self.frames,
                                       num_indices_between_frames=self.step).data[0]
        return self.transform(tv_tensors.Video(clip)), label


def peer_loader(a, samples, batch: int, persistent: bool):
    from torch.utils.data import DataLoader
    ds = TorchcodecClips(samples, a.frames, a.step, make_transform(), a.seek_mode)
    return DataLoader(ds, batch_size=batch, shuffle=True, num_workers=a.workers,
                      pin_memory=False, persistent_workers=persistent)


def our_loader(a, batch: int, persistent: bool):
    from pooled_loader import PooledLoader
    from pooled_loader.video import VideoClips
    ds = VideoClips(a.data, frames_per_clip=a.frames, frame_step=a.step,
                    transform=make_transform())
    return PooledLoader(ds, batch_size=batch, num_workers=a.workers, shuffle=True,
                        persistent_workers=persistent)


# -- measuring -----------------------------------------------------------------------------------
def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int] | None:
    """The descendants of ``pid`` from ``/proc/PID/task/TID/children`` (cheap: no scan of every
    process), parents first; None where the kernel does not have that file."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except FileNotFoundError:
                if p == pid and not out:
                    return None
                continue
            except OSError:
                continue
            out += kids
            todo += kids
    return out


class TreeMeter:
    """CPU seconds and peak PSS of this process and its descendants between start() and stop()
    (see the module docstring)."""

    def __init__(self, interval: float = INTERVAL) -> None:
        import psutil
        self.interval = interval
        self.psutil, self.me = psutil, psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_kb = 0
        self.meter_s = 0.0

    def _tree(self) -> list:
        """This process and its descendants, parents before children."""
        pids = _descendants(self.me.pid)
        if pids is None:  # no /proc/PID/task/TID/children: psutil scans every process
            try:
                return [self.me] + self.me.children(recursive=True)
            except self.psutil.Error:
                return [self.me]
        procs = [self.me]
        for pid in pids:
            try:
                procs.append(self.psutil.Process(pid))
            except self.psutil.Error:
                pass
        return procs

    def cpu(self) -> tuple[float, float]:
        """(the tree's CPU seconds, this process's own)."""
        total = own = 0.0
        for p in reversed(self._tree()):  # children first: one reaped meanwhile is in its parent
            try:
                t = p.cpu_times()
            except self.psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
            if p.pid == self.me.pid:
                own = t.user + t.system
        return total, own

    def _sample(self) -> None:
        self.peak_kb = max(self.peak_kb, sum(_pss_kb(p.pid) for p in self._tree()))

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(self.interval):
            self._sample()
        self.meter_s = time.thread_time() - t0

    def start(self) -> None:
        self.peak_kb, self.meter_s = 0, 0.0
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cpu0 = self.cpu()
        self._thread.start()

    def stop(self) -> tuple[float, float, float]:
        """(CPU seconds of the tree and of this process, both less the sampler thread's; peak
        PSS in MB)."""
        self._stop.set()
        self._thread.join()  # first: all of the sampler's CPU is inside the window
        (tree1, own1), (tree0, own0) = self.cpu(), self._cpu0
        self._sample()
        return tree1 - tree0 - self.meter_s, own1 - own0 - self.meter_s, self.peak_kb / 1024


def wait_workers_gone(before: set[int], timeout: float = 20.0) -> list[int]:
    """Wait until this process has no children but those in ``before``; the rest's pids."""
    import psutil
    me, end = psutil.Process(), time.monotonic() + timeout
    while True:
        left = [p.pid for p in me.children() if p.pid not in before
                and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def consume(loader, expect: int) -> tuple[int, tuple]:
    n, shape = 0, ()
    for clips, _labels in loader:
        n += len(clips)
        shape = (tuple(clips.shape), str(clips.dtype))
    assert n == expect, (n, expect)
    return n, shape


def measure(make, epochs: int, expect: int, meter: TreeMeter, warmup_epochs: int) -> dict:
    import psutil
    before = {p.pid for p in psutil.Process().children()}
    loader = make()
    shape = None
    for _ in range(warmup_epochs):
        _, shape = consume(loader, expect)
    gc.collect()
    meter.start()
    t0 = time.perf_counter()
    n = 0
    for _ in range(epochs):
        got, shape = consume(loader, expect)
        n += got
    wall = time.perf_counter() - t0
    cpu_s, main_s, peak_mb = meter.stop()
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    del loader
    gc.collect()
    left = wait_workers_gone(before)
    if left:
        print(f"  warning: workers {left} still alive after the loader was dropped", flush=True)
    return {"clips": n, "wall_s": wall, "cpu_s": cpu_s, "clips_per_s": n / wall,
            "cpu_ms_per_clip": cpu_s / n * 1e3, "clips_per_cpu_s": n / cpu_s,
            "main_cpu_ms_per_clip": main_s / n * 1e3,
            "peak_pss_mb": peak_mb, "batch": shape}


# -- the 64 MB /dev/shm check --------------------------------------------------------------------
def shm_child(a: argparse.Namespace) -> int:
    """Runs inside the private mount namespace, /dev/shm a 64 MiB tmpfs."""
    st = os.statvfs("/dev/shm")
    print(f"SHM-MOUNTED /dev/shm: {st.f_blocks * st.f_frsize / 2**20:.0f} MiB tmpfs, "
          f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free", flush=True)
    samples = video_samples(a.data)
    batch = 32
    nbytes = batch * a.frames * 3 * 224 * 224
    rows = []
    if a.peer == "torchcodec":
        rows.append(("DataLoader + torchcodec", lambda: peer_loader(a, samples, batch, False)))
    else:
        from torch.utils.data import DataLoader
        from pooled_loader.video import VideoClips

        def plain_dl():
            return DataLoader(VideoClips(a.data, frames_per_clip=a.frames, frame_step=a.step,
                                         transform=make_transform()),
                              batch_size=batch, shuffle=True, num_workers=a.workers)
        rows.append(("DataLoader(VideoClips) (no torchcodec)", plain_dl))
    rows.append(("PooledLoader(VideoClips)", lambda: our_loader(a, batch, False)))
    for name, make in rows:
        t0 = time.perf_counter()
        try:
            batches, first = 0, None
            for clips, _ in make():
                batches += 1
                first = first or (tuple(clips.shape), str(clips.dtype))
                del clips
            print(f"{name}, {a.workers} workers, batch {batch}: PASS: {batches} batches in "
                  f"{time.perf_counter() - t0:.1f} s, the first {first[0]} {first[1]} "
                  f"({nbytes / 1e6:.1f} MB)", flush=True)
        except Exception as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""]
            key = [ln for ln in lines[1:] if "Error" in ln or "space" in ln] or [lines[-1]]
            said = lines[0] if lines[0] == key[-1] else f"{lines[0]} ... {key[-1]}"
            print(f"{name}, {a.workers} workers, batch {batch}: FAIL: {type(e).__name__}: "
                  f"{said[:400]}", flush=True)
        gc.collect()
    return 0


def shm_check(a: argparse.Namespace) -> None:
    print("\n## --shm-check: batches of 32 clips (77 MB) under a 64 MB /dev/shm", flush=True)
    if shutil.which("unshare") is None:
        print("SKIP: no `unshare` here (util-linux): cannot make a private 64 MB /dev/shm")
        return
    args = [sys.executable, os.path.abspath(__file__), "--shm-child", "--data", a.data,
            "--step", str(a.step), "--frames", str(a.frames), "--workers", str(a.workers),
            "--peer", a.peer, "--seek-mode", a.seek_mode]
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$@"'] + args
    try:
        r = subprocess.run(cmd, text=True, capture_output=True, timeout=600)
    except subprocess.TimeoutExpired:
        print("FAIL: the check did not finish in 600 s")
        return
    if "SHM-MOUNTED" not in r.stdout:
        err = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
        print(f"SKIP: cannot make a private mount namespace with a 64 MB /dev/shm here "
              f"(unshare --mount, then mount -t tmpfs: exit {r.returncode}: {err}); no result")
        return
    for line in r.stdout.splitlines():
        print(line.replace("SHM-MOUNTED ", "in a private mount namespace, "))
    results = {ln.split(",")[0]: ": PASS:" in ln for ln in r.stdout.splitlines()
               if ": PASS:" in ln or ": FAIL:" in ln}
    ours = results.get("PooledLoader(VideoClips)")
    theirs = [ok for k, ok in results.items() if k.startswith("DataLoader")]
    if ours and theirs and not any(theirs):
        print("shm-check: as stated: DataLoader fails under a 64 MB /dev/shm, PooledLoader runs")
    elif results:
        print(f"shm-check: NOT as stated ({results})")
    if r.returncode != 0:
        print(f"(the check's process exited {r.returncode}: "
              f"{(r.stderr.strip().splitlines() or [''])[-1][:300]})")


# -- main ----------------------------------------------------------------------------------------
def versions(peer: str) -> str:
    import av
    import psutil
    import torch
    import torchvision
    tc = "not used"
    if importlib.util.find_spec("torchcodec") is not None:
        import torchcodec
        tc = torchcodec.__version__ + ("" if peer == "torchcodec" else " (not run)")
    return (f"torch {torch.__version__}, torchvision {torchvision.__version__}, av "
            f"{av.__version__} (FFmpeg {av.ffmpeg_version_info}), torchcodec {tc}, "
            f"psutil {psutil.__version__}, Python {platform.python_version()}")


def tree_state() -> str:
    """The checkout measured (read-only git commands)."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %s"], text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "pooled_loader"],
                               text=True, capture_output=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "(not a git checkout)"
    changed = [ln[3:] for ln in dirty if ln.strip()]
    return (f"{head[:80]}" + (f"; uncommitted changes in pooled_loader/: {', '.join(changed)}"
                              if changed else ""))


def machine() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f
                          if ln.startswith("model name")), "")
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "?"
    model = f", {model}" if model else ""
    return (f"{os.cpu_count()} CPU cores ({usable} usable by this process){model}, "
            f"{platform.machine()}, load average {os.getloadavg()[0]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="/tmp/pooled_videos")
    ap.add_argument("--rounds", type=int, default=3, help="0: no benchmark (with --shm-check)")
    ap.add_argument("--batch", type=int, default=16, help="clips per batch (8..32 in mind)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--frames", type=int, default=16, help="frames per clip")
    ap.add_argument("--step", type=int, default=2, help="frames of the video between two of a "
                                                      "clip")
    ap.add_argument("--epochs", type=int, default=10, help="measured epochs per loader per round")
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--peer", choices=("torchcodec", "none"), default="torchcodec")
    ap.add_argument("--seek-mode", choices=("approximate", "exact"), default="approximate",
                    help="the peer's VideoDecoder seek_mode")
    ap.add_argument("--fresh-workers", action="store_true",
                    help="persistent_workers=False (both loaders' default): workers are started "
                         "and joined inside every measured epoch")
    ap.add_argument("--mem-interval", type=float, default=INTERVAL,
                    help="seconds between PSS samples of the process tree")
    ap.add_argument("--shm-check", action="store_true")
    ap.add_argument("--shm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="write the raw figures here")
    a = ap.parse_args()
    a.data = os.path.abspath(a.data)

    ensure_data(a.data)
    samples = video_samples(a.data)
    if not samples:
        print(f"no videos under {a.data}")
        return 1
    a.peer, peer_line = setup_peer(a, samples[0][0])  # may re-execute this script
    if a.shm_child:
        return shm_child(a)
    _remove_shim_at_exit()

    print("$ python " + " ".join(shlex.quote(x) for x in sys.argv))
    print(f"machine: {machine()}")
    print(f"tree: {tree_state()}")
    print(f"versions: {versions(a.peer)}")
    print(peer_line)
    persistent = not a.fresh_workers
    print(f"data: {a.data}: {len(samples)} videos; clips of {a.frames} frames, step {a.step} "
          f"(a clip spans {(a.frames - 1) * a.step + 1} frames); batch {a.batch}, "
          f"{a.workers} workers, persistent_workers={persistent}, shuffle=True; per round and "
          f"loader: {a.warmup_epochs} warm-up epoch(s), then {a.epochs} measured epochs "
          f"({a.epochs * len(samples)} clips)")
    if a.peer == "torchcodec":
        print(f"peer: VideoDecoder(path, seek_mode={a.seek_mode!r}) + clips_at_random_indices("
              f"num_clips=1, num_frames_per_clip={a.frames}, num_indices_between_frames="
              f"{a.step}), v2 transform on tv_tensors.Video, DataLoader(pin_memory=False)")
    from pooled_loader.video import VideoClips
    vc = VideoClips(a.data, frames_per_clip=a.frames, frame_step=a.step,
                    transform=make_transform())
    assert len(vc) == len(samples), (len(vc), len(samples))
    fused = [op.split("(")[0] for op in vc.describe()["fused"].get("fused", [])]
    print(f"transform (both): {TRANSFORM_TEXT} on a tv_tensors.Video; VideoClips fuses "
          f"{', '.join(fused) or 'nothing'} into its kernel, leaves to torchvision: "
          f"{', '.join(vc.describe()['as_is']) or 'nothing'}")
    del vc
    sys.stdout.flush()

    rows = {OURS_NAME: lambda: our_loader(a, a.batch, persistent)}
    if a.peer == "torchcodec":
        rows[PEER_NAME] = lambda: peer_loader(a, samples, a.batch, persistent)
    figures: dict[str, list[dict]] = {k: [] for k in rows}
    meter = TreeMeter(a.mem_interval) if a.rounds > 0 else None
    expect = len(samples)
    for r in range(a.rounds):
        order = list(rows)
        if r % 2:
            order.reverse()
        for name in order:
            got = measure(rows[name], a.epochs, expect, meter, a.warmup_epochs)
            figures[name].append(got)
            print(f"round {r} {name}: {got['clips_per_s']:.1f} clips/s, "
                  f"{got['cpu_ms_per_clip']:.2f} CPU-ms/clip (main process "
                  f"{got['main_cpu_ms_per_clip']:.2f}), peak PSS {got['peak_pss_mb']:.0f} "
                  f"MB, batches {got['batch'][0]} {got['batch'][1]}", flush=True)
        if a.peer == "torchcodec":
            o, p = figures[OURS_NAME][-1], figures[PEER_NAME][-1]
            assert o["batch"][0][1:] == p["batch"][0][1:] and o["batch"][1] == p["batch"][1], \
                (o["batch"], p["batch"])
            print(f"round {r} ours/peer: {o['clips_per_cpu_s'] / p['clips_per_cpu_s']:.2f}x "
                  f"clips per CPU-s, {o['clips_per_s'] / p['clips_per_s']:.2f}x clips/s",
                  flush=True)

    if a.rounds > 0:
        def med(name: str, key: str) -> float:
            return statistics.median(g[key] for g in figures[name])
        print(f"\n{a.rounds} rounds, medians; load average at the end {os.getloadavg()[0]:.2f}")
        print("| loader | clips/s | CPU-ms/clip (all processes) | of which main process "
              "| clips per CPU-s | peak MB (PSS, tree) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in ([PEER_NAME] if PEER_NAME in figures else []) + [OURS_NAME]:
            print(f"| {name} | {med(name, 'clips_per_s'):.1f} | "
                  f"{med(name, 'cpu_ms_per_clip'):.2f} | {med(name, 'main_cpu_ms_per_clip'):.2f} "
                  f"| {med(name, 'clips_per_cpu_s'):.1f} | {med(name, 'peak_pss_mb'):.0f} |")
        if PEER_NAME in figures:
            cpu_r = [o["clips_per_cpu_s"] / p["clips_per_cpu_s"]
                     for o, p in zip(figures[OURS_NAME], figures[PEER_NAME])]
            wall_r = [o["clips_per_s"] / p["clips_per_s"]
                      for o, p in zip(figures[OURS_NAME], figures[PEER_NAME])]
            mem_r = [o["peak_pss_mb"] / p["peak_pss_mb"]
                     for o, p in zip(figures[OURS_NAME], figures[PEER_NAME])]
            verdict = "PASS" if statistics.median(cpu_r) >= GOAL else "MISS"
            print(f"\n| ratio ours/peer | median | per round | goal |")
            print("| --- | --- | --- | --- |")
            print(f"| clips per CPU-second | {statistics.median(cpu_r):.2f}x | "
                  f"{', '.join(f'{x:.2f}' for x in cpu_r)} | {verdict} >= {GOAL}x |")
            print(f"| clips/s | {statistics.median(wall_r):.2f}x | "
                  f"{', '.join(f'{x:.2f}' for x in wall_r)} | |")
            print(f"| peak PSS | {statistics.median(mem_r):.2f}x | "
                  f"{', '.join(f'{x:.2f}' for x in mem_r)} | |")
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as f:
                json.dump({"argv": sys.argv, "figures": figures, "peer": a.peer}, f, indent=1)
            print(f"raw figures: {a.json}")
    if a.shm_check:
        shm_check(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
