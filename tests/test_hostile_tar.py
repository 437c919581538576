"""Hostile and corrupt tar shards (issue 24): each test builds its shard byte by byte.

Every reader of the package (``WebDataset`` counting and reading, local and streamed,
``read_shard_classes``) goes through ``pooled_loader.shards.tar``; a bad shard must be an error
naming it and the offset (or a counted skip), never a hang, a MemoryError or lost samples.
"""
from __future__ import annotations

import bz2
import gzip
import io
import os
import tarfile
import warnings

import pytest
from webdataset import TarWriter

from pooled_loader.core.errors import SampleError, ShardFormatError
from pooled_loader.shards.writer import read_shard_classes, write_shards
from pooled_loader.shards import samples as shard_samples_module
from pooled_loader.shards import tar as tar_reader
from pooled_loader.core.constants import MAX_TRAILING_BYTES
from pooled_loader.shards.tar import MAX_META_BYTES, TarReader
from pooled_loader.shards.webdataset import WebDataset, count_samples


def octal(n, width=12):
    return b"%0*o\0" % (width - 1, n)


def header(name, size, kind=b"0", *, size_field=None, checksum=True):
    """One ustar header block (``size_field`` replaces the encoded size as it stands)."""
    h = bytearray(512)
    h[0:100] = name.encode().ljust(100, b"\0")
    h[100:108], h[108:116], h[116:124] = b"0000644\0", b"0000000\0", b"0000000\0"
    h[124:136] = size_field if size_field is not None else octal(size)
    h[136:148] = octal(0)
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    if checksum:
        h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def member(name, data, kind=b"0"):
    return header(name, len(data), kind) + data + bytes(-len(data) % 512)


END = bytes(1024)
SAMPLE = 2560  # bytes of one sample of samples(): two headers, 512 + 1024 bytes of data


def samples(n, start=0):
    return b"".join(member(f"{i:04d}.cls", str(i).encode()) + member(f"{i:04d}.jpg", b"x" * 700)
                    for i in range(start, start + n))


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def keys(ds):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return [s["__key__"] for s in ds]


def test_a_hand_built_shard_reads_as_tarfile_reads_it(tmp_path):
    path = write(tmp_path, "ok.tar", samples(3) + END)
    assert [m.name for m in tarfile.open(path)] == [m.name for m in TarReader(open(path, "rb"),
                                                                               path)]
    assert count_samples(path) == 3 and keys(WebDataset(path, shuffle_shards=False)) == \
        ["0000", "0001", "0002"]


@pytest.mark.timeout(60)  # tarfile looped forever here, its memory growing
def test_a_negative_base256_size_is_an_error_not_an_endless_loop(tmp_path):
    bad = header("0002.jpg", 0, size_field=b"\xff" * 12)
    path = write(tmp_path, "neg.tar", samples(2) + bad + END)
    with pytest.raises(SampleError, match=r"neg\.tar: negative or malformed base-256 size in a "
                                          rf"tar header at byte {2 * SAMPLE}"):
        WebDataset(path)
    with pytest.warns(RuntimeWarning, match="neg.tar"):
        ds = WebDataset(path, on_error="skip", shuffle_shards=False)
    assert ds.skipped == 1 and keys(ds) == ["0000"]  # the sample in progress is the loss


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [b"L", b"x"], ids=["GNU longname", "pax"])
@pytest.mark.parametrize("how", ["local", "pipe"])
def test_a_longname_or_pax_header_claiming_a_terabyte_is_skipped_not_a_memory_error(
        tmp_path, kind, how):
    huge = header("././@LongLink", 0, kind, size_field=b"\x80" + (2**40).to_bytes(11, "big"))
    path = write(tmp_path, "huge.tar", samples(2) + huge + bytes(512) + samples(1, 2) + END)
    url = path if how == "local" else f"pipe:cat {path}"
    with pytest.raises(SampleError, match=rf"huge\.tar: .* at byte {2 * SAMPLE}"):
        WebDataset(url)
    with pytest.warns(RuntimeWarning, match="huge.tar"):
        ds = WebDataset(url, on_error="skip", shuffle_shards=False)
    assert ds.skipped == 1 and ds.samples_per_epoch == 1


def test_a_pax_header_over_the_limit_is_refused_even_when_its_bytes_are_there(tmp_path):
    pax = member("PaxHeader", b"x" * (MAX_META_BYTES + 1), b"x")
    path = write(tmp_path, "pax.tar", samples(1) + pax + samples(1, 1) + END)
    with pytest.raises(SampleError, match=rf"pax\.tar: a pax header of {MAX_META_BYTES + 1} "
                                          r"bytes \(at most"):
        count_samples(path)


@pytest.mark.parametrize("bad", [
    member("0001.jpg", b"\xff" * 512, b"S"),  # a GNU sparse member, its map garbage
    member("PaxHeader", b"27 GNU.sparse.map=1,x,-5\n", b"x") + member("0001.jpg", b"y" * 10),
    member("PaxHeader", b"99 path=0001.jpg\n", b"x") + member("0001.jpg", b"y"),  # bad length
    member("PaxHeader", b"12 size=-12\n", b"x") + member("0001.jpg", b"y"),
], ids=["GNU sparse", "pax sparse map", "pax record length", "pax negative size"])
def test_sparse_members_and_malformed_pax_records_are_shard_errors_not_value_errors(
        tmp_path, bad):
    path = write(tmp_path, "sparse.tar", samples(1) + bad + END)
    at = rf"sparse\.tar: .* at byte ({SAMPLE}|{SAMPLE + 1024})"  # the pax or the member header
    with pytest.raises(SampleError, match=at):
        count_samples(path)
    with pytest.raises(SampleError, match=at):
        list(WebDataset(path, samples_per_epoch=1))


def test_read_shard_classes_names_the_corrupt_shard(tmp_path):
    path = write(tmp_path, "cls.tar", header("__classes__", 2, checksum=False) + b"[]" +
                 bytes(510) + END)
    with pytest.raises(ShardFormatError, match=r"cls\.tar: bad tar header \(checksum mismatch"):
        read_shard_classes([path])


def corrupt_mid_shard(tmp_path, how):
    raw = bytearray(samples(6) + END)
    at = 3 * SAMPLE  # the header of 0003.cls
    if how == "checksum":
        raw[at] ^= 0x01
    else:
        raw[at:at + 512] = bytes(512)  # a zeroed header: an early end-of-archive to tarfile
    return write(tmp_path, f"{how}.tar", bytes(raw)), at


@pytest.mark.parametrize("how", ["checksum", "zeroed"])
def test_a_bad_header_mid_shard_is_an_error_or_a_counted_skip_never_silent(tmp_path, how):
    path, at = corrupt_mid_shard(tmp_path, how)
    with pytest.raises(SampleError, match=rf"{how}\.tar: .* at byte {at}"):
        count_samples(path)
    with pytest.raises(SampleError, match=rf"{how}\.tar: .*after key '0001'"):
        list(WebDataset(path, samples_per_epoch=6, shuffle_shards=False))
    with pytest.warns(RuntimeWarning, match=f"{how}.tar"):
        ds = WebDataset(path, on_error="skip", shuffle_shards=False)
    assert ds.skipped == 1 and keys(ds) == ["0000", "0001"]  # 0002 may have more members


@pytest.mark.parametrize("how", ["local", "pipe"])
def test_a_shard_truncated_at_a_member_boundary_is_an_error(tmp_path, how):
    path = write(tmp_path, "cut.tar", samples(3))  # every member whole, no end-of-archive
    url = path if how == "local" else f"pipe:cat {path}"
    with pytest.raises(SampleError, match=r"cut\.tar: truncated shard: no end-of-archive marker"
                                          rf" .* at byte {3 * SAMPLE}"):
        count_samples(url)
    with pytest.warns(RuntimeWarning, match="cut.tar"):
        ds = WebDataset(url, on_error="skip")
    assert ds.skipped == 1 and ds.samples_per_epoch == 2


@pytest.mark.parametrize("tail,what", [
    (bytes(512), "one zero block where the end-of-archive marker has two"),
    (END + bytes(9000) + b"junk", f"data after the end-of-archive marker at byte "
                                  f"{3 * SAMPLE + 1024 + 9000}"),
], ids=["one zero block", "data after the end"])
def test_a_shard_must_end_with_two_zero_blocks_and_only_zeros_after(tmp_path, tail, what):
    path = write(tmp_path, "end.tar", samples(3) + tail)
    with pytest.raises(SampleError, match=rf"end\.tar: .*{what}"):
        count_samples(path)


def test_a_corrupt_gzip_shard_names_the_shard(tmp_path):
    raw = bytearray(gzip.compress(samples(4) + END))
    raw[len(raw) // 2] ^= 0xFF
    path = write(tmp_path, "bad.tar.gz", bytes(raw))
    with pytest.raises(SampleError, match=r"bad\.tar\.gz: "):
        list(WebDataset(path, samples_per_epoch=4))


def tarfile_members(raw):
    with tarfile.open(fileobj=io.BytesIO(raw)) as tf:
        return [(m.name, m.offset, tf.extractfile(m).read() if m.isreg() else None)
                for m in tf]


def reader_members(raw, stream):
    f = src = io.BytesIO(raw)
    if stream:  # a non-seekable stream, as an HTTP or pipe: shard is
        f = io.BufferedReader(type("Raw", (io.RawIOBase,), {
            "readable": lambda self: True, "readinto": lambda self, b: src.readinto(b)})())
    r = TarReader(f, "mem.tar")
    return [(m.name.rstrip("/"), m.offset, r.read(m) if m.isreg() else None) for m in r]


NAMES = ["a.jpg", "a.cls", "d" * 60 + "/" + "e" * 80 + ".jpg", "x" * 200 + ".png",
         "ünï/cödé.txt", "empty.txt", "dir/", "link"]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_archives_of_every_tarfile_format_read_exactly_as_tarfile_reads_them(fmt, stream):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for i, name in enumerate(NAMES):
            if fmt == tarfile.USTAR_FORMAT and (not name.isascii() or name.startswith("x")):
                continue  # ustar cannot store these
            info = tarfile.TarInfo(name.rstrip("/"))
            data = b"" if name == "empty.txt" else os.urandom(100 + 300 * i)
            if name.endswith("/"):
                info.type, data = tarfile.DIRTYPE, b""
            elif name == "link":
                info.type, info.linkname, data = tarfile.SYMTYPE, "a.jpg", b""
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    raw = out.getvalue()
    assert reader_members(raw, stream) == tarfile_members(raw)


def test_webdataset_writer_and_shards_write_output_read_whole(tmp_path):
    path = str(tmp_path / "wds.tar")
    with TarWriter(path) as w:
        for i in range(5):
            w.write({"__key__": f"s{i}", "cls": str(i), "txt": "t" * (i * 300)})
    assert count_samples(path) == 5
    assert [s["cls"] for s in WebDataset(path, shuffle_shards=False)] == \
        [str(i).encode() for i in range(5)]


def test_shards_write_does_not_write_through_a_planted_partial_symlink(tmp_path):
    root = tmp_path / "imgs"
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        (root / c / "1.jpg").write_bytes(b"\xff\xd8" + c.encode() * 50)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = tmp_path / "out" / "s-%03d.tar"
    out.parent.mkdir()
    os.symlink(victim, str(out) % 0 + ".partial")
    paths = write_shards(str(root), str(out), per_shard=10, progress=False)
    assert victim.read_bytes() == b"precious" and os.path.islink(str(out) % 0 + ".partial")
    assert read_shard_classes(paths) == ["a", "b"] and count_samples(paths[0]) == 2
    assert oct(os.stat(paths[0]).st_mode & 0o777) == oct(0o644)


def test_a_sample_with_a_file_name_twice_is_a_shard_error_naming_the_shard(tmp_path):
    """Found by scripts/checks/fuzz.py: this was a bare ValueError without the shard's name."""
    path = write(tmp_path, "dup.tar", member("0001.cls", b"1") + member("0001.cls", b"2") + END)
    with pytest.raises(SampleError, match=r"dup\.tar.*0001\.cls: duplicate file name"):
        keys(WebDataset(path))


# -- decompressed bytes and trailing data are bounded (issue 35) -------------------------------

@pytest.mark.timeout(60)
def test_gigabytes_of_zeros_after_the_end_marker_of_a_tiny_bz2_shard_are_refused_unread(
        tmp_path):
    """A 20 KiB .tar.bz2 whose stream goes on with 16 GiB of zeros after the end-of-archive
    marker kept ``WebDataset.__init__`` decompressing for minutes; at most
    ``MAX_TRAILING_BYTES`` are read after the marker now."""
    zeros = bz2.compress(bytes(64 << 20))  # bzip2 reads concatenated streams as one
    path = write(tmp_path, "bomb.tar.bz2", bz2.compress(samples(2) + END) + zeros * 256)
    assert os.path.getsize(path) < 32 << 10
    with pytest.raises(SampleError, match=r"bomb\.tar\.bz2: more bytes after the "
                                          r"end-of-archive marker, more than the \d+ a tar "
                                          "writer pads"):
        WebDataset([path])


@pytest.mark.parametrize("tail, ok", [(1 << 20, True), (MAX_TRAILING_BYTES + 512, False)])
def test_padding_after_the_end_marker_of_a_local_tar_is_bounded_without_reading_it(
        tmp_path, tail, ok):
    path = write(tmp_path, "pad.tar", samples(2) + END + bytes(tail))  # 1 MiB: tar -b 2048
    if ok:
        assert count_samples(path) == 2
    else:
        with pytest.raises(SampleError, match=rf"pad\.tar: {tail} bytes after the end-of-"
                                              "archive marker"):
            count_samples(path)


def big_sample_shard(tmp_path, name, members, size):
    data = b"".join(member(f"0000.m{k}", bytes(size)) for k in range(members))
    data += samples(1, start=1) + END
    return write(tmp_path, name, gzip.compress(data) if name.endswith(".gz") else data)


def test_the_member_bytes_of_one_sample_are_bounded_naming_shard_sample_and_member(
        tmp_path, monkeypatch):
    """Each member under the per-member cap, but many of them in one sample: a tiny .tar.gz
    held any amount of memory. ``MAX_SAMPLE_BYTES`` (4 GiB) is lowered to 1 MiB here."""
    monkeypatch.setattr(shard_samples_module, "MAX_SAMPLE_BYTES", 1 << 20, raising=False)
    fits = big_sample_shard(tmp_path, "fits.tar.gz", 2, 400 << 10)
    assert [sorted(s) for s in WebDataset([fits], shuffle_shards=False)][0][-2:] == ["m0", "m1"]
    path = big_sample_shard(tmp_path, "many.tar.gz", 3, 400 << 10)
    with pytest.raises(SampleError, match=r"many\.tar\.gz: sample '0000': member '0000\.m2' "
                                          r"brings it to 1228800 bytes, more than the 1048576"):
        list(WebDataset([path], samples_per_epoch=2))


@pytest.mark.parametrize("name, ok", [("big.tar.gz", False), ("big.tar", True)])
def test_what_a_compressed_shard_expands_to_is_bounded(tmp_path, monkeypatch, name, ok):
    """``MAX_DECOMPRESSED_SHARD_BYTES`` (16 GiB) lowered to 2 MiB: a .tar.gz expanding to 3 MiB
    is refused naming it; the same bytes uncompressed are read (nothing to expand)."""
    monkeypatch.setattr(tar_reader, "MAX_DECOMPRESSED_SHARD_BYTES", 2 << 20, raising=False)
    path = big_sample_shard(tmp_path, name, 3, 1 << 20)
    if ok:
        assert count_samples(path) == 2
    else:
        with pytest.raises(SampleError, match=r"big\.tar\.gz: a compressed shard expanding "
                                              r"past 2097152 bytes"):
            count_samples(path)


def zeros_member_tar_gz(tmp_path, name, size):
    """A .tar.gz of one sample whose one member is ``size`` zero bytes: gzip members of 1 MiB
    of zeros repeated (a gzip stream may hold many), so a few hundred KiB on disk."""
    mib = gzip.compress(bytes(1 << 20), compresslevel=9)
    with open(tmp_path / name, "wb") as f:
        f.write(gzip.compress(header("0000.bin", size)))
        for _ in range(size >> 20):
            f.write(mib)
        f.write(gzip.compress(bytes(size % (1 << 20)) + bytes(-size % 512) + END))
    return str(tmp_path / name)


def test_a_tiny_tar_gz_declaring_300_mib_in_one_member_is_refused_at_the_default_unread(
        tmp_path):
    """Issue 35: a small .tar.gz expanding to one huge member was accepted (up to 4 GiB a
    sample). The default bound (256 MiB) refuses its 300 MiB member from the header, naming
    the shard, the member, the bound and the keyword, before a byte of it is decompressed."""
    import tracemalloc
    from pooled_loader.core.constants import MAX_SAMPLE_BYTES
    assert MAX_SAMPLE_BYTES == 256 << 20
    path = zeros_member_tar_gz(tmp_path, "bomb.tar.gz", 300 << 20)
    assert os.path.getsize(path) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(SampleError, match=r"bomb\.tar\.gz: sample '0000': member "
                                              r"'0000\.bin' brings it to 314572800 bytes, more "
                                              r"than the 268435456 .*max_sample_bytes"):
            list(WebDataset([path], samples_per_epoch=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20  # the member was never read into memory


def test_max_sample_bytes_is_a_keyword_of_webdataset_and_of_shards_index(tmp_path):
    """The bound is set per dataset (an int or "4MiB"), for streamed, global-shuffle and
    indexing reads alike; the error says how to raise it."""
    from pooled_loader.shards.writer import main as shards_main
    gz = zeros_member_tar_gz(tmp_path, "two.tar.gz", 2 << 20)
    with pytest.raises(SampleError, match=r"two\.tar\.gz: .*more than the 1048576 one sample "
                                          r"may hold in memory \(max_sample_bytes: raise it "
                                          r"with WebDataset\(max_sample_bytes=\.\.\.\)"):
        list(WebDataset([gz], samples_per_epoch=1, max_sample_bytes=1 << 20))
    [sample] = list(WebDataset([gz], samples_per_epoch=1, max_sample_bytes="4MiB"))
    assert len(sample["bin"]) == 2 << 20
    with pytest.raises(ValueError, match="max_sample_bytes"):
        WebDataset([gz], samples_per_epoch=1, max_sample_bytes=0)

    plain = write(tmp_path, "two.tar", member("0000.bin", bytes(2 << 20)) + samples(2, 1) + END)
    with pytest.raises(ShardFormatError, match=r"two\.tar: sample '0000'.*1048576"):
        shards_main(["index", plain, "--max-sample-bytes", "1MiB"])
    assert not os.path.exists(plain + ".idx.json")
    assert shards_main(["index", plain]) == 0
    with pytest.raises(SampleError, match=r"two\.tar: .*1048576.*max_sample_bytes"):
        list(WebDataset([plain], shuffle="global", seed=1, max_sample_bytes=1 << 20))
    got = list(WebDataset([plain], shuffle="global", seed=1))
    assert sorted(s["__key__"] for s in got) == ["0000", "0001", "0002"]
