"""An unchanged torchvision detection pipeline through PooledLoader: routed to the fused detection
path by itself, with what DataLoader gives (types, keys, the user's collate_fn, the same draws
sample for sample through 2 real workers); what cannot be honoured runs as torchvision's code."""
import json
import logging

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchvision import tv_tensors
from torchvision.transforms import v2

from pooled_loader import PooledLoader
from test_detection import wrapped_coco, write_coco

pytest.importorskip("pycocotools")

KEYS = ("image_id", "boxes", "labels", "masks", "iscrowd")


def zip_collate(batch):
    return tuple(zip(*batch))


def annotated_only(img_dir, ann):
    """The COCO file without its image that has no annotations (torchvision's RandomIoUCrop
    and SanitizeBoundingBoxes refuse such a sample)."""
    data = json.loads(open(ann).read())
    used = {a["image_id"] for a in data["annotations"]}
    data["images"] = [im for im in data["images"] if im["id"] in used]
    with open(ann, "w") as f:
        json.dump(data, f)
    return img_dir, ann


def both(ds, **kw):
    kw = dict(batch_size=2, num_workers=2, shuffle=True, collate_fn=zip_collate, **kw)
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(7), **kw))
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(7), **kw)
    return want, list(loader), loader


def same_target(a, b):
    """``b`` is what torchvision gave as ``a``: keys, types, metadata, values."""
    assert list(a) == list(b)
    for key, va in a.items():
        vb = b[key]
        assert type(vb) is type(va), key
        if not isinstance(va, torch.Tensor):
            assert va == vb, key
            continue
        assert vb.dtype == va.dtype and vb.shape == va.shape, key
        if isinstance(va, tv_tensors.BoundingBoxes):
            assert vb.format == va.format and tuple(vb.canvas_size) == tuple(va.canvas_size)
            torch.testing.assert_close(vb.as_subclass(torch.Tensor),
                                       va.as_subclass(torch.Tensor), atol=1e-4, rtol=0)
        else:  # masks exactly after nearest resampling; labels
            assert torch.equal(vb.as_subclass(torch.Tensor), va.as_subclass(torch.Tensor)), key


PIPELINES = {
    "ssd": (lambda: [v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((48, 64)),
                     v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes()], True),
    "crop pad flip": (lambda: [v2.ToImage(), v2.RandomResizedCrop((40, 56), scale=(0.2, 1.0)),
                               v2.Pad([1, 2, 3, 4]), v2.RandomHorizontalFlip(0.7),
                               v2.Resize(30)], False),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_unchanged_wrapped_coco_runs_fused_and_gives_dataloaders_samples(tmp_path, name, caplog):
    ops, annotated = PIPELINES[name]
    img_dir, ann = write_coco(tmp_path)
    if annotated:
        annotated_only(img_dir, ann)
    ds = wrapped_coco(img_dir, ann, ops(), KEYS)
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        want, got, loader = both(ds)
    lines = [r.getMessage() for r in caplog.records if "detection transforms" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        "PooledLoader: accelerated torchvision detection transforms: fused [ToImage(), ")
    stats = loader.stats()["transforms"]
    assert len(stats["fused"]) == len(ops()) and stats["as_is"] == []
    assert stats["output"] == "tv_tensors.Image"
    assert len(got) == len(want)
    for (images_a, targets_a), (images_b, targets_b) in zip(want, got):
        for xa, xb in zip(images_a, images_b):
            assert type(xb) is tv_tensors.Image and xb.dtype == torch.uint8
            assert xb.shape == xa.shape  # the same crop, then pixels within resampling error
            assert (xa.float() - xb.float()).abs().mean() < 8
        for ta, tb in zip(targets_a, targets_b):
            same_target(ta, tb)


def test_to_pure_tensor_at_the_end_gives_plain_tensors(tmp_path):
    img_dir, ann = write_coco(tmp_path)
    ds = wrapped_coco(img_dir, ann, [v2.ToImage(), v2.RandomHorizontalFlip(), v2.Resize(24),
                                     v2.ToPureTensor()], KEYS)
    want, got, loader = both(ds)
    assert loader.stats()["transforms"]["output"] == "torch.Tensor"
    for (images_a, targets_a), (images_b, targets_b) in zip(want, got):
        assert [type(x) for x in images_b] == [torch.Tensor] * len(images_a)
        for ta, tb in zip(targets_a, targets_b):
            same_target(ta, tb)


@pytest.mark.parametrize("case", ["switched off", "unfused op", "op after ToPureTensor"])
def test_what_is_not_routed_runs_as_torchvision_bit_for_bit(tmp_path, case, caplog):
    img_dir, ann = write_coco(tmp_path)
    ops = {"switched off": [v2.ToImage(), v2.RandomHorizontalFlip(), v2.Resize(24)],
           "unfused op": [v2.ToImage(), v2.RandomPhotometricDistort(), v2.Resize(24)],
           "op after ToPureTensor": [v2.ToImage(), v2.ToPureTensor(), v2.Resize(24)]}[case]
    ds = wrapped_coco(img_dir, ann, ops, KEYS)
    kw = dict(batch_size=2, num_workers=0, collate_fn=zip_collate)
    torch.manual_seed(0)
    want = list(DataLoader(ds, **kw))
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="pooled_loader"):
        loader = PooledLoader(ds, accelerate_transforms=case != "switched off", **kw)
        got = list(loader)
    assert "transforms" not in loader.stats()
    lines = [r.getMessage() for r in caplog.records if "detection transforms" in r.getMessage()]
    assert lines == ([] if case == "switched off" else
                     [lines[0]]) and all("run as they are" in line for line in lines)
    for (images_a, targets_a), (images_b, targets_b) in zip(want, got):
        for xa, xb in zip(images_a, images_b):
            assert type(xb) is type(xa) and torch.equal(xa, xb)
        for ta, tb in zip(targets_a, targets_b):
            same_target(ta, tb)


# ---------------------------------------------------------------- masks resampled in one layout

@pytest.mark.parametrize("layout", ["row-major", "column-major"])
@pytest.mark.parametrize("dtype", [np.uint8, np.bool_, np.int32])
def test_masks_resampled_in_their_own_layout_equal_the_gather(layout, dtype):
    """pycocotools' column-major masks (and row-major ones) through gather_masks: row copies and
    blocked transposes give exactly numpy's gather, with padding, flips and dropped instances."""
    pytest.importorskip("cv2")
    from pooled_loader.vision.detection.targets import Geometry, gather, gather_masks
    rng = np.random.default_rng(3)
    for trial in range(20):
        n, h, w = int(rng.integers(1, 5)), int(rng.integers(3, 90)), int(rng.integers(3, 90))
        m = rng.integers(0, 3, (n, h, w)).astype(dtype)
        if layout == "column-major":
            m = np.asfortranarray(m.transpose(1, 2, 0)).transpose(2, 0, 1)  # pycocotools' layout
            assert not m[0].flags.c_contiguous
        g = Geometry(h, w)
        g.crop(int(rng.integers(-5, h // 2)), int(rng.integers(-5, w // 2)),
               int(rng.integers(1, h + 6)), int(rng.integers(1, w + 6)))
        g.resize(int(rng.integers(1, 120)), int(rng.integers(1, 120)))
        if trial % 2:
            g.flip()
        g.pad(*(int(v) for v in rng.integers(0, 4, 4)))
        rows, cols = g.index_maps()
        picked = sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist())
        want = np.empty((len(picked), len(rows), len(cols)), m.dtype)
        gather(np.ascontiguousarray(m[picked]), rows, cols, want)
        got = np.full_like(want, 7 if dtype is not np.bool_ else True)
        assert gather_masks(m, picked, rows, cols, got)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(g.masks(m, select=np.array(picked)), want)


def test_masks_of_instances_sanitize_drops_are_never_decoded(tmp_path, monkeypatch):
    """pycocotools decodes the kept instances only (the degenerate box of each image goes)."""
    from pycocotools import mask as coco_mask

    from pooled_loader.vision import DecodeImage, Resize, ToCHW
    from pooled_loader.vision.detection.coco import CocoDetection
    from pooled_loader.vision.detection import DetectionCompose, SanitizeBoundingBoxes
    img_dir, ann = write_coco(tmp_path)
    decoded = []
    real = coco_mask.decode
    monkeypatch.setattr(coco_mask, "decode", lambda rles: decoded.append(len(rles)) or real(rles))
    ds = CocoDetection(img_dir, ann, DetectionCompose([DecodeImage(), Resize(40), ToCHW(),
                                                       SanitizeBoundingBoxes()]),
                       target_keys=("boxes", "labels", "masks"))
    eager = CocoDetection(img_dir, ann, target_keys=("boxes", "labels", "masks"))
    for i in range(len(ds)):
        decoded.clear()
        _, t = ds[i]
        assert sum(decoded) == len(t["masks"]) == len(t["labels"])
        assert 9 not in t["labels"].tolist() and len(eager.target(i)["masks"]) in (0, 4)


def test_a_file_the_fused_path_refuses_is_made_by_torchvision_with_the_same_draws(tmp_path,
                                                                                   caplog):
    """A symlinked image (our reader opens no symlink; torchvision's does) comes from the
    dataset's own __getitem__, the RNG restored: every sample still equals DataLoader's."""
    import os
    img_dir, ann = write_coco(tmp_path)
    os.rename(os.path.join(img_dir, "2.jpg"), os.path.join(img_dir, "real.jpg"))
    os.symlink(os.path.join(img_dir, "real.jpg"), os.path.join(img_dir, "2.jpg"))
    ds = wrapped_coco(img_dir, ann, PIPELINES["crop pad flip"][0](), KEYS)
    want, got, loader = both(ds)
    assert "transforms" in loader.stats()
    from pooled_loader.vision.torchvision.detection_fused import translate
    fused, _ = translate(ds)
    with caplog.at_level(logging.WARNING, logger="pooled_loader"):
        for i in range(len(fused)):
            fused[i]
    assert fused.fallbacks == 2  # the image without annotations, and the symlink
    assert sum("could not make" in r.getMessage() for r in caplog.records) == 1
    for (images_a, targets_a), (images_b, targets_b) in zip(want, got):
        for xa, xb, ta, tb in zip(images_a, images_b, targets_a, targets_b):
            assert type(xb) is type(xa) and xb.shape == xa.shape
            same_target(ta, tb)
            if ta["image_id"] == 12:  # the symlinked file: torchvision's own pixels
                assert torch.equal(xa, xb)


@pytest.mark.parametrize("images", ["stack", "pad"])
def test_torchvision_typed_targets_through_detection_collate_stay_per_image(tmp_path, images):
    """The routed dataset's BoundingBoxes (format and canvas size as attributes: not a slot
    leaf) with varying counts per image, collated by our detection_collate through 2 workers:
    one BoundingBoxes per image, DataLoader's values; masks and labels per-image views."""
    from pooled_loader.vision.detection.batch import detection_collate, per_image
    img_dir, ann = annotated_only(*write_coco(tmp_path))
    ds = wrapped_coco(img_dir, ann, PIPELINES["ssd"][0](), KEYS)
    kw = dict(batch_size=3, num_workers=2, shuffle=True)
    want = list(DataLoader(ds, generator=torch.Generator().manual_seed(3),
                           collate_fn=zip_collate, **kw))
    got = list(PooledLoader(ds, generator=torch.Generator().manual_seed(3),
                            collate_fn=detection_collate(images=images), **kw))
    assert len(got) == len(want)
    counts = set()
    for (_, targets_a), (_, targets_b) in zip(want, got):
        assert isinstance(targets_b["boxes"], tuple)
        for ta, tb in zip(targets_a, per_image(targets_b)):
            counts.add(len(ta["boxes"]))
            assert type(tb["boxes"]) is tv_tensors.BoundingBoxes
            assert tuple(tb["boxes"].canvas_size) == tuple(ta["boxes"].canvas_size)
            torch.testing.assert_close(tb["boxes"].as_subclass(torch.Tensor),
                                       ta["boxes"].as_subclass(torch.Tensor), atol=1e-4, rtol=0)
            assert torch.equal(tb["labels"], ta["labels"])
            assert torch.equal(tb["masks"].as_subclass(torch.Tensor),
                               ta["masks"].as_subclass(torch.Tensor))
    assert len(counts) > 1  # the counts differ between images: the case that used to fail
