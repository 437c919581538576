"""Detection: an image with its targets (boxes, masks, keypoints) through the same geometry, the
COCO and VOC readers and the batches they make.

- ``targets``: boxes / masks / keypoints through a planned geometry (numpy only);
- ``compose``: ``DetectionCompose`` (image + targets) and its ops ``RandomIoUCrop``, ``Pad``,
  ``SanitizeBoundingBoxes``;
- ``ops``: torchvision v2's ``CenterCrop``, ``RandomZoomOut``, ``Resize(max_size=...)``,
  ``RandomShortestSize``, ``ClampBoundingBoxes``, drawn as torchvision draws;
- ``coco``, ``voc``: ``CocoDetection`` and ``VOCDetection`` folders;
- ``batch``: ``detection_collate`` and the batches of ragged targets.

Imports: numpy, torch, core/, engine/, ragged/, vision/io/ and vision/ops/; nothing of
vision/torchvision/ (which translates torchvision's datasets onto this). Exports what the module
``pooled_loader.vision.detection`` exported before it became this package.
"""
from pooled_loader.vision.detection.compose import (DetectionCompose, Pad, RandomIoUCrop,
                                                    SanitizeBoundingBoxes)

__all__ = ["DetectionCompose", "RandomIoUCrop", "Pad", "SanitizeBoundingBoxes"]
