"""``build_cache``: run the tasks, journal each finished record, resume, finish the file.

A build holds the journal's lock (one build per path), starts afresh or resumes from the journal
(``_Build._resume``: rows whose checksums hold, renumbered when only unfinished samples of the
source changed), runs ``tasks._BuildTasks`` on ``PooledLoader``'s workers, appends every task's
rows to the journal as they come (the page cache keeps them through a SIGKILL of this process),
and finally writes the index arrays and header (``_write_trailer``) and moves the file into
place atomically (fsync, ``os.replace``). The byte layout is in format.py.

The build's files have fixed names (``PATH.partial``, ``PATH.partial.journal``: a later run
must find them to resume), so they are opened with ``O_NOFOLLOW`` and used only if they are
regular files of this user with one link (``open_own``); a fresh ``.partial`` is created with
``O_EXCL``. A symlink or hard link planted there (a shared ``/tmp``) is never written through.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import multiprocessing as mp
import os
import sys
import time
import warnings
import zlib
from typing import Any

import numpy as np

from ..core import safe_open
from .._cli import one_line
from ..core.errors import WorkerError
from ..loader import PooledLoader
from ..observability.progress import progress_bar
from .fingerprint import SavedRng, digest, fingerprint_info, sample_identity, source_root
from .format import (
    DATA_START, FORMAT_VERSION, JOURNAL_HEADER_MAX, JOURNAL_VERSION, STATE_BUILDING,
    STATE_COMPLETE, VAR_KINDS, CacheError, CacheMismatchError, CacheSampleError, align,
    apply_entries, entry_dtype, header_bytes, index_arrays, infer_layout_from_tree,
    pack_journal_header, pack_preamble, pwrite_all, read_header, unpack_journal_header,
)
from .tasks import SourceTraceback, _BuildTasks, collate_as_is, seal_row

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
    # checked here, before the journal and the partial file are made, not by the loader after
    if num_workers < 0 or chunk_size < 1:
        raise ValueError(f"num_workers must be >= 0 and chunk_size >= 1, got {num_workers} and "
                         f"{chunk_size}")
    if num_workers and isinstance(multiprocessing_context, str) \
            and multiprocessing_context not in mp.get_all_start_methods():
        raise ValueError(f"multiprocessing_context must be one of {mp.get_all_start_methods()}, "
                         f"got {multiprocessing_context!r}")
    if on_error is None:
        on_error = "skip" if getattr(dataset, "on_error", None) == "skip" else "raise"
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    count = len(dataset)
    if count == 0:
        raise ValueError("cannot cache an empty dataset")
    info = fingerprint_info(dataset)
    fp = digest(info)
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
    jfd = open_own(journal, os.O_RDWR | os.O_CREAT)
    try:
        for _ in range(LOCK_TRIES):
            try:
                fcntl.flock(jfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(LOCK_WAIT_S)
        else:
            raise CacheError(f"another build of {path} is running (it holds {journal})")
        with SavedRng():
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
                     "fingerprint": digest(info), "count": count, "variants": variants,
                     "seed": seed, "source": info}
        self.root = source_root(dataset)
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
            try:
                os.unlink(self.partial)  # unlinks a symlink itself, never its target
            except FileNotFoundError:
                pass
            fd = open_own(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            with os.fdopen(fd, "wb") as f:
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
        with os.fdopen(open_own(self.partial, os.O_RDONLY), "rb") as f:
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
        now = {sample_identity(self.dataset, i, self.root): i for i in range(self.count)}
        index = np.array([now.get(int(s), -1) for s in rows["source"]], np.int64)
        if (index < 0).any():
            n = len(np.unique(rows["index"][index < 0]))
            return rows, (f"{n} already cached sample{'s' if n > 1 else ''} changed since it "
                          "started (file replaced, removed or moved, or its label changed)")
        rows["index"] = index
        for r in range(len(rows)):
            seal_row(rows[r:r + 1])
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
            mp_context = mp_context or ("fork" if "fork" in mp.get_all_start_methods() else None)
            extra = {"multiprocessing_context": mp_context, "persistent_workers": True,
                     "prefetch_factor": 3}  # persistent: close() stops the workers at once
        else:
            extra = {}
        loader = PooledLoader(builder, batch_size=None, sampler=tasks, num_workers=num_workers,
                              collate_fn=collate_as_is, in_order=False, **extra)
        bar = progress_bar(total=self.count * self.variants, initial=int(self.done.sum()),
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
                    from SourceTraceback(f["traceback"])
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
                raise self._sample_error(f) from SourceTraceback(f["traceback"])
            self.skipped.setdefault(f["index"], f)
        if failures and not self.done.any() \
                and len(self.skipped) >= MAX_FAILURES_BEFORE_FIRST_SUCCESS:
            f = self.skipped[min(self.skipped)]
            raise CacheError(
                f"building {self.path}: the first {len(self.skipped)} samples all failed (e.g. "
                f"{_where(f)}: {f['reason']}): that is a broken pipeline rather than a few bad "
                "files; fix it and run the build again") from SourceTraceback(f["traceback"])
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


def open_own(path: str, flags: int) -> int:
    """``os.open`` of a build file that is not a symlink, and is a regular file of this user
    with one link (``safe_open.open_own``); CacheError naming it otherwise."""
    try:
        return safe_open.open_own(path, flags)
    except (safe_open.UnsafeFileError, FileExistsError) as e:
        if e.errno not in (errno.ELOOP, errno.EEXIST):
            raise CacheError(f"{path} is not a regular file of yours with one link: refusing "
                             "to build through it; remove it and run the build again") from None
        raise CacheError(f"{path} is a symlink or appeared during the build: refusing to write "
                         "through it; remove it and run the build again") from None


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
    fd = open_own(partial, os.O_RDWR)
    try:
        data_end = os.fstat(fd).st_size
        table = {}
        off = align(data_end)
        for name, a in arrs.items():
            table[name] = {"offset": off, "dtype": a.dtype.str, "shape": list(a.shape),
                           "crc": zlib.crc32(np.ascontiguousarray(a))}
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
