"""The recipes people train with, unchanged, under PooledLoader (issue 47): a Compose inside a
wrapper class (torchvision's reference ``ClassificationPresetTrain`` shape), the AutoAugment
family and RandomErasing fused, MixUp/CutMix in the collate_fn applied in the slot; through 2
worker processes, against DataLoader from the same seed: the same types and shapes, the same
targets (soft targets bit for bit), the same draws (pixels within the ops' tolerance)."""
import functools
import logging

import pytest

torchvision = pytest.importorskip("torchvision")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.transforms import InterpolationMode  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import imgutil  # noqa: E402
from reference_mix import RandomCutMix, RandomMixUp  # noqa: E402
from pooled_loader import PooledLoader  # noqa: E402
from pooled_loader.vision.torchvision import plan as tp  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BILINEAR = InterpolationMode.BILINEAR


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Odd sizes, a grey JPEG and a CMYK one (torchvision's loader converts both to RGB)."""
    root = str(tmp_path_factory.mktemp("recipes"))
    w = imgutil.write
    sizes = [(321, 257), (257, 385), (500, 375), (224, 224), (640, 427), (300, 301)]
    for k, size in enumerate(sizes * 2):
        w(f"{root}/c{k % 3}/{k:02d}.jpg", imgutil.jpeg(imgutil.PHOTOS[k % 3], size))
    w(f"{root}/c0/grey.jpg", imgutil.jpeg("coffee", (333, 250), mode="L"))
    w(f"{root}/c1/cmyk.jpg", imgutil.jpeg("chelsea", (280, 260), mode="CMYK"))
    return root


class Preset:
    """The reference recipe's shape: a class whose ``__call__`` applies ``self.transforms``
    (the op list of torchvision's ``ClassificationPresetTrain``)."""

    def __init__(self, auto_augment=None, random_erase=0.0, backend="pil", use_v2=False,
                 crop=64):
        T = v2 if use_v2 else v1
        ops = [T.PILToTensor()] if backend == "tensor" else []
        ops += [T.RandomResizedCrop(crop, interpolation=BILINEAR, antialias=True),
                T.RandomHorizontalFlip(0.5)]
        if auto_augment == "ra":
            ops.append(T.RandAugment(interpolation=BILINEAR, magnitude=9))
        elif auto_augment == "ta_wide":
            ops.append(T.TrivialAugmentWide(interpolation=BILINEAR))
        elif auto_augment == "augmix":
            ops.append(T.AugMix(interpolation=BILINEAR, severity=3))
        elif auto_augment:
            ops.append(T.AutoAugment(T.AutoAugmentPolicy(auto_augment), interpolation=BILINEAR))
        if backend == "pil":
            ops.append(T.PILToTensor())
        ops += [T.ToDtype(torch.float, scale=True) if use_v2 else T.ConvertImageDtype(torch.float),
                T.Normalize(MEAN, STD)]
        if random_erase > 0:
            ops.append(T.RandomErasing(p=random_erase))
        if use_v2:
            ops.append(T.ToPureTensor())
        self.transforms = T.Compose(ops)

    def __call__(self, img):
        return self.transforms(img)


class Talkative(Preset):
    def __call__(self, img):
        out = self.transforms(img)
        return out


class ModulePreset(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pipeline = v2.Compose([v2.RandomResizedCrop(64), v2.PILToTensor()])

    def forward(self, img):
        return self.pipeline(img)


def _levels(x):
    """A normalized float image back in 0..255 levels."""
    mean = torch.tensor(MEAN).view(-1, 3, 1, 1)
    std = torch.tensor(STD).view(-1, 3, 1, 1)
    return (x * std + mean) * 255


def _pair(ds, collate_fn=None, seed=7, **kw):
    kw = dict(batch_size=4, num_workers=2, shuffle=True, drop_last=True, **kw)
    if collate_fn is not None:
        kw["collate_fn"] = collate_fn
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(seed), **kw))
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(seed), **kw)
    return want, list(loader), loader


def _line(caplog):
    lines = [r.getMessage() for r in caplog.records if "torchvision transform" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


# -- reading through wrappers ---------------------------------------------------------------------

def test_a_wrapped_compose_is_read_and_a_wrapper_that_does_more_says_why(folder, caplog):
    assert tp.read_compose(Preset())[0] is not None
    assert tp.read_compose(ModulePreset())[0] is not None
    ops, why = tp.read_compose(Talkative())
    assert ops is None and why == "Talkative.__call__ does more than apply self.transforms"
    for t in (lambda img: img, functools.partial(Preset.__call__, Preset())):
        assert tp.read_compose(t)[0] is None and "not a torchvision Compose" in tp.read_compose(t)[1]
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        loader = PooledLoader(datasets.ImageFolder(folder, Talkative()), batch_size=2)
        next(iter(loader))
    assert "runs as it is (Talkative.__call__ does more than apply self.transforms)" in \
        _line(caplog)


def test_the_reference_default_preset_is_fused_whole(folder, caplog):
    ds = datasets.ImageFolder(folder, Preset())
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, loader = _pair(ds)
    assert "as is []" in _line(caplog)
    assert loader.stats()["transforms"]["as_is"] == []
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is type(xa) and xb.shape == xa.shape and torch.equal(ya, yb)
        assert (_levels(xa) - _levels(xb)).abs().max() <= 1.01


# -- the AutoAugment family, RandomErasing ---------------------------------------------------------

RECIPES = [("ta_wide", "pil", False), ("ta_wide", "tensor", True), ("ra", "pil", False),
           ("ra", "pil", True), ("imagenet", "pil", False), ("cifar10", "tensor", True),
           ("svhn", "pil", True), ("augmix", "pil", False), ("augmix", "tensor", True)]


@pytest.mark.parametrize("policy,backend,use_v2", RECIPES)
def test_every_auto_augment_choice_gives_dataloaders_draws(folder, policy, backend, use_v2,
                                                           caplog):
    ds = datasets.ImageFolder(folder, Preset(policy, random_erase=0.5, backend=backend,
                                             use_v2=use_v2))
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, loader = _pair(ds)
    assert "as is []" in _line(caplog), _line(caplog)
    assert len(got) == len(want)
    means = []
    for (xa, ya), (xb, yb) in zip(want, got):
        assert type(xb) is type(xa) and xb.shape == xa.shape and xb.dtype == xa.dtype
        assert torch.equal(ya, yb)
        erased_a, erased_b = (xa == 0).all(1), (xb == 0).all(1)  # value 0 in every channel
        assert torch.equal(erased_a, erased_b)  # the same boxes erased
        # The crop's pixels are within a level of torchvision's; Equalize, AutoContrast,
        # Posterize and Solarize turn some 1-level differences into steps of many levels
        # (docs/vision.md: a sample's mean up to ~5 levels, the median sample's ~0.1). Another
        # op or magnitude drawn moves a sample's mean by tens of levels.
        means += [float(d.mean()) for d in (_levels(xa) - _levels(xb)).abs()]
    assert max(means) <= 6.0 and float(np.median(means)) <= 0.5, means


def _recorded(monkeypatch, version):
    """A list that torchvision's AutoAugment-family ops append (name, magnitude) to as they
    apply an op, in this process."""
    calls = []
    if version == "v1":
        import torchvision.transforms.autoaugment as aa_v1
        real = aa_v1._apply_op

        def spy(img, name, magnitude, interpolation, fill):
            calls.append((name, float(magnitude)))
            return real(img, name, magnitude, interpolation, fill)
        monkeypatch.setattr(aa_v1, "_apply_op", spy)
    else:
        from torchvision.transforms.v2._auto_augment import _AutoAugmentBase
        real2 = _AutoAugmentBase._apply_image_or_video_transform

        def spy2(self, image, name, magnitude, interpolation, fill):
            calls.append((name, float(magnitude)))
            return real2(self, image, name, magnitude, interpolation, fill)
        monkeypatch.setattr(_AutoAugmentBase, "_apply_image_or_video_transform", spy2)
    return calls


@pytest.mark.parametrize("policy,backend,use_v2", RECIPES)
def test_the_ops_and_magnitudes_applied_are_dataloaders_sample_for_sample(
        folder, policy, backend, use_v2, monkeypatch):
    from pooled_loader.vision.torchvision import augment_draws
    ds = datasets.ImageFolder(folder, Preset(policy, backend=backend, use_v2=use_v2))
    kw = dict(batch_size=4, num_workers=0, shuffle=True)
    calls = _recorded(monkeypatch, "v2" if use_v2 else "v1")
    torch.manual_seed(0)  # in process, the samples draw from the global RNG
    for _ in DataLoader(ds, generator=torch.Generator().manual_seed(11), **kw):
        pass
    want = list(calls)
    drawn = []
    for name in ("draw_auto_augment", "draw_augmix"):
        real = getattr(augment_draws, name)

        def spy(*a, _real=real, **k):
            out = _real(*a, **k)
            drawn.extend(out if _real.__name__ == "draw_auto_augment"
                         else [op for _, ops in out[1] for op in ops])
            return out
        monkeypatch.setattr(augment_draws, name, spy)
    calls.clear()
    torch.manual_seed(0)
    for _ in PooledLoader(ds, generator=torch.Generator().manual_seed(11), **kw):
        pass
    assert calls == []  # nothing ran as torchvision's op
    assert len(want) >= len(ds) and drawn == want


def test_random_erasing_random_values_are_the_ops_own(folder):
    ds = datasets.ImageFolder(folder, v2.Compose([
        v2.RandomResizedCrop(48), v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
        v2.RandomErasing(p=1.0, value="random")]))
    want, got, _ = _pair(ds)
    for (xa, _), (xb, _) in zip(want, got):
        same = (xa == xb)
        noise_a = ~same  # where the crops differ by a level, or the erased region
        assert same.float().mean() >= 0.3  # the erased normal values are bit for bit the op's
        assert (xa - xb).abs()[noise_a].max() <= 1.01 / 255 + 1e-6


# -- MixUp / CutMix -------------------------------------------------------------------------------

def _mixes(kind):
    n = 3
    if kind == "v2":
        return v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=n),
                                v2.CutMix(alpha=1.0, num_classes=n)])
    if kind == "reference":
        return v1.RandomChoice([RandomMixUp(n, p=1.0, alpha=0.2), RandomCutMix(n, p=1.0)])
    return v2.CutMix(alpha=1.0, num_classes=n) if kind == "cutmix" else \
        v2.MixUp(alpha=0.2, num_classes=n)


def _closure_collate(mix):
    def collate_fn(batch):
        return mix(*default_collate(batch))
    return collate_fn


@pytest.mark.parametrize("kind", ["v2", "reference", "cutmix", "mixup"])
def test_mixup_cutmix_in_the_collate_fn_run_in_the_slot(folder, kind, caplog):
    use_v2 = kind != "reference"
    ds = datasets.ImageFolder(folder, Preset("ta_wide", random_erase=0.1, use_v2=use_v2))
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, loader = _pair(ds, collate_fn=_closure_collate(_mixes(kind)), seed=3)
    assert "in the slot: collate_fn's" in _line(caplog), _line(caplog)
    assert len(got) == len(want)
    for a, b in zip(want, got):
        assert type(b) is type(a) is tuple and len(b) == 2
        (xa, ya), (xb, yb) = a, b
        assert xb.shape == xa.shape and yb.shape == ya.shape and yb.dtype == ya.dtype
        assert torch.equal(ya, yb)  # the same draws: the same soft targets, bit for bit
        d = (xa - xb).abs()
        assert d.mean() <= 0.03 and (d > 0.05).float().mean() <= 0.05


def test_a_collate_fn_that_is_not_just_the_mix_runs_as_is(folder, caplog):
    mix = _mixes("v2")

    def collate_fn(batch):
        images, labels = default_collate(batch)
        return mix(images, labels)

    ds = datasets.ImageFolder(folder, Preset(use_v2=True))
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, _ = _pair(ds, collate_fn=collate_fn)
    assert "in the slot" not in _line(caplog)
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(ya, yb)


# -- timm -----------------------------------------------------------------------------------------

def test_timms_rand_augment_recipe_gives_dataloaders_draws(folder, caplog):
    timm_data = pytest.importorskip("timm.data")
    transform = timm_data.create_transform(64, is_training=True,
                                           auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    ds = datasets.ImageFolder(folder, transform)
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, _ = _pair(ds, seed=1)
    assert "as is []" in _line(caplog), _line(caplog)
    means = []
    for (xa, ya), (xb, yb) in zip(want, got):
        assert xb.shape == xa.shape and xb.dtype == xa.dtype and torch.equal(ya, yb)
        assert torch.equal((xa == 0).all(1), (xb == 0).all(1))  # the same boxes erased
        means += [float(d.mean()) for d in (_levels(xa) - _levels(xb)).abs()]
    assert max(means) <= 6.0 and float(np.median(means)) <= 0.5, means


def test_timms_posterize_to_zero_bits_fails_as_it_does_under_dataloader(folder):
    """timm's PosterizeIncreasing at magnitude 10 keeps 0 bits, which this Pillow refuses:
    the sample fails under PooledLoader as under DataLoader, with Pillow's words."""
    timm_aa = pytest.importorskip("timm.data.auto_augment")
    import timm.data.transforms  # noqa: F401 - the crop's class in the op table
    op = timm_aa.RandAugment([timm_aa.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)],
                             num_layers=1)
    ds = datasets.ImageFolder(folder, v1.Compose([v1.RandomResizedCrop(32), op, v1.ToTensor()]))
    from PIL import Image, ImageOps
    try:
        ImageOps.posterize(Image.new("RGB", (1, 1)), 0)
    except ValueError as e:
        words = str(e)
    else:
        pytest.skip("this Pillow posterizes to 0 bits")
    with pytest.raises(ValueError, match=words):
        next(iter(DataLoader(ds, batch_size=2, num_workers=2)))
    with pytest.raises(ValueError, match=words):
        next(iter(PooledLoader(ds, batch_size=2, num_workers=2)))


def test_the_mix_in_process_and_with_a_callable_object_collate(folder):
    """num_workers=0 mixes in the main process as DataLoader's collate does; a collate object
    whose ``__call__`` is ``return self.mix(*default_collate(batch))`` is read too."""
    class Collate:
        def __init__(self, mix):
            self.mix = mix

        def __call__(self, batch):
            return self.mix(*default_collate(batch))

    ds = datasets.ImageFolder(folder, Preset(use_v2=True))
    kw = dict(batch_size=4, num_workers=0, shuffle=True, drop_last=True,
              collate_fn=Collate(_mixes("v2")))
    torch.manual_seed(2)
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(4), **kw))
    torch.manual_seed(2)
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(4), **kw)
    got = list(loader)
    assert loader._fused is not None and loader._fused.mix is not None
    for (xa, ya), (xb, yb) in zip(want, got):
        assert torch.equal(ya, yb) and (xa - xb).abs().mean() <= 0.03
