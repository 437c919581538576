"""The trainer's side: a Ray Data pipeline consumed by a ``PooledLoader``.

``from_ray(ds, batch_size)`` makes a loader whose samples are the rows of a Ray ``Dataset`` that
reads from one of our readers (``sources.py``), through the user's own chain (typically
``map_batches(pooled_loader.ray.transform(...))`` on CPU nodes). The order is the loader's, not
Ray's: the epoch's order is torch's ``DistributedSampler`` order of the row ids for (seed,
epoch), split over ranks (``resume.elastic.ElasticDistributedSampler``, padded or cut as it
does), and :class:`RayRows` has Ray read exactly the rows of this rank's share still to come,
in that order (``lineage.with_source``). The sampler hands out *positions* in the share, so a
resumed loader (its count of delivered batches) asks for position ``k`` first, and the stream
restarts there: delivered rows are neither read nor decoded again. Every row Ray gives is
checked against the row due at that position; a lost or repeated row raises.

Each row is copied once, from Ray's block (shared memory on this node) into its row of the
batch slot (``getitem_into``): pinned under CUDA, then sent to the GPU as every batch is.

``from_ray(iterator)`` takes a ``DataIterator`` (Ray Train's ``get_dataset_shard``) instead: rows
come in Ray's order (:class:`RayStream`), each row id at most once per epoch; a resumed epoch
skips the rows already delivered, after Ray made them (Ray decides that split's order).
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ..core.hooks import LoaderHooks
from ..core.ranks import rank_and_world
from ..resume.elastic import ElasticDistributedSampler
from .lineage import find_source, with_source
from .sources import RowSource

__all__ = ["from_ray", "RayRows", "RayStream"]

HIDDEN = ("epoch", "path")  # columns for bookkeeping and errors, not samples
PREFETCH_BLOCKS = 2  # Ray blocks fetched ahead of the one being copied
MAX_DELIVERED = 1 << 26  # row ids a DataIterator state may hold (a hostile one: no MemoryError)


class _PositionSampler(ElasticDistributedSampler):
    """DistributedSampler's share of row ids (elastic plans included), kept as `share` for
    RayRows; iterating yields positions 0..len(share)-1 in it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.share = np.zeros(0, np.int64)
        self.passes = 0  # a new pass (epoch, or resume) starts a new stream

    def __iter__(self) -> Iterator[int]:
        self.share = np.fromiter(super().__iter__(), np.int64)
        self.passes += 1
        return iter(range(len(self.share)))


def _columns(block: dict, names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [c for c in block if c not in HIDDEN]
    missing = [c for c in names if c not in block]
    if missing:
        raise KeyError(f"from_ray: the dataset has no column {missing[0]!r}; its columns: "
                       f"{sorted(block)}")
    return list(names)


class _Blocks:
    """Ray's blocks of one stream, row by row; the time spent waiting for Ray is counted.
    Blocks come as Arrow tables and each of their chunks is viewed as numpy on its own: Ray's
    numpy format would first concatenate a block's chunks (a copy of every image)."""

    def __init__(self, stream: Any, prefetch_blocks: int, figures: dict) -> None:
        """`stream`: a Ray Dataset or DataIterator, read block by block as it comes."""
        self.tables = iter(stream.iter_batches(batch_size=None, batch_format="pyarrow",
                                               prefetch_batches=prefetch_blocks))
        self.figures = figures
        self.chunks: Iterator[dict] = iter(())
        self.block: dict | None = None
        self.rows = self.at = 0

    def _next_block(self) -> dict:
        from ray.data.block import BlockAccessor
        while True:
            chunk = next(self.chunks, None)
            if chunk is not None:
                return BlockAccessor.for_block(chunk).to_numpy()
            started = time.perf_counter()
            try:
                table = next(self.tables)
            finally:
                self.figures["wait_s"] += time.perf_counter() - started
            self.figures["blocks"] += 1
            self.chunks = iter([type(table).from_batches([b]) for b in table.to_batches()])

    def next_row(self) -> tuple[dict, int]:
        while self.block is None or self.at >= self.rows:
            block = self._next_block()
            if "row_id" not in block:
                raise KeyError("from_ray: the dataset's rows have no 'row_id' column: keep the "
                               "reader's columns through map_batches (pooled_loader.ray.transform"
                               " does)")
            self.block, self.rows, self.at = block, len(block["row_id"]), 0
        self.at += 1
        return self.block, self.at - 1

    def close(self) -> None:
        close = getattr(self.tables, "close", None)
        if close is not None:
            close()


def _sample(block: dict, j: int, names: list[str], out: Any, as_tuple: bool) -> Any:
    """Row `j` of `block`: arrays copied into `out`'s leaves (the slot row) when given."""
    values = []
    for k, name in enumerate(names):
        value = block[name][j]
        dst = (out[k] if as_tuple else out.get(name)) if out is not None else None
        if isinstance(dst, np.ndarray) and isinstance(value, np.ndarray) and dst.ndim \
                and dst.shape == value.shape and dst.dtype == value.dtype:
            np.copyto(dst, value, casting="no")
            value = dst
        values.append(value)
    return tuple(values) if as_tuple else dict(zip(names, values))


class RayRows(Dataset, LoaderHooks):
    """A Ray pipeline's rows by their position in this rank's share of the epoch (see the module
    docstring). Runs in the loader's process only (``num_workers=0``)."""

    def __init__(self, ds: Any, source: RowSource, sampler: _PositionSampler,
                 columns: Sequence[str] | None, prefetch_blocks: int) -> None:
        self.ds, self.source, self.sampler = ds, source, sampler
        self.columns = columns
        self.prefetch_blocks = prefetch_blocks
        self._blocks: _Blocks | None = None
        self._pass = -1
        self._next = -1
        self._names: list[str] | None = None
        self.figures = {"wait_s": 0.0, "blocks": 0, "rows": 0, "streams": 0, "skipped_rows": 0}

    def __len__(self) -> int:
        return self.source.num_rows

    def __getstate__(self) -> dict:
        raise TypeError("RayRows reads a Ray stream in the loader's process: from_ray's loader "
                        "runs with num_workers=0 (Ray's workers do the work)")

    def __getitem__(self, position: int) -> Any:
        return self.getitem_into(position, None)

    def getitem_into(self, position: int, out: Any) -> Any:
        s = self.sampler
        if self._blocks is None or self._pass != s.passes or position != self._next:
            self._start(position)
        block, j = self._blocks.next_row()
        due = int(s.share[position])
        got = int(block["row_id"][j])
        if got != due:
            self.close()
            raise RuntimeError(f"from_ray: Ray delivered row {got} at position {position} of "
                               f"epoch {s.epoch} where row {due} was due: a row was lost or "
                               "repeated upstream (a filter, a flat_map or a repartition after "
                               "the reader changes the rows; keep one output row per input row)")
        names = self._names or _columns(block, self.columns)
        self._names = names
        self._next = position + 1
        self.figures["rows"] += 1
        sample = _sample(block, j, names, out, self.columns is not None)
        if self._next == len(s.share):
            self.close()  # the share's last row: Ray's executor ends now, not at exit
        return sample

    def _start(self, position: int) -> None:
        """Ray reads this share's rows from `position` on, in order."""
        self.close()
        s = self.sampler
        rows = s.share[position:]
        self.figures["streams"] += 1
        self.figures["skipped_rows"] += position
        stream = with_source(self.ds, self.source.with_rows(rows, s.epoch))
        self._blocks = _Blocks(stream, self.prefetch_blocks, self.figures)
        self._pass, self._next, self._names = s.passes, position, None

    def close(self) -> None:
        """Stop the running stream, if any (its Ray executor shuts down)."""
        if self._blocks is not None:
            self._blocks.close()
            self._blocks = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit Ray may be gone already
            pass

    def pooled_figures(self, states: list, figures: dict) -> dict:
        s = self.sampler
        n, world = self.source.num_rows, s.num_replicas
        total = s.total_size if s.plan is None else len(s.share) * world
        ray = dict(self.figures, world_size=world, rank=s.rank,
                   padded_rows=max(0, total - n) if s.plan is None else 0,
                   dropped_rows=max(0, n - total) if s.plan is None else 0)
        own = figures.get("wait_s", 0.0)
        ray["notes"] = [f"Of the {own:.2f}s the loop waited for data, {ray['wait_s']:.2f}s went "
                        f"waiting on Ray ({ray['blocks']} blocks); the rest is the copy into the "
                        "slots and the loader's own stages."]
        if ray["padded_rows"] or ray["dropped_rows"]:
            ray["notes"].append(
                f"Each epoch, {ray['padded_rows']} rows are repeated to even the {world} ranks "
                f"out" if ray["padded_rows"] else
                f"Each epoch, {ray['dropped_rows']} rows are left out (drop_last) to even the "
                f"{world} ranks out")
        return {"ray": ray}


class RayStream(IterableDataset, LoaderHooks):
    """A ``DataIterator``'s rows in Ray's order; its state is the row ids delivered this epoch
    (as ranges), which a resumed epoch skips (after Ray made them: Ray decides the order)."""

    def __init__(self, iterator: Any, columns: Sequence[str] | None,
                 prefetch_blocks: int) -> None:
        self.iterator, self.columns = iterator, columns
        self.prefetch_blocks = prefetch_blocks
        self.epoch = 0
        self._seen: set[int] = set()
        self._skip: set[int] = set()
        self.figures = {"wait_s": 0.0, "blocks": 0, "rows": 0, "streams": 0, "skipped_rows": 0,
                        "repeated_rows": 0}

    def __getstate__(self) -> dict:
        raise TypeError("RayStream reads a Ray stream in the loader's process: from_ray's loader "
                        "runs with num_workers=0")

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._seen, self._skip = epoch, set(), set()

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, set()
        self._seen = set(skip)
        blocks = _Blocks(self.iterator, self.prefetch_blocks, self.figures)
        self.figures["streams"] += 1
        names = None
        try:
            while True:
                try:
                    block, j = blocks.next_row()
                except StopIteration:
                    return
                row = int(block["row_id"][j])
                if row in self._seen:
                    self.figures["skipped_rows" if row in skip else "repeated_rows"] += 1
                    continue
                self._seen.add(row)
                names = names or _columns(block, self.columns)
                self.figures["rows"] += 1
                yield _sample(block, j, names, None, self.columns is not None)
        finally:
            blocks.close()
            self._seen = set()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "delivered": _ranges(sorted(self._seen))}

    def load_state_dict(self, state: dict) -> None:
        def corrupt(why: str) -> ValueError:
            return ValueError(f"from_ray: the stream state is corrupt: {why}; expected "
                              "{'epoch': int, 'delivered': [[a, b], ...]}")
        if not isinstance(state, dict) or not isinstance(state.get("delivered"), list):
            raise corrupt("no 'delivered' list")
        epoch = state.get("epoch", 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise corrupt(f"epoch {epoch!r}")
        skip: set[int] = set()
        for pair in state["delivered"]:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(
                    isinstance(v, int) and not isinstance(v, bool) for v in pair):
                raise corrupt(f"range {pair!r}")
            a, b = pair
            if not 0 <= a < b or len(skip) + b - a > MAX_DELIVERED:
                raise corrupt(f"range {pair!r} (at most {MAX_DELIVERED} rows in all)")
            skip.update(range(a, b))
        self.epoch, self._skip = epoch, skip

    def pooled_figures(self, states: list, figures: dict) -> dict:
        return {"ray": dict(self.figures, notes=[
            f"{self.figures['wait_s']:.2f}s went waiting on Ray ({self.figures['blocks']} "
            "blocks)"])}


def _ranges(ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i in ids:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def from_ray(ds: Any, batch_size: int = 1, *, distributed: bool = False, seed: int = 0,
             shuffle: bool = True, drop_last: bool = False, columns: Sequence[str] | None = None,
             prefetch_blocks: int = PREFETCH_BLOCKS, **options: Any) -> Any:
    """A ``PooledLoader`` over a Ray ``Dataset`` read by ``pooled_loader.ray``'s readers (or a
    ``DataIterator``, e.g. Ray Train's ``get_dataset_shard``).

    ``distributed``: this rank's share (``RANK``/``WORLD_SIZE`` or the process group), as
    ``DistributedSampler`` splits (equal batch counts, padded or ``drop_last``). ``seed``,
    ``shuffle``: the epoch order (``set_epoch`` reshuffles). ``columns``: the columns a sample
    holds, as a tuple in this order (default: a dict of every column but ``epoch``/``path``).
    ``options`` go to ``PooledLoader`` (``pin_memory``, ``device``, ``pool_slots``...);
    ``num_workers`` must stay 0: Ray's workers do the work.
    """
    from ..loader import PooledLoader
    if options.get("num_workers", 0):
        raise ValueError("from_ray: num_workers must be 0: the rows are made by Ray's workers "
                         "(scale map_batches' concurrency instead); the loader copies them "
                         "into its slots in this process")
    for key in ("sampler", "batch_sampler", "shuffle", "dataset"):
        if key in options:
            raise ValueError(f"from_ray: {key} is set by from_ray")
    from ray.data import DataIterator
    if isinstance(ds, DataIterator):  # Ray Train's get_dataset_shard, ds.iterator()
        if distributed:
            raise ValueError("from_ray: a DataIterator is already one rank's split (Ray Train's "
                             "get_dataset_shard); distributed=True is for a Dataset")
        return PooledLoader(RayStream(ds, columns, prefetch_blocks), batch_size=batch_size,
                            drop_last=drop_last, num_workers=0, **options)
    source = find_source(ds)
    if source is None:
        raise ValueError("from_ray: the dataset does not read from a pooled_loader.ray reader "
                         "(read_image_folder, read_webdataset), so its order and resume cannot be "
                         "the loader's; read with one of them, or pass ds.iterator() for Ray's "
                         "own order")
    rank, world = rank_and_world() if distributed else (0, 1)
    rows = RayRows(ds, source, None, columns, prefetch_blocks)  # type: ignore[arg-type]
    sampler = _PositionSampler(rows, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                               drop_last=drop_last)
    rows.sampler = sampler
    return PooledLoader(rows, batch_size=batch_size, sampler=sampler, drop_last=drop_last,
                        num_workers=0, **options)
