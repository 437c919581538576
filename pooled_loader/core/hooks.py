"""`LoaderHooks`: what a dataset may add to torch's Dataset for `PooledLoader`, declared once.

The loader and its workers import no dataset (the machinery sits below `mix/` and `shards/`), so a
dataset that wants a say (`mix.Mix`, `shards.WebDataset`) declares the hooks by subclassing
`LoaderHooks` (a Protocol, as torchdata's `Stateful`, for type checkers): each method's body here
is its default, which does nothing. `hooks_of(dataset)` is the one place that asks, by the
dataset's class hierarchy: a method of the same name on a class that does not declare the hooks
is not one of them (and, unlike a runtime Protocol check, asking never writes to the user's class:
Python 3.11's adds an `__annotations__` to it). Who calls each hook, and when: CONTRACTS.md
("Loader <-> a dataset's own hooks").
"""
from __future__ import annotations

from typing import Any, Protocol

__all__ = ["LoaderHooks", "hooks_of"]


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

    def pooled_finish_batch(self, leaves: list) -> type | None:
        """In the worker, once the default collate has written a map-style batch into its slot:
        change it there in place (`leaves`: numpy views of the batch's array leaves, in tree
        order); return the sequence type to hand the batch out as instead of default_collate's
        list (a collate function's tuple, say), or None to keep it."""
        return None


class _NoHooks(LoaderHooks):
    """Every hook's default: what a dataset that declares none gets."""


_DEFAULTS = _NoHooks()


def hooks_of(dataset: Any) -> LoaderHooks:
    """The dataset itself when its class declares the hooks, else hooks that do nothing."""
    return dataset if LoaderHooks in type(dataset).__mro__ else _DEFAULTS
