"""PooledLoader inside training stacks: HF accelerate (one process here, two in
test_integrations_ranks.py), HF datasets."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from compare import assert_same
from loader_datasets import Structured
from test_webdataset import make_shards, sample_id
from torch.utils.data import DataLoader

from pooled_loader import PooledLoader
from pooled_loader.shards.webdataset import WebDataset


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState, PartialState
    acc = accelerate.Accelerator(cpu=True)
    yield acc
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


def loader_pair(dataset, **kwargs):
    """The same arguments to DataLoader and to PooledLoader (shuffle seeded alike)."""
    return [cls(dataset, generator=torch.Generator().manual_seed(5), **kwargs)
            for cls in (DataLoader, PooledLoader)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_accelerate_prepare_keeps_a_pooled_loader(accelerator, num_workers, tmp_path):
    ref, ours = loader_pair(Structured(37), batch_size=4, shuffle=True,
                            num_workers=num_workers)
    ours.pool_slots = 16  # the test keeps every batch
    ours.trace_path = str(tmp_path / "run.trace.json")  # as if given to the constructor
    ref, prepared = accelerator.prepare(ref, ours)
    assert isinstance(prepared, PooledLoader)  # accelerate's wrapper, a PooledLoader inside
    inner = prepared.base_dataloader
    assert type(inner) is PooledLoader and inner.pool_slots == 16
    assert type(prepared).__name__ == "DataLoaderShard"
    for _ in range(2):  # two epochs: accelerate reseeds nothing in one process
        expected, got = list(ref), list(prepared)
        assert len(got) == len(expected) == 10
        for a, b in zip(expected, got):
            assert_same(a, b)
            assert b["image"].device == accelerator.device
        del expected, got, a, b
    assert prepared.stats()["batches"] == 20
    assert (tmp_path / "run.trace.json").exists()  # the rebuilt loader keeps the trace
    # accelerate's bookkeeping for gradient accumulation still runs
    ends = [accelerator.gradient_state.end_of_dataloader for _ in prepared]
    assert ends == [False] * 9 + [True]


def test_accelerate_skip_first_batches_keeps_a_pooled_loader(accelerator):
    ref, ours = loader_pair(Structured(37), batch_size=4, shuffle=False, num_workers=2)
    ours.pool_slots = 12  # the test keeps every batch
    ref, prepared = accelerator.prepare(ref, ours)
    skipped = accelerator.skip_first_batches(prepared, 3)
    assert type(skipped.base_dataloader) is PooledLoader
    expected = list(accelerator.skip_first_batches(ref, 3))
    got = list(skipped)
    assert len(got) == len(expected) == 7
    for a, b in zip(expected, got):
        assert_same(a, b)


def test_accelerate_keeps_a_self_splitting_webdataset(accelerator, tmp_path):
    make_shards(str(tmp_path), [5, 9, 3])
    ds = WebDataset(str(tmp_path), transform=sample_id, seed=1)
    prepared = accelerator.prepare(PooledLoader(ds, batch_size=4, num_workers=2))
    assert type(prepared.base_dataloader) is PooledLoader
    assert prepared.base_dataloader.dataset is ds  # no IterableDatasetShard around it
    assert sorted(int(i) for b in prepared for i in b) == list(range(17))


def test_accelerate_patch_is_applied_once_and_passes_other_loaders_through(accelerator):
    import accelerate.accelerator as acc_mod
    import accelerate.data_loader as adl

    from pooled_loader.integrations import patch_accelerate
    patch_accelerate()
    wrapped = adl.prepare_data_loader
    patch_accelerate()
    assert adl.prepare_data_loader is wrapped and acc_mod.prepare_data_loader is wrapped
    plain = accelerator.prepare(DataLoader(list(range(6)), batch_size=2))
    assert type(plain.base_dataloader) is DataLoader


def test_accelerate_stateful_dataloader_warns_when_it_cannot_keep_the_pool(accelerator):
    from pooled_loader import integrations
    if hasattr(PooledLoader, "state_dict"):
        pytest.skip("PooledLoader has state_dict: nothing to warn about")

    class Prepared:  # what accelerate builds with use_stateful_dataloader=True
        base_dataloader = type("StatefulDataLoader", (), {})()

    with pytest.warns(UserWarning, match="use_stateful_dataloader.*Drop use_stateful"):
        integrations._swap_base(Prepared(), PooledLoader(list(range(4))))


# -- HF datasets -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["numpy", "torch"])
def test_hf_datasets_give_dataloaders_batches(fmt):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    table = datasets.Dataset.from_dict({
        "image": rng.integers(0, 255, (29, 3, 6, 5), dtype=np.uint8),
        "feat": rng.standard_normal((29, 4)).astype(np.float32),
        "label": np.arange(29) % 7,
    }).with_format(fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # datasets' own notices about formats
        for workers in (0, 2):
            ref, ours = loader_pair(table, batch_size=8, shuffle=True, num_workers=workers)
            expected, got = list(ref), list(ours)
            assert len(got) == len(expected) == 4
            for a, b in zip(expected, got):
                assert_same(a, b)


def test_accelerate_stateful_dataloader_keeps_pooled_loader_and_resumes():
    """Accelerator(use_stateful_dataloader=True): the loader inside is still a PooledLoader, and
    accelerate's state_dict/load_state_dict resume it mid-epoch."""
    accelerate = pytest.importorskip("accelerate")
    pytest.importorskip("torchdata.stateful_dataloader")
    if not hasattr(PooledLoader, "state_dict"):
        pytest.skip("PooledLoader.state_dict is not in this version")
    from accelerate.state import AcceleratorState, GradientState, PartialState
    config = accelerate.DataLoaderConfiguration(use_stateful_dataloader=True)
    acc = accelerate.Accelerator(cpu=True, dataloader_config=config)
    try:
        def prepared():
            return acc.prepare(PooledLoader(Structured(37), batch_size=4, shuffle=True,
                                            num_workers=2,
                                            generator=torch.Generator().manual_seed(2)))

        first = prepared()
        assert type(first.base_dataloader) is PooledLoader
        full = [b["label"].tolist() for b in prepared()]
        it = iter(first)
        got = [next(it)["label"].tolist() for _ in range(3)]
        state = first.state_dict()
        del it
        again = prepared()
        again.load_state_dict(state)
        assert got + [b["label"].tolist() for b in again] == full
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        PartialState._reset_state()


def test_accelerate_warns_when_the_loader_is_sharded_twice(accelerator, monkeypatch):
    import accelerate.data_loader as adl
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = PooledLoader(list(range(8)), batch_size=2, shuffle=True, distributed=True)
    with pytest.warns(UserWarning, match="already has a DistributedSampler.*1/2 of its share"):
        adl.prepare_data_loader(loader, num_processes=2, process_index=0)


def test_accelerate_imported_after_the_loader_was_built_still_keeps_it():
    """The import order must not matter: a loader built before `import accelerate` is kept."""
    pytest.importorskip("accelerate")
    import os
    import subprocess
    import sys
    script = (
        "import sys, torch\n"
        "from pooled_loader import PooledLoader\n"
        "loader = PooledLoader(list(range(10)), batch_size=5)\n"
        "assert 'accelerate' not in sys.modules\n"
        "from accelerate import Accelerator\n"
        "prepared = Accelerator(cpu=True).prepare(loader)\n"
        "print(type(prepared.base_dataloader).__name__,\n"
        "      [b.tolist() for b in prepared])\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "PooledLoader", out.stdout
    assert "[[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]" in out.stdout
