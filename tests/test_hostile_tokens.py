"""Hostile token files (issue 35): wrapping offsets, a ``.bin`` cut short under an item already
handed out, a sparse file larger than the address space a process may map, and FIFOs or
devices in place of the files ``TokenDataset`` and ``tokens write`` read.

Every test that could hang on a regression runs under a timeout."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pooled_loader.ragged.tokens import HEADER, MAGIC, TokenDataset, TokenFileError, write_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_pair(path, offsets, num_tokens, dtype=b"<u2", bin_bytes=None):
    """A token index with these offsets, and a .bin of the size it announces (sparse)."""
    with open(path + ".idx", "wb") as f:
        f.write(HEADER.pack(MAGIC, 1, dtype.ljust(4, b"\0"), num_tokens, len(offsets) - 1))
        f.write(struct.pack(f"<{len(offsets)}Q", *offsets))
    with open(path + ".bin", "wb") as f:
        f.truncate(num_tokens * 2 if bin_bytes is None else bin_bytes)


def run_python(code, timeout=120):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("offsets", [
    [0, 1, 2**63, 2**64 - 1, 8],  # int64 differences: 1, 2**63 - 1, 2**63 - 1, 9: all positive
    [0, 2**64 - 1, 8],
    [0, 5, 3, 8],
])
def test_offsets_that_wrap_as_int64_are_refused_naming_the_index(tmp_path, offsets):
    path = str(tmp_path / "t")
    write_pair(path, offsets, 8)
    with pytest.raises(TokenFileError, match=r"t\.idx: document offsets are not 0\.\.8 in order"):
        TokenDataset(path)


def test_an_item_handed_out_before_the_file_is_cut_stays_readable_and_the_next_is_an_error(
        tmp_path):
    """Items were views of a memory map: reading one after the file was cut killed the process
    with SIGBUS. They are read into arrays of their own now; the next item is the error."""
    path = str(tmp_path / "corpus")
    write_tokens(path, [np.arange(5000) % 300 for _ in range(8)], dtype=np.uint16)
    r = run_python(f"""
        import os, numpy as np
        from pooled_loader.ragged.tokens import TokenDataset, TokenFileError
        ds = TokenDataset({path!r})
        item = ds[7]
        os.truncate({path + '.bin'!r}, 100)
        assert int(item.sum()) == int((np.arange(5000) % 300).sum())  # SIGBUS on a view
        try:
            ds[6]
        except TokenFileError as e:
            print("error:", e)
        """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "corpus.bin: the file shrank while it was open" in r.stdout


def test_items_are_read_into_the_slot_row_or_one_array_per_batch_with_the_same_values(
        tmp_path):
    """The cheap read paths: ``getitem_into`` reads a window into the row it is given (that
    very array comes back: the loader copies nothing more), a row of another length or dtype
    gets a new array; ``__getitems__`` reads a batch of windows into one array."""
    path = str(tmp_path / "t")
    write_tokens(path, [np.arange(n) for n in (300, 50, 700)], dtype=np.uint16)
    win, docs = TokenDataset(path, seq_len=64, stride=10), TokenDataset(path, max_len=100)
    row = np.zeros(64, np.uint16)
    assert win.getitem_into(3, row) is row and (row == win[3]).all() and row[0] == 30
    for other in (np.zeros(63, np.uint16), np.zeros(64, np.int32), None):
        got = win.getitem_into(-1, other)
        assert got is not other and (got == win[len(win) - 1]).all()
    batch = win.__getitems__([5, 0, len(win) - 1])
    assert all(b.base is batch[0].base for b in batch)  # one array
    assert [b.tolist() for b in batch] == [win[i].tolist() for i in (5, 0, -1)]
    assert [d.tolist() for d in docs.__getitems__([2, 1])] == [docs[2].tolist(), docs[1].tolist()]
    with pytest.raises(IndexError):
        win.__getitems__([0, len(win)])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collate", [None, "list"])
def test_a_file_cut_during_a_loader_epoch_is_an_error_naming_it_not_a_sigbus(tmp_path, collate):
    """Through PooledLoader's workers: windows read into the slot rows (``getitem_into``, the
    default collate) or through ``__getitems__`` (a custom collate); the cut ends the epoch
    with the error naming the file, never a worker killed by SIGBUS."""
    path = str(tmp_path / "corpus")
    write_tokens(path, [np.arange(5000) % 300 for _ in range(8)], dtype=np.uint16)
    r = run_python(f"""
        import os
        from pooled_loader import PooledLoader
        from pooled_loader.ragged.tokens import TokenDataset
        collate = {"list" if collate else "None"}
        ds = TokenDataset({path!r}, seq_len=16)
        batches = 0
        try:
            for batch in PooledLoader(ds, batch_size=4, num_workers=1, collate_fn=collate):
                if batches == 0:
                    os.truncate({path + '.bin'!r}, 100)
                batches += 1
        except Exception as e:
            print("error:", type(e).__name__, str(e).replace(chr(10), " "))
        print("batches", batches, "of", len(ds) // 4)
        """)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "corpus.bin: the file shrank while it was open" in r.stdout, r.stdout[-2000:]


@pytest.mark.timeout(120)
def test_a_sparse_2_tib_token_file_reads_under_an_address_space_limit(tmp_path):
    """A 2 TiB ``.bin`` (sparse) with ``ulimit -v`` of 16 GiB: mapping it failed with a bare
    ENOMEM naming no file; items are read with ``pread``, so it reads like any other."""
    path = str(tmp_path / "big")
    tokens = 1 << 40
    try:
        write_pair(path, [0, 10, tokens], tokens)
    except OSError as exc:  # a filesystem without sparse files this large
        pytest.skip(f"cannot make a sparse 2 TiB file here: {exc}")
    r = run_python(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
        from pooled_loader.ragged.tokens import TokenDataset
        ds = TokenDataset({path!r}, max_len=64)
        print(len(ds), ds[0].tolist(), ds[1].shape, int(ds[1].sum()))
        win = TokenDataset({path!r}, seq_len=32)
        row = win.getitem_into(len(win) - 1, __import__("numpy").ones(32, win.dtype))
        print(win[len(win) - 1].shape, int(row.sum()), win.__getitems__([0, 1])[1].shape)
        """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:2] == [f"2 {[0] * 10} (64,) 0", "(32,) 0 (32,)"]


def _fifo(path):
    os.mkfifo(path)
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which, kind", [(".idx", "fifo"), (".bin", "fifo"), (".idx", "zero"),
                                         (".bin", "zero")])
def test_a_fifo_or_device_in_place_of_a_token_file_is_refused_naming_it(tmp_path, which, kind):
    path = str(tmp_path / "t")
    write_tokens(path, [[1, 2, 3]])
    os.unlink(path + which)
    if kind == "fifo":
        _fifo(path + which)
    else:
        os.symlink("/dev/zero", path + which)
    what = "a FIFO" if kind == "fifo" else "a character device"
    with pytest.raises(OSError, match=f"{what}, not a regular file.*t{which}"):
        TokenDataset(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_tokens_write_refuses_a_fifo_or_device_among_the_text_files(tmp_path, kind):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.txt").write_text("hello world")
    if kind == "fifo":
        _fifo(str(src / "b.txt"))
    else:
        os.symlink("/dev/zero", src / "b.txt")
    (tmp_path / "tok.py").write_text("def encode(text):\n    return [len(w) for w in "
                                     "text.split()]\n")
    r = subprocess.run([sys.executable, "-m", "pooled_loader", "tokens", "write",
                        str(tmp_path / "out"), "--from", str(src), "--tokenizer", "tok:encode"],
                       cwd=ROOT, capture_output=True, text=True, timeout=50,
                       env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert r.returncode == 1, r.stderr[-2000:]
    assert "not a regular file" in r.stderr and "b.txt" in r.stderr
    assert not os.path.exists(tmp_path / "out.idx")
