"""Shard indexes: the byte offset and size of every sample of a tar shard, in a sidecar file.

Why: with them any sample can be read by position (a local seek, one HTTP Range request, or a
seek in a cached shard), which is what a global shuffle (pooled_loader.global_shuffle) needs,
and a cache can check a downloaded shard's size and checksum.

Format: next to ``data-000001.tar`` lies ``data-000001.tar.idx.json``, UTF-8 JSON::

    {"format": "pooled_loader.shard_index/1", "shard_bytes": 1048576,
     "sha256": "<hex of the whole shard>", "offsets": [1024, 3584, ...], "sizes": [2560, ...]}

``offsets[i]`` is where sample ``i``'s first tar header starts and ``sizes[i]`` the bytes up to
where the next sample starts (its headers, data and padding), as ``pooled_loader.shard_samples``
groups members into samples (so ``shards index`` and the reader agree on what a sample is).
Compressed shards cannot be indexed (their offsets are not file offsets).

An index is untrusted input: it is read only up to ``MAX_INDEX_BYTES``, and ``parse_index``
checks the format tag, the types, that samples are in order, do not overlap, lie inside
``shard_bytes`` and are at least one tar header long, and, when the shard's size is known (a
local file), that it matches. Any failure is a ``ShardIndexError`` naming the index file.

CLI: ``python -m pooled_loader shards index PATTERN`` (local shards); ``shards write`` writes the
index of each shard it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Optional

from . import remote
from .errors import SampleError
from .shard_samples import shard_samples

__all__ = ["ShardIndex", "ShardIndexError", "INDEX_SUFFIX", "build_index", "write_index",
           "parse_index", "load_index", "index_url"]

FORMAT = "pooled_loader.shard_index/1"
INDEX_SUFFIX = ".idx.json"
MAX_INDEX_BYTES = 64 << 20  # ~3 M samples per shard at ~20 bytes each; far above real shards
TAR_BLOCK = 512  # a sample holds at least one tar header
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ShardIndexError(SampleError):
    """A shard index that is missing, too large, malformed or does not fit its shard."""


@dataclass(frozen=True)
class ShardIndex:
    """One shard's sample positions (see the module docstring)."""
    shard_bytes: int
    sha256: Optional[str]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.offsets)

    def to_json(self) -> dict:
        return {"format": FORMAT, "shard_bytes": self.shard_bytes, "sha256": self.sha256,
                "offsets": list(self.offsets), "sizes": list(self.sizes)}


def index_url(url: str) -> str:
    """Where the index of shard ``url`` lives (a sibling with the ``.idx.json`` suffix)."""
    return url + INDEX_SUFFIX


def build_index(path: str) -> ShardIndex:
    """Index a local tar shard by reading it once (every sample, as the reader groups them)."""
    offsets, sizes = [], []
    for _, start, after in shard_samples(path, 0):  # the reader's own grouping, so both agree
        if start is None or after is None:
            raise ValueError(f"{path}: a compressed shard cannot be indexed (its offsets are "
                             "not file offsets); index the uncompressed .tar")
        offsets.append(start)
        sizes.append(after - start)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return ShardIndex(os.path.getsize(path), h.hexdigest(), tuple(offsets), tuple(sizes))


def write_index(path: str) -> str:
    """Write ``path``'s index next to it (a new file of unpredictable name, created exclusively
    so a planted symlink is never written through, then renamed); its path."""
    index = build_index(path)
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
        return ShardIndexError(f"shard index {where}: {what}; rebuild it with "
                               "`python -m pooled_loader shards index PATTERN`")

    if len(data) > MAX_INDEX_BYTES:
        raise bad(f"larger than {MAX_INDEX_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"format is {got!r}, expected {FORMAT!r}")
    size, sha, offsets, sizes = (doc.get(k) for k in ("shard_bytes", "sha256", "offsets",
                                                       "sizes"))
    if not _is_int(size) or size < 0:
        raise bad(f"shard_bytes must be an int >= 0, got {size!r}")
    if sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise bad("sha256 must be 64 lowercase hex digits or null")
    if not isinstance(offsets, list) or not isinstance(sizes, list) or len(offsets) != len(
            sizes):
        raise bad("offsets and sizes must be lists of the same length")
    if len(offsets) > size // TAR_BLOCK:
        raise bad(f"{len(offsets)} samples cannot fit in {size} bytes")
    end = 0
    for i, (off, n) in enumerate(zip(offsets, sizes)):
        if not (_is_int(off) and _is_int(n)) or off < end or n < TAR_BLOCK or off + n > size:
            raise bad(f"sample {i} (offset {off!r}, size {n!r}) is out of order, overlaps the "
                      f"previous one, is shorter than a tar header or runs past the shard's "
                      f"{size} bytes")
        end = off + n
    if shard_bytes is not None and shard_bytes != size:
        raise bad(f"it is for a shard of {size} bytes, the shard has {shard_bytes} (stale)")
    return ShardIndex(size, sha, tuple(offsets), tuple(sizes))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_index(url: str, *, retries: int = remote.RETRIES,
               backoff_s: float = remote.BACKOFF_S) -> ShardIndex:
    """The validated index of shard ``url`` (read from ``index_url(url)``, local or remote).
    Raises ``ShardIndexError`` saying how to make one when it is missing."""
    where = index_url(url)
    try:
        with remote.open_shard(where, retries=retries, backoff_s=backoff_s) as f:
            data = f.read(MAX_INDEX_BYTES + 1)
    except (FileNotFoundError, remote.RemoteReadError) as exc:
        raise ShardIndexError(f"shard {url} has no readable index at {where} ({exc}); write "
                              "one with `python -m pooled_loader shards index PATTERN`") from exc
    local = url[len("file://"):] if url.startswith("file://") else url
    size = os.path.getsize(local) if "://" not in local and os.path.isfile(local) else None
    return parse_index(data, where, size)
