"""PooledLoader next to torch's DataLoader, behaviour by behaviour (issue 10).

Each test runs the same thing through `torch.utils.data.DataLoader` and `PooledLoader` and checks
that what a user (or a tool, or torch's own test-suite) can observe is the same: exception types,
the words of messages, warnings, types and values of batches.
"""
from __future__ import annotations

import multiprocessing
import re
import signal

import pytest
import torch
from torch.utils.data import DataLoader

from loader_datasets import Dying, Images, Slow
from pooled_loader import PooledLoader, WorkerError

LOADERS = [DataLoader, PooledLoader]


def _error_of(loader_cls, dataset, **kw) -> BaseException:
    with pytest.raises(Exception) as info:
        for _ in loader_cls(dataset, **kw):
            pass
    return info.value


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("how,words", [
    (signal.SIGSEGV, r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault\. "),
    (signal.SIGKILL, r"DataLoader worker \(pid \d+\) is killed by signal: Killed\. "),
    (("exit", 3), r"DataLoader worker \(pid \d+\) exited unexpectedly with exit code 3\. "
                  r"Details are lost due to multiprocessing\."),
])
def test_a_dead_worker_raises_a_runtime_error_in_dataloaders_words(how, words, pin_memory):
    kw = dict(batch_size=2, num_workers=2, pin_memory=pin_memory)
    with pytest.warns(UserWarning) if pin_memory else _nothing():
        theirs = _error_of(DataLoader, Dying(how, at=3), **kw)
    with pytest.warns(UserWarning) if pin_memory else _nothing():
        ours = _error_of(PooledLoader, Dying(how, at=3), **kw)
    # DataLoader's SIGCHLD handler words may come as the cause of "(pid(s) N) exited unexpectedly"
    assert type(theirs) is RuntimeError and re.search(words, _chain(theirs))
    assert isinstance(ours, RuntimeError) and isinstance(ours, WorkerError)
    assert re.match(words, str(ours)), str(ours)  # torch's words first ...
    assert "PooledLoader worker" in str(ours)  # ... then which of ours it was


def test_worker_error_is_a_runtime_error():
    assert issubclass(WorkerError, RuntimeError)


@pytest.mark.parametrize("pin_memory", [False, True])
def test_a_timeout_raises_a_runtime_error_in_dataloaders_words(pin_memory):
    kw = dict(batch_size=1, num_workers=1, timeout=0.5, pin_memory=pin_memory)
    for cls in LOADERS:
        with pytest.warns(UserWarning) if pin_memory else _nothing():
            with pytest.raises(RuntimeError) as info:
                next(iter(cls(Slow(3.0), **kw)))
        assert str(info.value).startswith("DataLoader timed out after 0.5 seconds"), cls


@pytest.mark.parametrize("persistent", [False, True])
def test_iterator_workers_are_processes_that_tests_can_join(persistent):
    for cls in LOADERS:
        loader = cls(Images(8), batch_size=2, num_workers=2, persistent_workers=persistent)
        it = iter(loader)
        next(it)
        workers = it._workers
        assert isinstance(workers, list) and len(workers) == 2
        assert all(isinstance(w, multiprocessing.process.BaseProcess) for w in workers)
        assert all(isinstance(w.pid, int) and w.is_alive() for w in workers)
        if persistent:  # the next epoch reuses the very same processes
            assert iter(loader)._workers == workers
            del loader
        del it
        for w in workers:
            w.join(20)
            assert not w.is_alive(), cls


def _chain(exc: BaseException | None) -> str:
    """The messages of an exception and of its causes, as a traceback would show them."""
    text = []
    while exc is not None:
        text.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return "\n".join(text)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
