"""What identifies a cache's source, and the seeds its records are made with.

Two identities, kept apart on purpose: ``fingerprint_info`` names the source as a whole (class,
length, transforms, the file list's sizes and mtimes; its digest is checked on every open and
resume), while ``sample_identity`` names one sample's source file and label, so that a resume
can accept a source in which only samples without a finished record changed.

Seeds: record ``(index, k)`` is produced with ``random``, ``numpy.random`` and ``torch`` seeded
from ``SeedSequence([seed, index, k])`` (``seed_everything``), and epoch ``e`` reads the variant
``variant_for_epoch(seed, e, index, variants)``.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
from typing import Any, Sequence

import numpy as np

from ..core.file_index import FileIndex
from ..core.seeds import splitmix64

def _stable_repr(obj: Any) -> str:
    """``repr`` without memory addresses, so it is the same in every process and run."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))


# Modules moved into sub-packages (issues 41, 46) that hold a map-style dataset a cache can be built
# from: the fingerprint keeps the released class path, so caches built before the move still fit.
_RELEASED_MODULE = {"pooled_loader.ragged.tokens": "pooled_loader.tokens",
                    "pooled_loader.vision.detection.coco": "pooled_loader.vision.coco",
                    "pooled_loader.vision.detection.voc": "pooled_loader.vision.voc"}


def fingerprint_info(dataset: Any) -> dict:
    """What identifies ``dataset``'s output: class, length, transforms and source files.

    A dataset may define ``cache_fingerprint() -> str`` to replace the file-list part.
    """
    cls = type(dataset)
    module = _RELEASED_MODULE.get(cls.__module__, cls.__module__)
    info = {"class": f"{module}.{cls.__qualname__}", "len": len(dataset),
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
    return digest(fingerprint_info(dataset))


def digest(info: dict) -> str:
    return hashlib.sha256(json.dumps(info, sort_keys=True).encode()).hexdigest()


def variant_for_epoch(seed: int, epoch: int, index: int, variants: int) -> int:
    """Variant read at ``epoch`` for ``index``: ``(epoch + splitmix64(seed*2**32+index)) % K``."""
    if variants == 1:
        return 0
    return (epoch + splitmix64((seed << 32) + index)) % variants


def seed_everything(seed: int, index: int, k: int) -> None:
    s = np.random.SeedSequence([seed, index, k]).generate_state(4)
    random.seed(int(s[0]))
    np.random.seed(s[1])
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed((int(s[2]) << 32) | int(s[3]))


class SavedRng:
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


def sample_file(ds: Any, i: int) -> str | None:
    """Path of sample ``i``'s source file, when the dataset has a ``samples`` list."""
    try:
        s = ds.samples[i]
    except Exception:  # noqa: BLE001 - no file list: the sample is named by its index only
        return None
    p = s[0] if isinstance(s, (tuple, list)) else s
    return os.fspath(p) if isinstance(p, (str, os.PathLike)) else None


def source_root(ds: Any) -> str | None:
    """Root that source paths are taken relative to (movable data); None without a file list."""
    samples = getattr(ds, "samples", None)  # a list, or a lazy sequence (vision.ImageFolder)
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)) \
            or not len(samples) or sample_file(ds, 0) is None:
        return None
    root = getattr(ds, "root", None)
    if isinstance(root, (str, os.PathLike)):
        return os.path.abspath(root)
    paths = [os.path.abspath(p) for p in (sample_file(ds, i) for i in range(len(samples))) if p]
    return os.path.commonpath(paths)


def sample_identity(ds: Any, i: int, root: str | None) -> int:
    """Nonzero u64 naming sample ``i``'s source as it is now: its file (path under ``root``, size,
    mtime) and the rest of its ``samples`` entry (the label); 0 when it has no file."""
    p = sample_file(ds, i) if root is not None else None
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
