"""litdata's and mosaicml-streaming's StreamingDataset through PooledLoader: the same items as
DataLoader (their state_dict takes arguments: treated as stateless, said once)."""

from __future__ import annotations

import warnings

import pytest
import torch
from third_party import streaming_modules, write_litdata, write_mds
from torch.utils.data import DataLoader, IterableDataset

from pooled_loader import PooledLoader
from pooled_loader.core.stateful import follows_stateful

N = 45


def epochs(loader, count=2):
    return [[b["index"].tolist() for b in loader] for _ in range(count)]


@pytest.fixture(scope="module")
def litdata_dir(tmp_path_factory):
    return write_litdata(str(tmp_path_factory.mktemp("litdata")), N)


@pytest.fixture(scope="module")
def mds_dir(tmp_path_factory):
    return write_mds(str(tmp_path_factory.mktemp("mds") / "mds"), N)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_litdata_streaming_dataset_gives_dataloaders_items(litdata_dir, num_workers, shuffle):
    import litdata

    def make():
        return litdata.StreamingDataset(litdata_dir, shuffle=shuffle, seed=3)
    expected = epochs(DataLoader(make(), batch_size=8, num_workers=num_workers))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = epochs(PooledLoader(make(), batch_size=8, num_workers=num_workers))
    assert got == expected
    assert sorted(i for b in got[0] for i in b) == list(range(N))
    if num_workers == 0:  # in workers it goes to their stderr, once per process
        said = [w for w in caught if "not torchdata's Stateful" in str(w.message)]
        assert len(said) <= 1  # once per type and process (an earlier test may have said it)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_mosaic_streaming_dataset_gives_dataloaders_items(mds_dir, num_workers, shuffle):
    streaming_dataset, _ = streaming_modules()

    def run(cls):
        dataset = streaming_dataset(local=mds_dir, shuffle=shuffle, shuffle_seed=3, batch_size=8)
        try:
            return epochs(cls(dataset, batch_size=8, num_workers=num_workers))
        finally:
            del dataset  # its shared memory is named after the local dir: one at a time

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its read-only arrays and the stateless note
        expected = run(DataLoader)
        got = run(PooledLoader)
    assert got == expected
    assert sorted(i for b in got[0] for i in b) == list(range(N))


def test_litdata_loader_resumes_mid_epoch_by_skipping_ahead(litdata_dir):
    import litdata
    loader = PooledLoader(litdata.StreamingDataset(litdata_dir), batch_size=8, num_workers=2)
    it = iter(loader)
    seen = [next(it)["index"].tolist() for _ in range(3)]
    state = loader.state_dict()
    del it
    fresh = PooledLoader(litdata.StreamingDataset(litdata_dir), batch_size=8, num_workers=2)
    fresh.load_state_dict(state)
    rest = [b["index"].tolist() for b in fresh]
    full = epochs(DataLoader(litdata.StreamingDataset(litdata_dir), batch_size=8,
                             num_workers=2), 1)[0]
    assert seen + rest == full


class _ArgState(IterableDataset):
    def __iter__(self):
        return iter(range(3))

    def state_dict(self, num_samples):  # another library's protocol
        raise AssertionError("called without its argument")

    def load_state_dict(self, state):
        raise AssertionError


class _Stateful(_ArgState):
    def state_dict(self, extra=None):
        return {"n": 0}

    def load_state_dict(self, state, strict=True):
        pass


def test_only_the_stateful_protocol_counts_as_state():
    with pytest.warns(UserWarning, match=r"_ArgState.state_dict takes required arguments "
                                         r"\(num_samples\)"):
        assert not follows_stateful(_ArgState())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not follows_stateful(_ArgState())  # said once per type
        assert follows_stateful(_Stateful())
        assert not follows_stateful(object())
    assert [b.tolist() for b in PooledLoader(_ArgState(), batch_size=2)] == [[0, 1], [2]]
    torch.testing.assert_close(list(PooledLoader(_Stateful(), batch_size=3))[0],
                               torch.tensor([0, 1, 2]))
