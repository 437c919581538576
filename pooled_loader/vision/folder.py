"""ImageFolder: torchvision's class-per-folder dataset, reading encoded bytes for the pipeline."""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from pooled_loader.vision.class_check import check_classes
from pooled_loader.core.errors import SampleError
from pooled_loader.core.file_index import (IMG_EXTENSIONS, FileIndex, SampleList, TargetList,
                                      list_image_folder)
from pooled_loader.vision.io.buffers import Scratch, read_file
from pooled_loader.vision.compose import Compose
from pooled_loader.vision.base import Op

__all__ = ["ImageFolder", "IMG_EXTENSIONS", "FileIndex", "list_image_folder"]

ON_ERROR = ("raise", "skip")


class ImageFolder:
    """``root/<class>/**/<image>`` -> ``(transform(encoded bytes), class index)``.

    Classes, ``class_to_idx``, ``samples``/``imgs`` and ``targets`` follow torchvision's
    ImageFolder (listing: ``pooled_loader.core.file_index.list_image_folder``; ``include_hidden`` and
    ``allow_empty`` are passed to it). The file list is kept in numpy buffers (``file_index``),
    so forked workers do not copy it; ``samples``/``imgs``/``targets`` are lazy read-only
    sequences over it, and assigning a list to ``samples`` or ``targets`` replaces it. The item is the
    file's encoded bytes (uint8 array) passed through ``transform``, so decoding happens in the
    pipeline (see :class:`DecodeImage`). A file that cannot be read or decoded raises
    :class:`~pooled_loader.errors.SampleError` naming the file and the reason. ``on_error``
    ("raise" or "skip") is kept for the loader: skipping is the loader's job (PooledLoader's
    ``on_error``); the dataset always raises.

    Under PooledLoader, ``getitem_into`` reads the file into a reused buffer and has the transform
    write the image straight into the batch slot.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable[..., Any] | None = None,
                 on_error: str = "raise", *, include_hidden: bool | None = None,
                 allow_empty: bool = False) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.root = os.fspath(root)
        self.transform = transform
        self.on_error = on_error
        self.file_index = list_image_folder(self.root, include_hidden=include_hidden,
                                            allow_empty=allow_empty)
        self.classes = list(self.file_index.classes)
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self._pid = os.getpid()
        self._scratch = Scratch()

    @property
    def samples(self) -> SampleList:
        """``(path, class index)`` per file (a lazy sequence; assign a list to replace it)."""
        return SampleList(self.file_index)

    @samples.setter
    def samples(self, samples: Any) -> None:
        self.file_index = FileIndex.from_samples(self.root, samples, self.classes)

    imgs = samples

    @property
    def targets(self) -> TargetList:
        """Class index per file (a lazy sequence; ``np.asarray(ds.targets)`` is one copy)."""
        return TargetList(self.file_index)

    @targets.setter
    def targets(self, targets: Any) -> None:
        labels = np.array([int(t) for t in targets], np.int64)
        if len(labels) != len(self.file_index):
            raise ValueError(f"targets needs {len(self.file_index)} labels, got {len(labels)}")
        ix = self.file_index
        self.file_index = FileIndex(ix.root, ix.classes, ix.blob, ix.offsets, labels)

    def check_classes(self, other: Any) -> None:
        """Raise ClassMismatchError unless ``other`` (shards written by ``shards write``, a
        ``CachedDataset`` or its path, a WebDataset, another ImageFolder or a list of names)
        numbers the classes as this folder does."""
        check_classes(self.classes, other, f"ImageFolder({self.root!r})")

    def __len__(self) -> int:
        return len(self.file_index)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_scratch"], state["_pid"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pid, self._scratch = os.getpid(), Scratch()

    def _read(self, path: str) -> np.ndarray:
        """The file's bytes in the reused read buffer."""
        if os.getpid() != self._pid:
            self._pid, self._scratch = os.getpid(), Scratch()
        return read_file(path, self._scratch)

    def _load(self, index: int, out: np.ndarray | None) -> tuple[Any, int]:
        path, label = self.file_index[index]
        try:
            if out is None:
                data = np.fromfile(path, np.uint8)  # a caller may keep it: not a reused buffer
            else:
                data = self._read(path)
            if self.transform is None:
                return (data if out is None else data.copy()), label
            if isinstance(self.transform, (Compose, Op)):
                return self.transform(data, out=out), label
            return self.transform(data), label
        except SampleError as e:
            raise SampleError(f"{path}: {e}") from e
        except Exception as e:  # any other failure on this file: name the file and the reason
            raise SampleError(f"{path}: {type(e).__name__}: {e}") from e

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return self._load(index, None)

    def getitem_into(self, index: int, out: Any) -> tuple[Any, int]:
        """Zero-copy protocol (CONTRACTS.md): write the image into ``out[0]`` when it fits."""
        dst = out[0] if isinstance(out, (tuple, list)) and len(out) == 2 else None
        return self._load(index, dst if isinstance(dst, np.ndarray) else None)

    def __repr__(self) -> str:
        return (f"ImageFolder(root={self.root!r}, {len(self)} samples, "
                f"{len(self.classes)} classes, transform={self.transform!r})")
