#!/usr/bin/env python
"""38 MB batches under Docker's default 64 MB /dev/shm: torch DataLoader vs PooledLoader.

    python scripts/benchmarks/shm_compare.py        # needs root and `unshare -m` (a private mount namespace)

Mounts a 64 MB tmpfs on /dev/shm in a private mount namespace, then loads 2 epochs of batches of
8 x 4.75 MiB samples (38 MiB each) with 2 workers through each loader and prints what happened.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np, torch
from torch.utils.data import DataLoader, Dataset
from pooled_loader import PooledLoader

class Big(Dataset):
    def __len__(self): return 16
    def __getitem__(self, i): return np.full(int(4.75 * 2**20), i, dtype=np.uint8)

for cls in (DataLoader, PooledLoader):
    try:
        for epoch in range(2):
            for batch in cls(Big(), batch_size=8, num_workers=2):
                assert batch.shape == (8, int(4.75 * 2**20))
        print(f"{{cls.__name__:>13}}: OK, 38 MiB batches loaded")
    except Exception as e:
        last = [l for l in str(e).splitlines() if "Error" in l] or [str(e)]
        print(f"{{cls.__name__:>13}}: FAILED: {{last[-1].strip()[:160]}}")
"""


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    code = CHILD.format(tests=os.path.join(root, "tests"), root=root)
    cmd = ["unshare", "-m", "sh", "-c",
           'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, code]
    result = subprocess.run(cmd, text=True, capture_output=True)
    print(result.stdout, end="")
    if result.returncode != 0:
        print(result.stderr[-2000:], file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
