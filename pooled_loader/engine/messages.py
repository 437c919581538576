"""Messages between the main process (`worker_iter.py`) and its workers (`worker.py`).

Every message is a small frozen dataclass, built with keywords only, sent over the worker's pipe.
Only the slot's *layout* travels, never sample data: a message pickles to a few hundred bytes.

Main process -> worker (sent by `worker_iter.WorkerIter`, answered by `worker.worker_loop`):
    Task       build one batch into a slot
    Slot       the bigger slot a worker asked for with NeedSlot
    Forget     unmap a retired arena
    Reset      a new epoch on persistent workers: restart an iterable dataset's iterator
    SetEpoch   forward `set_epoch` (and the dataset's per-epoch payload) to the worker's copy
    None       stop: the worker returns
    Restore    where a worker's stream starts after a load: handed over with its start
               (`worker.WorkerConfig.restores`), read by `worker.BatchMaker.reset_iterator`

Two counters travel, each named for what it counts: `generation` (the epochs run by these
workers: 0 at their start, one more at each Reset; answers of an abandoned one are dropped) and
`seed_epoch` (the epoch per-sample seeds are drawn for, kept across a resume). The user's
`set_epoch()` value travels as `SetEpoch.loader_epoch`.

Worker -> main process (sent by `worker.worker_loop`, handled by `worker_iter.WorkerIter._handle`):
    Done          the batch is in its slot (exactly one of Done, End or Failed answers a Task)
    End           an iterable dataset is exhausted; the task's slot is unused; carries the
                  dataset's state after its end of pass (what an end-of-epoch state restores)
    Failed        building the batch raised (or, as in DataLoader, worker_init_fn or
                  iter(dataset) did: then every task of that worker is answered so)
    NeedSlot      the batch does not fit its slot: asks for a bigger one, answered by Slot
    Started       the worker's epoch has started (after its first start and after each Reset):
                  where its dataset and stream stand, so that a state taken before the worker
                  delivers anything still records them (StatefulDataLoader's start-up state)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import Leaf
from .pool import SlotRef

# No __slots__: a slotted dataclass pickles through Python-level __getstate__/__setstate__
# (several times slower per message); with a __dict__, pickle copies it in C.
_MESSAGE = dict(frozen=True, kw_only=True)


# -- payloads -------------------------------------------------------------------------------------
@dataclass(**_MESSAGE)
class BatchLayout:
    """Where a built batch lies in its slot: enough for the main process to view it zero-copy.

    Produced by `worker.BatchMaker.make`; turned into tensors by `iterators._IterBase._build`."""

    ref: SlotRef  # the slot holding it (possibly bigger than the one the task named)
    spec: tuple  # the tree structure (layout.flatten's spec, already collated)
    leaves: list[tuple[Leaf, int]]  # each array leaf and its byte offset in the slot
    metas: list  # the non-array leaves (strings, ...), in tree order
    num_samples: int

    @property
    def nbytes(self) -> int:
        """The bytes of the slot the batch uses (its end; the slot may be larger)."""
        return max((offset + leaf.nbytes for leaf, offset in self.leaves), default=0)


@dataclass(**_MESSAGE)
class ErrorInfo:
    """A picklable description of an exception raised in a worker (see `worker.error_message`)."""

    exc_type: type
    message: str
    traceback: str  # the formatted original traceback
    worker_id: int
    index: Any  # the sample index being loaded, or None


# -- main process -> worker -----------------------------------------------------------------------
@dataclass(**_MESSAGE)
class Task:
    """Build the batch of `payload` (a sampler's indices, or None for an iterable dataset) into
    the slot `ref`. Task ids grow across epochs and are never reused."""

    task_id: int
    generation: int  # the workers' epoch it belongs to: answers of an abandoned one are dropped
    payload: Any
    ref: SlotRef
    seed_epoch: int = 0  # the epoch per-sample seeds are drawn for (kept across a resume)
    trace: bool = False  # record this batch's spans for the trace file (trace.py)


@dataclass(**_MESSAGE)
class Slot:
    """The answer to `NeedSlot`: write task `task_id` into `ref` instead."""

    task_id: int
    ref: SlotRef


@dataclass(**_MESSAGE)
class Forget:
    """The main process retired arena `arena_id` of process `owner_pid`: unmap it."""

    owner_pid: int
    arena_id: int


@dataclass(**_MESSAGE)
class Reset:
    """A new epoch on persistent workers: start the iterable dataset's iterator afresh, and
    answer with `Started`."""

    generation: int  # the workers' new epoch, echoed by Started
    shared_seed: int | None = None  # the new epoch's seed for a datapipe graph (DataLoader's)


@dataclass(**_MESSAGE)
class SetEpoch:
    """Call `dataset.set_epoch(loader_epoch)` on the worker's copy of the dataset (unless None),
    then `pooled_load_epoch(payload)` with what the main process's copy gave for the epoch
    (`pooled_epoch()`, e.g. a mix's weights in force; `core.hooks`)."""

    loader_epoch: int | None  # the loader's set_epoch() value
    payload: Any = None


@dataclass(**_MESSAGE)
class Restore:
    """Where one worker's epoch starts after `load_state_dict` (`position.Resume.restores`):
    its dataset's and its iterator's saved states, then the `skip` items its delivered batches
    consumed after them, read again and dropped. With `new_epoch` (a state saved at an epoch's
    end) the states are loaded and the next epoch starts, its dataset told `set_epoch(set_epoch)`
    first (unless None), as a persistent worker is."""

    dataset_state: Any  # None: nothing to load
    iter_state: Any
    items: int  # items this worker's delivered batches consumed, this epoch
    skip: int  # of those, the ones after the saved states
    new_epoch: bool = False
    set_epoch: int | None = None


# -- worker -> main process -----------------------------------------------------------------------
@dataclass(**_MESSAGE)
class StreamPosition:
    """Where a worker's iterable stream stands right after a batch: the items it has consumed
    this epoch and, every `snapshot_every_n_steps` of its batches, (dataset state, iterator state)
    from their `state_dict()` (None where they have none)."""

    items: int
    snapshot: tuple[Any, Any] | None


@dataclass(**_MESSAGE)
class Done:
    """Task `task_id` is built; its batch lies in `batch.ref`."""

    task_id: int
    generation: int
    batch: BatchLayout
    skipped: list[tuple[Any, str]]  # (index, reason) of samples replaced under on_error="skip"
    busy_s: float  # seconds the worker spent on it
    # iterable datasets; map-style ones only where the dataset has its own state
    position: StreamPosition | None = None
    stages: dict[str, float] | None = None  # seconds per stage of this batch (stages.py)
    spans: list | None = None  # when the task asked for a trace: (stage, start ns, ns, index)


@dataclass(**_MESSAGE)
class Started:
    """Worker `worker_id` has started its epoch `generation` (its first start, or a Reset): its
    dataset's (and stream's) state at that point, after any restore, and the items consumed."""

    worker_id: int
    generation: int
    snapshot: tuple[Any, Any] | None  # (dataset state, iterator state); None: no state at all
    items: int


@dataclass(**_MESSAGE)
class End:
    """An iterable dataset has no more items for this worker; slot `ref` is unused. `position`
    holds the dataset's state after its iterator ended (a dataset may reset its cursor or count
    its passes there), whatever `snapshot_every_n_steps` is."""

    task_id: int
    generation: int
    ref: SlotRef
    position: StreamPosition | None = None


@dataclass(**_MESSAGE)
class Failed:
    """Building task `task_id` raised; slot `ref` is unused."""

    task_id: int
    generation: int
    error: ErrorInfo
    ref: SlotRef
    skipped: list[tuple[Any, str]]


@dataclass(**_MESSAGE)
class NeedSlot:
    """Task `task_id` needs `nbytes`; the main process frees `old` and answers with `Slot`."""

    task_id: int
    nbytes: int
    old: SlotRef
