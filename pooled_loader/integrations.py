"""PooledLoader inside training stacks: HF accelerate (Lightning and HF datasets need nothing).

accelerate
----------
``Accelerator.prepare(loader)`` rebuilds every ``DataLoader`` it is given: it reads the
constructor arguments back, wraps the batch sampler in its ``BatchSamplerShard`` (or an iterable
dataset in ``IterableDatasetShard``) and builds a plain ``torch.utils.data.DataLoader`` inside its
``DataLoaderShard``. Left alone, that silently drops the pool, the zero-copy batches and the
statistics. :func:`patch_accelerate` wraps accelerate's ``prepare_data_loader`` and
``skip_first_batches`` so that, for a ``PooledLoader``, the loader inside accelerate's wrapper is
a ``PooledLoader`` built from exactly the arguments accelerate chose (so the batches, their
sharding per process and their order are the ones accelerate gives for an equivalent
``DataLoader``), plus the original's ``pool_slots``, ``on_error``, ``device_transform``,
``trace`` and ``device`` (accelerate's device when the original has none and it is a CUDA device, so the
pinned pool's asynchronous copy does the transfer). Everything accelerate's wrapper does stays:
device placement, RNG synchronisation, ``end_of_dataloader`` for gradient accumulation,
``skip_first_batches``. ``isinstance(prepared, PooledLoader)`` holds and ``prepared.stats()``
works.

It is applied automatically, whatever the import order: importing ``pooled_loader`` patches
an accelerate that is already imported, or else installs a one-shot import hook that patches
accelerate as soon as it is imported. ``pooled_loader.integrations.patch_accelerate()`` does it
explicitly (idempotent).

An iterable dataset that splits itself by rank (``splits_by_rank = True``, e.g.
``pooled_loader.webdataset.WebDataset``) keeps its own split: every process reads its own share
(accelerate's default for iterable datasets, ``dispatch_batches``, would have process 0 read and
split batches that are already one rank's share; an explicit ``dispatch_batches=True`` warns),
and accelerate's ``IterableDatasetShard`` is not put around it. What cannot be kept (TPU/XLA's ``MpDeviceLoaderWrapper``; torchdata's
``StatefulDataLoader`` while ``PooledLoader`` has no ``state_dict``) warns, naming what was kept
instead.

Resuming under accelerate (``Accelerator(dataloader_config=DataLoaderConfiguration(
use_stateful_dataloader=True))``, or ``prepared.state_dict()``/``load_state_dict()``) is made
exact where accelerate alone is not:

- accelerate's ``state_dict()`` returns a copy it refreshes only while batches are delivered, so
  a state taken right after ``load_state_dict()`` was the one from before the load (``{}`` at
  first: the next resume replayed the epoch from its start). The patched ``load_state_dict``
  keeps the loaded state as that copy, and puts accelerate's epoch counter (``iteration``, which
  its ``__iter__`` passes to ``set_epoch``) back to the state's epoch: the sampler's own epoch
  when the saved pass began (``_pooled.sampler_epoch``), else the loader's. With
  ``use_seedable_sampler=True`` the permutation is ``SeedableRandomSampler``'s, drawn from
  ``seed + epoch``; the counter restarted at 0 in a new process, so a state saved in epoch 1 or
  later resumed epoch 0's permutation at the saved position (items lost and repeated; with a
  plain ``DataLoader`` under ``use_stateful_dataloader=True``, accelerate's own
  ``StatefulDataLoader`` loses the same items). That sampler also adds 1 to its epoch at each
  pass's end, which the replay of a finished pass must not do again
  (``engine.position.SamplerCursor.run_out``).
- A shuffled map-style loader on several processes: accelerate wraps the batch sampler in its
  ``BatchSamplerShard`` and gives the sampler a generator of its own, whose state it never saves;
  a resume in new processes replayed the first epoch's permutation at the saved position
  (accelerate issue 4195). Our ``ResumableRandomSampler`` inside it is kept resumable: the shard
  saves the generator's state at the start of its pass and the batches it gave, and a loaded
  state replays that very pass (:class:`_ResumableShard`).

HF datasets' ``IterableDataset`` resumed in one process without ``set_epoch``: see
pooled_loader.resume.replay_watch.
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

import torch
from torch.utils.data import DistributedSampler, IterableDataset

from .core.errors import StateMismatch

__all__ = ["patch_accelerate", "maybe_patch_accelerate"]

# DataLoader's constructor arguments that accelerate passes through unchanged.
_PASSED_THROUGH = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "prefetch_factor",
                   "persistent_workers", "pin_memory_device", "in_order")
_PATCHED = "_pooled_loader_patched"


_ACCELERATOR_MODULE = "accelerate.accelerator"  # the module whose import completes accelerate


def maybe_patch_accelerate() -> None:
    """:func:`patch_accelerate` now if accelerate is imported, else as soon as it is (cheap)."""
    if _ACCELERATOR_MODULE in sys.modules:
        patch_accelerate()
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches accelerate right after ``accelerate.accelerator`` has executed, so a loader built
    before ``import accelerate`` is kept too. Removes itself on first use."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _ACCELERATOR_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            patch_accelerate()
        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def patch_accelerate() -> None:
    """Make ``Accelerator.prepare`` (and ``skip_first_batches``) keep ``PooledLoader``s
    (idempotent; see the module docstring)."""
    import accelerate.accelerator as acc
    import accelerate.data_loader as adl

    for name in ("prepare_data_loader", "skip_first_batches"):
        original = getattr(adl, name)
        if getattr(original, _PATCHED, False):
            continue
        wrapped = _keeping_pooled(original)
        setattr(adl, name, wrapped)
        if getattr(acc, name, None) is original:  # accelerator.py imported it by name
            setattr(acc, name, wrapped)
    adapter = adl.DataLoaderAdapter
    if not getattr(adapter.load_state_dict, _PATCHED, False):
        adapter.load_state_dict = _keeping_loaded_state(adapter.load_state_dict)


def _keeping_loaded_state(original: Callable) -> Callable:
    """accelerate's ``load_state_dict``, after which ``state_dict()`` gives the loaded state (not
    accelerate's copy from before the load) and the epoch counter is the state's."""
    @functools.wraps(original)
    def load_state_dict(self: Any, state_dict: Any) -> None:
        original(self, state_dict)
        from .loader import PooledLoader
        if not isinstance(self.__dict__.get("base_dataloader"), PooledLoader):
            return
        self.dl_state_dict = copy.deepcopy(state_dict)
        pooled = state_dict.get("_pooled") if isinstance(state_dict, dict) else None
        pooled = pooled if isinstance(pooled, dict) else {}
        # accelerate's set_epoch(iteration) reaches the sampler, not our loader: the sampler's
        # epoch is the counter (a SeedableRandomSampler's permutation is seed + epoch)
        epoch = pooled.get("sampler_epoch")
        epoch = pooled.get("loader_epoch") if epoch is None else epoch
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 \
                and hasattr(self, "iteration"):
            # a finished epoch (accelerate marks its last batch so) resumes at the next one
            self.iteration = epoch + bool(state_dict.get("_iterator_finished"))

    setattr(load_state_dict, _PATCHED, True)
    return load_state_dict


def _keeping_pooled(original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(dataloader: Any, *args: Any, **kwargs: Any) -> Any:
        from .loader import PooledLoader
        template = dataloader
        if not isinstance(template, PooledLoader):
            return original(dataloader, *args, **kwargs)
        template = getattr(dataloader, "base_dataloader", dataloader)  # already prepared
        processes = kwargs.get("num_processes") or 1
        if processes > 1 and isinstance(template.sampler, DistributedSampler):
            warnings.warn(
                "PooledLoader: this loader already has a DistributedSampler (distributed=True?) "
                "and accelerate shards its batches across processes again: each process would "
                f"see 1/{processes} of its share. Build the loader without distributed=True or a "
                "DistributedSampler when using accelerator.prepare.", UserWarning, stacklevel=3)
        if getattr(template.dataset, "splits_by_rank", False) and "dispatch_batches" in kwargs:
            if kwargs["dispatch_batches"] is None:  # accelerate's default for iterables: True
                kwargs["dispatch_batches"] = False
            elif kwargs["dispatch_batches"]:
                warnings.warn(
                    f"PooledLoader: dispatch_batches=True makes process 0 read and split the "
                    f"batches, but {type(template.dataset).__name__} already splits itself by "
                    "rank: each process would get a fraction of one rank's share. Use "
                    "Accelerator(dataloader_config=DataLoaderConfiguration("
                    "dispatch_batches=False)).", UserWarning, stacklevel=3)
        return _swap_base(original(dataloader, *args, **kwargs), template)

    setattr(wrapper, _PATCHED, True)
    return wrapper


def _swap_base(prepared: Any, template: Any) -> Any:
    """Replace the plain DataLoader inside accelerate's wrapper with a PooledLoader."""
    from .loader import PooledLoader
    base = getattr(prepared, "base_dataloader", None)
    if base is None:
        if type(prepared) is torch.utils.data.DataLoader:  # skip_first_batches on a raw loader
            return _rebuild(prepared, template, template.device)
        warnings.warn(
            f"PooledLoader: accelerate returned a {type(prepared).__name__} (e.g. TPU/XLA, or "
            "skip_first_batches on an unprepared iterable loader), which wraps a plain torch "
            "DataLoader: the pool is not used there. Pass the loader through "
            "accelerator.prepare first, or iterate the PooledLoader itself and move batches "
            "to accelerator.device.", UserWarning, stacklevel=4)
        return prepared
    if isinstance(base, PooledLoader):
        return prepared
    if type(base).__name__ == "StatefulDataLoader" and not hasattr(PooledLoader, "state_dict"):
        warnings.warn(
            "PooledLoader: Accelerator(use_stateful_dataloader=True) needs a loader with "
            "state_dict(); this PooledLoader has none, so accelerate's StatefulDataLoader is "
            "kept and the pool is not used. Drop use_stateful_dataloader to keep PooledLoader.",
            UserWarning, stacklevel=4)
        return prepared
    device = template.device
    accel_device = getattr(prepared, "device", None)
    if device is None and accel_device is not None and torch.device(accel_device).type == "cuda":
        device = accel_device
    prepared.base_dataloader = _rebuild(base, template, device)
    if hasattr(prepared, "dl_state_dict"):
        # Not state_dict(): before the first iter() it would start the epoch (draw the shuffle)
        # now, before accelerate synchronises the processes' RNGs at iter(). {} is torchdata's
        # "nothing to restore"; accelerate replaces it at the first batch.
        prepared.dl_state_dict = {}
    return prepared


def _rebuild(base: Any, template: Any, device: Any) -> Any:
    """A PooledLoader with ``base``'s arguments (as accelerate built them) and ``template``'s
    extras."""
    from .loader import PooledLoader
    dataset = base.dataset
    inner = getattr(dataset, "dataset", None)
    if type(dataset).__name__ == "IterableDatasetShard" and getattr(inner, "splits_by_rank",
                                                                    False):
        dataset = inner  # it splits itself by rank, with equal counts per rank
    if isinstance(dataset, IterableDataset):
        batching: dict = {"batch_size": base.batch_size, "drop_last": base.drop_last}
    elif base.batch_sampler is not None:
        batching = {"batch_sampler": _resumable_shard(base.batch_sampler)}
    else:
        batching = {"batch_size": None, "sampler": base.sampler}
    loader = PooledLoader(dataset, **batching, **{k: getattr(base, k) for k in _PASSED_THROUGH},
                          pool_slots=template.pool_slots, on_error=template.on_error,
                          device=device, device_transform=template.device_transform,
                          snapshot_every_n_steps=template.snapshot_every_n_steps,
                          per_sample_seed=template.per_sample_seed,
                          trace=template.trace_path, trace_batches=template.trace_batches)
    loader._epoch = template._epoch
    return loader


class _ResumableShard:
    """Mixed into accelerate's ``BatchSamplerShard`` around our ``ResumableRandomSampler``: its
    pass can be saved and replayed. ``state_dict()`` is the sampler's start of the pass (its
    generator's state, or its seed) and the batches this process has taken; after
    ``load_state_dict()`` the next pass replays that one and passes over those batches, drawing
    indices only. (The shard cannot be restored from the sampler's own count: that counts the
    other processes' batches too.)"""

    _start: Any = None
    _taken = 0
    _replay: Any = None

    def __iter__(self) -> Any:
        replay, self._replay = self._replay, None
        self._taken, skip = 0, 0
        self._start = None
        if replay is not None:
            if replay["pass"] is not None:
                self.batch_sampler.sampler.load_state_dict({**replay["pass"], "yielded": 0})
                self._start = replay["pass"]
            skip = replay["batches"]
        return self._batches(skip)

    def _batches(self, skip: int) -> Any:
        for batch in super().__iter__():  # type: ignore[misc]
            if self._start is None:  # the pass has started: its start is known now
                self._start = {k: v for k, v in self.batch_sampler.sampler.state_dict().items()
                               if k != "yielded"}
            self._taken += 1
            if self._taken > skip:
                yield batch

    def state_dict(self) -> dict:
        start = self._start
        if start is None:  # asked before the pass's first batch: where it will start
            from .engine.sampler import encode_generator  # here: `import pooled_loader` loads
            gen = self.batch_sampler.sampler.generator  # this module, and nothing of engine/
            start = None if gen is None else {"generator": encode_generator(gen.get_state())}
        return {"pass": start, "batches": self._taken}

    def load_state_dict(self, state: Any) -> None:
        batches = state.get("batches") if isinstance(state, dict) else None
        if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0 or (
                state.get("pass") is not None and not isinstance(state["pass"], dict)):
            raise StateMismatch("PooledLoader.load_state_dict: the state of accelerate's "
                                "BatchSamplerShard should be {'pass': dict or null, "
                                f"'batches': count}}, got {state!r:.120}")
        self._replay = state


_SHARD_CLASSES: dict = {}


def _resumable_shard(batch_sampler: Any) -> Any:
    """`batch_sampler`, as a `_ResumableShard` when it is accelerate's BatchSamplerShard around
    a torch BatchSampler of our ResumableRandomSampler (shuffle=True)."""
    from accelerate.data_loader import BatchSamplerShard

    from .engine.sampler import ResumableRandomSampler
    inner = getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)
    if type(batch_sampler) is not BatchSamplerShard or not isinstance(inner,
                                                                       ResumableRandomSampler):
        return batch_sampler
    cls = _SHARD_CLASSES.get(BatchSamplerShard)
    if cls is None:  # named as accelerate's: a state's sampler check compares the names
        cls = _SHARD_CLASSES[BatchSamplerShard] = type(
            "BatchSamplerShard", (_ResumableShard, BatchSamplerShard), {"__module__": __name__})
    shard = object.__new__(cls)
    shard.__dict__.update(batch_sampler.__dict__)
    return shard

