"""Detection targets follow the image: boxes, masks and keypoints against torchvision v2 for the
same drawn parameters, SanitizeBoundingBoxes' rule, a COCO folder written here (odd sizes, crowd
RLE, polygons, empty targets, border and degenerate boxes) through PooledLoader's workers."""
import io
import json
import os
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from pooled_loader import PooledLoader
from pooled_loader.vision import (DecodeImage, RandomHorizontalFlip, RandomResizedCrop, Resize,
                                  ToCHW)
from pooled_loader.vision.detection.coco import CocoDetection
from pooled_loader.vision.detection import (DetectionCompose, Pad, RandomIoUCrop,
                                            SanitizeBoundingBoxes)
from pooled_loader.vision.detection.batch import (Counted, ImageBatch, detection_collate,
                                                  per_image)
from pooled_loader.vision.detection.targets import to_xyxy


def smooth(h, w, seed=0):
    """A smooth RGB image (resampling filters agree on it, unlike on noise)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    rng = np.random.default_rng(seed)
    chans = [127 + 120 * np.sin(x / rng.uniform(8, 30) + y / rng.uniform(8, 30) + c)
             for c in range(3)]
    return np.stack(chans, -1).astype(np.uint8)


def replay(g, img, boxes, masks, kps):
    """Run a drawn geometry with torchvision's functional ops on tv_tensors."""
    for i, (kind, args, _) in enumerate(g.steps):
        if kind == "crop":
            t, l, h, w = args
            xy = F.convert_bounding_box_format(boxes, new_format="XYXY")
            cx, cy = (xy[:, 0] + xy[:, 2]) / 2, (xy[:, 1] + xy[:, 3]) / 2
            within = (l < cx) & (cx < l + w) & (t < cy) & (cy < t + h)
            img, boxes, masks, kps = [F.crop(x, t, l, h, w) for x in (img, boxes, masks, kps)]
            if i in g.center_windows:  # RandomIoUCrop's marking, as its transform() does
                boxes[~within] = 0
        elif kind == "resize":
            img, boxes, masks, kps = [F.resize(x, list(args), antialias=True)
                                      for x in (img, boxes, masks, kps)]
        elif kind == "flip":
            img, boxes, masks, kps = [F.horizontal_flip(x) for x in (img, boxes, masks, kps)]
        else:
            img, boxes, masks, kps = [F.pad(x, list(args)) for x in (img, boxes, masks, kps)]
    return img, boxes, masks, kps


@pytest.mark.parametrize("fmt", ["XYXY", "XYWH", "CXCYWH"])
def test_boxes_masks_and_keypoints_equal_torchvision_for_the_same_parameters(fmt):
    rng = np.random.default_rng({"XYXY": 0, "XYWH": 1, "CXCYWH": 2}[fmt])
    for trial in range(60):
        H, W = (int(v) for v in rng.integers(9, 260, 2))
        img = smooth(H, W, trial)
        n = int(rng.integers(1, 7))
        xy = rng.uniform(-5, [W, H], (n, 2))
        xyxy = np.concatenate([xy, xy + rng.uniform(0, 90, (n, 2))], 1).astype(np.float32)
        xyxy[0] = [0, 0, W, H]  # a box on the border
        bx = F.convert_bounding_box_format(
            tv_tensors.BoundingBoxes(torch.from_numpy(xyxy), format="XYXY", canvas_size=(H, W)),
            new_format=fmt)
        inst = tv_tensors.Mask(torch.from_numpy(rng.integers(0, 2, (n, H, W), dtype=np.uint8)))
        sem = tv_tensors.Mask(torch.from_numpy(rng.integers(0, 250, (H, W), dtype=np.uint8)))
        kp = tv_tensors.KeyPoints(torch.from_numpy(
            rng.uniform(0, [W, H], (n * 3, 2)).astype(np.float32)), canvas_size=(H, W))
        ops = [RandomIoUCrop(), RandomResizedCrop(tuple(int(v) for v in rng.integers(5, 150, 2))),
               RandomHorizontalFlip(), Pad((1, 2, 3, 4)), Resize(int(rng.integers(5, 120)))]
        chosen = [ops[i] for i in sorted(rng.choice(5, int(rng.integers(1, 6)), replace=False))]
        dc = DetectionCompose(chosen + [ToCHW()])
        for target_mask in (inst, sem):
            torch.manual_seed(trial)
            random.seed(trial)
            out, t = dc(img, {"boxes": bx, "masks": target_mask, "keypoints": kp})
            torch.manual_seed(trial)
            random.seed(trial)
            g = dc.draw((H, W), to_xyxy(bx.numpy(), fmt))
            ti, tb, tm, tk = replay(g, tv_tensors.Image(torch.from_numpy(img).permute(2, 0, 1)),
                                    bx, target_mask, kp)
            assert out.shape == tuple(ti.shape)
            if fmt == "XYXY":  # torchvision's float32 operations, one by one: bit-equal
                np.testing.assert_array_equal(t["boxes"], tb.numpy())
            else:  # format conversions round differently: one float32 step at most
                np.testing.assert_allclose(t["boxes"], tb.numpy(), rtol=2.5e-7, atol=1e-4)
            assert t["masks"].dtype == np.uint8 and np.array_equal(t["masks"], tm.numpy())
            np.testing.assert_array_equal(t["keypoints"], tk.numpy())
        resizes = sum(s.kind == "resize" for s in g.steps)
        if resizes == 0:  # crops, pads and flips move pixels: the very same ones
            assert np.array_equal(out, ti.numpy())
        elif resizes == 1 and min(out.shape[1:]) >= 16:
            # one resampling, as torchvision: the same picture, up to the filter
            assert np.abs(out.astype(int) - ti.numpy().astype(int)).mean() < 6


def test_semantic_mask_values_survive_every_step_unchanged():
    H, W = 37, 53
    sem = np.random.default_rng(3).choice(np.array([0, 7, 200, 255], np.uint8), (H, W))
    dc = DetectionCompose([RandomResizedCrop((91, 45)), RandomHorizontalFlip(1.0), Pad(3),
                           Resize((40, 70))])
    _, t = dc(smooth(H, W), {"masks": sem})
    assert set(np.unique(t["masks"])) <= {0, 7, 200, 255}
    assert t["masks"].shape == (40, 70)


def test_random_iou_crop_draws_torchvision_crop_from_the_same_seed():
    rng = np.random.default_rng(5)
    for seed in range(25):
        H, W = (int(v) for v in rng.integers(40, 300, 2))
        xy = rng.uniform(0, [W * 0.8, H * 0.8], (4, 2))
        xyxy = np.concatenate([xy, xy + rng.uniform(2, 60, (4, 2))], 1).astype(np.float32)
        bx = tv_tensors.BoundingBoxes(torch.from_numpy(xyxy), format="XYXY", canvas_size=(H, W))
        img = tv_tensors.Image(torch.from_numpy(smooth(H, W)).permute(2, 0, 1))
        torch.manual_seed(seed)
        ti, tt = v2.RandomIoUCrop()(img, {"boxes": bx})
        torch.manual_seed(seed)
        out, t = DetectionCompose([RandomIoUCrop(), ToCHW()])(smooth(H, W), {"boxes": bx})
        assert out.shape == tuple(ti.shape)
        assert np.array_equal(out, ti.numpy())  # a crop only: the very same pixels
        np.testing.assert_allclose(t["boxes"], tt["boxes"].numpy(), rtol=0, atol=1e-4)


def test_sanitize_drops_exactly_what_torchvision_drops_with_labels_and_masks():
    H, W = 50, 60
    boxes = np.array([[0, 0, 60, 50],      # the whole canvas, on every border: kept
                      [10, 10, 10, 20],    # zero width: dropped
                      [5, 5, 5.5, 30],     # narrower than min_size: dropped
                      [55, 45, 60, 50],    # 5x5 in the corner, area 25: kept
                      [30, 10, 40, 12],    # area 20: dropped with min_area=25
                      [0, 0, 0, 0]], np.float32)  # degenerate
    labels = np.arange(6)
    masks = np.stack([np.full((H, W), i, np.uint8) for i in range(6)])
    bx = tv_tensors.BoundingBoxes(torch.from_numpy(boxes), format="XYXY", canvas_size=(H, W))
    expected = v2.SanitizeBoundingBoxes(min_area=25)(
        {"boxes": bx, "labels": torch.from_numpy(labels),
         "masks": tv_tensors.Mask(torch.from_numpy(masks))})
    dc = DetectionCompose([SanitizeBoundingBoxes(min_area=25)])
    _, t = dc(smooth(H, W), {"boxes": boxes, "labels": labels, "masks": masks})
    np.testing.assert_array_equal(t["boxes"], expected["boxes"].numpy())
    np.testing.assert_array_equal(t["labels"], expected["labels"].numpy())
    np.testing.assert_array_equal(t["masks"], expected["masks"].numpy())
    assert list(t["labels"]) == [0, 3]
    # a semantic mask is never filtered, even when its height equals the number of boxes
    sem = np.arange(6 * W, dtype=np.uint8).reshape(6, W) % 5
    dc2 = DetectionCompose([SanitizeBoundingBoxes()])
    _, t2 = dc2(smooth(6, W), {"boxes": boxes[:6] * [1, 0.1, 1, 0.1], "masks": sem})
    assert np.array_equal(t2["masks"], sem)


def test_keypoints_with_visibility_lose_it_when_a_crop_leaves_them_out():
    kps = np.array([[[5, 5, 2], [50, 40, 2], [20, 30, 0]]], np.float32)
    dc = DetectionCompose([Pad((0, 0, 0, 0)), RandomHorizontalFlip(1.0)])
    _, t = dc(smooth(48, 64), {"keypoints": kps})
    assert t["keypoints"][0, :, 2].tolist() == [2, 2, 0]
    assert t["keypoints"][0, 0, 0] == 64 - 1 - 5  # torchvision's keypoint flip
    g_ops = DetectionCompose([RandomResizedCrop(16, scale=(0.05, 0.05))])
    random.seed(1)
    _, t = g_ops(smooth(48, 64), {"keypoints": kps})
    random.seed(1)
    g = g_ops.draw((48, 64), None)
    top, left, h, w = g.steps[0].args
    inside = [(left <= x < left + w) and (top <= y < top + h) for x, y, _ in kps[0]]
    assert t["keypoints"][0, :, 2].tolist() == [v if ok else 0 for (_, _, v), ok in
                                               zip(kps[0], inside)]


# ---------------------------------------------------------------- a COCO folder

def write_coco(root):
    """Images of odd sizes; a crowd RLE, polygons, an empty target, border and degenerate
    boxes."""
    os.makedirs(root / "img")
    sizes = [(97, 131), (64, 64), (203, 151), (45, 301), (120, 80), (77, 99)]
    images, anns = [], []
    aid = 1
    for i, (h, w) in enumerate(sizes):
        buf = io.BytesIO()
        Image.fromarray(smooth(h, w, i)).save(buf, "JPEG", quality=95)
        (root / "img" / f"{i}.jpg").write_bytes(buf.getvalue())
        images.append({"id": 10 + i, "file_name": f"{i}.jpg", "height": h, "width": w})
        if i == 1:
            continue  # an image without annotations
        polys = [[2, 2, w / 2, 2, w / 2, h / 2, 2, h / 2]]
        anns.append({"id": aid, "image_id": 10 + i, "category_id": 3, "iscrowd": 0,
                     "bbox": [2, 2, w / 2 - 2, h / 2 - 2], "area": 1.0, "segmentation": polys})
        anns.append({"id": aid + 1, "image_id": 10 + i, "category_id": 5, "iscrowd": 0,
                     "bbox": [0, 0, w, h], "area": 1.0,  # on every border
                     "segmentation": [[0, 0, w, 0, w, h, 0, h]]})
        anns.append({"id": aid + 2, "image_id": 10 + i, "category_id": 7, "iscrowd": 1,
                     "bbox": [w / 3, h / 3, w / 3, h / 3], "area": 1.0,
                     "segmentation": {"size": [h, w], "counts": [h * (w // 3) + h // 3, h // 3,
                                                                 h * w - h * (w // 3) - 2 * (h // 3)]}})
        anns.append({"id": aid + 3, "image_id": 10 + i, "category_id": 9, "iscrowd": 0,
                     "bbox": [w - 1, 5, 0, 10], "area": 0.0,  # degenerate: zero width
                     "segmentation": [[w - 1, 5, w - 1, 15, w - 1, 10]]})
        aid += 4
    (root / "ann.json").write_text(json.dumps({"images": images, "annotations": anns,
                                               "categories": []}))
    return str(root / "img"), str(root / "ann.json")


def test_coco_targets_equal_torchvision_wrapped_coco_detection(tmp_path):
    pytest.importorskip("pycocotools")
    from torchvision.datasets import CocoDetection as TvCoco, wrap_dataset_for_transforms_v2
    img_dir, ann = write_coco(tmp_path)
    keys = ("image_id", "boxes", "labels", "masks")
    ours = CocoDetection(img_dir, ann, target_keys=keys)
    theirs = wrap_dataset_for_transforms_v2(TvCoco(img_dir, ann), target_keys=set(keys))
    for i in range(len(ours)):
        t, (_, tt) = ours.target(i), theirs[i]
        assert t["image_id"] == tt["image_id"]
        if "boxes" not in tt:  # torchvision gives only image_id without annotations; we give
            assert t["boxes"].shape == (0, 4) and t["masks"].shape[0] == 0  # empty arrays
            continue
        np.testing.assert_allclose(t["boxes"], tt["boxes"].numpy(), atol=1e-4)
        np.testing.assert_array_equal(t["labels"], tt["labels"].numpy())
        np.testing.assert_array_equal(t["masks"], tt["masks"].numpy())


def fixed_pipeline():
    return DetectionCompose([DecodeImage(), Resize(64, max_side=100), RandomHorizontalFlip(0.0),
                             Pad((0, 0, 3, 1)), ToCHW(), SanitizeBoundingBoxes()])


@pytest.mark.parametrize("targets", ["list", "pad"])
def test_coco_through_pooled_loader_workers_equals_the_dataset(tmp_path, targets):
    pytest.importorskip("pycocotools")
    img_dir, ann = write_coco(tmp_path)
    ds = CocoDetection(img_dir, ann, transform=fixed_pipeline(),
                       target_keys=("image_id", "boxes", "labels", "masks"))
    collate = detection_collate(images="pad", targets=targets, to_multiple_of=32)
    loader = PooledLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
    seen = 0
    for b, (images, tg) in enumerate(loader):
        assert isinstance(images, ImageBatch)
        assert images.images.shape[2] % 32 == 0 and images.images.shape[3] % 32 == 0
        for j in range(len(images.sizes)):
            img, t = ds[b * 4 + j]
            h, w = images.sizes[j].tolist()
            assert (h, w) == img.shape[1:]
            assert torch.equal(images.images[j, :, :h, :w], torch.from_numpy(img))
            assert not images.images[j, :, h:].any() and not images.images[j, :, :, w:].any()
            if targets == "list":
                got = per_image(tg)[j]
                boxes, masks, labels = got["boxes"], got["masks"], got["labels"]
            else:
                assert isinstance(tg["boxes"], Counted)
                n = int(tg["boxes"].counts[j])
                boxes, labels = tg["boxes"].values[j, :n], tg["labels"].values[j, :n]
                masks = tg["masks"].values[j, :n]
                assert masks.shape[1:] == images.images.shape[2:]  # aligned with the images
                assert not masks[:, h:].any() and not masks[:, :, w:].any()
                masks = masks[:, :h, :w]
            assert torch.equal(boxes, torch.from_numpy(t["boxes"]))
            assert torch.equal(labels, torch.from_numpy(t["labels"]))
            assert torch.equal(masks, torch.from_numpy(t["masks"]))
            assert 9 not in labels.tolist()  # the degenerate box went, with its label and mask
            seen += 1
    assert seen == len(ds)


def test_random_pipeline_through_workers_keeps_masks_inside_their_boxes(tmp_path):
    pytest.importorskip("pycocotools")
    img_dir, ann = write_coco(tmp_path)
    dc = DetectionCompose([DecodeImage(), RandomIoUCrop(), Resize((48, 64)),
                           RandomHorizontalFlip(), ToCHW(), SanitizeBoundingBoxes()])
    ds = CocoDetection(img_dir, ann, transform=dc,
                       target_keys=("image_id", "boxes", "labels", "masks"))
    loader = PooledLoader(ds, batch_size=3, num_workers=2, collate_fn=detection_collate())
    n = 0
    for images, tg in loader:
        assert images.shape == (len(tg["boxes"]), 3, 48, 64)
        for t in per_image(tg):
            assert len(t["boxes"]) == len(t["labels"]) == len(t["masks"])
            for box, mask in zip(t["boxes"], t["masks"]):
                ys, xs = np.nonzero(mask.numpy())
                if len(ys):  # nearest sampling: every mask pixel within a pixel of its box
                    assert xs.min() >= box[0] - 1 and xs.max() <= box[2] + 1
                    assert ys.min() >= box[1] - 1 and ys.max() <= box[3] + 1
            n += 1
    assert n == len(ds)


def test_bad_inputs_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        DetectionCompose([ToCHW(), Resize(10)])
    with pytest.raises(ValueError, match="canvas_size"):
        bx = tv_tensors.BoundingBoxes(torch.zeros(1, 4), format="XYXY", canvas_size=(5, 5))
        DetectionCompose([Resize(8)])(smooth(10, 10), {"boxes": bx})
    img_dir, ann = write_coco(tmp_path)
    os.symlink(os.path.join(img_dir, "0.jpg"), os.path.join(img_dir, "link.jpg"))
    data = json.loads(open(ann).read())
    data["images"][0]["file_name"] = "link.jpg"
    with open(ann, "w") as f:
        json.dump(data, f)
    with pytest.raises(Exception, match="link.jpg"):
        CocoDetection(img_dir, ann)[0]
    data["images"][0]["file_name"] = "../ann.json"
    with open(ann, "w") as f:
        json.dump(data, f)
    with pytest.raises(ValueError, match="leaves the image folder"):
        CocoDetection(img_dir, ann)


# ---------------------------------------------------------------- unchanged torchvision datasets

def wrapped_coco(img_dir, ann, ops, keys=("image_id", "boxes", "labels", "masks")):
    from torchvision.datasets import CocoDetection as TvCoco, wrap_dataset_for_transforms_v2
    return wrap_dataset_for_transforms_v2(TvCoco(img_dir, ann, transforms=v2.Compose(ops)),
                                          target_keys=set(keys))


@pytest.mark.parametrize("ops", [
    [v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((48, 64)), v2.RandomHorizontalFlip(),
     v2.SanitizeBoundingBoxes()],
    [v2.ToImage(), v2.RandomResizedCrop((40, 56), scale=(0.2, 1.0)), v2.Pad([1, 2, 3, 4]),
     v2.RandomHorizontalFlip(0.7), v2.Resize(30), v2.SanitizeBoundingBoxes(min_size=2)],
])
def test_wrapped_torchvision_coco_runs_fused_with_torchvision_draws(tmp_path, ops):
    pytest.importorskip("pycocotools")
    from pooled_loader.vision.torchvision.detection import accelerate_detection
    img_dir, ann = write_coco(tmp_path)
    theirs = wrapped_coco(img_dir, ann, ops)
    ours = accelerate_detection(theirs)
    assert isinstance(ours, CocoDetection) and len(ours) == len(theirs)
    for i in range(len(ours)):
        if i == 1:
            continue  # no annotations: torchvision's RandomIoUCrop refuses a sample without boxes
        torch.manual_seed(i)
        ti, tt = theirs[i]
        torch.manual_seed(i)
        oi, ot = ours[i]
        assert oi.shape == tuple(ti.shape) and np.abs(oi.astype(int) - ti.numpy()).mean() < 8
        assert ot["image_id"] == tt["image_id"]
        np.testing.assert_array_equal(ot["boxes"], tt["boxes"].numpy())
        np.testing.assert_array_equal(ot["labels"], tt["labels"].numpy())
        np.testing.assert_array_equal(ot["masks"], tt["masks"].numpy())


@pytest.mark.parametrize("ops", [
    [v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((48, 64), antialias=False)],  # an argument
    [v2.ToImage(), v2.RandomPhotometricDistort()],  # an op we do not fuse
    [v2.RandomHorizontalFlip(), v2.ToImage()],  # PIL ops before the decode
    [v2.ToImage(), v2.Resize(32, max_size=40, interpolation=v2.InterpolationMode.NEAREST)],
    [v2.ToImage(), v2.Pad(2, fill=5)],  # a fill we would not give the masks
])
def test_what_cannot_be_honoured_exactly_stays_torchvision(tmp_path, ops):
    pytest.importorskip("pycocotools")
    from pooled_loader.vision.torchvision.detection import accelerate_detection
    img_dir, ann = write_coco(tmp_path)
    theirs = wrapped_coco(img_dir, ann, ops)
    assert accelerate_detection(theirs) is theirs


def test_normalize_after_the_last_resize_is_the_classification_path_s_result():
    from pooled_loader.vision import Compose, Normalize
    img = smooth(70, 90)
    ops = [Resize((32, 40)), ToCHW(), Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))]
    ours, _ = DetectionCompose(ops)(img, {"boxes": np.zeros((0, 4), np.float32)})
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, Compose(ops)(img))


def test_sanitize_drops_per_instance_keypoints_with_their_boxes():
    boxes = np.array([[0, 0, 10, 10], [5, 5, 5, 9], [2, 2, 8, 8]], np.float32)
    kps = np.arange(3 * 2 * 3, dtype=np.float32).reshape(3, 2, 3) % 7
    dc = DetectionCompose([SanitizeBoundingBoxes()])
    _, t = dc(smooth(20, 20), {"boxes": boxes, "labels": np.array([1, 2, 3]), "keypoints": kps})
    assert t["labels"].tolist() == [1, 3]
    np.testing.assert_array_equal(t["keypoints"][..., :2], kps[[0, 2], :, :2])
