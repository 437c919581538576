"""A short run of scripts/checks/fuzz.py on every target (issues 24, 35): no finding in 12 s
each (6 s for the small index parsers; the suite's time, issue 45).

Runs under atheris (coverage-guided) when it is installed, else the script's seeded random
mutator; the longer campaign is in scripts/README.md.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECONDS = {"jpeg": 12, "tar": 12, "cache": 12, "state": 12, "tokidx": 6,
           "shardidx": 6}  # 60 s of fuzzing (plus ~7 s a target to start, instrumented)


@pytest.mark.parametrize("target", list(SECONDS))
def test_a_short_fuzz_run_of_each_reader_finds_nothing(target, tmp_path):
    artifacts = tmp_path / "artifacts"
    seconds = SECONDS[target]
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "checks", "fuzz.py"),
                        "--target", target, "--seconds", str(seconds),
                        "--artifacts", str(artifacts)],
                       capture_output=True, text=True, timeout=seconds + 120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": ROOT})
    out = r.stdout + r.stderr
    found = sorted(os.listdir(artifacts)) if artifacts.exists() else []
    assert r.returncode == 0 and not found, f"findings {found}:\n{out[-4000:]}"
    runs = re.search(r"(?:Done )?(\d+) runs in", out)
    assert runs and int(runs.group(1)) >= 200, out[-2000:]  # it really ran the target
