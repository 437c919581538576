"""Shard patterns and member names are read as WebDataset reads them (our own functions since
issue 34, so the shard readers need no `webdataset`), and a hostile pattern is bounded."""
from __future__ import annotations

import io
import itertools
import os
import tarfile
import urllib.parse

import pytest

from pooled_loader.shards import samples
from pooled_loader.shards.cache import ShardCache, is_cacheable
from pooled_loader.shards.index import INDEX_SUFFIX, load_index
from pooled_loader.shards.samples import count_samples, is_local_tar, local_sample_offset
from pooled_loader.shards.urls import MAX_EXPANDED_URLS, base_plus_ext, expand_urls, local_path
from pooled_loader.shards.webdataset import WebDataset
from pooled_loader.shards.writer import main as shards_cli

PATTERNS = ["data-{0000..0012}.tar", "a.tar::b-{1..3}.tar", "{train,val}/s-{00..02}.tar",
            "s-{0..10..3}.tar", "s-{a..e}.tar", "plain.tar", "s-{10..1}.tar", "x{a}.tar",
            "pipe:curl -s http://h/s-{000..002}.tar", "{a,{b,c}}-{1,2}.tar", "s-{,x}.tar"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_name_the_shards_webdataset_names(pattern):
    shardlists = pytest.importorskip("webdataset.shardlists")
    assert expand_urls(pattern) == shardlists.expand_urls(pattern)


def test_environment_variables_come_from_their_wds_names(monkeypatch):
    monkeypatch.setenv("WDS_ROOT", "/data/${WDS_SPLIT_NAME}")
    monkeypatch.setenv("WDS_SPLIT_NAME", "train")
    monkeypatch.setenv("WDS_WDS_SPLIT_NAME", "train")
    assert expand_urls("${ROOT}/s-{0..1}.tar") == ["/data/train/s-0.tar", "/data/train/s-1.tar"]


def test_a_missing_variable_or_unbalanced_braces_are_errors_naming_the_pattern(monkeypatch):
    monkeypatch.delenv("WDS_NOPE", raising=False)
    with pytest.raises(ValueError, match=r"WDS_NOPE is not set"):
        expand_urls("${NOPE}/a.tar")
    with pytest.raises(ValueError, match=r"s-\{0\.\.3\.tar"):
        expand_urls("s-{0..3.tar")


def test_a_pattern_naming_too_many_shards_is_refused_before_it_is_built():
    with pytest.raises(ValueError, match=f"at most {MAX_EXPANDED_URLS}"):
        expand_urls("s-{0..999999999999}.tar")
    with pytest.raises(ValueError, match=f"at most {MAX_EXPANDED_URLS}"):
        expand_urls("s-{0..999}-{0..999}-{0..9}.tar")
    with pytest.raises(ValueError, match=f"at most {MAX_EXPANDED_URLS}"):
        expand_urls("}{0..999999999999}.tar")


def test_member_names_split_into_key_and_extension_as_webdataset_splits_them():
    tariterators = pytest.importorskip("webdataset.tariterators")
    for n in range(1, 10):  # every name of up to 9 characters over the characters that matter
        for chars in itertools.product("a./\n", repeat=n):
            name = "".join(chars)
            assert base_plus_ext(name) == tariterators.base_plus_ext(name), repr(name)
    assert base_plus_ext("dir/x.seg.png") == ("dir/x", "seg.png")
    assert base_plus_ext("x") == (None, None)


def _tar(path, ids):
    """A plain tar shard with one ``.txt`` member per sample (key ``%06d``, data the id)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in ids:
            info = tarfile.TarInfo(f"{i:06d}.txt")
            info.size, info.mtime = len(str(i)), 0
            tar.addfile(info, io.BytesIO(str(i).encode()))
    return path


def test_a_file_url_names_its_percent_decoded_path_for_every_reader(tmp_path, monkeypatch):
    # RFC 8089: file:///a%20b.tar is the file "/a b.tar", for the reader, the counter, the index
    # CLI, the index lookup, the seek and the shard cache alike (they used to disagree).
    paths = [_tar(str(tmp_path / "with space" / f"s {k}.tar"), range(3 * k, 3 * k + 3))
             for k in range(2)]
    urls = ["file://" + urllib.parse.quote(p) for p in paths]
    assert "%20" in urls[0] and local_path(urls[0]) == paths[0]
    assert local_path(paths[0]) == paths[0]  # a plain path is itself, never decoded
    assert local_path("s%20x.tar") == "s%20x.tar"
    assert [local_path(u) for u in ("pipe:cat a.tar", "http://h/a.tar", "s3://b/a.tar")] == \
        [None] * 3
    assert shards_cli(["index", urls[0]]) == 0  # written beside the path the URL names
    assert os.path.isfile(paths[0] + INDEX_SUFFIX)
    assert shards_cli(["index", paths[1]]) == 0
    assert load_index(urls[0]) == load_index(paths[0])  # and found there
    monkeypatch.setattr(samples, "COUNT_CACHE", {})
    assert is_local_tar(urls[1]) and count_samples(urls[1]) == 3
    assert count_samples(paths[1]) == 3 and len(samples.COUNT_CACHE) == 1  # one entry, one file
    assert local_sample_offset(urls[1], 2) == local_sample_offset(paths[1], 2) == 2 * 1024
    assert [int(s["txt"]) for s in WebDataset(urls, shuffle_shards=False)] == list(range(6))
    assert sorted(int(s["txt"]) for s in WebDataset(urls, shuffle="global")) == list(range(6))
    assert not is_cacheable(urls[0]) and is_cacheable("http://h/a%20b.tar")
    with ShardCache(str(tmp_path / "cache")).reading(urls[0]) as read_from:
        assert read_from == urls[0]  # read in place, never copied
