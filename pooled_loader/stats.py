"""Public import path: re-exports ``pooled_loader.observability.stats``, where this module lives
since the regroup (issue 41)."""
from __future__ import annotations

from .observability.stats import (log, STRAGGLER_FACTOR, STRAGGLER_MIN_WAIT_SHARE, FIXES, MIX_FIX,
                                  ONE_OFF, OP_FIX, LoaderStats, slowest_stage, report_text,
                                  stragglers, ranks_text, gather)  # noqa: F401
