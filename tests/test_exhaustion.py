"""Resource exhaustion: a pool that cannot grow (``ulimit -v``), file descriptors near
``ulimit -n``, a worker SIGKILLed (as by the OOM killer) while the pool is large. Each gives a
clear error naming the limit and the fix, with no hang and nothing leaked. The limits are set in
a subprocess. (RLIMIT_MEMLOCK only matters for pinning, which needs CUDA: not tested here.)"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from loader_datasets import Images
from pooled_loader import PooledLoader, WorkerError

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script).format(tests=HERE)],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:pooled_loader" in line for line in f)


PRELUDE = """
    import gc, multiprocessing as mp, os, resource, sys, time, warnings
    sys.path.insert(0, {tests!r})
    from loader_datasets import Images
    from pooled_loader import PooledLoader, PoolAllocationError
    warnings.simplefilter("ignore")

    def memfd_maps():
        with open("/proc/self/maps") as f:
            return sum("memfd:pooled_loader" in line for line in f)

    def children_gone():
        deadline = time.monotonic() + 10
        while mp.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not mp.active_children()
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_a_pool_that_cannot_grow_under_ulimit_v_names_the_limit_without_hang_or_leak(workers):
    res = _run(PRELUDE + f"""
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (600 << 20), resource.RLIM_INFINITY))
    loader = PooledLoader(Images(10**5, (512, 512, 4)), batch_size=4, num_workers={workers},
                          timeout=60)
    kept, batch, start = [], None, time.monotonic()
    try:
        for batch in loader:  # 4 MiB a batch, all kept: the pool must grow until it cannot
            kept.append(batch)
        print("no error")
    except PoolAllocationError as e:
        print("error after", len(kept), "batches:", str(e).splitlines()[-1][:2000])
    took = time.monotonic() - start
    del kept, batch
    loader.close()
    del loader
    gc.collect()
    print("took", round(took), "children_gone", children_gone(), "memfd_maps", memfd_maps())
    """)
    out = res.stdout
    assert "error after" in out, out + res.stderr[-3000:]
    assert "ulimit -v (address space)" in out and "Fix: raise the limit" in out, out
    assert "children_gone True memfd_maps 0" in out, out


def test_running_out_of_file_descriptors_while_starting_workers_names_ulimit_n():
    res = _run(PRELUDE + """
    before = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 8, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    loader = PooledLoader(Images(64), batch_size=4, num_workers=6)
    try:
        list(loader)
        print("no error")
    except OSError as e:
        print("error:", e)
    loader.close()
    del loader
    gc.collect()
    print("children_gone", children_gone(), "fds_back", len(os.listdir("/proc/self/fd")) <= before)
    """)
    out = res.stdout
    assert "error:" in out and "ulimit -n is" in out and "fewer workers" in out, \
        out + res.stderr[-3000:]
    assert "children_gone True fds_back True" in out, out


@pytest.mark.timeout(120)
def test_a_worker_sigkilled_while_the_pool_is_large_gives_an_oom_hint_and_leaks_nothing():
    gc.collect()  # earlier tests' batches may still be garbage holding their pools
    before = memfd_maps()
    loader = PooledLoader(Images(10**5, (256, 256, 4)), batch_size=4, num_workers=2, timeout=60)
    kept = []
    it = iter(loader)
    with pytest.warns(UserWarning, match="pool grows"):
        for _ in range(60):  # keep 60 batches of 1 MiB: the pool grows several times
            kept.append(next(it))
    assert loader.stats()["grown"] >= 2
    os.kill(it._workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"SIGKILL.*OOM killer.*dmesg"):
        while True:
            kept.append(next(it))
    assert time.monotonic() - start < 30
    assert all(int(b[1][0]) == 4 * k for k, b in enumerate(kept[:60]))  # kept batches intact
    del kept, it
    x, y = next(iter(loader))  # the loader still works: fresh workers
    assert int(y[0]) == 0
    del x, y
    loader.close()
    del loader
    gc.collect()
    deadline = time.monotonic() + 10
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not mp.active_children()
    assert memfd_maps() <= before
