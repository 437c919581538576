"""Command-line inputs that once lost data or hung (issue 35): a ``shards write`` pattern that
does not give each shard its own name, and a FIFO or device given to ``cache info``.
Tests that could hang on a regression run under a timeout."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_webdataset import make_image_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "pooled_loader", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("pattern, per_shard, clash", [
    ("s-%.0s.tar", 2, r"shards 0 and 1 both '\S*/s-\.tar'"),
    ("s-%.1s.tar", 1, r"shards 1 and 10 both '\S*/s-1\.tar'"),  # only the 11th clashes
])
def test_shards_write_refuses_a_pattern_that_names_two_shards_alike_before_writing(
        tmp_path, pattern, per_shard, clash):
    """``s-%.0s.tar`` formats every number as ``s-.tar``: each shard replaced the last, and the
    command said it wrote 3 shards while one was on disk and 4 of 6 images were gone."""
    src = str(tmp_path / "img")
    make_image_folder(src, per_class=4)  # 12 images
    out = tmp_path / "out"
    r = cli("shards", "write", src, str(out / pattern), "--per-shard", str(per_shard), "--quiet")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert re.search(f"names {clash}", r.stderr), r.stderr
    assert not out.exists() or not os.listdir(out)  # checked before writing anything


def test_shards_write_with_a_numbering_pattern_still_writes_every_shard(tmp_path):
    src = str(tmp_path / "img")
    make_image_folder(src, per_class=3)
    r = cli("shards", "write", src, str(tmp_path / "out" / "s-%02d.tar"), "--per-shard", "2",
            "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".tar")) == [
        f"s-{n:02d}.tar" for n in range(5)]  # 9 images, 2 a shard


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_cache_info_refuses_a_fifo_or_device_naming_it(tmp_path, kind):
    path = tmp_path / "c.plc"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    r = cli("cache", "info", str(path), timeout=50)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "not a regular file" in r.stderr and "c.plc" in r.stderr
