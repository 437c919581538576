"""A resumed HF datasets ``IterableDataset`` that would replay its loaded state: say so.

HF datasets' ``IterableDataset`` (e.g. ``Dataset.to_iterable_dataset()``, streaming datasets)
restarts from a loaded state at *every* pass of the epoch the state was saved in, until its
``set_epoch`` moves it on. Where the restored copy lives on (``num_workers=0``, persistent
workers), a loop that does not call ``set_epoch`` gets only the rest of the resumed epoch in every
later epoch (3 batches of 64, say), under DataLoader and StatefulDataLoader alike. That is the
dataset's own rule, which a loader cannot undo without losing the states other datasets carry
between epochs: :class:`ReplayWatch` warns once, at the second pass, with the fix
(``loader.set_epoch(epoch)`` before each epoch). Imports nothing of the package.
"""
from __future__ import annotations

import warnings
from typing import Any

__all__ = ["ReplayWatch"]


class ReplayWatch:
    """Watches a loader resumed with a dataset state of HF datasets' ``IterableDataset`` kept in
    one process: warns at the second pass if the dataset's epoch has not moved since the resumed
    pass."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.passes = 0
        self.epoch: Any = None

    @classmethod
    def after_load(cls, dataset: Any, kept_in_process: bool,
                   dataset_states: bool) -> "ReplayWatch | None":
        """A watch for a loader that has just loaded a state (None: nothing to watch).
        `kept_in_process`: 0 workers or persistent workers; `dataset_states`: the state restores
        the dataset's own state."""
        kind = type(dataset)
        hf = kind.__name__ == "IterableDataset" and kind.__module__.startswith("datasets.")
        return cls(dataset) if hf and kept_in_process and dataset_states else None

    def before_pass(self) -> bool:
        """Called as a pass starts; False once there is nothing more to watch."""
        epoch = getattr(self.dataset, "epoch", None)
        self.passes += 1
        if self.passes == 1:
            self.epoch = epoch
            return True
        if epoch == self.epoch:
            warnings.warn(
                f"PooledLoader: the datasets.IterableDataset was resumed from a state of its "
                f"epoch {epoch}, and this new pass is at that epoch again: it restarts from the "
                "loaded state at every pass of that epoch, so this pass gives only what was "
                "left of it (with num_workers=0 or persistent workers, as in DataLoader and "
                "StatefulDataLoader). Call loader.set_epoch(epoch) before each epoch.",
                UserWarning, stacklevel=3)
        return False
