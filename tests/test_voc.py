"""VOC on the fused detection path: a VOC folder written here (odd sizes, border, degenerate and
negative boxes, an image without objects), against torchvision's wrapped VOCDetection with the
same seed, through PooledLoader's workers, and hostile annotation files refused naming the file."""
import io
import os

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2

from pooled_loader import PooledLoader
from pooled_loader.core.errors import SampleError
from pooled_loader.vision import DecodeImage, Resize, ToCHW
from pooled_loader.vision.detection import DetectionCompose, SanitizeBoundingBoxes
from pooled_loader.vision.detection.batch import detection_collate, per_image
from pooled_loader.vision.torchvision.detection import accelerate_detection
from pooled_loader.vision.detection.voc import MAX_XML_BYTES, VOCDetection, parse_annotation
from test_detection import smooth

SIZES = [(97, 131), (64, 64), (203, 151), (45, 301), (120, 80)]


def xml(objects, w=10, h=10):
    body = "".join(
        f"<object><name>{name}</name><difficult>0</difficult><bndbox><xmin>{b[0]}</xmin>"
        f"<ymin>{b[1]}</ymin><xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>"
        for name, b in objects)
    return (f"<annotation><folder>VOC2012</folder><size><width>{w}</width><height>{h}</height>"
            f"<depth>3</depth></size>{body}</annotation>").encode()


def write_voc(tmp_path):
    """root for torchvision (root/VOCdevkit/VOC2012/...) and the VOC folder itself."""
    voc = tmp_path / "VOCdevkit" / "VOC2012"
    for d in ("JPEGImages", "Annotations", "ImageSets/Main"):
        os.makedirs(voc / d)
    ids = []
    for i, (h, w) in enumerate(SIZES):
        name = f"2008_{i:06d}"
        buf = io.BytesIO()
        Image.fromarray(smooth(h, w, i)).save(buf, "JPEG", quality=95)
        (voc / "JPEGImages" / f"{name}.jpg").write_bytes(buf.getvalue())
        objs = [("dog", (2, 3, w // 2, h // 2)), ("person", (0, 0, w, h)),  # on every border
                ("car", (w - 1, 5, w - 1, 15)),  # degenerate: no width
                ("tvmonitor", (-4, h // 3, w // 3, h - 2))]  # negative: kept, then clipped
        (voc / "Annotations" / f"{name}.xml").write_bytes(xml(objs if i != 1 else objs[:1], w, h))
        ids.append(name)
    (voc / "ImageSets" / "Main" / "train.txt").write_text("\n".join(ids) + "\n")
    return str(tmp_path), str(voc)


def wrapped_voc(root, ops):
    from torchvision.datasets import VOCDetection as TvVOC, wrap_dataset_for_transforms_v2
    return wrap_dataset_for_transforms_v2(TvVOC(root, "2012", "train",
                                                transforms=v2.Compose(ops)))


def test_voc_targets_equal_torchvision_wrapped_voc_detection(tmp_path):
    from torchvision.datasets import VOCDetection as TvVOC, wrap_dataset_for_transforms_v2
    root, voc = write_voc(tmp_path)
    ours = VOCDetection(voc)
    theirs = wrap_dataset_for_transforms_v2(TvVOC(root, "2012", "train"))
    assert len(ours) == len(theirs) == len(SIZES)
    for i in range(len(ours)):
        t, (_, tt) = ours.target(i), theirs[i]
        assert t["boxes"].dtype == np.int64
        np.testing.assert_array_equal(t["boxes"], tt["boxes"].numpy())
        np.testing.assert_array_equal(t["labels"], tt["labels"].numpy())


@pytest.mark.parametrize("ops", [
    [v2.ToImage(), v2.RandomIoUCrop(), v2.Resize((48, 64)), v2.RandomHorizontalFlip(),
     v2.SanitizeBoundingBoxes()],
    [v2.ToImage(), v2.RandomZoomOut(side_range=(1.0, 2.0), p=0.7),
     v2.RandomShortestSize([33, 41], max_size=77), v2.CenterCrop(37),
     v2.RandomHorizontalFlip(), v2.ClampBoundingBoxes(), v2.SanitizeBoundingBoxes()],
    # RandomIoUCrop draws on the boxes a resize truncated
    [v2.ToImage(), v2.Resize(41), v2.RandomIoUCrop(), v2.Resize((30, 44)),
     v2.SanitizeBoundingBoxes()],
])
def test_wrapped_torchvision_voc_runs_fused_with_torchvision_draws(tmp_path, ops):
    root, _ = write_voc(tmp_path)
    theirs = wrapped_voc(root, ops)
    ours = accelerate_detection(theirs)
    assert isinstance(ours, VOCDetection) and len(ours) == len(theirs)
    for seed in range(3):
        for i in range(len(ours)):
            torch.manual_seed(seed * 100 + i)
            ti, tt = theirs[i]
            after = torch.rand(1)
            torch.manual_seed(seed * 100 + i)
            oi, ot = ours[i]
            assert torch.rand(1) == after
            assert oi.shape == tuple(ti.shape) and np.abs(oi.astype(int) - ti.numpy()).mean() < 8
            assert ot["boxes"].dtype == np.int64  # integers, truncated by resizes as torchvision
            np.testing.assert_array_equal(ot["boxes"], tt["boxes"].numpy())
            np.testing.assert_array_equal(ot["labels"], tt["labels"].numpy())


def test_what_cannot_be_honoured_stays_torchvision(tmp_path):
    from torchvision.datasets import VOCDetection as TvVOC, wrap_dataset_for_transforms_v2
    root, _ = write_voc(tmp_path)
    annotated = wrap_dataset_for_transforms_v2(
        TvVOC(root, "2012", "train", transforms=v2.Compose([v2.ToImage()])),
        target_keys={"annotation", "boxes"})  # the XML as a dict: not made here
    assert accelerate_detection(annotated) is annotated
    photometric = wrapped_voc(root, [v2.ToImage(), v2.RandomPhotometricDistort()])
    assert accelerate_detection(photometric) is photometric


def test_voc_through_pooled_loader_workers_equals_the_dataset(tmp_path):
    _, voc = write_voc(tmp_path)
    dc = DetectionCompose([DecodeImage(), Resize((40, 56)), ToCHW(), SanitizeBoundingBoxes()])
    ds = VOCDetection(voc, image_set=None, transform=dc)
    loader = PooledLoader(ds, batch_size=2, num_workers=2, collate_fn=detection_collate())
    n = 0
    for images, tg in loader:
        for j, t in enumerate(per_image(tg)):
            img, ref = ds[n]
            assert torch.equal(images[j], torch.from_numpy(img))
            assert torch.equal(t["boxes"], torch.from_numpy(ref["boxes"]))
            assert torch.equal(t["labels"], torch.from_numpy(ref["labels"]))
            assert 7 not in t["labels"].tolist()  # the degenerate car went, with its label
            n += 1
    assert n == len(ds)


def test_an_image_without_objects_gets_empty_targets():
    boxes, labels = parse_annotation(xml([]), "a.xml")
    assert boxes.shape == (0, 4) and labels.shape == (0,)


@pytest.mark.parametrize("data,match", [
    (b"<?xml version='1.0'?><!DOCTYPE lolz [<!ENTITY lol 'lol'><!ENTITY lol2 "
     b"'&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;'>]><annotation>&lol2;</annotation>",
     "declarations are refused"),  # billion laughs, cut short
    (b"<?xml version='1.0'?><!DOCTYPE a [<!ENTITY x SYSTEM 'file:///etc/passwd'>]>"
     b"<annotation><object><name>&x;</name></object></annotation>", "declarations are refused"),
    ("<?xml version='1.0' encoding='UTF-16'?><!DOCTYPE a [<!ENTITY x 'y'>]><annotation/>"
     .encode("utf-16"), "declarations are refused"),  # not visible to a byte search
    (b"<annotation><object><name>dog</name></object></annotation>", "bndbox/xmin"),
    (xml([("dog", (1, 2, "", 4))]), "bndbox/xmax"),
    (xml([("dog", (1, "nan", 3, 4))]), "bndbox/ymin"),
    (xml([("dog", (1, 2, "inf", 4))]), "bndbox/xmax"),
    (xml([("dragon", (1, 2, 3, 4))]), "not a VOC class"),
    (xml([("", (1, 2, 3, 4))]), "not a VOC class"),
    (b"<notes/>", "not <annotation>"),
    (b"<annotation><object>", "not a VOC annotation"),
    (b"<annotation>" + b" " * MAX_XML_BYTES + b"</annotation>", "more than"),
])
def test_hostile_annotations_are_refused_naming_the_file(data, match):
    with pytest.raises(ValueError, match=match) as e:
        parse_annotation(data, "/data/Annotations/x.xml")
    assert "/data/Annotations/x.xml" in str(e.value)


def test_negative_and_degenerate_boxes_are_kept_for_sanitize():
    boxes, labels = parse_annotation(xml([("cat", (-3, -2, 5, 6)), ("cow", (8, 8, 2, 9))]), "x")
    assert boxes.tolist() == [[-3, -2, 5, 6], [8, 8, 2, 9]] and labels.tolist() == [8, 10]
    _, t = DetectionCompose([SanitizeBoundingBoxes()])(smooth(10, 10), {"boxes": boxes,
                                                                        "labels": labels})
    assert t["boxes"].shape == (0, 4) and t["labels"].shape == (0,)


def test_bad_files_on_disk_are_refused_naming_them(tmp_path):
    _, voc = write_voc(tmp_path)
    ann = os.path.join(voc, "Annotations")
    huge = os.path.join(ann, "2008_000000.xml")
    with open(huge, "wb") as f:
        f.truncate(MAX_XML_BYTES + 1)
    ds = VOCDetection(voc)
    with pytest.raises(SampleError, match="2008_000000"):
        ds[0]
    os.remove(os.path.join(ann, "2008_000002.xml"))
    os.symlink("/etc/hostname", os.path.join(ann, "2008_000002.xml"))
    with pytest.raises(SampleError, match="2008_000002"):
        ds[2]
    os.remove(os.path.join(ann, "2008_000003.xml"))
    os.mkfifo(os.path.join(ann, "2008_000003.xml"))  # never blocks
    with pytest.raises(SampleError, match="2008_000003"):
        ds[3]
    with open(os.path.join(voc, "ImageSets", "Main", "evil.txt"), "w") as f:
        f.write("../../../etc/passwd\n")
    with pytest.raises(ValueError, match="leaves the folder"):
        VOCDetection(voc, image_set="evil")


def test_random_iou_crop_sees_integer_boxes_truncated_by_a_resize_before_it():
    from pooled_loader.vision.detection import RandomIoUCrop
    seen = []

    class Recording(RandomIoUCrop):
        def draw(self, canvas, xyxy):
            seen.append(np.array(xyxy))
            return None

    dc = DetectionCompose([Resize((7, 9)), Recording(), ToCHW()])
    boxes = np.array([[1, 2, 7, 9]], np.int64)
    _, t = dc(smooth(10, 13), {"boxes": boxes})
    ref = v2.Resize((7, 9))(tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(10, 13)))
    assert ref.tolist() == [[0, 1, 4, 6]]  # torchvision casts back to int64: truncated
    assert seen[0].tolist() == [[0, 1, 4, 6]] and t["boxes"].tolist() == [[0, 1, 4, 6]]


def test_unchanged_wrapped_voc_is_routed_by_pooled_loader_with_dataloaders_samples(tmp_path):
    """PooledLoader routes a wrapped torchvision VOCDetection by itself: through 2 workers the
    user's collate_fn gets what DataLoader gives (types, keys, boxes and labels) for one seed."""
    from test_detection_routing import both, same_target
    from torchvision import tv_tensors
    root, _ = write_voc(tmp_path)
    ds = wrapped_voc(root, [v2.ToImage(), v2.RandomZoomOut(side_range=(1.0, 2.0), p=0.7),
                            v2.RandomIoUCrop(), v2.Resize((40, 48)), v2.RandomHorizontalFlip(),
                            v2.SanitizeBoundingBoxes()])
    want, got, loader = both(ds)
    assert loader.stats()["transforms"]["as_is"] == []
    assert len(loader.stats()["transforms"]["fused"]) == 6
    assert len(got) == len(want)
    for (images_a, targets_a), (images_b, targets_b) in zip(want, got):
        for xa, xb in zip(images_a, images_b):
            assert type(xb) is tv_tensors.Image and xb.shape == xa.shape
        for ta, tb in zip(targets_a, targets_b):
            same_target(ta, tb)


def test_a_cache_fingerprint_names_detection_datasets_by_their_released_path(tmp_path):
    """CocoDetection and VOCDetection moved into vision/detection/ (issue 46); a cache built
    from one before the move must still fit, so the fingerprint keeps the released class path."""
    from pooled_loader.cache import fingerprint_info
    from pooled_loader.vision.detection.coco import CocoDetection
    from test_detection import write_coco
    _, voc = write_voc(tmp_path / "voc")
    assert fingerprint_info(VOCDetection(voc))["class"] == "pooled_loader.vision.voc.VOCDetection"
    img_dir, ann = write_coco(tmp_path / "coco")
    assert fingerprint_info(CocoDetection(img_dir, ann))["class"] == \
        "pooled_loader.vision.coco.CocoDetection"
