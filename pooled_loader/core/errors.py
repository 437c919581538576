"""Every exception of pooled_loader: the loader's, the datasets' and the cache's (``Cache*``).

They live here, below every other module, so that any module (and the one-line error rule in
``_cli``) can name them without importing the module that raises them."""


class SampleError(Exception):
    """A sample could not be produced: the message names the sample (file, shard/key) and why.

    With ``on_error="skip"`` the loader skips samples whose loading raised this (or any other
    exception) and counts them in ``loader.stats()``.
    """


class ShardFormatError(SampleError):
    """A tar shard is malformed or truncated; the message names the shard and the byte offset
    (``detail`` holds the message without the shard's name)."""

    def __init__(self, shard: str, detail: str) -> None:
        super().__init__(f"{shard}: {detail}")
        self.shard, self.detail = shard, detail

    def __reduce__(self):  # pickles (a worker's error) with both arguments
        return type(self), (self.shard, self.detail)


class ShardIndexError(SampleError):
    """A shard index that is missing, too large, malformed or does not fit its shard (also as
    ``pooled_loader.shards.index.ShardIndexError``). Raised even with ``on_error="skip"`` when
    found while reading: skipping would make the reader repeat other samples in their place (a
    stale index found when the dataset is made is a counted skip there, the shard left out)."""


class WorkerError(RuntimeError):
    """A worker process died or stopped answering."""


class PoolAllocationError(MemoryError):
    """The batch pool could not get (or a worker could not map) more shared memory: the message
    names the limit in force (``ulimit -v``, ``ulimit -n``, ...) and what to change."""


class StateMismatch(ValueError):
    """A saved loader state that does not fit this loader (or is corrupt); the message says
    what (also as ``pooled_loader.resume.StateMismatch``)."""


class ClassMismatchError(ValueError):
    """Two datasets (an ImageFolder and shards or a cache made from a folder) number their
    classes differently, so the same label would mean different classes."""


class CacheError(Exception):
    """A cache file cannot be used; the message names the file, the problem and the remedy."""


class CacheFormatError(CacheError):
    """Not a cache file, another format version, a truncated file or a corrupted header/record."""


class CacheRecordError(CacheFormatError, SampleError):
    """One record fails its checksum (a SampleError: the loader's ``on_error="skip"`` skips it)."""


class CacheIncompleteError(CacheError):
    """The cache was never finished: only an unfinished ``.partial`` build exists."""


class CacheMismatchError(CacheError):
    """The cache was built from another dataset or transform than the one it is used with."""


class CacheSampleError(CacheError):
    """A build stopped because the source dataset failed on one sample.

    ``index`` and ``variant`` name the sample, ``file`` its source file (None when the dataset
    has no ``samples`` list), ``reason`` the error in a few words; the exception's cause carries
    the traceback from the process that ran the sample.
    """

    def __init__(self, message: str, *, index: int, variant: int, file: str | None,
                 reason: str, kept: int) -> None:
        super().__init__(message)
        self.index, self.variant, self.file, self.reason = index, variant, file, reason
        self.kept = kept  # finished records kept for the resume


class SkipBudgetExceeded(RuntimeError):
    """``on_error="skip"`` skipped more samples than its budget allows (``max_skip_fraction`` of
    the epoch, or ``max_consecutive_skips`` in a row): the message names the last ones. A broken
    mount or a bad shard set fails the run instead of turning into an epoch of skips."""
