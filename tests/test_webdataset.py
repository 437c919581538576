"""pooled_loader.shards.webdataset and pooled_loader.shards.writer on real tar files, with real worker
processes (PooledLoader once the core has landed, torch's DataLoader before)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import types
import warnings
from collections import Counter

import numpy as np
import pytest
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader
from webdataset.tariterators import tarfile_samples

import pooled_loader.shards.webdataset as pwds
from pooled_loader import PooledLoader
from pooled_loader.shards import writer as shards
from pooled_loader.core.errors import SampleError
from pooled_loader.shards.plan import plan_piece, slot_share
from pooled_loader.shards.webdataset import WebDataset, count_samples, expand_shards

SIZES = [5, 41, 12, 1, 33, 20, 9]  # uneven on purpose; 121 samples


def make_shards(root, sizes, name="shard"):
    """Tar shards with consecutive global ids: key ``%06d``, ``.txt`` = id, ``.cls`` = id % 10."""
    os.makedirs(root, exist_ok=True)
    paths, gid = [], 0
    for s, size in enumerate(sizes):
        path = os.path.join(root, f"{name}-{s:04d}.tar")
        with wds.TarWriter(path, encoder=False, mtime=0) as w:
            for _ in range(size):
                w.write({"__key__": f"{gid:06d}", "txt": str(gid).encode(),
                         "cls": str(gid % 10).encode()})
                gid += 1
        paths.append(path)
    return paths


def sample_id(sample):
    """Transform: the sample's id (needs the ``txt`` extension)."""
    return int(sample["txt"])


def run_epoch(ds, epoch, num_workers=2, batch_size=4, cls=None):
    ds.set_epoch(epoch)
    loader = (cls or PooledLoader)(ds, batch_size=batch_size, num_workers=num_workers)
    return [[int(i) for i in batch] for batch in loader]


def flat(batches):
    return [i for b in batches for i in b]


def fake_worker(monkeypatch, wid, nworkers):
    info = types.SimpleNamespace(id=wid, num_workers=nworkers)
    monkeypatch.setattr(pwds, "get_worker_info", lambda: info)


@pytest.fixture
def shard_dir(tmp_path):
    make_shards(str(tmp_path / "s"), SIZES)
    return str(tmp_path / "s")


# -- reading and grouping --------------------------------------------------------------------
def test_groups_like_webdataset(tmp_path):
    path = str(tmp_path / "mixed.tar")
    with tarfile.open(path, "w") as tf:
        for name, data in [("__meta__", b"m"), ("a.jpg", b"1"), ("a.cls", b"0"), ("a.seg.png", b"2"),
                           ("dir/b.jpg", b"3"), ("noext", b"x"), ("c.JPG", b"4"), ("a.txt", b"5")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    expected = list(tarfile_samples([{"url": path}]))
    got = list(WebDataset(path, shuffle_shards=False))
    assert got == expected
    assert [s["__key__"] for s in got] == ["a", "dir/b", "c", "a"]
    assert got[0] == {"__key__": "a", "__url__": path, "jpg": b"1", "cls": b"0", "seg.png": b"2"}
    assert count_samples(path) == 4


def test_expand_shards_patterns(shard_dir):
    listed = sorted(os.path.join(shard_dir, f) for f in os.listdir(shard_dir))
    assert expand_shards(os.path.join(shard_dir, "shard-{0000..0006}.tar")) == listed
    assert expand_shards(shard_dir) == listed
    assert expand_shards(listed[:2]) == listed[:2]
    assert expand_shards(f"{listed[0]}::{listed[1]}") == listed[:2]
    with pytest.raises(ValueError):
        expand_shards([])


def test_counts_and_len(shard_dir, monkeypatch):
    ds = WebDataset(shard_dir)
    assert ds.shard_sizes == SIZES and ds.samples_per_epoch == 121 and len(ds) == 121
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert len(ds) == 40
    assert len(WebDataset(shard_dir, samples_per_epoch=90)) == 30


# -- splitting and order ---------------------------------------------------------------------
@pytest.mark.parametrize("which", ["torch", "pooled"])
def test_workers_split_one_epoch_exactly(shard_dir, which):
    """Two workers, batches formed per worker: every sample once (torch's DataLoader and ours)."""
    cls = DataLoader if which == "torch" else PooledLoader
    if cls is DataLoader and which == "pooled":
        pytest.skip("pooled_loader.PooledLoader is not importable")
    batches = run_epoch(WebDataset(shard_dir, transform=sample_id), epoch=0, cls=cls)
    assert sorted(flat(batches)) == list(range(121))
    assert [len(b) for b in batches] == [4] * 30 + [1]  # workers in turn: 61 + 60 samples


@pytest.mark.parametrize("sizes", [SIZES, [50, 3, 7, 1], [2, 2], [0, 30, 0, 11, 6]])
@pytest.mark.parametrize("world,nworkers", [(1, 3), (2, 2), (3, 2), (4, 3)])
def test_equal_counts_and_coverage(tmp_path, monkeypatch, sizes, world, nworkers):
    """Every rank yields len(ds) samples, its workers the same split on every rank, no sample
    twice, all but N % world seen; also with fewer shards than ranks x workers."""
    make_shards(str(tmp_path), sizes)
    n = sum(sizes)
    per_worker = {}
    seen = Counter()
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        ds = WebDataset(str(tmp_path), transform=sample_id, seed=3)
        ds.set_epoch(1)
        for wid in range(nworkers):
            fake_worker(monkeypatch, wid, nworkers)
            ids = list(ds)
            per_worker[rank, wid] = len(ids)
            seen.update(ids)
        monkeypatch.setattr(pwds, "get_worker_info", lambda: None)
        assert sum(per_worker[rank, w] for w in range(nworkers)) == len(ds) == n // world
    for wid in range(nworkers):
        assert len({per_worker[r, wid] for r in range(world)}) == 1
    assert max(seen.values(), default=1) == 1
    assert sum(seen.values()) == world * (n // world)


def test_a_piece_starts_at_its_slots_first_sample_and_prefetches_up_to_its_last_shard():
    sizes = [5, 0, 12, 1, 33, 7]  # an empty shard is left out of the stream
    urls = [f"s{i}.tar" for i in range(len(sizes))]
    stream = [(u, j) for u, n in zip(urls, sizes) for j in range(n)]
    for world, workers in [(1, 1), (2, 3), (3, 2), (4, 4)]:
        for rank in range(world):
            for k in range(workers):
                piece = plan_piece(urls, sizes, len(stream), seed=0, epoch=0,
                                   shuffle_shards=False, rank=rank, world=world, worker=k,
                                   workers=workers)
                start, count = slot_share(len(stream), rank, world, k, workers)
                assert piece.quota == count and "s1.tar" not in piece.shards
                mine = stream[start:start + count]
                assert (piece.shards[piece.first], piece.skip) == mine[0]
                assert piece.shards[piece.last] == mine[-1][0]


def test_explicit_samples_per_epoch_equal_counts(tmp_path, monkeypatch):
    make_shards(str(tmp_path), [30, 2, 9])  # fewer shards than the 6 slots
    counts = {}
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        ds = WebDataset(str(tmp_path), transform=sample_id, samples_per_epoch=41)
        assert ds.shard_sizes is None
        for wid in range(2):
            fake_worker(monkeypatch, wid, 2)
            ids = list(ds)
            assert set(ids) <= set(range(41))
            counts[rank, wid] = len(ids)
    assert counts == {(r, w): 7 if w == 0 else 6 for r in range(3) for w in range(2)}


def test_reshuffle_per_epoch_and_same_seed_same_order(shard_dir):
    e0 = flat(run_epoch(WebDataset(shard_dir, transform=sample_id, seed=5), 0))
    e1 = flat(run_epoch(WebDataset(shard_dir, transform=sample_id, seed=5), 1))
    again = flat(run_epoch(WebDataset(shard_dir, transform=sample_id, seed=5), 0))
    other = flat(run_epoch(WebDataset(shard_dir, transform=sample_id, seed=6), 0))
    assert sorted(e0) == sorted(e1) == list(range(121))
    assert e0 != e1 and e0 == again and e0 != other
    fixed = flat(run_epoch(WebDataset(shard_dir, transform=sample_id, shuffle_shards=False), 0, 0))
    assert fixed == list(range(121))


def test_shuffle_buffer_is_seeded_permutation(shard_dir):
    def ids(seed, epoch):
        ds = WebDataset(shard_dir, transform=sample_id, shuffle_shards=False, shuffle_buffer=16,
                        seed=seed)
        ds.set_epoch(epoch)
        return list(ds)

    a = ids(1, 0)
    assert sorted(a) == list(range(121)) and a != list(range(121))
    assert a == ids(1, 0) and a != ids(1, 1) and a != ids(2, 0)


# -- bad input -------------------------------------------------------------------------------
def test_missing_shard(shard_dir):
    missing = os.path.join(shard_dir, "nope.tar")
    with pytest.raises(SampleError, match="nope.tar.*No such file"):
        WebDataset([missing] + expand_shards(shard_dir))
    with pytest.warns(RuntimeWarning, match="nope.tar"):
        ds = WebDataset([missing] + expand_shards(shard_dir), transform=sample_id,
                        on_error="skip")
    assert ds.skipped == 1 and len(ds) == 121
    assert sorted(ds) == list(range(121))
    skips = ds.pop_skips()
    assert len(skips) == 1 and "nope.tar" in skips[0][0] and "No such file" in skips[0][1]
    assert ds.pop_skips() == []
    # Not counted beforehand: found while reading, in a worker process.
    ds = WebDataset([missing] + expand_shards(shard_dir), transform=sample_id,
                    samples_per_epoch=121)
    with pytest.raises(SampleError, match="nope.tar"):
        run_epoch(ds, 0)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def truncate(path, keep):
    data = read(path)
    with open(path, "wb") as f:
        f.write(data[:keep])


@pytest.mark.parametrize("keep", [512 * 7 + 100, 5000, 512 * 9])
def test_truncated_shard(tmp_path, keep):
    path = make_shards(str(tmp_path), [12])[0]
    truncate(path, keep)
    with pytest.raises(SampleError, match=r"shard-0000\.tar"):
        count_samples(path)
    with pytest.raises(SampleError, match="shard-0000.tar"):
        WebDataset(path)
    # Streaming read of the same file: the error names the shard and the last key read.
    with pytest.raises(SampleError, match=r"shard-0000\.tar: truncated shard.*after key '00000"):
        list(WebDataset(path, samples_per_epoch=12))
    # Skip mode: the header scan counts exactly what webdataset yields before the error.
    yielded = []
    with pytest.raises(tarfile.ReadError):
        for s in tarfile_samples([{"url": path}]):
            yielded.append(s["__key__"])
    with pytest.warns(RuntimeWarning, match="shard-0000.tar"):
        ds = WebDataset(path, on_error="skip")
    assert ds.samples_per_epoch == len(yielded) >= 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # warned once per shard, above
        assert [s["__key__"] for s in ds] == yielded
    assert ds.skipped >= 1  # counted when counting (and again if reading reached the damage)


def test_missing_extension_raises_with_shard_and_key(tmp_path):
    paths = make_shards(str(tmp_path), [4, 4])
    with wds.TarWriter(os.path.join(str(tmp_path), "shard-0002.tar"), encoder=False) as w:
        w.write({"__key__": "odd", "cls": b"1"})  # no .txt
    ds = WebDataset(paths + [os.path.join(str(tmp_path), "shard-0002.tar")], transform=sample_id,
                    shuffle_shards=False)
    with pytest.raises(SampleError) as err:
        run_epoch(ds, 0)  # raised in a worker, re-raised in the main process
    assert "shard-0002.tar" in str(err.value)
    assert "key 'odd'" in str(err.value) and "missing extension 'txt'" in str(err.value)


def test_skip_keeps_counts_equal(tmp_path, monkeypatch):
    """Skipped samples are replaced by reading on, so every rank still yields len(ds)."""
    make_shards(str(tmp_path), [6, 6])
    with wds.TarWriter(os.path.join(str(tmp_path), "shard-0002.tar"), encoder=False) as w:
        for k in range(6):
            w.write({"__key__": f"bad{k}", "cls": b"1"})
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ds = WebDataset(str(tmp_path), transform=sample_id, on_error="skip", seed=rank)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids = list(ds)
        assert len(ids) == len(ds) == 9 and set(ids) <= set(range(12))
    # A worker whose every shard is unreadable fails instead of spinning.
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    ds = WebDataset(os.path.join(str(tmp_path), "shard-0002.tar"), transform=sample_id,
                    on_error="skip")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(SampleError, match="no usable sample"):
            list(ds)
        assert ds.skipped >= 6
        gone = WebDataset(os.path.join(str(tmp_path), "gone-{0..2}.tar"), samples_per_epoch=5,
                          on_error="skip")
        with pytest.raises(SampleError, match="no readable sample in a whole pass over 3"):
            list(gone)
        assert gone.skipped == 3


def test_on_error_validated(shard_dir):
    with pytest.raises(ValueError):
        WebDataset(shard_dir, on_error="ignore")


# -- shards/writer.py ---------------------------------------------------------------------------------
def make_image_folder(root, per_class=5, classes=("ant", "bee", "cat")):
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 255, (24 + i, 32, 3), dtype=np.uint8)
            Image.fromarray(arr).save(os.path.join(root, c, f"img.{i}.jpg"), quality=90)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(os.path.join(root, "cat", "p.png"))
    with open(os.path.join(root, "bee", "notes.txt"), "w") as f:
        f.write("not an image")


def test_write_shards_roundtrip(tmp_path):
    src = str(tmp_path / "img")
    make_image_folder(src)
    paths = shards.write_shards(src, str(tmp_path / "out" / "d-%04d.tar"), per_shard=4,
                                progress=False)
    assert [os.path.basename(p) for p in paths] == [f"d-{i:04d}.tar" for i in range(4)]
    assert [count_samples(p) for p in paths] == [4, 4, 4, 4]
    samples = list(WebDataset(paths, shuffle_shards=False))
    by_key = {s["__key__"]: s for s in samples}
    assert len(by_key) == 16
    for cls, name in enumerate(["ant", "bee", "cat"]):
        for i in range(5):
            s = by_key[f"{name}/img_{i}"]
            assert s["jpg"] == read(os.path.join(src, name, f"img.{i}.jpg"))
            assert s["cls"] == str(cls).encode()
    assert by_key["cat/p"]["png"] == read(os.path.join(src, "cat", "p.png"))
    assert [s["__key__"] for s in samples] != sorted(by_key)  # classes mixed across shards
    again = shards.write_shards(src, str(tmp_path / "again" / "d-%04d.tar"), 4, progress=False)
    assert [read(a) for a in again] == [read(p) for p in paths]


def test_shards_cli(tmp_path, capsys):
    src = str(tmp_path / "img")
    make_image_folder(src, per_class=2)
    out = str(tmp_path / "o" / "x-%02d.tar")
    assert shards.main(["write", src, out, "--per-shard", "3", "--quiet"]) == 0
    assert "wrote 3 shards" in capsys.readouterr().out
    assert sum(count_samples(out % i) for i in range(3)) == 7
    with pytest.raises(ValueError, match="%-format"):
        shards.write_shards(src, str(tmp_path / "bad.tar"), 3, progress=False)
    with pytest.raises(SystemExit):
        shards.main(["write", src, out])  # --per-shard is required
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out2 = str(tmp_path / "cli" / "y-%02d.tar")
    proc = subprocess.run([sys.executable, "-m", "pooled_loader", "shards", "write", src, out2,
                           "--per-shard", "4", "--quiet"], cwd=repo, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [count_samples(out2 % i) for i in range(2)] == [4, 3]
