"""Trace files: Chrome trace events with one track per worker and one for the main process."""
from __future__ import annotations

import collections
import json

import pytest

from imgutil import make_folder
from pooled_loader import PooledLoader
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("trace") / "imgs")
    make_folder(root, n_per_class=8)
    return ImageFolder(root, transform=Compose([DecodeImage(), RandomResizedCrop(48),
                                                RandomHorizontalFlip(), ToCHW()]))


def read(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = collections.defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            spans[tracks[e["tid"]], e["name"]].append(e)
    return tracks, spans


def inside(inner, outer):
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + \
        outer["dur"] + 1e-3


def test_the_trace_parses_as_json_with_a_track_per_worker_and_nested_stages(dataset, tmp_path):
    path = tmp_path / "run.trace.json"
    loader = PooledLoader(dataset, batch_size=4, num_workers=2, trace=str(path))
    batches = list(loader)
    tracks, spans = read(path)
    assert sorted(tracks.values()) == ["main", "worker 0", "worker 1"]
    assert tracks[0] == "main"
    for w in ("worker 0", "worker 1"):
        assert len(spans[w, "batch"]) == len(batches) // 2
        samples = spans[w, "getitem"]
        assert len(samples) == 4 * len(spans[w, "batch"])
        for span in samples:  # each sample inside one of its worker's batches
            assert any(inside(span, b) for b in spans[w, "batch"])
        for op in ("decode", "crop_resize"):  # ops nested in their sample's getitem
            assert len(spans[w, op]) == len(samples)
            assert all(any(inside(s, g) for g in samples) for s in spans[w, op])
        assert spans[w, "collate"]
    got = sorted(s["args"]["sample"] for w in ("worker 0", "worker 1")
                 for s in spans[w, "getitem"])
    assert got == list(range(len(dataset)))
    assert len(spans["main", "wait"]) == len(batches)
    assert len(spans["main", "step"]) == len(batches) - 1


def test_the_trace_keeps_a_ring_of_the_last_batches(dataset, tmp_path):
    path = tmp_path / "ring.json"
    loader = PooledLoader(dataset, batch_size=2, num_workers=2, trace=str(path),
                          trace_batches=3, persistent_workers=True)
    for _ in range(2):
        assert sum(1 for _ in loader) == 8
    tracks, spans = read(path)
    batch_spans = [s for (track, name), ss in spans.items() if name == "batch" for s in ss]
    assert len(batch_spans) == 3  # the last 3 of 16 to arrive (two workers: in any order)
    assert all(s["args"]["task"] >= 12 for s in batch_spans)
    assert len(spans["main", "wait"]) <= 3 * 3


def test_loader_trace_records_the_next_batches_and_writes_them(dataset, tmp_path):
    path = tmp_path / "next.json"
    loader = PooledLoader(dataset, batch_size=2, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    loader.trace(str(path), batches=3)
    for _ in range(6):  # batches already prefetched come first, without spans
        next(it)
        if path.exists():
            break
    assert path.exists()  # written as soon as 3 traced batches were delivered
    tracks, spans = read(path)
    assert sum(len(ss) for (_, name), ss in spans.items() if name == "batch") == 3
    rest = list(it)
    assert len(rest) >= 1 and not loader._stats.tracing


def test_in_process_batches_go_on_the_main_track_and_close_writes(dataset, tmp_path):
    path = tmp_path / "inproc.json"
    loader = PooledLoader(dataset, batch_size=4, trace=str(path))
    it = iter(loader)
    next(it)
    next(it)
    assert not path.exists()
    loader.close()
    tracks, spans = read(path)
    assert list(tracks.values()) == ["main"]
    assert len(spans["main", "batch"]) == 2 and len(spans["main", "decode"]) == 8


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_trace_batches_are_refused(dataset, tmp_path, bad):
    with pytest.raises(ValueError, match="trace batches"):
        PooledLoader(dataset, trace=str(tmp_path / "x.json"), trace_batches=bad)
    with pytest.raises(ValueError, match="trace batches"):
        PooledLoader(dataset).trace(str(tmp_path / "x.json"), batches=bad)
