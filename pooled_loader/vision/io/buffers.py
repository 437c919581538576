"""Reusable scratch buffers: grown on demand, never shrunk, counted.

The one scheme for every temporary of the vision ops: a :class:`Scratch` owned by whoever runs
the ops one at a time (a ``Compose``, an ``ImageFolder`` in its process), or, for the stateless
functions (``kernels.crop_resize_flip_chw_opencv``, ``kernels.resize_hwc``), the calling thread's
own one from :func:`thread_scratch`. Buffers are named, so a name's buffer serves every shape
and grows to the largest seen.
"""
from __future__ import annotations

import math
import os
import threading

import numpy as np

from pooled_loader.core.safe_open import open_regular_stat


class Scratch:
    """Named flat byte buffers handed out as typed views.

    ``array(key, shape, dtype)`` returns a view of the buffer named ``key``, allocating (1.5x
    headroom) only when the request is larger than what the buffer already holds. In steady state
    nothing is allocated; ``allocations`` counts the real allocations so tests can check that.
    """

    def __init__(self) -> None:
        self._bufs: dict[object, np.ndarray] = {}
        self.allocations = 0

    def flat(self, key: object, nbytes: int) -> np.ndarray:
        """A writable 1-D uint8 array of exactly ``nbytes`` (a view of the reused buffer)."""
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            grow = 0 if buf is None else buf.nbytes + buf.nbytes // 2
            buf = np.empty(max(nbytes, grow), np.uint8)
            self._bufs[key] = buf
            self.allocations += 1
        return buf[:nbytes]

    def reserve(self, key: object, nbytes: int) -> None:
        """Make the buffer named ``key`` hold at least ``nbytes`` (exactly that if it grows)."""
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < nbytes:
            self._bufs[key] = np.empty(nbytes, np.uint8)
            self.allocations += 1

    def array(self, key: object, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` in the buffer named ``key``."""
        dtype = np.dtype(dtype)
        return self.flat(key, math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.nbytes for b in self._bufs.values())


_local = threading.local()


def thread_scratch() -> Scratch:
    """The calling thread's own :class:`Scratch` (for functions that keep no state of their own;
    threads never share it, so concurrent calls cannot overwrite each other's temporaries)."""
    scratch = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = Scratch()
    return scratch


MAX_FILE_BYTES = 1 << 30  # bytes: an image file larger than this is refused (1 GiB)


def read_file(path: str, scratch: Scratch, limit: int = MAX_FILE_BYTES) -> np.ndarray:
    """The bytes of the regular file ``path`` in ``scratch``'s buffer "file" (reused: valid
    until the next read). A FIFO, device or folder is refused (opened non-blocking, so a FIFO
    cannot hang the worker), and so is a file over ``limit`` bytes: OSError naming it."""
    # one open per sample, no file object; links are followed, as torchvision's folders do
    fd, st = open_regular_stat(path, max_bytes=limit, what="image file", follow=True)
    try:
        buf = scratch.flat("file", st.st_size)
        got = 0
        while got < st.st_size:
            k = os.readv(fd, [buf[got:]])
            if not k:
                break
            got += k
    finally:
        os.close(fd)
    return buf[:got]
