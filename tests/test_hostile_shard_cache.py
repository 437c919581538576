"""The shard cache, the trace writer and local tar readers against a hostile folder (issue 35):
foreign files in ``cache_dir``, links, FIFOs and devices planted at the names the library uses,
short writes and a really full disk (a 64 KiB tmpfs under ``unshare -m``). Real files, a real
HTTP server on 127.0.0.1, real worker processes."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
from http_shards import ShardServer
from test_webdataset import flat, make_shards, run_epoch, sample_id

from pooled_loader.core import safe_open
from pooled_loader.core.safe_open import UnsafeFileError
from pooled_loader.shards.cache import ShardCache, cache_key
from pooled_loader.shards.samples import count_samples, shard_samples
from pooled_loader.observability.trace import TraceRecorder
from pooled_loader.shards.webdataset import WebDataset

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
SIZES = [20] * 8  # 160 samples


def tree(root):
    """{relative path: bytes} of every file under ``root``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in pathlib.Path(root).rglob("*")
            if p.is_file()}


@pytest.fixture
def remote_root(tmp_path):
    make_shards(str(tmp_path / "remote"), SIZES)
    return str(tmp_path / "remote")


def remote_names():
    return [f"shard-{i:04d}.tar" for i in range(len(SIZES))]


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.timeout(300)
def test_eviction_never_deletes_files_the_cache_did_not_write(remote_root, tmp_path):
    """cache_dir already holds the user's only copies of local shards, a README, a folder, and
    files whose names look like the cache's; a budget of 2 of 8 remote shards forces many
    evictions over two epochs that read local and remote shards together."""
    cache = tmp_path / "mixed"
    local = make_shards(str(cache), [20, 20], name="local")  # ids 0..39, only copies
    (cache / "README").write_text("my notes\n")
    (cache / "data").mkdir()
    (cache / "data" / "keep.bin").write_bytes(os.urandom(5000))
    (cache / "0123456789abcdef-looks-like-a-key.tar").write_bytes(os.urandom(20000))
    (cache / ".0123456789abcdef-x.tar.part-9").write_bytes(b"y" * 9)  # not the part pattern
    (cache / ".hidden").write_bytes(b"z" * 10)
    before = tree(cache)
    shard_bytes = os.path.getsize(os.path.join(remote_root, remote_names()[0]))
    with ShardServer(remote_root) as srv:
        urls = local + [srv.url(n) for n in remote_names()]
        ds = WebDataset(urls, transform=sample_id, cache_dir=str(cache),
                        cache_limit=2 * shard_bytes, seed=1)
        assert ds.shard_sizes == [20, 20] + SIZES
        for epoch in (0, 1):
            got = sorted(flat(run_epoch(ds, epoch)))
            assert got == sorted(list(range(40)) + list(range(160))), epoch
        # The same folder used directly: every remote shard passes through a 2-shard budget.
        direct = ShardCache(str(cache), 2 * shard_bytes)
        for url in urls[2:] * 2:
            with direct.open(url):
                pass
        assert direct.stats["evictions"] >= 6
        assert direct.usage() <= 2 * shard_bytes
    after = tree(cache)
    assert {k: after.get(k) for k in before} == before  # every foreign file intact


def test_links_planted_at_the_lock_files_are_refused_and_nothing_is_created_elsewhere(
        remote_root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    with ShardServer(remote_root) as srv:
        url = srv.url(remote_names()[0])
        folder = tmp_path / "c1"
        cache = ShardCache(str(folder), "10MB")
        os.symlink(outside / "budget", folder / ".budget.lock")
        with pytest.raises(UnsafeFileError, match=r"symbolic link.*\.budget\.lock"):
            cache.open(url)
        folder2 = tmp_path / "c2"
        cache2 = ShardCache(str(folder2), "10MB")
        os.symlink(outside / "key", folder2 / ".locks" / cache_key(url))
        with pytest.raises(UnsafeFileError, match=r"symbolic link.*\.locks"):
            cache2.open(url)
        folder3 = tmp_path / "c3"
        folder3.mkdir()
        os.symlink(outside, folder3 / ".locks")
        with pytest.raises(UnsafeFileError, match=r"lock folder is a link.*\.locks"):
            ShardCache(str(folder3))
    assert os.listdir(outside) == []
    for folder in (tmp_path / "c1", tmp_path / "c2"):
        for p in [folder / ".budget.lock"] + list((folder / ".locks").iterdir()):
            if p.is_symlink() or not p.exists():
                continue  # the planted one, or not made before the refusal
            mode = os.lstat(p).st_mode & 0o777
            assert mode & 0o022 == 0, oct(mode)  # never 0o666


def _plant(kind, path, tmp_path, other_shard):
    if kind == "link to another shard":
        os.symlink(other_shard, path)
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "hard link":
        victim = tmp_path / "victim.tar"
        shutil.copy(other_shard, victim)
        os.link(victim, path)
    elif kind == "unrecorded file":
        shutil.copy(other_shard, path)


@pytest.mark.timeout(60)  # a FIFO used to block open() forever
@pytest.mark.parametrize("kind", ["link to another shard", "link to /dev/zero", "fifo",
                                  "hard link", "unrecorded file"])
def test_a_link_fifo_or_foreign_file_at_a_shards_name_is_never_read_as_the_shard(
        remote_root, tmp_path, kind):
    other = os.path.join(remote_root, remote_names()[1])
    other_before = read_bytes(other)
    with ShardServer(remote_root) as srv:
        url = srv.url(remote_names()[0])
        cache = ShardCache(str(tmp_path / "c"), "10MB")
        _plant(kind, cache.path(url), tmp_path, other)
        with pytest.warns(RuntimeWarning, match=f"{cache_key(url)}.*not used"):
            shard = cache.open(url)
        assert shard is not None
        with shard:
            assert read_bytes(shard.path) == read_bytes(os.path.join(remote_root,
                                                                     remote_names()[0]))
        assert srv.requests[remote_names()[0]] == 1  # fetched, replacing the planted name
        assert os.path.isfile(cache.path(url)) and not os.path.islink(cache.path(url))
    assert read_bytes(other) == other_before  # a link's target is never written
    if kind == "hard link":
        assert read_bytes(tmp_path / "victim.tar") == other_before


def test_a_cached_copy_truncated_or_replaced_since_its_download_is_fetched_again(
        remote_root, tmp_path):
    name = remote_names()[0]
    good = read_bytes(os.path.join(remote_root, name))
    with ShardServer(remote_root) as srv:
        url = srv.url(name)
        cache = ShardCache(str(tmp_path / "c"))
        with cache.open(url):
            pass
        os.truncate(cache.path(url), len(good) // 2)  # no index: the record knows the size
        with pytest.warns(RuntimeWarning, match="changed since.*downloading it again"):
            with cache.open(url) as shard:
                assert read_bytes(shard.path) == good
        # Same size, other bytes, renamed into place (another inode): not the copy downloaded.
        fake = tmp_path / "fake"
        fake.write_bytes(b"\0" * len(good))
        os.rename(fake, cache.path(url))
        with pytest.warns(RuntimeWarning, match="not the copy this cache downloaded"):
            with cache.open(url) as shard:
                assert read_bytes(shard.path) == good
        # A shard index whose SHA-256 is not the one checked at download: fetched again (and
        # refused, since the server's copy does not match that index either).
        with pytest.warns(RuntimeWarning, match="at download, the shard index says abab"), \
                pytest.raises(Exception, match="SHA-256 .* does not match its shard index"):
            cache.open(url, sha256="ab" * 32)
        assert srv.requests[name] == 4
    assert not os.path.exists(cache.path(url))


def test_short_writes_are_completed_and_writes_that_stop_are_a_disk_full_error(
        remote_root, tmp_path, monkeypatch):
    name = remote_names()[0]
    good = read_bytes(os.path.join(remote_root, name))
    real_write = os.write
    with ShardServer(remote_root) as srv:
        url = srv.url(name)
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:1000]))
        cache = ShardCache(str(tmp_path / "c"))
        with cache.open(url) as shard:
            assert read_bytes(shard.path) == good
        monkeypatch.setattr(os, "write", lambda fd, data: 0)
        url2 = srv.url(remote_names()[1])
        with pytest.raises(OSError, match="no space left in .* set cache_limit") as info:
            cache.open(url2)
        assert info.value.errno == errno.ENOSPC
        monkeypatch.setattr(os, "write", real_write)
    assert sorted(os.listdir(tmp_path / "c")) == sorted([".budget.lock", ".locks",
                                                         cache_key(url)])


DISK_FULL = """
import json, os, sys
sys.path[:0] = [{repo!r}]
from pooled_loader.shards.cache import ShardCache
out = {{}}
cache = ShardCache({folder!r})
try:
    cache.open({big!r})
    out["big"] = "cached"
except OSError as e:
    out["big"] = [e.errno, str(e)]
out["after_big"] = sorted(os.listdir({folder!r}))
with cache.open({small!r}) as shard:
    out["small"] = open(shard.path, "rb").read().hex()
out["after_small"] = sorted(os.listdir({folder!r}))
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_full_disk_leaves_no_shard_and_no_part_file_and_says_so(tmp_path):
    """A real ENOSPC: the cache folder is a 64 KiB tmpfs mounted in a private mount namespace."""
    root = tmp_path / "remote"
    root.mkdir()
    (root / "big.tar").write_bytes(os.urandom(200_000))
    (root / "small.tar").write_bytes(os.urandom(8_000))
    folder = tmp_path / "full"
    folder.mkdir()
    with ShardServer(str(root)) as srv:
        code = DISK_FULL.format(repo=REPO, folder=str(folder), big=srv.url("big.tar"),
                                small=srv.url("small.tar"))
        cmd = ["unshare", "-m", "sh", "-c",
               f"mount -t tmpfs -o size=64k tmpfs {folder} && exec {sys.executable} -c \"$0\"",
               code]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
        except FileNotFoundError:
            pytest.skip("no unshare command: cannot make a small private tmpfs")
        if proc.returncode != 0 and ("unshare" in proc.stderr or "mount" in proc.stderr) \
                and "Traceback" not in proc.stderr:
            pytest.skip(f"unshare -m / mount not permitted here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["big"][0] == errno.ENOSPC and "no space left in" in out["big"][1]
    assert out["after_big"] == [".budget.lock", ".locks"]  # no final name, no part file
    assert bytes.fromhex(out["small"]) == (root / "small.tar").read_bytes()
    assert out["after_small"] == [".budget.lock", ".locks", cache_key(srv.url("small.tar"))]


def test_a_link_planted_at_a_trace_temp_name_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    path = tmp_path / "run.trace.json"
    os.symlink(victim, f"{path}.{os.getpid()}.tmp")  # the old fixed temporary name
    rec = TraceRecorder(path)
    rec.add_main("step", 1.0, 2.0)
    assert rec.write() == str(path)
    assert not victim.exists()
    assert not path.is_symlink() and json.loads(path.read_text())["traceEvents"]
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == [
        f"run.trace.json.{os.getpid()}.tmp"]  # only the planted link, untouched


@pytest.mark.timeout(60)  # a FIFO used to block open() forever, /dev/zero to be read forever
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_local_tar_that_is_a_fifo_or_a_device_is_refused_naming_it(tmp_path, kind):
    path = str(tmp_path / "bad.tar")
    os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
    what = "a FIFO" if kind == "fifo" else "a character device"
    with pytest.raises(Exception, match=f"bad.tar.*{what}, not a regular file"):
        count_samples(path)
    with pytest.raises(UnsafeFileError, match=f"{what}.*bad.tar"):
        list(shard_samples(path))
    with pytest.raises(Exception, match=f"bad.tar.*{what}"):
        list(WebDataset([path], samples_per_epoch=1))


def test_safe_open_refuses_each_kind_of_planted_file(tmp_path):
    reg = tmp_path / "f"
    reg.write_bytes(b"abc")
    os.link(reg, tmp_path / "f2")
    os.symlink(reg, tmp_path / "l")
    os.mkfifo(tmp_path / "p")
    cases = {"l": "symbolic link", "p": "a FIFO", "f2": "2 hard links"}
    for name, why in cases.items():
        with pytest.raises(UnsafeFileError, match=why):
            safe_open.open_regular(tmp_path / name, own=True)
    with pytest.raises(UnsafeFileError, match="3 bytes where 4"):
        safe_open.open_regular(reg, expect_size=4, follow=True)
    with pytest.raises(UnsafeFileError, match="more than the 2"):
        safe_open.open_regular(reg, max_bytes=2, follow=True)
    fd = safe_open.open_regular(tmp_path / "l", follow=True)
    assert os.read(fd, 10) == b"abc"
    os.close(fd)
    fd, path = safe_open.create_exclusive(tmp_path, "t-", ".tmp")
    safe_open.write_all(fd, memoryview(b"x" * 100000), path)
    os.close(fd)
    assert os.path.getsize(path) == 100000 and os.stat(path).st_mode & 0o777 == 0o644


def test_a_cache_hit_is_one_open_one_flock_and_one_fstat_the_record_read_once(
        remote_root, tmp_path, monkeypatch):
    """The hit path's cost (issue 35: hits ran at 0.92x the unchecked open): after the first
    open, a hit neither reads the record again, nor ``lstat``s the name, nor clears
    ``O_NONBLOCK`` (the descriptor only holds the lock); the checks are on one ``fstat``."""
    from pooled_loader.shards import cache as shard_cache
    with ShardServer(remote_root) as srv:
        url = srv.url(remote_names()[0])
        cache = ShardCache(str(tmp_path / "c"))
        cache.open(url).close()
        calls = {"lstat": 0, "stat": 0, "fstat": 0, "fcntl": 0, "record": 0, "key": 0}

        def counting(name, fn):
            def call(*a, **k):
                calls[name] += 1
                return fn(*a, **k)
            return call
        for name, owner in (("lstat", os), ("stat", os), ("fstat", os),
                            ("fcntl", shard_cache.fcntl)):
            monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
        monkeypatch.setattr(ShardCache, "_record", counting("record", ShardCache._record))
        monkeypatch.setattr(shard_cache, "cache_key", counting("key", shard_cache.cache_key))
        for _ in range(10):
            with cache.open(url) as shard:
                assert os.path.basename(shard.path) == cache_key(url)
        monkeypatch.undo()
        assert calls == {"lstat": 0, "stat": 0, "fstat": 10, "fcntl": 0, "record": 0, "key": 0}
        assert srv.requests[remote_names()[0]] == 1


def test_a_shard_evicted_between_the_open_and_the_lock_is_looked_up_again(
        remote_root, tmp_path, monkeypatch):
    """The hit locks the descriptor it opened; if the file was unlinked (evicted) before the
    lock was taken, its ``fstat`` under the lock shows no link: it is never served, the name is
    looked up again (and, gone, downloaded again)."""
    from pooled_loader.shards import cache as shard_cache
    name = remote_names()[0]
    good = read_bytes(os.path.join(remote_root, name))
    with ShardServer(remote_root) as srv:
        url = srv.url(name)
        cache = ShardCache(str(tmp_path / "c"))
        cache.open(url).close()
        flock, evicted = shard_cache.fcntl.flock, []

        def evict_first(fd, mode):
            if not evicted and mode & shard_cache.fcntl.LOCK_SH:
                evicted.append(fd)
                os.unlink(cache.path(url))  # what an eviction does, just before our lock
            return flock(fd, mode)
        monkeypatch.setattr(shard_cache.fcntl, "flock", evict_first)
        with cache.open(url) as shard:
            monkeypatch.undo()
            held = os.fstat(shard._fd)  # the new download's file (its inode may be reused)
            assert held.st_nlink == 1 and read_bytes(shard.path) == good
            assert (held.st_dev, held.st_ino) == (os.stat(shard.path).st_dev,
                                                  os.stat(shard.path).st_ino)
        assert srv.requests[name] == 2
