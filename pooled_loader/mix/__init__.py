"""Weighted, resumable mixing of datasets: the dataset (dataset), its order (order) and its
checkpoint state (state).

Imports core/, observability/ and shards/ (``shards.elastic``: an iterable source's elastic
merge, in ``state``).

``pooled_loader.mix`` is a public import path: it re-exports ``pooled_loader.mix.dataset`` (the
module it was before the regroup)."""
from __future__ import annotations

from .dataset import Mix, merge_mix_states  # noqa: F401

__all__ = ['Mix', 'merge_mix_states']
