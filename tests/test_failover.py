"""Issue 50: a worker that dies or hangs is replaced and the batches stay the same (real worker
processes, real signals, real JPEGs): SIGKILL at random moments (map-style with random
augmentation, a WebDataset, a Mix), a `__getitem__` that sleeps forever, a segfault in C code,
the restart budget, exact resume after a replacement, the skip budget, and Ctrl-C during a
replacement leaving nothing behind."""
from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from pooled_loader import PooledLoader, WorkerError
from pooled_loader.core.errors import SkipBudgetExceeded
from pooled_loader.mix.dataset import Mix
from pooled_loader.shards.webdataset import WebDataset

from imgutil import make_folder
from test_mix import Ids
from test_webdataset import make_shards, sample_id

HERE = os.path.dirname(os.path.abspath(__file__))
KILLS = 20


# -- helpers ------------------------------------------------------------------------------------
def _snapshot(batch):
    """A batch as plain, comparable values (copies: the slot is recycled)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, (list, tuple)):
        return [_snapshot(b) for b in batch]
    if isinstance(batch, dict):
        return {k: _snapshot(v) for k, v in batch.items()}
    return batch


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


class Killer:
    """SIGKILLs a random live worker of `it` shortly after each batch number in `at` (a random
    delay of up to `jitter_s`, so that workers die mid-sample, mid-message and idle); a kill due
    while every worker is dead and not yet replaced waits for the next batch."""

    def __init__(self, it, at: list[int], seed: int, jitter_s: float = 0.01):
        self.it, self.at, self.jitter_s = it, set(at), jitter_s
        self.rng = random.Random(seed)
        self.kills = self.due = 0

    def after(self, batch_number: int) -> None:
        self.due += batch_number in self.at
        if not self.due:
            return
        time.sleep(self.rng.uniform(0, self.jitter_s))
        live = [p for p in self.it._workers if p.is_alive()]
        if live:
            os.kill(self.rng.choice(live).pid, signal.SIGKILL)
            self.kills += 1
            self.due -= 1


def _epoch(loader, kill_at=(), seed=0):
    it = iter(loader)
    killer = Killer(it, list(kill_at), seed)
    out = []
    for n, batch in enumerate(it):
        out.append(_snapshot(batch))
        killer.after(n)
    return out, killer.kills


def _run_target(template: str, tmp_path) -> subprocess.CompletedProcess:
    """Run `template` (formatted with this folder and `tmp_path` for flag files) as a script of
    its own; it must exit 0."""
    script = tmp_path / "target.py"
    script.write_text(template.format(here=HERE, flags=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _kill_moments(batches: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted(rng.sample(range(batches - 12), KILLS))


# -- SIGKILL at 20 random moments ------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("photos"))
    make_folder(root, n_per_class=60, sizes=((96, 80), (64, 120), (150, 100)))
    return root


def _augmented(folder):
    from torchvision import datasets
    from torchvision.transforms import v2
    return datasets.ImageFolder(folder, transform=v2.Compose([
        v2.RandomResizedCrop(32, antialias=True), v2.RandomHorizontalFlip(),
        v2.PILToTensor()]))


@pytest.mark.timeout(300)
def test_sigkill_at_20_random_moments_of_a_shuffled_augmented_epoch_changes_nothing(folder,
                                                                                    caplog):
    def loader():
        return PooledLoader(_augmented(folder), batch_size=2, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(7), per_sample_seed=True,
                            max_worker_restarts=KILLS + 5)
    clean, _ = _epoch(loader())
    assert len(clean) == 60
    moments = _kill_moments(len(clean), seed=1)
    l2 = loader()
    with caplog.at_level(logging.WARNING, logger="pooled_loader"):
        killed, kills = _epoch(l2, moments, seed=2)
    assert kills == KILLS
    assert len(killed) == len(clean) and all(map(_same, clean, killed)), \
        "an epoch with killed workers differs from the uninterrupted one"
    replaced = l2.stats()["worker_replacements"]
    assert 1 <= replaced <= KILLS  # a worker killed after its last batch is not replaced
    lines = [r.getMessage() for r in caplog.records if "PooledLoader replaced worker" in
             r.getMessage()]
    assert len(lines) == replaced and all("killed by SIGKILL" in line for line in lines)


@pytest.mark.timeout(300)
def test_sigkill_at_20_random_moments_of_a_webdataset_epoch_changes_nothing(tmp_path):
    make_shards(str(tmp_path), [23, 17, 31, 29, 20, 40])  # 160 samples

    def loader():
        ds = WebDataset(str(tmp_path), transform=sample_id, shuffle_buffer=5, seed=3)
        return PooledLoader(ds, batch_size=2, num_workers=2, max_worker_restarts=KILLS + 5,
                            snapshot_every_n_steps=3)
    clean, _ = _epoch(loader())
    ids = [int(i) for b in clean for i in b]
    assert sorted(ids) == list(range(160))
    killed, kills = _epoch(loader(), _kill_moments(len(clean), seed=3), seed=4)
    assert kills == KILLS
    assert [b.tolist() for b in killed] == [b.tolist() for b in clean]


@pytest.mark.timeout(300)
def test_sigkill_at_20_random_moments_of_a_mix_epoch_changes_nothing():
    def loader():
        mix = Mix({"a": Ids(0, 50), "b": Ids(1000, 70), "c": Ids(5000, 30)},
                  {"a": 0.5, "b": 0.3, "c": 0.2}, batch_size=2, stop="never",
                  samples_per_epoch=160, seed=5)
        return PooledLoader(mix, batch_size=2, num_workers=2, max_worker_restarts=KILLS + 5,
                            per_sample_seed=True)
    clean, _ = _epoch(loader())
    assert sum(len(b) for b in clean) == 160
    killed, kills = _epoch(loader(), _kill_moments(len(clean), seed=5), seed=6)
    assert kills == KILLS
    assert [b.tolist() for b in killed] == [b.tolist() for b in clean]


# -- hangs and crashes ----------------------------------------------------------------------------
class Once(Dataset):
    """Sample `at` misbehaves the first time it is loaded in this run (a flag file remembers):
    "sleep" sleeps forever, "segv" reads address 0 through ctypes, "kill" SIGKILLs itself."""

    def __init__(self, mode: str, flag_dir: str, at: int = 17, n: int = 64):
        self.mode, self.flag, self.at, self.n = mode, os.path.join(flag_dir, "done"), at, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            if self.mode == "sleep":
                time.sleep(10 ** 6)
            elif self.mode == "segv":
                ctypes.string_at(0)
            elif self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((3,), float(i))


@pytest.mark.timeout(120)
def test_a_getitem_that_sleeps_forever_is_replaced_within_the_timeout_with_its_stack_logged(
        tmp_path, caplog):
    timeout = 2.0
    loader = PooledLoader(Once("sleep", str(tmp_path)), batch_size=4, num_workers=2,
                          max_worker_restarts=1, worker_timeout=timeout)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pooled_loader"):
        got = torch.cat([b[:, 0] for b in loader]).tolist()
    assert time.monotonic() - started < timeout + 5
    assert got == list(range(64))
    (line,) = [r.getMessage() for r in caplog.records
               if "PooledLoader replaced worker" in r.getMessage()]
    assert "made no progress" in line and "worker_timeout=2.0" in line
    assert "sample index 17" in line
    assert "in __getitem__" in line and "time.sleep" not in line  # faulthandler's frames
    assert "test_failover.py" in line
    assert loader.stats()["worker_replacements"] == 1


@pytest.mark.timeout(120)
def test_worker_timeout_alone_dumps_the_stack_and_raises_instead_of_a_silent_stall(tmp_path,
                                                                                   caplog):
    loader = PooledLoader(Once("sleep", str(tmp_path)), batch_size=4, num_workers=2,
                          worker_timeout=1.5)
    with caplog.at_level(logging.WARNING, logger="pooled_loader"), \
            pytest.raises(WorkerError) as info:
        list(loader)
    text = str(info.value)
    assert "made no progress on its batch for" in text and "sample index 17" in text
    assert "max_worker_restarts" in text and "test_failover.py" in text
    assert any("stack" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_a_segfault_in_c_code_is_replaced_and_named(tmp_path, caplog):
    loader = PooledLoader(Once("segv", str(tmp_path)), batch_size=4, num_workers=2,
                          max_worker_restarts=1)
    with caplog.at_level(logging.WARNING, logger="pooled_loader"):
        got = torch.cat([b[:, 0] for b in loader]).tolist()
    assert got == list(range(64))
    (line,) = [r.getMessage() for r in caplog.records
               if "PooledLoader replaced worker" in r.getMessage()]
    assert "killed by SIGSEGV" in line and "sample index 17" in line
    assert "Segmentation fault" in line  # faulthandler's crash report


CRASH_AFTER_OTHER_HANDLERS = textwrap.dedent("""
    import faulthandler, logging, sys
    sys.path.insert(0, {here!r})
    from torch.utils.data._utils import signal_handling
    faulthandler.enable()  # as pytest does, then a library's own fatal-signal handlers on top
    signal_handling._set_worker_signal_handlers()
    from pooled_loader import PooledLoader
    from test_failover import Once
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    loader = PooledLoader(Once("segv", {flags!r}), batch_size=4, num_workers=2,
                          max_worker_restarts=1)
    print("batches", len(list(loader)))
""")


@pytest.mark.timeout(120)
def test_the_crash_stack_is_kept_when_the_parent_had_other_fatal_signal_handlers(tmp_path):
    done = _run_target(CRASH_AFTER_OTHER_HANDLERS, tmp_path)
    assert "batches 16" in done.stdout
    assert "killed by SIGSEGV" in done.stdout and "Segmentation fault" in done.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_replacements_under_spawn_and_forkserver(tmp_path, method):
    import multiprocessing
    loader = PooledLoader(Once("segv", str(tmp_path)), batch_size=4, num_workers=2,
                          max_worker_restarts=1, worker_timeout=2,  # starts get 120 s
                          multiprocessing_context=multiprocessing.get_context(method))
    assert torch.cat([b[:, 0] for b in loader]).tolist() == list(range(64))
    assert loader.stats()["replacements"] == [
        f"worker 0 (pid {loader.stats()['replacements'][0].split()[3][:-1]}) killed by SIGSEGV "
        "while loading sample index 17"]


class Hangs(Dataset):
    """Every load of sample `at` hangs (a file that never answers)."""

    def __init__(self, at: int = 9):
        self.at = at

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i == self.at:
            time.sleep(10 ** 6)
        return torch.tensor([i])


@pytest.mark.timeout(120)
def test_past_max_worker_restarts_the_loader_raises_naming_every_replacement():
    loader = PooledLoader(Hangs(), batch_size=4, num_workers=2, max_worker_restarts=2,
                          worker_timeout=1.0)
    with pytest.raises(WorkerError) as info:
        list(loader)
    text = str(info.value)
    assert "already replaced 2 worker(s)" in text and "max_worker_restarts=2" in text
    assert text.count("sample index 9") >= 3  # the two replaced, and the last one
    assert loader.stats()["worker_replacements"] == 2


class NamesItsFile(Dataset):
    """Reads its samples through the library's own file opener, so the watchdog names them."""

    def __init__(self, paths, slow):
        self.paths, self.slow = paths, slow

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from pooled_loader.core.safe_open import open_regular
        fd = open_regular(self.paths[i])
        try:
            if self.paths[i] == self.slow:
                time.sleep(10 ** 6)  # a read that never returns
            return torch.tensor([len(os.read(fd, 100))])
        finally:
            os.close(fd)


@pytest.mark.timeout(120)
def test_the_watchdog_names_the_file_a_stuck_reader_was_on(tmp_path):
    paths = []
    for i in range(12):
        paths.append(str(tmp_path / f"f{i}.bin"))
        with open(paths[-1], "wb") as f:
            f.write(b"x" * (i + 1))
    loader = PooledLoader(NamesItsFile(paths, paths[5]), batch_size=2, num_workers=2,
                          worker_timeout=1.0)
    with pytest.raises(WorkerError) as info:
        list(loader)
    assert f"reading {paths[5]}" in str(info.value) and "sample index 5" in str(info.value)


# -- iterable datasets -----------------------------------------------------------------------------
class NoState(IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, 400, info.num_workers):
            time.sleep(0.002)
            yield torch.tensor([i])


@pytest.mark.timeout(120)
def test_an_iterable_dataset_without_state_cannot_be_replayed_and_says_so():
    loader = PooledLoader(NoState(), batch_size=4, num_workers=2, max_worker_restarts=3)
    it = iter(loader)
    next(it), next(it), next(it), next(it)
    os.kill(it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(WorkerError) as info:
        list(it)
    assert "killed by signal" in str(info.value) and "no state_dict()" in str(info.value)


# -- resume, persistent workers ------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_a_state_taken_after_a_replacement_resumes_as_one_taken_without_it(folder):
    def loader():
        return PooledLoader(_augmented(folder), batch_size=4, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(3), per_sample_seed=True,
                            max_worker_restarts=5)
    clean, _ = _epoch(loader())
    l1 = loader()
    it = iter(l1)
    head = [_snapshot(next(it)) for _ in range(9)]
    os.kill(it._workers[1].pid, signal.SIGKILL)
    head += [_snapshot(next(it)) for _ in range(4)]
    state = json.loads(json.dumps(l1.state_dict()))
    assert l1.stats()["worker_replacements"] == 1
    del it
    l2 = loader()
    l2.load_state_dict(state)
    rest = [_snapshot(b) for b in l2]
    assert all(map(_same, clean, head + rest)) and len(head + rest) == len(clean)


@pytest.mark.timeout(300)
def test_a_webdataset_state_taken_after_a_replacement_resumes_exactly(tmp_path):
    make_shards(str(tmp_path), [13, 17, 11, 19, 20])

    def loader():
        ds = WebDataset(str(tmp_path), transform=sample_id, shuffle_buffer=4, seed=2)
        return PooledLoader(ds, batch_size=3, num_workers=2, max_worker_restarts=3,
                            snapshot_every_n_steps=2)
    clean = [b.tolist() for b in loader()]
    l1 = loader()
    it = iter(l1)
    head = [next(it).tolist() for _ in range(5)]
    os.kill(it._workers[0].pid, signal.SIGKILL)
    head += [next(it).tolist() for _ in range(6)]
    state = json.loads(json.dumps(l1.state_dict()))
    assert l1.stats()["worker_replacements"] == 1
    del it
    l2 = loader()
    l2.load_state_dict(state)
    assert head + [b.tolist() for b in l2] == clean


@pytest.mark.timeout(300)
def test_persistent_workers_killed_between_and_within_epochs_keep_every_epoch(tmp_path):
    make_shards(str(tmp_path), [13, 17, 11, 19])

    def run(kill: bool):
        ds = WebDataset(str(tmp_path), transform=sample_id, shuffle_buffer=3, seed=1)
        loader = PooledLoader(ds, batch_size=3, num_workers=2, persistent_workers=True,
                              max_worker_restarts=4)
        epochs = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            it = iter(loader)
            out = []
            for n, b in enumerate(it):
                out.append(b.tolist())
                if kill and n == 4 and epoch == 1:
                    os.kill(it._workers[0].pid, signal.SIGKILL)
            epochs.append(out)
            if kill and epoch == 0:  # dies while idle between epochs
                os.kill(it._workers[1].pid, signal.SIGKILL)
                time.sleep(0.2)
        return epochs, loader.stats()["worker_replacements"]
    clean, _ = run(False)
    killed, replaced = run(True)
    assert killed == clean and replaced == 2


# -- the skip budget -------------------------------------------------------------------------------
def test_the_skip_budget_raises_past_a_fraction_of_the_epoch_naming_the_last_ones():
    bad = frozenset(range(0, 200, 4))  # a quarter
    loader = PooledLoader(Ids(0, 200, fail=bad), batch_size=10, num_workers=2,
                          on_error="skip", max_consecutive_skips=None)
    with pytest.raises(SkipBudgetExceeded) as info:
        list(loader)
    text = str(info.value)
    assert "max_skip_fraction=0.1" in text and "of 200 samples of the epoch" in text
    assert "cannot read item" in text
    # within the budget, the same data runs (and the loader's skips are counted)
    ok = PooledLoader(Ids(0, 200, fail=bad), batch_size=10, num_workers=2, on_error="skip",
                      max_skip_fraction=0.5, max_consecutive_skips=None)
    assert sum(len(b) for b in ok) == 200 and ok.stats()["skipped"] >= len(bad)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_skip_budget_raises_on_a_run_of_consecutive_skips(num_workers):
    bad = frozenset(range(50, 90))  # a mount that went away for a while
    loader = PooledLoader(Ids(0, 400, fail=bad), batch_size=10, num_workers=num_workers,
                          on_error="skip", max_skip_fraction=None, max_consecutive_skips=8)
    with pytest.raises(SkipBudgetExceeded) as info:
        list(loader)
    assert "9 samples in a row" in str(info.value) and "max_consecutive_skips=8" in str(
        info.value)


def test_failure_options_are_checked():
    for kwargs in ({"max_worker_restarts": -1}, {"max_worker_restarts": 1.5},
                   {"worker_timeout": -2}, {"worker_timeout": "5"},
                   {"max_skip_fraction": 1.5}, {"max_consecutive_skips": -1}):
        with pytest.raises(ValueError):
            PooledLoader(Ids(0, 4), **kwargs)


# -- Ctrl-C during a replacement -------------------------------------------------------------------
CTRL_C_TARGET = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    sys.path.insert(0, {here!r})
    from pooled_loader import PooledLoader
    from pooled_loader.engine import worker_iter
    from test_failover import Once

    real = worker_iter.WorkerIter._replace
    def interrupted(self, worker, owed):
        real(self, worker, owed)  # the new worker is starting, its tasks sent
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    worker_iter.WorkerIter._replace = interrupted

    fds = len(os.listdir("/proc/self/fd"))
    shm = sorted(os.listdir("/dev/shm"))
    loader = PooledLoader(Once("kill", {flags!r}), batch_size=4, num_workers=2,
                          max_worker_restarts=3, worker_timeout=30)
    try:
        for batch in loader:
            pass
        print("no interrupt")
    except KeyboardInterrupt:
        pass
    import multiprocessing
    deadline = time.time() + 10
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.05)
    del loader
    import gc; gc.collect()
    print("children", len(multiprocessing.active_children()))
    print("fds", len(os.listdir("/proc/self/fd")) - fds)
    print("shm", sorted(os.listdir("/dev/shm")) == shm)
""")


@pytest.mark.timeout(120)
def test_ctrl_c_during_a_replacement_leaves_no_process_no_fd_and_nothing_in_dev_shm(tmp_path):
    done = _run_target(CTRL_C_TARGET, tmp_path)
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert "no" not in lines, "the interrupt never came: no replacement happened"
    assert lines["children"] == "0" and lines["fds"] == "0" and lines["shm"] == "True", \
        done.stdout


# -- the watchdog's page ---------------------------------------------------------------------------
def test_the_workers_page_bounds_what_it_holds_and_reads_back_any_name():
    import mmap
    from pooled_loader.core.working_on import Board
    board = Board(mmap.mmap(-1, 4096))
    assert board.read() == (None, None)
    for index, shown in [(2**63 - 1, str(2**63 - 1)), (-2**63, str(-2**63)),
                         (2**64 + 5, str(2**64 + 5)),  # past int64: kept as text, not wrapped
                         (("shard-3", 17), "('shard-3', 17)")]:
        board.sample(index)
        assert board.read() == (f"sample index {shown}", None)
    board.sample("x" * 10_000)  # a huge index: cut at the field's end
    where, _ = board.read()
    assert where.startswith("sample index 'xxx") and len(where) < 600
    odd = os.fsdecode(b"/data/caf\xe9/\xff.jpg")  # not UTF-8: surrogate escapes
    board.reading(odd)
    assert board.read()[1] == "/data/caf?/?.jpg"
    board.reading("/" + "d" * 20_000)
    assert len(board.read()[1]) == 3500 and board.read()[0].startswith("sample index 'x")
    board.item(41)
    assert board.read()[0] == "item 41 of its stream"
    board.idle()
    assert board.read() == (None, None)
