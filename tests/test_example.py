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


def test_train_lm_example_trains_on_packed_batches_and_resumes(tmp_path):
    ckpt = str(tmp_path / "lm.pt")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_lm.py"), "--workers", "2",
           "--checkpoint", ckpt, "--save-every", "2"]
    env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(tmp_path)}
    first = subprocess.run(cmd + ["--max-steps", "3"], capture_output=True, text=True,
                           timeout=240, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "steps 3, epoch 0" in first.stdout and os.path.exists(ckpt)
    again = subprocess.run(cmd + ["--max-steps", "5"], capture_output=True, text=True,
                           timeout=240, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at epoch 0, step 3" in again.stdout and "steps 5, epoch 0" in again.stdout
    assert "PooledLoader: 2 batches" in again.stdout  # the two batches after the saved ones
