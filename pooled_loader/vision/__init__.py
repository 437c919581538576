"""Pooled image pipeline: decode, crop/resize, flip, layout and normalize into reused buffers.

``ImageFolder(root, transform=Compose([DecodeImage(), RandomResizedCrop(224),
RandomHorizontalFlip(), ToCHW()]))`` yields ``(uint8 [3, 224, 224], int label)``; under
``PooledLoader`` each sample is written straight into its row of the shared-memory batch slot.
"""
from pooled_loader.vision.compose import Compose
from pooled_loader.vision.decode import DecodeImage
from pooled_loader.vision.folder import IMG_EXTENSIONS, ImageFolder, list_image_folder
from pooled_loader.vision.ops import (CenterCrop, Normalize, Op, RandomHorizontalFlip,
                                      RandomResizedCrop, Resize, Spec, ToCHW)

__all__ = ["ImageFolder", "IMG_EXTENSIONS", "list_image_folder", "Compose", "DecodeImage", "RandomResizedCrop",
           "RandomHorizontalFlip", "Resize", "CenterCrop", "Normalize", "ToCHW", "Op", "Spec"]
