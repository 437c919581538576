"""torchvision's uint8 recipe under PooledLoader (issue 37): ``ImageFolder(loader=decode_image)``
with v2 ops on uint8 tensors runs on the fused path with torchvision's draws, output types and
pixels; a hand-written read_file + decode_jpeg dataset runs as it is, through the slots."""
import functools
import io
import warnings

import pytest

torchvision = pytest.importorskip("torchvision")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from torchvision import datasets, tv_tensors  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.io import (ImageReadMode, decode_image, decode_jpeg, read_file,  # noqa: E402
                            read_image)
from torchvision.transforms import v2  # noqa: E402

import imgutil  # noqa: E402
from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.vision.torchvision import folder as torchvision_fused  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # decode_image is deprecated
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
RGB = functools.partial(decode_image, mode=ImageReadMode.RGB)


def _jpeg(name, size, **save):
    buf = io.BytesIO()
    Image.fromarray(imgutil.rgb(name, size)).save(buf, "JPEG", **save)
    return buf.getvalue()


def _exif_rotated(name, size):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: decode_image applies it only with apply_exif_orientation
    buf = io.BytesIO()
    Image.fromarray(imgutil.rgb(name, size)).save(buf, "JPEG", quality=88, exif=exif.tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """YCbCr JPEGs of odd sizes in every chroma sampling, progressive, EXIF-rotated: what the
    fused path decodes itself."""
    root = str(tmp_path_factory.mktemp("recipe_jpegs"))
    w = imgutil.write
    w(f"{root}/a/s444.jpg", _jpeg("astronaut", (321, 257), quality=90, subsampling=0))
    w(f"{root}/a/s422.jpg", _jpeg("chelsea", (257, 385), quality=80, subsampling=1))
    w(f"{root}/a/s420.jpg", _jpeg("coffee", (1201, 901), quality=85, subsampling=2))
    w(f"{root}/b/prog.jpg", _jpeg("astronaut", (403, 299), quality=90, progressive=True))
    w(f"{root}/b/exif.jpg", _exif_rotated("coffee", (345, 227)))
    w(f"{root}/b/small.jpg", _jpeg("chelsea", (131, 97), quality=75))
    return root


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The same, plus what decode_image converts its own way: grey, CMYK, PNGs."""
    root = str(tmp_path_factory.mktemp("recipe_mixed"))
    w = imgutil.write
    w(f"{root}/a/odd.jpg", _jpeg("astronaut", (321, 257), quality=90))
    w(f"{root}/a/grey.jpg", imgutil.jpeg("astronaut", (300, 333), mode="L"))
    w(f"{root}/a/big.jpg", _jpeg("coffee", (1201, 901), quality=85, subsampling=1))
    w(f"{root}/b/cmyk.jpg", imgutil.jpeg("chelsea", (299, 241), mode="CMYK"))
    w(f"{root}/b/rgba.png", imgutil.encode(imgutil.rgb("coffee", (233, 301)), "PNG", mode="RGBA"))
    w(f"{root}/b/exif.jpg", _exif_rotated("chelsea", (257, 300)))
    w(f"{root}/b/prog.jpg", _jpeg("astronaut", (403, 299), quality=90, progressive=True))
    return root


def translate(ds):
    return torchvision_fused.translate(ds)[0]


def _levels(x, normalized=False):
    x = x.as_subclass(torch.Tensor).double()
    if normalized:
        x = (x * torch.tensor(STD, dtype=torch.double)[:, None, None]
             + torch.tensor(MEAN, dtype=torch.double)[:, None, None]) * 255
    return x


@pytest.mark.parametrize("loader", [decode_image, read_image, RGB])
def test_a_one_to_one_crop_equals_decode_image_bit_for_bit(jpegs, loader):
    """The decoders agree exactly: a crop that is not resized (only the box decoded) is the same
    bytes as torchvision's decode, cropped; EXIF orientation is not applied, as decode_image
    does not apply it by default."""
    ds = datasets.ImageFolder(jpegs, loader=loader, transform=v2.Compose([
        v2.RandomHorizontalFlip(), v2.CenterCrop(96)]))
    fused = translate(ds)
    assert fused is not None and fused.describe()["output"] == "torch.Tensor"
    for i in range(len(ds)):
        for seed in range(2):
            torch.manual_seed(seed)
            want = ds[i]
            torch.manual_seed(seed)
            got = fused[i]
            assert type(got[0]) is torch.Tensor and got[0].dtype == torch.uint8
            assert torch.equal(got[0], want[0]) and got[1] == want[1], ds.samples[i][0]
    assert fused.fallbacks == 0


PIPELINES = {
    "crop flip": (lambda: v2.Compose([v2.RandomResizedCrop(96), v2.RandomHorizontalFlip()]),
                  False, torch.Tensor),
    "image crop flip": (lambda: v2.Compose([v2.ToImage(), v2.RandomResizedCrop(96, scale=(0.3, 1)),
                                            v2.RandomHorizontalFlip()]), False, tv_tensors.Image),
    "eval float": (lambda: v2.Compose([v2.Resize(110), v2.CenterCrop(96),
                                       v2.ToDtype(torch.float32, scale=True),
                                       v2.Normalize(MEAN, STD)]), True, torch.Tensor),
    "float pure": (lambda: v2.Compose([v2.RandomResizedCrop(96), v2.RandomHorizontalFlip(),
                                       v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                                       v2.Normalize(MEAN, STD), v2.ToPureTensor()]),
                   True, torch.Tensor),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pixels_types_and_draws_match_torchvision(jpegs, name):
    make, normalized, out_type = PIPELINES[name]
    ds = datasets.ImageFolder(jpegs, loader=decode_image, transform=make())
    fused = translate(ds)
    assert fused is not None and fused.describe()["as_is"] == []
    means = []
    for i in range(len(ds)):
        for seed in range(3):
            torch.manual_seed(seed)
            want = ds[i][0]
            after_want = torch.rand(1)
            torch.manual_seed(seed)
            got = fused[i][0]
            assert torch.equal(torch.rand(1), after_want)  # the same number of draws
            assert type(got) is type(want) is out_type
            assert got.dtype == want.dtype and got.shape == want.shape
            diff = (_levels(got, normalized) - _levels(want, normalized)).abs()
            assert diff.max() <= 1.01, (ds.samples[i][0], seed, diff.max())  # same box and flip
            border = torch.cat([diff[:, :2].flatten(), diff[:, -2:].flatten(),
                                diff[:, :, :2].flatten(), diff[:, :, -2:].flatten()])
            assert border.mean() <= max(0.3, 2 * diff.mean())  # the kernel reads only the box
            means.append(diff.mean().item())
    assert np.mean(means) <= 0.25
    assert fused.fallbacks == 0


@pytest.mark.parametrize("mode", ["UNCHANGED", "RGB"])
def test_grey_cmyk_and_png_are_decoded_by_torchvision(mixed, mode):
    """What decode_image converts its own way (a grey JPEG to 1 channel unchanged, CMYK, PNG)
    is made by the dataset's own __getitem__: the same tensor, the same draws after it."""
    loader = decode_image if mode == "UNCHANGED" else functools.partial(decode_image, mode=mode)
    ds = datasets.ImageFolder(mixed, loader=loader, transform=v2.Compose([
        v2.RandomResizedCrop(64), v2.RandomHorizontalFlip()]))
    fused = translate(ds)
    names = [p.rsplit("/", 1)[1] for p, _ in ds.samples]
    own = {"cmyk.jpg", "rgba.png"} | ({"grey.jpg"} if mode == "UNCHANGED" else set())
    for i in range(len(ds)):
        torch.manual_seed(i)
        want, after_want = ds[i][0], torch.rand(1)
        torch.manual_seed(i)
        before = fused.fallbacks
        got, after_got = fused[i][0], torch.rand(1)
        assert got.shape == want.shape and torch.equal(after_got, after_want)
        if names[i] in own:
            assert fused.fallbacks == before + 1 and torch.equal(got, want)
        else:  # fused; a grey JPEG in mode RGB too (libjpeg's grey-to-RGB, as torchvision's)
            assert fused.fallbacks == before
            assert (got.int() - want.int()).abs().max() <= 1
    assert fused.fallbacks == len(own)


def test_through_workers_same_seed_gives_dataloaders_batches_through_the_slots(mixed):
    ds = datasets.ImageFolder(mixed, loader=RGB, transform=v2.Compose([
        v2.RandomResizedCrop(80), v2.RandomHorizontalFlip(), v2.ToImage()]))
    kw = dict(batch_size=3, num_workers=2, shuffle=True)
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(3), **kw))
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(3), **kw)
    got = list(loader)
    assert len(got) == len(want) == 3
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is type(xa) and xb.dtype == torch.uint8  # what stack makes of Images
        assert xb.shape == xa.shape and torch.equal(ya, yb)
        diff = (xa.as_subclass(torch.Tensor).int() - xb.as_subclass(torch.Tensor).int()).abs()
        assert diff.flatten(1).max(1).values.max() <= 1  # every sample's box and flip
    stats = loader.stats()
    assert stats["transforms"]["as_is"] == [] and len(stats["transforms"]["fused"]) == 3
    assert stats["transforms"]["output"] == "tv_tensors.Image"
    assert stats["bytes_moved"] == len(ds) * (3 * 80 * 80 + 8)  # images and labels in slots


def _own_loader(path):
    return decode_image(path)


@pytest.mark.parametrize("case", ["lambda", "exif applied", "grey mode", "v1 resize",
                                  "switched off"])
def test_what_is_not_torchvisions_recipe_runs_as_it_is(jpegs, case):
    crop = v2.Compose([v2.RandomResizedCrop(48), v2.RandomHorizontalFlip()])
    ds = {
        "lambda": lambda: datasets.ImageFolder(jpegs, loader=_own_loader, transform=crop),
        "exif applied": lambda: datasets.ImageFolder(jpegs, transform=crop, loader=(
            functools.partial(decode_image, apply_exif_orientation=True))),
        "grey mode": lambda: datasets.ImageFolder(jpegs, transform=v2.Compose([
            v2.CenterCrop(48)]), loader=functools.partial(decode_image, mode=ImageReadMode.GRAY)),
        "v1 resize": lambda: datasets.ImageFolder(jpegs, loader=decode_image, transform=v1.Compose(
            [v1.RandomResizedCrop(48, antialias=True), v1.RandomHorizontalFlip()])),
        "switched off": lambda: datasets.ImageFolder(jpegs, loader=decode_image, transform=crop),
    }[case]()
    assert translate(ds) is None or case == "switched off"
    imgutil.assert_runs_as_torchvision(ds, accelerate=case != "switched off")


class DecodeJpegRecipe(Dataset):
    """The recipe written by hand: not recognisable, so it runs as it is."""

    def __init__(self, root):
        self.samples = datasets.ImageFolder(root).samples
        self.transform = v2.Compose([v2.RandomResizedCrop(64), v2.RandomHorizontalFlip()])

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        return self.transform(decode_jpeg(read_file(path), mode=ImageReadMode.RGB)), label


def test_the_hand_written_recipe_runs_as_it_is_through_the_slots(jpegs):
    ds = DecodeJpegRecipe(jpegs)
    kw = dict(batch_size=2, num_workers=2, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = list(DataLoader(ds, generator=torch.Generator().manual_seed(1), **kw))
        loader = PooledLoader(ds, generator=torch.Generator().manual_seed(1), **kw)
        got = list(loader)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is torch.Tensor and torch.equal(xa, xb) and torch.equal(ya, yb)
    stats = loader.stats()
    assert "transforms" not in stats
    assert stats["bytes_moved"] == len(ds) * (3 * 64 * 64 + 8)  # no batch went DataLoader's way
