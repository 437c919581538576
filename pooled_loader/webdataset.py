"""Public import path: re-exports ``pooled_loader.shards.webdataset``, where this module lives
since the regroup (issue 41)."""
from __future__ import annotations

from .shards.webdataset import WebDataset, count_samples, expand_shards  # noqa: F401

__all__ = ['WebDataset', 'count_samples', 'expand_shards']
