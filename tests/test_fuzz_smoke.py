"""A short run of scripts/checks/fuzz.py on every target (issues 24, 35): no finding in 20 s each.

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
SECONDS = 20  # per target: about 60 s in all


@pytest.mark.parametrize("target", ["jpeg", "tar", "cache", "state"])
def test_a_short_fuzz_run_of_each_reader_finds_nothing(target, tmp_path):
    artifacts = tmp_path / "artifacts"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "checks", "fuzz.py"),
                        "--target", target, "--seconds", str(SECONDS),
                        "--artifacts", str(artifacts)],
                       capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": ROOT})
    out = r.stdout + r.stderr
    found = sorted(os.listdir(artifacts)) if artifacts.exists() else []
    assert r.returncode == 0 and not found, f"findings {found}:\n{out[-4000:]}"
    runs = re.search(r"(?:Done )?(\d+) runs in", out)
    assert runs and int(runs.group(1)) >= 200, out[-2000:]  # it really ran the target
