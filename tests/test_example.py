"""The training example runs end to end (real JPEGs, real workers, a real optimiser step)."""
import os
import subprocess
import sys

from imgutil import make_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_classifier_example_runs(tmp_path):
    data = str(tmp_path / "imgs")
    make_folder(data, n_per_class=8, sizes=((320, 256), (256, 384)))
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_classifier.py"), data,
           "--epochs", "2", "--batch", "4", "--size", "64", "--workers", "2", "--max-steps", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PooledLoader: 6 batches" in result.stdout
