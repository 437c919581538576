"""WebDataset tar shards: reading them, deciding which samples each rank and worker reads,
resuming that exactly, and writing them.

What a user imports from here (``__all__``):

- ``WebDataset``: an ``IterableDataset`` over tar shards for ``PooledLoader`` (any
  ``num_workers``, ranks, exact resume, shuffle by shard or global, a shard cache);
  ``count_samples(url)`` and ``expand_shards(pattern)``, the counting and patterns it uses.
  Also at ``pooled_loader.webdataset``.
- ``write_shards``, ``read_shard_classes``, ``CLASSES_MEMBER`` and ``main`` (the CLI
  ``python -m pooled_loader shards write|index``, also ``python -m pooled_loader.shards``):
  an ImageFolder written as shards, and the class list they record. Before the regroup this
  import path was the writer alone; every name it had stays here.

Inside, lowest first: ``urls`` (patterns, and which URL is a local file), ``deadlines``,
``remote`` (streams that survive dropped connections), ``tar`` (the bounded tar parser),
``samples`` (a shard's samples and their count), ``index`` (the sample index beside a shard),
``cache`` (a local copy of remote shards under a byte budget), ``plan`` and ``global_shuffle``
(who reads what), ``elastic`` and ``state`` (checkpoint states), ``webdataset`` and ``writer``.

Imports core/ and observability/ only.
"""
from __future__ import annotations

from .webdataset import WebDataset, count_samples, expand_shards  # noqa: F401
from .writer import CLASSES_MEMBER, write_shards, read_shard_classes, main  # noqa: F401

__all__ = ['WebDataset', 'count_samples', 'expand_shards',
           'write_shards', 'read_shard_classes', 'main', 'CLASSES_MEMBER']
