"""The samples of a WebDataset shard set: which shards a pattern names, how a shard's tar members
group into samples, how many samples a shard holds and where sample ``n`` begins.

Grouping follows ``webdataset.tariterators`` exactly (``group_by_keys`` and the members its
``tar_file_iterator`` leaves out), so this reader, the counts, the shard indexes
(pooled_loader.shards.index) and ``webdataset`` itself agree on what a sample is. Tar headers are
read by ``pooled_loader.shards.tar`` (checked and bounded: a corrupt or truncated shard is an
error, never a hang or silently lost samples); shard bytes come through
``pooled_loader.shards.remote.open_shard`` (local, ``http(s)://``, ``pipe:``, fsspec, with retries).

Counting a local ``.tar`` reads its tar headers only (the data is seeked over); other URLs are
read once. Counts are cached per process by path, size and mtime (``COUNT_CACHE``).

Which samples each (rank, worker) reads, and in what order, is pooled_loader.webdataset's job.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator, Optional, Sequence, Union

from . import remote
from ..core.constants import MAX_SAMPLE_BYTES
from ..core.errors import SampleError, ShardFormatError, ShardIndexError
from ..core.safe_open import open_regular
from .urls import base_plus_ext, expand_urls, local_path
from .tar import Member, TarReader

__all__ = ["expand_shards", "shard_samples", "count_samples", "count_shard",
           "local_sample_offset", "local_sample_starts", "is_local_tar", "error_reason",
           "COUNT_CACHE", "Sample", "Urls"]

Sample = dict[str, Any]
Urls = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]

COUNT_CACHE: dict[tuple, int] = {}  # (abspath, size, mtime) or (url,) -> samples
# A shard's index (pooled_loader.shards.index) is the sibling URL + this; here, with index_url,
# so that an error about a shard that does not fit its index can name both
INDEX_SUFFIX = ".idx.json"
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # tar_file_iterator's default skip_meta


def expand_shards(urls: Urls) -> list[str]:
    """Shard URLs from a brace pattern (``data-{0000..0099}.tar``, ``a.tar::b.tar``), a directory
    (its ``*.tar`` files, sorted) or a list of either."""
    items = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.isdir(item):
            out.extend(sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(".tar")))
        else:
            out.extend(expand_urls(item))
    if not out:
        raise ValueError(f"no shards in {urls!r}")
    return out


def error_reason(exc: BaseException) -> str:
    """A short reason for an error, to follow the shard's name (``"OSError: No such file"``)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    if isinstance(exc, ShardFormatError):  # the caller names the shard
        return exc.detail
    if isinstance(exc, KeyError) and exc.args:
        return f"KeyError: {exc.args[0]!r}"
    first = exc.args[0] if exc.args else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _not_a_sample_file(info: Member) -> bool:
    """Members ``webdataset.tariterators.tar_file_iterator`` leaves out: not regular files, and
    metadata (``__name__`` at the top level, or matching its ``skip_meta`` pattern)."""
    name = info.name
    return (not info.isreg() or ("/" not in name and name.startswith("__") and name.endswith("__"))
            or bool(_SKIP_META.match(name)))


def index_url(url: str) -> str:
    """Where the index of shard ``url`` lives (a sibling with the ``.idx.json`` suffix)."""
    return url + INDEX_SUFFIX


def is_local_tar(url: str) -> bool:
    """An uncompressed tar on this machine (a path or ``file://`` URL: ``urls.local_path``): its
    byte offsets are file offsets, so it can be seeked."""
    path = local_path(url)
    return path is not None and path.endswith(".tar")


def shard_samples(url: str, offset: Optional[int] = 0, *, retries: int = remote.RETRIES,
                  backoff_s: float = remote.BACKOFF_S, end: Optional[int] = None,
                  size: Optional[int] = None, max_sample_bytes: Optional[int] = None
                  ) -> Iterator[tuple[Sample, Any, Any]]:
    """``(sample, start, next)`` for the samples of one shard from byte ``offset`` (the start of
    a sample's first member), grouped as ``webdataset.tariterators.group_by_keys`` groups them.

    ``start``/``next`` are the byte offsets where this sample and the next one begin, or ``None``
    for a compressed shard (its offsets are not file offsets; such a shard resumes by re-reading
    and skipping whole samples). ``end``: read no byte from there on. ``size``: the shard's
    size as its index records it; a shard (or server) that reports another raises
    ``ShardIndexError``. ``max_sample_bytes``: the most member data one sample may hold
    (default ``core.constants.MAX_SAMPLE_BYTES``), checked from the headers before a member's data
    is read. Other errors propagate."""
    base = offset or 0
    bound = MAX_SAMPLE_BYTES if max_sample_bytes is None else max_sample_bytes
    stream = remote.open_shard(url, base, retries=retries, backoff_s=backoff_s, end=end)
    try:
        got = stream.raw.size
        if size is not None and got is not None and got != size:
            raise ShardIndexError(f"shard {url} has {got} bytes, its index was made for {size}: "
                                  f"the shard changed since it was indexed; rebuild the index "
                                  f"{index_url(url)} (`python -m pooled_loader shards index "
                                  "PATTERN`)")
        if base and not stream.peek(1):
            return  # resumed at the very end
        tar = TarReader(stream, url, base=base, sliced=end is not None)
        plain = tar.plain
        sample: Optional[Sample] = None
        start: Optional[int] = None
        held = 0  # member bytes of `sample`
        for info in tar:
            name = info.name
            if _not_a_sample_file(info):
                continue
            prefix, suffix = base_plus_ext(name)
            if prefix is None:
                continue
            here = info.offset if plain else None
            if sample is None or prefix != sample["__key__"]:
                if sample is not None:
                    yield sample, start, here
                sample, start, held = {"__key__": prefix, "__url__": url}, here, 0
            suffix = suffix.lower()
            if suffix in sample:
                raise ShardFormatError(url, f"{name}: duplicate file name in the shard")
            held += info.size
            if held > bound:  # from the headers, before the data is read (or decompressed)
                raise ShardFormatError(url, sample_too_big(prefix, name, held, bound,
                                                           info.data_offset))
            sample[suffix] = tar.read(info)
        if sample is not None:
            yield sample, start, (tar.end if plain else None)
    finally:
        stream.close()


def sample_too_big(key: str, member: str, held: int, bound: int, at: int) -> str:
    """Why a sample is refused: its members' bytes pass ``bound`` (what to raise, and how)."""
    return (f"sample {key!r}: member {member!r} brings it to {held} bytes, more than the "
            f"{bound} one sample may hold in memory (max_sample_bytes: raise it with "
            "WebDataset(max_sample_bytes=...) or `shards index --max-sample-bytes` if such "
            f"samples are meant), at byte {at}")


def _open_tar(url: str) -> Any:
    """The local tar ``url`` names (``is_local_tar``) opened for reading, if it is a regular
    file (a FIFO would block in open(), a link to /dev/zero never end): ``UnsafeFileError``
    naming it otherwise."""
    return os.fdopen(open_regular(local_path(url) or url, follow=True, what="local shard"), "rb")


def _scan_local_tar(url: str) -> tuple[int, Optional[str]]:
    """Count a local tar's samples from its headers alone, grouping names exactly as
    ``webdataset.tariterators.group_by_keys`` does. Returns ``(count, error)``; on a truncated or
    corrupt tar, ``count`` is what ``webdataset`` yields before it fails (the sample in progress
    when the read fails is lost)."""
    count, last = 0, None
    try:
        with _open_tar(url) as f:
            for info in TarReader(f, url):  # checks that each member lies inside the file
                if _not_a_sample_file(info):
                    continue
                prefix, _ = base_plus_ext(info.name)
                if prefix is not None and prefix != last:
                    count, last = count + 1, prefix
    except (ShardFormatError, OSError) as exc:
        return max(count - 1, 0), error_reason(exc)
    return count, None


def local_sample_offset(url: str, n: int) -> Optional[int]:
    """Byte offset where sample ``n`` of a local tar (a path or ``file://`` URL) begins, from
    its headers alone (the data is seeked over), or ``None`` if it cannot be found (read the
    shard instead)."""
    count, last = 0, None
    try:
        with _open_tar(url) as f:
            for info in TarReader(f, url):
                if _not_a_sample_file(info):
                    continue
                prefix, _ = base_plus_ext(info.name)
                if prefix is not None and prefix != last:
                    if count == n:
                        return info.offset
                    count, last = count + 1, prefix
    except (ShardFormatError, OSError):
        pass
    return None


def local_sample_starts(url: str) -> Optional[list[int]]:
    """Byte offsets where each sample of a local tar begins, then where its end-of-archive
    marker begins, from its headers alone (None if the shard cannot be read to its end)."""
    starts, last = [], None
    try:
        with _open_tar(url) as f:
            reader = TarReader(f, url)
            for info in reader:
                prefix = None if _not_a_sample_file(info) else base_plus_ext(info.name)[0]
                if prefix is not None and prefix != last:
                    starts.append(info.offset)
                    last = prefix
    except (ShardFormatError, OSError):
        return None
    return None if reader.end is None else starts + [reader.end]


def count_samples(url: str) -> int:
    """Number of samples ``webdataset`` yields from one shard (cached per process).

    Raises ``SampleError`` naming the shard when it is missing, truncated or unreadable."""
    count, error = count_shard(url)
    if error:
        raise SampleError(f"shard {url}: {error}")
    return count


def count_shard(url: str, **stream_opts: Any) -> tuple[int, Optional[str]]:
    """``(count, error)`` of one shard, cached per process: ``error`` (None when it read to the
    end) says why the count stopped early; ``stream_opts`` go to ``remote.open_shard``."""
    if is_local_tar(url):
        path = local_path(url) or url
        try:
            st = os.stat(path)
        except OSError as exc:
            return 0, error_reason(exc)
        key: tuple = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    else:
        key = (url,)
    if key in COUNT_CACHE:
        return COUNT_CACHE[key], None
    if is_local_tar(url):
        count, error = _scan_local_tar(url)
    else:
        count, error = 0, None
        try:
            for _ in shard_samples(url, **stream_opts):
                count += 1
        except Exception as exc:  # noqa: BLE001 - reported with the shard name
            error = error_reason(exc)
    if error is None:
        COUNT_CACHE[key] = count
    return count, error
