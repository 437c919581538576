"""pooled_loader.vision: ops' declared outputs, Compose's planning and fusion, ImageFolder."""
from __future__ import annotations

import os
import pickle
import random
import tracemalloc

import numpy as np
import pytest
from PIL import Image

import imgutil
from pooled_loader.vision import (CenterCrop, Compose, DecodeImage, ImageFolder, Normalize,
                                  RandomHorizontalFlip, RandomResizedCrop, Resize, Spec, ToCHW)
from pooled_loader.vision.compose import dct_factor, scale_box
from pooled_loader.vision.io.decode import decode_into, read_header, scaled_size

U8 = np.dtype(np.uint8)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def train_tf() -> Compose:
    return Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("folder"))
    imgutil.make_folder(root)
    return root


# ---------------------------------------------------------------- declared outputs

def test_ops_declare_their_output():
    hwc = Spec((300, 400, 3), U8, "HWC")
    assert CenterCrop(224).spec(hwc) == Spec((224, 224, 3), U8, "HWC")
    assert CenterCrop((10, 20)).spec(hwc) == Spec((10, 20, 3), U8, "HWC")
    chw = ToCHW().spec(hwc)
    assert chw == Spec((3, 300, 400), U8, "CHW")
    assert RandomHorizontalFlip().spec(chw) == chw
    assert Normalize(MEAN, STD).spec(chw) == Spec((3, 300, 400), np.dtype(np.float32), "CHW")
    with pytest.raises(ValueError, match="ToCHW"):
        Normalize(MEAN, STD).spec(hwc)
    with pytest.raises(ValueError, match="HWC"):
        ToCHW().spec(chw)


@pytest.mark.parametrize("hw, size, max_side, want", [
    ((300, 400), 256, None, (256, 341)),     # shorter side -> 256, torchvision's int()
    ((400, 300), 256, None, (341, 256)),
    ((300, 400), None, 200, (150, 200)),     # longest side capped
    ((100, 120), None, 200, (100, 120)),     # already within the cap: unchanged
    ((300, 1200), 256, 512, (128, 512)),     # shorter to 256 would make the long side 1024
    ((300, 400), (100, 50), None, (100, 50)),
])
def test_resize_sizes(hw, size, max_side, want):
    box, out_hw = Resize(size, max_side).sample(*hw)
    assert box == (0, 0, hw[1], hw[0]) and out_hw == want
    img = np.zeros((*hw, 3), np.uint8)
    assert Resize(size, max_side)(img).shape == (*want, 3)


def test_simple_ops_values():
    img = imgutil.rgb("chelsea")
    assert np.array_equal(ToCHW()(img), img.transpose(2, 0, 1))
    flipped = Compose([RandomHorizontalFlip(p=1.0)])(img)
    assert np.array_equal(flipped, img[:, ::-1])
    assert np.array_equal(Compose([RandomHorizontalFlip(p=0.0)])(img), img)
    h, w = img.shape[:2]
    cc = CenterCrop((100, 120))(img)
    top, left = int(round((h - 100) / 2)), int(round((w - 120) / 2))
    assert np.array_equal(cc, img[top:top + 100, left:left + 120])
    small = img[:10, :12]
    padded = CenterCrop(16)(small)  # torchvision pads a too-small image with zeros
    assert padded[3:13, 2:14].tolist() == small.tolist() and padded[:3].max() == 0
    norm = Compose([ToCHW(), Normalize(MEAN, STD)])(img)
    m, s = np.array(MEAN)[:, None, None], np.array(STD)[:, None, None]
    ref = (img.transpose(2, 0, 1) / 255.0 - m) / s
    assert norm.dtype == np.float32 and np.abs(norm - ref).max() < 1e-5


def test_compose_writes_into_out_and_returns_fresh_without():
    data = imgutil.jpeg("astronaut", (400, 300))
    tf = train_tf()
    out = np.empty((3, 224, 224), np.uint8)
    assert tf(data, out=out) is out
    a, b = tf(data), tf(data)
    assert a.shape == (3, 224, 224) and a.dtype == np.uint8
    assert not np.shares_memory(a, b)  # results without out are the caller's own arrays
    wrong = np.empty((3, 100, 100), np.uint8)
    r = tf(data, out=wrong)
    assert r is not wrong and r.shape == (3, 224, 224)  # mismatch: a new array (loader copies)
    strided = np.empty((3, 224, 448), np.uint8)[:, :, ::2]
    assert tf(data, out=strided) is strided  # fits but not contiguous: copied into


@pytest.mark.parametrize("op", [DecodeImage(), Resize(100), RandomResizedCrop((64, 48)),
                                RandomHorizontalFlip(p=1.0), CenterCrop(90), ToCHW()],
                         ids=repr)
def test_an_op_called_alone_gives_what_a_one_op_compose_gives(op):
    """An op runs alone without the planner (vision/base.py); same result, same ``out`` rules."""
    data = imgutil.jpeg("astronaut", (200, 160))
    x = data if isinstance(op, DecodeImage) else Compose([DecodeImage()])(data)
    random.seed(3)
    want = Compose([op])(x)
    random.seed(3)
    got = op(x)
    assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)
    out = np.empty_like(want)
    random.seed(3)
    assert op(x, out=out) is out and np.array_equal(out, want)
    strided = np.empty((*want.shape[:-1], 2 * want.shape[-1]), want.dtype)[..., ::2]
    random.seed(3)
    assert op(x, out=strided) is strided and np.array_equal(strided, want)
    wrong = np.empty((3, 7, 7), np.uint8)
    assert op(x, out=wrong) is not wrong


def test_fusion_groups_ops():
    tf = Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW(),
                  Normalize(MEAN, STD)])
    (st,) = tf._stages
    assert st.flip is not None and st.chw and st.norm is not None
    out = np.empty((3, 224, 224), np.float32)
    assert tf(imgutil.jpeg(), out=out) is out
    with pytest.raises(ValueError, match="first"):
        Compose([RandomResizedCrop(8), DecodeImage()])


def test_fused_decode_equals_decode_then_ops_without_dct_scaling():
    """Fusing decode + crop does not change the crop or flip a seed gives (no DCT scale here)."""
    data = imgutil.jpeg("coffee", (400, 267))
    fused = Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()])
    decode = Compose([DecodeImage()])
    rest = Compose([RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()])
    for seed in range(20):
        random.seed(seed)
        a = fused(data)
        img = decode(data)
        random.seed(seed)
        b = rest(img)
        assert np.array_equal(a, b)
    assert fused.stats()["dct_scaled"] == 0


def test_unfused_hwc_path_matches_fused_chw_path():
    img = imgutil.rgb("astronaut", (600, 450))
    hwc = Compose([RandomResizedCrop(160), RandomHorizontalFlip()])
    chw = Compose([RandomResizedCrop(160), RandomHorizontalFlip(), ToCHW()])
    for seed in range(10):
        random.seed(seed)
        a = hwc(img)
        random.seed(seed)
        b = chw(img)
        assert np.abs(a.transpose(2, 0, 1).astype(int) - b).mean() < 2.0


# ---------------------------------------------------------------- DCT-domain downscaling

def test_dct_factor_and_box_mapping():
    assert dct_factor((0, 0, 224, 224), (224, 224)) == 1
    assert dct_factor((0, 0, 447, 900), (224, 224)) == 1
    assert dct_factor((0, 0, 448, 900), (224, 224)) == 2
    assert dct_factor((0, 0, 1000, 1000), (224, 224)) == 4
    assert dct_factor((0, 0, 4000, 1800), (224, 224)) == 8
    assert dct_factor((0, 0, 8000, 8000), (224, 224)) == 8  # 1/8 is the smallest scale
    assert scale_box((8, 16, 800, 400), (1000, 2000), (125, 250)) == (1, 2, 100, 50)
    x0, y0, w, h = scale_box((1999, 999, 1, 1), (1000, 2000), (125, 250))
    assert w >= 1 and h >= 1 and x0 + w <= 250 and y0 + h <= 125


@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_decode_scaled_sizes(factor):
    data = imgutil.jpeg("astronaut", (1001, 777))
    hdr = read_header(data)
    assert (hdr.height, hdr.width, hdr.turbo) == (777, 1001, True)
    img = decode_into(data, hdr, lambda n: np.empty(n, np.uint8), factor)
    assert img.shape == (*scaled_size(hdr, factor), 3)


def test_big_jpeg_is_decoded_dct_scaled():
    data = imgutil.jpeg("chelsea", (2400, 1800))
    tf = Compose([DecodeImage(), Resize(256), CenterCrop(224), ToCHW()])
    out = tf(data)
    assert out.shape == (3, 224, 224) and tf.stats()["dct_scaled"] == 1
    tf = train_tf()
    for _ in range(20):
        tf(data)
    assert tf.stats()["dct_scaled"] > 0


# ---------------------------------------------------------------- no allocations in steady state

def test_steady_state_allocates_no_pixel_buffers(folder):
    ds = ImageFolder(folder, transform=train_tf())
    out = np.empty((3, 224, 224), np.uint8)
    random.seed(0)
    for i in range(len(ds)):  # warm-up: each image seen once sizes the buffers for good
        ds.getitem_into(i, (out, None))
    tf = ds.transform
    before = tf.stats()
    file_allocs = ds._scratch.allocations
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    n = 0
    for _ in range(15):
        for i in range(len(ds)):
            img, label = ds.getitem_into(i, (out, None))
            assert img is out and label == ds.targets[i]
            n += 1
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after = tf.stats()
    assert n >= 100 and after["dct_scaled"] > before["dct_scaled"]  # both decode paths ran
    # the planner's counters: no buffer allocated, no plan recomputed, after warm-up
    assert after["allocations"] == before["allocations"]
    assert after["plans_made"] == before["plans_made"]
    assert ds._scratch.allocations == file_allocs
    # tracemalloc (numpy reports its data buffers to it): the peak over all those samples stays
    # far below one output image (150 KB), let alone a decoded one (>= 250 KB here)
    assert peak - base < 32 * 1024, (peak - base)
    assert current - base < 8 * 1024


def test_planner_buffers_are_per_process_and_not_pickled():
    tf = train_tf()
    tf(imgutil.jpeg())
    assert tf.stats()["scratch_bytes"] > 0
    tf2 = pickle.loads(pickle.dumps(tf))
    assert tf2.stats() == {"allocations": 0, "scratch_bytes": 0, "plans_made": 0,
                           "dct_scaled": 0, "roi_decoded": 0}
    assert tf2(imgutil.jpeg()).shape == (3, 224, 224)


# ---------------------------------------------------------------- ImageFolder

def test_imagefolder_indexing_like_torchvision(tmp_path):
    root = tmp_path / "root"
    for cls, files in {"b_dog": ["z.jpg", "a.JPEG", "notes.txt"], "a_cat": ["x.png"],
                       "c_cow": ["sub/y.jpg", "sub/a.jpg", "w.jpeg"]}.items():
        for f in files:
            data = imgutil.encode(imgutil.rgb("coffee", (32, 24)), "PNG" if f.endswith("png")
                                  else "JPEG") if not f.endswith("txt") else b"text"
            imgutil.write(str(root / cls / f), data)
    (root / "loose.jpg").write_bytes(imgutil.jpeg(size=(32, 24)))  # not in a class folder
    ds = ImageFolder(str(root))
    assert ds.classes == ["a_cat", "b_dog", "c_cow"]
    assert ds.class_to_idx == {"a_cat": 0, "b_dog": 1, "c_cow": 2}
    rel = [(os.path.relpath(p, root), t) for p, t in ds.samples]
    assert rel == [("a_cat/x.png", 0), ("b_dog/a.JPEG", 1), ("b_dog/z.jpg", 1),
                   ("c_cow/w.jpeg", 2), ("c_cow/sub/a.jpg", 2), ("c_cow/sub/y.jpg", 2)]
    assert ds.targets == [0, 1, 1, 2, 2, 2] and len(ds) == 6
    data, label = ds[1]  # no transform: the encoded bytes
    assert label == 1 and bytes(data[:3]) == b"\xff\xd8\xff"
    (root / "d_empty").mkdir()
    with pytest.raises(FileNotFoundError, match="d_empty"):
        ImageFolder(str(root))
    with pytest.raises(FileNotFoundError, match="class folder"):
        ImageFolder(str(tmp_path / "root" / "a_cat"))
    with pytest.raises(ValueError):
        ImageFolder(str(root / "c_cow"), on_error="ignore")


def test_imagefolder_samples(folder):
    ds = ImageFolder(folder, transform=train_tf())
    for i in range(len(ds)):
        img, label = ds[i]
        assert img.shape == (3, 224, 224) and img.dtype == np.uint8
        assert isinstance(label, int) and label == ds.samples[i][1]
    random.seed(3)
    a = ds[5][0]
    random.seed(3)
    out = np.zeros((3, 224, 224), np.uint8)
    b, _ = ds.getitem_into(5, (out, None))
    assert b is out and np.array_equal(a, b)  # both paths give the same sample


def test_imagefolder_pickles_without_buffers(folder):
    """What a spawned worker receives: the index and the pipeline, none of the buffers."""
    ds = ImageFolder(folder, transform=train_tf())
    out = np.empty((3, 224, 224), np.uint8)
    ds.getitem_into(0, (out, None))
    blob = pickle.dumps(ds)
    assert len(blob) < 10_000
    ds2 = pickle.loads(blob)
    assert ds2.samples == ds.samples and ds2.class_to_idx == ds.class_to_idx
    random.seed(1)
    a = ds2.getitem_into(2, (out, None))[0].copy()
    random.seed(1)
    assert np.array_equal(a, ds[2][0])


def test_imagefolder_eval_pipeline_float(folder):
    tf = Compose([DecodeImage(), Resize(256), CenterCrop(224), ToCHW(), Normalize(MEAN, STD)])
    ds = ImageFolder(folder, transform=tf)
    path = ds.samples[0][0]
    img, _ = ds[0]
    ref = Image.open(path).convert("RGB")
    w, h = ref.size
    s = 256 / min(w, h)
    ref = ref.resize((int(w * s) if w > h else 256, int(h * s) if h > w else 256),
                     Image.BILINEAR)
    W, H = ref.size
    left, top = int(round((W - 224) / 2)), int(round((H - 224) / 2))
    ref = np.asarray(ref.crop((left, top, left + 224, top + 224)), np.float32)
    m, s = np.array(MEAN)[:, None, None], np.array(STD)[:, None, None]
    ref = (ref.transpose(2, 0, 1) / 255 - m) / s
    assert img.dtype == np.float32
    assert np.abs(img - ref).mean() * 255 * 0.226 <= 2.0  # mean abs diff <= 2 levels


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_through_pooled_loader(folder, workers):
    torch = pytest.importorskip("torch")
    from pooled_loader import PooledLoader

    # deterministic pipeline: every batch row must equal the dataset's own item
    ds = ImageFolder(folder, transform=Compose([DecodeImage(), Resize(256), CenterCrop(224),
                                                ToCHW()]))
    xs, ys = [], []
    for x, y in PooledLoader(ds, batch_size=3, num_workers=workers, timeout=60):
        assert x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, 224, 224)
        assert y.dtype == torch.int64 and len(y) == len(x)
        xs.append(x.numpy().copy())
        ys.extend(y.tolist())
    assert ys == ds.targets
    expected = np.stack([ds[i][0] for i in range(len(ds))])
    assert np.array_equal(np.concatenate(xs), expected)
    ds.transform = Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(),
                            ToCHW()])

    def epoch() -> np.ndarray:  # random crops drawn from the worker-seeded RNG: reproducible
        random.seed(0)  # without workers the transform runs here, on this process's RNG
        loader = PooledLoader(ds, batch_size=4, num_workers=workers, shuffle=True, timeout=60,
                              generator=torch.Generator().manual_seed(7))
        xs = []
        for x, y in loader:
            assert tuple(x.shape[1:]) == (3, 224, 224) and x.dtype == torch.uint8
            xs.append(x.numpy().copy())
        return np.concatenate(xs)

    a, b = epoch(), epoch()
    assert len(a) == len(ds) and np.array_equal(a, b)
