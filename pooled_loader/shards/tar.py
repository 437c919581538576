"""Tar shards read on a bounded path: every header is checked before anything is allocated.

Python's ``tarfile`` loops forever on a negative base-256 size, reads a longname or pax header
of whatever size it claims into memory, and takes a bad header, or a shard cut between members,
for the end of the archive (the samples after it vanish). ``TarReader`` parses ustar, GNU and
pax headers itself, and every tar reader of the package uses it:

- header checksums are verified; sizes are octal or positive base-256 numbers and, when the
  archive's size is known (a local file), a member must lie inside it;
- longname/longlink and pax headers hold at most ``MAX_META_BYTES``, pax records must be well
  formed, sparse members are refused; data is read in pieces (memory follows the bytes that
  arrive), at most ``MAX_MEMBER_BYTES`` per member (and ``core.constants.MAX_SAMPLE_BYTES`` per
  sample, checked by ``shard_samples``); a compressed shard may expand to at most
  ``core.constants.MAX_DECOMPRESSED_SHARD_BYTES``;
- the archive must end as tar says: two zero blocks, then only zeros, at most
  ``core.constants.MAX_TRAILING_BYTES`` of them (more is refused unread). A bad header, a shard
  truncated anywhere and data after the end raise ``ShardFormatError`` naming the shard and
  the byte offset.

Reading is sequential (local file, HTTP or ``pipe:`` stream alike); a local file's unread data
is seeked over. gzip, bzip2 and xz shards are decompressed on the fly (offsets are then those of
the uncompressed tar, and ``plain`` is False).
"""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Optional

from ..core.constants import MAX_DECOMPRESSED_SHARD_BYTES, MAX_TRAILING_BYTES
from ..core.errors import ShardFormatError

__all__ = ["TarReader", "Member", "MAX_META_BYTES", "MAX_MEMBER_BYTES"]

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_META_BYTES = 1 << 16  # a longname or pax header: a path and a few numbers, never near 64 KiB
MAX_MEMBER_BYTES = 1 << 32  # 4 GiB: one member's data is held in memory whole
CHUNK = 1 << 22  # data is read (and skipped on a stream) 4 MiB at a time
REGULAR = (b"0", b"\0", b"7")
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, directories, fifos
PAX_GLOBAL, LONGNAME, LONGLINK, SPARSE = b"g", b"L", b"K", b"S"
META = {b"x": "pax", b"X": "pax", b"g": "pax global", b"L": "GNU longname",
        b"K": "GNU longlink"}  # headers that describe the next member
POSIX_MAGIC = b"ustar\x0000"
COMPRESSED = ((b"\x1f\x8b", lambda f: gzip.GzipFile(fileobj=f, mode="rb")),
              (b"BZh", bz2.BZ2File), (b"\xfd7zXZ\x00", lzma.LZMAFile))
DECOMPRESS_ERRORS = (OSError, EOFError, lzma.LZMAError)  # gzip's BadGzipFile is an OSError
SIGNED = struct.Struct("148b8x356b")  # some old writers summed the header as signed bytes
OCTAL = b"01234567"


@dataclass
class Member:
    """One archive member: ``offset`` is where its first header starts (a longname or pax header
    included), ``data_offset`` where its data starts (absolute offsets in the tar)."""
    name: str
    offset: int
    data_offset: int
    size: int
    type: bytes

    def isreg(self) -> bool:
        """A regular file (``tarfile.TarInfo.isreg``)."""
        return self.type in REGULAR and not (self.type == b"\0" and self.name.endswith("/"))


class TarReader:
    """Iterate over the members of the tar in ``fileobj`` (named ``url`` in errors).

    ``base`` is the absolute offset at which ``fileobj`` starts (a stream resumed mid-shard);
    ``read(member)`` returns the data of the member just yielded (else it is skipped). After a
    complete iteration ``end`` is the offset of the end-of-archive marker. ``sliced``: the
    stream is a slice of the archive that stops at a member boundary (one sample read by its
    shard index's offsets): it may end there without the marker (inside a header or member it
    is still truncated)."""

    def __init__(self, fileobj: BinaryIO, url: str, *, base: int = 0,
                 sliced: bool = False) -> None:
        self.url, self.base, self.end, self.sliced = url, base, None, sliced
        self.plain = True
        head = fileobj.peek(6)[:6] if hasattr(fileobj, "peek") else b""
        self.expanded = 0  # bytes decompressed (compressed shards)
        for magic, opener in COMPRESSED:
            if base == 0 and head.startswith(magic):
                fileobj, self.plain = opener(fileobj), False
                break
        self.f = fileobj
        self._get = fileobj.read if self.plain else self._decompressed
        self.size: Optional[int] = None  # bytes from `base` to the end, when known
        self.seekable = False
        if self.plain:
            try:
                self.seekable = fileobj.seekable()
                st = os.fstat(fileobj.fileno())
                self.size = st.st_size - fileobj.tell() if self.seekable else None
            except (AttributeError, OSError, ValueError):
                pass
        self._pos = 0  # bytes consumed from `base`
        self._unread = 0  # data (and padding) of the last member not read yet
        self._current: Optional[Member] = None

    def fail(self, at: int, what: str) -> ShardFormatError:
        return ShardFormatError(self.url, f"{what} at byte {self.base + at}")

    # -- byte access --

    def _decompressed(self, n: int) -> bytes:
        try:
            data = self.f.read(n)
        except DECOMPRESS_ERRORS as exc:
            raise self.fail(self._pos, f"corrupt compressed data ({type(exc).__name__}: {exc})"
                            ) from None
        self.expanded += len(data)
        if self.expanded > MAX_DECOMPRESSED_SHARD_BYTES:  # at most one CHUNK past it
            raise self.fail(self._pos, f"a compressed shard expanding past "
                                       f"{MAX_DECOMPRESSED_SHARD_BYTES} bytes (a decompression "
                                       "bomb? constants.MAX_DECOMPRESSED_SHARD_BYTES)")
        return data

    def _read(self, n: int, what: str) -> bytes:
        data = self._get(min(n, CHUNK))
        if len(data) == n:
            self._pos += n
            return data
        parts, got = [data], len(data)
        while got < n and parts[-1]:
            parts.append(self._get(min(n - got, CHUNK)))
            got += len(parts[-1])
        if got < n:
            raise self.fail(self._pos + got, f"truncated shard: it ends inside {what}")
        self._pos += n
        return b"".join(parts)

    def _skip(self, n: int) -> None:
        if self.seekable:  # a local file: a short file shows at the next header read
            self.f.seek(n, io.SEEK_CUR)
            self._pos += n
            return
        while n:
            step = min(n, CHUNK)
            self._read(step, "a member's data")
            n -= step

    # -- members --

    def __iter__(self) -> Iterator[Member]:
        names: dict[bytes, bytes] = {}  # from longname/pax headers, for the next member
        gpax: dict[bytes, bytes] = {}
        first: Optional[int] = None
        while True:
            if self._unread:
                self._skip(self._unread)
                self._unread = 0
            at = self._pos
            buf = self._get(BLOCK)
            if len(buf) < BLOCK:
                if buf or first is not None:
                    raise self.fail(at + len(buf), "truncated shard: it ends inside a header")
                if self.sliced and at:
                    self.end = self.base + at
                    return
                raise self.fail(at, "truncated shard: no end-of-archive marker (it ends after "
                                    "a member)" if at or self.base else "empty file, not a tar")
            self._pos += BLOCK
            if buf == ZERO_BLOCK:
                if first is not None:
                    raise self.fail(at, "end of archive after a longname or pax header")
                self._check_end(at)
                return
            kind, size, name = self._header(buf, at)
            if kind in NO_DATA:  # as tarfile: these carry no data whatever their size says
                size = 0
            self._check_inside(at, name, size)
            if kind in META:
                first = at if first is None else first
                (gpax if kind == PAX_GLOBAL else names).update(self._meta(kind, size, at))
                continue
            m = self._member(at, first, kind, size, name, {**gpax, **names} if gpax else names)
            names, first = {}, None
            self._unread, self._current = -m.size % BLOCK + m.size, m
            yield m
            self._current = None

    def _meta(self, kind: bytes, size: int, at: int) -> dict[bytes, bytes]:
        """The records of a longname or pax header (its data read, bounded)."""
        if size > MAX_META_BYTES:
            raise self.fail(at, f"a {META[kind]} header of {size} bytes (at most "
                                f"{MAX_META_BYTES} are accepted)")
        data = self._read(size, "a header")
        self._skip(-size % BLOCK)
        if kind == LONGNAME:
            return {b"path": data.split(b"\0", 1)[0]}
        return {} if kind == LONGLINK else self._pax(data, at)

    def _member(self, at: int, first: Optional[int], kind: bytes, size: int, name: str,
                pax: dict[bytes, bytes]) -> Member:
        """The member whose header is at ``at``, with what its longname/pax headers say."""
        if kind == SPARSE or any(k.startswith(b"GNU.sparse") for k in pax):
            raise self.fail(at, f"sparse member {name!r}: not supported in a shard")
        if b"path" in pax:
            name = pax[b"path"].decode("utf-8", "surrogateescape")
        if b"size" in pax:
            text = pax[b"size"]
            if not text.isdigit():
                raise self.fail(at, f"pax size {text[:40]!r} of member {name!r}")
            size = int(text)
            self._check_inside(at, name, size)
        return Member(name, self.base + (at if first is None else first), self.base + self._pos,
                      size, kind)

    def read(self, member: Member) -> bytes:
        """The data of ``member``, the member the iteration just yielded."""
        if member is not self._current or self._unread != -member.size % BLOCK + member.size:
            raise ValueError(f"{self.url}: read() takes the member just yielded, once")
        if member.size > MAX_MEMBER_BYTES:
            raise self.fail(member.data_offset - self.base,
                            f"member {member.name!r} of {member.size} bytes (at most "
                            f"{MAX_MEMBER_BYTES} are read)")
        data = self._read(member.size, f"member {member.name!r}")
        self._unread -= member.size
        return data

    def _header(self, buf: bytes, at: int) -> tuple[bytes, int, str]:
        """(type, size, name) of a header block, its checksum and numbers checked."""
        stored = self._number(buf[148:156], "checksum", at)
        unsigned = sum(buf) - sum(buf[148:156]) + 256
        if stored != unsigned and stored != sum(SIGNED.unpack(buf)) + 256:
            raise self.fail(at, "bad tar header (checksum mismatch): corrupt shard, or not a tar")
        size = self._number(buf[124:136], "size", at)
        name = buf[:100].split(b"\0", 1)[0]
        kind = buf[156:157]
        if buf[257:265] == POSIX_MAGIC and buf[345] and kind not in (LONGNAME, LONGLINK):
            name = buf[345:500].split(b"\0", 1)[0] + b"/" + name
        return kind, size, name.decode("utf-8", "surrogateescape")

    def _number(self, field: bytes, what: str, at: int) -> int:
        if field[0] & 0x80:  # GNU base-256: 0x80 then a big-endian number; 0xff is negative
            if field[0] != 0x80:
                raise self.fail(at, f"negative or malformed base-256 {what} in a tar header")
            return int.from_bytes(field[1:], "big")
        text = field.split(b"\0", 1)[0].strip(b" ")
        if text.strip(OCTAL):
            raise self.fail(at, f"malformed {what} {text[:12]!r} in a tar header")
        return int(text, 8) if text else 0

    def _check_inside(self, at: int, name: str, size: int) -> None:
        if self.size is not None and self._pos + size > self.size:
            raise self.fail(at, f"truncated shard: member {name!r} of {size} bytes runs past "
                                "the end of the file")

    def _pax(self, data: bytes, at: int) -> dict[bytes, bytes]:
        """The records ``LEN key=value\\n`` of a pax header."""
        out: dict[bytes, bytes] = {}
        pos, n = 0, len(data)
        while pos < n and data[pos]:  # NUL padding after the records is tolerated
            sp = data.find(b" ", pos, pos + 12)
            length = data[pos:sp]
            end = pos + int(length) if sp > 0 and length.isdigit() else -1
            eq = data.find(b"=", sp + 1, end)
            if not sp + 1 < end <= n or eq <= sp + 1 or data[end - 1] != 0x0A:
                raise self.fail(at, "malformed pax header records")
            out[data[sp + 1:eq]] = data[eq + 1:end - 1]
            pos = end
        return out

    def _check_end(self, at: int) -> None:
        """After the first zero block at ``at``: a second one, then nothing but zeros."""
        second = self._get(BLOCK)
        if len(second) < BLOCK:
            raise self.fail(at, "truncated shard: one zero block where the end-of-archive "
                                "marker has two")
        if second != ZERO_BLOCK:
            raise self.fail(at, "a zero block in mid-archive (a corrupt header?), more data "
                                "after it")
        pos = at + 2 * BLOCK
        if self.size is not None and self.size - pos > MAX_TRAILING_BYTES:  # not read
            raise self._too_much_after(at, self.size - pos)
        while True:
            tail = self._get(min(CHUNK, MAX_TRAILING_BYTES + 1 - (pos - at - 2 * BLOCK)))
            if not tail:
                break
            if tail.strip(b"\0"):
                lead = len(tail) - len(tail.lstrip(b"\0"))
                raise self.fail(pos + lead, "data after the end-of-archive marker")
            pos += len(tail)
            if pos - at - 2 * BLOCK > MAX_TRAILING_BYTES:
                raise self._too_much_after(at, None)
        self._pos, self.end = pos, self.base + at

    def _too_much_after(self, at: int, n: Optional[int]) -> ShardFormatError:
        what = f"{n} bytes" if n is not None else "more bytes"
        return self.fail(at, f"{what} after the end-of-archive marker, more than the "
                             f"{MAX_TRAILING_BYTES} a tar writer pads with "
                             "(constants.MAX_TRAILING_BYTES)")

