"""AutoAugment-family kernels (pooled_loader/vision/ops/autoaugment.py) against torchvision's
own ``_apply_op`` (PIL images, v1 tensors), v2's op mapping, AugMix and timm's op functions,
on real JPEGs: odd and square sizes, a grey JPEG and a CMYK JPEG converted to RGB as
torchvision's ``pil_loader`` does. Tolerances are the measured ones (see the module docstring).
"""
from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("cv2")
from PIL import Image, ImageDraw, ImageFilter  # noqa: E402
from torchvision.transforms import InterpolationMode, v2  # noqa: E402
from torchvision.transforms import autoaugment as tv_aa  # noqa: E402

from pooled_loader.vision.io.buffers import Scratch  # noqa: E402
from pooled_loader.vision.ops import autoaugment as aa  # noqa: E402

GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
MAGNITUDES = {
    "Identity": [0.0],
    "ShearX": [-0.99, -0.3, 0.0, 0.17, 0.99],  # TrivialAugmentWide's extremes
    "TranslateX": [-32.0, -5.7, 0.0, 14.0, 32.0],
    "Rotate": [-135.0, -30.0, 0.0, 4.5, 90.0, 180.0, 270.0, 135.0],
    "Brightness": [-0.99, -0.5, 0.0, 0.3, 0.99],
    "Sharpness": [-0.99, -0.4, 0.0, 0.5, 0.99],
    "Posterize": [0.0, 2.0, 4.0, 5.0, 8.0],
    "Solarize": [0.0, 8.5, 127.5, 128.0, 255.0],
    "AutoContrast": [0.0], "Equalize": [0.0], "Invert": [0.0],
}
MAGNITUDES["ShearY"] = MAGNITUDES["ShearX"]
MAGNITUDES["TranslateY"] = MAGNITUDES["TranslateX"]
MAGNITUDES["Color"] = MAGNITUDES["Contrast"] = MAGNITUDES["Brightness"]
FILL = [100.0, 150.4, 200.6]


def _natural(w: int, h: int, seed: int) -> Image.Image:
    """Gradients, noise and filled shapes, slightly blurred: JPEG-friendly, not flat."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([x / w * 200 + 20, y / h * 180 + 30, (x + y) / (w + h) * 150 + 60], -1)
    base += rng.normal(0, 12, base.shape)
    im = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(8):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = [x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))]
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return im.filter(ImageFilter.GaussianBlur(0.7))


def _jpeg(im: Image.Image) -> Image.Image:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    buf.seek(0)
    return Image.open(buf).convert("RGB")  # torchvision's pil_loader


@pytest.fixture(scope="module")
def images() -> dict[str, Image.Image]:
    return {"223x171": _jpeg(_natural(223, 171, 1)), "224x224": _jpeg(_natural(224, 224, 2)),
            "grey": _jpeg(_natural(160, 199, 3).convert("L")),
            "cmyk": _jpeg(_natural(201, 150, 4).convert("CMYK"))}


def _chw(pil: Image.Image) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(pil).transpose(2, 0, 1))


def _ref_pil(pil, name, magnitude, interpolation, fill):
    return _chw(tv_aa._apply_op(pil, name, magnitude, InterpolationMode(interpolation), fill))


def _ref_v1(pil, name, magnitude, interpolation, fill):
    t = torch.from_numpy(_chw(pil))
    return tv_aa._apply_op(t, name, magnitude, InterpolationMode(interpolation), fill).numpy()


def _ref_v2(pil, name, magnitude, interpolation, fill):
    op = v2.RandAugment(fill=fill)
    if name == "Solarize":  # v2's magnitude is a fraction of 255; ours is v1's threshold
        magnitude = magnitude / 255.0
    return op._apply_image_or_video_transform(torch.from_numpy(_chw(pil)), name, magnitude,
                                              InterpolationMode(interpolation), op._fill).numpy()


def _ours(pil, name, magnitude, arithmetic, interpolation="nearest", fill=None, scratch=None):
    img = _chw(pil)
    aa.apply_op(img, name, magnitude, interpolation=interpolation, fill=fill,
                arithmetic=arithmetic, scratch=scratch or Scratch())
    return img


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, int, float]:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return float(d.mean()), int(d.max()), float((d > 0).mean())


# ---------------------------------------------------------------- colour and table ops

@pytest.mark.parametrize("name", [n for n in MAGNITUDES if n not in GEOMETRIC])
def test_colour_ops_bit_exact(images, name):
    """Pillow and v2 results exactly; v1's tensor arithmetic (no FMA, other blend order) <= 1."""
    scratch = Scratch()
    for pil in images.values():
        for magnitude in MAGNITUDES[name]:
            if not (name == "Posterize" and magnitude == 0):  # Pillow >= 10 refuses 0 bits
                ours = _ours(pil, name, magnitude, "pil", scratch=scratch)
                ref = _ref_pil(pil, name, magnitude, "nearest", None)
                np.testing.assert_array_equal(ours, ref, err_msg=f"{name} {magnitude} pil")
            ours = _ours(pil, name, magnitude, "tensor", scratch=scratch)
            np.testing.assert_array_equal(ours, _ref_v2(pil, name, magnitude, "nearest", None),
                                          err_msg=f"{name} {magnitude} tensor v2")
            mean, worst, frac = _diff(ours, _ref_v1(pil, name, magnitude, "nearest", None))
            assert worst <= 1 and frac < 0.1, (name, magnitude, mean, worst, frac)


# ---------------------------------------------------------------- geometric ops

@pytest.mark.parametrize("fill", [None, [0.0, 0.0, 0.0], FILL], ids=["none", "zeros", "fill"])
@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("name", GEOMETRIC)
def test_geometric_ops(images, name, interpolation, fill):
    """Nearest: exact (Pillow's 16.16 fixed point and v2's float32 grid reproduced).
    Bilinear: +-1 at most; Pillow on <= 0.2% of pixels, tensors (v1 and v2) on <= 5%."""
    scratch = Scratch()
    for key, pil in images.items():
        for magnitude in MAGNITUDES[name]:
            what = f"{name} {magnitude} {interpolation} fill={fill} {key}"
            ours = _ours(pil, name, magnitude, "pil", interpolation, fill, scratch)
            ref = _ref_pil(pil, name, magnitude, interpolation, fill)
            mean, worst, frac = _diff(ours, ref)
            if interpolation == "nearest":
                assert worst == 0, (what, "pil", mean, worst, frac)
            else:
                assert worst <= 1 and frac <= 0.002, (what, "pil", mean, worst, frac)
            ours = _ours(pil, name, magnitude, "tensor", interpolation, fill, scratch)
            for ref_fn in (_ref_v2, _ref_v1):
                if ref_fn is _ref_v1 and name == "Rotate" and magnitude % 90 == 0 and \
                        magnitude % 360 and interpolation == "bilinear":
                    continue  # v1 has no quarter-turn fast path: grid_sample's own +-1 there
                ref = ref_fn(pil, name, magnitude, interpolation, fill)
                mean, worst, frac = _diff(ours, ref)
                if interpolation == "nearest":
                    assert worst == 0, (what, ref_fn.__name__, mean, worst, frac)
                else:
                    assert worst <= 1 and frac <= 0.05, (what, ref_fn.__name__, mean, worst, frac)


def test_bicubic_needs_pil_and_bad_arguments_raise(images):
    pil = images["224x224"]
    ours = _ours(pil, "Rotate", 17.0, "pil", "bicubic")
    mean, worst, frac = _diff(ours, _ref_pil(pil, "Rotate", 17.0, "bicubic", None))
    assert mean < 1.0, (mean, worst, frac)  # OpenCV's cubic (a=-0.75) vs Pillow's (a=-1)
    with pytest.raises(ValueError, match="bicubic"):
        _ours(pil, "Rotate", 17.0, "tensor", "bicubic")
    with pytest.raises(ValueError, match="arithmetic"):
        _ours(pil, "Invert", 0.0, "numpy")
    with pytest.raises(ValueError, match="unknown op"):
        _ours(pil, "Blur", 0.0, "pil")
    assert aa.OPS == set(MAGNITUDES)


# ---------------------------------------------------------------- AugMix

def _augmix_draws(transform, image, seed, v2_api):
    """Run torchvision's AugMix with a spy on its op calls: its result and the draws it made
    (m0, per chain its weight and (op, magnitude) list)."""
    calls = []
    if v2_api:
        cls = type(transform)
        real = cls._apply_image_or_video_transform

        def spy(self, img, op, magnitude, interpolation, fill):
            calls.append((img.data_ptr() == image.data_ptr(), op,
                          magnitude * 255.0 if op == "Solarize" else magnitude))
            return real(self, img, op, magnitude, interpolation, fill)
        patch = (cls, "_apply_image_or_video_transform", spy)
    else:
        real = tv_aa._apply_op

        def spy(img, op, magnitude, interpolation, fill):
            calls.append((img.data_ptr() == image.data_ptr(), op, magnitude))
            return real(img, op, magnitude, interpolation, fill)
        patch = (tv_aa, "_apply_op", spy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(*patch)
        torch.manual_seed(seed)
        result = transform(image).numpy()
    torch.manual_seed(seed)  # the two Dirichlet draws come first, as forward makes them
    alpha = transform.alpha
    m = transform._sample_dirichlet(torch.tensor([[alpha, alpha]]))
    weights = transform._sample_dirichlet(torch.tensor([[alpha] * transform.mixture_width]))
    weights = weights * m[:, 1].view(1, -1)
    chains = []
    for first, op, magnitude in calls:  # a chain starts from the original image
        if first:
            chains.append((float(weights[0, len(chains)]), []))
        chains[-1][1].append((op, magnitude))
    return result, float(m[0, 0]), chains


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear"])
@pytest.mark.parametrize("v2_api", [True, False], ids=["v2", "v1"])
def test_augmix_mix(images, v2_api, interpolation):
    """Same draws: v2 nearest exact; bilinear chains +-1 on <= 2% of pixels (the geometric
    ops' +-1, weighted); v1 also +-1 (its own blend order)."""
    scratch = Scratch()
    cls = v2.AugMix if v2_api else tv_aa.AugMix
    transform = cls(interpolation=InterpolationMode(interpolation), all_ops=True)
    for seed, pil in enumerate(list(images.values()) * 2):
        image = torch.from_numpy(_chw(pil))
        ref, m0, chains = _augmix_draws(transform, image, seed, v2_api)
        ours = _chw(pil)
        aa.augmix_mix(ours, m0, chains, interpolation=interpolation, fill=None, scratch=scratch)
        mean, worst, frac = _diff(ours, ref)
        if v2_api and interpolation == "nearest":
            assert worst == 0, (seed, chains, mean, worst, frac)
        else:
            assert worst <= 1 and frac <= 0.02, (seed, chains, mean, worst, frac)


# ---------------------------------------------------------------- timm

TIMM_LEVELS = {  # what timm's level functions return over 0..10 (signs included)
    "AutoContrast": [()], "Equalize": [()], "Invert": [()],
    "Rotate": [(-30.0,), (-2.7,), (0.0,), (13.5,), (90.0,), (30.0,)],
    "PosterizeIncreasing": [(1,), (2,), (4,)], "PosterizeOriginal": [(4,), (6,), (8,)],
    "SolarizeIncreasing": [(0,), (26,), (128,), (256,)], "SolarizeAdd": [(0,), (49,), (110,)],
    "ColorIncreasing": [(0.1,), (0.19,), (1.0,), (1.81,), (1.9,)],
    "ContrastIncreasing": [(0.1,), (0.55,), (1.0,), (1.9,)],
    "BrightnessIncreasing": [(0.1,), (0.55,), (1.0,), (1.9,)],
    "SharpnessIncreasing": [(0.1,), (0.55,), (1.0,), (1.9,)],
    "ShearX": [(-0.3,), (-0.09,), (0.0,), (0.27,)], "ShearY": [(-0.3,), (0.27,)],
    "TranslateXRel": [(-0.45,), (-0.1,), (0.0,), (0.405,)], "TranslateYRel": [(-0.45,), (0.2,)],
    "TranslateX": [(-250.0,), (37.5,)], "Desaturate": [(0.5,), (0.9,)],
}


@pytest.mark.parametrize("name", sorted(TIMM_LEVELS))
def test_timm_ops(images, name):
    """Against timm's own op functions (Pillow): colour and table ops exact; bilinear +-1 on
    <= 0.2% of pixels, <= 5% for fractional translations (TranslateXRel/YRel: OpenCV's float32
    weights against Pillow's doubles, then truncated); bicubic (OpenCV a=-0.75 vs Pillow a=-1):
    mean <= 0.5."""
    timm_aa = pytest.importorskip("timm.data.auto_augment")
    scratch = Scratch()
    geometric = name.startswith(("Rotate", "Shear", "Translate"))
    for pil in images.values():
        for args in TIMM_LEVELS[name]:
            for resample in (("bilinear", "bicubic") if geometric else ("bilinear",)):
                fill = (124, 116, 104)
                kwargs = {"fillcolor": fill, "resample": {"bilinear": Image.BILINEAR,
                                                          "bicubic": Image.BICUBIC}[resample]}
                ref = _chw(timm_aa.NAME_TO_OP[name](pil, *args, **kwargs))
                ours = _chw(pil)
                aa.apply_timm_op(ours, name, args, resample=resample, fill=fill, scratch=scratch)
                mean, worst, frac = _diff(ours, ref)
                what = (name, args, resample, mean, worst, frac)
                if not geometric:
                    assert worst == 0, what
                elif resample == "bilinear":
                    assert worst <= 1 and frac <= (0.05 if "Rel" in name else 0.002), what
                else:
                    assert mean <= 0.5, what
    assert set(TIMM_LEVELS) <= aa.TIMM_OPS


def test_timm_rand_increasing_ops_all_map():
    timm_aa = pytest.importorskip("timm.data.auto_augment")
    assert set(timm_aa._RAND_INCREASING_TRANSFORMS) <= aa.TIMM_OPS
    assert set(timm_aa._RAND_TRANSFORMS) <= aa.TIMM_OPS


# ---------------------------------------------------------------- steady state

def test_steady_state_allocates_nothing(images):
    """After one round over every op, further rounds add no Scratch allocation, and a row of a
    larger batch (a view) is written in place."""
    scratch = Scratch()
    batch = np.zeros((2, 3, 224, 224), np.uint8)

    def one_round():
        for name, mags in MAGNITUDES.items():
            for arithmetic in ("pil", "tensor"):
                for interpolation in ("nearest", "bilinear"):
                    batch[1] = _chw(images["224x224"])
                    aa.apply_op(batch[1], name, mags[-1], interpolation=interpolation, fill=FILL,
                                arithmetic=arithmetic, scratch=scratch)
        aa.augmix_mix(batch[1], 0.4, [(0.3, [("Rotate", 10.0), ("Equalize", 0.0)]),
                                      (0.3, [("Color", 0.5)])],
                      interpolation="bilinear", fill=None, scratch=scratch)
        aa.apply_timm_op(batch[1], "TranslateXRel", (0.2,), resample="bicubic",
                         fill=(124, 116, 104), scratch=scratch)

    one_round()
    before = scratch.allocations
    assert before > 0
    for _ in range(2):
        one_round()
    assert scratch.allocations == before
    assert not batch[0].any()  # the neighbouring row untouched
    ref = _ref_pil(images["224x224"], "Invert", 0.0, "nearest", None)
    batch[1] = _chw(images["224x224"])
    aa.apply_op(batch[1], "Invert", 0.0, interpolation="nearest", fill=None, arithmetic="pil",
                scratch=scratch)
    np.testing.assert_array_equal(batch[1], ref)
