"""pooled_loader.tune.trials: a short real sweep (real JPEGs, real worker processes) and the search."""
from __future__ import annotations

import ast
import json
import os
import struct

import pytest
import torch

import imgutil
from pooled_loader import PooledLoader
from pooled_loader.tune.trials import (KNOBS, Setting, confirm, coordinate_descent, main,
                                 recommended_line)

TRIAL_KEYS = {
    "id", "knob", "label", "num_workers", "batch_size", "prefetch_factor", "pool_extra",
    "pool_slots", "step_ms", "images_per_s", "batches", "samples", "measured_s", "setup_s",
    "wait_s", "consumer_s", "wait_fraction", "bottleneck", "worker_busy_fraction",
    "worker_busy_mean", "slots", "slots_in_use", "slot_bytes", "pool_bytes", "grown",
    "allocations_after_warmup", "skipped", "peak_rss_worker_mb", "rss_main_mb",
    "load_avg_1min", "report", "stage_ms_per_sample"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """24 JPEGs (skimage photos encoded by Pillow) in 3 class folders."""
    root = str(tmp_path_factory.mktemp("tune_data"))
    imgutil.make_folder(root, n_per_class=8, classes=("cat", "dog", "owl"),
                        sizes=((320, 256), (256, 384), (500, 375)))
    return root


def _call_kwargs(line: str) -> dict:
    """The keyword arguments of a pasted ``PooledLoader(dataset, ...)`` line (literals only)."""
    call = ast.parse(line, mode="eval").body
    assert isinstance(call, ast.Call) and call.func.id == "PooledLoader"
    assert [a.id for a in call.args] == ["dataset"]
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


@pytest.mark.timeout(120)
def test_tune_cli_writes_json_png_and_a_line_to_paste(folder, tmp_path, capsys):
    out = str(tmp_path / "out")
    rc = main(["tune", "--data", folder, "--out", out, "--budget-s", "6", "--workers", "1,2",
               "--prefetch", "1,2", "--pool-extra", "1,2", "--batch-sizes", "4,8",
               "--max-batches", "6", "--simulate-step-ms", "5", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out

    with open(os.path.join(out, "tune.json")) as f:
        res = json.load(f)
    assert {"version", "created", "dataset", "machine", "settings", "trials", "best",
            "confirm", "recommended", "notes", "elapsed_s"} <= set(res)
    assert res["dataset"]["kind"] == "imagefolder" and res["dataset"]["len"] == 24
    trials = res["trials"]
    assert trials and trials[0]["knob"] == "start"
    assert [t["id"] for t in trials] == list(range(len(trials)))
    space = res["settings"]["space"]
    start_batch = res["settings"]["start"]["batch_size"]
    assert set(space) == set(KNOBS)
    settings = set()
    for t in trials:
        assert TRIAL_KEYS <= set(t), TRIAL_KEYS - set(t)
        for knob in KNOBS:
            assert t[knob] in space[knob]
        s = Setting(t["num_workers"], t["batch_size"], t["prefetch_factor"], t["pool_extra"])
        if t["knob"] != "confirm":
            assert s not in settings  # the search measures each setting once
            settings.add(s)
        assert t["pool_slots"] == s.pool_slots and t["slots"] >= s.pool_slots
        assert t["images_per_s"] > 0 and t["batches"] >= 3
        assert t["samples"] == t["batches"] * t["batch_size"]  # 24 = 3 * 8 = 6 * 4: full
        assert 0.0 <= t["wait_fraction"] <= 1.0
        assert t["step_ms"] == pytest.approx(5 * t["batch_size"] / start_batch)
        busy = t["worker_busy_fraction"]
        assert sorted(busy) == [str(w) for w in range(t["num_workers"])]
        assert all(0.0 < f <= 1.0 for f in busy.values())
        assert t["report"].startswith("PooledLoader: ")
        stages = t["stage_ms_per_sample"]  # where the workers' time went, per stage
        assert {"getitem", "decode", "crop_resize", "collate"} <= set(stages)
        assert all(ms > 0 for ms in stages.values())
    # the first pass of coordinate descent varies every knob (budget allowing at least that)
    assert {t["knob"] for t in trials} >= {"start", "num_workers"}

    best = res["best"]
    by_id = {t["id"]: t for t in trials}
    again = [t for t in trials if t["knob"] == "confirm"]
    if res["confirm"] is not None:  # the winner was not the start: both measured again, in turn
        rounds = res["confirm"]["rounds"]
        assert 1 <= rounds <= 2 and len(again) == 2 * rounds and trials[-len(again):] == again
        assert again[0]["label"] == trials[0]["label"] != again[1]["label"]
        assert [t["label"] for t in again[2:]] == [t["label"] for t in again[:2]][:len(again) - 2]
        assert by_id[best["id"]]["label"] in res["confirm"]["median"]
        assert all(len(v) == 1 + rounds for v in res["confirm"]["images_per_s"].values())
    else:
        assert not again
    confirmed = res["confirm"]["median"] if res["confirm"] else {}
    assert best["images_per_s"] == confirmed.get(by_id[best["id"]]["label"],
                                                 by_id[best["id"]]["images_per_s"])
    assert best["report"] == by_id[best["id"]]["report"]
    kw = _call_kwargs(res["recommended"])
    assert kw == {"batch_size": best["batch_size"], "shuffle": True,
                  "num_workers": best["num_workers"], "prefetch_factor": best["prefetch_factor"],
                  "persistent_workers": True, "pool_slots": best["pool_slots"]}

    with open(os.path.join(out, "tune.png"), "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 600 and height >= 500 and len(png) > 20_000
    import matplotlib.image
    assert matplotlib.image.imread(os.path.join(out, "tune.png")).shape[:2] == (height, width)

    assert "images/s" in printed and res["recommended"] in printed
    assert best["report"] in printed and "paste:" in printed

    # the pasted line works as written
    from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                      RandomResizedCrop, ToCHW)
    dataset = ImageFolder(folder, Compose([DecodeImage(), RandomResizedCrop(224),
                                           RandomHorizontalFlip(), ToCHW()]))
    loader = eval(res["recommended"], {"PooledLoader": PooledLoader, "dataset": dataset})
    images, labels = next(iter(loader))
    assert images.shape == (best["batch_size"], 3, 224, 224) and images.dtype == torch.uint8
    del images, labels, loader


def test_tune_needs_data_or_cache(capsys):
    with pytest.raises(SystemExit):
        main(["--budget-s", "1"])
    assert "--data" in capsys.readouterr().err


def test_recommended_line_without_workers():
    kw = _call_kwargs(recommended_line(Setting(0, 32, 2, 2)))
    # no prefetch_factor or persistent_workers: DataLoader refuses them without workers
    assert kw == {"batch_size": 32, "shuffle": True, "num_workers": 0, "pool_slots": 3}


def _fake_measure(rates: dict):
    """A deterministic objective for the search: images/s from a table, default 100."""
    def measure(s: Setting, knob: str) -> dict:
        return {"images_per_s": rates.get((s.num_workers, s.batch_size), 100.0)}
    return measure


def test_coordinate_descent_keeps_the_best_and_prefers_cheaper_ties():
    space = {"num_workers": [1, 2, 4], "batch_size": [8, 16], "prefetch_factor": [1, 2],
             "pool_extra": [1, 2]}
    start = Setting(2, 8, 2, 2)
    rates = {(4, 8): 200.0, (4, 16): 300.0, (1, 16): 100.0}
    trials, best = coordinate_descent(space, start, _fake_measure(rates), 0.03,
                                        lambda best: True)
    # workers 4 wins (200 > 100), then batch 16 (300), prefetch 1 and extra 1 tie and are cheaper
    assert best["setting"] == Setting(4, 16, 1, 1)
    assert trials[0]["knob"] == "start" and trials[0]["setting"] == start
    assert len({t["setting"] for t in trials}) == len(trials)


def test_coordinate_descent_stops_when_time_is_up():
    calls = []
    space = {k: [1, 2, 3] for k in KNOBS}

    def time_left(best: dict) -> bool:
        return len(calls) < 3

    def measure(s: Setting, knob: str) -> dict:
        calls.append(s)
        return {"images_per_s": 1.0}

    trials, best = coordinate_descent(space, Setting(1, 1, 1, 1), measure, 0.03, time_left)
    assert len(trials) == 3 and best is trials[0]


@pytest.mark.timeout(120)
def test_tune_on_a_cache_uses_the_random_tail(folder, tmp_path, capsys):
    from pooled_loader.cache import build_cache
    from pooled_loader.tune.trials import make_dataset
    from pooled_loader.vision import Compose, DecodeImage, ImageFolder, RandomResizedCrop, Resize

    # built by a worker process: OpenCV's thread pool, once used here, can deadlock a forked
    # loader worker (cv2.setNumThreads in the child)
    resized = str(tmp_path / "max256.plc")
    build_cache(ImageFolder(folder, Compose([DecodeImage(), Resize(max_side=256)])), resized,
                progress=False, num_workers=1)
    crops = str(tmp_path / "crops.plc")
    build_cache(ImageFolder(folder, Compose([DecodeImage(), RandomResizedCrop(96)])), crops,
                variants=2, progress=False, num_workers=1)
    ds, info = make_dataset(None, resized, size=96)
    assert info["kind"] == "cache" and "RandomResizedCrop(" in info["transform"]
    ds, info = make_dataset(None, crops, size=96)  # crops stored: only flip + CHW remain
    assert "RandomResizedCrop" not in info["transform"] and "ToCHW" in info["transform"]
    assert ds[0][0].shape == (3, 96, 96)

    out = str(tmp_path / "out")
    assert main(["--cache", resized, "--size", "96", "--out", out, "--budget-s", "2",
                 "--workers", "1", "--prefetch", "2", "--pool-extra", "2", "--batch-sizes", "4",
                 "--max-batches", "5", "--quiet"]) == 0
    with open(os.path.join(out, "tune.json")) as f:
        res = json.load(f)
    assert res["dataset"]["kind"] == "cache" and len(res["trials"]) == 1
    assert res["trials"][0]["slot_bytes"] >= 4 * 3 * 96 * 96
    assert "PooledLoader(dataset, batch_size=4" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_tune_when_every_trial_fails(tmp_path, capsys):
    for i in range(4):
        imgutil.write(str(tmp_path / "data" / "a" / f"{i}.jpg"), b"not a jpeg")
    rc = main(["--data", str(tmp_path / "data"), "--out", str(tmp_path / "out"),
               "--budget-s", "2", "--workers", "1", "--prefetch", "2", "--pool-extra", "2",
               "--batch-sizes", "2", "--quiet"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "failed: " in captured.out and "every trial failed" in captured.err
    assert "0.jpg" in captured.err or "1.jpg" in captured.err  # names a bad file


def test_confirm_measures_both_in_turn_and_compares_medians():
    start, fast = Setting(2, 8, 2, 2), Setting(4, 8, 2, 2)
    first = {"label": start.label(), "setting": start, "images_per_s": 100.0, "id": 0}
    winner = {"label": fast.label(), "setting": fast, "images_per_s": 150.0, "id": 1}
    order = []

    def measure_with(rates):
        def measure(s: Setting, knob: str) -> dict:
            order.append(s)
            return {"images_per_s": rates[s].pop(0)}
        return measure

    runs, keep, rates = confirm(first, winner, measure_with({start: [100, 100], fast: [140, 90]}),
                                2, 0.03, 2)
    assert order == [start, fast, start, fast] and [r["id"] for r in runs] == [2, 3, 4, 5]
    assert keep is winner and rates[fast.label()] == [150.0, 140, 90]  # median 140 > 100
    order.clear()
    runs, keep, _ = confirm(first, winner, measure_with({start: [120, 110], fast: [95, 100]}),
                            2, 0.03, 2)
    assert keep is first  # the first figure was luck: medians 110 vs 100
