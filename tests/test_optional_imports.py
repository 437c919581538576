"""A machine with only torch, numpy and one extra's packages: every public module imports, a
vision pipeline runs through real workers, shards and caches are written without tqdm, and a
missing extra is an error that names it (issue 34: the README's demo lost its PooledLoader row
because `webdataset` was imported at the top of a module `pooled_loader.vision` reached).

Each case runs in a subprocess whose import system refuses the hidden packages, as if they were
not installed, whatever this environment has."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every optional package the library or its extras use, apart from the `vision` extra's.
NOT_CORE = ("webdataset", "litdata", "streaming", "accelerate",
            "datasets", "lightning", "pytorch_lightning", "lightning_utilities", "tqdm",
            "matplotlib", "atheris", "torchdata", "fsspec", "skimage", "torchvision", "timm",
            "psutil", "transformers", "nvidia", "ray", "av")
VISION = ("simplejpeg", "cv2", "PIL")

def hide(hidden: tuple[str, ...], where) -> str:
    """A folder to put first on PYTHONPATH in which each hidden package is a module whose import
    fails as a missing one does: the subprocess, its workers and its own subprocesses all see the
    package as not installed."""
    folder = os.path.join(str(where), "hidden_packages")
    os.makedirs(folder, exist_ok=True)
    for name in hidden:
        with open(os.path.join(folder, name + ".py"), "w") as f:
            f.write(f"raise ModuleNotFoundError(\"No module named '{name}' (hidden by the test)\", "
                    f"name={name!r})\n")
    return folder


def run_hidden(hidden: tuple[str, ...], body: str, tmp_path, script: str | None = None,
               args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``body`` (or ``script``) with ``hidden`` unimportable, in ``tmp_path``."""
    cmd = [sys.executable, script, *args] if script else [sys.executable, "-c",
                                                          textwrap.dedent(body)]
    path = os.pathsep.join([hide(hidden, tmp_path), ROOT])
    return subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})


def run_json(hidden: tuple[str, ...], body: str, tmp_path) -> dict:
    proc = run_hidden(hidden, body, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_IMPORT_ALL = """
import importlib, json, pkgutil
import pooled_loader
failed = {}
names = [m.name for m in pkgutil.walk_packages(pooled_loader.__path__, "pooled_loader.",
                                               onerror=lambda name: None)
         if not m.name.endswith("__main__")]
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
"""


def test_every_module_imports_without_any_optional_package_but_the_vision_extra(tmp_path):
    out = run_json(NOT_CORE, _IMPORT_ALL + """
print(json.dumps({"names": names, "failed": failed}))
""", tmp_path)
    ray_modules = {n for n in out["names"] if n.startswith("pooled_loader.ray")}
    assert "pooled_loader.ray" in ray_modules  # its modules are not listed: it does not import
    assert set(out["failed"]) == ray_modules  # the `ray` extra's package, and only it
    assert all("pip install 'pooled-loader[ray]'" in why for why in out["failed"].values())
    for public in ("pooled_loader.vision", "pooled_loader.cache", "pooled_loader.ragged.collate",
                   "pooled_loader.ragged.samplers", "pooled_loader.ragged.tokens", "pooled_loader.resume.state",
                   "pooled_loader.observability.stats", "pooled_loader.shards.webdataset", "pooled_loader.shards.writer",
                   "pooled_loader.tune.trials", "pooled_loader.vision.decode"):
        assert public in out["names"]


def test_without_the_vision_extra_the_rest_imports_and_vision_names_the_extra(tmp_path):
    out = run_json(NOT_CORE + VISION, _IMPORT_ALL + """
try:
    import pooled_loader.vision
    vision_error = None
except ModuleNotFoundError as exc:
    vision_error = str(exc)
print(json.dumps({"failed": failed, "vision_error": vision_error}))
""", tmp_path)
    assert {n for n in out["failed"]
            if not n.startswith(("pooled_loader.ray", "pooled_loader.video"))} == \
        {"pooled_loader.vision"}
    video = {n: why for n, why in out["failed"].items() if n.startswith("pooled_loader.video")}
    assert all("pooled-loader[vision]" in why for why in video.values())  # if it fails
    assert "pip install 'pooled-loader[vision]'" in out["vision_error"]
    assert "simplejpeg" in out["vision_error"]


def test_a_vision_pipeline_shards_and_a_cache_run_through_workers_without_optional_packages(
        tmp_path):
    out = run_json(NOT_CORE, """
import io, json, os
import numpy as np
from PIL import Image
from pooled_loader import PooledLoader
from pooled_loader.vision import (ImageFolder, Compose, DecodeImage, RandomResizedCrop,
                                  RandomHorizontalFlip, ToCHW)
from pooled_loader.shards.writer import write_shards
from pooled_loader.shards.webdataset import WebDataset

rng = np.random.default_rng(0)
for c in ("cat", "dog"):
    os.makedirs(f"data/{c}")
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (37 + i, 53, 3), np.uint8)).save(f"data/{c}/{i}.jpg")
ds = ImageFolder("data", transform=Compose([DecodeImage(), RandomResizedCrop(32),
                                            RandomHorizontalFlip(), ToCHW()]))
loader = PooledLoader(ds, batch_size=4, shuffle=True, num_workers=2)
shapes, labels = [], []
for images, targets in loader:
    shapes.append(list(images.shape))
    labels += targets.tolist()
write_shards("data", "shards/s-%04d.tar", per_shard=5, progress=True)
wds = WebDataset("shards/s-{0000..0002}.tar")
keys = sorted(sample["__key__"] for sample in wds)
print(json.dumps({"shapes": shapes, "labels": sorted(labels), "keys": len(keys)}))
""", tmp_path)
    assert out["shapes"][0] == [4, 3, 32, 32] and len(out["shapes"]) == 3
    assert out["labels"] == [0] * 6 + [1] * 6
    assert out["keys"] == 12


def test_the_demo_exits_non_zero_with_one_line_when_pooled_loader_cannot_run(tmp_path):
    """The demo may list a peer as unavailable; PooledLoader failing is a failed demo."""
    proc = run_hidden(("simplejpeg",), "", tmp_path, script=os.path.join(ROOT, "scripts", "demo.py"),
                      args=("--n", "8", "--data", "demo", "--batch", "4"))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ours could not run"), last
    assert "pooled-loader[vision]" in last


def test_tune_writes_its_json_without_matplotlib(tmp_path):
    out = run_json(("matplotlib",), """
import json
from pooled_loader.tune.report import write_plot
print(json.dumps({"wrote": write_plot([], {}, "x.png", "t")}))
""", tmp_path)
    assert out["wrote"] is False


def test_video_imports_without_pyav_and_a_clip_names_the_extra(tmp_path):
    out = run_json(NOT_CORE, """
import json, os
os.makedirs("videos/a")
open("videos/a/x.mp4", "wb").write(b"not decoded: PyAV is hidden")
from pooled_loader.video import VideoClips
ds = VideoClips("videos", frames_per_clip=2)
try:
    ds[0]
    error = None
except ModuleNotFoundError as exc:
    error = str(exc)
print(json.dumps({"error": error, "n": len(ds)}))
""", tmp_path)
    assert out["n"] == 1 and "pip install 'pooled-loader[video]'" in out["error"]
