"""Instance masks resampled straight into the slot (issue 38): under a `pooled_loader.ragged.collate`
helper the detection transform hands out a `deferred.DeferredArray` and the ragged write fills
the slot's view with it; batches are byte-identical to the copied ones, every deferred array is
filled once, a failing fill is its sample's error, and every other reader gets plain arrays."""
import numpy as np
import pytest
import torch

from pooled_loader import PooledLoader
from pooled_loader.core import deferred
from pooled_loader.ragged import slots as ragged
from pooled_loader.ragged.collate import as_list
from pooled_loader.core.deferred import DeferredArray
from pooled_loader.vision import DecodeImage, RandomHorizontalFlip, Resize, ToCHW
from pooled_loader.vision.detection.coco import CocoDetection
from pooled_loader.vision.detection import (DetectionCompose, Pad, RandomIoUCrop,
                                            SanitizeBoundingBoxes)
from pooled_loader.vision.detection.batch import detection_collate, per_image
from test_detection import write_coco

KEYS = ("image_id", "boxes", "labels", "masks")


class CopiedCompose(DetectionCompose):
    """The transform as it was before: masks resampled into a fresh array, then copied."""

    defers_masks = False


def random_ops():
    return [DecodeImage(), RandomIoUCrop(), Resize((48, 64)), RandomHorizontalFlip(),
            ToCHW(), SanitizeBoundingBoxes()]


def batches(ds, collate):
    loader = PooledLoader(ds, batch_size=3, num_workers=2, shuffle=True, collate_fn=collate,
                          generator=torch.Generator().manual_seed(5))
    return [(images.clone(), {k: tuple(x.clone() for x in v) if isinstance(v, tuple) else
                              (v.clone() if isinstance(v, torch.Tensor) else
                               type(v)(*(x.clone() for x in v)))
                              for k, v in targets.items()}) for images, targets in loader]


@pytest.mark.parametrize("targets", ["list", "pad"])
def test_deferred_masks_through_two_workers_equal_the_copied_ones_byte_for_byte(tmp_path,
                                                                                targets):
    pytest.importorskip("pycocotools")
    img_dir, ann = write_coco(tmp_path)
    collate = detection_collate(targets=targets)
    fast = batches(CocoDetection(img_dir, ann, transform=DetectionCompose(random_ops()),
                                 target_keys=KEYS), collate)
    slow = batches(CocoDetection(img_dir, ann, transform=CopiedCompose(random_ops()),
                                 target_keys=KEYS), collate)
    assert len(fast) == len(slow) == 2
    kept = 0
    for (fi, ft), (si, st) in zip(fast, slow):
        assert torch.equal(fi, si)
        assert list(ft) == list(st)
        for key in ft:
            a, b = ft[key], st[key]
            pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
            for x, y in pairs:
                assert x.dtype == y.dtype and x.shape == y.shape, key
                assert torch.equal(x, y), key
        if targets == "list":
            kept += sum(len(m) for m in ft["masks"])
    assert targets == "pad" or kept > 0  # masks were resampled, not only empty ones


class Probe(torch.utils.data.Dataset):
    """Samples from arrays (no files): semantic [H, W] masks, instances that all go, none at
    all; ``accepting`` records what the worker said while the sample was made."""

    def __init__(self, fail_at=None):
        self.t = DetectionCompose([Resize((20, 30)), RandomHorizontalFlip(1.0),
                                   Pad((1, 2, 3, 4)), ToCHW(), SanitizeBoundingBoxes()])
        self.fail_at = fail_at

    def __len__(self):
        return 6

    def source(self, i):
        rng = np.random.default_rng(i)
        h, w = 13 + i, 17 + 2 * i
        img = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        box = np.array([[1, 1, w - 2, h - 2]], np.float32)
        if i % 3 == 0:  # a semantic mask: class values, never thresholded
            return img, {"boxes": box, "labels": np.ones(1, np.int64),
                         "masks": rng.integers(0, 7, (h, w), dtype=np.uint8)}
        if i % 3 == 1:  # three instances whose boxes all have zero width: none is kept
            return img, {"boxes": np.array([[2, 2, 2, 9]] * 3, np.float32),
                         "labels": np.arange(3), "masks": np.ones((3, h, w), np.uint8)}
        return img, {"boxes": np.zeros((0, 4), np.float32), "labels": np.zeros(0, np.int64),
                     "masks": np.zeros((0, h, w), np.uint8)}  # an empty target

    def __getitem__(self, i):
        out_img, out = self.t(*self.source(i), defer_masks=deferred.accepting())
        if i == self.fail_at and isinstance(out["masks"], DeferredArray):
            m = out["masks"]
            out["masks"] = DeferredArray(m.shape, m.dtype, lambda dst: 1 // 0)
        return out_img, {**out, "accepting": int(deferred.accepting())}


def mask_types(batch):
    return [type(t["masks"]).__name__ for _, t in batch]


def test_semantic_empty_and_all_dropped_masks_through_two_workers_equal_the_transform():
    ds = Probe()
    loader = PooledLoader(ds, batch_size=3, num_workers=2, collate_fn=detection_collate())
    seen = 0
    for images, targets in loader:
        assert targets["accepting"].tolist() == [1] * len(images)  # the deferred path ran
        for j, got in enumerate(per_image(targets)):
            i = seen + j
            img, want = ds.t(*ds.source(i))  # in the main process: plain arrays
            assert isinstance(want["masks"], np.ndarray)
            assert torch.equal(images[j], torch.from_numpy(img))
            masks = got["masks"]
            assert masks.dtype == torch.uint8 and tuple(masks.shape) == want["masks"].shape
            assert torch.equal(masks, torch.from_numpy(want["masks"]))
            if i % 3 == 1:
                assert masks.shape[0] == 0 and len(got["labels"]) == 0
            if i % 3 == 0:  # the semantic mask's values, flipped and padded with 0
                assert masks.shape == (20 + 2 + 4, 30 + 1 + 3)
        seen += len(images)
    assert seen == len(ds)


def test_a_failing_fill_is_the_sample_s_error_naming_it():
    loader = PooledLoader(Probe(fail_at=4), batch_size=3, num_workers=2,
                          collate_fn=detection_collate())
    with pytest.raises(ZeroDivisionError, match="loading sample index 4"):  # as a __getitem__'s
        list(loader)


def test_every_deferred_array_is_filled_once_and_its_source_released():
    calls = []

    def maker(k):
        def fill(out):
            calls.append(k)
            out[...] = k
        return DeferredArray((2, k + 1), np.int16, fill)

    samples = [(np.full(3, k), {"m": maker(k)}) for k in range(4)]
    leaves = [s[1]["m"] for s in samples]
    batch = as_list()(samples)
    assert sorted(calls) == [0, 1, 2, 3]  # once each
    assert all(leaf.filled and leaf._fill_into is None for leaf in leaves)
    for k, m in enumerate(batch[1]["m"]):
        assert m.dtype == torch.int16 and m.shape == (2, k + 1) and (m == k).all()
    with pytest.raises(RuntimeError, match="filled already"):
        leaves[0].fill(np.empty((2, 1), np.int16))
    # any other reader materialises it, once
    d = maker(5)
    assert np.asarray(d).tolist() == [[5] * 6] * 2 and d.filled
    with pytest.raises(ValueError, match="cannot fill"):
        maker(2).fill(np.empty((2, 2), np.int16))


def test_a_fill_failure_in_process_names_the_sample():
    def bad(out):
        raise OSError("decode failed")

    samples = [{"m": np.zeros(2, np.uint8)}, {"m": DeferredArray((3,), np.uint8, bad)}]
    with pytest.raises(deferred.FillFailed, match="sample 1 of the batch.*decode failed") as info:
        as_list()(samples)
    assert info.value.index == 1 and isinstance(info.value.__cause__, OSError)
    p = ragged.plan(as_list(), [{"m": DeferredArray((3,), np.uint8, bad)}], indices=[41])
    with pytest.raises(deferred.FillFailed, match="sample 41") as info:
        ragged.write(p, np.empty(p.nbytes, np.uint8))
    assert info.value.index == 41


def test_outside_the_worker_s_ragged_fetch_the_transform_gives_plain_arrays(tmp_path):
    pytest.importorskip("pycocotools")
    img_dir, ann = write_coco(tmp_path)
    ds = CocoDetection(img_dir, ann, transform=DetectionCompose(random_ops()), target_keys=KEYS)
    assert not deferred.accepting()
    assert isinstance(ds[0][1]["masks"], np.ndarray)
    with deferred.accepted():
        got = ds[0][1]["masks"]
    assert isinstance(got, DeferredArray) and not deferred.accepting()
    # a user's collate_fn in workers: never accepting, so it sees arrays
    loader = PooledLoader(ds, batch_size=2, num_workers=2,
                          collate_fn=mask_types)
    assert {name for batch in loader for name in batch} == {"ndarray"}


def test_routed_torchvision_dataset_with_our_collate_gets_dataloader_s_masks(tmp_path):
    """The routed path (FusedDetection) under detection_collate: its masks are deferred in the
    worker and filled where it wraps them as tensors (not left deferred). ToPureTensor: a
    batch of BoundingBoxes (instance attributes) cannot go through detection_collate."""
    pytest.importorskip("pycocotools")
    from torch.utils.data import DataLoader
    from torchvision.transforms import v2

    from test_detection import wrapped_coco
    from test_detection_routing import annotated_only, zip_collate
    img_dir, ann = annotated_only(*write_coco(tmp_path))
    ds = wrapped_coco(img_dir, ann, [v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((48, 64)),
                                     v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes(),
                                     v2.ToPureTensor()])
    kw = dict(batch_size=2, num_workers=2, shuffle=True)
    want = [t for _, ts in DataLoader(ds, generator=torch.Generator().manual_seed(7),
                                      collate_fn=zip_collate, **kw) for t in ts]
    loader = PooledLoader(ds, generator=torch.Generator().manual_seed(7),
                          collate_fn=detection_collate(), **kw)
    got = [t for _, ts in loader for t in per_image(ts)]
    assert "transforms" in loader.stats() and len(got) == len(want) == 5
    for a, b in zip(got, want):
        assert torch.equal(a["masks"], b["masks"].as_subclass(torch.Tensor))
        assert torch.equal(a["labels"], b["labels"])
