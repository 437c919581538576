"""More DataLoader behaviours and PooledLoader's own protocol."""
import os

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from loader_datasets import Counting, Images, IntoCounter
from pooled_loader import PooledLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_getitem_into_writes_straight_into_the_slot(num_workers):
    loader = PooledLoader(IntoCounter(24), batch_size=8, num_workers=num_workers)
    for epoch in range(2):
        for images, labels, how in loader:
            assert torch.equal(images[:, 0, 0], labels.float())
            # the first sample of a worker's first batch is fetched plainly to learn the layout
            assert how.count("into") >= 7 or epoch == 0


def test_worker_init_fn_gets_each_worker_id():
    class Record(Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return int(os.environ.get("PL_TEST_WORKER", "-1"))

    def init(worker_id):
        os.environ["PL_TEST_WORKER"] = str(worker_id)
    got = [int(w) for b in PooledLoader(Record(), batch_size=1, num_workers=3,
                                        worker_init_fn=init) for w in b]
    assert got == [0, 1, 2, 0, 1, 2]


def test_setting_sampler_after_init_raises_like_dataloader():
    loader = PooledLoader(Images(4))
    with pytest.raises(ValueError, match="should not be set after PooledLoader is initialized"):
        loader.batch_size = 3


def test_empty_dataset_yields_nothing():
    assert list(PooledLoader(Images(0), batch_size=4, num_workers=2)) == []
    assert list(PooledLoader(Counting(0), batch_size=4, num_workers=2)) == []


def test_no_file_descriptors_leak_across_epochs():
    loader = PooledLoader(Images(32), batch_size=8, num_workers=2)
    list(loader)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(10):
        for _ in loader:
            pass
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_large_batch_of_many_leaves_and_strings():
    class Many(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {f"k{j}": np.full((3,), i * j) for j in range(40)} | {"name": f"s{i}"}
    expected = list(DataLoader(Many(), batch_size=5))
    got = list(PooledLoader(Many(), batch_size=5, num_workers=2))
    for a, b in zip(expected, got):
        assert a["name"] == b["name"]
        assert all(torch.equal(a[f"k{j}"], b[f"k{j}"]) for j in range(40))


def test_close_stops_workers_and_held_batches_stay_valid():
    loader = PooledLoader(Images(40), batch_size=4, num_workers=2, persistent_workers=True)
    held = next(iter(loader))
    procs = list(loader._iterator._workers)
    loader.close()
    for p in procs:
        p.join(10)
        assert not p.is_alive()
    assert torch.equal(held[0][:, 0, 0, 0].long(), held[1] % 251)
    assert [int(i) for _, idx in loader for i in idx] == list(range(40))  # usable again
