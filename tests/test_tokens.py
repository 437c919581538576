"""Memory-mapped token files (issue 26): writing, untrusted headers, windows and documents through
real workers, exact resume, and the `tokens write` command."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pooled_loader import PooledLoader
from pooled_loader.ragged.collate import packed
from pooled_loader.ragged.samplers import TokenBudgetBatchSampler
from pooled_loader.ragged.tokens import TokenDataset, TokenFileError, write_tokens

# The comparisons keep every batch of an epoch: the pool grows (and says so), as it should.
pytestmark = pytest.mark.filterwarnings("ignore:PooledLoader. every slot")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documents(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50000, size=int(rng.integers(1, 90))) for _ in range(n)]


@pytest.fixture
def token_file(tmp_path):
    docs = documents()
    path = str(tmp_path / "corpus")
    write_tokens(path, docs, dtype=np.uint16)
    return path, docs


def test_documents_and_windows_read_back_what_was_written(token_file):
    path, docs = token_file
    ds = TokenDataset(path)
    assert len(ds) == len(docs) and ds.dtype == np.uint16
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
    assert ds.lengths().tolist() == [len(d) for d in docs]
    flat = np.concatenate(docs)
    windows = TokenDataset(path + ".bin", seq_len=33, stride=20)
    assert len(windows) == (len(flat) - 33) // 20 + 1
    assert np.array_equal(windows[3], flat[60:93]) and np.array_equal(windows[-1], flat[
        (len(windows) - 1) * 20:(len(windows) - 1) * 20 + 33])
    assert np.array_equal(np.memmap(path + ".bin", dtype=np.uint16), flat)  # nanoGPT reads it
    assert TokenDataset(path, max_len=5).lengths().max() == 5
    with pytest.raises(IndexError):
        ds[len(docs)]


def test_ids_that_do_not_fit_the_dtype_are_refused_with_the_document(tmp_path):
    with pytest.raises(ValueError, match="document 1: token id 70000 does not fit uint16"):
        write_tokens(tmp_path / "x", [[1, 2], [70000]], dtype=np.uint16)
    assert not os.listdir(tmp_path)  # nothing half-written is left


@pytest.mark.parametrize("damage, message", [
    (lambda b, i: open(i, "r+b").truncate(40), "truncated or corrupt"),
    (lambda b, i: open(b, "r+b").truncate(10), "does not match"),
    (lambda b, i: _patch(i, 0, b"NOTTOKEN"), "bad magic"),
    (lambda b, i: _patch(i, 8, (7).to_bytes(4, "little")), "version 7"),
    (lambda b, i: _patch(i, 12, b"<f4\0"), "unknown token dtype"),
    (lambda b, i: _patch(i, 24, (2**60).to_bytes(8, "little")), "announces"),
    (lambda b, i: _patch(i, 40, (10**6).to_bytes(8, "little")), "not 0.."),
    (lambda b, i: os.remove(b), "No such file"),
])
def test_damaged_token_files_give_errors_naming_the_file(token_file, damage, message):
    path, _ = token_file
    damage(path + ".bin", path + ".idx")
    with pytest.raises(TokenFileError, match=message) as info:
        TokenDataset(path)
    assert "corpus." in str(info.value)


def _patch(name, offset, data):
    with open(name, "r+b") as f:
        f.seek(offset)
        f.write(data)


def py_packed(samples):
    values = [torch.from_numpy(s.astype(np.int64)).to(torch.uint16) for s in samples]
    lengths = torch.tensor([len(v) for v in values])
    cu = torch.zeros(len(values) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return torch.cat(values), cu, torch.cat([torch.arange(n) for n in lengths.tolist()])


def test_packed_documents_with_a_token_budget_equal_dataloader_and_resume_exactly(token_file):
    path, _ = token_file
    ds = TokenDataset(path)

    def sampler():
        return TokenBudgetBatchSampler(ds.lengths(), 256, packing=True, seed=1)
    ours = list(PooledLoader(ds, batch_sampler=sampler(), num_workers=2, collate_fn=packed()))
    theirs = list(DataLoader(ds, batch_sampler=sampler(), collate_fn=py_packed))
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert a.values.dtype == torch.uint16 and len(a.values) <= 256

    loader = PooledLoader(ds, batch_sampler=sampler(), num_workers=2, collate_fn=packed())
    it = iter(loader)
    next(it), next(it), next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    again = PooledLoader(ds, batch_sampler=sampler(), num_workers=1, collate_fn=packed())
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(ours) - 3
    assert all(torch.equal(a.values, b.values) for a, b in zip(rest, ours[3:]))


def test_windows_batch_with_the_default_collate_in_workers(token_file):
    path, _ = token_file
    ds = TokenDataset(path, seq_len=17)
    ours = list(PooledLoader(ds, batch_size=8, num_workers=2))
    theirs = list(DataLoader(ds, batch_size=8, collate_fn=lambda b: torch.from_numpy(
        np.stack(b))))
    assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_tokens_write_command_tokenizes_a_folder_with_the_users_function(tmp_path):
    texts = tmp_path / "texts"
    (texts / "sub").mkdir(parents=True)
    (texts / "a.txt").write_text("hello world")
    (texts / "sub" / "b.txt").write_text("abc")
    (texts / ".hidden.txt").write_text("skipped")
    (tmp_path / "mytok.py").write_text("def encode(text):\n    return [ord(c) for c in text]\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    out = str(tmp_path / "corpus")

    def run(*args):
        return subprocess.run([sys.executable, "-m", "pooled_loader", "tokens", *args],
                              capture_output=True, text=True, env=env, timeout=120)
    result = run("write", out, "--from", str(texts), "--tokenizer", "mytok:encode",
                 "--dtype", "uint16")
    assert result.returncode == 0, result.stderr
    assert "2 documents, 14 tokens (uint16)" in result.stdout
    ds = TokenDataset(out)
    assert bytes(ds[0].astype(np.uint8)) == b"hello world" and bytes(ds[1].astype(np.uint8)) == b"abc"
    assert run("info", out).stdout.strip() == "2 documents, 14 tokens (uint16)"
    bad = run("write", out, "--from", str(texts), "--tokenizer", "mytok:nope")
    assert bad.returncode == 1 and bad.stderr.startswith("error: --tokenizer mytok:nope")
    os.truncate(out + ".idx", 20)
    broken = run("info", out)
    assert broken.returncode == 1 and "corpus.idx" in broken.stderr


def test_spawned_workers_map_the_file_themselves(token_file):
    path, docs = token_file
    ds = TokenDataset(path)
    ds[0]  # mapped here: the map must not travel to the workers
    loader = PooledLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="spawn",
                          collate_fn=packed(dtype=torch.int64))
    values = torch.cat([b.values for b in loader])
    assert torch.equal(values, torch.from_numpy(np.concatenate(docs).astype(np.int64)))


def test_a_token_file_cut_short_while_open_is_an_error_not_a_crash(token_file):
    path, docs = token_file
    ds = TokenDataset(path)
    assert np.array_equal(ds[0], docs[0])
    os.truncate(path + ".bin", 10)
    with pytest.raises(TokenFileError, match="corpus.bin: the file shrank"):
        ds[len(docs) - 1]


def test_writing_leaves_no_temporary_files_and_replaces_a_pair_whole(tmp_path):
    write_tokens(tmp_path / "c", [[1, 2, 3]])
    write_tokens(tmp_path / "c", [[4], [5, 6]])
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.idx"]
    assert TokenDataset(tmp_path / "c")[1].tolist() == [5, 6]


def test_a_cache_fingerprint_names_token_datasets_by_their_released_path(token_file):
    """TokenDataset moved to pooled_loader.ragged.tokens (issue 41); a cache built from one
    before the move must still fit, so the fingerprint keeps the released class path."""
    from pooled_loader.cache import fingerprint_info
    path, _ = token_file
    assert fingerprint_info(TokenDataset(path))["class"] == "pooled_loader.tokens.TokenDataset"
