"""Shard indexes: the byte offset and size of every sample of a tar shard, in a sidecar file.

Why: with them any sample can be read by position (a local seek, one HTTP Range request, or a
seek in a cached shard), which is what a global shuffle (pooled_loader.shards.global_shuffle) needs,
and a cache can check a downloaded shard's size and checksum.

Format: next to ``data-000001.tar`` lies ``data-000001.tar.idx.json``, UTF-8 JSON::

    {"format": "pooled_loader.shard_index/1", "shard_bytes": 1048576,
     "sha256": "<hex of the whole shard>", "shard_mtime_ns": 1733300000123456789,
     "offsets": [1024, 3584, ...], "sizes": [2560, ...]}

``offsets[i]`` is where sample ``i``'s first tar header starts and ``sizes[i]`` the bytes up to
where the next sample starts (its headers, data and padding), as ``pooled_loader.shards.samples``
groups members into samples (so ``shards index`` and the reader agree on what a sample is).
Compressed shards cannot be indexed (their offsets are not file offsets). ``shard_mtime_ns`` (the
shard's mtime when it was indexed) is optional: indexes written before it (issue 45) have none
and keep the format tag, which readers without it ignore.

An index is untrusted input: a local one must be a regular file (a FIFO or device is refused,
not waited on), it is read only up to ``MAX_INDEX_BYTES``, and ``parse_index`` checks the format
tag, the types, that the samples are contiguous (each starts where the one before ends: an entry
left out is a gap), are at least one tar header long and end at least an end-of-archive marker
before ``shard_bytes``. ``check_shard`` then compares it with a local shard as it is now: its size,
then its mtime; where that is not the one recorded (a copy, a download, an index without one)
the shard's tar headers are read (as counting does) and its samples must lie where the index
places them. Any failure is a ``ShardIndexError`` naming the index file (and the shard). What a
remote shard is like is seen as it is read: ``read_sample`` (global shuffle) and ``samples_from``
(shard order) check each sample's place and the shard's size, the shard cache its SHA-256.

CLI: ``python -m pooled_loader shards index PATTERN`` (local shards); ``shards write`` writes the
index of each shard it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterator, Optional

from . import remote
from ..core.errors import ShardFormatError, ShardIndexError
from ..core.safe_open import UnsafeFileError, open_regular
from .urls import local_path
from .samples import (INDEX_SUFFIX, Sample, index_url, is_local_tar, local_sample_starts,
                      shard_samples)

__all__ = ["ShardIndex", "ShardIndexError", "INDEX_SUFFIX", "build_index", "write_index",
           "parse_index", "check_shard", "load_index", "load_indexes", "index_url", "read_sample",
           "samples_from"]

FORMAT = "pooled_loader.shard_index/1"
MAX_INDEX_BYTES = 64 << 20  # ~3 M samples per shard at ~20 bytes each; far above real shards
TAR_BLOCK = 512  # a sample holds at least one tar header
END_MARKER = 2 * TAR_BLOCK  # the two zero blocks that end every tar, after the last sample
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REBUILD = "rebuild it with `python -m pooled_loader shards index PATTERN`"


@dataclass(frozen=True)
class ShardIndex:
    """One shard's sample positions (see the module docstring)."""
    shard_bytes: int
    sha256: Optional[str]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    shard_mtime_ns: Optional[int] = None  # None: not recorded (an index of an older release)

    def __len__(self) -> int:
        return len(self.offsets)

    def to_json(self) -> dict:
        return {"format": FORMAT, "shard_bytes": self.shard_bytes, "sha256": self.sha256,
                "shard_mtime_ns": self.shard_mtime_ns, "offsets": list(self.offsets),
                "sizes": list(self.sizes)}


def build_index(path: str, max_sample_bytes: Optional[int] = None) -> ShardIndex:
    """Index a local tar shard by reading it once (every sample, as the reader groups them;
    ``max_sample_bytes`` as ``shard_samples`` takes it)."""
    offsets, sizes = [], []
    # refused before reading: a FIFO blocks open(), a link to /dev/zero never ends
    with os.fdopen(open_regular(path, what="shard", follow=True), "rb") as f:
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
        st = os.fstat(f.fileno())
    # the reader's own grouping, so both agree
    for _, start, after in shard_samples(path, 0, max_sample_bytes=max_sample_bytes):
        if start is None or after is None:
            raise ValueError(f"{path}: a compressed shard cannot be indexed (its offsets are "
                             "not file offsets); index the uncompressed .tar")
        offsets.append(start)
        sizes.append(after - start)
    return ShardIndex(st.st_size, h.hexdigest(), tuple(offsets), tuple(sizes), st.st_mtime_ns)


def write_index(path: str, max_sample_bytes: Optional[int] = None) -> str:
    """Write ``path``'s index next to it (a new file of unpredictable name, created exclusively
    so a planted symlink is never written through, then renamed); its path."""
    index = build_index(path, max_sample_bytes)
    out = index_url(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(out) + ".", suffix=".partial",
                               dir=os.path.dirname(out) or ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(index.to_json(), f, separators=(",", ":"))
        os.chmod(tmp, 0o644)  # mkstemp makes it private (0600)
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return out


def parse_index(data: bytes, where: str, shard_bytes: Optional[int] = None) -> ShardIndex:
    """Validate index bytes read from ``where``; ``shard_bytes``: the shard's real size if
    known. Raises ``ShardIndexError`` naming ``where`` and what is wrong."""
    def bad(what: str) -> ShardIndexError:
        return ShardIndexError(f"shard index {where}: {what}; {_REBUILD}")

    if len(data) > MAX_INDEX_BYTES:
        raise bad(f"larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON ({exc})") from None
    except RecursionError:
        raise bad("JSON nested too deeply (an index is one object of flat lists)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"format is {got!r}, expected {FORMAT!r}")
    size, sha, mtime, offsets, sizes = (doc.get(k) for k in (
        "shard_bytes", "sha256", "shard_mtime_ns", "offsets", "sizes"))
    if not _is_int(size) or size < 0:
        raise bad(f"shard_bytes must be an int >= 0, got {size!r}")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise bad("sha256 must be 64 lowercase hex digits or null")
    if mtime is not None and not _is_int(mtime):
        raise bad(f"shard_mtime_ns must be an int or null, got {mtime!r}")
    if not isinstance(offsets, list) or not isinstance(sizes, list) or len(offsets) != len(
            sizes):
        raise bad("offsets and sizes must be lists of the same length")
    if len(offsets) > size // TAR_BLOCK:
        raise bad(f"{len(offsets)} samples cannot fit in {size} bytes")
    end = offsets[0] if offsets else 0
    for i, (off, n) in enumerate(zip(offsets, sizes)):
        if not (_is_int(off) and _is_int(n)) or off < max(end, 0) or n < TAR_BLOCK or (
                off + n + END_MARKER > size):
            raise bad(f"sample {i} (offset {off!r}, size {n!r}) is out of order, overlaps the "
                      f"previous one, is shorter than a tar header or runs past the shard's "
                      f"{size} bytes (less its {END_MARKER}-byte end-of-archive marker)")
        if off != end:
            raise bad(f"bytes {end}..{off} lie between sample {i - 1} and sample {i}: a gap "
                      "(a sample left out of the index?)")
        end = off + n
    if shard_bytes is not None and shard_bytes != size:
        raise bad(f"it is for a shard of {size} bytes, the shard has {shard_bytes} (stale)")
    return ShardIndex(size, sha, tuple(offsets), tuple(sizes), mtime)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fetch_index(url: str, *, retries: int = remote.RETRIES,
                 backoff_s: float = remote.BACKOFF_S) -> ShardIndex:
    """The index of shard ``url`` (read from ``index_url(url)``, local or remote), parsed but
    not yet compared with the shard (``check_shard``). Raises ``ShardIndexError`` saying how to
    make one when it is missing."""
    where = index_url(url)
    local = local_path(url)
    try:
        if local is not None:
            with os.fdopen(open_regular(local + INDEX_SUFFIX, what="shard index", follow=True),
                           "rb") as f:
                data = f.read(MAX_INDEX_BYTES + 1)
        else:
            with remote.open_shard(where, retries=retries, backoff_s=backoff_s) as f:
                data = f.read(MAX_INDEX_BYTES + 1)
    except (FileNotFoundError, remote.RemoteReadError) as exc:
        raise ShardIndexError(f"shard {url} has no readable index at {where} ({exc}); write "
                              "one with `python -m pooled_loader shards index PATTERN`") from exc
    except UnsafeFileError as exc:  # a FIFO, a device, a directory
        raise ShardIndexError(f"shard index {where}: {exc.strerror}; put the index file "
                              "itself there (`python -m pooled_loader shards index PATTERN`)"
                              ) from None
    return parse_index(data, where)


def check_shard(url: str, index: ShardIndex) -> None:
    """Raise ``ShardIndexError`` naming the index and the shard when ``index`` does not
    describe the local shard ``url`` as it is now: another size, or (its mtime not the one
    recorded) samples that are not where the index places them, read from its tar headers. A
    missing or unreadable shard passes (its reader says what is wrong); so does a remote one,
    checked as it is read (``read_sample``, ``samples_from``, the shard cache)."""
    local = local_path(url)
    try:
        st = os.stat(local) if local is not None else None
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        return
    if st.st_size != index.shard_bytes:
        raise _changed(url, f"it is for a shard of {index.shard_bytes} bytes, the shard has "
                            f"{st.st_size}")
    if st.st_mtime_ns == index.shard_mtime_ns:
        return  # as indexed; else a copy, a download or an older index: the headers tell
    starts = local_sample_starts(local) if is_local_tar(local) else None
    if starts is None:
        return  # damaged, or not a plain tar: reading it says how
    have, want = starts[:-1], list(index.offsets)
    end = index.offsets[-1] + index.sizes[-1] if index.offsets else starts[-1]
    if have != want or starts[-1] != end:
        i = next((k for k, (a, b) in enumerate(zip(have, want)) if a != b),
                 min(len(have), len(want)))
        at = (lambda xs: f"at byte {xs[i]}" if i < len(xs) else "nowhere")
        raise _changed(url, f"sample {i} begins {at(want)} in it, {at(have)} in the shard "
                            f"({len(want)} samples ending at byte {end}; the shard's "
                            f"{len(have)} end at byte {starts[-1]})")


def _changed(url: str, what: str) -> ShardIndexError:
    return ShardIndexError(f"shard index {index_url(url)}: {what}: the shard {url} changed "
                           f"since it was indexed (stale); {_REBUILD}")


def load_index(url: str, *, retries: int = remote.RETRIES,
               backoff_s: float = remote.BACKOFF_S) -> ShardIndex:
    """The validated index of shard ``url`` (read from ``index_url(url)``, local or remote),
    checked against a local shard (``check_shard``). Raises ``ShardIndexError`` naming the index
    when it is missing (saying how to make one), malformed or stale."""
    index = _fetch_index(url, retries=retries, backoff_s=backoff_s)
    check_shard(url, index)
    return index


def load_indexes(urls: list[str], *, skip: Optional[Callable[[str, str], None]] = None,
                 retries: int = remote.RETRIES,
                 backoff_s: float = remote.BACKOFF_S) -> list[ShardIndex]:
    """``load_index`` of every shard. With ``skip``, an index that no longer fits its shard
    (``check_shard``) is reported to ``skip(url, why)`` and stands as an empty one: the shard
    is left out, none of its samples read by the stale index. Other failures raise."""
    indexes = []
    for url in urls:
        index = _fetch_index(url, retries=retries, backoff_s=backoff_s)
        try:
            check_shard(url, index)
        except ShardIndexError as exc:
            if skip is None:
                raise
            skip(url, str(exc))
            index = ShardIndex(0, None, (), ())
        indexes.append(index)
    return indexes


def read_sample(url: str, index: ShardIndex, i: int, *, name: Optional[str] = None,
                retries: int = remote.RETRIES, backoff_s: float = remote.BACKOFF_S,
                max_sample_bytes: Optional[int] = None) -> Sample:
    """Sample ``i`` of shard ``url`` (named ``name`` in errors) as ``index`` places it, checked
    against the shard on the way: the shard (or the server's ``Content-Range``) has the size the
    index records, and the bytes hold exactly one whole sample there. The first sample is read
    from byte 0 (no sample may come before it) and the last with the two blocks after it (the
    end-of-archive marker must follow it): with contiguity (``parse_index``) the entries are
    then the tar's own samples, none left out or split off a member's data. A mismatch raises
    ``ShardIndexError``; a damaged shard ``ShardFormatError``."""
    off, n = index.offsets[i], index.sizes[i]
    lo = 0 if i == 0 else off
    hi = off + n + (END_MARKER if i == len(index) - 1 else 0)
    samples = shard_samples(url, lo, end=hi, size=index.shard_bytes, retries=retries,
                            backoff_s=backoff_s, max_sample_bytes=max_sample_bytes)
    try:
        sample, start, after = next(samples, (None, None, None))
        # the last: the iteration must end at the marker, not find (part of) another member
        more = sample is not None and hi > off + n and _continues(samples)
    finally:
        samples.close()
    if sample is None or (start, after) != (off, off + n) or more:
        found = ("none" if sample is None else f"one at bytes {start}..{after}" + (
            ", and more members after it where the end-of-archive marker should be" if more
            else ""))
        raise ShardIndexError(f"shard {name or url}: its index places sample {i} at bytes "
                              f"{off}..{off + n}, the shard holds {found}: the index does not "
                              f"fit the shard; rebuild {index_url(name or url)} (`python -m "
                              "pooled_loader shards index PATTERN`)")
    return sample


def samples_from(src: str, offset: Optional[int], first: int, *, url: str,
                 index: Optional[ShardIndex] = None,
                 **opts: Any) -> Iterator[tuple[Sample, Any, Any]]:
    """``shard_samples`` of shard ``url`` (read from ``src``: it, or its cached copy) from its
    sample ``first``: at byte ``offset``, or (None: a compressed shard) from its start, passing
    over the ``first`` samples before it. With ``index``, each is checked against it
    (``_follow_index``). ``opts`` go to ``shard_samples``."""
    size = None if index is None else index.shard_bytes
    samples = shard_samples(src, offset or 0, size=size, **opts)
    if index is not None:
        samples = _follow_index(samples, index, 0 if offset is None else first, url)
    return samples if offset is not None else islice(samples, first, None)


def _follow_index(samples: Iterator[tuple[Sample, Any, Any]], index: ShardIndex, first: int,
                  url: str) -> Iterator[tuple[Sample, Any, Any]]:
    """``samples`` (``shard_samples`` of shard ``url`` from its sample ``first``) as they come,
    each checked to begin and end where ``index`` places it, and (once read to the end) to be
    as many as it counts: a shard changed after its index was read raises ``ShardIndexError``
    naming both, where counting on the index would read other samples twice to make up the
    difference. A compressed shard (no offsets) is checked on its count."""
    i = first
    for item in samples:
        _, start, after = item
        if i >= len(index):
            raise _changed(url, f"it counts {len(index)} samples, the shard holds more")
        want = (index.offsets[i], index.offsets[i] + index.sizes[i])
        if start is not None and (start, after) != want:
            raise _changed(url, f"it places sample {i} at bytes {want[0]}..{want[1]}, the "
                                f"shard holds one at bytes {start}..{after}")
        yield item
        i += 1
    if i < len(index):
        raise _changed(url, f"it counts {len(index)} samples, the shard ends after {i}")


def _continues(samples: Iterator) -> bool:
    """Whether a slice's iteration finds more after its first sample (another sample, or a
    member cut by the slice's end)."""
    try:
        return next(samples, None) is not None
    except ShardFormatError:
        return True
