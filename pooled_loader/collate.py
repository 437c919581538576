"""Public import path: re-exports ``pooled_loader.ragged.collate``, where this module lives since
the regroup (issue 41)."""
from __future__ import annotations

from .ragged.collate import pad, packed, as_list, Padded, Packed, RaggedCollate  # noqa: F401

__all__ = ['pad', 'packed', 'as_list', 'Padded', 'Packed', 'RaggedCollate']
