"""Per-stage timings: stats()["stages"], report()'s slowest stage, and straggler ranks."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from imgutil import make_folder
from pooled_loader import PooledLoader
from pooled_loader.observability.stats import gather, ranks_text, stragglers
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW)
from pooled_loader.vision.base import Op
from ranks import run_ranks

SLOW_S = 0.004
SLOW_OP_S = 0.03  # well above decoding the test's largest JPEG on a loaded machine


class SlowBlur(Op):
    """A deliberately slow vision op: copies its input after sleeping."""

    def spec(self, spec):
        return spec

    def apply(self, x, out, params, spec):
        time.sleep(SLOW_OP_S)
        np.copyto(out, x)
        return out


class SlowItems(torch.utils.data.Dataset):
    """Arrays whose __getitem__ sleeps (the dataset's own code is the slow stage)."""

    def __init__(self, n=24, sleep_s=SLOW_S, side=16):
        self.n, self.sleep_s, self.side = n, sleep_s, side

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return np.full((self.side, self.side, 3), i % 256, np.uint8), i


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("stages") / "imgs")
    make_folder(root, n_per_class=6)
    return root


def pipeline(*extra):
    return Compose([DecodeImage(), RandomResizedCrop(64), RandomHorizontalFlip(), ToCHW(),
                    *extra])


@pytest.mark.parametrize("workers", [0, 2])
def test_stages_add_up_to_the_measured_worker_busy_time(folder, workers):
    loader = PooledLoader(ImageFolder(folder, transform=pipeline()), batch_size=4,
                          num_workers=workers, persistent_workers=workers > 0)
    for _ in range(2):
        for _ in loader:
            pass
    s = loader.stats()
    st = s["stages"]
    assert set(st["workers"]) == ({0, 1} if workers else {0})
    assert sum(f["samples"] for f in st["workers"].values()) == 24
    for w, fig in st["workers"].items():
        assert fig["busy_s"] > 0
        if workers:  # the busy time the loader measured per batch (around the whole build)
            assert fig["busy_s"] == pytest.approx(s["worker_busy_s"][w])
        assert {"getitem", "decode", "crop_resize", "collate"} <= set(fig["total_s"])
        assert sum(fig["total_s"].values()) == pytest.approx(fig["busy_s"], rel=0.10)
        for stage, total in fig["total_s"].items():
            assert fig["per_sample_ms"][stage] == pytest.approx(1e3 * total / fig["samples"])
    every = st["all"]
    assert every["samples"] == 24
    assert every["total_s"]["decode"] == pytest.approx(
        sum(f["total_s"]["decode"] for f in st["workers"].values()))
    main = st["main"]["total_s"]
    assert main["wait"] == pytest.approx(s["wait_s"]) and main["step"] == s["consumer_s"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_deliberately_slow_vision_op_is_named_as_the_bottleneck(folder, workers):
    loader = PooledLoader(ImageFolder(folder, transform=pipeline(SlowBlur())), batch_size=4,
                          num_workers=workers)
    for _ in loader:
        pass
    fig = loader.stats()["stages"]["all"]
    assert max(fig["total_s"], key=fig["total_s"].get) == "slow_blur", fig
    assert fig["per_sample_ms"]["slow_blur"] >= 1e3 * SLOW_OP_S
    report = loader.report()
    assert "LOADER is the bottleneck" in report
    assert "slowest stage: slow_blur" in report and "device_transform" in report


def test_a_slow_getitem_is_named_with_its_fix_and_a_slow_step_is_the_bottleneck():
    loader = PooledLoader(SlowItems(), batch_size=4, num_workers=2)
    for _ in loader:
        pass
    report = loader.report()
    assert "slowest stage: getitem" in report and "cache" in report
    fig = loader.stats()["stages"]["all"]
    assert fig["per_sample_ms"]["getitem"] >= 1e3 * SLOW_S
    # the same loader behind a slow training step: the step is the bottleneck
    loader = PooledLoader(SlowItems(n=40, sleep_s=0.0), batch_size=4, num_workers=1)
    for i, _ in enumerate(loader):
        if i == 0:
            loader.reset_stats()  # leave the workers' start out
        time.sleep(0.02)
    s = loader.stats()
    assert s["stages"]["main"]["total_s"]["step"] >= 0.02 * 8
    assert s["stages"]["main"]["per_batch_ms"]["step"] >= 20 * 8 / 9
    assert "TRAINING STEP is the bottleneck" in loader.report()


class SlowStream(IterableDataset):
    def __iter__(self):
        for i in range(12):
            time.sleep(SLOW_S)
            yield np.zeros(8, np.float32) + i


def test_iterable_datasets_and_custom_collate_are_timed():
    loader = PooledLoader(SlowStream(), batch_size=4, num_workers=1)
    assert len(list(loader)) == 3
    fig = loader.stats()["stages"]["workers"][0]
    assert fig["samples"] == 12 and fig["per_sample_ms"]["getitem"] >= 1e3 * SLOW_S

    def slow_collate(samples):
        time.sleep(0.01)
        return torch.stack([torch.as_tensor(s[0]) for s in samples])

    loader = PooledLoader(SlowItems(n=8, sleep_s=0.0), batch_size=4, num_workers=1,
                          collate_fn=slow_collate)
    assert [b.shape for b in loader] == [(4, 16, 16, 3)] * 2
    fig = loader.stats()["stages"]["workers"][0]
    assert fig["total_s"]["collate"] >= 0.02
    assert sum(fig["total_s"].values()) == pytest.approx(fig["busy_s"], rel=0.10)


def test_reset_stats_starts_the_stage_figures_afresh():
    loader = PooledLoader(SlowItems(n=8, sleep_s=0.0), batch_size=4)
    list(loader)
    loader.reset_stats()
    assert loader.stats()["stages"]["all"]["samples"] == 0
    assert "no batches yet" in loader.report()


# -- across ranks -----------------------------------------------------------------------------
def rank(r, wait_s, elapsed_s=10.0, stage_s=None):
    stages = {"workers": {0: {}}, "all": {"samples": 100, "total_s": stage_s or {"getitem": 1.0},
                                          "per_sample_ms": {k: 10 * v for k, v in
                                                            (stage_s or {"getitem": 1.0}).items()}},
              "main": {"total_s": {"h2d": 0.0}, "per_batch_ms": {"h2d": 0.0}}}
    return {"rank": r, "wait_s": wait_s, "elapsed_s": elapsed_s, "stages": stages}


def test_stragglers_wait_more_than_twice_the_median():
    ranks = [rank(0, 1.0), rank(1, 1.2), rank(2, 2.5, stage_s={"decode": 3.0}), rank(3, 0.9)]
    assert stragglers(ranks) == [2]
    text = ranks_text(ranks)
    assert "STRAGGLER ranks 2" in text and "slowest stage: decode" in text
    assert stragglers([rank(0, 0.0), rank(1, 0.0), rank(2, 0.05)]) == []  # < 1% of 10 s: noise
    assert stragglers([rank(0, 0.0), rank(1, 0.0), rank(2, 0.5)]) == [2]
    assert stragglers([rank(0, 3.0)]) == []
    assert "no straggler" in ranks_text([rank(0, 1.0), rank(1, 1.1)])


def gather_main(r, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r,
                            world_size=3, timeout=timedelta(seconds=60))
    try:
        # rank 2's samples take 10x longer: it is the straggler the others wait for in DDP
        ds = SlowItems(n=48, sleep_s=0.02 if r == 2 else 0.001)
        loader = PooledLoader(ds, batch_size=4, num_workers=1, distributed=True,
                              multiprocessing_context="fork")
        for i, _ in enumerate(loader):
            if i == 0:
                loader.reset_stats()  # the steady state: without the workers' start
            time.sleep(0.005)
        figures = gather(loader)
        assert [f["rank"] for f in figures] == [0, 1, 2]
        assert figures[r]["samples"] == 12
        if r == 0:
            with open(os.path.join(out_dir, "report.txt"), "w") as f:
                f.write(loader.report())
    finally:
        dist.destroy_process_group()


def test_gather_returns_every_rank_and_the_report_names_the_straggler(tmp_path):
    run_ranks(gather_main, 3, (str(tmp_path),), deadline_s=120)
    report = (tmp_path / "report.txt").read_text()
    assert "STRAGGLER ranks 2" in report and "slowest stage: getitem" in report


def test_gather_without_a_process_group_is_this_process_alone():
    loader = PooledLoader(SlowItems(n=4, sleep_s=0.0), batch_size=4)
    list(loader)
    assert [f["rank"] for f in gather(loader)] == [0]
    assert "Ranks: 1, no straggler" in loader.report()


def test_copies_to_the_device_are_booked_as_h2d_in_the_main_process(tmp_path):
    from test_cuda import ManualBackend  # stands in for the CUDA runtime
    from pooled_loader.engine.cuda import DeviceIter
    loader = PooledLoader(SlowItems(n=16, sleep_s=0.0), batch_size=4, trace=str(tmp_path / "t"))
    backend = ManualBackend()
    it = DeviceIter(iter(loader), torch.device("cpu"), depth=2, backend=backend)
    for _ in range(4):
        for e in backend.events:
            e.complete = True
        next(it)
    main = loader.stats()["stages"]["main"]
    assert main["total_s"]["h2d"] > 0 and main["per_batch_ms"]["h2d"] > 0
    loader.close()
    import json
    names = {e["name"] for e in json.load(open(tmp_path / "t"))["traceEvents"]}
    assert {"h2d", "wait", "batch", "getitem", "collate"} <= names


def test_batches_of_a_steady_size_never_wait_for_a_bigger_slot():
    # found by these timings: without getitem_into, every batch after the first asked the main
    # process for a new slot (and copied its samples twice) although its own slot fitted
    loader = PooledLoader(SlowItems(n=32, sleep_s=0.0, side=64), batch_size=4, num_workers=2,
                          persistent_workers=True)
    for _ in range(3):
        for _ in loader:
            pass
    fig = loader.stats()["stages"]["all"]
    assert fig["batches"] == 24 and "slot_wait" not in fig["total_s"]
    assert loader.stats()["grown"] == 1  # sized once from the first batch
