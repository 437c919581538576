"""Failure behaviour with real worker processes: errors, deaths, timeouts, clean exits."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from loader_datasets import Dying, Failing, Images, Slow
from pooled_loader import PooledLoader, WorkerError


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exception_in_getitem_names_worker_index_and_traceback(num_workers):
    loader = PooledLoader(Failing(bad=(5,)), batch_size=4, num_workers=num_workers)
    with pytest.raises(ValueError) as info:
        list(loader)
    text = str(info.value)
    assert "sample 5 is broken on purpose" in text
    if num_workers:
        assert "worker" in text and "sample index 5" in text and "Traceback" in text
        assert "__getitem__" in text
    # the loader stays usable, and the iterator can go on past the failed batch
    it = iter(loader)
    assert next(it).tolist()[0] == [0] * 4
    with pytest.raises(ValueError):
        next(it)
    assert next(it)[0].tolist() == [8] * 4


def test_exception_in_collate_and_in_worker_init():
    def bad_collate(samples):
        raise TypeError("collate says no")
    with pytest.raises(TypeError, match="collate says no"):
        list(PooledLoader(Images(8), batch_size=4, num_workers=2, collate_fn=bad_collate))

    def bad_init(worker_id):
        raise RuntimeError(f"init failed in {worker_id}")
    with pytest.raises(RuntimeError, match="init failed in"):
        list(PooledLoader(Images(8), batch_size=4, num_workers=2, worker_init_fn=bad_init))


def test_on_error_skip_replaces_samples_and_counts_them(caplog):
    loader = PooledLoader(Failing(bad=(3,), n=16), batch_size=4, num_workers=2,
                          on_error="skip")
    for epoch in range(2):
        batches = list(loader)
        assert [len(b) for b in batches] == [4, 4, 4, 4]  # batches keep their size
        values = [int(v) for b in batches for v in b[:, 0]]
        assert 3 not in values
        assert sorted(set(range(16)) - {3}) == sorted(set(values) - {3})
        assert loader.stats()["skipped"] == epoch + 1
    logged = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert len(logged) == 1 and "sample 3 is broken on purpose" in logged[0]


def test_on_error_skip_gives_up_when_replacements_keep_failing():
    loader = PooledLoader(Failing(bad=range(16), n=16), batch_size=4, num_workers=2,
                          on_error="skip")
    with pytest.raises(ValueError, match="broken on purpose"):
        list(loader)


@pytest.mark.parametrize("how,expect", [
    (signal.SIGKILL, "SIGKILL"),
    (signal.SIGSEGV, "SIGSEGV"),
    (("exit", 3), "exit code 3"),
])
def test_dead_worker_gives_a_clear_error_quickly(how, expect):
    before = set(os.listdir("/dev/shm"))
    loader = PooledLoader(Dying(how, at=3), batch_size=2, num_workers=2)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        list(loader)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert expect in text and "pid" in text and "worker" in text
    assert set(os.listdir("/dev/shm")) - before == set()


def test_timeout_raises_a_clear_error():
    loader = PooledLoader(Slow(3.0), batch_size=1, num_workers=1, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        next(iter(loader))
    assert time.monotonic() - start < 10


def test_break_and_del_stop_workers_promptly():
    loader = PooledLoader(Images(400), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    pids = [p.pid for p in it._workers]
    del it
    assert wait_gone(pids, 10) == []

    loader = PooledLoader(Images(400), batch_size=2, num_workers=2, persistent_workers=True)
    for _ in loader:
        break
    pids = [p.pid for p in loader._iterator._workers]
    assert all(alive(p) for p in pids)
    del loader
    assert wait_gone(pids, 10) == []


def test_exception_in_training_loop_stops_workers():
    pids = []

    def train():
        it = iter(PooledLoader(Images(400), batch_size=2, num_workers=2))
        pids.extend(p.pid for p in it._workers)
        for _ in it:
            raise ArithmeticError("loss is nan")
    with pytest.raises(ArithmeticError):
        train()
    assert wait_gone(pids, 10) == []


SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    from loader_datasets import Images
    from pooled_loader import PooledLoader
    loader = PooledLoader(Images(100000), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    print(" ".join(str(p.pid) for p in it._workers), flush=True)
    for batch in it:
        time.sleep(0.01)
""")


def start_training(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT.format(tests=os.path.dirname(__file__))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, proc.stderr.read()
    return proc, pids


def test_ctrl_c_stops_everything(tmp_path):
    proc, pids = start_training(tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert "KeyboardInterrupt" in proc.stderr.read()
    assert wait_gone(pids, 10) == []


def test_main_process_sigkilled_workers_exit_and_nothing_is_left(tmp_path):
    before = set(os.listdir("/dev/shm"))
    proc, pids = start_training(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(pids, 10) == []
    assert set(os.listdir("/dev/shm")) - before == set()


def test_spawned_workers_exit_when_main_is_killed():
    script = SCRIPT.replace("num_workers=2)", "num_workers=2, multiprocessing_context='forkserver')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script.format(tests=os.path.dirname(__file__))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, proc.stderr.read()
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone(pids, 10) == []
