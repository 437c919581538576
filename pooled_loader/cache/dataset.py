"""``CachedDataset``: a finished cache file as a map-style dataset, read through one mmap.

The file is validated once per process when opened (the header's schema, the index arrays'
crc32, every record inside the data area and the file, shapes consistent with sizes), and its
size is checked before each read (a file truncated in place raises instead of a SIGBUS); samples are then read-only numpy views of the file, handed to the
transform without a copy, and ``getitem_into`` lets the transform's last op write straight into
the loader's batch slot. The file is reopened lazily in each process that unpickles the dataset.
"""
from __future__ import annotations

import inspect
import mmap
import os
import zlib
from typing import Any, Callable, NamedTuple

import numpy as np

from ..observability.progress import progress_bar
from ..core.safe_open import open_regular
from .fingerprint import digest, fingerprint_info, variant_for_epoch
from .format import (
    PREAMBLE_SIZE, VAR_KINDS, CacheFormatError, CacheIncompleteError, CacheMismatchError,
    CacheRecordError, infer_layout_from_tree, make_out_leaves, make_unflatten, partial_progress,
    read_header,
)


class _Columns(NamedTuple):
    """A leaf's index arrays, looked up once per open rather than by name on every read."""

    id: int
    kind: str
    value: np.ndarray | None  # scalar leaves
    offset: np.ndarray | None  # variable-size leaves: where each record lies, its size, crc32
    nbytes: np.ndarray | None
    crc: np.ndarray | None
    shape: np.ndarray | None  # array leaves with ndim > 0
    dtype: np.dtype | None


def _columns(lf: dict, arrays: dict) -> _Columns:
    j = lf["id"]
    col = arrays.get
    return _Columns(j, lf["kind"], col(f"leaf{j}.value"), col(f"leaf{j}.offset"),
                    col(f"leaf{j}.nbytes"), col(f"leaf{j}.crc"),
                    col(f"leaf{j}.shape") if lf.get("ndim") else None,
                    np.dtype(lf["dtype"]) if "dtype" in lf else None)


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
        # a FIFO or device at `path` is refused naming it (open() of a FIFO blocks forever)
        with os.fdopen(open_regular(path, what="cache file", follow=True), "rb") as f:
            fsize = os.fstat(f.fileno()).st_size
            hdr = read_header(path, fsize, f.read(PREAMBLE_SIZE), f.fileno())
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count, variants = hdr["count"], hdr["variants"]
        tree, leaves = infer_layout_from_tree(hdr["layout"])
        arrays = {}
        for name, a in hdr["arrays"].items():  # names, dtypes, shapes, bounds: read_header
            dt, shape = np.dtype(a["dtype"]), tuple(a["shape"])
            size = dt.itemsize * int(np.prod(shape))
            if zlib.crc32(memoryview(mm)[a["offset"]:a["offset"] + size]) != a["crc"]:
                raise CacheFormatError(f"{path}: index array {name} is corrupted (crc32 "
                                       "mismatch: a label, size or offset changed); rebuild the "
                                       "cache")
            arrays[name] = np.frombuffer(mm, dt, int(np.prod(shape)), a["offset"]).reshape(shape)
        ds, de = np.uint64(hdr["data_start"]), np.uint64(hdr["data_end"])  # de <= file size
        for lf in leaves:  # every record lies inside the data area and matches its shape
            if lf["kind"] not in VAR_KINDS:
                continue
            j = lf["id"]
            o, n = arrays[f"leaf{j}.offset"], arrays[f"leaf{j}.nbytes"]
            bad = (o < ds) | (o > de) | (n > de - np.minimum(o, de))  # o + n could wrap
            if lf["ndim"]:
                shp = arrays[f"leaf{j}.shape"]
                itemsize = np.dtype(lf["dtype"]).itemsize
                # in float first: an int64 product of huge dimensions could wrap to n
                big = np.prod(shp.astype(np.float64), axis=-1) * itemsize > float(de)
                bad |= (shp < 0).any(axis=-1) | big | (np.prod(shp, axis=-1) * itemsize != n)
            if bad.any():
                i, k = (int(v[0]) for v in np.nonzero(bad))
                raise CacheFormatError(
                    f"{path}: record {i} (variant {k}) of leaf {j} lies outside the data area "
                    f"(bytes {int(ds)}..{int(de)}) or has an inconsistent size (offset "
                    f"{int(o[i, k])}, {int(n[i, k])} bytes); rebuild the cache")
        source_count = hdr.get("source_count", count)
        src = arrays.get("source_index")
        if src is not None and len(src) and (src.min() < 0 or src.max() >= source_count):
            raise CacheFormatError(f"{path}: source_index points outside the source; rebuild")
        self.header, self._tree, self._leaves, self._arrays = hdr, tree, leaves, arrays
        self._unflatten = make_unflatten(tree)
        self._out_leaves = make_out_leaves(tree)
        self._cols = [_columns(lf, arrays) for lf in leaves]
        # the leaves _sample passes through the transform or into out: arrays and tensors
        self._arraylike = [(lf["id"], lf["kind"] == "tensor") for lf in leaves
                           if lf["kind"] in ("array", "tensor")]
        self._image = next((lf["id"] for lf in leaves if lf["kind"] in ("array", "tensor")), None)
        self._count, self._variants = count, variants
        self._mm, self._fsize = mm, fsize
        self._has_records = any(lf["kind"] in VAR_KINDS for lf in leaves)

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        for k in ("_mm", "_arrays", "header", "_tree", "_leaves", "_unflatten", "_out_leaves",
                  "_cols", "_arraylike", "_image", "_count", "_variants", "_fsize",
                  "_has_records"):
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
        count = self._count
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"index {index} out of range for a cache of {count} samples")
        if variant is not None:
            k = variant
        elif self._variants == 1:
            k = 0
        else:
            k = self.variant(index)
        if not 0 <= k < self._variants:
            raise IndexError(f"variant {k} out of range: the cache stores {self._variants}")
        if self._has_records:
            self._check_size()
        return [self._leaf(c, index, k) for c in self._cols]

    def _check_size(self) -> None:
        """Raise before touching a record of a file that shrank since it was opened: reading a
        mapped page past the end of the file would kill the process with SIGBUS."""
        size = self._mm.size()  # an fstat of the mapped file
        if size < self._fsize:
            raise CacheFormatError(
                f"{self.path}: the file shrank from {self._fsize} to {size} bytes while in use "
                "(truncated or rewritten in place); replace a cache with a new file (build_cache "
                "does), never in place, and open it again")

    def _leaf(self, c: _Columns, i: int, k: int) -> Any:
        kind = c.kind
        if c.offset is None:  # a scalar (or none) leaf
            if kind == "none":
                return None
            v = c.value[i, k]
            return v if kind == "npscalar" else v.item()
        off, n = int(c.offset[i, k]), int(c.nbytes[i, k])
        if self.check_crc and zlib.crc32(memoryview(self._mm)[off:off + n]) != c.crc[i, k]:
            raise CacheRecordError(f"{self.path}: record {i} (variant {k}) of leaf {c.id} is "
                                   "corrupted (crc32 mismatch); rebuild the cache")
        if kind == "str":
            return bytes(self._mm[off:off + n]).decode("utf-8")
        if kind == "bytes":
            return bytes(self._mm[off:off + n])
        # a read-only view (shape and size were checked against each other at open); tensors
        # come back as arrays for the transform and _sample converts them
        return np.ndarray(c.shape[i, k].tolist() if c.shape is not None else (), c.dtype,
                          self._mm, off)

    def __getitem__(self, index: int) -> Any:
        return self._sample(index, None)

    def getitem_into(self, index: int, out: Any) -> Any:
        """Like ``dataset[index]``, writing the image's transform output into ``out``'s leaf."""
        self._ensure_open()
        return self._sample(index, self._out_leaves(out))

    def _sample(self, index: int, outs: list | None) -> Any:
        values = self._values(index)
        for j, tensor in self._arraylike:
            o = outs[j] if outs is not None else None
            v = values[j]
            if j == self._image and self.transform is not None:
                v = self.transform(v, out=o) if (self._takes_out and o is not None) \
                    else self.transform(v)
            elif o is not None and o.shape == v.shape and o.dtype == v.dtype:
                np.copyto(o, v)
                v = o
            if tensor and isinstance(v, np.ndarray):
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
        if digest(info) == src["fingerprint"]:
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
        count, variants = self.header["count"], self.header["variants"]
        mv = memoryview(self._mm)
        for i in progress_bar(range(count), disable=not progress, desc="verify", unit="sample"):
            self._check_size()
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
