"""`LoaderHooks`: what a dataset may add to torch's Dataset for `PooledLoader`, declared once.

The loader and its workers import no dataset (the machinery sits below `mix/` and `shards/`), so a
dataset that wants a say (`mix.Mix`, `shards.WebDataset`) declares the hooks by subclassing
`LoaderHooks`: each method's body here is its default, which does nothing. An object that
defines all six without subclassing matches too (a runtime-checkable Protocol, as torchdata's
`Stateful`). `hooks_of(dataset)` is the one place that asks; every other dataset gets the
defaults. Who calls each hook, and when: CONTRACTS.md ("Loader <-> a dataset's own hooks").
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["LoaderHooks", "hooks_of"]


@runtime_checkable
class LoaderHooks(Protocol):
    """A dataset's hooks into the loader (each a no-op unless overridden)."""

    def pooled_batch_size(self, batch_size: int | None) -> None:
        """`PooledLoader.__init__`: the loader's batch size (None: one sample a step)."""

    def pooled_check_states(self, states: list) -> None:
        """`load_state_dict`, main process: every worker's saved dataset state (None where none);
        raise ValueError naming the bad key before any worker starts."""

    def pooled_figures(self, states: list, figures: dict) -> dict:
        """`stats()`: figures to merge into the loader's, from the delivered dataset states."""
        return {}

    def pop_skips(self) -> list[tuple[Any, str]]:
        """In the worker, after each batch: `(where, reason)` of the reads skipped since."""
        return []

    def pooled_epoch(self) -> Any:
        """A persistent iterator's new epoch, main process: what the workers' copies need of
        this copy (it must pickle; None: nothing)."""
        return None

    def pooled_load_epoch(self, payload: Any) -> None:
        """In each worker: `pooled_epoch()`'s payload from the main process's copy."""


_DEFAULTS = type("NoHooks", (LoaderHooks,), {})()


def hooks_of(dataset: Any) -> LoaderHooks:
    """The dataset itself when it declares the hooks, else hooks that do nothing."""
    return dataset if isinstance(dataset, LoaderHooks) else _DEFAULTS
