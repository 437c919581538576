"""One folder, one listing: ImageFolder, shards and caches agree on classes and labels (hidden
folders, symlinked and empty class folders), and the file list holds no object per file."""
from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import pickle
import sys
import tarfile
import types
import warnings

import numpy as np
import pytest

from pooled_loader.shards import writer as shards
from pooled_loader.cache import CachedDataset, CacheMismatchError, build_cache
from pooled_loader.core.errors import ClassMismatchError
from pooled_loader.core.file_index import FileIndex, list_image_folder
from pooled_loader.vision import Compose, DecodeImage, ImageFolder, Resize
from pooled_loader.shards.webdataset import WebDataset

import imgutil

JPEG = None


def put(root, rel):
    global JPEG
    JPEG = JPEG or imgutil.jpeg(size=(40, 30))
    return imgutil.write(os.path.join(root, rel), JPEG)


@pytest.fixture
def jupyter_folder(tmp_path):
    """cat/, dog/ and a Jupyter checkpoint folder holding one image (the reported trap)."""
    root = str(tmp_path / "data")
    for rel in ["cat/a.jpg", "cat/b.jpg", "dog/c.jpg", "dog/sub/d.jpg", ".ipynb_checkpoints/e.jpg"]:
        put(root, rel)
    return root


def shard_labels(paths):
    """{key: cls} of every sample in the shards, read by the project's WebDataset."""
    return {s["__key__"]: int(s["cls"]) for s in WebDataset(paths, shuffle_shards=False)}


def folder_labels(ds):
    return {os.path.splitext(os.path.relpath(p, ds.root))[0].replace(".", "_"): t
            for p, t in ds.samples}


def test_hidden_class_folder_is_a_class_by_default_with_a_warning(jupyter_folder):
    with pytest.warns(UserWarning, match=r"\.ipynb_checkpoints are classes 0.*include_hidden"):
        ds = ImageFolder(jupyter_folder)
    assert ds.classes == [".ipynb_checkpoints", "cat", "dog"]  # torchvision's classes
    assert ds.targets == [0, 1, 1, 2, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = ImageFolder(jupyter_folder, include_hidden=True)
        clean = ImageFolder(jupyter_folder, include_hidden=False)
    assert kept.classes == ds.classes
    assert clean.classes == ["cat", "dog"] and clean.targets == [0, 0, 1, 1]


def test_shards_and_imagefolder_give_the_same_labels(jupyter_folder, tmp_path):
    with pytest.warns(UserWarning):
        ds = ImageFolder(jupyter_folder)
    with pytest.warns(UserWarning):
        paths = shards.write_shards(jupyter_folder, str(tmp_path / "s" / "d-%02d.tar"), 2,
                                    progress=False)
    assert shard_labels(paths) == folder_labels(ds)
    assert shards.read_shard_classes(paths) == ds.classes
    ds.check_classes(WebDataset(paths))
    ds.check_classes(str(tmp_path / "s"))  # a directory of shards, as WebDataset takes it
    with tarfile.open(paths[0]) as tf:  # the class names lead every shard
        assert tf.getnames()[0] == "__classes__"
    clean_paths = shards.write_shards(jupyter_folder, str(tmp_path / "c" / "d-%02d.tar"), 2,
                                      progress=False, include_hidden=False)
    clean = ImageFolder(jupyter_folder, include_hidden=False)
    assert shard_labels(clean_paths) == folder_labels(clean)
    clean.check_classes(WebDataset(clean_paths))
    with pytest.raises(ClassMismatchError, match=r"'cat' is 0 there and 1 here.*hidden folder"):
        ds.check_classes(WebDataset(clean_paths))
    with pytest.raises(ClassMismatchError, match="'.ipynb_checkpoints' only there"):
        clean.check_classes(WebDataset(paths))


def test_shards_cli_skip_hidden(jupyter_folder, tmp_path, capsys):
    out = str(tmp_path / "o" / "x-%02d.tar")
    assert shards.main(["write", jupyter_folder, out, "--per-shard", "10", "--quiet",
                        "--skip-hidden"]) == 0
    assert shards.read_shard_classes([out % 0]) == ["cat", "dog"]
    assert shards.main(["write", str(tmp_path / "nowhere"), out, "--per-shard", "1"]) == 1
    assert "no such image folder" in capsys.readouterr().err


def test_shards_from_another_folder_are_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    put(a, "ant/1.jpg"), put(a, "bee/1.jpg"), put(b, "bee/1.jpg"), put(b, "cow/1.jpg")
    pa = shards.write_shards(a, str(tmp_path / "s" / "d-%02d.tar"), 5, progress=False)
    pb = shards.write_shards(b, str(tmp_path / "s" / "e-%02d.tar"), 5, progress=False)
    with pytest.raises(ClassMismatchError, match="different folders"):
        shards.read_shard_classes(pa + pb)
    with tarfile.open(tmp_path / "plain.tar", "w") as tf:  # shards without class names
        tf.add(os.path.join(a, "ant", "1.jpg"), "k.jpg")
    with pytest.raises(ClassMismatchError, match="records no class names"):
        ImageFolder(a).check_classes(WebDataset(str(tmp_path / "plain.tar")))


def test_cache_records_classes_and_refuses_another_listing(jupyter_folder, tmp_path):
    tf = Compose([DecodeImage(), Resize(max_side=32)])
    with pytest.warns(UserWarning):
        ds = ImageFolder(jupyter_folder, transform=tf)
    path = build_cache(ds, str(tmp_path / "c.plc"), progress=False)
    cached = CachedDataset(path, expect_fingerprint_of=ds)
    assert cached.header["source"]["classes"] == ds.classes
    assert [int(cached.raw(i)[1]) for i in range(len(cached))] == list(ds.targets)
    ds.check_classes(cached)
    ds.check_classes(path)  # the cache file's path works too
    clean = ImageFolder(jupyter_folder, transform=tf, include_hidden=False)
    with pytest.raises(ClassMismatchError, match="'dog' is 2 there and 1 here"):
        clean.check_classes(cached)
    with pytest.raises(CacheMismatchError, match="classes: cache has"):
        CachedDataset(path, expect_fingerprint_of=clean)


def test_symlinked_class_folder_is_followed_everywhere(tmp_path):
    root, elsewhere = str(tmp_path / "data"), str(tmp_path / "elsewhere")
    put(root, "cat/a.jpg"), put(elsewhere, "birds/b.jpg"), put(elsewhere, "birds/deep/c.jpg")
    os.symlink(os.path.join(elsewhere, "birds"), os.path.join(root, "bird"))
    os.symlink(os.path.join(elsewhere, "birds"), os.path.join(elsewhere, "birds", "loop"))
    ds = ImageFolder(root)  # the loop inside the linked folder is walked once
    assert ds.classes == ["bird", "cat"]
    rel = [(os.path.relpath(p, root), t) for p, t in ds.samples]
    assert rel == [("bird/b.jpg", 0), ("bird/deep/c.jpg", 0), ("cat/a.jpg", 1)]
    paths = shards.write_shards(root, str(tmp_path / "s" / "d-%02d.tar"), 10, progress=False)
    assert shard_labels(paths) == folder_labels(ds)
    ds.check_classes(WebDataset(paths))
    cached = CachedDataset(build_cache(ImageFolder(root, transform=DecodeImage()),
                                       str(tmp_path / "c.plc"), progress=False))
    assert cached.header["source"]["classes"] == ["bird", "cat"]
    assert [int(cached.raw(i)[1]) for i in range(3)] == [0, 0, 1]


def test_empty_class_folder_fails_the_same_way_everywhere_unless_allowed(tmp_path):
    root = str(tmp_path / "data")
    put(root, "ant/a.jpg"), put(root, "cow/c.jpg")
    os.makedirs(os.path.join(root, "bee"))
    with open(os.path.join(root, "bee", "notes.txt"), "w") as f:
        f.write("not an image")
    with pytest.raises(FileNotFoundError, match="classes bee.*allow_empty"):
        ImageFolder(root)
    with pytest.raises(FileNotFoundError, match="classes bee"):
        shards.write_shards(root, str(tmp_path / "s" / "d-%02d.tar"), 10, progress=False)
    ds = ImageFolder(root, allow_empty=True)  # bee keeps its index: labels stay torchvision's
    assert ds.classes == ["ant", "bee", "cow"] and ds.targets == [0, 2]
    cached = CachedDataset(build_cache(ImageFolder(root, transform=DecodeImage(),
                                                   allow_empty=True),
                                       str(tmp_path / "c.plc"), progress=False))
    assert cached.header["source"]["classes"] == ["ant", "bee", "cow"]
    ds.check_classes(cached)


def test_samples_and_targets_are_lazy_torchvision_sequences(tmp_path):
    root = str(tmp_path / "data")
    for rel in ["b/2.jpg", "a/1.jpg", "a/0.JPEG", "b/x/3.jpg"]:
        put(root, rel)
    ds = ImageFolder(root)
    expected = [(os.path.join(root, r), t) for r, t in
                [("a/0.JPEG", 0), ("a/1.jpg", 0), ("b/2.jpg", 1), ("b/x/3.jpg", 1)]]
    assert ds.samples == expected and ds.imgs == expected and list(ds.samples) == expected
    assert ds.samples[-1] == expected[-1] and ds.samples[1:3] == expected[1:3]
    assert ds.samples[np.int64(2)] == expected[2]
    assert ds.targets == [0, 0, 1, 1] and ds.targets.count(1) == 2
    assert np.asarray(ds.targets).tolist() == [0, 0, 1, 1]
    with pytest.raises(IndexError, match="out of range"):
        ds.samples[4]
    ds.samples = ds.samples[1:]  # what scripts do to subsample: replaces the index
    assert len(ds) == 3 and ds.samples == expected[1:] and ds[0][1] == 0
    ds.targets = [1, 0, 0]
    assert ds.samples[0] == (expected[1][0], 1)
    with pytest.raises(ValueError, match="needs 3 labels"):
        ds.targets = [0]
    ds2 = pickle.loads(pickle.dumps(ds))
    assert ds2.samples == ds.samples and ds2.targets == ds.targets
    assert isinstance(ds.file_index.blob, np.ndarray) and not ds.file_index.labels.flags.writeable


def _objects_reachable(obj) -> int:
    """Python objects reachable from ``obj`` (modules, classes and functions not followed)."""
    seen, todo = set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(o))
        todo.extend(gc.get_referents(o))
    return len(seen)


def test_imagefolder_holds_no_python_object_per_file(tmp_path):
    root = str(tmp_path / "data")
    first = put(root, "c0/0.jpg")
    for i in range(1, 3000):  # hard links: a large folder in no space
        d = os.path.join(root, f"c{i % 3}")
        os.makedirs(d, exist_ok=True)
        os.link(first, os.path.join(d, f"{i}.jpg"))
    ds = ImageFolder(root)
    assert len(ds) == 3000
    assert _objects_reachable(ds) < 200  # a list of (path, label) would be > 6000
    assert _objects_reachable(list(ds.samples)) > 6000  # the count sees per-file objects


def _private_growth_after_lookups(index, conn):
    def private_kb() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(line.split()[1]) for line in f
                       if line.startswith(("Private_Clean", "Private_Dirty")))
    gc.freeze()  # as the loader's workers: the collector itself touches no inherited object
    before = private_kb()
    for i in range(len(index)):
        index[i]
    conn.send(private_kb() - before)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc")
def test_looking_up_every_file_in_a_forked_worker_copies_no_index_pages(tmp_path):
    n = 200_000
    pairs = [(f"/data/train/n{i % 1000:08d}/img_{i:08d}.JPEG", i % 1000) for i in range(n)]
    index = FileIndex.from_samples("/data/train", pairs, [str(c) for c in range(1000)])
    ctx = mp.get_context("fork")
    growth = {}
    for name, obj in [("FileIndex", index), ("list", pairs)]:
        recv, send = ctx.Pipe(False)
        p = ctx.Process(target=_private_growth_after_lookups, args=(obj, send))
        p.start()
        growth[name] = recv.recv()
        p.join()
    assert growth["list"] > 8_000, growth  # the reference: refcounts dirty every tuple's page
    assert growth["FileIndex"] < 2_000, growth  # KiB


def test_list_image_folder_is_what_imagefolder_uses(jupyter_folder):
    with pytest.warns(UserWarning):
        index = list_image_folder(jupyter_folder)
    with pytest.warns(UserWarning):
        ds = ImageFolder(jupyter_folder)
    assert list(index) == list(ds.samples) and index.classes == ds.classes
    assert "5 files, 3 classes" in repr(index)
