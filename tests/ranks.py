"""Real gloo ranks for the tests: a free loopback port and a spawn launcher that never hangs."""
from __future__ import annotations

import socket
import time
from typing import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, world: int, args: tuple, deadline_s: float) -> None:
    """Run `target(rank, port, *args)` in `world` spawned processes; kill any still running after
    `deadline_s` and fail unless every rank exited 0."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * world, "a rank failed or hung"
