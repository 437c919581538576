"""`WorkerIter` (``num_workers > 0``): the epoch's iterator that runs worker processes.

It starts the worker processes (``worker.worker_loop``), dispatches ``Task``s as DataLoader does
(at most ``prefetch_factor * num_workers`` in flight), hands out answers in task order (or as they
come with ``in_order=False``), gives each slot back when its batch is dropped, and stops the
workers (``processes._shutdown``: politely, then firmly) when the epoch ends, on an error, or when
the iterator is garbage collected. Messages: ``messages.py``; what it shares with the in-process
iterator: ``iterators._IterBase``.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import itertools
import multiprocessing
import os
import pickle
import time
import warnings
import weakref
from multiprocessing.connection import wait
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data import dataloader as torch_dataloader

from .epoch import EpochSpec
from ..core.errors import PoolAllocationError, SkipBudgetExceeded, WorkerError
from .failover import Failover, Replacement, cause_of_exit
from .interrupts import signals_held_for_start
from .iterators import _IterBase, worker_config
from ..core.hooks import hooks_of
from .messages import Done, End, Failed, NeedSlot, Reset, SetEpoch, Slot, Started, Task
from .pool import SlotRef
from .position import WorkerStream
from .processes import (is_alive, join, timeout_message, _check_fd_headroom,
                        _forget_arena_hook, _gc_frozen, _out_of_fds, _reraise, _shutdown, _Worker)
from .watchdog import Watch
from .worker import worker_loop

__all__ = ["WorkerIter"]

SETTLE_S = 60.0  # how long a dropped iterator waits for its workers' start states
KILL_WAIT_S = 5.0  # how long a killed worker may take to be reaped
# A worker's start (imports under spawn/forkserver, worker_init_fn, a restored stream) is no
# batch: the watchdog gives it at least this long before it calls the worker hung.
START_TIMEOUT_S = 120.0

PICKLE_WARNING = (  # DataLoader's words when a worker cannot be started
    "Got pickle error when attempting to start a worker Process. This might be because the "
    "worker Process arguments are not picklable. Python 3.14+ changed the multiprocessing start "
    "method in non-Mac POSIX platforms to 'forkserver', which requires the worker Process "
    "arguments to be picklable. You can also try multiprocessing.set_start_method('fork').")


def _shutdown_all(workers: list[_Worker], lifeline: Any, owner_pid: int,
                  closables: list) -> None:
    """`_shutdown`, then close what outlived the workers only for them (the lifeline's read end
    kept for replacements, the watchdog's files)."""
    try:
        _shutdown(workers, lifeline, owner_pid)
    finally:
        if owner_pid == os.getpid():
            for obj in closables:
                try:
                    obj.close()
                except OSError:
                    pass


class WorkerIter(_IterBase):
    """num_workers>0: worker processes fill slots; results come back in task order."""

    def __init__(self, spec: EpochSpec) -> None:
        super().__init__(spec)
        self._num_workers = spec.num_workers
        self._prefetch = spec.prefetch_factor
        self._timeout = spec.timeout
        self._in_order = spec.in_order
        self._persistent = spec.persistent_workers
        self._ctx = spec.multiprocessing_context or multiprocessing.get_context()
        self._worker_init_fn = spec.worker_init_fn
        if isinstance(spec.dataset, (IterDataPipe, MapDataPipe)):
            # DataLoader's own wrapper: shard the graph by rank and worker, then the user's init
            world_size, rank = torch_dataloader._get_distributed_settings()
            self._worker_init_fn = functools.partial(torch_dataloader._sharding_worker_init_fn,
                                                     spec.worker_init_fn, world_size, rank)
        self._generation = 0  # the epochs these workers have run (`messages`)
        self._stopped = False
        self._owner_pid = os.getpid()
        # docs/failures.md: replace dead or hung workers (failover), name hung ones (watchdog)
        self._failover = spec.failover if spec.failover is not None else Failover(0)
        self._worker_timeout = spec.worker_timeout
        self._settling = False  # dropped by the training loop: no replacement any more
        self._start_workers(spec)

    # -- workers -----------------------------------------------------------------------------
    def _start_workers(self, spec: EpochSpec) -> None:
        watched = self._failover.enabled or self._worker_timeout > 0
        _check_fd_headroom(self._num_workers)
        watch = Watch(self._num_workers) if watched else None
        cfg = worker_config(spec, self._iterable, self._seed,
                            worker_init_fn=self._worker_init_fn,
                            start_method=self._ctx.get_start_method(),
                            restores=self._epoch_position.restore, generation=self._generation,
                            shared_seed=self._shared_seed,
                            watch=None if watch is None else watch.spec)
        self._cfg, self._watch = cfg, watch
        lifeline_r, lifeline_w = self._ctx.Pipe(duplex=False)
        # a forked worker's copies of the others' ends (and of the watchdog's files: it opens
        # its own through /proc)
        close_in_child = [lifeline_w.fileno(), *(watch.fds if watch is not None else ())]
        workers = []
        try:
            for wid in range(self._num_workers):
                parent, child = self._ctx.Pipe(duplex=True)
                close_in_child.append(parent.fileno())
                mine = dataclasses.replace(cfg, close_in_child=tuple(close_in_child))
                proc = self._ctx.Process(target=worker_loop, args=(mine, wid, child,
                                                                   lifeline_r), daemon=True)
                # before start: a Ctrl-C stops it
                workers.append(_Worker(wid, proc, parent, busy_since=time.monotonic()))
                try:
                    with signals_held_for_start(), _gc_frozen():
                        proc.start()
                except (TypeError, AttributeError, pickle.PicklingError):
                    warnings.warn(PICKLE_WARNING, stacklevel=4)
                    raise
                child.close()
                close_in_child.remove(parent.fileno())
        except BaseException as exc:
            _shutdown_all(workers, lifeline_w, os.getpid(),
                          [lifeline_r, *([watch] if watch is not None else [])])
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(exc.errno, _out_of_fds(self._num_workers)) from exc
            raise
        closables = [watch] if watch is not None else []
        if self._failover.enabled:  # a replacement needs the lifeline's read end
            self._lifeline_r = lifeline_r
            closables.append(lifeline_r)
        else:
            lifeline_r.close()
        self._worker_states = workers
        # What torch's own tests (and tools written against DataLoader) look at: the processes.
        self._workers = [w.process for w in workers]
        self._lifeline = lifeline_w
        self._broken = self._stopped = False
        self._finalizer = weakref.finalize(self, _shutdown_all, workers, lifeline_w,
                                           os.getpid(), closables)
        self._retire_hook = _forget_arena_hook(workers)
        self._pool.on_retire_arena.append(self._retire_hook)
        self._next_task = 0
        self._stale: dict = {}
        self._reset_epoch_state()

    def _reset_epoch_state(self) -> None:
        self._tasks: dict[int, tuple[_Worker, SlotRef]] = {}
        self._sent: dict[int, Task] = {}  # the tasks in `_tasks`, as sent (a replacement's)
        self._task_info: dict[int, tuple[int, int]] = {}  # task id -> (place in epoch, worker)
        self._ready: dict[int, Done | End | Failed] = {}  # answers not yet handed out
        self._next_yield = self._next_task  # task ids grow across epochs: never reused
        self._sampler_done = False
        # A resumed iterable epoch keeps its interleaving: the worker after the one that
        # delivered last goes first, and workers whose stream had ended stay idle.
        first = (self._epoch_position.last_worker + 1) % len(self._worker_states)
        order = self._worker_states[first:] + self._worker_states[:first]
        self._cycle = itertools.cycle(order)
        for w in self._worker_states:
            w.active = not self._epoch_position.stream_ended(w.id)
            w.outstanding = 0
            w.received = None

    def _stop(self) -> None:
        self._stopped = True
        if hasattr(self, "_worker_states"):
            if self._retire_hook in self._pool.on_retire_arena:
                self._pool.on_retire_arena.remove(self._retire_hook)
            self._finalizer()
            for tasks in (self._tasks, self._stale):  # workers are gone: nothing writes these
                for task_id in list(tasks):
                    self._pool.release(tasks.pop(task_id)[1])
            self._release_ready()

    def _release_ready(self) -> None:
        """Give back the slots of batches built but never handed out."""
        for answer in self._ready.values():
            if type(answer) is Done:
                self._pool.release(answer.batch.ref)
        self._ready.clear()

    def _shutdown_workers(self) -> None:
        """DataLoader's iterator's name for stopping its workers (torch's tests call it)."""
        self._stop()

    def _stop_on_interrupt(self, exc: BaseException) -> None:
        """Ctrl-C (or SystemExit from a signal handler) may have cut a message in half, and a
        pool that cannot grow leaves a worker waiting for its slot: stop the workers now; the
        next epoch starts fresh ones."""
        if not isinstance(exc, Exception) or isinstance(exc, PoolAllocationError):
            self._broken = True
            self._stop()

    def _reset(self, spec: EpochSpec) -> None:
        """A new epoch on persistent workers (`PooledLoader.__iter__`), possibly from a loaded
        state."""
        try:
            self._reset_workers(spec)
        except BaseException as exc:
            self._stop_on_interrupt(exc)
            raise

    def _reset_workers(self, spec: EpochSpec) -> None:
        self._reset_length_check(spec)
        self._shared_seed = self._seed_datapipe(spec)
        seed_before = self._seed
        resume = self._begin_epoch(spec, first=False)
        # Workers seeded from another base seed would not give the saved epoch's randomness, and
        # a loaded state, as in StatefulDataLoader, starts fresh workers (fresh copies of the
        # dataset, RNGs seeded anew) that restore it.
        dead = [w for w in self._worker_states if not is_alive(w.process)]
        if (self._broken or (dead and not self._failover.enabled)
                or self._seed != seed_before or resume is not None):
            self._stop()
            self._start_workers(spec)
            return
        for w in dead:  # died between epochs: replaced where its stream ended, in the old
            self._lost(w)  # generation (its start is not the new epoch's: Reset follows)
        self._generation += 1
        self._stale.update(self._tasks)  # results of these are dropped when they arrive
        self._release_ready()
        self._reset_epoch_state()
        # what the main process's dataset changed between epochs (a mix's set_weights) reaches
        # the persistent workers' copies with the epoch
        payload = hooks_of(spec.dataset).pooled_epoch()
        loader_epoch = spec.loader_epoch if hasattr(spec.dataset, "set_epoch") else None
        for w in self._worker_states:
            if loader_epoch is not None or payload is not None:
                w.conn.send(SetEpoch(loader_epoch=loader_epoch, payload=payload))
            w.conn.send(Reset(generation=self._generation, shared_seed=self._shared_seed))

    def _prepare_state(self) -> None:
        """Before a state is taken: also wait for the start state of every worker that has not
        sent it yet (it does so as soon as its epoch starts), as StatefulDataLoader waits for
        its workers' start-up states."""
        super()._prepare_state()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while not (self._stopped or self._broken) and self._unstarted():
            try:
                self._receive(deadline)
            except BaseException as exc:
                self._stop_on_interrupt(exc)
                raise

    def _unstarted(self) -> list[int]:
        return [w.id for w in self._worker_states
                if w.id not in self._epoch_position.started_workers]

    def _settle(self) -> None:
        """Dropped mid-epoch (a `for` loop's `break`): the loader's `state_dict()` can no longer
        ask this iterator, so collect the start states it would have waited for now (bounded:
        `timeout`, else SETTLE_S); workers still missing are named when a state is taken."""
        if self._stopped or self._broken or self._epoch_position.finished:
            return
        deadline = time.monotonic() + (self._timeout if self._timeout > 0 else SETTLE_S)
        self._settling = True
        try:
            while not (self._stopped or self._broken) and self._unstarted():
                self._receive(deadline)
        finally:
            self._epoch_position.unsettled = self._unstarted()

    # -- dispatch and receive --------------------------------------------------------------------
    def _try_dispatch(self) -> None:
        """DataLoader's dispatch: at most prefetch_factor * num_workers batches in flight or
        waiting, workers in turn; with in_order=False a worker already holding its share
        (in flight / active workers) is passed over, so a slow one does not gather tasks."""
        limit = self._prefetch * self._num_workers
        # An abandoned epoch's tasks (a break) still hold slots until their answers come back:
        # they count, or the new epoch would run the pool dry and grow it.
        while (not self._sampler_done
               and len(self._tasks) + len(self._ready) + len(self._stale) < limit):
            active = sum(w.active for w in self._worker_states)
            for _ in range(self._num_workers):
                worker = next(self._cycle)
                if worker.active and (self._in_order or worker.outstanding < limit // active):
                    break
            else:
                return  # no active worker (or none with room)
            payload = position = None
            if not self._iterable:
                try:
                    position, payload = self._next_payload()
                except StopIteration:
                    self._sampler_done = True
                    return
            ref = self._pool.acquire()
            task_id = self._next_task
            self._next_task += 1
            self._tasks[task_id] = (worker, ref)
            if not worker.outstanding:
                worker.busy_since = time.monotonic()
            worker.outstanding += 1
            self._task_info[task_id] = (position, worker.id)
            task = Task(task_id=task_id, generation=self._generation, payload=payload, ref=ref,
                        seed_epoch=self._sample_epoch(), trace=self._stats.tracing)
            self._sent[task_id] = task
            try:
                worker.conn.send(task)
            except (BrokenPipeError, ConnectionResetError):  # it died: say how, not EPIPE
                self._lost(worker)

    def _handle(self, worker: _Worker, msg: Done | End | Failed | NeedSlot | Started) -> None:
        worker.busy_since = time.monotonic()  # any message is progress (watchdog)
        if type(msg) is Started:
            worker.up = True
            # not an abandoned epoch's; and a replacement's start is not the epoch's (unless its
            # predecessor sent none): it stands where its predecessor's answers left the stream
            if msg.generation == self._generation \
                    and msg.worker_id not in self._epoch_position.started_workers:
                position = self._epoch_position
                position.stream_started(msg.worker_id, msg.snapshot, msg.items)
                start = position.streams.get(msg.worker_id)  # (none: a fresh stream)
                worker.received = (dataclasses.replace(start) if start is not None
                                   else WorkerStream(msg.worker_id))
            return
        if type(msg) is NeedSlot:
            self._pool.release(msg.old)
            ref = self._pool.acquire(msg.nbytes)
            if msg.task_id in self._tasks:
                self._tasks[msg.task_id] = (worker, ref)
            elif msg.task_id in self._stale:
                self._stale[msg.task_id] = (worker, ref)
            try:
                worker.conn.send(Slot(task_id=msg.task_id, ref=ref))
            except (BrokenPipeError, ConnectionResetError):  # it died: its sentinel says how
                pass
            return
        if msg.generation != self._generation or msg.task_id not in self._tasks:  # abandoned
            self._stale.pop(msg.task_id, None)
            self._pool.release(msg.batch.ref if type(msg) is Done else msg.ref)
            return
        self._tasks.pop(msg.task_id)
        self._sent.pop(msg.task_id, None)
        worker.outstanding -= 1
        if worker.received is not None:
            if type(msg) is End:
                worker.received.end(msg.position)
            elif type(msg) is Done and msg.position is not None:
                worker.received.advance(msg.position)
        if type(msg) is Done:
            self._stats.record_skips(msg.skipped)
            self._stats.worker_busy_s[worker.id] += msg.busy_s
            self._stats.record_batch(worker.id, msg.stages, msg.batch.num_samples, msg.busy_s,
                                     msg.spans)
        elif type(msg) is End:
            worker.active = False
            self._pool.release(msg.ref)
        else:
            self._stats.record_skips(msg.skipped)
            self._pool.release(msg.ref)
        self._ready[msg.task_id] = msg

    def _receive(self, deadline: float | None) -> None:
        live = {w.conn: w for w in self._worker_states}
        sentinels = {w.process.sentinel: w for w in self._worker_states}
        wake = deadline
        if self._worker_timeout > 0:  # the watchdog looks again when a worker is due
            busy = [w.busy_since + self._hang_limit(w) for w in self._worker_states
                    if w.outstanding]
            if busy:
                wake = min(busy) if wake is None else min(wake, min(busy))
        timeout = None if wake is None else max(0.0, wake - time.monotonic())
        ready = wait(list(live) + list(sentinels), timeout)
        if not ready and deadline is not None and time.monotonic() >= deadline:
            self._broken = True
            self._stop()
            raise RuntimeError(timeout_message(self._timeout))
        for obj in ready:
            worker = live.get(obj)
            if worker is not None and worker.conn is obj:  # not replaced meanwhile
                if not self._read(worker):
                    self._lost(worker)
        for obj in ready:
            worker = sentinels.get(obj)
            if worker is not None and worker.process.sentinel == obj:
                self._lost(worker)
        if self._worker_timeout > 0:
            self._check_hung()

    # -- failures (docs/failures.md) --------------------------------------------------------------
    def _hang_limit(self, worker: _Worker) -> float:
        return self._worker_timeout if worker.up else max(self._worker_timeout,
                                                          START_TIMEOUT_S)

    def _check_hung(self) -> None:
        """The watchdog: a worker owing a batch that sent nothing for `worker_timeout` seconds.
        What is already in its pipe is read first (the time spent replacing another worker
        passes for all of them)."""
        for w in list(self._worker_states):
            if not w.outstanding:
                continue
            if not self._read(w):
                self._lost(w)
                continue
            silent = time.monotonic() - w.busy_since
            if w.outstanding and silent >= self._hang_limit(w):
                self._lost(w, hung_s=silent)

    def _read(self, worker: _Worker) -> bool:
        """Handle every message waiting in `worker`'s pipe; False when the pipe ended."""
        try:
            while worker.conn.poll():
                self._handle(worker, worker.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _drain(self, worker: _Worker) -> None:
        """The answers a dead worker finished before it died."""
        try:
            self._read(worker)
        except (pickle.UnpicklingError, ValueError):
            pass  # a message cut in half

    def _lost(self, worker: _Worker, hung_s: float | None = None) -> None:
        """Worker `worker` died (or hung `hung_s` seconds, and is killed here): replace it
        (`_replace`) when failover allows, else stop every worker and raise, naming what it was
        on and, for a hang, its stack."""
        watch, process = self._watch, worker.process
        stack = ""
        if hung_s is not None and is_alive(process):
            if watch is not None:
                stack = watch.ask_dump(worker.id, process.pid)
            process.kill()
            join(process, KILL_WAIT_S)
        else:
            join(process, 1.0)
            if is_alive(process):  # its pipe broke but it lingers: it is replaced for good
                process.kill()
                join(process, KILL_WAIT_S)
        self._drain(worker)
        if watch is not None:
            stack = stack or watch.new_dump(worker.id)
        where, reading = watch.where(worker.id) if watch is not None else (None, None)
        if hung_s is not None:
            cause = (f"made no progress for {hung_s:.1f} s (worker_timeout="
                     f"{self._worker_timeout}) and was killed")
        else:
            cause = cause_of_exit(process.exitcode)
        owed = sorted(t for t, (w, _) in self._tasks.items() if w is worker)
        record = Replacement(worker_id=worker.id, pid=process.pid, cause=cause, where=where,
                             reading=reading, tasks=len(owed))
        received = worker.received  # replayable: it has a state, or consumed nothing yet
        unreplayable = (self._iterable and worker.active and received is not None
                        and not received.has_state and received.items > 0)
        if self._failover.allows() and not self._settling and not unreplayable:
            self._failover.record(record, stack)
            self._replace(worker, owed)
            return
        self._broken = True
        self._stop()
        raise WorkerError(self._failover.lost_message(record, process.exitcode, hung_s,
                                                      self._worker_timeout, stack, unreplayable))

    def _replace(self, worker: _Worker, owed: list[int]) -> None:
        """Start a new process for `worker`'s id, where its stream stood, and send it again the
        tasks it owed, into the same slots."""
        worker.conn.close()
        for task_id in [t for t, (w, _) in self._stale.items() if w is worker]:
            self._pool.release(self._stale.pop(task_id)[1])  # nobody writes it any more
        received = worker.received
        if received is None:  # it never started: as it was to start
            restore = self._epoch_position.resume_stream(worker.id)
        else:  # where its answers left its stream (no state: a fresh start)
            restore = received.restore() if received.has_state else None
        others = [w.conn.fileno() for w in self._worker_states if w is not worker]
        cfg = dataclasses.replace(
            self._cfg, restores=None if restore is None else {worker.id: restore},
            generation=self._generation, shared_seed=self._shared_seed,
            close_in_child=(self._lifeline.fileno(), *(self._watch.fds if self._watch else ()),
                            *others))
        if self._watch is not None:
            self._watch.clear(worker.id)
        parent, child = self._ctx.Pipe(duplex=True)
        cfg = dataclasses.replace(cfg, close_in_child=cfg.close_in_child + (parent.fileno(),))
        proc = self._ctx.Process(target=worker_loop, args=(cfg, worker.id, child,
                                                           self._lifeline_r), daemon=True)
        # before start: a Ctrl-C now stops it with the others (the finalizer holds `worker`)
        worker.process, worker.conn = proc, parent
        worker.outstanding, worker.busy_since, worker.up = 0, time.monotonic(), False
        self._workers[worker.id] = proc
        try:
            with signals_held_for_start(), _gc_frozen():
                proc.start()
        except Exception as exc:  # no process, no memory, no fd left: the run cannot go on
            self._broken = True
            self._stop()
            raise WorkerError(f"PooledLoader could not start a replacement for worker "
                              f"{worker.id}: {type(exc).__name__}: {exc}") from exc
        finally:
            child.close()
        for task_id in owed:
            self._sent[task_id] = task = dataclasses.replace(self._sent[task_id],
                                                             ref=self._tasks[task_id][1])
            worker.outstanding += 1
            worker.conn.send(task)

    def __next__(self) -> Any:
        try:
            return self._next_batch()
        except BaseException as exc:
            self._stop_on_interrupt(exc)
            raise

    def _next_batch(self) -> Any:
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout if self._timeout > 0 else None
        while True:
            if self._broken:
                raise RuntimeError("this PooledLoader iterator stopped after an error; "
                                   "start a new epoch with iter(loader)")
            self._try_dispatch()
            answer = self._pop_ready()
            if answer is not None:
                position, worker_id = self._task_info.pop(answer.task_id)
                if type(answer) is End:
                    self._epoch_position.delivered_end(worker_id, answer.position)
                    continue
                if type(answer) is Failed:
                    _reraise(answer.error)
                batch = self._build(answer.batch)
                try:
                    self._count_skips(answer.skipped, answer.batch.num_samples)
                except SkipBudgetExceeded:
                    self._broken = True
                    self._stop()
                    raise
                if self._iterable:
                    self._epoch_position.delivered_batch(worker_id, answer.position)
                else:
                    self._epoch_position.delivered_task(position, worker_id, answer.position)
                self._mark_wait(started)
                self._check_length()
                return batch
            if not self._tasks and (self._sampler_done or not any(
                    w.active for w in self._worker_states)):
                self._epoch_position.finish()
                self._epoch_done()
                if not self._persistent:
                    self._stop()
                raise StopIteration
            self._receive(deadline)

    def _pop_ready(self) -> Done | End | Failed | None:
        if self._in_order:
            answer = self._ready.pop(self._next_yield, None)
            if answer is not None:
                self._next_yield += 1
            return answer
        if self._ready:
            return self._ready.pop(next(iter(self._ready)))
        return None

    def __del__(self) -> None:
        try:
            pid = os.getpid()
        except Exception:  # noqa: BLE001 - interpreter shutdown: module globals are gone
            return
        if getattr(self, "_owner_pid", None) != pid:
            # Garbage inherited by a forked process (a torch DataLoader's worker collects it):
            # its pipes are the parent's; waiting on them there would hang and steal messages.
            return
        try:
            self._settle()  # a Ctrl-C here still stops the workers (finally)
        except Exception:  # noqa: BLE001 - the missing workers are named by state_dict()
            pass
        finally:
            try:
                self._stop()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
