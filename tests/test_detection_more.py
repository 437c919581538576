"""More torchvision v2 detection ops on the fused path (CenterCrop, RandomZoomOut, Resize with
max_size, RandomShortestSize, ClampBoundingBoxes) against an unchanged v2 Compose run on
tv_tensors with the same torch seed: boxes to 1e-4, masks and keypoints exactly, draw for draw."""
import numpy as np
import pytest
import torch
from torchvision import tv_tensors
from torchvision.transforms import v2

from pooled_loader.vision import ToCHW
from pooled_loader.vision.detection.coco import CocoDetection
from pooled_loader.vision.detection import DetectionCompose
from pooled_loader.vision.detection.ops import CenterCrop, RandomZoomOut, TorchResize
from pooled_loader.vision.torchvision.detection import (_op, accelerate_detection,
                                                       translate_transforms)
from test_detection import smooth, wrapped_coco, write_coco

IMAGE_FILL = {tv_tensors.Image: (11, 22, 33), "others": 0}


def tv_ops(rng, h, w):
    """A random v2 pipeline of the new ops (with flips between them)."""
    short = int(rng.integers(6, 90))
    pool = [
        v2.CenterCrop([int(v) for v in rng.integers(3, [h + 9, w + 9])]),  # past the image too
        v2.CenterCrop(int(rng.integers(3, 80))),
        v2.RandomZoomOut(fill=IMAGE_FILL, side_range=(1.0, float(rng.uniform(1.0, 2.5))),
                         p=0.7),
        v2.Resize(short, max_size=short + int(rng.integers(1, 60))),
        v2.Resize(None, max_size=int(rng.integers(8, 120))),
        v2.RandomShortestSize([int(v) for v in rng.integers(6, 70, 3)],
                              int(rng.integers(70, 140))),
        v2.RandomHorizontalFlip(0.5),
        v2.ClampBoundingBoxes(),
    ]
    picked = [pool[i] for i in rng.choice(len(pool), int(rng.integers(1, 5)), replace=False)]
    if any(type(t) is v2.CenterCrop for t in picked):  # its padding is 0: one fill per render
        picked = [v2.RandomZoomOut(0, t.side_range, t.p) if type(t) is v2.RandomZoomOut else t
                  for t in picked]
    return picked + [v2.SanitizeBoundingBoxes()]


def inputs(rng, h, w, n):
    xy = rng.uniform(-4, [w, h], (n, 2))
    xyxy = np.concatenate([xy, xy + rng.uniform(0, 70, (n, 2))], 1).astype(np.float32)
    if n >= 2:
        xyxy[0] = [0, 0, w, h]  # on every border
        xyxy[1] = [w - 1, 3, w - 1, 9]  # degenerate: no width
    boxes = tv_tensors.BoundingBoxes(torch.from_numpy(xyxy), format="XYXY", canvas_size=(h, w))
    masks = tv_tensors.Mask(torch.from_numpy(rng.integers(0, 2, (n, h, w), dtype=np.uint8)))
    kps = tv_tensors.KeyPoints(torch.from_numpy(rng.uniform(0, [w, h], (n + 2, 2))
                                                .astype(np.float32)), canvas_size=(h, w))
    labels = torch.arange(n)
    return boxes, masks, kps, labels


@pytest.mark.parametrize("seed", range(4))
def test_new_ops_equal_torchvision_draw_for_draw(seed):
    rng = np.random.default_rng(seed)
    for trial in range(30):
        h, w = (int(v) for v in rng.integers(7, 140, 2))  # odd sizes among them
        n = int(rng.integers(0, 5))  # empty targets too
        tops = tv_ops(rng, h, w)
        ours = translate_transforms(v2.Compose([v2.ToImage()] + tops))
        assert ours is not None, tops  # recognised by the translator
        dc = DetectionCompose(ours.ops[1:])  # the same ops, fed a CHW tensor instead of bytes
        img = tv_tensors.Image(torch.from_numpy(smooth(h, w, trial)).permute(2, 0, 1))
        boxes, masks, kps, labels = inputs(rng, h, w, n)
        torch.manual_seed(trial)
        try:
            ti, tt = v2.Compose(tops)(img, {"boxes": boxes, "masks": masks, "keypoints": kps,
                                            "labels": labels})
        except RuntimeError as e:  # a side resized to 0 pixels: we refuse it too
            assert "greater than 0" in str(e)
            with pytest.raises(ValueError, match="needs pixels"):
                dc(img, {"boxes": boxes, "masks": masks})
            continue
        after = torch.rand(1)  # the generators must stand at the same place afterwards
        torch.manual_seed(trial)
        oi, ot = dc(img, {"boxes": boxes, "masks": masks, "keypoints": kps, "labels": labels})
        assert torch.rand(1) == after, dc
        assert oi.shape == tuple(ti.shape), dc
        np.testing.assert_allclose(ot["boxes"], tt["boxes"].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_array_equal(ot["labels"], tt["labels"].numpy())
        np.testing.assert_array_equal(ot["masks"], tt["masks"].numpy())
        np.testing.assert_array_equal(ot["keypoints"], tt["keypoints"].numpy())
        if not any(type(t) in (v2.Resize, v2.RandomShortestSize) for t in tops):
            np.testing.assert_array_equal(oi, ti.numpy())  # crops, pads, flips: the same pixels


def test_center_crop_past_the_image_keeps_torchvision_s_one_pixel_shift_of_the_boxes():
    # 5 -> 8 rows: the image is padded by (8 - 5) // 2 = 1 on top, boxes move by
    # -round(-1.5) = 2 (torchvision's two anchors disagree when crop - size is 3 mod 4)
    img = tv_tensors.Image(torch.from_numpy(smooth(5, 6)).permute(2, 0, 1))
    boxes = tv_tensors.BoundingBoxes([[1.0, 1.0, 4.0, 3.0]], format="XYXY", canvas_size=(5, 6))
    ti, tb = v2.CenterCrop((8, 6))(img, boxes)
    oi, ot = DetectionCompose([CenterCrop((8, 6)), ToCHW()])(img, {"boxes": boxes})
    assert tb.tolist() == [[1.0, 3.0, 4.0, 5.0]]
    np.testing.assert_array_equal(ot["boxes"], tb.numpy())
    np.testing.assert_array_equal(oi, ti.numpy())
    assert not oi[:, 0].any() and oi[:, 1].any()  # one padded row on top, as torchvision


def test_zoom_out_pads_the_image_with_its_fill_and_masks_with_zero():
    img = torch.full((3, 9, 7), 200, dtype=torch.uint8)
    masks = tv_tensors.Mask(torch.ones(1, 9, 7, dtype=torch.uint8))
    dc = DetectionCompose([RandomZoomOut(fill=(11, 22, 33), side_range=(3.0, 3.0), p=1.0),
                           ToCHW()])
    torch.manual_seed(0)
    oi, ot = dc(img, {"masks": masks})
    assert oi.shape == (3, 27, 21) and ot["masks"].shape == (1, 27, 21)
    assert ot["masks"].sum() == 63 and (oi == 200).all(axis=0).sum() == 63
    assert {tuple(oi[:, y, x]) for y in (0, 26) for x in (0, 20)} == {(11, 22, 33)}


def test_resize_with_max_size_is_torchvision_s_size():
    for h, w in [(7, 300), (300, 7), (64, 64), (33, 17), (480, 640)]:
        for size, max_size in [(10, 11), (50, 80), (5, 600), (None, 40), (None, 900)]:
            ours = TorchResize(size, max_size).out_hw(h, w)
            try:
                out = v2.Resize(size, max_size=max_size)(torch.zeros(1, h, w, dtype=torch.uint8))
            except RuntimeError:  # a side of 0 pixels, which Geometry refuses
                assert 0 in ours
                continue
            assert ours == tuple(out.shape[-2:]), (h, w, size, max_size)


@pytest.mark.parametrize("op", [
    v2.RandomZoomOut(fill=5),  # masks would be padded with 5
    v2.RandomZoomOut(fill={tv_tensors.Image: 1.5, "others": 0}),  # not a uint8 fill
    v2.Resize(20, max_size=40, antialias=False),
    v2.RandomShortestSize([20, 30], interpolation=v2.InterpolationMode.NEAREST),
    v2.ClampBoundingBoxes(clamping_mode="hard"),
])
def test_what_the_new_ops_cannot_honour_stays_torchvision(op):
    assert _op(op) is None
    assert translate_transforms(v2.Compose([v2.ToImage(), op])) is None


def test_two_different_fills_stay_torchvision():
    ops = [v2.ToImage(), v2.RandomZoomOut(fill=IMAGE_FILL), v2.CenterCrop(30)]
    assert translate_transforms(v2.Compose(ops)) is None
    assert translate_transforms(v2.Compose([v2.ToImage(), v2.RandomZoomOut(),
                                            v2.CenterCrop(30)])) is not None


def test_a_clamp_after_the_last_resize_keeps_the_fused_resize():
    ops = [_op(t) for t in [v2.Resize((10, 12)), v2.ClampBoundingBoxes()]]
    dc = DetectionCompose(ops + [ToCHW()])
    assert [s.kind for s in dc.draw((20, 30), None).steps] == ["resize", "crop"]
    boxes = np.array([[-3, 2, 40, 25]], np.float32)
    img = smooth(20, 30)
    out, t = dc(img, {"boxes": boxes})
    ref, _ = DetectionCompose([ops[0], ToCHW()])(img, {"boxes": boxes})
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(t["boxes"], [[0, 1, 12, 10]])


@pytest.mark.parametrize("ops", [
    [v2.ToImage(), v2.RandomZoomOut(fill=IMAGE_FILL, side_range=(1.0, 2.0), p=0.8),
     v2.RandomShortestSize([40, 48, 56], max_size=90), v2.RandomHorizontalFlip(),
     v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes()],
    [v2.ToImage(), v2.RandomZoomOut(side_range=(1.0, 1.5)), v2.Resize(50, max_size=70),
     v2.CenterCrop(45), v2.RandomHorizontalFlip(), v2.SanitizeBoundingBoxes()],
])
def test_wrapped_coco_with_the_new_ops_runs_fused_with_torchvision_draws(tmp_path, ops):
    pytest.importorskip("pycocotools")
    img_dir, ann = write_coco(tmp_path)
    theirs = wrapped_coco(img_dir, ann, ops)
    ours = accelerate_detection(theirs)
    assert isinstance(ours, CocoDetection)
    for i in range(len(ours)):
        torch.manual_seed(i)
        oi, ot = ours[i]
        torch.manual_seed(i)
        try:
            ti, tt = theirs[i]
        except ValueError:  # an image without annotations: torchvision finds no labels
            assert ot["boxes"].shape == (0, 4) and len(ot["labels"]) == 0
            continue
        assert oi.shape == tuple(ti.shape) and np.abs(oi.astype(int) - ti.numpy()).mean() < 8
        np.testing.assert_allclose(ot["boxes"], tt["boxes"].numpy(), atol=1e-4, rtol=0)
        np.testing.assert_array_equal(ot["labels"], tt["labels"].numpy())
        np.testing.assert_array_equal(ot["masks"], tt["masks"].numpy())
