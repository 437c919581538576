"""Cache the deterministic front of a pipeline in one memory-mapped file.

    build_cache(ImageFolder(root, transform=Compose([DecodeImage(), Resize(max_side=512)])),
                "train.plc", num_workers=2)
    ds = CachedDataset("train.plc", transform=Compose([RandomResizedCrop(224),
                                                       RandomHorizontalFlip(), ToCHW()]))
    loader = PooledLoader(ds, batch_size=256, shuffle=True, num_workers=2)

``build_cache`` runs ``dataset[i]`` once per index (``variants`` times with distinct seeds when
the dataset's transform is random), and stores every sample in one file (format:
``pooled_loader.cache.format``). The build runs on ``PooledLoader``'s worker processes (or in
this process when ``num_workers=0``): they write records straight into the file and send the
main process only their index entries, so sample data is never pickled; a failing sample is
reported with its index, file, worker and traceback, and workers exit with the main process.
The build goes to ``path + ".partial"`` with a journal ``path + ".partial.journal"`` of finished
records; an interrupted build (Ctrl-C, crash, SIGKILL) resumes from the journal on the next call
with the same dataset fingerprint, and the finished file appears at ``path`` atomically (fsync,
``os.replace``).

Bad samples. ``on_error="raise"`` (default): the first sample the dataset fails on stops the
build with ``CacheSampleError`` (index, file, reason; the worker's traceback as its cause).
``on_error="skip"``: failed samples are left out and recorded in the header (source index, path,
reason; ``CachedDataset.skipped``), and the cache is *renumbered*: ``len()`` counts the stored
samples, indices are dense, every sample keeps its own label, and
``CachedDataset.source_indices`` maps back to the source's indices. (Keeping source indices
would leave holes that every sampler would have to avoid.) Skipped samples are retried when an
interrupted build resumes.

Resume after a fix. Each journal row records the identity of its source sample (path under the
root, size, mtime, label). When the source's fingerprint changed, the build still resumes if
only samples without a finished record changed (a bad file fixed, replaced or removed, files
added): finished rows are renumbered to the current listing. A change to an already cached file
or label, to the transform, dataset class, seed or variants starts afresh, with a warning that
says why. Records kept across such a resume keep the seeds of the index they were built at.

``CachedDataset`` maps the file read-only and hands the transform numpy views of the records (no
copy); ``getitem_into`` lets the transform's last op write straight into the loader's batch slot.

Seeds. Record ``(index, k)`` is produced with ``random``, ``numpy.random`` and ``torch`` seeded
from ``SeedSequence([seed, index, k])``. Epoch ``e`` reads variant
``f(seed, e, index) = (e + splitmix64(seed * 2**32 + index)) % variants``: each sample cycles
through all its variants once every ``variants`` epochs, starting at a per-sample offset.
"""
from .build import MAX_FAILURES_BEFORE_FIRST_SUCCESS, ON_ERROR, build_cache
from .cli import main
from .dataset import CachedDataset
from .fingerprint import dataset_fingerprint, fingerprint_info, variant_for_epoch
from .format import (CacheError, CacheFormatError, CacheIncompleteError, CacheMismatchError,
                     CacheRecordError, CacheSampleError, partial_progress)

__all__ = ["build_cache", "CachedDataset", "dataset_fingerprint", "variant_for_epoch",
           "partial_progress", "main",
           "CacheError", "CacheFormatError", "CacheIncompleteError", "CacheMismatchError",
           "CacheRecordError", "CacheSampleError"]
