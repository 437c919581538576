"""The draws of vision/torchvision/augment_draws.py and mix_draws.py against the real ops: seed,
run the op while recording what it applies, reseed, draw; the same values and the same RNG
states after (torch's, Python's, numpy's), over many seeds and odd sizes."""
import math
import random

import numpy as np
import pytest

torchvision = pytest.importorskip("torchvision")

import torch  # noqa: E402
from PIL import Image  # noqa: E402
from torchvision import transforms as v1  # noqa: E402
from torchvision.transforms import autoaugment as v1_autoaugment  # noqa: E402
from torchvision.transforms import v2  # noqa: E402
from torchvision.transforms.v2 import _auto_augment as v2_autoaugment  # noqa: E402

from pooled_loader.vision.torchvision.augment_draws import (  # noqa: E402
    draw_augmix, draw_auto_augment, draw_erasing)
from pooled_loader.vision.torchvision.plan import Draws  # noqa: E402

SEEDS = range(200)
SIZES = [(24, 24), (31, 47), (224, 181)]
POLICIES = [v1.AutoAugmentPolicy.IMAGENET, v1.AutoAugmentPolicy.CIFAR10,
            v1.AutoAugmentPolicy.SVHN]


def _seed(seed: int) -> None:
    # not torch.manual_seed: it formats the call stack (slow under pytest) to seed accelerators
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _rng_states():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _same_states(a, b) -> bool:
    return (torch.equal(a[0], b[0]) and a[1] == b[1]
            and all(np.array_equal(x, y) for x, y in zip(a[2], b[2])))


def _image(h: int, w: int, pil: bool):
    g = torch.Generator().manual_seed(h * 1000 + w)
    x = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
    return Image.fromarray(x.permute(1, 2, 0).numpy()) if pil else x


@pytest.fixture
def recorder(monkeypatch):
    """Replaces the ops' apply functions (v1's module-level ``_apply_op``, v2's method) by ones
    that record (name, magnitude) and return the image unchanged."""
    applied = []

    def v1_apply(img, op_name, magnitude, interpolation, fill):
        applied.append((op_name, magnitude))
        return img

    def v2_apply(self, image, transform_id, magnitude, interpolation, fill):
        applied.append((transform_id, magnitude))
        return image

    monkeypatch.setattr(v1_autoaugment, "_apply_op", v1_apply)
    monkeypatch.setattr(v2_autoaugment._AutoAugmentBase, "_apply_image_or_video_transform",
                        v2_apply)
    return applied


def _auto_augment_ops():
    for version, mod in (("v1", v1), ("v2", v2)):
        yield version, mod.TrivialAugmentWide()
        yield version, mod.TrivialAugmentWide(num_magnitude_bins=9)
        yield version, mod.RandAugment()
        yield version, mod.RandAugment(num_ops=3, magnitude=5, num_magnitude_bins=11)
        for policy in POLICIES:
            yield version, mod.AutoAugment(policy)


@pytest.mark.parametrize("version,op", list(_auto_augment_ops()),
                         ids=lambda x: x if isinstance(x, str) else repr(x)[:40])
def test_auto_augment_draws_are_the_ops_own(recorder, version, op):
    draws = Draws()
    seen = set()
    for h, w in SIZES:
        for seed in SEEDS:
            _seed(seed)
            recorder.clear()
            op(_image(h, w, pil=seed % 2 == 1))
            after_op = _rng_states()
            _seed(seed)
            got = draw_auto_augment(op, version, h, w, draws)
            assert got == recorder, (seed, h, w)
            # -0.0 from a negated zero magnitude, as the op has it
            assert [math.copysign(1, m) for _, m in got] == [math.copysign(1, m)
                                                              for _, m in recorder]
            assert _same_states(after_op, _rng_states()), (seed, h, w)
            seen.update(name for name, _ in got)
    if not isinstance(op, (v1.AutoAugment, v2.AutoAugment)):
        assert len(seen) == 14  # every op of the space was drawn and checked


@pytest.mark.parametrize("version,mod", [("v1", v1), ("v2", v2)])
@pytest.mark.parametrize("kwargs", [{}, dict(severity=7, mixture_width=4, chain_depth=2,
                                             alpha=0.5, all_ops=False)])
def test_augmix_draws_and_mix_arithmetic(recorder, version, mod, kwargs):
    """With every op the identity, torchvision's output is the documented mix of the original
    with itself: so the weights and the arithmetic are checked bit for bit."""
    op = mod.AugMix(**kwargs)
    for h, w in SIZES[:2]:
        x = _image(h, w, pil=False)
        for seed in SEEDS:
            _seed(seed)
            recorder.clear()
            out = op(x)
            after_op = _rng_states()
            _seed(seed)
            m0, chains = draw_augmix(op, version, h, w)
            assert [o for _, ops in chains for o in ops] == recorder, seed
            assert _same_states(after_op, _rng_states()), seed
            if kwargs:
                assert all(len(ops) == 2 for _, ops in chains)
            xf = x.float()
            mix = torch.tensor(m0, dtype=torch.float32) * xf
            for weight, _ in chains:
                mix = mix + torch.tensor(weight, dtype=torch.float32) * xf
            assert torch.equal(mix.to(torch.uint8), out), seed


# ---------------------------------------------------------------- RandomErasing

def _erasing_ops(c: int):
    per_channel = tuple(0.1 * (k + 1) for k in range(c))
    for version, mod in (("v1", v1), ("v2", v2)):
        for value in (0, 0.5, per_channel, "random"):
            yield version, mod.RandomErasing(p=0.5, value=value)
        yield version, mod.RandomErasing(p=1.0, value="random", inplace=True)
        # boxes mostly too big: the 10 tries often fail
        yield version, mod.RandomErasing(p=1.0, scale=(0.6, 0.95), ratio=(0.2, 5.0), value=1)


@pytest.mark.parametrize("c,h,w", [(3, 24, 24), (3, 31, 47), (1, 17, 9)])
def test_erasing_draws_and_output(c, h, w):
    img = torch.randn(c, h, w, generator=torch.Generator().manual_seed(c + h + w))
    for version, op in _erasing_ops(c):
        outcomes = set()
        for seed in SEEDS:
            _seed(seed)
            source = img.clone()
            out = op(source)
            after_op = _rng_states()
            _seed(seed)
            got = draw_erasing(op, version, c, h, w)
            assert _same_states(after_op, _rng_states()), (op, seed)
            expected = img.clone()
            if got is not None:
                i, j, eh, ew, v = got
                if isinstance(v, tuple):
                    assert len(v) == c
                    v = torch.tensor(v)[:, None, None]
                else:
                    assert v.shape == (c, eh, ew) and v.dtype == torch.float32
                expected[:, i:i + eh, j:j + ew] = v
            assert torch.equal(out, expected), (op, seed)
            assert op.inplace == (out is source) or got is None
            outcomes.add(got is None)
        if op.p < 1 or op.scale[0] > 0.5:
            assert outcomes == {True, False}, op  # both paths exercised


# ---------------------------------------------------------------- MixUp / CutMix

from pooled_loader.vision.torchvision.batch_mix import BatchMix  # noqa: E402
from pooled_loader.vision.torchvision.mix_draws import (  # noqa: E402
    MixDraw, draw_mix, is_mix, mix_num_classes)


from reference_mix import RandomCutMix, RandomMixUp  # noqa: E402


NUM_CLASSES = 7


def _mixes():
    yield "v2", v2.MixUp(alpha=0.2, num_classes=NUM_CLASSES)
    yield "v2", v2.CutMix(alpha=1.0, num_classes=NUM_CLASSES)
    yield "v2", v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=NUM_CLASSES),
                                 v2.CutMix(alpha=1.0, num_classes=NUM_CLASSES)])
    yield "reference", RandomMixUp(NUM_CLASSES, p=0.5, alpha=0.2)
    yield "reference", RandomCutMix(NUM_CLASSES, p=1.0, alpha=1.0, inplace=True)
    yield "v1", v1.RandomChoice([RandomMixUp(NUM_CLASSES, p=1.0, alpha=0.2),
                                 RandomCutMix(NUM_CLASSES, p=0.7, alpha=1.0)])
    yield "v1", v1.RandomChoice([RandomMixUp(NUM_CLASSES, alpha=0.2),
                                 v2.CutMix(alpha=1.0, num_classes=NUM_CLASSES)], p=[0.3, 0.7])


@pytest.mark.parametrize("version,t", list(_mixes()), ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("shape", [(4, 3, 16, 16), (5, 3, 23, 9), (2, 1, 7, 31)])
def test_mix_draws_and_arithmetic(version, t, shape):
    assert is_mix(t) == version
    assert mix_num_classes(t) == NUM_CLASSES
    g = torch.Generator().manual_seed(sum(shape))
    batch = torch.randn(shape, generator=g)
    target = torch.randint(0, NUM_CLASSES, (shape[0],), generator=g)
    kinds = set()
    for seed in SEEDS:
        _seed(seed)
        out, labels = t(batch.clone(), target.clone())
        after_op = _rng_states()
        _seed(seed)
        draw = draw_mix(t, version, shape, NUM_CLASSES)
        assert _same_states(after_op, _rng_states()), seed
        assert isinstance(draw, MixDraw)
        _seed(seed)  # the loader's in-place mix, drawing again from the same state
        mix = BatchMix(t, version, NUM_CLASSES)
        mine = batch.clone()
        my_labels = torch.from_numpy(np.stack([mix.one_hot_into(k, None) for k in target]))
        mix.apply(mine.numpy(), my_labels.numpy())
        assert _same_states(after_op, _rng_states()), seed
        assert torch.equal(out, mine), (seed, draw)
        assert labels.dtype == my_labels.dtype and torch.equal(labels, my_labels), (seed, draw)
        if draw.kind == "cutmix":
            y1, y2, x1, x2 = draw.box
            assert draw.lam == 1.0 - (x2 - x1) * (y2 - y1) / (shape[2] * shape[3])
        kinds.add(draw.kind)
    if hasattr(t, "transforms"):
        assert {"mixup", "cutmix"} <= kinds


def test_is_mix_rejects_lookalikes():
    class RandomMixup(torch.nn.Module):  # the name, not the attributes
        def forward(self, batch, target):
            return batch, target

    class Other(RandomMixUp):  # the attributes, not the name
        pass

    assert is_mix(RandomMixup()) is None
    assert is_mix(Other(3)) is None
    assert is_mix(v2.RandomChoice([v2.MixUp(num_classes=3), v2.RandomErasing()])) is None
    assert is_mix(v2.MixUp(num_classes=3, labels_getter=lambda x: x[1])) is None
    assert is_mix(v1.RandomErasing()) is None
    assert mix_num_classes(v2.RandomChoice([v2.MixUp(num_classes=3),
                                            v2.CutMix(num_classes=4)])) is None


# ---------------------------------------------------------------- timm

try:  # timm is optional: without it only these tests skip
    from timm.data import auto_augment as timm_auto_augment
    from timm.data.random_erasing import RandomErasing as TimmErasing
except ImportError:
    timm_auto_augment = None

needs_timm = pytest.mark.skipif(timm_auto_augment is None, reason="timm is not installed")

from pooled_loader.vision.torchvision.augment_draws import (  # noqa: E402
    draw_timm_erasing, draw_timm_rand_augment)


def _timm_rand_augments():
    if timm_auto_augment is None:
        return
    from timm.data import create_transform
    built = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1")
    yield next(t for t in built.transforms if type(t).__name__ == "RandAugment")
    hparams = dict(translate_const=100, img_mean=(124, 116, 104))  # interpolation: random
    for config in ("rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd101-mmax12", "rand-m10-n2-p1.0",
                   "rand-m9-mstd0.5-tweights", "rand-m8-mstd1.0-inc0"):
        yield timm_auto_augment.rand_augment_transform(config, dict(hparams))


@needs_timm
@pytest.mark.parametrize("t", list(_timm_rand_augments()), ids=repr)
def test_timm_rand_augment_draws(monkeypatch, t):
    applied = []  # [name, level args, resample or None] per op function called
    check_args = timm_auto_augment._check_args_tf

    def record_resample(kwargs):  # timm's geometric ops pick their resample here
        check_args(kwargs)
        applied[-1][2] = kwargs["resample"].name.lower()

    tiny = _image(4, 4, pil=True)

    def recording(op):
        def aug_fn(img, *args, **kwargs):
            applied.append([op.name, args, None])
            try:  # timm's own function (on a tiny image): it draws the resample, or not
                fn(tiny, *args, **kwargs)
            except ValueError:  # Pillow 13 refuses timm's posterize to 0 bits
                assert op.name.startswith("Posterize") and args == (0,)
            return img
        fn = op.aug_fn
        return aug_fn

    monkeypatch.setattr(timm_auto_augment, "_check_args_tf", record_resample)
    for op in t.ops:
        monkeypatch.setattr(op, "aug_fn", recording(op))
    for h, w in SIZES[:2]:
        img = _image(h, w, pil=True)
        for seed in SEEDS:
            _seed(seed)
            applied.clear()
            t(img)
            after_op = _rng_states()
            _seed(seed)
            got = draw_timm_rand_augment(t, h, w)
            assert _same_states(after_op, _rng_states()), seed
            assert got == [tuple(a) for a in applied], seed


def _timm_erasings():
    if timm_auto_augment is None:
        return
    from timm.data import create_transform
    built = create_transform(224, is_training=True, re_prob=0.25)
    yield next(t for t in built.transforms if isinstance(t, TimmErasing))
    yield TimmErasing(0.5, mode="rand", max_count=3, device="cpu")
    yield TimmErasing(0.5, mode="pixel", min_count=2, max_count=2, device="cpu")
    yield TimmErasing(1.0, mode="pixel", min_area=0.5, max_area=0.9, device="cpu")


@needs_timm
@pytest.mark.parametrize("t", list(_timm_erasings()), ids=repr)
@pytest.mark.parametrize("c,h,w", [(3, 24, 24), (3, 31, 47), (1, 7, 5)])
def test_timm_erasing_draws_and_output(t, c, h, w):
    img = torch.randn(c, h, w, generator=torch.Generator().manual_seed(c + h + w))
    counts = set()
    for seed in SEEDS:
        _seed(seed)
        out = t(img.clone())
        after_op = _rng_states()
        _seed(seed)
        boxes = draw_timm_erasing(t, c, h, w)
        assert _same_states(after_op, _rng_states()), seed
        expected = img.clone()
        for top, left, eh, ew, v in boxes:
            expected[:, top:top + eh, left:left + ew] = v
        assert torch.equal(out, expected), seed
        counts.add(len(boxes))
    assert 0 in counts and len(counts) > 1
