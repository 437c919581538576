"""The file list of an image folder: one listing, kept in a few numpy buffers.

One listing. ``list_image_folder`` is the only place that turns ``root/<class>/**/<image>`` into
classes and labels; ``vision.ImageFolder``, ``shards write`` and the cache fingerprint all use it,
so one folder gets the same class indices everywhere. Its order is torchvision's: class folders
sorted by name (hidden ones included, symlinks followed), files sorted within each walked
directory, directories in sorted path order. A Jupyter ``.ipynb_checkpoints/`` next to the class
folders is therefore class 0 and shifts every label, as in torchvision; the listing warns about it
and ``include_hidden=False`` leaves hidden folders and files out. Whether two sources (folder,
cache, shards) number their classes alike is pooled_loader.vision.class_check's question.

No object per file. Forked workers that look samples up in a list of ``(path, label)`` tuples
touch every tuple's reference count, so each worker ends up with a private copy of the pages
holding them (copy-on-read, pytorch/pytorch#13246): about 150 bytes per file per worker. Here the
paths (relative to the root, file-system encoded) are one bytes buffer plus an offsets array and
the labels one int64 array: a lookup reads the buffers and creates its strings fresh, so the
pages stay shared. torchvision's ``samples``/``imgs``/``targets`` are lazy sequences over it.
"""
from __future__ import annotations

import fnmatch
import operator
import os
import warnings
from collections.abc import Sequence
from typing import Any, Iterable, Iterator

import numpy as np

__all__ = ["IMG_EXTENSIONS", "FileIndex", "list_image_folder", "SampleList", "TargetList",
           "is_hidden"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class FileIndex:
    """``(path, label)`` of every sample, in three arrays; ``classes`` names the labels.

    ``blob[offsets[i]:offsets[i + 1]]`` is sample ``i``'s path relative to ``root`` (an absolute
    path is stored as it is), ``labels[i]`` its class index.
    """

    __slots__ = ("root", "classes", "blob", "offsets", "labels", "_prefix")

    def __init__(self, root: str, classes: Sequence[str], blob: np.ndarray, offsets: np.ndarray,
                 labels: np.ndarray) -> None:
        if len(offsets) != len(labels) + 1:
            raise ValueError(f"{len(labels)} labels need {len(labels) + 1} offsets, "
                             f"got {len(offsets)}")
        self.root = os.fspath(root)
        self._prefix = os.path.join(self.root, "")  # root + "/" (unless empty): path() joins to it
        self.classes = list(classes)
        self.blob, self.offsets, self.labels = blob, offsets, labels
        for a in (blob, offsets, labels):
            a.flags.writeable = False

    @classmethod
    def from_samples(cls, root: str, samples: Iterable[tuple[Any, int]],
                     classes: Sequence[str]) -> "FileIndex":
        """Index of ``(path, label)`` pairs; paths under ``root`` are stored relative to it."""
        root = os.fspath(root)
        prefix = os.path.join(root, "")
        rels, labels = [], []
        for path, label in samples:
            path = os.fspath(path)
            rels.append(os.fsencode(path[len(prefix):] if path.startswith(prefix) else path))
            labels.append(operator.index(label))
        return cls(root, classes, *_pack(rels), np.array(labels, np.int64))

    def __len__(self) -> int:
        return len(self.labels)

    def _position(self, index: Any) -> int:
        i = operator.index(index)
        n = len(self.labels)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        return i

    def relpath(self, index: int) -> str:
        """Sample ``index``'s path relative to the root."""
        return self._rel(self._position(index))

    def _rel(self, i: int) -> str:
        return os.fsdecode(self.blob[self.offsets[i]:self.offsets[i + 1]].tobytes())

    def _join(self, rel: str) -> str:
        # posixpath.join(root, rel) without its per-call checks: an absolute rel stands alone
        return rel if rel.startswith(os.sep) else self._prefix + rel

    def path(self, index: int) -> str:
        """Sample ``index``'s path (the root joined with the stored one)."""
        return self._join(self.relpath(index))

    def label(self, index: int) -> int:
        return int(self.labels[self._position(index)])

    def __getitem__(self, index: int) -> tuple[str, int]:
        i = self._position(index)
        return self._join(self._rel(i)), int(self.labels[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for i in range(len(self)):
            yield self[i]

    def nbytes(self) -> int:
        return self.blob.nbytes + self.offsets.nbytes + self.labels.nbytes

    def __repr__(self) -> str:
        return (f"FileIndex(root={self.root!r}, {len(self)} files, {len(self.classes)} classes, "
                f"{self.nbytes() / 2**20:.1f} MiB)")


def _pack(items: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(b) for b in items], out=offsets[1:])
    return np.frombuffer(b"".join(items), np.uint8), offsets


def is_hidden(name: str) -> bool:
    """A hidden file or folder name (starts with ``.``), as the listing treats it."""
    return name.startswith(".")


def _walk(top: str, include_hidden: bool) -> list[tuple[str, list[str]]]:
    """``(dirpath, filenames)`` under ``top`` following symlinks (each directory once, so a
    symlink loop ends), in sorted path order as torchvision's ``sorted(os.walk(...))``."""
    seen: set[tuple[int, int]] = set()
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        if not include_hidden:
            dirnames[:] = [d for d in dirnames if not is_hidden(d)]
            filenames = [f for f in filenames if not is_hidden(f)]
        out.append((dirpath, filenames))
    out.sort(key=lambda e: e[0])
    return out


def list_image_folder(root: str | os.PathLike, *, include_hidden: bool | None = None,
                      exclude: Sequence[str] = (), extensions: Sequence[str] = IMG_EXTENSIONS,
                      allow_empty: bool = False) -> FileIndex:
    """Classes and ``(path, label)`` of every image under ``root/<class>/``, torchvision's way.

    Args:
        include_hidden: ``None`` (default) lists hidden folders and files (names starting with
            ``.``) as torchvision does, and warns when there are any; ``True`` does the same
            silently; ``False`` leaves them out (e.g. ``.ipynb_checkpoints/``, macOS ``._*``).
        exclude: glob patterns of class folder names to leave out (e.g. ``["unused*"]``).
        extensions: file name endings (compared in lower case) that count as images.
        allow_empty: accept class folders without images (otherwise FileNotFoundError).
    """
    root = os.fspath(root)
    exts = tuple(e.lower() for e in extensions)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        raise FileNotFoundError(f"{root}: no such image folder") from None
    classes = [e.name for e in entries if e.is_dir()
               and not any(fnmatch.fnmatchcase(e.name, p) for p in exclude)]
    if include_hidden is False:
        classes = [c for c in classes if not is_hidden(c)]
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    rels: list[bytes] = []
    labels: list[int] = []
    empty, hidden_files = [], []
    prefix = os.path.join(root, "")
    for label, name in enumerate(classes):
        n0 = len(rels)
        for dirpath, filenames in _walk(os.path.join(root, name), include_hidden is not False):
            rel_dir = os.path.join(dirpath[len(prefix):], "")
            images = [f for f in sorted(filenames) if f.lower().endswith(exts)]
            rels.extend(os.fsencode(rel_dir + f) for f in images)
            if include_hidden is None and not is_hidden(name):
                in_hidden_dir = any(is_hidden(part) for part in rel_dir.split(os.sep))
                hidden_files += [rel_dir + f for f in images if in_hidden_dir or is_hidden(f)]
        labels.extend([label] * (len(rels) - n0))
        if len(rels) == n0:
            empty.append(name)
    if empty and not allow_empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)} in "
                                f"{root}. Supported extensions are: {', '.join(exts)} "
                                "(allow_empty=True accepts empty classes)")
    hidden_classes = [c for c in classes if is_hidden(c)]
    if include_hidden is None and (hidden_classes or hidden_files):
        what = []
        if hidden_classes:
            what.append(f"the hidden folder(s) {', '.join(hidden_classes)} are classes "
                        f"{', '.join(str(classes.index(c)) for c in hidden_classes)}, which "
                        "shifts the labels of the classes after them")
        if hidden_files:
            what.append(f"{len(hidden_files)} hidden image file(s) are samples (first: "
                        f"{hidden_files[0]})")
        warnings.warn(f"{root}: {' and '.join(what)}, as in torchvision's ImageFolder; pass "
                      "include_hidden=False to leave hidden folders and files out, or "
                      "include_hidden=True to keep them without this warning", UserWarning,
                      stacklevel=2)
    return FileIndex(root, classes, *_pack(rels), np.array(labels, np.int64))


class _IndexView(Sequence):
    """A read-only sequence computed from a FileIndex on access (nothing stored per item)."""

    __slots__ = ("_index",)

    def __init__(self, index: FileIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._item(j) for j in range(*i.indices(len(self)))]
        return self._item(self._index._position(i))

    def _item(self, i: int) -> Any:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(repr(x) for x in self[:3])
        return f"{type(self).__name__}([{head}{', ...' if n > 3 else ''}], {n} items)"


class SampleList(_IndexView):
    """torchvision's ``samples``/``imgs``: ``(path, class index)`` per file, made on access."""

    __slots__ = ()

    def _item(self, i: int) -> tuple[str, int]:
        return self._index[i]


class TargetList(_IndexView):
    """torchvision's ``targets``: the class index (int) per file; ``np.asarray`` is fast."""

    __slots__ = ()

    def _item(self, i: int) -> int:
        return int(self._index.labels[i])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(self._index.labels, dtype=dtype)
