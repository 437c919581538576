"""pooled_loader.ray.transform: the fused torchvision path as a Ray Data map_batches UDF.

Rows are real encoded files (JPEGs of odd sizes, a grey JPEG, a PNG, a JPEG our decoder refuses
and the fused path hands to torchvision) in Ray's numpy batch format; pixels are compared with
torchvision's own ops run on ``Image.open(...).convert("RGB")`` under the same per-row seed."""
import io
import logging
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

from PIL import Image  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import imgutil  # noqa: E402
from pooled_loader.core.errors import SampleError  # noqa: E402
from pooled_loader.core.seeds import sample_seed, seed_globals  # noqa: E402
from pooled_loader.ray import udf  # noqa: E402
from pooled_loader.ray.udf import transform  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
SIZE = 64


def v1_recipe():
    return v1.Compose([v1.RandomResizedCrop(SIZE), v1.RandomHorizontalFlip(), v1.ToTensor(),
                       v1.Normalize(MEAN, STD)])


def v2_recipe():
    return v2.Compose([v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip(), v2.ToImage(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


def warned_jpeg(data):
    """A stray RST marker early in the scan: Pillow decodes it (libjpeg warns), our decoder
    refuses it, so the fused path hands the row to torchvision."""
    i = data.index(b"\xff\xda")
    start = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return data[:start + 50] + b"\xff\xd3" + data[start + 52:]


@pytest.fixture(scope="module")
def files():
    """(encoded bytes, path) of each row: its row id is its place here plus 100."""
    return [
        (imgutil.jpeg("astronaut", (321, 257)), "/data/train/a/odd1.JPEG"),
        (imgutil.jpeg("chelsea", (257, 385), quality=80), "/data/train/a/odd2.JPEG"),
        (imgutil.jpeg("coffee", (600, 451)), "shard-0003.tar:coffee"),
        (imgutil.jpeg("astronaut", (300, 333), mode="L"), "/data/train/b/grey.JPEG"),
        (imgutil.encode(imgutil.rgb("coffee", (233, 301)), "PNG", mode="RGBA"),
         "/data/train/b/rgba.png"),
        (imgutil.jpeg("chelsea", (280, 300)), "shard-0003.tar:cat"),
        (warned_jpeg(imgutil.jpeg("chelsea", (280, 300))), "/data/train/b/warned.JPEG"),
    ]


def batch(files, ids=None, epoch=0):
    """Ray's numpy batch for rows ``ids`` (default: all)."""
    ids = list(range(len(files))) if ids is None else ids
    data = np.empty(len(ids), object)
    data[:] = [files[i][0] for i in ids]
    return {"row_id": np.array([100 + i for i in ids], np.int64),
            "epoch": np.full(len(ids), epoch, np.int64), "bytes": data,
            "label": np.array([i % 3 for i in ids], np.int64),
            "path": np.array([files[i][1] for i in ids], object)}


def torchvision_row(t, data, seed, epoch, row_id):
    seed_globals(sample_seed(seed, epoch, row_id))
    return t(Image.open(io.BytesIO(data)).convert("RGB")).as_subclass(torch.Tensor).numpy()


def levels(x, normalized=True):
    """Pixel values on 0-255."""
    x = np.asarray(x, np.float64)
    if normalized:
        x = x * np.array(STD)[:, None, None] + np.array(MEAN)[:, None, None]
    return x * 255


def test_one_array_per_batch_columns_passed_through_and_pixels_fixed_by_row_and_epoch(files):
    cls = type(transform(v1_recipe(), seed=3))  # the class: what Ray's actors construct
    b = batch(files)
    out = cls()(b)
    assert set(out) == {"row_id", "epoch", "label", "path", "image"}
    for key in ("row_id", "epoch", "label", "path"):
        assert out[key] is b[key]
    image = out["image"]
    assert image.shape == (len(files), 3, SIZE, SIZE) and image.dtype == np.float32
    assert image.flags.c_contiguous
    other = cls()  # another actor, rows alone and in another order
    for i in range(len(files)):
        assert np.array_equal(other(batch(files, [i]))["image"][0], image[i])
    order = [5, 2, 6, 0, 4, 1, 3]
    assert np.array_equal(other(batch(files, order))["image"], image[order])
    again = other(b)["image"]  # same batch twice: same pixels, buffers reused
    assert np.array_equal(again, image)
    later = other(batch(files, epoch=1))["image"]
    # (the refused JPEG decodes mostly to Pillow's flat grey: any crop of it looks the same)
    assert all(not np.array_equal(later[i], image[i]) for i in range(len(files) - 1))
    reseeded = transform(v1_recipe(), seed=4)(b)["image"]
    assert not np.array_equal(reseeded, image)


@pytest.mark.parametrize("make", [v1_recipe, v2_recipe], ids=["v1", "v2"])
def test_pixels_match_torchvision_for_the_same_seed(files, make, caplog):
    t = make()
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        inst = transform(t, seed=7)
    assert "accelerated Ray transform: fused [" in caplog.text
    for epoch in (0, 2):
        got = inst(batch(files, epoch=epoch))["image"]
        means = []
        for i, (data, path) in enumerate(files):
            want = torchvision_row(t, data, 7, epoch, 100 + i)
            assert want.shape == got[i].shape
            diff = np.abs(levels(got[i]) - levels(want))
            assert diff.max() <= 1.01, (path, epoch, diff.max())  # same box and flip
            if "warned" in path:  # made by torchvision itself
                assert np.array_equal(got[i], want)
            means.append(diff.mean())
        assert np.mean(means) <= 0.25
    assert inst.fallbacks == 2  # the refused JPEG, once per epoch


def test_unreadable_transform_runs_as_it_is_and_fallback_rows_match(files, caplog):
    t = v1.Compose([v1.CenterCrop(300), v1.ToTensor()])  # larger than most images: fallbacks
    ids = [0, 2, 4, 6]  # 321x257 (crop too large), 600x451 (fused), a PNG, the refused JPEG
    inst = transform(t, seed=1)
    got = inst(batch(files, ids))["image"]
    for k, i in enumerate(ids):
        want = torchvision_row(t, files[i][0], 1, 0, 100 + i)
        if i in (0, 4, 6):  # made by torchvision itself
            assert np.array_equal(got[k], want), files[i][1]
        else:
            assert np.abs(got[k] - want).max() <= 1.01 / 255, files[i][1]
    assert inst.fallbacks == 3
    # a lambda runs as it is, the random state per row all the same
    op = v1.RandomResizedCrop(40)
    fn = lambda im: v1.functional.pil_to_tensor(op(im))  # noqa: E731
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        cls = type(transform(fn, seed=2))
    assert "runs as it is (the transform is a lambda" in caplog.text
    got = cls()(batch(files))["image"]
    assert got.shape == (len(files), 3, 40, 40) and got.dtype == np.uint8
    for i, (data, _) in enumerate(files):
        assert np.array_equal(got[i], torchvision_row(fn, data, 2, 0, 100 + i))


def test_pooled_loader_own_compose_runs_on_the_bytes(files):
    from pooled_loader import vision
    t = vision.Compose([vision.DecodeImage(), vision.RandomResizedCrop(48),
                        vision.RandomHorizontalFlip(), vision.ToCHW()])
    jpegs = [0, 1, 2, 5]
    got = transform(t, seed=5)(batch(files, jpegs))["image"]
    assert got.shape == (4, 3, 48, 48) and got.dtype == np.uint8
    for k, i in enumerate(jpegs):
        seed_globals(sample_seed(5, 0, 100 + i))
        assert np.array_equal(got[k], t(np.frombuffer(files[i][0], np.uint8)))


def test_bad_rows_name_the_row_and_path(files, monkeypatch):
    inst = transform(v1_recipe())
    b = batch(files, [0, 1])
    b["bytes"][1] = b"\x89PNG not an image at all"
    with pytest.raises(SampleError, match=r"row 101 \(/data/train/a/odd2.JPEG\): cannot decode"):
        inst(b)
    b["bytes"][1] = files[1][0][:300]  # truncated: Pillow refuses it too
    with pytest.raises(SampleError, match=r"row 101 \(/data/train/a/odd2.JPEG\)"):
        inst(b)
    del b["path"]
    b["bytes"][1] = None
    with pytest.raises(SampleError, match=r"row 101: the image column holds NoneType"):
        inst(b)
    monkeypatch.setattr(udf, "MAX_IMAGE_BYTES", 1000)
    with pytest.raises(SampleError, match=r"row 100 \(/data/train/a/odd1.JPEG\): the encoded "
                       r"image is \d+ bytes, over the 1000-byte limit"):
        inst(batch(files, [0]))


def test_rows_of_different_sizes_in_one_batch_are_refused(files):
    inst = transform(v1.Compose([v1.Resize(50), v1.ToTensor()]))
    with pytest.raises(ValueError, match=r"row 101 gives an image of shape \(3, 74, 50\) "
                       r"\(float32\) but row 100 of the same batch gives \(3, 50, 62\).*"
                       r"crop or\s+resize"):
        inst(batch(files, [0, 1]))
    assert inst(batch(files, [1]))["image"].shape == (1, 3, 74, 50)  # alone it is fine


def test_buffer_kinds_and_pickled_classes_give_the_same_pixels(files):
    from ray import cloudpickle  # the one Ray pickles UDFs with (vendored)
    udf = transform(v2_recipe(), seed=9)
    cls = type(udf)
    want = cls()(batch(files))["image"]
    for copy in (pickle.loads(pickle.dumps(cls)), cloudpickle.loads(cloudpickle.dumps(cls))):
        assert np.array_equal(copy()(batch(files))["image"], want)
    # an instance (a task's UDF) unpickles as this process's one instance of its transform:
    # the plan is read and the buffers grown once per process, not once per task
    tasks = [pickle.loads(pickle.dumps(udf)), cloudpickle.loads(cloudpickle.dumps(udf))]
    assert tasks[0] is tasks[1] is not udf
    assert np.array_equal(tasks[0](batch(files))["image"], want)
    b = batch(files)
    b["bytes"][0] = memoryview(files[0][0])
    b["bytes"][1] = np.frombuffer(files[1][0], np.uint8)
    b["bytes"][2] = bytearray(files[2][0])
    assert np.array_equal(cls()(b)["image"], want)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("on", ["tasks", "actors"])
def test_through_ray_data_map_batches_as_tasks_or_on_an_actor(files, ray_session, on):
    ray = ray_session
    items = [{"row_id": 100 + i, "epoch": 1, "bytes": data, "label": i % 3, "path": path}
             for i, (data, path) in enumerate(files)]
    t = v1_recipe()
    udf = transform(t, seed=3)
    ds = ray.data.from_items(items)
    ds = ds.map_batches(udf, batch_size=4, batch_format="numpy") if on == "tasks" else \
        ds.map_batches(type(udf), concurrency=1, batch_size=4, batch_format="numpy")
    rows = sorted(ds.take_all(), key=lambda r: r["row_id"])
    want = transform(t, seed=3)(batch(files, epoch=1))["image"]
    assert [r["row_id"] for r in rows] == [100 + i for i in range(len(files))]
    for i, r in enumerate(rows):
        assert r["path"] == files[i][1] and r["label"] == i % 3 and "bytes" not in r
        assert np.array_equal(r["image"], want[i])
