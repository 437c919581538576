"""Nothing is written before the arguments are checked (issue 45, item 6): a call whose arguments
conflict, or name something that is not there, raises and leaves the disk as it was: no cache
folder, journal, partial file, temporary file or shard index behind."""
from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from test_webdataset import make_shards

from pooled_loader.cache import build_cache
from pooled_loader.core.errors import ShardIndexError
from pooled_loader.ragged import tokens
from pooled_loader.shards import writer
from pooled_loader.shards.index import INDEX_SUFFIX
from pooled_loader.shards.webdataset import WebDataset


@pytest.mark.parametrize("conflict, error", [
    ({"shuffle": "global", "samples_per_epoch": 5}, "leave samples_per_epoch"),
    ({"shuffle": "global", "shuffle_buffer": 4}, "leave samples_per_epoch and shuffle_buffer"),
    ({"index": True, "samples_per_epoch": 5}, "leave samples_per_epoch unset"),
    ({"index": True, "cache_limit": "lots"}, "cache_limit: cannot read 'lots'"),
    ({"shuffle": "global"}, "has no readable index"),  # the shards have none
])
def test_webdataset_makes_no_cache_folder_before_its_arguments_are_checked(tmp_path, conflict,
                                                                           error):
    paths = make_shards(str(tmp_path / "s"), [3, 4])
    folder = tmp_path / "cache"
    with pytest.raises((ValueError, ShardIndexError), match=error):
        WebDataset(paths, cache_dir=str(folder), **conflict)
    assert not folder.exists()
    WebDataset(paths, cache_dir=str(folder))  # the same folder, arguments that fit: made
    assert folder.is_dir()


class Zeros:
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.zeros(3, np.uint8)


@pytest.mark.parametrize("bad, error", [
    ({"chunk_size": 0}, "chunk_size >= 1"),
    ({"num_workers": -1}, "num_workers must be >= 0"),
    ({"num_workers": 1, "multiprocessing_context": "nope"}, "multiprocessing_context must be"),
])
def test_build_cache_writes_no_journal_before_its_arguments_are_checked(tmp_path, bad, error):
    with pytest.raises(ValueError, match=error):
        build_cache(Zeros(), str(tmp_path / "x.plc"), progress=False, **bad)
    assert os.listdir(tmp_path) == []  # no x.plc.partial, no x.plc.partial.journal


def test_tokens_write_makes_no_temporary_file_for_a_folder_without_texts(tmp_path,
                                                                          monkeypatch):
    made = []
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        made.append(kwargs.get("prefix"))
        return real(*args, **kwargs)
    monkeypatch.setattr(tokens.tempfile, "mkstemp", mkstemp)
    (tmp_path / "texts").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        tokens.write_from_texts(str(tmp_path / "out"), str(tmp_path / "texts"), list)
    assert made == [] and sorted(os.listdir(tmp_path)) == ["texts"]


def test_shards_index_writes_no_index_before_every_pattern_is_checked(tmp_path):
    local = make_shards(str(tmp_path / "s"), [2])[0]
    with pytest.raises(ValueError, match="works on local shards"):
        writer.main(["index", f"{local}::http://127.0.0.1:9/x.tar"])
    assert not os.path.exists(local + INDEX_SUFFIX)
