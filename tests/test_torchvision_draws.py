"""The fused torchvision path's cheaper draws, jitter chain and slot writes give what the ops
themselves give (issue 37): same numbers from the same RNG state, same RNG state after, same
bytes, and the slot row handed back as it is."""
import random

import pytest

torchvision = pytest.importorskip("torchvision")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageEnhance  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

import imgutil  # noqa: E402
from pooled_loader.vision.torchvision import folder as torchvision_fused  # noqa: E402
from pooled_loader.vision.torchvision import plan as tp  # noqa: E402
from pooled_loader.vision.io.buffers import Scratch  # noqa: E402
from pooled_loader.vision.ops.jitter import jitter_into  # noqa: E402
from pooled_loader.vision.io.kernels import ext_available  # noqa: E402

SIZES = [(375, 500), (500, 333), (17, 301), (300, 9), (1, 1), (2, 3), (224, 224)]


def _step(op, kind, version):
    """The plan's step for ``op`` alone (as the plan reads it: RandomResizedCrop's log ratio)."""
    step = tp.read_plan((v1 if version == "v1" else v2).Compose([op])).steps[0]
    assert (step.kind, step.version) == (kind, version)
    return step


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_resized_crop_boxes_and_rng_state_are_the_ops_own(version):
    mod = v1 if version == "v1" else v2
    draws = tp.Draws()
    for kw in ({}, {"scale": (0.5, 3.0), "ratio": (0.1, 9.0)}, {"scale": (0.9, 1.0)}):
        op = mod.RandomResizedCrop(32, **kw)
        step = _step(op, tp.RESIZED_CROP, version)
        for h, w in SIZES:
            for seed in range(40):
                img = torch.empty((3, h, w), dtype=torch.uint8)
                torch.manual_seed(seed)
                if version == "v1":
                    want = tuple(int(v) for v in op.get_params(img, op.scale, op.ratio))
                else:
                    p = op.make_params([img])
                    want = (p["top"], p["left"], p["height"], p["width"])
                state = torch.get_rng_state()
                torch.manual_seed(seed)
                assert draws.box(step, h, w) == want, (kw, h, w, seed)
                assert torch.equal(torch.get_rng_state(), state)


def test_flip_and_jitter_draws_and_rng_state_are_the_ops_own():
    draws = tp.Draws()
    jitters = [v1.ColorJitter(0.4, 0.4, 0.4), v2.ColorJitter(0.4, 0.4, 0.4),
               v1.ColorJitter(brightness=(0.2, 0.3), saturation=0.9),
               v2.ColorJitter(contrast=0.1)]
    for seed in range(60):
        for p in (0.5, 0.1, 0.9999):  # p rounds to float32 as torch compares it
            for mod in (v1, v2):
                op = mod.RandomHorizontalFlip(p)
                torch.manual_seed(seed)
                want = bool(torch.rand(1) < op.p)
                state = torch.get_rng_state()
                torch.manual_seed(seed)
                assert draws.flip(tp.Step(tp.FLIP, op, "v1")) == want
                assert torch.equal(torch.get_rng_state(), state)
        for op in jitters:
            version = "v2" if isinstance(op, v2.ColorJitter) else "v1"
            torch.manual_seed(seed)
            if version == "v1":
                fn_idx, *factors = op.get_params(op.brightness, op.contrast, op.saturation,
                                                 op.hue)
            else:
                p = op.make_params([])
                fn_idx, factors = p["fn_idx"], [p["brightness_factor"], p["contrast_factor"],
                                                p["saturation_factor"], p["hue_factor"]]
            state = torch.get_rng_state()
            torch.manual_seed(seed)
            order, got = draws.jitter(tp.Step(tp.JITTER, op, version))
            assert order == fn_idx.tolist() and list(got) == factors
            assert torch.equal(torch.get_rng_state(), state)


def test_timm_boxes_and_random_state_are_timms_own():
    timm_t = pytest.importorskip("timm.data.transforms")
    draws = tp.Draws()
    for kw in ({}, {"scale": (0.5, 3.0), "ratio": (0.1, 9.0)}):
        op = timm_t.RandomResizedCropAndInterpolation(32, **kw)
        step = tp.Step(tp.RESIZED_CROP, op, "timm")
        for h, w in SIZES:
            for seed in range(40):
                random.seed(seed)
                want = op.get_params(torch.empty((3, h, w)), op.scale, op.ratio)
                state = random.getstate()
                random.seed(seed)
                assert draws.box(step, h, w) == tuple(want)
                assert random.getstate() == state


def _pillow_chain(img, ops):
    im = Image.fromarray(img)
    for kind, factor in ops:
        im = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)[kind](im) \
            .enhance(factor)
    return np.asarray(im)


@pytest.mark.parametrize("compiled", [True, False])
def test_jitter_chain_is_pillow_op_after_op_then_the_float_values(compiled):
    if compiled and not ext_available():
        pytest.skip("the compiled kernels are not built")
    rng = np.random.default_rng(1)
    scratch = Scratch()
    for trial in range(80):
        h, w = rng.integers(1, 40, 2)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        if trial % 3 == 0:
            img = img // 50 * 50
        jitters = []
        for _ in range(1 + trial % 2):  # one or two ColorJitters
            factors = [None if rng.random() < 0.2 else float(rng.uniform(0, 2))
                       for _ in range(3)] + [None]
            jitters.append((list(rng.permutation(4)), tuple(factors)))
        ops = [(fn, f[fn]) for order, f in jitters for fn in order
               if fn < 3 and f[fn] is not None]
        want = _pillow_chain(img, ops)
        chw = np.ascontiguousarray(img.transpose(2, 0, 1))
        u8 = chw.copy()
        jitter_into(u8, jitters, scratch, compiled=compiled)
        assert np.array_equal(u8.transpose(1, 2, 0), want), (trial, ops)
        mul, add = rng.standard_normal(3).tolist(), rng.standard_normal(3).tolist()
        out = np.empty(chw.shape, np.float32)
        jitter_into(chw, jitters, scratch, out, mul, add, compiled=compiled)
        # numpy's float32 arithmetic, as the loader's conversion made it before the chain did
        expect = want.transpose(2, 0, 1) * np.float32(mul)[:, None, None] + \
            np.float32(add)[:, None, None]
        assert expect.dtype == np.float32 and np.array_equal(out, expect), (trial, ops)


def test_a_slot_row_written_in_place_is_returned_as_is(tmp_path):
    for i in range(3):
        imgutil.write(str(tmp_path / "a" / f"{i}.jpg"), imgutil.jpeg("astronaut", (90, 70)))
    ds = datasets.ImageFolder(str(tmp_path), transform=v2.Compose([
        v2.RandomResizedCrop(32), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]))
    fused = torchvision_fused.translate(ds)[0]
    row = np.empty((3, 32, 32), np.float32)
    image, label = fused.getitem_into(1, (row, None))
    assert image is row and label == 0  # the loader sees its own row and copies nothing
    torch.manual_seed(3)
    want = fused[1][0]
    torch.manual_seed(3)
    fused.getitem_into(1, (row, None))
    assert type(want) is torchvision.tv_tensors.Image and torch.equal(want, torch.from_numpy(row))


def test_jitter_chain_refuses_what_it_cannot_run():
    if not ext_available():
        pytest.skip("the compiled kernels are not built")
    from pooled_loader.vision.io.kernels import _kernels
    img = np.zeros((3, 4, 5), np.uint8)
    for bad in ([(3, 1.0)], [(0,)], [(0, 1.0)] * 17, 5):
        with pytest.raises((ValueError, TypeError)):
            _kernels.enhance_chain(img, bad)
    with pytest.raises(ValueError, match="uint8"):
        _kernels.enhance_chain(np.zeros((4, 4, 5), np.uint8), [])
    for out in (np.zeros((3, 5, 4), np.float32), np.zeros((3, 4, 5), np.float64)):
        with pytest.raises(ValueError, match="out"):
            _kernels.enhance_chain(img, [], out, (1, 1, 1), (0, 0, 0))
    with pytest.raises(ValueError, match="mul"):
        _kernels.enhance_chain(img, [], np.zeros((3, 4, 5), np.float32), (1, 1), (0, 0, 0))
