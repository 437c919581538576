"""Ray Data readers whose rows carry a stable id, read in any order the trainer asks for.

A :class:`RowSource` is a Ray ``Datasource`` over a fixed table of rows (an image folder's files,
the samples of WebDataset shards). Each row has an id, its place in that table, that never
changes; a read gives the columns ``row_id``, ``epoch``, ``bytes`` (the encoded file), ``label``
and ``path`` (where the row came from, for error messages). By default it reads every row once in
id order; :meth:`RowSource.with_rows` gives a copy that reads a list of row ids in the list's
order for one epoch, which is how ``consume.from_ray`` runs an epoch's order and skips, before
any decoding, the rows a resumed run already delivered.

Read tasks are contiguous chunks of that list (at most :data:`ROWS_PER_TASK` rows, at least
:data:`MIN_ROWS_PER_TASK`), and each pickles only its own rows' paths, never the whole table.
This module imports Ray (``pip install 'pooled_loader[ray]'``). Every file is untrusted: a link to a FIFO or a device is refused, a file over
``vision.io.buffers.MAX_FILE_BYTES`` (the folder path's bound) is refused before it is read, and the error names the file and the row.
"""
from __future__ import annotations

import copy
import math
import os
from typing import Any, Callable, Sequence

import numpy as np
from ray.data import Datasource

from ..core.errors import SampleError
from ..core.file_index import IMG_EXTENSIONS, list_image_folder
from ..core.safe_open import open_regular_stat
from ..vision.io.buffers import MAX_FILE_BYTES

__all__ = ["RowSource", "FolderRows", "ShardRows", "read_image_folder", "read_webdataset",
           "ROWS_PER_TASK"]

ROWS_PER_TASK = 256  # rows one read task reads: ~30 MB of ImageNet JPEGs, one object-store block
MIN_ROWS_PER_TASK = 128  # below this a task's fixed cost in Ray (~10-20 ms) shows per row
# a shard sample's image member: the image files `shards write` takes from a folder
IMAGE_SUFFIXES = tuple(e.lstrip(".") for e in IMG_EXTENSIONS)
LABEL_SUFFIXES = ("cls", "label", "target")


def _read_bytes(path: str, row: int) -> bytes:
    try:
        fd, st = open_regular_stat(path, max_bytes=MAX_FILE_BYTES, what="image file",
                                   follow=True)
    except OSError as e:
        raise SampleError(f"row {row}: {path}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            return f.read(st.st_size)
    except OSError as e:
        raise SampleError(f"row {row}: {path}: {e}") from e


def _block(rows: np.ndarray, epoch: int, data: list, labels: Sequence[int],
           paths: list[str]) -> Any:
    import pyarrow as pa
    return pa.table({"row_id": pa.array(rows, pa.int64()),
                     "epoch": pa.array(np.full(len(rows), epoch, np.int64)),
                     "bytes": pa.array(data, pa.binary()),
                     "label": pa.array(np.asarray(labels, np.int64)),
                     "path": pa.array(paths, pa.string())})


class RowSource(Datasource):
    """Base of the readers: ``num_rows`` rows, read in id order or in ``with_rows``' order.
    Subclasses give ``_reader(rows)``: a picklable function reading those rows as one block."""

    num_rows: int = 0
    rows: np.ndarray | None = None  # the row ids to read, in order (None: all, by id)
    epoch: int = 0

    def with_rows(self, rows: np.ndarray, epoch: int) -> "RowSource":
        """A copy that reads ``rows`` (row ids, repeats allowed) in that order for ``epoch``."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim != 1 or (len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows)):
            raise ValueError(f"row ids must be a 1-d list in [0, {self.num_rows})")
        twin = copy.copy(self)
        twin.rows, twin.epoch = rows, int(epoch)
        return twin

    def task_count(self) -> int:
        """The read tasks this source makes when asked for this many: one per ROWS_PER_TASK."""
        return max(1, math.ceil(len(self.order()) / ROWS_PER_TASK))

    def order(self) -> np.ndarray:
        return np.arange(self.num_rows, dtype=np.int64) if self.rows is None else self.rows

    def _reader(self, rows: np.ndarray) -> Callable[[], list]:
        raise NotImplementedError

    def _row_bytes(self) -> int:
        return 110_000  # an ImageNet JPEG, for Ray's size estimates only

    # -- ray.data.Datasource's interface
    def estimate_inmemory_data_size(self) -> int:
        return len(self.order()) * self._row_bytes()

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list:
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask
        order = self.order()
        if not len(order):
            return []
        size = min(ROWS_PER_TASK, max(MIN_ROWS_PER_TASK,
                                      math.ceil(len(order) / max(1, parallelism))))
        tasks = []
        for start in range(0, len(order), size):
            rows = order[start:start + size]
            meta = BlockMetadata(num_rows=len(rows), size_bytes=len(rows) * self._row_bytes(),
                                 input_files=None, exec_stats=None)
            tasks.append(ReadTask(self._reader(rows), meta))
        return tasks


# -- an image folder ------------------------------------------------------------------------------
class _ReadFiles:
    """One read task: the files of its rows (paths and labels pickled with it)."""

    def __init__(self, rows: np.ndarray, epoch: int, paths: list[str], labels: np.ndarray):
        self.rows, self.epoch, self.paths, self.labels = rows, epoch, paths, labels

    def __call__(self) -> list:
        data = [_read_bytes(p, int(r)) for p, r in zip(self.paths, self.rows)]
        return [_block(self.rows, self.epoch, data, self.labels, self.paths)]


class FolderRows(RowSource):
    """``root/<class>/**/<image>``, rows numbered and labelled as torchvision's ImageFolder."""

    def __init__(self, root: str | os.PathLike, **listing: Any) -> None:
        super().__init__()
        self.index = list_image_folder(root, **listing)
        self.num_rows = len(self.index)
        self.classes = list(self.index.classes)

    def _reader(self, rows: np.ndarray) -> Callable[[], list]:
        index = self.index
        return _ReadFiles(rows, self.epoch, [index.path(int(r)) for r in rows],
                          np.array([index.label(int(r)) for r in rows], np.int64))


def read_image_folder(root: str | os.PathLike, *, include_hidden: bool | None = None,
                      extensions: Sequence[str] = IMG_EXTENSIONS, **read_args: Any) -> Any:
    """An image folder as a Ray ``Dataset`` (columns ``row_id``, ``epoch``, ``bytes``,
    ``label``, ``path``): rows in torchvision's ImageFolder order, labels its class numbers.
    ``read_args`` go to ``ray.data.read_datasource`` (``ray_remote_args``, ``concurrency``...)."""
    import ray.data
    source = FolderRows(root, include_hidden=include_hidden, extensions=extensions)
    return ray.data.read_datasource(source, **read_args)


# -- WebDataset shards ----------------------------------------------------------------------------
def _sample_image(sample: dict, where: str) -> tuple[bytes, int]:
    image = next((sample[s] for s in IMAGE_SUFFIXES if s in sample), None)
    if image is None:
        raise SampleError(f"{where}: no image member (one of .{', .'.join(IMAGE_SUFFIXES)})")
    raw = next((sample[s] for s in LABEL_SUFFIXES if s in sample), None)
    try:
        label = -1 if raw is None else int(bytes(raw).decode("ascii").strip())
    except ValueError:
        raise SampleError(f"{where}: its label member is not an integer: {bytes(raw)[:40]!r}") \
            from None
    return bytes(image), label


class _ReadSamples:
    """One read task: its rows' samples, each read from its shard between its byte offsets."""

    def __init__(self, rows: np.ndarray, epoch: int, spans: list[tuple[str, int, int]]):
        self.rows, self.epoch, self.spans = rows, epoch, spans

    def __call__(self) -> list:
        from ..shards.samples import shard_samples
        data, labels, paths = [], [], []
        for row, (url, start, end) in zip(self.rows, self.spans):
            got = None
            try:
                for sample, _, _ in shard_samples(url, start, end=end, retries=0):
                    got = sample
                    break
            except (OSError, ValueError) as e:
                raise SampleError(f"row {int(row)}: {url} at byte {start}: {e}") from e
            if got is None:
                raise SampleError(f"row {int(row)}: {url} at byte {start}: no sample there; "
                                  "the shard changed since it was listed")
            where = f"{url}:{got['__key__']}"
            image, label = _sample_image(got, f"row {int(row)}: {where}")
            data.append(image)
            labels.append(label)
            paths.append(where)
        return [_block(self.rows, self.epoch, data, labels, paths)]


class ShardRows(RowSource):
    """The samples of local, uncompressed WebDataset tar shards, numbered in shard order then
    sample order (as ``webdataset`` yields them), located by their byte offsets."""

    def __init__(self, urls: Any) -> None:
        from ..shards.samples import expand_shards, is_local_tar, local_sample_starts
        super().__init__()
        self.shards = expand_shards(urls)
        starts, shard_of = [], []
        for j, url in enumerate(self.shards):
            if not is_local_tar(url):
                raise ValueError(f"{url}: pooled_loader.ray reads local, uncompressed .tar "
                                 "shards (copy remote shards to the nodes' disk first)")
            offsets = local_sample_starts(url)
            if offsets is None:
                raise SampleError(f"{url}: the shard cannot be read to its end (truncated or "
                                  "not a tar)")
            starts.append(np.asarray(offsets, np.int64))
            shard_of.append(np.full(len(offsets) - 1, j, np.int64))
        self._starts = starts
        self._shard = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int64)
        self._first = np.cumsum([0] + [len(s) - 1 for s in starts])
        self.num_rows = int(self._first[-1])

    def _reader(self, rows: np.ndarray) -> Callable[[], list]:
        spans = []
        for r in rows:
            j = int(self._shard[r])
            k = int(r) - int(self._first[j])
            spans.append((self.shards[j], int(self._starts[j][k]), int(self._starts[j][k + 1])))
        return _ReadSamples(rows, self.epoch, spans)


def read_webdataset(urls: Any, **read_args: Any) -> Any:
    """Local WebDataset tar shards (a list, or a brace pattern ``train-{0000..0099}.tar``) as a
    Ray ``Dataset`` with the columns of :func:`read_image_folder`: ``bytes`` is a sample's image
    member, ``label`` its ``.cls`` (-1 when it has none), ``path`` ``shard:key``."""
    import ray.data
    return ray.data.read_datasource(ShardRows(urls), **read_args)
