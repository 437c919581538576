"""Cache the deterministic front of a pipeline in one memory-mapped file.

    build_cache(ImageFolder(root, transform=Compose([DecodeImage(), Resize(max_side=512)])),
                "train.plc", num_workers=2)
    ds = CachedDataset("train.plc", transform=Compose([RandomResizedCrop(224),
                                                       RandomHorizontalFlip(), ToCHW()]))
    loader = PooledLoader(ds, batch_size=256, shuffle=True, num_workers=2)

``build_cache`` runs ``dataset[i]`` once per index (``variants`` times with distinct seeds when
the dataset's transform is random), and stores every sample in one file (format:
``pooled_loader.cache_format``). The build runs on ``PooledLoader``'s worker processes (or in
this process when ``num_workers=0``): they write records straight into the file and send the
main process only their index entries, so sample data is never pickled; a failing sample is
reported with its index, file, worker and traceback, and workers exit with the main process.
The build goes to ``path + ".partial"`` with a journal ``path + ".partial.journal"`` of finished
records; an interrupted build (Ctrl-C, crash, SIGKILL) resumes from the journal on the next call
with the same dataset fingerprint, and the finished file appears at ``path`` atomically (fsync,
``os.replace``).

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
import warnings
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from .cache_format import (
    DATA_START, FORMAT_VERSION, JOURNAL_MAGIC, PREAMBLE_SIZE, STATE_BUILDING, STATE_COMPLETE,
    VAR_KINDS, CacheError, CacheFormatError, CacheIncompleteError, CacheMismatchError,
    CacheRecordError, align, apply_entries, entry_dtype, flatten, header_bytes, index_arrays,
    infer_layout, infer_layout_from_tree, leaf_to_array, make_unflatten, out_leaves,
    pack_preamble, pwrite_all, read_header, reserve,
)
from .errors import WorkerError
from .loader import PooledLoader

__all__ = ["build_cache", "CachedDataset", "dataset_fingerprint", "variant_for_epoch",
           "partial_progress", "main",
           "CacheError", "CacheFormatError", "CacheIncompleteError", "CacheMismatchError",
           "CacheRecordError"]

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
    if hasattr(dataset, "cache_fingerprint"):
        h.update(str(dataset.cache_fingerprint()).encode())
        info["files"] = "cache_fingerprint()"
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
# Build tasks: run by PooledLoader's workers (or in-process when num_workers=0)


class _SampleFailed(CacheError):
    """The source dataset failed on a sample (re-raised by the loader with worker and task)."""


class _BuildTasks:
    """Map-style dataset of build tasks: ``tasks[pairs]`` computes the records of ``pairs``
    (``(index, variant)`` tuples), writes them straight into the ``.partial`` file and returns
    ``(layout or None, journal rows as bytes)``: only those small rows travel back. The layout is
    given on resume, else inferred from each process's first sample and sent with its first
    result (the main process checks that all agree)."""

    def __init__(self, dataset: Any, partial: str, seed: int, tree: dict | None,
                 lock_fd: int) -> None:
        self.dataset, self.partial, self.seed, self.tree = dataset, partial, seed, tree
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

    def __getitem__(self, pairs: Sequence[tuple[int, int]]) -> tuple[dict | None, bytes]:
        if self._pid != os.getpid():
            self._open()
        ds, rows = self.dataset, None
        for r, (i, k) in enumerate(pairs):
            try:
                _seed_everything(self.seed, i, k)
                sample = ds[i]
                if self._tree is None:
                    self._set_layout(infer_layout(sample)[0])
                values = flatten(sample, self._tree, f"dataset[{i}]")
                if rows is None:
                    rows = np.zeros(len(pairs), self._dtype)
                _write_record(self._fd, rows[r:r + 1], i, k, values, self._leaves)
            except Exception as e:
                raise _SampleFailed(f"sample {i}{_sample_name(ds, i)} (variant {k}): "
                                    f"{type(e).__name__}: {e}") from e
        tree, self._sent = (None if self._sent else self._tree), True
        return tree, rows.tobytes()

    def close(self) -> None:
        if self._pid == os.getpid():
            os.close(self._fd)
            self._pid = self._fd = None


def _as_is(result: Any) -> Any:
    return result


def _sample_name(ds: Any, i: int) -> str:
    try:
        s = ds.samples[i]
        return f" ({os.fspath(s[0] if isinstance(s, (tuple, list)) else s)})"
    except Exception:
        return ""


def _write_record(fd: int, row: np.ndarray, i: int, k: int, values: list,
                  leaves: list[dict]) -> None:
    row["index"], row["variant"] = i, k
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
    raw = row.tobytes()
    row["ecrc"] = zlib.crc32(raw[:-4])


# ---------------------------------------------------------------------------------------------
# Build


def build_cache(dataset: Any, path: str | os.PathLike, *, num_workers: int = 0,
                variants: int = 1, progress: bool = True, seed: int = 0,
                overwrite: bool = False, chunk_size: int = 8,
                multiprocessing_context: str | None = None) -> str:
    """Run ``dataset[i]`` for every index (``variants`` times) and store the samples at ``path``.

    Resumes an interrupted build of the same dataset (fingerprint), seed and variants from
    ``path + ".partial"``. If ``path`` already holds a complete cache of this dataset it is kept
    (``overwrite=True`` rebuilds it); a cache of another dataset there raises CacheMismatchError.
    Returns ``path``. ``num_workers`` PooledLoader worker processes (``multiprocessing_context``,
    default fork where available) write records straight into the file; 0 builds in-process.
    """
    path = os.fspath(path)
    if variants < 1:
        raise ValueError(f"variants must be >= 1, got {variants}")
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
            f"seed={seed}; delete it or pass overwrite=True")
    jfd = os.open(journal, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for attempt in range(20):  # a killed build's processes may take a moment to go
            try:
                fcntl.flock(jfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.1)
        else:
            raise CacheError(f"another build of {path} is running (it holds {journal})")
        with _SavedRng():
            _build_locked(dataset, path, partial, journal, jfd, info, fp, count, variants,
                          seed, num_workers, progress, chunk_size, multiprocessing_context)
    finally:
        os.close(jfd)
    return path


def _build_locked(dataset: Any, path: str, partial: str, journal: str, jfd: int, info: dict,
                  fp: str, count: int, variants: int, seed: int, num_workers: int,
                  progress: bool, chunk_size: int, mp_context: str | None) -> None:
    spec = {"format_version": FORMAT_VERSION, "fingerprint": fp, "count": count,
            "variants": variants, "seed": seed}
    state = _resume(partial, journal, jfd, spec)
    if state is None:
        with open(partial, "wb") as f:
            f.write(pack_preamble(STATE_BUILDING).ljust(DATA_START, b"\x00"))
        tree, leaves, arrs, done = None, None, None, np.zeros((count, variants), bool)
    else:
        tree, leaves, arrs, done = state
    todo = [(int(i), int(k)) for i, k in zip(*np.nonzero(~done))]
    tasks = [tuple(todo[s:s + chunk_size]) for s in range(0, len(todo), chunk_size)]
    builder = _BuildTasks(dataset, partial, seed, tree, jfd)
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
    bar = tqdm(total=count * variants, initial=int(done.sum()), disable=not progress,
               desc=f"caching {os.path.basename(path)}", unit="rec", smoothing=0.05)
    os.lseek(jfd, 0, os.SEEK_END)
    try:
        for got, raw in (loader if tasks else ()):
            if got is not None and got != tree:  # a process's first result brings its layout
                if tree is not None:
                    raise CacheError(f"building {path}: samples differ in structure ({got} vs "
                                     f"{tree}); every sample must have the same layout")
                tree, leaves = infer_layout_from_tree(got)
                jhead = header_bytes({**spec, "layout": tree})
                os.ftruncate(jfd, 0)
                os.pwrite(jfd, JOURNAL_MAGIC + len(jhead).to_bytes(4, "little") + jhead, 0)
                os.lseek(jfd, 0, os.SEEK_END)
                arrs = index_arrays(leaves, count, variants)
            os.write(jfd, raw)  # in the page cache at once: survives SIGKILL of this process
            e = np.frombuffer(raw, entry_dtype(leaves))
            apply_entries(arrs, done, e, leaves)
            bar.update(len(e))
    except KeyboardInterrupt:
        bar.close()
        print(f"\ninterrupted: {int(done.sum())} of {count * variants} records kept in "
              f"{partial}; run the build again to resume", file=sys.stderr)
        raise
    except (_SampleFailed, WorkerError) as e:  # in-process: keep the sample's traceback
        raise CacheError(_failure(path, partial, e)) from (None if num_workers else e)
    finally:
        bar.close()
        loader.close()
        builder.close()
    _finish(path, partial, journal, tree, leaves, arrs, info, fp, count, variants, seed)


def _failure(path: str, partial: str, e: Exception) -> str:
    """One line naming the sample (or the dead worker), then the loader's report if any."""
    msg = str(e).rstrip()
    if isinstance(e, WorkerError):
        return (f"building {path}: a build worker died ({msg}); finished records are kept in "
                f"{partial}: run the build again to resume")
    found = re.findall(r"(?m)(sample \d+.*\(variant \d+\): .*)$", msg)
    head = found[-1] if found else msg.splitlines()[0]
    return (f"building {path}: {head}; finished records are kept in {partial}: fix the cause "
            "and run the build again to resume" + ("" if head == msg else f"\n\n{msg}"))


def _resume(partial: str, journal: str, jfd: int, spec: dict):
    """Index state recovered from an interrupted build, or None to start afresh."""
    raw = os.pread(jfd, 1 << 20, 0)
    if not os.path.exists(partial) or len(raw) < 12 or raw[:8] != JOURNAL_MAGIC:
        return None
    n = int.from_bytes(raw[8:12], "little")
    try:
        jhead = json.loads(raw[12:12 + n])
    except ValueError:
        return None
    if any(jhead.get(k) != v for k, v in spec.items()):
        warnings.warn(f"{partial} is an unfinished build of another dataset/seed/variants; "
                      "starting afresh")
        return None
    tree = jhead["layout"]
    _, leaves = infer_layout_from_tree(tree)
    dtype = entry_dtype(leaves)
    start = 12 + n
    size = os.fstat(jfd).st_size
    nent = max(0, (size - start) // dtype.itemsize)
    body = os.pread(jfd, nent * dtype.itemsize, start) if nent else b""
    ents = np.frombuffer(body, dtype)
    os.ftruncate(jfd, start + nent * dtype.itemsize)  # drop a torn last entry
    arrs = index_arrays(leaves, spec["count"], spec["variants"])
    done = np.zeros((spec["count"], spec["variants"]), bool)
    with open(partial, "rb") as f:
        fsize = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if fsize else None
        try:
            for r in range(len(ents)):
                e = ents[r:r + 1]
                if zlib.crc32(e.tobytes()[:-4]) != int(e["ecrc"][0]) \
                        or not 0 <= e["index"][0] < spec["count"] \
                        or not 0 <= e["variant"][0] < spec["variants"]:
                    continue
                ok = True
                for lf in leaves:
                    if lf["kind"] in VAR_KINDS:
                        j = lf["id"]
                        o, nb = int(e[f"o{j}"][0]), int(e[f"n{j}"][0])
                        if o + nb > fsize or (nb and zlib.crc32(mm[o:o + nb]) != e[f"c{j}"][0]):
                            ok = False
                if ok:
                    apply_entries(arrs, done, e, leaves)
        finally:
            if mm is not None:
                mm.close()
    return tree, leaves, arrs, done


def partial_progress(path: str | os.PathLike) -> tuple[int, int] | None:
    """(records journaled, records in all) of an unfinished build of ``path``, or None."""
    journal = os.fspath(path) + ".partial.journal"
    try:
        with open(journal, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    if len(raw) < 12 or raw[:8] != JOURNAL_MAGIC:
        return None
    n = int.from_bytes(raw[8:12], "little")
    jhead = json.loads(raw[12:12 + n])
    _, leaves = infer_layout_from_tree(jhead["layout"])
    done = (len(raw) - 12 - n) // entry_dtype(leaves).itemsize
    return done, jhead["count"] * jhead["variants"]


def _finish(path: str, partial: str, journal: str, tree: dict, leaves: list[dict],
            arrs: dict[str, np.ndarray], info: dict, fp: str, count: int, variants: int,
            seed: int) -> None:
    fd = os.open(partial, os.O_RDWR)
    try:
        data_end = os.fstat(fd).st_size
        table = {}
        off = align(data_end)
        for name, a in arrs.items():
            table[name] = {"offset": off, "dtype": a.dtype.str, "shape": list(a.shape)}
            off = align(off + a.nbytes)
        header = {"format_version": FORMAT_VERSION, "count": count, "variants": variants,
                  "seed": seed, "layout": tree, "arrays": table, "data_start": DATA_START,
                  "data_end": data_end, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "source": {**info, "fingerprint": fp}}
        hb = header_bytes(header)
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
    os.replace(partial, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    os.unlink(journal)


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
            if end > fsize or shape[:2] != (count, variants):
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
        self._ensure_open()
        return self.header["count"]

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
    """``cache build SRC DST [--max-side N] [--variants K --crop S] [--workers N]``,
    ``cache info DST``, ``cache verify DST``. A leading ``"cache"`` in ``argv`` is skipped."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cache"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="python -m pooled_loader cache",
                                description="Build, inspect and check sample caches.")
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
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="print a cache's header")
    i.add_argument("dst")
    v = sub.add_parser("verify", help="check every record's checksum")
    v.add_argument("dst")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            if args.variants > 1 and args.crop is None:
                p.error("--variants > 1 stores random outputs: give --crop S")
            from .vision import Compose, DecodeImage, ImageFolder, RandomResizedCrop, Resize
            ops = [DecodeImage()]
            if args.max_side:
                ops.append(Resize(max_side=args.max_side))
            if args.crop:
                ops.append(RandomResizedCrop(args.crop))
            ds = ImageFolder(args.src, transform=Compose(ops))
            build_cache(ds, args.dst, num_workers=args.workers, variants=args.variants,
                        seed=args.seed, progress=not args.quiet)
            print(f"{args.dst}: {len(ds)} samples x {args.variants} variants, "
                  f"{os.path.getsize(args.dst) / 2**20:.1f} MiB")
        elif args.cmd == "info":
            ds = CachedDataset(args.dst)
            h = ds.header
            shp = {lf["id"]: ds._arrays.get(f"leaf{lf['id']}.shape") for lf in ds._leaves}
            print(f"file:       {args.dst} ({os.path.getsize(args.dst) / 2**20:.1f} MiB)")
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
            for k, val in h["source"].items():
                print(f"source.{k}: {val}")
        else:
            CachedDataset(args.dst).verify(progress=True)
            print(f"{args.dst}: all records OK")
    except (CacheError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
