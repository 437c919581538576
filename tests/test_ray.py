"""pooled_loader.ray on a real local Ray cluster (issue 48): the loader's order, exact resume with
the delivered rows never read again, ranks over gloo, elastic 2 -> 3, Ray's own iterator, the
readers, and the errors. Ray starts once for the module (~5 s); the two-node cluster and the
killed actor are in test_ray_cluster.py."""
from __future__ import annotations

import gc
import json
import os
import sys

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")
sys.path.insert(0, os.path.dirname(__file__))

from imgutil import make_folder  # noqa: E402
from ray_pipelines import Marks, decoded, ids_of, init_ray, pipeline  # noqa: E402
from ranks import run_ranks  # noqa: E402

from pooled_loader.ray import from_ray, read_image_folder, read_webdataset  # noqa: E402

N = 60  # rows: 3 classes x 20


@pytest.fixture(scope="module")
def cluster():
    init_ray(num_cpus=2)
    yield ray.get_runtime_context().gcs_address
    gc.collect()  # streams of loaders left mid-epoch end while Ray is still up
    ray.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ray_folder"))
    make_folder(root, n_per_class=20, classes=("ant", "bee", "cat"),
                sizes=((96, 80), (64, 72), (120, 90)))
    return root


def _order(seed: int, epoch: int, n: int = N) -> list[int]:
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def test_the_epoch_order_is_the_loaders_and_every_row_comes_once(cluster, root):
    import torchvision
    loader = from_ray(pipeline(root), batch_size=8, seed=3)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        batches = list(loader)
        ids = [i for b in batches for i in b["row_id"].tolist()]
        assert ids == _order(3, epoch)  # DistributedSampler's order for (seed, epoch)
        assert [len(b["row_id"]) for b in batches] == [8] * 7 + [4]
        image = batches[0]["image"]
        assert image.dtype == torch.float32 and image.shape == (8, 3, 4, 4)
        first = batches[0]["row_id"][0].item()
        assert image[0, 0, 0, 0].item() % 1000 == pytest.approx((first * 7 + epoch * 1000) % 1000,
                                                                abs=97)
    targets = torchvision.datasets.ImageFolder(root).targets  # labels numbered as torchvision
    labels = {r: l for b in batches for r, l in zip(b["row_id"].tolist(), b["label"].tolist())}
    assert [labels[r] for r in range(N)] == targets
    assert set(batches[0]) == {"row_id", "image", "label"}


def test_columns_make_tuples_and_shuffle_false_reads_in_id_order(cluster, root):
    loader = from_ray(pipeline(root), batch_size=16, shuffle=False, drop_last=True,
                      columns=("image", "label", "row_id"))
    batches = list(loader)
    assert [len(b[0]) for b in batches] == [16, 16, 16]  # drop_last: the short batch goes
    assert isinstance(batches[0], (tuple, list))
    assert [i for b in batches for i in b[2].tolist()] == list(range(48))


@pytest.mark.parametrize("steps", [0, 1, 3, 7])
def test_resume_is_the_uninterrupted_rest_and_delivered_rows_are_not_read(cluster, root,
                                                                           tmp_path, steps):
    full = ids_of(_loader(root))
    logs = str(tmp_path / "logs")
    os.makedirs(logs)
    first = _loader(root)
    head = ids_of(first, steps)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as checkpoints travel
    resumed = _loader(root, logs)
    resumed.load_state_dict(state)
    rest = ids_of(resumed)
    assert head + rest == full
    made = sorted(r for _, r in decoded(logs))
    assert made == sorted(i for b in rest for i in b)  # Ray read only the rows still due
    figures = resumed.stats()["ray"]
    assert figures["skipped_rows"] == 8 * steps and figures["streams"] == 1


def _loader(root, logs=None):
    loader = from_ray(pipeline(root, logs), batch_size=8, seed=9)
    loader.set_epoch(2)
    return loader


def test_a_break_then_a_new_epoch_restarts_the_stream(cluster, root):
    loader = from_ray(pipeline(root), batch_size=8, seed=1)
    loader.set_epoch(0)
    assert ids_of(loader, 2) == [_order(1, 0)[:8], _order(1, 0)[8:16]]
    loader.set_epoch(1)
    assert [i for b in ids_of(loader) for i in b] == _order(1, 1)
    assert loader.stats()["ray"]["streams"] == 2


def test_stats_and_report_say_how_long_training_waited_on_ray(cluster, root):
    loader = from_ray(pipeline(root), batch_size=8)
    for _ in loader:
        pass
    figures = loader.stats()
    ray_figures = figures["ray"]
    assert ray_figures["rows"] == N and ray_figures["blocks"] >= 1
    assert 0 < ray_figures["wait_s"] <= figures["wait_s"] + 1e-6
    assert "waiting on Ray" in loader.report()


def test_two_gloo_ranks_then_three_cover_every_row_exactly_once(cluster, root, tmp_path):
    address = cluster
    work = str(tmp_path)
    run_ranks(_rank, 2, (2, address, root, work, "save", 3), deadline_s=240)
    run_ranks(_rank, 3, (3, address, root, work, "resume", 0), deadline_s=240)
    order = _order(5, 1)  # DistributedSampler's split: rank r takes positions r, r + 2, ...
    for r in range(2):
        assert [i for b in json.load(open(os.path.join(work, f"save_{r}.json")))["batches"]
                for i in b] == order[r::2][:12]
    saved = [json.load(open(os.path.join(work, f"save_{r}.json")))["batches"] for r in range(2)]
    rest = [json.load(open(os.path.join(work, f"resume_{r}.json"))) for r in range(3)]
    assert len({len(r["batches"]) for r in rest}) == 1  # no rank waits for another: no DDP hang
    before = [i for s in saved for b in s for i in b]
    after = [i for r in rest for b in r["batches"] for i in b]
    padded = rest[0]["padded"]
    assert len(before) == 24 and len(set(before)) == 24
    assert sorted(set(after)) == sorted(set(range(N)) - set(before))  # the rest, each row once
    assert len(after) - len(set(after)) <= 2  # only DistributedSampler's padding repeats


def _rank(rank, port, world, address, root, work, phase, steps):
    from ray_pipelines import gloo_rank
    gloo_rank(rank, port, world, address, root, work, phase, steps)


def test_a_data_iterator_is_read_in_rays_order_once_and_resumes(cluster, root):
    ds = pipeline(root)
    loader = from_ray(ds.iterator(), batch_size=8)
    ids = [i for b in ids_of(loader) for i in b]
    assert sorted(ids) == list(range(N))
    first = from_ray(ds.iterator(), batch_size=8)
    head = [i for b in ids_of(first, 3) for i in b]
    state = first.state_dict()
    resumed = from_ray(ds.iterator(), batch_size=8)
    resumed.load_state_dict(state)
    rest = [i for b in ids_of(resumed) for i in b]
    assert sorted(head + rest) == list(range(N))
    assert resumed.stats()["ray"]["skipped_rows"] == len(head)


def test_webdataset_shards_read_as_rows_in_shard_order(cluster, root, tmp_path):
    from pooled_loader.shards.writer import write_shards
    urls = write_shards(root, str(tmp_path / "s-%03d.tar"), per_shard=25, progress=False, seed=None)
    assert len(urls) == 3
    rows = sorted(read_webdataset(urls).take_all(), key=lambda r: r["row_id"])
    folder = sorted(read_image_folder(root).take_all(), key=lambda r: r["row_id"])
    assert [r["row_id"] for r in rows] == list(range(N))
    assert [r["label"] for r in rows] == [r["label"] for r in folder]
    assert [bytes(r["bytes"]) for r in rows] == [bytes(r["bytes"]) for r in folder]
    assert rows[30]["path"].endswith(".tar:" + rows[30]["path"].split(":")[-1])
    loader = from_ray(read_webdataset(urls).map_batches(Marks(), batch_size=8), batch_size=8,
                      seed=2)
    assert [i for b in ids_of(loader) for i in b] == _order(2, 0)


def test_what_from_ray_refuses_is_said(cluster, root):
    with pytest.raises(ValueError, match="num_workers must be 0"):
        from_ray(pipeline(root), batch_size=8, num_workers=2)
    images = ray.data.read_images(root)
    with pytest.raises(ValueError, match="does not read from a pooled_loader.ray reader"):
        from_ray(images, batch_size=8)
    dropped = read_image_folder(root).filter(lambda r: r["row_id"] % 5 != 3) \
        .map_batches(Marks(), batch_size=8)
    with pytest.raises(RuntimeError, match="where row .* was due"):
        for _ in from_ray(dropped, batch_size=8, shuffle=False):
            pass
    with pytest.raises(KeyError, match="no column 'pixels'"):
        next(iter(from_ray(pipeline(root), batch_size=8, columns=("pixels",))))
    broken = str(os.path.join(root, "bee", "999.jpg"))
    os.symlink("/dev/zero", broken)
    try:
        with pytest.raises(Exception, match="999.jpg"):
            for _ in from_ray(pipeline(root), batch_size=8):
                pass
    finally:
        os.unlink(broken)


def test_a_source_reads_the_rows_it_is_given(root):
    from pooled_loader.ray.sources import FolderRows
    src = FolderRows(root)
    picked = src.with_rows(np.array([5, 3, 3, 59]), epoch=4)
    tasks = picked.get_read_tasks(8)
    table = list(tasks[0]())[0]
    assert table.column("row_id").to_pylist() == [5, 3, 3, 59]
    assert table.column("epoch").to_pylist() == [4] * 4
    assert table.column("path").to_pylist()[0].endswith(os.path.join("ant", "005.jpg"))
    with pytest.raises(ValueError, match=r"in \[0, 60\)"):
        src.with_rows(np.array([60]), 0)


def test_reader_transform_from_ray_gives_the_udfs_pixels_in_recycled_slots(cluster, root):
    import torchvision.transforms as T
    from pooled_loader.ray import transform
    t = T.Compose([T.RandomResizedCrop(48), T.RandomHorizontalFlip(), T.ToTensor(),
                   T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    udf = transform(t, seed=4)
    ds = read_image_folder(root).map_batches(udf, batch_size=8)
    loader = from_ray(ds, batch_size=6, seed=4, columns=("image", "label", "row_id"))
    loader.set_epoch(3)
    rows = {r["row_id"]: r for r in read_image_folder(root).take_all()}
    direct = type(udf)()
    slots = set()
    for image, label, row_id in loader:
        assert image.shape == (len(row_id), 3, 48, 48) and image.dtype == torch.float32
        slots.add(image.untyped_storage().data_ptr())
        batch = {"row_id": row_id.numpy(), "epoch": np.full(len(row_id), 3),
                 "bytes": np.array([rows[r]["bytes"] for r in row_id.tolist()], dtype=object),
                 "label": label.numpy()}
        assert torch.equal(image, torch.from_numpy(direct(batch)["image"]))
    assert len(slots) <= loader.stats()["slots"]  # the batches live in the pool's recycled slots


def test_ray_trains_documented_ingest_works_both_ways(cluster, root, tmp_path):
    """TorchTrainer with datasets={"train": ds}: get_dataset_shard's split in Ray's order, and
    the Dataset itself with distributed=True in the loader's exact order."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray_pipelines import train_loop
    ds = pipeline(root)
    TorchTrainer(train_loop, train_loop_config={"ds": ds, "out": str(tmp_path), "seed": 6},
                 scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
                 datasets={"train": ds},
                 run_config=RunConfig(storage_path=str(tmp_path / "results"))).fit()
    got = [json.load(open(tmp_path / f"train_{r}.json")) for r in range(2)]
    assert all(g["group"] for g in got)  # the ranks come from Ray Train's process group
    assert sorted(got[0]["shard"] + got[1]["shard"]) == list(range(N))
    order = _order(6, 0)
    assert [g["own"] for g in got] == [order[0::2], order[1::2]]


@pytest.mark.parametrize("state", [None, {}, {"delivered": "0-5"}, {"delivered": [[3, 2]]},
                                   {"delivered": [[0, 1 << 40]]}, {"delivered": [[0, 1.5]]},
                                   {"delivered": [[0, 2]], "epoch": -1},
                                   {"delivered": [[0, 2, 4]]}])
def test_a_corrupt_stream_state_is_refused_by_name(state):
    from pooled_loader.ray.consume import RayStream
    stream = RayStream(iterator=None, columns=None, prefetch_blocks=1)
    with pytest.raises(ValueError, match="the stream state is corrupt"):
        stream.load_state_dict(state)
    stream.load_state_dict({"epoch": 2, "delivered": [[0, 3], [7, 9]]})
    assert stream.epoch == 2 and stream._skip == {0, 1, 2, 7, 8}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_batches_come_from_a_pinned_pool_to_the_device(cluster, root):
    cpu = [b["image"] for b in from_ray(pipeline(root), batch_size=8, seed=3)]
    loader = from_ray(pipeline(root), batch_size=8, seed=3, pin_memory=True, device="cuda")
    gpu = [b["image"] for b in loader]
    assert all(g.is_cuda for g in gpu)
    assert all(torch.equal(c, g.cpu()) for c, g in zip(cpu, gpu))
