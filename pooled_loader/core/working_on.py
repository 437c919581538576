"""What a worker is working on, published where its main process can read it even when the worker
is stuck: the sample index and the file or URL being read (`engine.watchdog`).

A worker with a watchdog points `BOARD` at its record (a page of shared memory); everything else
finds None and does nothing. Readers call `reading(name)` as they open a file or a URL, so a hang
in a read (a stale NFS mount, a server that stops answering) is named by the file, not only by the
index. The record is written before the work starts, so it holds even where no signal can reach
the worker (a process in uninterruptible sleep).
"""
from __future__ import annotations

import struct
from typing import Any

__all__ = ["BOARD", "Board", "sample", "item", "idle", "reading", "RECORD_BYTES"]

RECORD_BYTES = 4096  # one page: the record; a worker's stack dumps follow it in the same file
_INDEX_AT, _INDEX_TEXT_MAX = 16, 480  # kind:u32, pad, value:i64, then len:u16 and the text
_READING_AT, _READING_MAX = 512, 3500
_KIND_NONE, _KIND_INT, _KIND_TEXT, _KIND_ITEM = 0, 1, 2, 3


class Board:
    """A worker's record: the index (an int, the repr of another index, or an iterable stream's
    item count) and the name being read. `view` is a writable buffer of RECORD_BYTES bytes."""

    def __init__(self, view: Any) -> None:
        self.view = view

    def sample(self, index: Any) -> None:
        view = self.view
        if type(index) is int and -(1 << 63) <= index < (1 << 63):
            struct.pack_into("<I4xq", view, 0, _KIND_INT, index)
        else:
            text = repr(index).encode("utf-8", "replace")[:_INDEX_TEXT_MAX]
            struct.pack_into("<H", view, _INDEX_AT, len(text))
            view[_INDEX_AT + 2:_INDEX_AT + 2 + len(text)] = text
            struct.pack_into("<I4xq", view, 0, _KIND_TEXT, 0)
        struct.pack_into("<H", view, _READING_AT, 0)  # nothing read for this sample yet

    def idle(self) -> None:
        struct.pack_into("<I4xq", self.view, 0, _KIND_NONE, 0)
        struct.pack_into("<H", self.view, _READING_AT, 0)

    def item(self, count: int) -> None:
        struct.pack_into("<I4xq", self.view, 0, _KIND_ITEM, count)

    def reading(self, name: str) -> None:
        text = name.encode("utf-8", "replace")[:_READING_MAX]
        self.view[_READING_AT + 2:_READING_AT + 2 + len(text)] = text
        struct.pack_into("<H", self.view, _READING_AT, len(text))

    def read(self) -> tuple[str | None, str | None]:
        """(what the worker was loading, the file or URL it was reading), as text; None where
        nothing is recorded."""
        view = self.view
        kind, value = struct.unpack_from("<I4xq", view, 0)
        where = None
        if kind == _KIND_INT:
            where = f"sample index {value}"
        elif kind == _KIND_TEXT:
            (n,) = struct.unpack_from("<H", view, _INDEX_AT)
            n = min(n, _INDEX_TEXT_MAX)
            text = bytes(view[_INDEX_AT + 2:_INDEX_AT + 2 + n]).decode("utf-8", "replace")
            where = f"sample index {text}"
        elif kind == _KIND_ITEM:
            where = f"item {value} of its stream"
        (n,) = struct.unpack_from("<H", view, _READING_AT)
        n = min(n, _READING_MAX)
        name = bytes(view[_READING_AT + 2:_READING_AT + 2 + n]).decode("utf-8", "replace")
        return where, name or None


BOARD: Board | None = None  # this worker's record, when its loader runs a watchdog


def sample(index: Any) -> None:
    """This worker starts loading sample `index`."""
    if BOARD is not None:
        BOARD.sample(index)


def idle() -> None:
    """This worker finished its batch (it is on nothing until the next one)."""
    if BOARD is not None:
        BOARD.idle()


def item(count: int) -> None:
    """This worker takes item `count` (from 0) of its iterable stream."""
    if BOARD is not None:
        BOARD.item(count)


def reading(name: Any) -> None:
    """This worker opens the file or URL `name` (a reader's call, before the read)."""
    if BOARD is not None:
        BOARD.reading(str(name))
