"""VOCDetection: a Pascal VOC folder (``JPEGImages/*.jpg``, ``Annotations/*.xml``) read into
``(image, target)`` for the detection path.

The target is what torchvision's ``wrap_dataset_for_transforms_v2(VOCDetection(...))`` gives, as
numpy arrays: ``boxes`` (int64 [N, 4] XYXY, the XML's integers, as torchvision keeps them: its
resize then truncates them, and so does ours) and ``labels`` (int64 [N], the index of each
object's name in :data:`VOC_CLASSES`). An image without objects gets empty arrays (torchvision's
wrapper raises a KeyError there). The image is the file's encoded bytes passed through
``transform`` (a :class:`~pooled_loader.vision.detection.compose.DetectionCompose` starting with
``DecodeImage``), called as ``transform(image, target)``.

Annotation files are untrusted XML: at most ``MAX_XML_BYTES`` and ``MAX_OBJECTS`` objects, read
with expat with a document type or entity declaration refused (no entity expansion, no external
entities: "billion laughs" and XXE never start), every object's name and box checked (a box
coordinate must be a finite number; negative and degenerate boxes are kept, as torchvision keeps
them, for SanitizeBoundingBoxes). Errors name the file. Imports: errors, vision.coco (file reads).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from typing import Any, Callable, Sequence
from xml.parsers import expat

import numpy as np

from pooled_loader.core.errors import SampleError
from pooled_loader.vision.detection.coco import MAX_IMAGE_BYTES, read_regular

MAX_XML_BYTES = 1 << 20  # a VOC annotation is a few kB
MAX_OBJECTS = 10_000
KEYS = ("boxes", "labels")
VOC_CLASSES = ("__background__", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car",
               "cat", "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person",
               "pottedplant", "sheep", "sofa", "train", "tvmonitor")
_INDEX = {name: i for i, name in enumerate(VOC_CLASSES)}


def _refuse(*_: Any) -> None:
    raise ValueError("document type and entity declarations are refused")


def parse_xml(data: bytes) -> ET.Element:
    """The element tree of ``data`` (expat, with DOCTYPE and ENTITY declarations refused)."""
    builder = ET.TreeBuilder()
    parser = expat.ParserCreate()
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartDoctypeDeclHandler = _refuse
    parser.EntityDeclHandler = _refuse
    parser.ExternalEntityRefHandler = _refuse
    parser.StartElementHandler = builder.start
    parser.EndElementHandler = builder.end
    parser.CharacterDataHandler = builder.data
    parser.Parse(data, True)
    return builder.close()


def parse_annotation(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(boxes int64 [N, 4], labels int64 [N]) of a VOC annotation; ValueError naming ``where``."""
    if len(data) > MAX_XML_BYTES:
        raise ValueError(f"{where}: {len(data)} bytes, more than {MAX_XML_BYTES} for an "
                         "annotation")
    try:
        root = parse_xml(data)
    except (ValueError, expat.ExpatError) as e:
        raise ValueError(f"{where}: not a VOC annotation ({e})") from None
    if root.tag != "annotation":
        raise ValueError(f"{where}: the root element is <{root.tag}>, not <annotation>")
    objects = root.findall("object")
    if len(objects) > MAX_OBJECTS:
        raise ValueError(f"{where}: {len(objects)} objects, more than {MAX_OBJECTS}")
    boxes = np.zeros((len(objects), 4), np.int64)
    labels = np.zeros(len(objects), np.int64)
    for n, obj in enumerate(objects):
        name = (obj.findtext("name") or "").strip()
        if name not in _INDEX or name == VOC_CLASSES[0]:
            raise ValueError(f"{where}: object {n} has name {name[:40]!r}, not a VOC class")
        labels[n] = _INDEX[name]
        box = obj.find("bndbox")
        for k, part in enumerate(("xmin", "ymin", "xmax", "ymax")):
            text = None if box is None else box.findtext(part)
            try:
                value = float(text)
            except (TypeError, ValueError):
                value = float("nan")
            if not np.isfinite(value) or abs(value) > 1 << 30:
                raise ValueError(f"{where}: object {n} ({name}) needs a finite bndbox/{part}, "
                                 f"got {text if text is None else text[:40]!r}")
            boxes[n, k] = int(value)
    return boxes, labels


class VOCDetection:
    """``root/JPEGImages/<id>.jpg`` with ``root/Annotations/<id>.xml`` -> ``(image, target)``.

    ``image_set``: the ids of ``root/ImageSets/Main/<image_set>.txt`` (torchvision's order), or
    None for every annotation file, sorted. ``target_keys``: of ("boxes", "labels").
    ``transform(image_bytes, target)`` returns ``(image, target)``; without one the sample is
    ``(encoded bytes as uint8 array, target)``.
    """

    def __init__(self, root: str | os.PathLike, image_set: str | None = "train",
                 transform: Callable[..., Any] | None = None,
                 target_keys: Sequence[str] = KEYS) -> None:
        root = os.fspath(root)
        if image_set is None:
            ids = sorted(f[:-4] for f in os.listdir(os.path.join(root, "Annotations"))
                         if f.endswith(".xml"))
        else:
            split = os.path.join(root, "ImageSets", "Main", f"{image_set}.txt")
            ids = [x.strip() for x in read_regular(split, MAX_XML_BYTES * 64, "VOC image set")
                   .decode("utf-8", "replace").splitlines() if x.strip()]
        for i in ids:
            if "/" in i or "\\" in i or i in (".", ".."):
                raise ValueError(f"{root}: image id {i[:40]!r} leaves the folder")
        self.images = [os.path.join(root, "JPEGImages", i + ".jpg") for i in ids]
        self.annotations = [os.path.join(root, "Annotations", i + ".xml") for i in ids]
        self.transform = transform
        self.target_keys = tuple(target_keys)
        bad = [k for k in self.target_keys if k not in KEYS]
        if bad:
            raise ValueError(f"target_keys {bad} are not supported (choose from {KEYS})")

    @classmethod
    def from_files(cls, images: Sequence[str], annotations: Sequence[str],
                   transform: Callable[..., Any] | None = None,
                   target_keys: Sequence[str] = KEYS) -> "VOCDetection":
        """The dataset of explicit image and annotation paths (torchvision's ``images`` and
        ``targets``)."""
        if len(images) != len(annotations):
            raise ValueError(f"{len(images)} images for {len(annotations)} annotation files")
        ds = cls.__new__(cls)
        ds.images, ds.annotations = list(images), list(annotations)
        ds.transform, ds.target_keys = transform, tuple(target_keys)
        return ds

    def __len__(self) -> int:
        return len(self.images)

    def target(self, index: int) -> dict:
        """The target dict of image ``index`` (before the transform)."""
        path = self.annotations[index]
        boxes, labels = parse_annotation(read_regular(path, MAX_XML_BYTES, "VOC annotation"),
                                         path)
        return {k: (boxes if k == "boxes" else labels) for k in self.target_keys}

    def __getitem__(self, index: int) -> tuple[Any, dict]:
        path = self.images[index]
        try:
            target = self.target(index)
            data = np.frombuffer(read_regular(path, MAX_IMAGE_BYTES, "VOC image"), np.uint8)
            if self.transform is None:
                return data, target
            return self.transform(data, target)
        except SampleError as e:
            raise SampleError(f"{path}: {e}") from e
        except Exception as e:  # name the image, and the annotation's reason
            raise SampleError(f"{path}: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return (f"VOCDetection({len(self)} images, target_keys={self.target_keys}, "
                f"transform={self.transform!r})")


__all__ = ["VOCDetection", "parse_annotation", "parse_xml", "VOC_CLASSES", "MAX_XML_BYTES",
           "MAX_OBJECTS"]
