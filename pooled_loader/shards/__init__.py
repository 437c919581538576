"""WebDataset tar shards: reading (tar, samples, urls, remote, index, cache), which samples each
rank and worker reads (webdataset, plan, global_shuffle), their checkpoint states (state,
elastic) and writing an ImageFolder as shards (writer).

Imports core/ and observability/.

``pooled_loader.shards`` is a public import path: it re-exports ``pooled_loader.shards.writer``
(the module it was before the regroup)."""
from __future__ import annotations

from .writer import CLASSES_MEMBER, write_shards, read_shard_classes, main  # noqa: F401

__all__ = ['CLASSES_MEMBER', 'write_shards', 'read_shard_classes', 'main']
