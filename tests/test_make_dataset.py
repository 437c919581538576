"""scripts/tools/make_dataset.py: count, layout, sizes, JPEG-ness and determinism (n=20)."""
import hashlib
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("cv2")
pytest.importorskip("skimage")
pytest.importorskip("tqdm")
Image = pytest.importorskip("PIL.Image")

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "tools", "make_dataset.py")


def _load():
    spec = importlib.util.spec_from_file_location("make_dataset", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _digest(root):
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def test_count_layout_sizes(tmp_path):
    md = _load()
    paths = md.make_dataset(str(tmp_path / "ds"), n=20, classes=4, seed=0, progress=False)
    assert len(paths) == 20
    classes = sorted(os.listdir(tmp_path / "ds"))
    assert classes == ["class_000", "class_001", "class_002", "class_003"]
    files = [f for c in classes for f in os.listdir(tmp_path / "ds" / c)]
    assert len(files) == 20 and all(f.endswith(".jpg") for f in files)
    assert not any(f.endswith(".tmp") for f in files)
    for c in classes:
        assert len(os.listdir(tmp_path / "ds" / c)) == 5
    for p in paths:
        with open(p, "rb") as fh:
            assert fh.read(3) == b"\xff\xd8\xff"
        with Image.open(p) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
            w, h = im.size
            assert 256 <= min(w, h) <= 512
            assert max(w, h) / min(w, h) <= 2.0 + 1e-2
            im.load()  # decodes cleanly


def test_deterministic(tmp_path):
    md = _load()
    md.make_dataset(str(tmp_path / "a"), n=20, classes=3, seed=7, progress=False)
    md.make_dataset(str(tmp_path / "b"), n=20, classes=3, seed=7, progress=False)
    md.make_dataset(str(tmp_path / "c"), n=20, classes=3, seed=8, progress=False)
    a, b, c = (_digest(tmp_path / x) for x in "abc")
    assert a == b
    assert a.keys() == c.keys() and a != c
    # image i does not depend on how many images are made
    d = md.make_dataset(str(tmp_path / "d"), n=5, classes=3, seed=7, progress=False)
    dd = _digest(tmp_path / "d")
    assert all(dd[k] == a[k] for k in dd) and len(d) == 5


def test_cli(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, SCRIPT, str(out), "--n", "6", "--classes", "2",
                        "--seed", "1", "--quiet"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "wrote 6 JPEGs" in r.stdout
    assert sum(len(fs) for _, _, fs in os.walk(out)) == 6
