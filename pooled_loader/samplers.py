"""Public import path: re-exports ``pooled_loader.ragged.samplers``, where this module lives since
the regroup (issue 41)."""
from __future__ import annotations

from .ragged.samplers import LengthGroupedSampler, TokenBudgetBatchSampler  # noqa: F401

__all__ = ['LengthGroupedSampler', 'TokenBudgetBatchSampler']
