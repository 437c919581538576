"""Command line: `python -m pooled_loader {cache,tune,shards,tokens} ...` (each has --help).

Errors the user can act on print one line and exit with status 1; add ``--verbose`` to any
command for the traceback (see ``pooled_loader._cli``).
"""
from __future__ import annotations

import importlib
import sys

from ._cli import run

COMMANDS = {
    "cache": ("pooled_loader.cache", "build, inspect and verify precomputed augmentation caches"),
    "tune": ("pooled_loader.tune", "find the fastest workers/prefetch/pool/batch settings"),
    "shards": ("pooled_loader.shards", "write an ImageFolder as WebDataset tar shards"),
    "tokens": ("pooled_loader.tokens", "write and inspect memory-mapped token files"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m pooled_loader COMMAND [ARGS...] [--verbose]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<8}{text}")
        print("\n--verbose: show the traceback of an error (by default: one line)")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return run(module.main, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
