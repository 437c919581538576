"""Hostile shard indexes (issue 35): an index must cover its shard exactly, and every read by
offset (local seek, cached copy or HTTP Range request) is checked against it.

An index with a sample left out, two samples merged into one entry, entries past the shard's
samples, a shard replaced after it was indexed, a deeply nested or a FIFO ``.idx.json``: each is
an error naming the index or the shard (``ShardIndexError``, raised even with
``on_error="skip"``, where skipping would fill the epoch with repeated samples), never fewer,
repeated or foreign samples. Tests that could hang on a regression run under a timeout."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import webdataset as wds
from http_shards import ShardServer
from test_shard_index import REPO, SIZES, indexed  # noqa: F401 - a fixture: 7 indexed shards
from test_webdataset import flat, make_shards, run_epoch, sample_id

from pooled_loader import PooledLoader
from pooled_loader.shards.index import INDEX_SUFFIX, ShardIndexError, load_index
from pooled_loader.shards.webdataset import WebDataset

TOTAL = sum(SIZES)


def edit_index(path, change):
    with open(path + INDEX_SUFFIX) as f:
        doc = json.load(f)
    change(doc)
    with open(path + INDEX_SUFFIX, "w") as f:
        json.dump(doc, f)


def drop(doc, i):
    del doc["offsets"][i], doc["sizes"][i]


def ids(ds):
    return sorted(ds)


@contextlib.contextmanager
def shard_urls(paths, where="http"):
    """The shards' URLs: served over HTTP on 127.0.0.1, or the local paths."""
    if where != "http":
        yield paths
        return
    with ShardServer(os.path.dirname(paths[0])) as srv:
        yield [srv.url(os.path.basename(p)) for p in paths]


def changed_size(urls, shard):
    return pytest.raises(ShardIndexError, match=rf"shard {urls[shard]} has \d+ bytes, its index "
                                                r"was made for \d+: the shard changed")


def test_an_index_with_a_sample_left_out_in_the_middle_is_refused_naming_it(indexed):
    edit_index(indexed[1], lambda d: drop(d, 4))
    with pytest.raises(ShardIndexError, match=rf"shard index {indexed[1]}{INDEX_SUFFIX}: bytes "
                                              r"\d+\.\.\d+ lie between sample 3 and sample 4: a gap"):
        load_index(indexed[1])


@pytest.mark.parametrize("on_error", ["raise", "skip"])
@pytest.mark.parametrize("damage", ["first left out", "last left out", "two merged"])
def test_an_index_that_does_not_cover_its_shard_is_an_error_when_read_never_fewer_samples(
        indexed, damage, on_error):
    """Left out at either end, or two samples merged into one entry, the index still parses
    (contiguous, in bounds): reading its entries finds the mismatch."""
    def change(d):
        if damage == "first left out":
            drop(d, 0)
        elif damage == "last left out":
            drop(d, -1)
        else:
            d["sizes"][2] += d["sizes"][3]
            drop(d, 3)
    edit_index(indexed[1], change)
    ds = WebDataset(indexed, transform=sample_id, shuffle="global", on_error=on_error)
    assert len(ds) == TOTAL - 1
    with pytest.raises(ShardIndexError, match=rf"shard {indexed[1]}: its index places sample "
                                              r"\d+ at bytes .* the index does not fit the shard"):
        ids(ds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_index_claiming_more_samples_than_the_shard_holds_over_http_is_an_error(
        indexed, on_error):
    """Entries appended past the shard's last sample, and its size raised to match: over HTTP
    the shard's size is not known when the index is read, so the reads must find it. Skipping
    them replaced each by another sample of the share: samples repeated."""
    def change(d):
        extra = d["sizes"][-1]
        for _ in range(5):
            d["offsets"].append(d["offsets"][-1] + d["sizes"][-1])
            d["sizes"].append(extra)
        d["shard_bytes"] += 5 * extra
    edit_index(indexed[0], change)
    with shard_urls(indexed) as urls:
        ds = WebDataset(urls, transform=sample_id, shuffle="global", on_error=on_error)
        assert len(ds) == TOTAL + 5
        with changed_size(urls, 0):
            ids(ds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["http", "local"])
def test_a_shard_replaced_after_it_was_indexed_is_an_error_not_foreign_samples(
        indexed, tmp_path, where):
    """The dataset reads the indexes, then a shard is rewritten with other samples (as a
    re-export would): every read compares the shard's size with its index's."""
    other = make_shards(str(tmp_path / "other"), [7], name="o")[0]
    with shard_urls(indexed, where) as urls:
        ds = WebDataset(urls, transform=sample_id, shuffle="global", on_error="skip")
        assert ids(ds) == list(range(TOTAL))
        shutil.copyfile(other, indexed[2])  # 7 samples where there were 12: another size
        with changed_size(urls, 2):
            ids(ds)
        assert ds.skipped == 0


def test_a_deeply_nested_index_is_an_error_naming_it_not_a_recursion_error(indexed):
    with open(indexed[0] + INDEX_SUFFIX, "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ShardIndexError, match=rf"shard index {indexed[0]}{INDEX_SUFFIX}: JSON "
                                              "nested too deeply"):
        load_index(indexed[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_fifo_or_device_in_place_of_an_index_is_refused_naming_it(indexed, kind):
    os.unlink(indexed[0] + INDEX_SUFFIX)
    if kind == "fifo":
        os.mkfifo(indexed[0] + INDEX_SUFFIX)
    else:
        os.symlink("/dev/zero", indexed[0] + INDEX_SUFFIX)
    with pytest.raises(ShardIndexError, match=rf"shard index {indexed[0]}{INDEX_SUFFIX}: .*not a "
                                              "regular file"):
        WebDataset(indexed, shuffle="global")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_shards_index_refuses_a_fifo_or_device_among_the_shards(tmp_path, kind):
    make_shards(str(tmp_path / "s"), [2])
    bad = tmp_path / "s" / "shard-0001.tar"
    if kind == "fifo":
        os.mkfifo(bad)
    else:
        os.symlink("/dev/zero", bad)
    r = subprocess.run([sys.executable, "-m", "pooled_loader", "shards", "index",
                        str(tmp_path / "s")], cwd=REPO, capture_output=True, text=True,
                       timeout=50)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "not a regular file" in r.stderr and "shard-0001.tar" in r.stderr


@pytest.mark.timeout(60)
def test_a_file_replaced_while_a_stream_reconnects_is_an_error_not_two_files_spliced(indexed):
    """The first response is cut after 1000 bytes; the shard is replaced before the stream
    reconnects: the rest would come from the other file. The new size gives it away."""
    from pooled_loader.shards import remote
    with ShardServer(os.path.dirname(indexed[0]), cut_after=1000, cuts=1) as srv:
        f = remote.open_shard(srv.url(os.path.basename(indexed[0])), retries=2, backoff_s=0)
        try:
            assert len(f.read(1000)) == 1000
            with open(indexed[0], "ab") as g:  # rewritten, another size
                g.write(bytes(10240))
            with pytest.raises(remote.RemoteReadError, match="the file changed while it was "
                                                             "read"):
                f.read()
        finally:
            f.close()


# -- issue 45: an index older than its shard -----------------------------------------------------
REWRITTEN = list(range(1000, 1010))  # 10 samples where shard 2 had 12, in as many bytes
SHARD_2 = range(46, 58)  # shard 2's ids (after 5 + 41)


def rewrite(path, ids):
    """``path`` written again, same name, with the samples ``ids`` (other content), to its old
    size and with a later mtime, as a re-export gives it: only what the index places where
    can tell the two shards apart."""
    size, mtime = os.path.getsize(path), os.stat(path).st_mtime_ns
    with wds.TarWriter(path, encoder=False, mtime=0) as w:
        for g in ids:
            w.write({"__key__": f"{g:06d}", "txt": str(g).encode(), "cls": b"0"})
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
    assert os.path.getsize(path) == size


def released(paths):
    """The indexes as the last release wrote them: without the shard's mtime."""
    for p in paths:
        edit_index(p, lambda d: d.pop("shard_mtime_ns", None))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("written_by", ["this release", "the last release"])
@pytest.mark.parametrize("shuffle", ["shards", "global"])
def test_a_shard_rewritten_after_it_was_indexed_is_refused_naming_both_never_repeated(
        indexed, written_by, shuffle):
    """The bug of issue 45: counted mode read the shard's 10 samples, then two again to make
    up the 12 its index counted, with nothing skipped and no warning. Now the index is checked
    against the shard when it is read (its size, then its mtime or, when that differs or is not
    recorded, where the shard's tar headers place its samples): an error naming the index and
    the shard, or with on_error="skip" a counted skip leaving the shard out, read by workers."""
    if written_by == "the last release":
        released(indexed)
    rewrite(indexed[2], REWRITTEN)
    with pytest.raises(ShardIndexError, match=rf"shard index {indexed[2]}{INDEX_SUFFIX}: .*"
                                              rf"the shard {indexed[2]} changed .*rebuild"):
        WebDataset(indexed, transform=sample_id, index=True, shuffle=shuffle)
    with pytest.warns(RuntimeWarning, match=rf"skipping: shard {indexed[2]}: .*changed"):
        ds = WebDataset(indexed, transform=sample_id, index=True, shuffle=shuffle,
                        on_error="skip")
    assert ds.skipped == 1 and len(ds) == TOTAL - len(SHARD_2)
    loader = PooledLoader(ds, batch_size=4, num_workers=2)
    got = [int(i) for batch in loader for i in batch]
    assert sorted(got) == [g for g in range(TOTAL) if g not in SHARD_2]  # each once
    assert loader.stats()["skipped"] >= 1


@pytest.mark.parametrize("written_by", ["this release", "the last release"])
def test_a_shard_copied_with_a_new_mtime_still_fits_its_index(indexed, written_by):
    """A copy that keeps no mtime (cp, a download): the samples are where the index places
    them (the headers say so), so the index is used as it is, not refused."""
    if written_by == "the last release":
        released(indexed)
    for p in indexed:
        os.utime(p, ns=(10**18, 10**18))
    ds = WebDataset(indexed, transform=sample_id, index=True, shuffle_shards=False)
    assert list(ds) == list(range(TOTAL)) and ds.skipped == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["local", "http", "http+cache"])
def test_a_shard_rewritten_after_the_dataset_read_its_index_is_an_error_never_repeats(
        indexed, tmp_path, where):
    """Rewritten once the indexes were read (or over HTTP, where the shard's mtime and
    headers are not seen beforehand): reading it in a worker finds a sample missing where the
    index counts one (or the cache a SHA-256 that is not the index's). Skipping it would make
    the worker read others twice to fill its quota: an error even with on_error="skip"."""
    with shard_urls(indexed, where.split("+")[0]) as urls:
        ds = WebDataset(urls, transform=sample_id, index=True, on_error="skip",
                        shuffle_shards=False,
                        cache_dir=str(tmp_path / "c") if "cache" in where else None)
        assert ds.shard_sizes == SIZES
        rewrite(indexed[2], REWRITTEN)
        with pytest.raises(ShardIndexError, match=rf"shard {urls[2]}\b") as err:
            flat(run_epoch(ds, 0))
        assert urls[2] + INDEX_SUFFIX in str(err.value) and "rebuild" in str(err.value)
