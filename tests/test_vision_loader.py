"""The image pipeline through PooledLoader: batch structure, bad files skipped or reported."""
import logging
import os

import pytest
import torch

from imgutil import make_folder, write
from pooled_loader import PooledLoader
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW)


def pipeline():
    return Compose([DecodeImage(), RandomResizedCrop(64), RandomHorizontalFlip(), ToCHW()])


@pytest.fixture
def folder_with_bad_files(tmp_path):
    root = str(tmp_path / "imgs")
    make_folder(root, n_per_class=6)
    write(os.path.join(root, "cat", "zz_truncated.jpg"),
          open(os.path.join(root, "cat", sorted(os.listdir(os.path.join(root, "cat")))[0]),
               "rb").read()[:300])
    write(os.path.join(root, "dog", "zz_empty.jpg"), b"")
    return root


def test_batches_have_the_promised_structure(tmp_path):
    root = str(tmp_path / "imgs")
    make_folder(root, n_per_class=6)
    loader = PooledLoader(ImageFolder(root, transform=pipeline()), batch_size=4, num_workers=2)
    batches = list(loader)
    images, labels = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 64, 64)
    assert labels.dtype == torch.int64 and labels.shape == (4,)
    assert sum(len(l) for _, l in batches) == 12


def test_bad_files_raise_naming_the_file(folder_with_bad_files):
    loader = PooledLoader(ImageFolder(folder_with_bad_files, transform=pipeline()),
                          batch_size=4, num_workers=2)
    with pytest.raises(Exception) as info:
        list(loader)
    assert "zz_truncated.jpg" in str(info.value) or "zz_empty.jpg" in str(info.value)


@pytest.mark.parametrize("where", ["loader", "dataset"])
def test_bad_files_are_skipped_counted_and_logged_once(folder_with_bad_files, where, caplog):
    ds = ImageFolder(folder_with_bad_files, transform=pipeline(),
                     on_error="skip" if where == "dataset" else "raise")
    loader = PooledLoader(ds, batch_size=7, num_workers=2,
                          on_error="skip" if where == "loader" else "raise")
    with caplog.at_level(logging.WARNING, logger="pooled_loader"):
        for _ in range(2):
            batches = list(loader)
            assert [len(l) for _, l in batches] == [7, 7]  # batches keep their size
    assert loader.stats()["skipped"] >= 4  # two bad files, two epochs
    logged = [r.getMessage() for r in caplog.records if "skipped sample" in r.getMessage()]
    assert any("zz_truncated.jpg" in m for m in logged)
    assert any("zz_empty.jpg" in m for m in logged)
    assert len(logged) == len(set(logged))
