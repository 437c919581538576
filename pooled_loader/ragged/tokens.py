"""Token data: a flat binary file of token ids plus an index of document boundaries, memory-mapped.

Files (``PATH.bin`` and ``PATH.idx``, as nanoGPT's and Megatron's pipelines keep tokens)::

    PATH.bin   the token ids of every document, back to back: num_tokens values of `dtype`,
               no header (np.memmap(PATH.bin, dtype) reads it as nanoGPT does)
    PATH.idx   offset  size  field
               0       8     magic b"PLTOKIDX"
               8       4     version (little-endian uint32, 1)
               12      4     dtype, numpy str padded with NULs: b"<u2", b"<u4", b"<i4" or b"<i8"
               16      8     num_tokens (little-endian uint64)
               24      8     num_docs (little-endian uint64)
               32      8 * (num_docs + 1)   document start offsets in tokens (uint64), from 0
                                            to num_tokens, never decreasing

Both files are untrusted when read: each must be a regular file (a FIFO or device in its place
is refused, not waited on), sizes are checked against the header before anything is read,
offsets are checked (as uint64: no wrap-round), and every error names the file and says what to
do. Writers write under temporary names and rename the index last, so a half-written pair never
reads as whole.

`TokenDataset` yields fixed-length windows (pre-training) or whole documents (fine-tuning, with
`pooled_loader.collate.packed()`/`pad()` and `pooled_loader.samplers`), each read with one
``pread`` (into the loader's batch slot when it can: a file cut short while read is an error,
never a SIGBUS). It is map-style, so a PooledLoader resumes it exactly. Write files with
`write_tokens` (numpy arrays) or ``python -m pooled_loader tokens write OUT --from DIR
--tokenizer module:function``.
"""
from __future__ import annotations

import argparse
import importlib
import os
import struct
import tempfile
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from torch.utils.data import Dataset

from ..core.safe_open import open_regular

MAGIC = b"PLTOKIDX"
VERSION = 1
HEADER = struct.Struct("<8sI4sQQ")  # magic, version, dtype, num_tokens, num_docs
DTYPES = ("<u2", "<u4", "<i4", "<i8")  # what a token id file may hold
TEXT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl")
MAX_TEXT_BYTES = 1 << 30  # one document per text file: a 1 GiB document is no real text file
MAX_ID_CHUNK = 1 << 22  # tokens max_id() reads at a time (16 MiB of int32)


class TokenFileError(ValueError):
    """A token file pair is missing, truncated or not one this library wrote."""


def _paths(path: str | os.PathLike) -> tuple[str, str]:
    path = os.fspath(path)
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            path = path[:-len(suffix)]
    return path + ".bin", path + ".idx"


# -- writing -------------------------------------------------------------------------------------
def write_tokens(path: str | os.PathLike, docs: Iterable[Any], dtype: Any = np.uint32) -> dict:
    """Write documents (arrays or sequences of token ids) to ``PATH.bin`` + ``PATH.idx``;
    returns {"num_tokens", "num_docs", "dtype"}."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if dtype.str not in DTYPES:
        raise ValueError(f"token dtype must be one of uint16, uint32, int32, int64, not {dtype}")
    info = np.iinfo(dtype)
    bin_path, idx_path = _paths(path)
    # new files of unpredictable names (a link planted in a shared folder is never written through)
    tmp_bin, tmp_idx = (_new_temp(name) for name in (bin_path, idx_path))
    offsets = [0]
    try:
        with open(tmp_bin, "wb") as out:
            for number, doc in enumerate(docs):
                ids = np.asarray(doc)
                if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                    raise ValueError(f"document {number}: token ids must be a 1-D sequence of "
                                     f"ints, got shape {ids.shape} and dtype {ids.dtype}")
                if ids.size and (int(ids.min()) < info.min or int(ids.max()) > info.max):
                    raise ValueError(f"document {number}: token id {int(ids.max())} does not fit "
                                     f"{dtype.name}; write with a wider dtype (uint32)")
                out.write(ids.astype(dtype, copy=False).tobytes())
                offsets.append(offsets[-1] + ids.size)
        header = HEADER.pack(MAGIC, VERSION, dtype.str.encode().ljust(4, b"\0"), offsets[-1],
                             len(offsets) - 1)
        with open(tmp_idx, "wb") as out:
            out.write(header)
            out.write(np.asarray(offsets, dtype="<u8").tobytes())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)  # last: the pair is whole from here on
    finally:
        for tmp in (tmp_bin, tmp_idx):
            if os.path.exists(tmp):
                os.remove(tmp)
    return {"num_tokens": offsets[-1], "num_docs": len(offsets) - 1, "dtype": dtype.name}


def _new_temp(final: str) -> str:
    fd, name = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(final)),
                                prefix=os.path.basename(final) + ".", suffix=".tmp")
    os.close(fd)
    return name


def load_tokenizer(spec: str) -> Callable[[str], Any]:
    """The function ``module:function`` names (text -> token ids)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--tokenizer takes module:function (e.g. mytok:encode), not {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--tokenizer {spec}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"--tokenizer {spec} is not a function")
    return fn


def text_files(folder: str, extensions: tuple[str, ...] = TEXT_EXTENSIONS) -> list[str]:
    """Text files under `folder` (recursively, sorted, dot-files and dot-folders skipped)."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder}: not a folder of text files")
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, f) for f in sorted(files)
                  if not f.startswith(".") and f.lower().endswith(extensions)]
    if not found:
        raise ValueError(f"{folder}: no text files ({', '.join(extensions)}) found")
    return found


def write_from_texts(path: str, folder: str, tokenizer: Callable[[str], Any],
                     dtype: Any = np.uint32) -> dict:
    """One document per text file of `folder`, tokenized by `tokenizer(text)`."""
    names = text_files(folder)  # a folder with none is an error before anything is written

    def docs() -> Iterable[Any]:
        for name in names:
            # a FIFO, a link to /dev/zero or a huge file among them is an error naming it,
            # not a hang or an endless read
            f = os.fdopen(open_regular(name, max_bytes=MAX_TEXT_BYTES, what="text file",
                                       follow=True), encoding="utf-8", errors="replace")
            with f:
                text = f.read()
            try:
                yield tokenizer(text)
            except Exception as exc:
                raise ValueError(f"{name}: the tokenizer failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    return write_tokens(path, docs(), dtype)


# -- reading -------------------------------------------------------------------------------------
def _open(path: str, what: str, size: int | None = None) -> Any:
    """``path`` opened for reading if it is a regular file (of ``size`` bytes when given): a
    FIFO or device in its place is an error naming it, not a hang or an endless read. A link
    to a regular file is followed (these are the user's own inputs)."""
    return os.fdopen(open_regular(path, expect_size=size, what=what, follow=True), "rb")


def read_index(path: str | os.PathLike) -> tuple[np.dtype, int, np.ndarray]:
    """(dtype, num_tokens, document offsets) of a token file pair, checked."""
    bin_path, idx_path = _paths(path)
    try:
        with _open(bin_path, "token file") as f:
            bin_size = os.fstat(f.fileno()).st_size
        idx = _open(idx_path, "token index")
    except FileNotFoundError as exc:
        raise TokenFileError(f"{exc.filename}: {exc.strerror}; write token files with "
                             "`python -m pooled_loader tokens write` or write_tokens()") from None
    with idx:
        idx_size = os.fstat(idx.fileno()).st_size
        head = idx.read(HEADER.size)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise TokenFileError(f"{idx_path}: not a token index (bad magic or shorter than its "
                                 "header); rewrite it with `python -m pooled_loader tokens write`")
        _, version, dtype_raw, num_tokens, num_docs = HEADER.unpack(head)
        if version != VERSION:
            raise TokenFileError(f"{idx_path}: token index version {version}, this library "
                                 f"reads version {VERSION}; rewrite it")
        dtype_str = dtype_raw.rstrip(b"\0").decode("ascii", "replace")
        if dtype_str not in DTYPES:
            raise TokenFileError(f"{idx_path}: unknown token dtype {dtype_str!r}")
        dtype = np.dtype(dtype_str)
        if idx_size != HEADER.size + 8 * (num_docs + 1):
            raise TokenFileError(f"{idx_path}: {idx_size} bytes, but its header announces "
                                 f"{num_docs} documents; the file is truncated or corrupt: "
                                 "rewrite it")
        if bin_size != num_tokens * dtype.itemsize:
            raise TokenFileError(f"{bin_path}: {bin_size} bytes, but {idx_path} announces "
                                 f"{num_tokens} tokens of {dtype.name}; the pair does not "
                                 "match: rewrite it")
        raw = idx.read(8 * (num_docs + 1))  # the size check above bounds it by the file
    offsets = np.frombuffer(raw, dtype="<u8")
    # compared as uint64: int64 differences of offsets such as 2**63 and 2**64-1 wrap round
    if (len(offsets) != num_docs + 1 or offsets[0] != 0 or offsets[-1] != num_tokens
            or np.any(offsets[1:] < offsets[:-1])):
        raise TokenFileError(f"{idx_path}: document offsets are not 0..{num_tokens} in order; "
                             "the file is corrupt: rewrite it")
    return dtype, int(num_tokens), offsets.astype(np.int64)  # all <= num_tokens < 2**63


class TokenDataset(Dataset):
    """Windows or documents of a token file pair, read with one ``pread`` per item.

    `seq_len` given: item i is the window of `seq_len` tokens starting at ``i * stride``
    (`stride` defaults to `seq_len`; windows run across document boundaries, as pre-training
    reads them; ask for ``block + 1`` tokens to take shifted targets from each window).
    `seq_len` None: item i is document i, cut to its first `max_len` tokens if given.

    Items are read, not views of a memory map: a ``.bin`` cut short while an epoch runs is
    then a ``TokenFileError`` naming it at the next item (a short read), where a view read
    after the cut would kill the process with SIGBUS, and a file larger than the address space
    a process may map (``ulimit -v``) reads as any other. Under PooledLoader a window is read
    straight into its row of the batch slot (``getitem_into``: the read is the item's only
    copy, as the view's copy into the slot was); DataLoader's batched fetch (``__getitems__``)
    reads a batch of windows into one array (scripts/benchmarks/bench_checks.py: BENCHMARKS.md).
    """

    def __init__(self, path: str | os.PathLike, seq_len: int | None = None,
                 stride: int | None = None, max_len: int | None = None):
        self.path = os.fspath(path)
        self.dtype, self.num_tokens, self.offsets = read_index(self.path)
        self.seq_len, self.stride, self.max_len = seq_len, stride or seq_len, max_len
        for name, value in (("seq_len", seq_len), ("stride", stride), ("max_len", max_len)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        if seq_len is not None and max_len is not None:
            raise ValueError("max_len cuts documents; with seq_len (windows) leave it out")
        if seq_len is not None and self.num_tokens < seq_len:
            raise ValueError(f"{_paths(self.path)[0]}: {self.num_tokens} tokens, fewer than one "
                             f"window of seq_len={seq_len}")
        self._itemsize = self.dtype.itemsize
        self._len = self._count()
        self._file: Any = None  # opened on first use, in each process
        self._fd = -1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_file": None, "_fd": -1}  # workers open it themselves

    def _open_bin(self) -> int:
        bin_path = _paths(self.path)[0]
        self._file = _open(bin_path, "token file", self.num_tokens * self._itemsize)
        self._fd = self._file.fileno()
        return self._fd

    def _tokens(self, start: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``start:end`` read from the file (into ``out`` when given: an array of that
        many tokens of this dtype); a short read (the file shrank) is an error naming it."""
        if out is None:
            out = np.empty(end - start, self.dtype)
        fd = self._fd if self._fd >= 0 else self._open_bin()
        if os.preadv(fd, (out,), start * self._itemsize) != out.nbytes:
            self._read_rest(fd, out, start * self._itemsize)
        return out

    def _read_rest(self, fd: int, out: np.ndarray, pos: int) -> None:
        """After a short read: the rest (a read returns 2 GiB at most), or an error naming the
        file if it ends first."""
        raw = memoryview(out).cast("B")
        got = 0
        while got < len(raw):
            n = os.preadv(fd, (raw[got:],), pos + got)
            if n <= 0:
                raise TokenFileError(f"{_paths(self.path)[0]}: the file shrank while it was "
                                     f"open (it was {self.num_tokens} tokens); was it "
                                     "rewritten in place?")
            got += n

    def _span(self, i: Any) -> tuple[int, int]:
        """Token range of item ``i`` (negative counts from the end)."""
        n = self._len
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items of {self.path}")
        if i < 0:
            i += n
        if self.seq_len is not None:
            start = int(i) * self.stride
            return start, start + self.seq_len
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.max_len is not None:
            end = min(end, start + self.max_len)
        return start, end

    def _count(self) -> int:
        if self.seq_len is None:
            return len(self.offsets) - 1
        return (self.num_tokens - self.seq_len) // self.stride + 1

    def __len__(self) -> int:
        return self._len

    def lengths(self) -> np.ndarray:
        """Every item's length in tokens, from the index alone (for `pooled_loader.samplers`)."""
        if self.seq_len is not None:
            return np.full(len(self), self.seq_len, dtype=np.int64)
        lengths = np.diff(self.offsets)
        return lengths if self.max_len is None else np.minimum(lengths, self.max_len)

    def max_id(self) -> int:
        """The largest token id in the file (one pass, ``MAX_ID_CHUNK`` tokens at a time; -1
        when empty), e.g. to size an embedding."""
        best = -1
        for start in range(0, self.num_tokens, MAX_ID_CHUNK):
            best = max(best, int(self._tokens(start, min(start + MAX_ID_CHUNK,
                                                         self.num_tokens)).max()))
        return best

    def __getitem__(self, i: int) -> np.ndarray:
        return self._tokens(*self._span(i))

    def getitem_into(self, i: int, out: Any) -> np.ndarray:
        """Item ``i`` read straight into ``out`` (a PooledLoader slot's row: C-contiguous and
        writable) when it has the item's length and dtype, so the read is the only copy; else
        a new array."""
        start, end = self._span(i)
        if type(out) is np.ndarray and out.shape == (end - start,) and out.dtype == self.dtype:
            return self._tokens(start, end, out)
        return self._tokens(start, end)

    def __getitems__(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Items ``indices`` (DataLoader's batched fetch): windows are rows of one array read
        row by row, so a batch is one allocation; documents are read one by one."""
        if self.seq_len is None:
            return [self._tokens(*self._span(i)) for i in indices]
        rows = np.empty((len(indices), self.seq_len), self.dtype)
        for row, i in zip(rows, indices):
            self._tokens(*self._span(i), row)
        return list(rows)


# -- command line --------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """``python -m pooled_loader tokens {write,info}``."""
    parser = argparse.ArgumentParser(prog="python -m pooled_loader tokens",
                                     description="write and inspect memory-mapped token files")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="tokenize a folder of text files (one document per file)")
    w.add_argument("out", help="output path: writes OUT.bin and OUT.idx")
    w.add_argument("--from", dest="folder", required=True, help="folder of text files")
    w.add_argument("--tokenizer", required=True,
                   help="module:function taking a str and returning token ids")
    w.add_argument("--dtype", default="uint32", choices=["uint16", "uint32", "int32", "int64"])
    i = sub.add_parser("info", help="check a token file pair and print its counts")
    i.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "write":
        stats = write_from_texts(args.out, args.folder, load_tokenizer(args.tokenizer),
                                 args.dtype)
    else:
        dtype, num_tokens, offsets = read_index(args.path)
        stats = {"num_tokens": num_tokens, "num_docs": len(offsets) - 1, "dtype": dtype.name}
    print(f"{stats['num_docs']} documents, {stats['num_tokens']} tokens ({stats['dtype']})")
    return 0
