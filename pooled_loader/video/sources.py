"""Where a dataset's videos are: a class-per-folder tree, a list of files, or WebDataset shards.

Every source is a table of videos kept in numpy arrays (forked workers share it, nothing per
video is a Python object) with a label each, and opens video ``i`` as a file object that
FFmpeg reads and seeks: a file opened through ``core.safe_open`` (no links to devices, FIFOs or
``/dev/zero``), or a tar member's byte range inside its shard (:class:`MemberFile`), so that a
clip reads only the bytes its frames need, never the whole member.

- a folder: ``root/<class>/**/<video>``, classes numbered as torchvision's ``ImageFolder`` numbers
  them (``core.file_index.list_image_folder`` with the video extensions);
- a list of paths, or of ``(path, label)`` pairs (label -1 where none is given);
- local, uncompressed WebDataset shards (a list, a ``.tar`` path or a brace pattern): each
  sample's ``.mp4``/``.webm``/... member, its label from ``.cls``. The shards' headers are read
  once, here, by the bounded tar parser (``shards.tar``).
"""
from __future__ import annotations

import io
import os
from typing import Any, Sequence

import numpy as np

from pooled_loader.core.errors import SampleError
from pooled_loader.core.file_index import FileIndex, list_image_folder
from pooled_loader.core.safe_open import open_regular

__all__ = ["VIDEO_EXTENSIONS", "VideoTable", "MemberFile", "video_table"]

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".webm", ".mkv", ".avi")
MAX_LABEL_BYTES = 64  # a .cls member: a decimal class index


class MemberFile(io.RawIOBase):
    """Bytes ``[start, start + size)`` of the open file ``fd`` as a seekable read-only file
    (a tar member). Reads past the member's end return nothing, as at a file's end."""

    def __init__(self, fd: int, start: int, size: int) -> None:
        super().__init__()
        self._fd, self._start, self._size, self._pos = fd, start, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        if n == 0:
            return 0
        data = os.pread(self._fd, n, self._start + self._pos)
        view[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the member's start")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


class VideoTable:
    """``n`` videos: ``label(i)``, ``name(i)`` (for errors: a path, or ``shard:key``) and
    ``open(i)`` (a binary file object, to be closed by the caller)."""

    def __init__(self, *, names: list[str], labels: np.ndarray, classes: list[str],
                 shard: np.ndarray | None = None, start: np.ndarray | None = None,
                 size: np.ndarray | None = None, shards: list[str] | None = None,
                 index: FileIndex | None = None) -> None:
        self._index = index  # a folder's listing (paths packed in one buffer)
        self._names = None if index is not None else np.array(names, dtype=object)
        self.labels = np.asarray(labels, np.int64)
        self.classes = classes
        self._shard, self._start, self._size, self.shards = shard, start, size, shards

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, i: int) -> int:
        return int(self.labels[i])

    def name(self, i: int) -> str:
        if self._index is not None:
            return self._index[i][0]
        if self._shard is not None:
            return f"{self.shards[int(self._shard[i])]}:{self._names[i]}"
        return str(self._names[i])

    def open(self, i: int) -> Any:
        if self._shard is None:
            fd = open_regular(self.name(i), follow=True, what="video")
            return os.fdopen(fd, "rb")
        fd = open_regular(self.shards[int(self._shard[i])], follow=True, what="shard")
        return MemberFile(fd, int(self._start[i]), int(self._size[i]))


def _from_folder(root: str) -> VideoTable:
    index = list_image_folder(root, extensions=VIDEO_EXTENSIONS)
    return VideoTable(names=[], labels=np.asarray(index.labels), classes=list(index.classes),
                      index=index)


def _from_paths(items: Sequence[Any]) -> VideoTable:
    names, labels = [], []
    for item in items:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            names.append(os.fspath(item[0]))
            labels.append(int(item[1]))
        else:
            names.append(os.fspath(item))
            labels.append(-1)
    return VideoTable(names=names, labels=np.asarray(labels, np.int64), classes=[])


def _label(data: bytes, where: str) -> int:
    text = data.strip()
    if len(data) > MAX_LABEL_BYTES or not text.lstrip(b"-").isdigit():
        raise SampleError(f"{where}: .cls is not a class index ({data[:40]!r})")
    return int(text)


def _from_shards(urls: Any) -> VideoTable:
    from pooled_loader.shards.samples import expand_shards, is_local_tar, _open_tar
    from pooled_loader.shards.tar import TarReader
    from pooled_loader.shards.urls import base_plus_ext
    shards = expand_shards(urls)
    keys, labels, shard, start, size = [], [], [], [], []
    for j, url in enumerate(shards):
        if not is_local_tar(url):
            raise ValueError(f"{url}: VideoClips reads local, uncompressed .tar shards (a clip "
                             "seeks inside its member; copy remote shards to local disk first)")
        current: dict = {}

        def close_sample() -> None:
            if not current:
                return
            where = f"{url}:{current['key']}"
            if "video" not in current:
                raise SampleError(f"{where}: no video member (one of {VIDEO_EXTENSIONS})")
            keys.append(current["key"])
            labels.append(current.get("label", -1))
            shard.append(j)
            start.append(current["video"][0])
            size.append(current["video"][1])
            current.clear()

        with _open_tar(url) as f:
            reader = TarReader(f, url)
            for m in reader:
                if not m.isreg():
                    continue
                key, ext = base_plus_ext(m.name)
                if key is None:
                    continue
                if current and key != current["key"]:
                    close_sample()
                current["key"] = key
                ext = "." + ext.lower()
                if ext in VIDEO_EXTENSIONS:
                    if "video" in current:
                        raise SampleError(f"{url}:{key}: two video members")
                    current["video"] = (m.data_offset, m.size)
                elif ext == ".cls":
                    if m.size > MAX_LABEL_BYTES:
                        raise SampleError(f"{url}:{key}: a .cls of {m.size} bytes")
                    current["label"] = _label(reader.read(m), f"{url}:{key}")
            close_sample()
    return VideoTable(names=keys, labels=np.asarray(labels, np.int64), classes=[],
                      shard=np.asarray(shard, np.int64), start=np.asarray(start, np.int64),
                      size=np.asarray(size, np.int64), shards=shards)


def _is_shards(source: Any) -> bool:
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        return text.endswith(".tar") or ("{" in text and ".tar" in text)
    return (isinstance(source, (list, tuple)) and len(source) > 0
            and all(isinstance(s, (str, os.PathLike)) and os.fspath(s).endswith(".tar")
                    for s in source))


def video_table(source: Any) -> VideoTable:
    """The table of ``source``: a folder of class folders, WebDataset shards, or a list of
    paths / ``(path, label)`` pairs."""
    if _is_shards(source):
        return _from_shards(source)
    if isinstance(source, (str, os.PathLike)):
        root = os.fspath(source)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: not a folder of class folders (nor .tar shards)")
        return _from_folder(root)
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("VideoClips: the list of videos is empty")
        return _from_paths(source)
    raise TypeError(f"VideoClips: source must be a folder, .tar shards or a list of paths, got "
                    f"{type(source).__name__}")
