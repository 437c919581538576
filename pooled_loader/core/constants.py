"""Policy numbers shared by several modules, each with its unit and the reason for its value.

One place, so that the loader, the tuner, the pool and the cache cannot drift apart (they did:
the bottleneck share and the default pool size were each written twice). Numbers that only one
module uses and that explain themselves there stay in that module.
"""
from __future__ import annotations

ALIGN = 64
"""Bytes. Alignment of every array leaf in a slot (`layout.place`) and of every record and index
array in a cache file (`cache/format.py`): one cache line, and a multiple of every dtype's itemsize
and of a 512-bit SIMD load. Cache readers use the offsets stored in the file, so changing this
would not make old caches unreadable; it would only change the layout of new ones."""

FIRST_SLOT_BYTES = 4096
"""Bytes. Slot size of the pool before the first batch is seen: one page. The first batch larger
than this replaces the slots by ones of its size class (`size_classes.py`), so the value only
has to be small, not right."""

DRY_GROWTH_MIN_SLOTS = 2
"""Slots. When every slot is in use (the user keeps batches), the pool adds an arena of half as
many slots as it has (it grows by 1.5x, so a steadily leaking user costs O(log n) arenas), and at
least this many, so that a tiny pool does not grow one slot at a time."""

DRY_GROWTH_DIVISOR = 2
"""Ratio. The arena added when the pool runs dry holds `live slots // DRY_GROWTH_DIVISOR` slots."""

BOTTLENECK_WAIT_SHARE = 0.1
"""Fraction of wall time. When the training loop spends more than this share of its time waiting
for batches, the loader is called the bottleneck (`PooledLoader.report`, `tune`). Below it the
wait is within the noise of a loaded machine and the training step dominates."""

DEFAULT_PREFETCH_FACTOR = 2
"""Batches per worker in flight when `prefetch_factor` is not given (as torch's DataLoader)."""

SMALL_LEAF_BYTES = 64 * 1024
"""Bytes. Batch leaves up to this size and at most 1/SMALL_LEAF_SHARE of their batch (labels,
ids, lengths beside images) are copied out of their slot when handed out (unless the pool is
pinned), so keeping only them does not keep the slot from reuse."""

SMALL_LEAF_SHARE = 16

SMALL_BATCH_BYTES = 4096
"""Bytes. A batch whose leaves total at most this is copied out of its slot whole."""

DEFAULT_POOL_EXTRA_SLOTS = 2
"""Slots. Pool slots beyond the batches in flight: the batch the training step is using and the one
the loader hands out next, so workers never wait for a slot in a loop that drops its batches."""


def default_pool_slots(num_workers: int, prefetch_factor: int | None,
                       extra: int = DEFAULT_POOL_EXTRA_SLOTS) -> int:
    """Pool slots for a loader: the batches in flight (`num_workers * prefetch_factor`, or 1 when
    batches are built in the main process) plus `extra`."""
    if not num_workers:
        return 1 + extra
    return num_workers * (prefetch_factor or DEFAULT_PREFETCH_FACTOR) + extra


PR_SET_PDEATHSIG = 1
"""Linux `prctl` option (`<linux/prctl.h>`): the signal a process gets when its parent dies.
Workers ask for SIGKILL, so a killed main process leaves no orphan workers."""

REPLACEMENT_REDRAWS = 64
"""Draws. With `on_error="skip"`, how many times a worker redraws a replacement index that it has
already seen fail before trying it anyway: bounded, so a dataset of mostly bad samples cannot
spin, and large enough that a few bad samples are almost never drawn twice."""


def round_up(n: int, to: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `to` (bytes, by default to `ALIGN`)."""
    return (n + to - 1) // to * to


MAX_WORLD_SIZE = 1 << 18
"""Ranks. The largest world size a loaded or merged state may name (262,144: above the largest
training jobs reported, about 100,000 GPUs in 2025). Merging states and re-dealing an epoch cost
a little per rank (a range list each: about 40 us per rank, so 10 s for a lockstep merge at this
bound on 2 shared cores, and as much again to load it), so a hostile `world_size` of 10**12 ran
out of memory after minutes; this bound makes it an error at once."""

REMOTE_MIN_BYTES_PER_S = 1024
"""Bytes per second. A remote shard's connection keeps up while the bytes it delivered since it
last kept up cover this rate over the time spent waiting since (`remote.ResilientStream`); one
that goes a `REMOTE_RATE_WINDOW_S` window without keeping up is treated as stalled: dropped and
reopened at the byte reached, like a reset, counting against `retries`. The per-read timeout
alone lets a server that trickles a byte every few seconds hold a reader forever; 1 KiB/s is far
below any link worth reading from (a 100 MB shard would take a day). Read when a stream opens,
so a slower link can lower it here (`pooled_loader.core.constants.REMOTE_MIN_BYTES_PER_S = ...`,
or `open_shard(min_bytes_per_s=...)`)."""

REMOTE_RATE_WINDOW_S = 30.0
"""Seconds of waiting (inside the stream's reads, connects and backoffs, not the consumer's time
between reads) a remote shard's connection may go without keeping up with
`REMOTE_MIN_BYTES_PER_S`: a slow start (TCP slow start, a cold object store) is not a stall. The
window used is `min(REMOTE_RATE_WINDOW_S, timeout_s)` (`open_shard(rate_window_s=...)` sets it
outright), so a caller's short timeout also shortens it. The bound on a trickling server: each
connection is dropped after one window, and the read fails after `remote.STALL_WINDOWS` (3)
windows without progress in all, whatever `retries` remain: 6 s for `open_shard(url,
timeout_s=2)`, 90 s for datasets (`timeout_s` 60)."""

MAX_SAMPLE_BYTES = 256 << 20
"""Bytes. The default bound on the member data one sample of a tar shard may hold (256 MiB;
``WebDataset(max_sample_bytes=...)`` and ``shards index --max-sample-bytes`` change it per
dataset): a sample is held in memory whole, and a compressed shard makes gigabytes from
kilobytes (a 1 MiB ``.tar.gz`` can declare a 768 MiB member), so without a bound per sample a
small shard could claim any amount of memory. Checked from the tar headers before a member's
data is read (``shard_samples``): a refused member is never decompressed into memory."""

MAX_DECOMPRESSED_SHARD_BYTES = 1 << 34
"""Bytes. What a compressed (gzip, bzip2, xz) shard may expand to (16 GiB, above the 1-10 GB
shards WebDataset recommends). Every byte of a compressed stream is decompressed even when it is
skipped, and bzip2 and xz expand a few kilobytes of zeros to gigabytes, so this bounds the
time a decompression bomb can take (bzip2 expands zeros at about 65 MB/s here: 4 minutes). A
ratio limit would refuse real data: a tar of mostly-zero segmentation masks compresses 14000:1
with bzip2."""

MAX_TRAILING_BYTES = 1 << 22
"""Bytes. Zeros accepted after a tar's end-of-archive marker (4 MiB): tar pads an archive to a
whole record (10 KiB by default, 1 MiB with tar's `-b 2048`). More is refused without being
read: a 19 KiB bzip2 shard can hold 16 GiB of zeros there."""
