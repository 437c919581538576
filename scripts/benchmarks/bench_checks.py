#!/usr/bin/env python
"""What issue 35's checks cost on the hot paths: token items and global-shuffle reads.

    python scripts/benchmarks/bench_checks.py [--rounds 7]

- Token items: ``TokenDataset`` reads each item with one ``pread`` into an array of its own
  (a file cut short is an error, not a SIGBUS); before, an item was a view of a memory map
  checked with one ``fstat`` (``MappedTokens`` below does that). Timed two ways: an epoch of
  ``PooledLoader(batch_size=32, num_workers=2, shuffle=True)`` (persistent workers, the
  default collate) over windows of 2048 tokens and over documents of 20-600 tokens (uint16,
  ``collate.packed()``), and, alone, batches of 32 random items stacked into one array in the
  main process (the view's copy happens there), and one item alone in microseconds (the
  fastest of 15 repeats). The file is in the page cache.
- Global-shuffle reads: ``shard_index.read_sample`` (the shard's size against its index, exactly
  one sample in the slice, the first sample read from byte 0, the last with the end marker)
  against the read it replaced, ``shard_samples(path, offset, end=offset + size)``: every
  sample of 8 local shards of 250 samples (a 16 KiB and a 16-byte member each) in a random
  order, the shards in the page cache.

The two ways run interleaved (A B B A ...) so that load from other processes and drift fall on
both alike; the table gives the median CPU seconds per round (of this process and, for the
loader epochs, its workers: other processes' load disturbs CPU time much less than wall-clock
time on a shared machine) and the ratio checked / before, with the same code timed against itself
("noise floor") to show what differences this machine makes of equal work.
"""
from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import sys
import tarfile
import tempfile
import time
import timeit

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench_wds import cpu_seconds  # noqa: E402 - this folder is the script's sys.path[0]
from pooled_loader.shard_index import load_index, read_sample, write_index  # noqa: E402
from pooled_loader.shard_samples import shard_samples  # noqa: E402
from pooled_loader.tokens import TokenDataset, write_tokens  # noqa: E402

BATCH = 32


class MappedTokens(TokenDataset):
    """The read before issue 35: items are views of a memory map, one fstat per item."""

    def _tokens(self, start: int, end: int) -> np.ndarray:
        if self.__dict__.get("_map") is None:
            self._mapped_file = open(self.path + ".bin", "rb")
            self._map = np.memmap(self._mapped_file, dtype=self.dtype, mode="r").view(
                np.ndarray)
        if os.fstat(self._mapped_file.fileno()).st_size < self.num_tokens * self.dtype.itemsize:
            raise ValueError(f"{self.path}.bin: the file shrank")
        return self._map[start:end]

    def __getstate__(self) -> dict:
        return {k: v for k, v in super().__getstate__().items()
                if k not in ("_map", "_mapped_file")}


def loader_epoch(loader) -> int:
    return sum(1 for _ in loader)


def token_batches(items, order) -> int:
    total = 0
    for k in range(0, len(order) - BATCH + 1, BATCH):
        batch = [items[i] for i in order[k:k + BATCH]]
        if batch[0].shape == batch[-1].shape and all(len(b) == len(batch[0]) for b in batch):
            total += int(np.stack(batch)[:, 0].sum())
        else:
            total += int(np.concatenate(batch)[:1].sum())
    return total


def make_shards(root: str, shards: int, per_shard: int) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for s in range(shards):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for k in range(per_shard):
                for ext, data in (("jpg", rng.bytes(16 << 10)), ("cls", b"%d" % (k % 10))):
                    info = tarfile.TarInfo(f"{s:02d}{k:05d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        path = os.path.join(root, f"s-{s:02d}.tar")
        with open(path, "wb") as f:
            f.write(out.getvalue())
        write_index(path)
        paths.append(path)
    return paths


def read_checked(paths, indexes, order) -> int:
    return sum(len(read_sample(paths[s], indexes[s], i)["jpg"]) for s, i in order)


def read_before(paths, indexes, order) -> int:
    total = 0
    for s, i in order:
        off, n = indexes[s].offsets[i], indexes[s].sizes[i]
        samples = shard_samples(paths[s], off, end=off + n)
        total += len(next(samples)[0]["jpg"])
        samples.close()
    return total


def interleaved(rounds: int, a, b, clock=time.process_time) -> tuple[float, ...]:
    """Median and fastest round of ``a`` and of ``b``: (median a, median b, min a, min b)."""
    times: tuple[list, list] = ([], [])
    assert a() == b()  # the same work, and a warm-up of both
    for r in range(rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            t = clock()
            (a, b)[k]()
            times[k].append(clock() - t)
    return (statistics.median(times[0]), statistics.median(times[1]), min(times[0]),
            min(times[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    from pooled_loader import PooledLoader
    from pooled_loader.collate import packed
    rows, micro = [], []
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(1)
        path = os.path.join(d, "tok")
        write_tokens(path, (rng.integers(0, 50000, int(n), dtype=np.uint16)
                            for n in rng.integers(20, 600, 16000)), dtype=np.uint16)
        for name, kw, collate in (("windows of 2048 (stride 256)",
                                   {"seq_len": 2048, "stride": 256}, None),
                                  ("documents of 20-600", {}, packed())):
            built = [PooledLoader(cls(path, **kw), batch_size=BATCH, num_workers=2,
                                  shuffle=True, persistent_workers=True, collate_fn=collate)
                     for cls in (TokenDataset, MappedTokens)]
            rows.append((f"PooledLoader epoch, token {name} ({len(built[0].dataset)} items)",
                         *interleaved(args.rounds, *(lambda ld=ld: loader_epoch(ld)
                                                     for ld in built), clock=cpu_seconds)))
            del built
        for name, kw in (("windows of 2048", {"seq_len": 2048}), ("documents of 20-600", {})):
            new_ds, old_ds = TokenDataset(path, **kw), MappedTokens(path, **kw)
            order = list(rng.permutation(len(new_ds)))
            rows.append((f"items alone, token {name} ({len(order)} items)",
                         *interleaved(args.rounds, lambda: token_batches(new_ds, order),
                                      lambda: token_batches(old_ds, order))))
            if kw:  # the same code against itself: how far apart this machine puts equals
                rows.append(("  noise floor: before / before, token windows",
                             *interleaved(args.rounds, lambda: token_batches(old_ds, order),
                                          lambda: token_batches(old_ds, order))))
        for name, kw in (("window of 2048", {"seq_len": 2048}), ("document", {})):
            per_item = []
            for ds in (TokenDataset(path, **kw), MappedTokens(path, **kw)):
                idx = [int(i) for i in rng.permutation(len(ds))[:2000]]
                best = min(timeit.repeat(lambda: [ds[i] for i in idx], number=5, repeat=15))
                per_item.append(best / (5 * len(idx)) * 1e6)
            micro.append(f"one token {name}: {per_item[0]:.2f} µs read, {per_item[1]:.2f} µs "
                         f"as a view after an fstat ({per_item[0] - per_item[1]:+.2f} µs)")
        paths = make_shards(d, 8, 250)
        indexes = [load_index(p) for p in paths]
        order = [(s, i) for s, ix in enumerate(indexes) for i in range(len(ix))]
        random.Random(2).shuffle(order)
        rows.append((f"global-shuffle reads ({len(order)} samples, local)",
                     *interleaved(args.rounds, lambda: read_checked(paths, indexes, order),
                                  lambda: read_before(paths, indexes, order))))
        rows.append(("  noise floor: before / before, global-shuffle reads",
                     *interleaved(args.rounds, lambda: read_before(paths, indexes, order),
                                  lambda: read_before(paths, indexes, order))))
    print("| path | checked (s, median) | before (s, median) | checked / before, median | "
          "fastest rounds |\n|---|---:|---:|---:|---:|")
    for name, new_t, old_t, new_min, old_min in rows:
        print(f"| {name} | {new_t:.4f} | {old_t:.4f} | {new_t / old_t:.3f} | "
              f"{new_min / old_min:.3f} |")
    print("\nFastest of 15 repeats, 2000 random items each (wall-clock):\n" + "\n".join(micro))
    return 0


if __name__ == "__main__":
    sys.exit(main())
