"""ImageFolder: torchvision's class-per-folder dataset, reading encoded bytes for the pipeline."""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from pooled_loader.errors import SampleError
from pooled_loader.vision.buffers import Scratch
from pooled_loader.vision.compose import Compose
from pooled_loader.vision.ops import Op

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
ON_ERROR = ("raise", "skip")


def find_classes(root: str) -> tuple[list[str], dict[str, int]]:
    """Sorted class folder names under ``root`` and their indices (torchvision's order)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    return classes, {c: i for i, c in enumerate(classes)}


def make_samples(root: str, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """(path, class index) for every image file, classes in index order, files sorted."""
    samples = []
    empty = []
    for cls in sorted(class_to_idx, key=class_to_idx.__getitem__):
        n0 = len(samples)
        for dirpath, _, fnames in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, fname), class_to_idx[cls]))
        if len(samples) == n0:
            empty.append(cls)
    if empty:
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. "
                                f"Supported extensions are: {', '.join(IMG_EXTENSIONS)}")
    return samples


class ImageFolder:
    """``root/<class>/**/<image>`` -> ``(transform(encoded bytes), class index)``.

    Classes, ``class_to_idx`` and ``samples`` follow torchvision's ImageFolder. The item is the
    file's encoded bytes (uint8 array) passed through ``transform``, so decoding happens in the
    pipeline (see :class:`DecodeImage`). A file that cannot be read or decoded raises
    :class:`~pooled_loader.errors.SampleError` naming the file and the reason. ``on_error``
    ("raise" or "skip") is kept for the loader: skipping is the loader's job (PooledLoader's
    ``on_error``); the dataset always raises.

    Under PooledLoader, ``getitem_into`` reads the file into a reused buffer and has the transform
    write the image straight into the batch slot.
    """

    def __init__(self, root: str, transform: Callable[..., Any] | None = None,
                 on_error: str = "raise") -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.root = os.fspath(root)
        self.transform = transform
        self.on_error = on_error
        self.classes, self.class_to_idx = find_classes(self.root)
        self.samples = make_samples(self.root, self.class_to_idx)
        self.targets = [t for _, t in self.samples]
        self.imgs = self.samples
        self._pid = os.getpid()
        self._scratch = Scratch()

    def __len__(self) -> int:
        return len(self.samples)

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
        with open(path, "rb", buffering=0) as f:
            n = os.fstat(f.fileno()).st_size
            buf = self._scratch.flat("file", n)
            view, got = memoryview(buf), 0
            while got < n:
                k = f.readinto(view[got:])
                if not k:
                    break
                got += k
        return buf[:got]

    def _load(self, index: int, out: np.ndarray | None) -> tuple[Any, int]:
        path, label = self.samples[index]
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
