"""The worker processes seen from the main process: how they are started within the fd limit,
stopped without ever hanging, and described when they die.

``_shutdown`` asks politely (a ``None`` on the pipe, the lifeline closed), then terminates, then
kills; ``SHUTDOWN_TIMEOUT_S`` says why terminating is safe. ``describe_exit`` and ``_reraise``
put a dead worker or a worker's exception in DataLoader's own words first. ``WorkerIter``
(worker_iter.py) is the only user.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch._utils import ExceptionWrapper

from .messages import ErrorInfo, Forget

SHUTDOWN_TIMEOUT_S = 2.0  # workers hold no locks: terminating after this is safe
REAP_GRACE_S = 1.0  # how long an exited process may take to become reapable

FDS_PER_WORKER = 3  # this process's end of its socket pair, and its process's two pipe ends

FDS_TO_START = 6  # the lifeline pipe, and a worker's socket end and fork pipes while it starts


@dataclass
class _Worker:
    id: int
    process: Any
    conn: Any
    active: bool = True  # False once an iterable dataset's worker is exhausted
    outstanding: int = 0  # tasks sent and not answered yet (in_order=False balances on this)
    busy_since: float = 0.0  # when its current task started, as far as the main process knows
    # `position.WorkerStream`: its stream as of its last answer (its epoch's Started first)
    received: Any = None
    up: bool = False  # its process has started (sent its first Started)


def describe_exit(worker_id: int, pid: int | None, exitcode: int | None) -> str:
    """Why a worker process is gone, in DataLoader's own words first (people and tools grep for
    them), then which PooledLoader worker it was and what to do."""
    ours = f"(PooledLoader worker {worker_id}"
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode)
            name, description = sig.name, signal.strsignal(sig) or sig.name
        except ValueError:
            name = description = f"signal {-exitcode}"
        text = f"DataLoader worker (pid {pid}) is killed by signal: {description}. "
        if name == "SIGBUS":
            text += ("It is possible that dataloader's workers are out of shared memory. "
                     "Please try to raise your shared memory limit. ")
        if name == "SIGKILL":
            ours += (" was killed by SIGKILL: if nobody sent it, the kernel's OOM killer did "
                     "(see `dmesg`); lower num_workers, batch_size, prefetch_factor or what a "
                     "sample holds in memory")
            return f"{text}{ours}.)"
        return (f"{text}{ours} was killed by {name}; rerun with num_workers=0 to see where "
                "it fails.)")
    if exitcode:
        return (f"DataLoader worker (pid {pid}) exited unexpectedly with exit code {exitcode}. "
                "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give "
                f"better error trace. {ours} exited unexpectedly with exit code {exitcode}.)")
    return (f"DataLoader worker (pid(s) {pid}) exited unexpectedly {ours} exited with exit code "
            f"{exitcode} while the loader still expected batches from it.)")


def timeout_message(timeout: float) -> str:
    return (f"DataLoader timed out after {timeout} seconds (PooledLoader: no batch came back "
            f"from the workers within timeout={timeout}; raise it, or set timeout=0 to wait "
            "indefinitely)")


def _send_nowait(conn: Any, msg: Any) -> None:
    """Send ``msg`` unless the pipe is full (its worker is about to be terminated anyway)."""
    try:
        os.set_blocking(conn.fileno(), False)
        conn.send(msg)
    except (OSError, ValueError):
        pass


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Forked workers must not collect what they inherit: a finalizer of the main process's
    garbage would run in them (an old iterator's shutdown), and the collector's bookkeeping
    writes would copy the parent's pages (copy-on-read). ``gc.freeze`` across the fork hides
    those objects from the child's collector for good; the parent collects them as before."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _out_of_fds(num_workers: int) -> str:
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (f"PooledLoader: not enough file descriptors to start {num_workers} workers: "
            f"{len(os.listdir('/proc/self/fd'))} are open, ulimit -n is {soft}, and the workers "
            f"need about {FDS_PER_WORKER * num_workers + FDS_TO_START} more ({FDS_PER_WORKER} "
            "each, plus one per pool arena). Fix: raise the limit (`ulimit -n 65536`, or "
            "resource.setrlimit(resource.RLIMIT_NOFILE, ...)) or use fewer workers.")


def _check_fd_headroom(num_workers: int) -> None:
    """Fail before starting anything (multiprocessing leaks a pipe when fork's second pipe
    cannot be made)."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    need = FDS_PER_WORKER * num_workers + FDS_TO_START
    if soft != resource.RLIM_INFINITY and len(os.listdir("/proc/self/fd")) + need > soft:
        raise OSError(errno.EMFILE, _out_of_fds(num_workers))


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """A Ctrl-C during the block takes effect at its end. Reaping a process is not atomic for
    Python: `os.waitpid` reaps it, then multiprocessing records the exit code, and a
    KeyboardInterrupt raised between the two leaves a process object that looks alive forever
    (`multiprocessing.active_children()` lists it, `terminate()` would signal its pid, which
    another process may reuse). Only the main thread can set a handler; elsewhere no Ctrl-C
    arrives anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)  # delivered now, to whatever handled it before


def is_alive(process: Any) -> bool:
    """`process.is_alive()` (which reaps a dead process), safe from a Ctrl-C meanwhile."""
    with _sigint_deferred():
        return process.is_alive()


def join(process: Any, timeout: float) -> None:
    """`process.join(timeout)`: the wait can be cut short by Ctrl-C, the reaping cannot."""
    _join_all([process], timeout)


def _join_all(processes: list[Any], timeout: float) -> None:
    """Wait up to `timeout` for all of `processes` to exit at once (Ctrl-C cuts the wait short),
    then reap the ones that did."""
    started = [p for p in processes if p.pid is not None]
    deadline = time.monotonic() + timeout
    pending = {p.sentinel: p for p in started}
    exited = []
    while pending:
        done = wait(list(pending), max(0.0, deadline - time.monotonic()))
        if not done:
            break
        exited += [pending.pop(sentinel) for sentinel in done]
    with _sigint_deferred():
        for p in started:
            p.join(0)
        # A sentinel is ready once the process has closed its files, a moment before the kernel
        # lets it be reaped: under load a non-blocking reap right then still finds it running
        # (and its exit code, which names SIGKILL and the OOM killer, would read None).
        settle = time.monotonic() + REAP_GRACE_S
        while any(p.exitcode is None for p in exited) and time.monotonic() < settle:
            time.sleep(0.001)


def _shutdown(workers: list[_Worker], lifeline: Any, owner_pid: int | None = None) -> None:
    """Stop worker processes: ask politely, then terminate, then kill. Never hangs: the stop
    message is sent without blocking (a worker's full pipe cannot stall it), each step waits for
    all workers at once, and a Ctrl-C meanwhile cuts the polite wait short and is raised once
    every worker is gone. Does nothing in another process (a forked child that inherited it)."""
    if owner_pid is not None and owner_pid != os.getpid():
        return  # a forked child collected its copy of the iterator: the workers are not its own
    started = [w for w in workers if w.process.pid is not None]
    interrupted = None
    try:
        for w in workers:
            _send_nowait(w.conn, None)
        try:
            lifeline.close()
        except OSError:
            pass
        _join_all([w.process for w in started], SHUTDOWN_TIMEOUT_S)
    except KeyboardInterrupt as exc:
        interrupted = exc
    for stop in ("terminate", "kill"):
        alive = [w for w in started if is_alive(w.process)]
        for w in alive:
            getattr(w.process, stop)()
        _join_all([w.process for w in alive], 1.0)
    for w in workers:
        w.conn.close()
    if interrupted is not None:
        raise interrupted


def _forget_arena_hook(workers: list[_Worker]) -> Callable:
    """Tell workers to unmap a retired arena (holds the workers, never the iterator)."""
    def hook(arena: Any) -> None:
        for w in workers:
            if is_alive(w.process):
                try:
                    w.conn.send(Forget(owner_pid=os.getpid(), arena_id=arena.id))
                except (OSError, ValueError):
                    pass
    return hook


def _reraise(info: ErrorInfo) -> None:
    """Raise a worker's exception in the main process as DataLoader does: same type, torch's own
    words and KeyError/`message=` handling; the first line ("Caught X in DataLoader worker process
    N.") and the last (the original error) are torch's, the sample index comes on a line between."""
    where = f"in DataLoader worker process {info.worker_id}"
    if info.index is not None:
        where += f".\nPooledLoader: raised while loading sample index {info.index!r}"
    wrapper = ExceptionWrapper((info.exc_type, None, None), where=where)
    wrapper.exc_msg = info.traceback
    wrapper.reraise()
