#!/usr/bin/env python
"""What issue 35's checks cost on the hot paths: token items and global-shuffle reads.

    python scripts/benchmarks/bench_checks.py [--rounds 7] [--part all|tokens|shuffle]

- Token items: ``TokenDataset`` reads each item with one ``pread`` (a file cut short is an
  error, not a SIGBUS): into the slot row itself under PooledLoader (``getitem_into``), into
  one array per batch through ``__getitems__`` (DataLoader's batched fetch), else into an array
  of its own; before (79c5d7b), an item was a view of a memory map checked with one ``fstat``
  (``MappedTokens`` below, that code copied). Timed as: three epochs of
  ``PooledLoader(batch_size=32, num_workers=2, shuffle=True)`` (persistent workers, the
  default collate) over windows of 2048 tokens and over documents of 20-600 tokens (uint16,
  ``collate.packed()``); alone, batches of 32 random items fetched as DataLoader fetches them
  and stacked into one array in the main process (the view's copy happens there); one item
  alone (dropped at once), and one item written into a row of a batch array (``getitem_into``
  against the view copied in, as a worker writes a slot), in microseconds. The file is in
  the page cache.
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

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench_wds import cpu_seconds  # noqa: E402 - this folder is the script's sys.path[0]
from pooled_loader.shards.index import load_index, read_sample, write_index  # noqa: E402
from pooled_loader.shards.samples import shard_samples  # noqa: E402
from pooled_loader.tokens import TokenDataset, write_tokens  # noqa: E402

BATCH = 32


class MappedTokens(TokenDataset):
    """The read before issue 35 (79c5d7b's ``TokenDataset.__getitem__``): items are views of a
    memory map, one fstat per item; no ``getitem_into``, no ``__getitems__``."""

    getitem_into = None  # the loader then calls __getitem__ and copies the view into the slot
    __getitems__ = None

    def _mapped(self) -> np.ndarray:
        if self.__dict__.get("_map") is None:
            self._mapped_file = open(self.path + ".bin", "rb")
            self._map = np.memmap(self._mapped_file, dtype=self.dtype, mode="r").view(
                np.ndarray)
        if os.fstat(self._mapped_file.fileno()).st_size < self.num_tokens * self.dtype.itemsize:
            raise ValueError(f"{self.path}.bin: the file shrank")
        return self._map

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} items of {self.path}")
        i %= n
        if self.seq_len is not None:
            start = i * self.stride
            return self._mapped()[start:start + self.seq_len]
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.max_len is not None:
            end = min(end, start + self.max_len)
        return self._mapped()[start:end]

    def __getstate__(self) -> dict:
        return {k: v for k, v in super().__getstate__().items()
                if k not in ("_map", "_mapped_file")}


def loader_epoch(loader, epochs: int = 3) -> int:
    """Batches of ``epochs`` epochs (several, so that a round's CPU time is well above the
    10 ms resolution of the workers' CPU clocks)."""
    return sum(1 for _ in range(epochs) for _ in loader)


def token_batches(items, order) -> int:
    """Batches of BATCH items stacked into one array, fetched as DataLoader fetches them
    (``__getitems__`` when the dataset has one)."""
    total = 0
    fetch = items.__getitems__ or (lambda ids: [items[i] for i in ids])
    for k in range(0, len(order) - BATCH + 1, BATCH):
        batch = fetch(order[k:k + BATCH])
        if batch[0].shape == batch[-1].shape and all(len(b) == len(batch[0]) for b in batch):
            total += int(np.stack(batch)[:, 0].sum())
        else:
            total += int(np.concatenate(batch)[:1].sum())
    return total


def items_into_rows(ds, idx, rows) -> None:
    """Each item written into a row of a batch array, as a PooledLoader worker writes a slot:
    ``getitem_into`` reads straight into the row; a view is copied into it."""
    into = ds.getitem_into
    if into is not None:
        for j, i in enumerate(idx):
            into(i, rows[j % BATCH])
    else:
        for j, i in enumerate(idx):
            rows[j % BATCH] = ds[i]


def items_dropped(ds, idx) -> None:
    for i in idx:
        ds[i]


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
    ap.add_argument("--part", choices=["all", "tokens", "shuffle"], default="all")
    args = ap.parse_args()
    from pooled_loader import PooledLoader
    from pooled_loader.collate import packed
    rows, micro = [], []
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(1)
        path = os.path.join(d, "tok")
        write_tokens(path, (rng.integers(0, 50000, int(n), dtype=np.uint16)
                            for n in rng.integers(20, 600, 16000)), dtype=np.uint16)
        for name, kw, collate in () if args.part == "shuffle" else (("windows of 2048 (stride 256)",
                                   {"seq_len": 2048, "stride": 256}, None),
                                  ("documents of 20-600", {}, packed())):
            built = [PooledLoader(cls(path, **kw), batch_size=BATCH, num_workers=2,
                                  shuffle=True, persistent_workers=True, collate_fn=collate)
                     for cls in (TokenDataset, MappedTokens)]
            rows.append((f"PooledLoader epoch, token {name} ({len(built[0].dataset)} items)",
                         *interleaved(args.rounds, *(lambda ld=ld: loader_epoch(ld)
                                                     for ld in built), clock=cpu_seconds)))
            del built
        for name, kw in () if args.part == "shuffle" else (
                ("windows of 2048", {"seq_len": 2048}), ("documents of 20-600", {})):
            new_ds, old_ds = TokenDataset(path, **kw), MappedTokens(path, **kw)
            order = list(rng.permutation(len(new_ds)))
            rows.append((f"items alone, token {name} ({len(order)} items)",
                         *interleaved(args.rounds, lambda: token_batches(new_ds, order),
                                      lambda: token_batches(old_ds, order))))
            if kw:  # the same code against itself: how far apart this machine puts equals
                rows.append(("  noise floor: before / before, token windows",
                             *interleaved(args.rounds, lambda: token_batches(old_ds, order),
                                          lambda: token_batches(old_ds, order))))
        for name, kw in () if args.part == "shuffle" else (
                ("window of 2048", {"seq_len": 2048}), ("document", {})):
            new_ds, old_ds = TokenDataset(path, **kw), MappedTokens(path, **kw)
            idx = [int(i) for i in rng.permutation(len(new_ds))[:2000]]
            per_item = interleaved(args.rounds * 2, lambda: items_dropped(new_ds, idx),
                                   lambda: items_dropped(old_ds, idx))
            micro.append(f"one token {name} alone: {per_item[0] / len(idx) * 1e6:.2f} µs read, "
                         f"{per_item[1] / len(idx) * 1e6:.2f} µs as a view after an fstat "
                         f"(medians; {per_item[0] / per_item[1]:.3f}x)")
            if kw:
                rows_buf = np.empty((BATCH, 2048), new_ds.dtype)
                per_item = interleaved(args.rounds * 2,
                                       lambda: items_into_rows(new_ds, idx, rows_buf),
                                       lambda: items_into_rows(old_ds, idx, rows_buf))
                micro.append(f"one token {name} into a batch row: "
                             f"{per_item[0] / len(idx) * 1e6:.2f} µs getitem_into, "
                             f"{per_item[1] / len(idx) * 1e6:.2f} µs view + copy "
                             f"(medians; {per_item[0] / per_item[1]:.3f}x)")
        if args.part != "tokens":
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
    print("\nOne item, 2000 random items a round, CPU time:\n" + "\n".join(micro))
    return 0


if __name__ == "__main__":
    sys.exit(main())
