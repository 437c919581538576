"""A state taken after a `for` loop's `break` dropped the iterator (issue 36): it holds every
worker's start state, as StatefulDataLoader's does, even that of a worker that delivered nothing.

Worker 1 is made slow to start (it waits for worker 0's first item, then sleeps), so the first
batch, from worker 0, is handed out before worker 1's start state has arrived."""
from __future__ import annotations

import functools
import gc
import json
import os
import time
import weakref

import pytest
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from pooled_loader import PooledLoader
from pooled_loader.resume.elastic import merge_rank_states
from pooled_loader.webdataset import WebDataset
from test_webdataset import make_shards, sample_id


def _mark_first(marker: str) -> None:
    info = get_worker_info()
    if info is not None and info.id == 0 and not os.path.exists(marker):
        open(marker, "w").close()


def _slow_start(marker: str, wid: int) -> None:
    """worker_init_fn: worker 1 starts well after worker 0 has read its first item."""
    if wid == 1:
        limit = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < limit:
            time.sleep(0.01)
        time.sleep(1.5)


class Counter(IterableDataset):
    """Worker w yields w*1000+k, k < n, from its own `next` state."""

    def __init__(self, marker: str, n: int = 5):
        self.marker, self.n, self.next = marker, n, 0

    def __iter__(self):
        info = get_worker_info()
        wid = 0 if info is None else info.id
        while self.next < self.n:
            _mark_first(self.marker)
            self.next += 1
            yield wid * 1000 + self.next - 1

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = state["next"]


def _loader(dataset, marker: str, batch_size: int) -> PooledLoader:
    return PooledLoader(dataset, batch_size=batch_size, num_workers=2,
                        worker_init_fn=functools.partial(_slow_start, marker))


def _break_after_first(loader: PooledLoader) -> tuple[list, dict]:
    got = []
    for i, batch in enumerate(loader):  # the users' shape: the iterator is dropped at break
        got.append(batch.tolist())
        if i == 0:
            break
    gc.collect()
    return got, json.loads(json.dumps(loader.state_dict()))


def test_state_after_break_holds_the_start_state_of_a_worker_that_delivered_nothing(tmp_path):
    marker = str(tmp_path / "first")
    full = [b.tolist() for b in _loader(Counter(str(tmp_path / "m0")), str(tmp_path / "m0"), 1)]
    got, state = _break_after_first(_loader(Counter(marker), marker, 1))
    workers = state["_snapshot"]["_worker_snapshots"]
    assert workers["worker_1"]["dataset_state"] == {"next": 0}  # StatefulDataLoader's too
    assert workers["worker_0"]["dataset_state"] == {"next": 1}
    resumed = _loader(Counter(marker), marker, 1)
    resumed.load_state_dict(state)
    assert got + [b.tolist() for b in resumed] == full  # every sample once, in the same order


def test_webdataset_states_after_break_merge_and_resume_every_sample_once(tmp_path):
    root, marker = str(tmp_path / "shards"), str(tmp_path / "first")
    make_shards(root, [6, 6, 6, 6])

    def make():
        return WebDataset(root, transform=lambda s: (_mark_first(marker), sample_id(s))[1],
                          seed=6)

    got, state = _break_after_first(_loader(make(), marker, 2))
    assert all(w["dataset_state"] is not None
               for w in state["_snapshot"]["_worker_snapshots"].values())
    resumed = _loader(make(), marker, 2)
    resumed.load_state_dict(merge_rank_states([state]))  # refused when a worker's is missing
    rest = [b.tolist() for b in resumed]
    assert sorted(sum(got + rest, [])) == list(range(24))


def _never_starts(wid: int) -> None:
    if wid == 1:
        time.sleep(8)


def test_a_worker_still_starting_when_the_wait_ends_is_named_by_state_dict(tmp_path):
    marker = str(tmp_path / "first")
    loader = PooledLoader(Counter(marker), batch_size=1, num_workers=2, timeout=3,
                          worker_init_fn=_never_starts)
    for _ in loader:  # the wait at the drop is bounded by `timeout`, and nothing hangs
        break
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[1\].*start state"):
        loader.state_dict()


def _sleep_if_second(seconds: float, wid: int) -> None:
    if wid == 1:
        time.sleep(seconds)


class _CollectsGarbage(Dataset):
    """Each read runs the collector, as any allocation-heavy read in a worker may."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        gc.collect()
        return i


def test_an_iterator_dropped_in_a_cycle_does_nothing_in_a_process_forked_later(tmp_path):
    """A dropped iterator held in a reference cycle is garbage the next collection finalises,
    and a process forked before that (a torch DataLoader's worker: torch does not freeze the
    collector) inherits it. There, its `__del__` waited for the parent's workers' start states
    on the parent's pipes (up to `timeout`, stealing their messages): torch's worker hung until
    DataLoader's own timeout. Found by the suite's time: a 0.5 s test took 60-120 s."""
    loader = PooledLoader(Counter(str(tmp_path / "first"), n=50), batch_size=1, num_workers=2,
                          timeout=60, worker_init_fn=functools.partial(_sleep_if_second, 30))
    gc.disable()  # the cycle stays garbage until the forked worker collects it
    try:
        it = iter(loader)
        next(it)  # worker 1 has not started: a collected iterator would wait for it
        ref, cycle = weakref.ref(it), [it]
        cycle.append(cycle)
        del it, cycle
        batches = list(DataLoader(_CollectsGarbage(), batch_size=2, num_workers=1, timeout=10))
        assert [b.tolist() for b in batches] == [[0, 1], [2, 3]]
    finally:
        if ref() is not None:
            ref()._stop()  # this process's workers: stopped here, not by the collector's wait
        gc.enable()
        gc.collect()
