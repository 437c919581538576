#!/usr/bin/env python
"""The recipes people train with (issue 47): torchvision's reference classification presets and
timm's RandAugment train transform, unchanged, under PooledLoader against DataLoader, same run.

    python scripts/benchmarks/bench_recipes.py [--data DIR] [--n 1024] [--rounds 3]
        [--batch 64] [--workers 2] [--reference DIR] [--only NAMES]  (--n 2048)

``--reference DIR``: a checkout of torchvision's ``references/classification`` (its
``presets.py`` and ``transforms.py`` are imported from there, as its ``train.py`` does, and the
dataset, collate function and loader call are made as ``train.py`` makes them). Without it the
same recipes are built here: a wrapper class whose ``__call__`` returns ``self.transforms(img)``
around the op list ``ClassificationPresetTrain`` builds, and v2's ``MixUp``/``CutMix`` in a
``RandomChoice`` applied by ``collate_fn(batch): return mix(*default_collate(batch))``.

Rows (ImageFolder over ImageNet-like JPEGs, 224 crops, RandomSampler, pin_memory=True as the
reference passes it; the loader class is the only difference):

- default: ``ClassificationPresetTrain(crop_size=224)`` (PIL, v1)
- v2: ``use_v2=True``; tensor v2: ``backend="tensor", use_v2=True``
- ta_wide+re+mix: ``--auto-augment ta_wide --random-erase 0.1 --mixup-alpha 0.2
  --cutmix-alpha 1.0`` (torchvision's "new recipe"; v1 without --use-v2: the reference's
  RandomMixUp/RandomCutMix, or v2's MixUp/CutMix without --reference)
- ra: ``--auto-augment ra``; augmix: ``--auto-augment augmix``; aa: ``--auto-augment imagenet``
- timm ra: ``timm.data.create_transform(224, is_training=True,
  auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)`` (with Pillow 12's 0-bit posterize, see
  ``_pillow12_posterize``: Pillow 13 makes the recipe fail under either loader)

The figure is CPU milliseconds per image (main process + workers, ``getrusage``) over two epochs
of a fresh loader, a steadier figure than wall time on a shared machine; its ratio per round
(DataLoader's over ours), median over rounds; each round alternates which loader goes first.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import resource
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, RandomSampler, default_collate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts", "tools"))

from pooled_loader import PooledLoader  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GOALS = {"default": 3.0, "v2": 3.0, "tensor v2": 3.0, "ta_wide+re+mix": 2.5, "ra": 2.5,
         "timm ra": 2.0}
RECIPES = {  # name: ClassificationPresetTrain's and train.py's arguments
    "default": {},
    "v2": {"use_v2": True},
    "tensor v2": {"backend": "tensor", "use_v2": True},
    "ta_wide+re+mix": {"auto_augment": "ta_wide", "random_erase": 0.1, "mixup_alpha": 0.2,
                       "cutmix_alpha": 1.0},
    "ra": {"auto_augment": "ra"},
    "augmix": {"auto_augment": "augmix"},
    "aa": {"auto_augment": "imagenet"},
}


class Preset:
    """The reference's wrapper shape: ``__call__`` applies ``self.transforms``."""

    def __init__(self, *, auto_augment=None, random_erase=0.0, backend="pil", use_v2=False):
        import torchvision.transforms as v1
        import torchvision.transforms.v2 as v2
        from torchvision.transforms import InterpolationMode
        T, bilinear = (v2 if use_v2 else v1), InterpolationMode.BILINEAR
        ops = [T.PILToTensor()] if backend == "tensor" else []
        ops += [T.RandomResizedCrop(224, interpolation=bilinear, antialias=True),
                T.RandomHorizontalFlip(0.5)]
        if auto_augment == "ra":
            ops.append(T.RandAugment(interpolation=bilinear, magnitude=9))
        elif auto_augment == "ta_wide":
            ops.append(T.TrivialAugmentWide(interpolation=bilinear))
        elif auto_augment == "augmix":
            ops.append(T.AugMix(interpolation=bilinear, severity=3))
        elif auto_augment:
            ops.append(T.AutoAugment(T.AutoAugmentPolicy(auto_augment), interpolation=bilinear))
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


def _args(recipe: dict, batch: int, workers: int) -> SimpleNamespace:
    base = dict(train_crop_size=224, interpolation="bilinear", auto_augment=None,
                random_erase=0.0, ra_magnitude=9, augmix_severity=3, backend="pil",
                use_v2=False, mixup_alpha=0.0, cutmix_alpha=0.0, batch_size=batch,
                workers=workers)
    base.update(recipe)
    return SimpleNamespace(**base)


def reference_loader(ref: str, root: str, recipe: dict, batch: int, workers: int):
    """(dataset, make(loader_cls)) as torchvision's train.py makes them, from its own files."""
    import torchvision
    from torchvision.transforms import InterpolationMode
    sys.path.insert(0, ref)
    presets, transforms = importlib.import_module("presets"), importlib.import_module("transforms")
    a = _args(recipe, batch, workers)
    dataset = torchvision.datasets.ImageFolder(root, presets.ClassificationPresetTrain(
        crop_size=a.train_crop_size, interpolation=InterpolationMode(a.interpolation),
        auto_augment_policy=a.auto_augment, random_erase_prob=a.random_erase,
        ra_magnitude=a.ra_magnitude, augmix_severity=a.augmix_severity, backend=a.backend,
        use_v2=a.use_v2))
    mixup_cutmix = transforms.get_mixup_cutmix(mixup_alpha=a.mixup_alpha,
                                               cutmix_alpha=a.cutmix_alpha,
                                               num_classes=len(dataset.classes),
                                               use_v2=a.use_v2)
    return dataset, _loader_maker(dataset, mixup_cutmix, a)


def builtin_loader(root: str, recipe: dict, batch: int, workers: int):
    """The same recipe without the reference's files (see the module docstring)."""
    import torchvision
    import torchvision.transforms.v2 as v2
    a = _args(recipe, batch, workers)
    dataset = torchvision.datasets.ImageFolder(root, Preset(
        auto_augment=a.auto_augment, random_erase=a.random_erase, backend=a.backend,
        use_v2=a.use_v2))
    mixes = [m(alpha=alpha, num_classes=len(dataset.classes))
             for m, alpha in ((v2.MixUp, a.mixup_alpha), (v2.CutMix, a.cutmix_alpha)) if alpha]
    mixup_cutmix = v2.RandomChoice(mixes) if mixes else None
    return dataset, _loader_maker(dataset, mixup_cutmix, a)


def _pillow12_posterize() -> None:
    """timm 1.0 hands Pillow 0 bits at magnitude 10 (``PosterizeIncreasing``), which Pillow 13
    refuses: the recipe fails a few samples an epoch under either loader. Both loaders run here
    with Pillow 12's answer (black), which the fused path then gives too."""
    from PIL import Image, ImageOps
    real = ImageOps.posterize

    def posterize(image: Image.Image, bits: int) -> Image.Image:
        return image.point(lambda _: 0) if bits == 0 else real(image, bits)
    ImageOps.posterize = posterize


def timm_loader(root: str, batch: int, workers: int):
    import timm.data
    import torchvision
    _pillow12_posterize()
    transform = timm.data.create_transform(224, is_training=True,
                                           auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    dataset = torchvision.datasets.ImageFolder(root, transform)
    return dataset, _loader_maker(dataset, None, _args({}, batch, workers))


def _loader_maker(dataset, mixup_cutmix, a):
    """train.py's collate function and loader call, the class left open."""
    if mixup_cutmix is not None:
        def collate_fn(batch):
            return mixup_cutmix(*default_collate(batch))
    else:
        collate_fn = default_collate

    def make(loader_cls):
        return loader_cls(dataset, batch_size=a.batch_size, sampler=RandomSampler(dataset),
                          num_workers=a.workers, pin_memory=True, collate_fn=collate_fn,
                          drop_last=True)
    return make


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def one_epoch(make, expect: int) -> tuple[float, float]:
    """(images/s of the second of two epochs of a fresh loader, CPU ms per image over both:
    this process's, and its workers' once reaped). The collections that reap the workers are
    not counted (a full ``gc.collect`` with torch loaded costs ~0.2 s here, either loader)."""
    gc.collect()
    main0, kids0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    loader = make()
    speed = 0.0
    for _ in range(2):
        n, t0 = 0, time.perf_counter()
        for images, _ in loader:
            n += len(images)
        speed = n / (time.perf_counter() - t0)
        assert n == expect, (n, expect)
    main = _cpu(resource.RUSAGE_SELF) - main0
    del loader, images
    gc.collect()  # the workers are joined: their CPU time is in RUSAGE_CHILDREN
    kids = _cpu(resource.RUSAGE_CHILDREN) - kids0
    return speed, (main + kids) / (2 * expect) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="/tmp/pooled_recipes")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reference", default="", help="torchvision's references/classification")
    ap.add_argument("--only", default="", help="comma-separated row names (exact)")
    a = ap.parse_args()
    if not os.path.isdir(a.data):
        from make_dataset import make_dataset
        make_dataset(a.data, n=a.n, progress=False)
    names = list(RECIPES) + ["timm ra"]
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    rows = {}
    for name in names:
        if name == "timm ra":
            rows[name] = timm_loader(a.data, a.batch, a.workers)
        elif a.reference:
            rows[name] = reference_loader(a.reference, a.data, RECIPES[name], a.batch, a.workers)
        else:
            rows[name] = builtin_loader(a.data, RECIPES[name], a.batch, a.workers)
    cpus: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    for r in range(a.rounds):
        for name, (dataset, make) in rows.items():
            expect = len(dataset) // a.batch * a.batch
            runs = [("ours", lambda: make(PooledLoader)), ("peer", lambda: make(DataLoader))]
            if r % 2:
                runs.reverse()
            got = {k: one_epoch(m, expect) for k, m in runs}
            cpus[name].append((got["ours"][1], got["peer"][1]))
            print(f"round {r} {name}: CPU ms/img ours {got['ours'][1]:.2f} "
                  f"DataLoader {got['peer'][1]:.2f} ({got['peer'][1] / got['ours'][1]:.2f}x); "
                  f"img/s ours {got['ours'][0]:.0f} DataLoader {got['peer'][0]:.0f}", flush=True)
    print(f"\n{len(next(iter(rows.values()))[0])} images, batch {a.batch}, {a.workers} workers, "
          f"{a.rounds} rounds, {'reference files: ' + a.reference if a.reference else 'built-in recipes'}"
          f", load average at the end {os.getloadavg()[0]:.1f}")
    print("| recipe | DataLoader CPU-ms/img | PooledLoader CPU-ms/img | ratio (median) "
          "| per round | goal |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, cs in cpus.items():
        if not cs:
            continue
        ratios = [p / o for o, p in cs]
        med = statistics.median(ratios)
        goal = GOALS.get(name)
        verdict = "" if goal is None else f"{'PASS' if med >= goal else 'MISS'} >= {goal}x"
        print(f"| {name} | {statistics.median(p for _, p in cs):.2f} "
              f"| {statistics.median(o for o, _ in cs):.2f} | {med:.2f}x "
              f"| {', '.join(f'{x:.2f}' for x in ratios)} | {verdict} |")


if __name__ == "__main__":
    main()
