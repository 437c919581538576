"""Cache the deterministic front of a pipeline in one memory-mapped file.

    build_cache(ImageFolder(root, transform=Compose([DecodeImage(), Resize(max_side=512)])),
                "train.plc", num_workers=2)
    ds = CachedDataset("train.plc", transform=Compose([RandomResizedCrop(224),
                                                       RandomHorizontalFlip(), ToCHW()]))
    loader = PooledLoader(ds, batch_size=256, shuffle=True, num_workers=2)

``build_cache`` runs ``dataset[i]`` once per index (``variants`` times with distinct seeds when
the dataset's transform is random), and stores every sample in one file (format:
``pooled_loader.cache.format``). The build runs on ``PooledLoader``'s worker processes (or in
this process when ``num_workers=0``): they write records straight into the file and send the
main process only their index entries, so sample data is never pickled; a failing sample is
reported with its index, file, worker and traceback, and workers exit with the main process.
The build goes to ``path + ".partial"`` with a journal ``path + ".partial.journal"`` of finished
records; an interrupted build (Ctrl-C, crash, SIGKILL) resumes from the journal on the next call
with the same dataset fingerprint, and the finished file appears at ``path`` atomically (fsync,
``os.replace``).

Bad samples. ``on_error="raise"`` (default): the first sample the dataset fails on stops the
build with ``CacheSampleError`` (index, file, reason; the worker's traceback as its cause).
``on_error="skip"``: failed samples are left out and recorded in the header (source index, path,
reason; ``CachedDataset.skipped``), and the cache is *renumbered*: ``len()`` counts the stored
samples, indices are dense, every sample keeps its own label, and
``CachedDataset.source_indices`` maps back to the source's indices. (Keeping source indices
would leave holes that every sampler would have to avoid.) Skipped samples are retried when an
interrupted build resumes.

Resume after a fix. Each journal row records the identity of its source sample (path under the
root, size, mtime, label). When the source's fingerprint changed, the build still resumes if
only samples without a finished record changed (a bad file fixed, replaced or removed, files
added): finished rows are renumbered to the current listing. A change to an already cached file
or label, to the transform, dataset class, seed or variants starts afresh, with a warning that
says why. Records kept across such a resume keep the seeds of the index they were built at.

``CachedDataset`` maps the file read-only and hands the transform numpy views of the records (no
copy); ``getitem_into`` lets the transform's last op write straight into the loader's batch slot.

Seeds. Record ``(index, k)`` is produced with ``random``, ``numpy.random`` and ``torch`` seeded
from ``SeedSequence([seed, index, k])``. Epoch ``e`` reads variant
``f(seed, e, index) = (e + splitmix64(seed * 2**32 + index)) % variants``: each sample cycles
through all its variants once every ``variants`` epochs, starting at a per-sample offset.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import inspect
import json
import mmap
import os
import random
import re
import sys
import time
import traceback
import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .format import (
    DATA_START, FORMAT_VERSION, JOURNAL_HEADER_MAX, JOURNAL_VERSION, PREAMBLE_SIZE,
    STATE_BUILDING, STATE_COMPLETE, VAR_KINDS, CacheError, CacheFormatError,
    CacheIncompleteError, CacheMismatchError, CacheRecordError, CacheSampleError, align,
    apply_entries, entry_dtype, header_bytes, index_arrays, infer_layout,
    infer_layout_from_tree, leaf_to_array, leaf_values, make_unflatten, out_leaves,
    pack_journal_header, pack_preamble, pwrite_all, read_header, reserve, unpack_journal_header,
)
from .._cli import one_line
from ..errors import SampleError, WorkerError
from ..file_index import FileIndex
from ..loader import PooledLoader

__all__ = ["build_cache", "CachedDataset", "dataset_fingerprint", "variant_for_epoch",
           "partial_progress", "main",
           "CacheError", "CacheFormatError", "CacheIncompleteError", "CacheMismatchError",
           "CacheRecordError", "CacheSampleError"]

# ---------------------------------------------------------------------------------------------
# Fingerprint and seeds


def _stable_repr(obj: Any) -> str:
    """``repr`` without memory addresses, so it is the same in every process and run."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))


def fingerprint_info(dataset: Any) -> dict:
    """What identifies ``dataset``'s output: class, length, transforms and source files.

    A dataset may define ``cache_fingerprint() -> str`` to replace the file-list part.
    """
    cls = type(dataset)
    info = {"class": f"{cls.__module__}.{cls.__qualname__}", "len": len(dataset),
            "transform": _stable_repr(getattr(dataset, "transform", None)),
            "target_transform": _stable_repr(getattr(dataset, "target_transform", None))}
    h = hashlib.sha256()
    classes = getattr(dataset, "classes", None)
    if isinstance(classes, (list, tuple)) and all(isinstance(c, str) for c in classes):
        info["classes"] = list(classes)  # kept in the header: ImageFolder.check_classes reads it
    index = getattr(dataset, "file_index", None)
    if hasattr(dataset, "cache_fingerprint"):
        h.update(str(dataset.cache_fingerprint()).encode())
        info["files"] = "cache_fingerprint()"
    elif isinstance(index, FileIndex):  # list_image_folder's listing, as ImageFolder holds it
        for i in range(len(index)):
            try:
                st = os.stat(index.path(i))
                h.update(f"{index.relpath(i)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            except OSError:
                h.update(f"{index.relpath(i)}\0missing\0".encode())
            h.update(f"{index.labels[i]}\0".encode())
        info["files"] = f"{len(index)} samples (paths under the root, sizes, mtimes)"
    elif isinstance(getattr(dataset, "samples", None), (list, tuple)):
        paths = [os.fspath(s[0] if isinstance(s, (tuple, list)) else s) for s in dataset.samples
                 if isinstance(s[0] if isinstance(s, (tuple, list)) else s, (str, os.PathLike))]
        root = getattr(dataset, "root", None)
        if not isinstance(root, (str, os.PathLike)):
            root = os.path.commonpath([os.path.abspath(p) for p in paths]) if paths else ""
        root = os.path.abspath(root)
        n = 0
        for s in dataset.samples:
            p = s[0] if isinstance(s, (tuple, list)) else s
            if isinstance(p, (str, os.PathLike)):  # paths relative to the root: movable data
                rel = os.path.relpath(os.path.abspath(p), root)
                try:
                    st = os.stat(p)
                    h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
                except OSError:
                    h.update(f"{rel}\0missing\0".encode())
            h.update(_stable_repr(s[1:] if isinstance(s, (tuple, list)) else ()).encode())
            n += 1
        info["files"] = f"{n} samples (paths under the root, sizes, mtimes)"
    else:
        h.update(_stable_repr(dataset).encode())
        info["files"] = "repr(dataset)"
    info["files_sha256"] = h.hexdigest()
    return info


def dataset_fingerprint(dataset: Any) -> str:
    """Hex digest identifying ``dataset`` (see ``fingerprint_info``)."""
    return _digest(fingerprint_info(dataset))


def _digest(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def variant_for_epoch(seed: int, epoch: int, index: int, variants: int) -> int:
    """Variant read at ``epoch`` for ``index``: ``(epoch + splitmix64(seed*2**32+index)) % K``."""
    if variants == 1:
        return 0
    return (epoch + _splitmix64((seed << 32) + index)) % variants


def _seed_everything(seed: int, index: int, k: int) -> None:
    s = np.random.SeedSequence([seed, index, k]).generate_state(4)
    random.seed(int(s[0]))
    np.random.seed(s[1])
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed((int(s[2]) << 32) | int(s[3]))


class _SavedRng:
    """Saves and restores the global RNGs around an in-process build."""

    def __enter__(self) -> None:
        self.py, self.np = random.getstate(), np.random.get_state()
        torch = sys.modules.get("torch")
        self.torch = torch.get_rng_state() if torch else None

    def __exit__(self, *exc: Any) -> None:
        random.setstate(self.py)
        np.random.set_state(self.np)
        if self.torch is not None:
            sys.modules["torch"].set_rng_state(self.torch)


# ---------------------------------------------------------------------------------------------
# Per-sample source identity: lets a resume accept a source in which only samples without a
# finished record changed (a bad file fixed or removed). Kept apart from fingerprint_info, which
# identifies the source as a whole.


def _sample_file(ds: Any, i: int) -> str | None:
    """Path of sample ``i``'s source file, when the dataset has a ``samples`` list."""
    try:
        s = ds.samples[i]
    except Exception:  # noqa: BLE001 - no file list: the sample is named by its index only
        return None
    p = s[0] if isinstance(s, (tuple, list)) else s
    return os.fspath(p) if isinstance(p, (str, os.PathLike)) else None


def _source_root(ds: Any) -> str | None:
    """Root that source paths are taken relative to (movable data); None without a file list."""
    samples = getattr(ds, "samples", None)  # a list, or a lazy sequence (vision.ImageFolder)
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)) \
            or not len(samples) or _sample_file(ds, 0) is None:
        return None
    root = getattr(ds, "root", None)
    if isinstance(root, (str, os.PathLike)):
        return os.path.abspath(root)
    paths = [os.path.abspath(p) for p in (_sample_file(ds, i) for i in range(len(samples))) if p]
    return os.path.commonpath(paths)


def _sample_identity(ds: Any, i: int, root: str | None) -> int:
    """Nonzero u64 naming sample ``i``'s source as it is now: its file (path under ``root``, size,
    mtime) and the rest of its ``samples`` entry (the label); 0 when it has no file."""
    p = _sample_file(ds, i) if root is not None else None
    if p is None:
        return 0
    s = ds.samples[i]
    rest = s[1:] if isinstance(s, (tuple, list)) else ()
    try:
        st = os.stat(p)
        state = f"{st.st_size}\0{st.st_mtime_ns}"
    except OSError:
        state = "missing"
    key = f"{os.path.relpath(os.path.abspath(p), root)}\0{state}\0{_stable_repr(rest)}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") or 1


# ---------------------------------------------------------------------------------------------
# Build tasks: run by PooledLoader's workers (or in-process when num_workers=0)


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
        self._fd, self._pid, self._sent = os.open(self.partial, os.O_RDWR), os.getpid(), False
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
            _seed_everything(self.seed, i, k)
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
                          _sample_identity(ds, i, self.root), values, self._leaves)
            written += 1
        tree = None
        if written and not self._sent:
            tree, self._sent = self._tree, True
        return tree, (rows[:written].tobytes() if written else b""), failures

    def close(self) -> None:
        if self._pid == os.getpid():
            os.close(self._fd)
            self._pid = self._fd = None


def _as_is(result: Any) -> Any:
    return result


def _failure_report(ds: Any, i: int, k: int, e: Exception) -> dict:
    """What the main process needs to report or record a failed sample (small, picklable)."""
    file = _sample_file(ds, i)
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
    _seal_row(row)


def _seal_row(row: np.ndarray) -> None:
    """Set a one-row journal entry's own checksum (over every other field)."""
    row["ecrc"] = zlib.crc32(row.tobytes()[:-4])


class _SourceTraceback(Exception):
    """Carries the traceback of the process that ran a failed sample, as the exception's cause."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text


# ---------------------------------------------------------------------------------------------
# Build

ON_ERROR = ("raise", "skip")
LOCK_TRIES, LOCK_WAIT_S = 20, 0.1  # a killed build's processes may take a moment to go
# on_error="skip": this many failures before the first success is a broken pipeline, not a few
# bad files, so the build stops instead of skipping everything.
MAX_FAILURES_BEFORE_FIRST_SUCCESS = 32


def build_cache(dataset: Any, path: str | os.PathLike, *, num_workers: int = 0,
                variants: int = 1, progress: bool = True, seed: int = 0,
                overwrite: bool = False, chunk_size: int = 8,
                multiprocessing_context: str | None = None, on_error: str | None = None) -> str:
    """Run ``dataset[i]`` for every index (``variants`` times) and store the samples at ``path``.

    Resumes an interrupted build of the same dataset (fingerprint), seed and variants from
    ``path + ".partial"``; after a failed sample's file was fixed, replaced or removed the build
    resumes too (see the module docstring). If ``path`` already holds a complete cache of this
    dataset it is kept (``overwrite=True`` rebuilds it); a cache of another dataset there raises
    CacheMismatchError. Returns ``path``. ``num_workers`` PooledLoader worker processes
    (``multiprocessing_context``, default fork where available) write records straight into the
    file; 0 builds in-process.

    ``on_error="raise"`` (the default, unless the dataset's own ``on_error`` attribute is
    "skip", as PooledLoader reads it): a sample the dataset fails on stops the build with
    CacheSampleError (finished records are kept for the resume). ``"skip"``: such samples are
    left out of the cache and recorded in its header (``CachedDataset.skipped``); the cache
    numbers the rest densely (``CachedDataset.source_indices``). ``progress`` shows a bar and,
    with skipped samples, a one-line summary on stderr.
    """
    path = os.fspath(path)
    if variants < 1:
        raise ValueError(f"variants must be >= 1, got {variants}")
    if on_error is None:
        on_error = "skip" if getattr(dataset, "on_error", None) == "skip" else "raise"
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    count = len(dataset)
    if count == 0:
        raise ValueError("cannot cache an empty dataset")
    info = fingerprint_info(dataset)
    fp = _digest(info)
    partial, journal = path + ".partial", path + ".partial.journal"
    if os.path.exists(path) and not overwrite:
        if not os.path.exists(partial) and os.path.exists(journal):
            os.unlink(journal)  # left by a build killed between os.replace and cleanup
        try:
            hdr = read_header(path)
        except CacheError:
            hdr = None
        if hdr is not None and hdr["source"]["fingerprint"] == fp \
                and hdr["variants"] == variants and hdr["seed"] == seed:
            return path
        raise CacheMismatchError(
            f"{path} exists and is not a cache of this dataset with variants={variants}, "
            f"seed={seed}; delete it or pass overwrite=True (--overwrite)")
    jfd = os.open(journal, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for _ in range(LOCK_TRIES):
            try:
                fcntl.flock(jfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(LOCK_WAIT_S)
        else:
            raise CacheError(f"another build of {path} is running (it holds {journal})")
        with _SavedRng():
            build = _Build(dataset, path, jfd, info, count, variants, seed, on_error)
            build.run(num_workers, progress, chunk_size, multiprocessing_context)
    finally:
        os.close(jfd)
    return path


class _Build:
    """One build under the journal's lock: resume or start, run the tasks, journal each result,
    then write the trailer and move the file into place."""

    def __init__(self, dataset: Any, path: str, jfd: int, info: dict, count: int,
                 variants: int, seed: int, on_error: str) -> None:
        self.dataset, self.path, self.jfd, self.on_error = dataset, path, jfd, on_error
        self.partial, self.journal = path + ".partial", path + ".partial.journal"
        self.count, self.variants, self.seed = count, variants, seed
        self.spec = {"journal_version": JOURNAL_VERSION, "format_version": FORMAT_VERSION,
                     "fingerprint": _digest(info), "count": count, "variants": variants,
                     "seed": seed, "source": info}
        self.root = _source_root(dataset)
        self.tree: dict | None = None
        self.leaves: list[dict] = []
        self.arrs: dict[str, np.ndarray] = {}
        self.done = np.zeros((count, variants), bool)
        self.skipped: dict[int, dict] = {}  # source index -> first failure report

    # -- start or resume --

    def _start(self) -> None:
        why = self._resume()
        if why is not None:
            warnings.warn(f"{self.partial} is an unfinished build that cannot be resumed: {why}; "
                          "starting afresh", stacklevel=4)
        if self.tree is None:
            with open(self.partial, "wb") as f:
                f.write(pack_preamble(STATE_BUILDING).ljust(DATA_START, b"\x00"))
            os.ftruncate(self.jfd, 0)

    def _resume(self) -> str | None:
        """Recover the finished records of an interrupted build; why not, when there is one that
        cannot be resumed (None otherwise)."""
        head = unpack_journal_header(os.pread(self.jfd, JOURNAL_HEADER_MAX, 0))
        if head is None or not os.path.exists(self.partial):
            return None
        jhead, start = head
        if (jhead.get("journal_version"), jhead.get("format_version")) \
                != (JOURNAL_VERSION, FORMAT_VERSION):
            return "it was written by another version of pooled_loader"
        for key in ("variants", "seed"):
            if jhead.get(key) != self.spec[key]:
                return (f"it was started with {key}={jhead.get(key)!r}, this build has "
                        f"{self.spec[key]!r}")
        tree, leaves = infer_layout_from_tree(jhead["layout"])
        rows = self._journal_rows(jhead, start, leaves)
        if jhead["fingerprint"] != self.spec["fingerprint"]:
            rows, why = self._rows_for_changed_source(jhead, rows)
            if why is not None:
                return why
            # The journal now describes the source as it is. Emptied first: a crash while
            # rewriting must not leave old-numbered rows behind the new header.
            os.ftruncate(self.jfd, 0)
            os.pwrite(self.jfd, pack_journal_header({**self.spec, "layout": tree})
                      + rows.tobytes(), 0)
        self._set_layout(tree, leaves)
        apply_entries(self.arrs, self.done, rows, leaves)
        return None

    def _journal_rows(self, jhead: dict, start: int, leaves: list[dict]) -> np.ndarray:
        """The journal's rows whose own and record checksums hold (a torn last row is cut)."""
        dtype = entry_dtype(leaves)
        nrows = max(0, (os.fstat(self.jfd).st_size - start) // dtype.itemsize)
        os.ftruncate(self.jfd, start + nrows * dtype.itemsize)
        rows = np.frombuffer(os.pread(self.jfd, nrows * dtype.itemsize, start), dtype).copy()
        good = np.zeros(len(rows), bool)
        with open(self.partial, "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if fsize else None
            try:
                for r in range(len(rows)):
                    good[r] = _row_holds(rows[r:r + 1], jhead, leaves, mm, fsize)
            finally:
                if mm is not None:
                    mm.close()
        return rows[good]

    def _rows_for_changed_source(self, jhead: dict, rows: np.ndarray
                                 ) -> tuple[np.ndarray, str | None]:
        """Rows renumbered for the source as it is now, when only samples without a finished
        record changed (removed, replaced or added); else why the build starts over."""
        old, new = jhead.get("source", {}), self.spec["source"]
        changed = sorted(k for k in set(old) | set(new) if k not in ("len", "files", "files_sha256")
                         and old.get(k) != new.get(k))
        if changed:
            return rows, "; ".join(f"its {k} changed from {_short(old.get(k))} to "
                                   f"{_short(new.get(k))}" for k in changed)
        if self.root is None or (rows["source"] == 0).any():
            return rows, ("the source changed and the dataset has no `samples` file list to tell "
                          "which samples did")
        now = {_sample_identity(self.dataset, i, self.root): i for i in range(self.count)}
        index = np.array([now.get(int(s), -1) for s in rows["source"]], np.int64)
        if (index < 0).any():
            n = len(np.unique(rows["index"][index < 0]))
            return rows, (f"{n} already cached sample{'s' if n > 1 else ''} changed since it "
                          "started (file replaced, removed or moved, or its label changed)")
        rows["index"] = index
        for r in range(len(rows)):
            _seal_row(rows[r:r + 1])
        return rows, None

    def _set_layout(self, tree: dict, leaves: list[dict]) -> None:
        self.tree, self.leaves = tree, leaves
        self.arrs = index_arrays(leaves, self.count, self.variants)

    # -- run --

    def run(self, num_workers: int, progress: bool, chunk_size: int,
            mp_context: str | None) -> None:
        self._start()
        if progress and self.done.any():
            print(f"resuming {self.partial}: {int(self.done.sum()):,} of "
                  f"{self.done.size:,} records already built", file=sys.stderr)
        todo = [(int(i), int(k)) for i, k in zip(*np.nonzero(~self.done))]
        tasks = [tuple(todo[s:s + chunk_size]) for s in range(0, len(todo), chunk_size)]
        builder = _BuildTasks(self.dataset, self.partial, self.seed, self.tree, self.jfd,
                              self.on_error == "raise", self.root)
        if num_workers > 0:  # fork where available: the dataset need not be picklable
            import multiprocessing as mp
            mp_context = mp_context or ("fork" if "fork" in mp.get_all_start_methods() else None)
            extra = {"multiprocessing_context": mp_context, "persistent_workers": True,
                     "prefetch_factor": 3}  # persistent: close() stops the workers at once
        else:
            extra = {}
        loader = PooledLoader(builder, batch_size=None, sampler=tasks, num_workers=num_workers,
                              collate_fn=_as_is, in_order=False, **extra)
        from tqdm import tqdm
        bar = tqdm(total=self.count * self.variants, initial=int(self.done.sum()),
                   disable=not progress, desc=f"caching {os.path.basename(self.path)}",
                   unit="rec", smoothing=0.05)
        os.lseek(self.jfd, 0, os.SEEK_END)
        try:
            for got, raw, failures in (loader if tasks else ()):
                bar.update(self._take(got, raw, failures))
            if not self.done.any():
                f = self.skipped[min(self.skipped)]
                raise CacheError(f"building {self.path}: every sample failed (e.g. {_where(f)}: "
                                 f"{f['reason']}); nothing to cache") \
                    from _SourceTraceback(f["traceback"])
        except KeyboardInterrupt:
            bar.close()
            print(f"\ninterrupted: {int(self.done.sum())} of {self.count * self.variants} records "
                  f"kept in {self.partial}; run the build again to resume", file=sys.stderr)
            raise
        except CacheError:
            self._drop_if_empty()
            raise
        except Exception as e:  # noqa: BLE001 - a worker died or the pipeline broke: one line
            self._drop_if_empty()
            raise CacheError(self._failure_line(e)) from e
        finally:
            bar.close()
            loader.close()
            builder.close()
        self._finish()
        if progress and self.skipped:
            print(self.summary(), file=sys.stderr)

    def _take(self, got: dict | None, raw: bytes, failures: list[dict]) -> int:
        """Journal one task's rows and handle its failures; the number of records it settled."""
        if got is not None and got != self.tree:  # a process's first rows bring its layout
            if self.tree is not None:
                raise CacheError(f"building {self.path}: samples differ in structure ({got} vs "
                                 f"{self.tree}); every sample must have the same layout")
            self._set_layout(*infer_layout_from_tree(got))
            os.ftruncate(self.jfd, 0)
            os.pwrite(self.jfd, pack_journal_header({**self.spec, "layout": self.tree}), 0)
            os.lseek(self.jfd, 0, os.SEEK_END)
        rows = np.frombuffer(raw, entry_dtype(self.leaves)) if raw else ()
        if raw:
            os.write(self.jfd, raw)  # in the page cache at once: survives SIGKILL of this process
            apply_entries(self.arrs, self.done, rows, self.leaves)
        for f in failures:
            if self.on_error == "raise":
                raise self._sample_error(f) from _SourceTraceback(f["traceback"])
            self.skipped.setdefault(f["index"], f)
        if failures and not self.done.any() \
                and len(self.skipped) >= MAX_FAILURES_BEFORE_FIRST_SUCCESS:
            f = self.skipped[min(self.skipped)]
            raise CacheError(
                f"building {self.path}: the first {len(self.skipped)} samples all failed (e.g. "
                f"{_where(f)}: {f['reason']}): that is a broken pipeline rather than a few bad "
                "files; fix it and run the build again") from _SourceTraceback(f["traceback"])
        return len(rows) + len(failures)

    def _sample_error(self, f: dict) -> CacheSampleError:
        kept = int(self.done.sum())
        resume = f" to resume ({kept} records are kept in {self.partial})" if kept else ""
        return CacheSampleError(
            f"building {self.path}: {_where(f)} failed: {f['reason']}. Fix or remove the file "
            f"and call build_cache() again{resume}, or pass on_error=\"skip\" to leave bad "
            "samples out",
            index=f["index"], variant=f["variant"], file=f["file"], reason=f["reason"], kept=kept)

    def _failure_line(self, e: Exception) -> str:
        """One line for a failure that is not a sample's: a dead worker or a broken pipeline."""
        what = "a build worker died" if isinstance(e, WorkerError) else "the build failed"
        return (f"building {self.path}: {what}: {one_line(e)}; finished records are kept in "
                f"{self.partial}: fix the cause and run the build again to resume")

    def _drop_if_empty(self) -> None:
        """A build that finished no record leaves nothing behind (there is nothing to resume)."""
        if not self.done.any():
            for p in (self.partial, self.journal):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass

    def summary(self) -> str:
        n = len(self.skipped)
        return (f"{n:,} of {self.count:,} samples skipped (see `python -m pooled_loader cache "
                f"info {self.path}`)")

    # -- finish --

    def _finish(self) -> None:
        complete = self.done.all(axis=1)
        kept = np.flatnonzero(complete)
        lost = ~complete
        lost[list(self.skipped)] = False
        if lost.any():  # cannot happen: every task either journals its records or reports a failure
            raise CacheError(f"building {self.path}: {int(lost.sum())} samples were neither built "
                             "nor skipped; run the build again")
        arrs, extra = self.arrs, {"source_count": self.count, "skipped": []}
        if self.skipped:
            arrs = {name: a[kept] for name, a in arrs.items()}
            arrs["source_index"] = kept.astype("<i8")
            extra["skipped"] = [{"index": i, "path": f["file"], "reason": f["reason"]}
                                for i, f in sorted(self.skipped.items())]
        _write_trailer(self.partial, arrs, {
            "format_version": FORMAT_VERSION, "count": len(kept), "variants": self.variants,
            "seed": self.seed, "layout": self.tree, "data_start": DATA_START,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": {
                **self.spec["source"], "fingerprint": self.spec["fingerprint"]}, **extra})
        os.replace(self.partial, self.path)
        dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        os.unlink(self.journal)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _row_holds(row: np.ndarray, jhead: dict, leaves: list[dict], mm: mmap.mmap | None,
               fsize: int) -> bool:
    """A journal row's own checksum holds, it is in range, and so are its records' checksums."""
    if zlib.crc32(row.tobytes()[:-4]) != int(row["ecrc"][0]) \
            or not 0 <= row["index"][0] < jhead["count"] \
            or not 0 <= row["variant"][0] < jhead["variants"]:
        return False
    for lf in leaves:
        if lf["kind"] in VAR_KINDS:
            j = lf["id"]
            off, n = int(row[f"o{j}"][0]), int(row[f"n{j}"][0])
            if off + n > fsize or (n and zlib.crc32(mm[off:off + n]) != row[f"c{j}"][0]):
                return False
    return True


def _where(f: dict) -> str:
    return f"sample {f['index']} ({f['file']})" if f["file"] else f"sample {f['index']}"


def _write_trailer(partial: str, arrs: dict[str, np.ndarray], header: dict) -> None:
    """Append the index arrays and the JSON header, then mark the file complete (fsynced)."""
    fd = os.open(partial, os.O_RDWR)
    try:
        data_end = os.fstat(fd).st_size
        table = {}
        off = align(data_end)
        for name, a in arrs.items():
            table[name] = {"offset": off, "dtype": a.dtype.str, "shape": list(a.shape)}
            off = align(off + a.nbytes)
        hb = header_bytes({**header, "arrays": table, "data_end": data_end})
        os.ftruncate(fd, off + len(hb))
        for name, a in arrs.items():
            pwrite_all(fd, memoryview(np.ascontiguousarray(a).reshape(-1)).cast("B"),
                       table[name]["offset"])
        pwrite_all(fd, memoryview(hb), off)
        os.fsync(fd)
        os.pwrite(fd, pack_preamble(STATE_COMPLETE, off, len(hb), zlib.crc32(hb)), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_progress(path: str | os.PathLike) -> tuple[int, int] | None:
    """(records journaled, records in all) of an unfinished build of ``path``, or None."""
    journal = os.fspath(path) + ".partial.journal"
    try:
        with open(journal, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    head = unpack_journal_header(raw)
    if head is None or "layout" not in head[0]:
        return None
    jhead, start = head
    _, leaves = infer_layout_from_tree(jhead["layout"])
    done = (len(raw) - start) // entry_dtype(leaves).itemsize
    return done, jhead["count"] * jhead["variants"]


# ---------------------------------------------------------------------------------------------
# Reading


class CachedDataset:
    """Map-style dataset over a cache file: ``(image, label)`` like the uncached pipeline.

    ``transform`` (a callable ``t(x, out=None)`` or plain ``t(x)``) is applied to the sample's
    first array leaf (the image), which it receives as a read-only numpy view of the file.
    ``expect_fingerprint_of=dataset`` raises CacheMismatchError unless the cache was built from
    that dataset and transform. ``check_crc=True`` checks each record's crc32 when read.
    ``set_epoch(e)`` selects the variants of epoch ``e`` (see ``variant_for_epoch``); with
    ``persistent_workers`` call it before the workers start, as they keep their own copy.
    A cache built with ``on_error="skip"`` numbers its samples densely: ``skipped`` lists what was
    left out, ``source_indices`` maps each sample to its index in the source dataset.
    """

    def __init__(self, path: str | os.PathLike, transform: Callable | None = None, *,
                 expect_fingerprint_of: Any = None, seed: int | None = None,
                 check_crc: bool = False) -> None:
        self.path = os.fspath(path)
        self.transform = transform
        self.check_crc = check_crc
        self.epoch = 0
        self._mm: mmap.mmap | None = None
        self._open()
        self.seed = self.header["seed"] if seed is None else seed
        if expect_fingerprint_of is not None:
            self.check_source(expect_fingerprint_of)
        self._takes_out = _accepts_out(transform)

    # -- opening (lazily again in every process that unpickles it) --

    def _open(self) -> None:
        path = self.path
        if not os.path.exists(path):
            if os.path.exists(path + ".partial"):
                prog = partial_progress(path)
                got = f" ({prog[0]} of {prog[1]} records)" if prog else ""
                raise CacheIncompleteError(
                    f"{path} does not exist: only the unfinished build {path}.partial{got} is "
                    "there; "
                    "run build_cache() (or `python -m pooled_loader cache build`) with the same "
                    "dataset again to finish it")
            raise FileNotFoundError(f"{path}: no such cache file")
        with open(path, "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            hdr = read_header(path, fsize, f.read(PREAMBLE_SIZE))
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count, variants = hdr["count"], hdr["variants"]
        tree, leaves = infer_layout_from_tree(hdr["layout"])
        arrays = {}
        for name, a in hdr["arrays"].items():
            dt, shape = np.dtype(a["dtype"]), tuple(a["shape"])
            end = a["offset"] + dt.itemsize * int(np.prod(shape))
            want = (count,) if name == "source_index" else (count, variants)
            if end > fsize or shape[:len(want)] != want:
                raise CacheFormatError(f"{path}: index array {name} is out of bounds or has a "
                                       "wrong shape; rebuild the cache")
            arrays[name] = np.frombuffer(mm, dt, int(np.prod(shape)), a["offset"]).reshape(shape)
        for lf in leaves:  # every record lies inside the data area and matches its shape
            if lf["kind"] not in VAR_KINDS:
                continue
            j = lf["id"]
            o, n = arrays[f"leaf{j}.offset"], arrays[f"leaf{j}.nbytes"]
            bad = (o < hdr["data_start"]) | (o + n > hdr["data_end"])
            if lf["ndim"]:
                sz = np.prod(arrays[f"leaf{j}.shape"], axis=-1) * np.dtype(lf["dtype"]).itemsize
                bad |= (sz != n) | (arrays[f"leaf{j}.shape"] < 0).any(axis=-1)
            if bad.any():
                i, k = (int(v[0]) for v in np.nonzero(bad))
                raise CacheFormatError(f"{path}: record {i} (variant {k}) of leaf {j} lies "
                                       "outside the data or has an inconsistent size; rebuild")
        source_count = hdr.get("source_count", count)
        src = arrays.get("source_index")
        if src is not None and len(src) and (src.min() < 0 or src.max() >= source_count):
            raise CacheFormatError(f"{path}: source_index points outside the source; rebuild")
        self.header, self._tree, self._leaves, self._arrays = hdr, tree, leaves, arrays
        self._unflatten = make_unflatten(tree)
        self._var = [lf["kind"] in VAR_KINDS for lf in leaves]
        self._image = next((lf["id"] for lf in leaves if lf["kind"] in ("array", "tensor")), None)
        self._mm = mm

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        for k in ("_mm", "_arrays", "header", "_tree", "_leaves", "_unflatten"):
            d.pop(k, None)
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._mm = None

    def _ensure_open(self) -> None:
        if self._mm is None:
            self._open()

    # -- dataset protocol --

    @property
    def variants(self) -> int:
        """Stored outputs per sample."""
        self._ensure_open()
        return self.header["variants"]

    def __len__(self) -> int:
        """Samples stored: the source's length less the samples skipped at build time."""
        self._ensure_open()
        return self.header["count"]

    @property
    def skipped(self) -> list[dict]:
        """Samples left out at build time (``on_error="skip"``): ``{"index", "path", "reason"}``
        with ``index`` the source dataset's index."""
        self._ensure_open()
        return list(self.header.get("skipped", []))

    @property
    def source_indices(self) -> np.ndarray:
        """``source_indices[i]``: the source dataset's index of this cache's sample ``i`` (the
        identity unless samples were skipped)."""
        self._ensure_open()
        src = self._arrays.get("source_index")
        return np.arange(self.header["count"]) if src is None else src

    def set_epoch(self, epoch: int) -> None:
        """Read the variants of ``epoch`` from now on."""
        self.epoch = int(epoch)

    def variant(self, index: int) -> int:
        """Variant that ``index`` reads at the current epoch."""
        return variant_for_epoch(self.seed, self.epoch, index, self.header["variants"])

    def raw(self, index: int, variant: int | None = None) -> Any:
        """The stored sample (arrays are read-only views of the file), without the transform;
        ``variant`` defaults to the current epoch's."""
        return self._unflatten(self._values(index, variant))

    def _values(self, index: int, variant: int | None = None) -> list:
        self._ensure_open()
        count = self.header["count"]
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"index {index} out of range for a cache of {count} samples")
        k = self.variant(index) if variant is None else variant
        if not 0 <= k < self.header["variants"]:
            raise IndexError(f"variant {k} out of range: the cache stores "
                             f"{self.header['variants']}")
        return [self._leaf(lf, index, k) for lf in self._leaves]

    def _leaf(self, lf: dict, i: int, k: int) -> Any:
        j, kind, a = lf["id"], lf["kind"], self._arrays
        if kind == "none":
            return None
        if kind not in VAR_KINDS:
            v = a[f"leaf{j}.value"][i, k]
            return v if kind == "npscalar" else v.item()
        off, n = int(a[f"leaf{j}.offset"][i, k]), int(a[f"leaf{j}.nbytes"][i, k])
        if self.check_crc and zlib.crc32(memoryview(self._mm)[off:off + n]) \
                != a[f"leaf{j}.crc"][i, k]:
            raise CacheRecordError(f"{self.path}: record {i} (variant {k}) of leaf {j} is "
                                   "corrupted (crc32 mismatch); rebuild the cache")
        if kind == "str":
            return bytes(self._mm[off:off + n]).decode("utf-8")
        if kind == "bytes":
            return bytes(self._mm[off:off + n])
        shape = tuple(a[f"leaf{j}.shape"][i, k]) if lf["ndim"] else ()
        dt = np.dtype(lf["dtype"])
        arr = np.frombuffer(self._mm, dt, n // dt.itemsize, off).reshape(shape)
        return arr  # tensors come back as arrays for the transform; see _finish_leaf

    def __getitem__(self, index: int) -> Any:
        return self._sample(index, None)

    def getitem_into(self, index: int, out: Any) -> Any:
        """Like ``dataset[index]``, writing the image's transform output into ``out``'s leaf."""
        self._ensure_open()
        return self._sample(index, out_leaves(out, self._tree))

    def _sample(self, index: int, outs: list | None) -> Any:
        values = self._values(index)
        for lf in self._leaves:
            j = lf["id"]
            if not self._var[j] or lf["kind"] in ("str", "bytes"):
                continue
            o = outs[j] if outs is not None else None
            v = values[j]
            if j == self._image and self.transform is not None:
                v = self.transform(v, out=o) if (self._takes_out and o is not None) \
                    else self.transform(v)
            elif o is not None and o.shape == v.shape and o.dtype == v.dtype:
                np.copyto(o, v)
                v = o
            if lf["kind"] == "tensor" and isinstance(v, np.ndarray):
                import torch
                v = torch.from_numpy(v) if v.flags.writeable else torch.tensor(v)
            values[j] = v
        return self._unflatten(values)

    # -- checks --

    def check_source(self, dataset: Any) -> None:
        """Raise CacheMismatchError unless this cache was built from ``dataset`` as it is now."""
        self._ensure_open()
        src = self.header["source"]
        info = fingerprint_info(dataset)
        if _digest(info) == src["fingerprint"]:
            return
        diff = [f"{k}: cache has {src.get(k)!r}, dataset has {info[k]!r}" for k in info
                if src.get(k) != info[k]]
        raise CacheMismatchError(f"{self.path} was built from another dataset or transform "
                                 f"({'; '.join(diff)}); rebuild it with build_cache()")

    def verify(self, dataset: Any = None, progress: bool = False) -> None:
        """Check every record's bounds and crc32 (and the source, when ``dataset`` is given)."""
        self._ensure_open()
        if dataset is not None:
            self.check_source(dataset)
        from tqdm import tqdm
        count, variants = self.header["count"], self.header["variants"]
        mv = memoryview(self._mm)
        for i in tqdm(range(count), disable=not progress, desc="verify", unit="sample"):
            for k in range(variants):
                for lf in self._leaves:
                    if lf["kind"] not in VAR_KINDS:
                        continue
                    j = lf["id"]
                    off = int(self._arrays[f"leaf{j}.offset"][i, k])
                    n = int(self._arrays[f"leaf{j}.nbytes"][i, k])
                    if zlib.crc32(mv[off:off + n]) != self._arrays[f"leaf{j}.crc"][i, k]:
                        raise CacheRecordError(
                            f"{self.path}: record {i} (variant {k}) of leaf {j} is corrupted "
                            "(crc32 mismatch); rebuild the cache")

    def __repr__(self) -> str:
        return f"CachedDataset({self.path!r}, transform={self.transform!r})"


def _accepts_out(transform: Callable | None) -> bool:
    if transform is None:
        return False
    try:
        return "out" in inspect.signature(transform).parameters
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# CLI: python -m pooled_loader cache {build,info,verify}


def main(argv: Sequence[str] | None = None) -> int:
    """``cache build SRC DST [--max-side N] [--variants K --crop S] [--workers N] [--skip-bad]``,
    ``cache info DST [--all]``, ``cache verify DST``. A leading ``"cache"`` in ``argv`` is
    skipped. Errors are raised; ``python -m pooled_loader`` prints them as one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cache"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m pooled_loader cache",
                                description="Build, inspect and check sample caches.",
                                epilog="--verbose (any command): show the traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="cache an image folder (decoded, resized)")
    b.add_argument("src", help="image folder: SRC/CLASS/IMAGE")
    b.add_argument("dst", help="cache file to write")
    b.add_argument("--max-side", type=int, default=None, help="resize so the longer side <= N")
    b.add_argument("--variants", type=int, default=1,
                   help="store K random crops per image (needs --crop)")
    b.add_argument("--crop", type=int, default=None,
                   help="RandomResizedCrop(S) stored per variant (the random, expensive part)")
    b.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--skip-bad", action="store_true",
                   help="leave images that fail to load out of the cache (listed by `info`)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing cache at DST")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="print a cache's header")
    i.add_argument("dst")
    i.add_argument("--all", action="store_true", help="list every skipped sample")
    v = sub.add_parser("verify", help="check every record's checksum")
    v.add_argument("dst")
    args = p.parse_args(argv)
    if args.cmd == "build":
        if args.variants > 1 and args.crop is None:
            p.error("--variants > 1 stores random outputs: give --crop S")
        _cli_build(args)
    elif args.cmd == "info":
        _cli_info(args.dst, args.all)
    else:
        CachedDataset(args.dst).verify(progress=True)
        print(f"{args.dst}: all records OK")
    return 0


def _cli_build(args: argparse.Namespace) -> None:
    from ..vision import Compose, DecodeImage, ImageFolder, RandomResizedCrop, Resize
    ops = [DecodeImage()]
    if args.max_side:
        ops.append(Resize(max_side=args.max_side))
    if args.crop:
        ops.append(RandomResizedCrop(args.crop))
    ds = ImageFolder(args.src, transform=Compose(ops))
    existed = os.path.exists(args.dst) and not args.overwrite
    try:
        build_cache(ds, args.dst, num_workers=args.workers, variants=args.variants,
                    seed=args.seed, progress=not args.quiet, overwrite=args.overwrite,
                    on_error="skip" if args.skip_bad else "raise")
    except CacheSampleError as e:
        where = e.file or f"sample {e.index}"
        resumes = f" (the build resumes: {e.kept:,} records are kept)" if e.kept else ""
        raise CacheError(
            f"cannot cache {where}: {e.reason}. Either fix or remove it and run the same command "
            f"again{resumes}, or add --skip-bad to leave bad images out") from e
    cache = CachedDataset(args.dst)
    print(f"{args.dst}: {len(cache):,} samples x {cache.variants} variants, "
          f"{os.path.getsize(args.dst) / 2**20:.1f} MiB")
    if cache.skipped and (args.quiet or existed):  # else build_cache printed it
        print(f"{len(cache.skipped):,} of {cache.header['source_count']:,} samples skipped "
              f"(see `python -m pooled_loader cache info {args.dst}`)")


INFO_SKIPPED_SHOWN = 20  # `cache info` lists this many skipped samples unless --all


def _cli_info(dst: str, show_all: bool) -> None:
    ds = CachedDataset(dst)
    h = ds.header
    shp = {lf["id"]: ds._arrays.get(f"leaf{lf['id']}.shape") for lf in ds._leaves}
    print(f"file:       {dst} ({os.path.getsize(dst) / 2**20:.1f} MiB)")
    print(f"format:     version {h['format_version']}, created {h['created']}")
    print(f"samples:    {h['count']} x {h['variants']} variants (seed {h['seed']})")
    for lf in ds._leaves:
        s = f"  leaf {lf['id']}: {lf['kind']}"
        if lf.get("dtype"):
            s += f" {lf['dtype']}"
        if shp.get(lf["id"]) is not None:
            a = shp[lf["id"]].reshape(-1, lf["ndim"])
            s += (f" shape min {tuple(int(v) for v in a.min(0))}"
                  f" max {tuple(int(v) for v in a.max(0))}")
        print(s)
    skipped = ds.skipped
    print(f"skipped:    {len(skipped)} of {h.get('source_count', h['count'])} source samples"
          + (" (left out; cache indices are renumbered, CachedDataset.source_indices maps "
             "them back)" if skipped else ""))
    shown = skipped if show_all else skipped[:INFO_SKIPPED_SHOWN]
    for s in shown:
        print(f"  source index {s['index']}: {s['path'] or '(no file)'}: {s['reason']}")
    if len(shown) < len(skipped):
        print(f"  ... and {len(skipped) - len(shown)} more (--all lists them)")
    for k, val in h["source"].items():
        print(f"source.{k}: {val}")
