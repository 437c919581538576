"""Shard patterns and member names are read as WebDataset reads them (our own functions since
issue 34, so the shard readers need no `webdataset`), and a hostile pattern is bounded."""
from __future__ import annotations

import itertools

import pytest

from pooled_loader.shards.urls import MAX_EXPANDED_URLS, base_plus_ext, expand_urls

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
