"""Throughput tuning (`python -m pooled_loader tune`): the trials (trials), the search (search) and
the plot and table (report).

Imports everything below it (it runs the loader on a cache or a vision pipeline).

``pooled_loader.tune`` is a public import path: it re-exports ``pooled_loader.tune.trials`` (the
module it was before the regroup)."""
from __future__ import annotations

from .trials import (main, make_dataset, run_trial, failed_trial, warm_page_cache, KNOBS, Setting,
                     coordinate_descent, confirm, recommended_line)  # noqa: F401

__all__ = ['main', 'make_dataset', 'run_trial', 'failed_trial', 'warm_page_cache', 'KNOBS',
           'Setting', 'coordinate_descent', 'confirm', 'recommended_line']
