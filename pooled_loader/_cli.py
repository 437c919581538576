"""One error rule for every ``python -m pooled_loader`` command.

An error the user can act on (a bad or missing file, a wrong argument value, a cache that does
not fit the data) prints one line, ``error: ...``, and exits with status 1: its message already
says what is wrong and what to do, and a traceback would bury it. ``--verbose`` anywhere on the
command line prints the traceback as well. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import sys
import traceback
from typing import Callable, Sequence

from .core.errors import CacheError, SampleError

USER_ERRORS = (OSError, ValueError, SampleError, CacheError)
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
VERBOSE_FLAG = "--verbose"


def run(command: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """Run ``command(argv)`` (``--verbose`` removed) under the rule above; its exit status."""
    verbose = VERBOSE_FLAG in argv
    argv = [a for a in argv if a != VERBOSE_FLAG]
    try:
        return int(command(argv) or 0)
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except USER_ERRORS as e:
        if verbose:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_ERROR


def one_line(e: BaseException) -> str:
    """An exception's message on one line; for an error re-raised from a PooledLoader worker
    ("Caught X in PooledLoader worker ...", then its traceback), the original error's line."""
    lines = [s.strip() for s in str(e).strip().splitlines() if s.strip()]
    if not lines:
        return type(e).__name__
    return lines[-1] if lines[0].startswith("Caught ") else lines[0]
