"""Ctrl-C at any moment: a KeyboardInterrupt that Python would swallow is delivered again.

Python runs signal handlers between bytecodes of the main thread, wherever it is. When that is a
finalizer (``__del__`` of a batch's slot lease, a weakref callback, a ``weakref.finalize`` shutting
workers down) or an ``os.fork`` hook (``logging``'s lock release runs in the parent at every
worker start), the KeyboardInterrupt cannot propagate: Python prints "Exception ignored in ..."
and carries on, and the training loop goes on as if Ctrl-C had never been pressed (seen: a
process that did not exit within 30 s of SIGINT). Such exceptions reach ``sys.unraisablehook``;
ours sends SIGINT to this process again from a helper thread, so it is raised a moment later
in ordinary code. Everything else goes to the previous hook.

``signals_held_for_start`` is used while starting a worker: SIGINT is blocked in this thread, so
the child begins with it blocked and unblocks it only once it ignores SIGINT (a terminal's Ctrl-C
reaches the whole process group: a worker half-way through start-up would die with a traceback).
"""
from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
from typing import Any, Iterator

def _redeliver_sigint() -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except OSError:
        pass


def _unraisable_hook(unraisable: Any) -> None:
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        # Not from here: a signal handler run now would land in this same finalizer.
        _thread.start_new_thread(_redeliver_sigint, ())
        return
    _previous_hook(unraisable)


_previous_hook: Any = sys.__unraisablehook__


def install_interrupt_guard() -> None:
    """Make a KeyboardInterrupt swallowed by a finalizer or fork hook come back (idempotent;
    keeps a hook installed by someone else as the one that handles everything else)."""
    global _previous_hook
    if sys.unraisablehook is _unraisable_hook:
        return
    _previous_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable_hook


@contextlib.contextmanager
def signals_held_for_start() -> Iterator[None]:
    """Block SIGINT in this thread for the block (a process started inside inherits the mask).
    A SIGINT that arrives meanwhile is delivered when the block ends."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_sigint_in_worker() -> None:
    """In a worker: ignore SIGINT (the main process decides what Ctrl-C does), then unblock it
    (it was blocked across the start, see ``signals_held_for_start``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
