"""torchvision pipelines under PooledLoader: tensor subclasses (tv_tensors) in slots, and the
translation of an unchanged ImageFolder + Compose onto the fused image path (issue 37)."""
import pytest

torchvision = pytest.importorskip("torchvision")

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

from pooled_loader import PooledLoader  # noqa: E402


class Plain(torch.Tensor):
    """A subclass with torch's own __torch_function__: a batch of them stays one."""


class Subclassed(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        image = tv_tensors.Image(torch.full((3, 5, 4), i, dtype=torch.uint8))
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[0, 0, i, i]]), format="XYXY",
                                         canvas_size=(5, 4))
        return {"image": image, "plain": torch.full((2,), float(i)).as_subclass(Plain),
                "mask": tv_tensors.Mask(torch.zeros(2, 2, dtype=torch.bool)), "boxes": boxes,
                "label": i}


def _types(tree):
    return {k: type(v) for k, v in tree.items()}


@pytest.mark.parametrize("batch_size", [3, None])
def test_tensor_subclasses_go_through_slots_and_come_out_as_dataloader_gives_them(batch_size):
    expected = list(DataLoader(Subclassed(), batch_size=batch_size, num_workers=2))
    loader = PooledLoader(Subclassed(), batch_size=batch_size, num_workers=2)
    got = list(loader)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert _types(a) == _types(b)
        for key in ("image", "plain", "mask", "boxes"):
            assert torch.equal(a[key].as_subclass(torch.Tensor), b[key].as_subclass(torch.Tensor))
        assert torch.equal(torch.as_tensor(a["label"]), torch.as_tensor(b["label"]))
        if batch_size is None:  # a subclass with metadata keeps it: it travels DataLoader's way
            assert b["boxes"].canvas_size == a["boxes"].canvas_size
    # image, plain, mask (and, batched, label) leaves went through the slot
    label_bytes = 8 if batch_size else 0  # default_convert leaves a Python int as it is
    assert loader.stats()["bytes_moved"] == 6 * (3 * 5 * 4 + 2 * 4 + 4 + label_bytes)


# ---------------------------------------------------------------- the translated pipelines

import io  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

import numpy as np  # noqa: E402
from PIL import Image, ImageEnhance  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import imgutil  # noqa: E402
from pooled_loader.vision import ImageFolder as PooledFolder  # noqa: E402
from pooled_loader.vision.io.buffers import Scratch  # noqa: E402
from pooled_loader.vision.ops.jitter import jitter_  # noqa: E402
from pooled_loader.vision.io.kernels import ext_available  # noqa: E402
from pooled_loader.vision.torchvision import folder as torchvision_fused  # noqa: E402

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def translate(dataset):
    return torchvision_fused.translate(dataset)[0]


def _exif_rotated(img: np.ndarray) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 (torchvision's loader does not apply it)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=88, exif=exif.tobytes())
    return buf.getvalue()


def _warned_jpeg(data: bytes) -> bytes:
    """A stray RST marker early in the scan: libjpeg warns ("premature end of data segment"),
    Pillow decodes it anyway (grey padding); our decoder refuses it, so the fused path hands
    this sample to torchvision."""
    i = data.index(b"\xff\xda")
    start = i + 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return data[:start + 50] + b"\xff\xd3" + data[start + 52:]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Odd-sized JPEGs, greyscale, CMYK, PNG (RGBA and palette), EXIF-rotated, and one JPEG
    our decoder refuses but Pillow opens."""
    root = str(tmp_path_factory.mktemp("tvfolder"))
    w = imgutil.write
    w(f"{root}/a/odd1.jpg", imgutil.jpeg("astronaut", (321, 257)))
    w(f"{root}/a/odd2.jpg", imgutil.jpeg("chelsea", (257, 385), quality=80))
    w(f"{root}/a/big.jpg", imgutil.jpeg("coffee", (1201, 901)))
    w(f"{root}/a/grey.jpg", imgutil.jpeg("astronaut", (300, 333), mode="L"))
    w(f"{root}/b/cmyk.jpg", imgutil.jpeg("chelsea", (299, 241), mode="CMYK"))
    w(f"{root}/b/rgba.png", imgutil.encode(imgutil.rgb("coffee", (233, 301)), "PNG", mode="RGBA"))
    w(f"{root}/b/pal.png", imgutil.encode(imgutil.rgb("astronaut", (260, 250)), "PNG", mode="P"))
    w(f"{root}/b/exif.jpg", _exif_rotated(imgutil.rgb("coffee", (345, 227))))
    w(f"{root}/b/warned.jpg", _warned_jpeg(imgutil.jpeg("chelsea", (280, 300))))
    return root


def _levels(x: torch.Tensor, normalized: bool) -> torch.Tensor:
    """Pixel values on 0-255, whatever the pipeline's output."""
    x = x.as_subclass(torch.Tensor).double()
    if normalized:
        x = x * torch.tensor(STD, dtype=torch.double)[:, None, None] + \
            torch.tensor(MEAN, dtype=torch.double)[:, None, None]
    return x * 255 if x.is_floating_point() and (normalized or x.max() <= 1.0) else x


PIPELINES = {
    "v1 PIL float": (lambda: v1.Compose([v1.RandomResizedCrop(96), v1.RandomHorizontalFlip(),
                                         v1.ToTensor(), v1.Normalize(MEAN, STD)]), True),
    "v2 PIL float": (lambda: v2.Compose([v2.RandomResizedCrop(96), v2.RandomHorizontalFlip(),
                                         v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                                         v2.Normalize(MEAN, STD)]), True),
    "v2 tensor uint8": (lambda: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(96),
                                            v2.RandomHorizontalFlip()]), False),
    "v1 eval": (lambda: v1.Compose([v1.Resize(112), v1.CenterCrop(96), v1.ToTensor(),
                                    v1.Normalize(MEAN, STD)]), True),
    "v2 flip first, crop": (lambda: v2.Compose([v2.RandomHorizontalFlip(), v2.Resize(101),
                                                v2.RandomHorizontalFlip(), v2.CenterCrop(96),
                                                v2.PILToTensor()]), False),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pixels_match_torchvision_for_the_same_draws_on_every_kind_of_file(folder, name):
    make, normalized = PIPELINES[name]
    ds = datasets.ImageFolder(folder, transform=make())
    fused = translate(ds)
    assert fused is not None and not fused.describe()["as_is"]
    means = []
    for i in range(len(ds)):
        for seed in range(3):
            torch.manual_seed(seed)
            want, want_label = ds[i]
            torch.manual_seed(seed)
            got, got_label = fused[i]
            assert type(got) is type(want) and got.dtype == want.dtype
            assert got.shape == want.shape and got_label == want_label
            diff = (_levels(got, normalized) - _levels(want, normalized)).abs()
            assert diff.max() <= 1.01, (ds.samples[i][0], seed, diff.max())  # same box and flip
            # no border effect: the kernel reads only the crop box, as torchvision crops first
            border = torch.cat([diff[:, :2].flatten(), diff[:, -2:].flatten(),
                                diff[:, :, :2].flatten(), diff[:, :, -2:].flatten()])
            assert border.mean() <= max(0.3, 2 * diff.mean())
            means.append(diff.mean().item())
    assert np.mean(means) <= 0.25
    assert fused.fallbacks == 3  # the one JPEG our decoder refuses, once per seed


@pytest.mark.parametrize("compiled", [True, False])
def test_jitter_is_bit_exact_with_pillow(compiled):
    if compiled and not ext_available():
        pytest.skip("the compiled kernels are not built")
    rng = np.random.default_rng(0)
    scratch = Scratch()
    for trial in range(60):
        h, w = rng.integers(1, 50, 2)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if trial % 3 == 0:
            img = img // 40 * 40  # flat areas: many pixels on the same grey
        factor = float(rng.uniform(0, 2))
        for fn, enhance in enumerate((ImageEnhance.Brightness, ImageEnhance.Contrast,
                                      ImageEnhance.Color)):
            want = np.asarray(enhance(Image.fromarray(img)).enhance(factor))
            chw = np.ascontiguousarray(img.transpose(2, 0, 1))
            factors = [None] * 4
            factors[fn] = factor
            jitter_(chw, [3, 2, 1, 0], tuple(factors), scratch, compiled)
            assert np.array_equal(chw.transpose(1, 2, 0), want), (enhance.__name__, factor)


def _pairs(ds, **kw):
    kw = dict(batch_size=3, num_workers=2, shuffle=True, **kw)
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(5), **kw))
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(5), **kw)
    return want, list(loader), loader


@pytest.mark.parametrize("kind", ["v2", "timm"])
def test_same_seed_gives_dataloaders_crops_and_flips_sample_for_sample(folder, kind):
    if kind == "timm":
        timm_data = pytest.importorskip("timm.data")
        transform = timm_data.create_transform(96, is_training=True)  # Python random + jitter
        top = 4.5  # ColorJitter multiplies a 1-level difference by up to 1.4 ** 3
    else:
        transform = PIPELINES["v2 PIL float"][0]()
        top = 1.01
    ds = datasets.ImageFolder(folder, transform=transform)
    want, got, loader = _pairs(ds)
    assert len(got) == len(want)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is type(xa) and torch.equal(ya, yb)
        diff = (_levels(xa, True) - _levels(xb, True)).abs()
        assert diff.flatten(1).max(1).values.max() <= top  # every sample's box and flip
        assert diff.mean() <= 0.3
    transforms = loader.stats()["transforms"]
    assert transforms["as_is"] == [] and len(transforms["fused"]) == 5


def test_ops_after_the_fused_prefix_run_as_torchvision_in_the_worker(folder):
    transform = v2.Compose([v2.RandomResizedCrop(96), v2.RandomHorizontalFlip(),
                            v2.RandomRotation(30), v2.PILToTensor(), v2.RandomErasing(p=0.5)])
    ds = datasets.ImageFolder(folder, transform=transform)
    want, got, loader = _pairs(ds)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is type(xa) and xb.dtype == torch.uint8 and torch.equal(ya, yb)
        # the rotation's resampling can turn a 1-level difference into a few: the same
        # draws give mostly the same pixels
        assert (xa.float() - xb.float()).abs().mean() <= 2.0
    assert loader.stats()["transforms"]["as_is"][0].startswith("RandomRotation")


def test_the_log_line_and_stats_say_what_is_fused(folder, caplog):
    ds = datasets.ImageFolder(folder, transform=v1.Compose([
        v1.RandomResizedCrop(64), v1.RandomVerticalFlip(), v1.ToTensor()]))
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        loader = PooledLoader(ds, batch_size=4, num_workers=0)
        next(iter(loader))
    lines = [r.getMessage() for r in caplog.records if "torchvision transform" in r.getMessage()]
    assert len(lines) == 1 and "fused [RandomResizedCrop(" in lines[0]
    assert "as is [RandomVerticalFlip(p=0.5), ToTensor()]" in lines[0]
    stats = loader.stats()["transforms"]
    assert stats["as_is"] == ["RandomVerticalFlip(p=0.5)", "ToTensor()"]
    assert stats["output"] == "PIL.Image"


class OwnGetitem(datasets.ImageFolder):
    def __getitem__(self, index):
        image, label = super().__getitem__(index)
        return image, label + 100


class MyCrop(v1.RandomResizedCrop):
    pass


def _pil_rgb(path):
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


def _as_is_cases(folder):
    simple = lambda: v1.Compose([v1.RandomResizedCrop(64), v1.ToTensor()])  # noqa: E731
    return {
        "overridden __getitem__": OwnGetitem(folder, transform=simple()),
        "own loader": datasets.ImageFolder(folder, transform=simple(), loader=_pil_rgb),
        "subclassed op": datasets.ImageFolder(folder, transform=v1.Compose(
            [MyCrop(64), v1.ToTensor()])),
        "nearest": datasets.ImageFolder(folder, transform=v1.Compose(
            [v1.RandomResizedCrop(64, interpolation=v1.InterpolationMode.NEAREST),
             v1.ToTensor()])),
        "switched off": datasets.ImageFolder(folder, transform=simple()),
    }


@pytest.mark.parametrize("case", ["overridden __getitem__", "own loader", "subclassed op",
                                  "nearest", "switched off"])
def test_what_cannot_be_read_runs_as_it_is(folder, case):
    ds = _as_is_cases(folder)[case]
    imgutil.assert_runs_as_torchvision(ds, accelerate=case != "switched off")


def test_target_transform_and_pooled_imagefolder(folder):
    ds = datasets.ImageFolder(folder, transform=v1.Compose([v1.CenterCrop(64), v1.PILToTensor()]),
                              target_transform=lambda t: t * 10)
    fused = translate(ds)
    for i in range(len(ds)):
        image, label = fused[i]
        assert label == ds.targets[i] * 10
        if i != len(ds) - 1 or "warned" not in ds.samples[i][0]:
            assert torch.equal(image, ds[i][0])  # a 1:1 crop is exact
    pooled = PooledFolder(folder, transform=v2.Compose([v2.CenterCrop(64), v2.PILToTensor()]))
    fused = translate(pooled)
    for i in range(len(pooled)):  # the JPEG only Pillow opens too, the way torchvision opens it
        image, label = fused[i]
        assert torch.equal(image, ds[i][0]) and label == pooled.targets[i]
    assert fused.fallbacks == 1


def test_a_center_crop_larger_than_the_image_is_left_to_torchvision(folder):
    ds = datasets.ImageFolder(folder, transform=v1.Compose([
        v1.RandomHorizontalFlip(), v1.CenterCrop(400), v1.PILToTensor()]))
    fused = translate(ds)
    smaller = 0
    for i in range(len(ds)):
        with Image.open(ds.samples[i][0]) as im:
            smaller += min(im.size) < 400
        torch.manual_seed(i)
        want, after_want = ds[i][0], torch.rand(1)
        torch.manual_seed(i)
        got, after_got = fused[i][0], torch.rand(1)
        assert torch.equal(got, want)
        assert torch.equal(after_got, after_want)  # the draws after it are torchvision's too
    assert 0 < smaller < len(ds) and fused.fallbacks == smaller


def test_a_transform_changed_between_epochs_is_read_again(folder, caplog):
    ds = datasets.ImageFolder(folder, transform=v1.Compose([v1.CenterCrop(32), v1.PILToTensor()]))
    loader = PooledLoader(ds, batch_size=3, num_workers=2)
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        assert next(iter(loader))[0].shape[-1] == 32
        assert next(iter(loader))[0].shape[-1] == 32  # the same plan: not logged again
        ds.transform = v1.Compose([v1.CenterCrop(48), v1.PILToTensor()])
        assert next(iter(loader))[0].shape[-1] == 48
    lines = [r.getMessage() for r in caplog.records if "torchvision transform" in r.getMessage()]
    assert len(lines) == 2 and "CenterCrop(size=(48, 48))" in lines[1]


@pytest.mark.timeout(60)
def test_a_fifo_named_like_an_image_is_refused_not_waited_on(tmp_path):
    from pooled_loader.core.errors import SampleError
    imgutil.write(str(tmp_path / "a" / "ok.jpg"), imgutil.jpeg("astronaut", (64, 64)))
    os.mkfifo(tmp_path / "a" / "x.jpg")
    transform = v1.Compose([v1.CenterCrop(32), v1.PILToTensor()])
    fused = translate(datasets.ImageFolder(str(tmp_path), transform=transform))
    index = [p for p, _ in fused.dataset.samples].index(str(tmp_path / "a" / "x.jpg"))
    with pytest.raises(OSError, match="image file is a FIFO, not a regular file.*x.jpg"):
        fused[index]
    pooled = PooledFolder(str(tmp_path), transform=v2.Compose([v2.CenterCrop(32)]))
    with pytest.raises(SampleError, match="x.jpg.*not a regular file"):
        pooled.getitem_into(index, (np.empty((32, 32, 3), np.uint8), None))
