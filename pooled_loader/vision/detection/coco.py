"""CocoDetection: a COCO-format folder read into ``(image, target)`` for the detection path.

The target is what torchvision's ``wrap_dataset_for_transforms_v2(CocoDetection(...))`` gives,
as numpy arrays: ``image_id``, ``boxes`` (COCO's XYWH converted to XYXY, float32 [N, 4]),
``labels`` (category ids, int64 [N]) and, when asked for in ``target_keys``, ``masks`` (uint8
[N, H, W], polygons and RLE decoded with pycocotools, as torchvision does), ``keypoints``
(float32 [N, K, 3]: x, y, visibility), ``iscrowd`` and ``area``. Crowd annotations are kept, as
torchvision keeps them. The image is the file's encoded bytes passed through ``transform`` (a
:class:`~pooled_loader.vision.detection.DetectionCompose` starting with ``DecodeImage``), called as
``transform(image, target)``.

Files are untrusted: the annotation file must be a regular file under ``MAX_ANNOTATION_BYTES``;
each image is opened ``O_NOFOLLOW | O_NONBLOCK`` and must be a regular file under
``MAX_IMAGE_BYTES``; every annotation's fields are checked (a bad one raises ValueError naming the
annotation id). Failures on one image raise :class:`~pooled_loader.errors.SampleError` naming
the file. Imports: errors; pycocotools only when masks are asked for.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np

from pooled_loader.core.deferred import accepting
from pooled_loader.core.errors import SampleError
from pooled_loader.core.safe_open import open_regular

MAX_ANNOTATION_BYTES = 4 << 30  # COCO's train2017 instances file is 448 MB
MAX_IMAGE_BYTES = 256 << 20  # larger files are refused before they are read
KEYS = ("image_id", "boxes", "labels", "masks", "keypoints", "iscrowd", "area")


def read_regular(path: str, limit: int, what: str = "COCO file") -> bytes:
    """The bytes of ``path``: a regular file (no symlink, no FIFO) of at most ``limit`` bytes."""
    fd = open_regular(path, max_bytes=limit, what=what)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path}: grew past {limit} bytes while read")
    return data


def _number(ann: dict, key: str, where: str) -> float:
    v = ann.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {v!r}")
    return float(v)


class RleMasks:
    """The N instance masks of an h x w image, kept as pycocotools RLEs until read:
    ``decode_instances(select)`` decodes only the instances asked for (the detection path asks
    for those ``SanitizeBoundingBoxes`` keeps), ``np.asarray`` all of them."""

    dtype = np.dtype(np.uint8)
    ndim = 3

    def __init__(self, rles: list, h: int, w: int) -> None:
        self.rles, self.shape = rles, (len(rles), h, w)

    def __len__(self) -> int:
        return len(self.rles)

    def decode_instances(self, select: Any = None) -> np.ndarray:
        """uint8 [k, h, w]: a view of pycocotools' column-major decode of the instances
        ``select`` (all when None), made in one call (the resampling reads that layout)."""
        rles = self.rles if select is None else [self.rles[int(i)] for i in select]
        if not rles:
            return np.zeros((0, *self.shape[1:]), np.uint8)
        from pycocotools import mask as coco_mask
        decoded = coco_mask.decode(rles)  # [h, w, k], column-major
        if decoded.shape != (*self.shape[1:], len(rles)):
            raise ValueError(f"masks of a {self.shape[1]}x{self.shape[2]} image decode to "
                             f"{decoded.shape}")
        return decoded.transpose(2, 0, 1)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.decode_instances()
        return out if dtype is None else out.astype(dtype)


class CocoDetection:
    """``root/<file_name>`` images with COCO ``ann_file`` annotations -> ``(image, target)``.

    ``target_keys``: which target entries to make (default: image_id, boxes, labels, as
    torchvision's wrapper). Images are in the order of their ids, as torchvision's.
    ``transform(image_bytes, target)`` returns ``(image, target)``;
    without one the sample is ``(encoded bytes as uint8 array, target)``.
    """

    def __init__(self, root: str | os.PathLike, ann_file: str | os.PathLike | None,
                 transform: Callable[..., Any] | None = None,
                 target_keys: tuple = ("image_id", "boxes", "labels")) -> None:
        self.root = os.fspath(root)
        self.transform = transform
        self.target_keys = tuple(target_keys)
        bad = [k for k in self.target_keys if k not in KEYS]
        if bad:
            raise ValueError(f"target_keys {bad} are not supported (choose from {KEYS})")
        if ann_file is None:  # from_dict fills the index
            return
        try:
            coco = json.loads(read_regular(os.fspath(ann_file), MAX_ANNOTATION_BYTES))
        except ValueError as e:
            raise ValueError(f"{ann_file}: not a COCO annotation file ({e})") from None
        self._index(coco, os.fspath(ann_file))

    @classmethod
    def from_dict(cls, root: str | os.PathLike, coco: dict,
                  transform: Callable[..., Any] | None = None,
                  target_keys: tuple = ("image_id", "boxes", "labels")) -> "CocoDetection":
        """The dataset of an annotation dict already loaded (``pycocotools.coco.COCO.dataset``)."""
        ds = cls(root, None, transform, target_keys)
        ds._index(coco, "annotations")
        return ds

    def _index(self, coco: Any, ann_file: str) -> None:
        """Images sorted by id (torchvision's order) and their annotations, checked."""
        try:
            images = coco["images"]
            annotations = coco.get("annotations", [])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{ann_file}: not a COCO annotation file ({e!r})") from None
        self.images: list[tuple[int, str, int, int]] = []
        for im in images:
            where = f"{ann_file}: image {im.get('id')!r}" if isinstance(im, dict) else str(ann_file)
            if not isinstance(im, dict) or not isinstance(im.get("file_name"), str) \
                    or not isinstance(im.get("id"), int):
                raise ValueError(f"{where}: an image needs an int 'id' and a 'file_name'")
            name = im["file_name"]
            if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
                raise ValueError(f"{where}: file_name {name!r} leaves the image folder")
            h, w = int(_number(im, "height", where)), int(_number(im, "width", where))
            self.images.append((im["id"], name, h, w))
        self.images.sort()
        ids = {i for i, *_ in self.images}
        if len(ids) != len(self.images):
            raise ValueError(f"{ann_file}: two images have the same id")
        self.anns: dict[int, list[dict]] = {i: [] for i in ids}
        for ann in annotations:
            if not isinstance(ann, dict) or ann.get("image_id") not in ids:
                raise ValueError(f"{ann_file}: annotation {ann!r:.80} names no listed image")
            self.anns[ann["image_id"]].append(ann)

    def __len__(self) -> int:
        return len(self.images)

    def target(self, index: int, lazy_masks: bool = False) -> dict:
        """The target dict of image ``index`` (before the transform); with ``lazy_masks`` the
        masks are an :class:`RleMasks`, decoded when read (what the transform keeps)."""
        image_id, _, h, w = self.images[index]
        anns = self.anns[image_id]
        boxes = np.zeros((len(anns), 4), np.float32)
        for n, ann in enumerate(anns):
            where = f"annotation {ann.get('id')!r}"
            b = ann.get("bbox")
            if not isinstance(b, list) or len(b) != 4:
                raise ValueError(f"{where}: 'bbox' must be [x, y, width, height], got {b!r}")
            boxes[n] = [_number({"v": v}, "v", where) for v in b]
        boxes[:, 2:] += boxes[:, :2]
        out: dict[str, Any] = {}
        for key in self.target_keys:
            if key == "image_id":
                out[key] = image_id
            elif key == "boxes":
                out[key] = boxes
            elif key == "labels":
                out[key] = np.array([int(_number(a, "category_id", f"annotation {a.get('id')}"))
                                     for a in anns], np.int64)
            elif key == "iscrowd":
                out[key] = np.array([int(a.get("iscrowd", 0)) for a in anns], np.uint8)
            elif key == "area":
                out[key] = np.array([_number(a, "area", f"annotation {a.get('id')}")
                                     for a in anns], np.float32)
            elif key == "masks":
                masks = RleMasks(self._rles(anns, h, w), h, w)
                out[key] = masks if lazy_masks else masks.decode_instances()
            else:
                out[key] = self._keypoints(anns)
        return out

    @staticmethod
    def _rles(anns: list[dict], h: int, w: int) -> list:
        """pycocotools RLEs of the annotations' polygons/RLE (an empty one for no polygon)."""
        if not anns:
            return []
        try:
            from pycocotools import mask as coco_mask
        except ImportError as e:
            raise ImportError("masks from COCO polygons/RLE need pycocotools "
                              "(pip install pycocotools)") from e
        rles = []
        for ann in anns:
            seg = ann.get("segmentation")
            if isinstance(seg, dict):
                if not isinstance(seg.get("counts"), (str, bytes)):
                    seg = coco_mask.frPyObjects(seg, h, w)  # uncompressed RLE
            elif isinstance(seg, list):
                seg = coco_mask.merge(coco_mask.frPyObjects(seg, h, w)) if seg else \
                    {"size": [h, w], "counts": coco_mask.encode(np.zeros((h, w, 1), np.uint8,
                                                                         order="F"))[0]["counts"]}
            else:
                raise ValueError(f"annotation {ann.get('id')!r}: 'segmentation' must be polygons "
                                 f"or RLE, got {type(seg).__name__}")
            if list(seg.get("size", ())) != [h, w]:
                raise ValueError(f"annotation {ann.get('id')!r}: mask {seg.get('size')} for a "
                                 f"{h}x{w} image")
            rles.append(seg)
        return rles

    @staticmethod
    def _keypoints(anns: list[dict]) -> np.ndarray:
        rows = []
        for ann in anns:
            kp = ann.get("keypoints", [])
            if not isinstance(kp, list) or len(kp) % 3:
                raise ValueError(f"annotation {ann.get('id')!r}: 'keypoints' must be x, y, v "
                                 "triples")
            rows.append(np.asarray(kp, np.float32).reshape(-1, 3))
        k = max((len(r) for r in rows), default=0)
        out = np.zeros((len(rows), k, 3), np.float32)
        for n, r in enumerate(rows):
            out[n, :len(r)] = r
        return out

    def __getitem__(self, index: int) -> tuple[Any, dict]:
        _, name, _, _ = self.images[index]
        path = os.path.join(self.root, name)
        try:
            data = np.frombuffer(read_regular(path, MAX_IMAGE_BYTES), np.uint8)
            target = self.target(index, lazy_masks=self.transform is not None)
            if self.transform is None:
                return data, target
            if accepting() and getattr(self.transform, "defers_masks", False):
                return self.transform(data, target, defer_masks=True)
            return self.transform(data, target)
        except SampleError as e:
            raise SampleError(f"{path}: {e}") from e
        except Exception as e:  # name the file and the reason
            raise SampleError(f"{path}: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return (f"CocoDetection(root={self.root!r}, {len(self)} images, "
                f"target_keys={self.target_keys}, transform={self.transform!r})")


__all__ = ["CocoDetection", "RleMasks", "read_regular", "MAX_ANNOTATION_BYTES", "MAX_IMAGE_BYTES"]
