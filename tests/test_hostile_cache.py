"""Hostile and corrupt cache files (issue 24): each test forges its own file from a real cache.

A forged file has valid checksums wherever the attack needs them (preamble, header, index
arrays), so what is tested is the bound or schema check itself, not the checksum in front of it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from pooled_loader import PooledLoader
from pooled_loader.__main__ import main as cli
from pooled_loader.cache import CachedDataset, CacheError, CacheFormatError, build_cache
from pooled_loader.cache.format import (
    PREAMBLE, PREAMBLE_SIZE, STATE_COMPLETE, pack_preamble, unpack_preamble,
)

HERE = os.path.dirname(os.path.abspath(__file__))


class Mixed:
    """(image, label, name, raw bytes): array, int, str and bytes leaves."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return (np.full((4, 5, 3), i, np.uint8), i % 3, f"name-{i}", bytes([i]) * (i + 1))

    def __repr__(self):
        return "Mixed()"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile_cache") / "good.plc")
    build_cache(Mixed(), path, progress=False)
    return path


def header_of(path):
    with open(path, "rb") as f:
        raw = f.read()
    p = unpack_preamble(raw[:PREAMBLE_SIZE], path)
    return raw, p, json.loads(raw[p.hdr_off:p.hdr_off + p.hdr_len])


def forge(src, dst, *, arrays=None, header=None, raw_header=None, fix_crc=True):
    """Copy ``src`` to ``dst``; ``arrays`` maps an index array name to a function changing it
    in place; ``header`` changes the JSON header (a dict) in place; ``raw_header`` replaces the
    header's bytes. Every checksum is recomputed (array crcs unless ``fix_crc=False``)."""
    raw, p, hdr = header_of(src)
    body = bytearray(raw[:p.hdr_off])
    for name, change in (arrays or {}).items():
        a = hdr["arrays"][name]
        dt = np.dtype(a["dtype"])
        n = dt.itemsize * int(np.prod(a["shape"]))
        arr = np.frombuffer(bytes(body[a["offset"]:a["offset"] + n]), dt).reshape(
            a["shape"]).copy()
        change(arr)
        body[a["offset"]:a["offset"] + n] = arr.tobytes()
        if fix_crc:
            a["crc"] = zlib.crc32(arr.tobytes())
    if header is not None:
        header(hdr)
    hb = raw_header if raw_header is not None else json.dumps(hdr).encode()
    body[:PREAMBLE_SIZE] = pack_preamble(STATE_COMPLETE, p.hdr_off, len(hb), zlib.crc32(hb))
    with open(dst, "wb") as f:
        f.write(bytes(body) + hb)
    return str(dst)


def one_line_error(capsys, *args):
    """``python -m pooled_loader ARGS`` in this process: its exit status and stderr line."""
    status = cli(list(args))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return status, lines[0]


def test_the_forge_itself_keeps_a_cache_readable(good, tmp_path):
    same = forge(good, tmp_path / "same.plc")
    ds = CachedDataset(same)
    assert ds.raw(5)[1:] == (2, "name-5", b"\x05" * 6)
    ds.verify()


def test_a_record_offset_that_wraps_in_uint64_is_rejected_naming_file_and_record(good, tmp_path):
    def wrap(o):
        o[3, 0] = 2**64 - 64  # offset + nbytes wraps round to 64, inside the data area

    def size(n):
        n[3, 0] = 128

    def shape(s):
        s[3, 0] = 128
    bad = forge(good, tmp_path / "wrap.plc",
                arrays={"leaf2.offset": wrap, "leaf2.nbytes": size, "leaf2.shape": shape})
    with pytest.raises(CacheFormatError, match=r"wrap\.plc: record 3 \(variant 0\) of leaf 2"):
        CachedDataset(bad)


def test_a_str_record_past_the_end_of_the_file_is_an_error_not_an_empty_string(good, tmp_path):
    size = os.path.getsize(good)

    def cover(h):
        h["data_end"] = size + (1 << 20)  # claims the data area runs past the file

    def outside(o):
        o[7, 0] = size + 4096
    bad = forge(good, tmp_path / "far.plc", header=cover, arrays={"leaf2.offset": outside})
    with pytest.raises(CacheFormatError, match=r"far\.plc: malformed header: data_end"):
        CachedDataset(bad).raw(7)  # was "": the name silently empty


def test_a_record_outside_the_data_area_is_rejected_naming_it(good, tmp_path):
    _, _, hdr = header_of(good)

    def outside(o):
        o[7, 0] = hdr["data_end"] + 64
    bad = forge(good, tmp_path / "str.plc", arrays={"leaf2.offset": outside})
    with pytest.raises(CacheFormatError, match=r"str\.plc: record 7 \(variant 0\) of leaf 2"):
        CachedDataset(bad)


def test_a_shape_whose_product_wraps_to_the_record_size_is_rejected(good, tmp_path):
    def huge(s):
        s[1, 0] = (2**32, 2**32, 1)  # int64 product 2**64 wraps to 0 ...
    def empty(n):
        n[1, 0] = 0  # ... matching a zero-size record
    bad = forge(good, tmp_path / "shape.plc", arrays={"leaf0.shape": huge, "leaf0.nbytes": empty})
    with pytest.raises(CacheFormatError, match=r"shape\.plc: record 1 \(variant 0\) of leaf 0"):
        CachedDataset(bad)


def test_a_changed_label_fails_at_open_and_cache_verify_exits_non_zero(good, tmp_path, capsys):
    def relabel(v):
        v[4, 0] = 2 if v[4, 0] != 2 else 1
    bad = forge(good, tmp_path / "label.plc", arrays={"leaf1.value": relabel}, fix_crc=False)
    with pytest.raises(CacheFormatError, match=r"label\.plc: index array leaf1\.value is "
                                               r"corrupted \(crc32 mismatch"):
        CachedDataset(bad)
    status, line = one_line_error(capsys, "cache", "verify", bad)
    assert status == 1 and line.startswith("error: ") and "label.plc" in line
    assert "all records OK" not in capsys.readouterr().out


def test_a_cache_of_the_previous_format_says_to_rebuild(good, tmp_path):
    raw = bytearray(open(good, "rb").read())
    head = PREAMBLE.pack(b"PLCACHE\x00", 1, *PREAMBLE.unpack(raw[:PREAMBLE.size])[2:])[:-4]
    raw[:PREAMBLE.size] = head + zlib.crc32(head).to_bytes(4, "little")
    old = tmp_path / "v1.plc"
    old.write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match=r"v1\.plc: cache format version 1.*rebuild"):
        CachedDataset(str(old))


def _set(path, value):
    def change(h):
        node = h
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


CRAFTED = {  # header changes that used to give KeyError, TypeError, ... (or worse)
    "count missing": _set(["count"], KeyError),
    "count a string": _set(["count"], "16"),
    "count huge": _set(["count"], 2**62),
    "variants zero": _set(["variants"], 0),
    "layout a list": _set(["layout"], [1, 2]),
    "leaf kind unknown": _set(["layout", "items", 0, "kind"], "pickle"),
    "leaf dtype object": _set(["layout", "items", 0, "dtype"], "O"),
    "leaf dtype garbage": _set(["layout", "items", 0, "dtype"], "not a dtype"),
    "leaf dtype numpy parses with ast": _set(["layout", "items", 0, "dtype"], ","),  # fuzz
    "leaf ndim huge": _set(["layout", "items", 0, "ndim"], 10**6),
    "leaf id repeated": _set(["layout", "items", 1, "id"], 0),
    "items not a list": _set(["layout", "items"], {"a": 1}),
    "array missing": _set(["arrays", "leaf0.crc"], KeyError),
    "array shape negative": _set(["arrays", "leaf1.value", "shape"], [-16, 1]),
    "array offset a float": _set(["arrays", "leaf0.offset", "offset"], 1.5),
    "array offset past the file": _set(["arrays", "leaf0.offset", "offset"], 2**63),
    "array dtype changed": _set(["arrays", "leaf1.value", "dtype"], "<f8"),
    "skipped malformed": _set(["skipped"], [{"index": "x"}]),
    "source missing": _set(["source"], KeyError),
    "data_start inside the preamble": _set(["data_start"], 8),
}


@pytest.mark.parametrize("what", sorted(CRAFTED))
def test_a_crafted_header_raises_a_cache_error_naming_the_file_and_the_cli_prints_one_line(
        what, good, tmp_path, capsys):
    bad = forge(good, tmp_path / "crafted.plc", header=CRAFTED[what])
    with pytest.raises(CacheFormatError, match=r"crafted\.plc: malformed header"):
        CachedDataset(bad)
    for command in ("info", "verify"):
        status, line = one_line_error(capsys, "cache", command, bad)
        assert status == 1 and line.startswith("error: ") and "crafted.plc" in line


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b"{not json", b"[]", b"7"],
                         ids=["nested 100000 deep", "not json", "a list", "a number"])
def test_a_header_that_is_deep_or_not_an_object_is_a_cache_error(raw, good, tmp_path, capsys):
    bad = forge(good, tmp_path / "deep.plc", raw_header=raw)
    with pytest.raises(CacheFormatError, match=r"deep\.plc: "):
        CachedDataset(bad)
    status, line = one_line_error(capsys, "cache", "info", bad)
    assert status == 1 and "deep.plc" in line


TRUNCATE_WHILE_OPEN = textwrap.dedent("""
    import os, sys
    from pooled_loader.cache import CachedDataset, CacheFormatError
    path = sys.argv[1]
    ds = CachedDataset(path)
    ds.raw(0)
    os.truncate(path, 4096)  # the records are gone, the mapping is still there
    try:
        ds.raw(len(ds) - 1)
    except CacheFormatError as e:
        print("raised:", e)
""")


def test_a_cache_truncated_while_open_raises_instead_of_dying_of_sigbus(good, tmp_path):
    path = shutil.copy(good, tmp_path / "shrink.plc")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    r = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_OPEN, str(path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)  # -7 would be SIGBUS
    assert "raised:" in r.stdout and "shrink.plc: the file shrank from" in r.stdout


def test_a_loader_whose_cache_is_truncated_mid_epoch_stops_with_a_clear_error(good, tmp_path):
    path = shutil.copy(good, tmp_path / "mid.plc")
    ds = CachedDataset(path)
    loader = PooledLoader(ds, batch_size=2, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    next(it)
    os.truncate(path, 4096)
    with pytest.raises(Exception, match=r"mid\.plc: the file shrank") as info:
        for _ in it:
            pass
    assert "died" not in str(info.value)  # the worker raised; it was not killed by SIGBUS


def test_symlinks_planted_at_the_partial_and_journal_are_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    out = tmp_path / "c.plc"
    os.symlink(victim, str(out) + ".partial")  # no journal: a fresh build
    build_cache(Mixed(), str(out), progress=False)
    assert victim.read_bytes() == b"precious" and CachedDataset(str(out)).raw(3)[1] == 0
    out2 = tmp_path / "d.plc"
    os.symlink(victim, str(out2) + ".partial.journal")
    with pytest.raises(CacheError, match=r"d\.plc\.partial\.journal is a symlink"):
        build_cache(Mixed(), str(out2), progress=False)
    assert victim.read_bytes() == b"precious" and not os.path.exists(out2)
    os.unlink(str(out2) + ".partial.journal")
    os.link(victim, str(out2) + ".partial.journal")  # a hard link: the same, by another way
    with pytest.raises(CacheError, match=r"d\.plc\.partial\.journal is not a regular file"):
        build_cache(Mixed(), str(out2), progress=False)
    assert victim.read_bytes() == b"precious"
