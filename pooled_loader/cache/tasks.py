"""The worker side of a cache build: compute samples and write their records into the file.

``_BuildTasks`` is the map-style dataset that ``PooledLoader``'s workers (or this process, with
``num_workers=0``) run: each task writes its records straight into ``PATH.partial`` and returns
only small journal rows and failure reports, so sample data is never pickled. Counterpart of
build.py's ``_Build``, which journals the rows and finishes the file.
"""
from __future__ import annotations

import os
import traceback
import zlib
from typing import Any, Sequence

import numpy as np

from ..core.errors import SampleError
from .fingerprint import sample_file, sample_identity, seed_everything
from .format import (VAR_KINDS, align, entry_dtype, infer_layout, infer_layout_from_tree,
                     leaf_to_array, leaf_values, pwrite_all, reserve)

class _BuildTasks:
    """Map-style dataset of build tasks: ``tasks[pairs]`` computes the records of ``pairs``
    (``(index, variant)`` tuples), writes them straight into the ``.partial`` file and returns
    ``(layout or None, journal rows as bytes, failures)``: only those small results travel back.
    The layout is given on resume, else inferred from each process's first sample and sent with
    its first rows (the main process checks that all agree). A sample the dataset fails on gets
    no record but a failure report (``_failure_report``); with ``on_error="raise"`` the task stops
    there.
    """

    def __init__(self, dataset: Any, partial: str, seed: int, tree: dict | None, lock_fd: int,
                 stop_at_failure: bool, root: str | None) -> None:
        self.dataset, self.partial, self.seed, self.tree = dataset, partial, seed, tree
        # Not named on_error: PooledLoader would read that as its own (replacing samples).
        self.stop_at_failure, self.root = stop_at_failure, root
        st = os.fstat(lock_fd)
        self.lock, self.owner = (lock_fd, st.st_dev, st.st_ino), os.getpid()
        self._pid = self._fd = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_pid": None, "_fd": None}

    def _open(self) -> None:
        """Per process: its own fd (so ``reserve``'s flock excludes the other workers)."""
        if os.getpid() != self.owner:  # a forked worker must not keep the build lock alive
            fd, dev, ino = self.lock
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.close(fd)
            except OSError:
                pass
        self._fd, self._pid, self._sent = os.open(self.partial, os.O_RDWR | os.O_NOFOLLOW), \
            os.getpid(), False
        self._set_layout(self.tree)

    def _set_layout(self, tree: dict | None) -> None:
        self._tree = tree
        if tree is not None:
            self._leaves = infer_layout_from_tree(tree)[1]
            self._dtype = entry_dtype(self._leaves)

    def __getitem__(self, pairs: Sequence[tuple[int, int]]
                    ) -> tuple[dict | None, bytes, list[dict]]:
        if self._pid != os.getpid():
            self._open()
        ds, rows, written, failures = self.dataset, None, 0, []
        for i, k in pairs:
            seed_everything(self.seed, i, k)
            try:
                sample = ds[i]
            except Exception as e:  # noqa: BLE001 - any failure of the dataset is this sample's
                failures.append(_failure_report(ds, i, k, e))
                if self.stop_at_failure:
                    break
                continue
            if self._tree is None:
                self._set_layout(infer_layout(sample)[0])
            values = leaf_values(sample, self._tree, f"dataset[{i}]")
            if rows is None:
                rows = np.zeros(len(pairs), self._dtype)
            _write_record(self._fd, rows[written:written + 1], i, k,
                          sample_identity(ds, i, self.root), values, self._leaves)
            written += 1
        tree = None
        if written and not self._sent:
            tree, self._sent = self._tree, True
        return tree, (rows[:written].tobytes() if written else b""), failures

    def close(self) -> None:
        if self._pid == os.getpid():
            os.close(self._fd)
            self._pid = self._fd = None


def collate_as_is(result: Any) -> Any:
    return result


def _failure_report(ds: Any, i: int, k: int, e: Exception) -> dict:
    """What the main process needs to report or record a failed sample (small, picklable)."""
    file = sample_file(ds, i)
    text = str(e).strip()
    reason = text.splitlines()[0] if text else type(e).__name__
    if file and reason.startswith(f"{file}: "):  # the dataset named the file: say it once
        reason = reason[len(file) + 2:]
    elif not isinstance(e, SampleError):
        reason = f"{type(e).__name__}: {reason}"
    return {"index": i, "variant": k, "file": file, "reason": reason,
            "traceback": "".join(traceback.format_exception(e))}


def _write_record(fd: int, row: np.ndarray, i: int, k: int, source: int, values: list,
                  leaves: list[dict]) -> None:
    row["index"], row["variant"], row["source"] = i, k, source
    arrays, sizes = [], []
    for lf, v in zip(leaves, values):
        if lf["kind"] in VAR_KINDS:
            a = leaf_to_array(v, lf)
            arrays.append((lf, a))
            sizes.append(align(a.nbytes))
        elif lf["kind"] != "none":
            row[f"v{lf['id']}"] = v
    off = reserve(fd, sum(sizes)) if arrays else 0
    for (lf, a), size in zip(arrays, sizes):
        j = lf["id"]
        buf = memoryview(a.reshape(-1)).cast("B") if a.nbytes else memoryview(b"")
        pwrite_all(fd, buf, off)
        row[f"o{j}"], row[f"n{j}"], row[f"c{j}"] = off, a.nbytes, zlib.crc32(buf)
        if lf["ndim"]:
            row[f"s{j}"] = a.shape
        off += size
    seal_row(row)


def seal_row(row: np.ndarray) -> None:
    """Set a one-row journal entry's own checksum (over every other field)."""
    row["ecrc"] = zlib.crc32(row.tobytes()[:-4])


class SourceTraceback(Exception):
    """Carries the traceback of the process that ran a failed sample, as the exception's cause."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text
