"""A Ray ``Dataset``'s pipeline run again over another order of its source's rows.

A Ray ``Dataset`` is a lazy chain of operators rooted at a read. ``from_ray`` keeps the user's
chain (our reader, their ``map_batches``, whatever else) and changes only what the read reads:
:func:`with_source` copies the chain with its :class:`~.sources.RowSource` replaced by one that
reads an epoch's remaining rows in the epoch's order, so rows already delivered are never read
nor decoded, and the copy runs with ``preserve_order`` so its rows come out in that order.

Ray has no public call for this; the chain is walked and copied with the logical operators'
own ``_apply_transform`` (what Ray's optimizer rules use), and ``Read`` is a frozen dataclass
copied with ``dataclasses.replace``. ``tests/test_ray.py`` fails if a Ray release changes them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .sources import RowSource

__all__ = ["find_source", "with_source"]


def _reads(ds: Any) -> list:
    from ray.data._internal.logical.operators import Read
    try:
        dag = ds._logical_plan.dag
    except AttributeError:
        raise TypeError(f"expected a ray.data.Dataset, got {type(ds).__name__}") from None
    return [op for op in dag.post_order_iter() if isinstance(op, Read)]


def find_source(ds: Any) -> RowSource | None:
    """The one ``RowSource`` the dataset's chain reads from, or None when it reads none
    (``ray.data.read_images``, a materialized dataset...). More than one: ValueError."""
    found = [op.datasource for op in _reads(ds) if isinstance(op.datasource, RowSource)]
    if len(found) > 1:
        raise ValueError("pooled_loader.ray: the dataset reads from several pooled_loader "
                         "readers (a union or zip); give from_ray one reader's pipeline")
    return found[0] if found else None


def with_source(ds: Any, source: RowSource) -> Any:
    """``ds``'s chain reading from ``source`` instead of its RowSource, rows kept in order."""
    from ray.data import Dataset
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators import Read
    from ray.data._internal.stats import DatasetStats

    def swap(op: Any) -> Any:
        if isinstance(op, Read) and isinstance(op.datasource, RowSource):
            # Ray's default (-1) would ask for >= 200 blocks and split each read task's block
            # into small ones: more scheduling per row, and no read+UDF fusion
            blocks = op.parallelism if op.parallelism > 0 else source.task_count()
            return dataclasses.replace(op, datasource=source, datasource_or_legacy_reader=source,
                                       parallelism=blocks, detected_parallelism=None)
        return op

    dag = ds._logical_plan.dag._apply_transform(swap)
    context = ds.context.copy()
    context.execution_options.preserve_order = True
    return Dataset(LogicalPlan(dag, context), context,
                   DatasetStats(metadata={}, parent=None), dataset_name=ds._dataset_name)
