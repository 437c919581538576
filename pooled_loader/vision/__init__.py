"""Pooled image pipeline: decode, crop/resize, flip, layout and normalize into reused buffers.

``ImageFolder(root, transform=Compose([DecodeImage(), RandomResizedCrop(224),
RandomHorizontalFlip(), ToCHW()]))`` yields ``(uint8 [3, 224, 224], int label)``; under
``PooledLoader`` each sample is written straight into its row of the shared-memory batch slot.

The package is laid out in wings, each with an ``__init__`` that says what it is for and what it
may import: ``io/`` (files, JPEG markers, decoders, resize kernels; the compiled ``_jpeg`` and
``_kernels`` stay here, where setup.py builds them), ``ops/`` (the image ops and RandomResizedCrop's
one box draw), ``detection/`` (targets, detection ops, COCO/VOC, batches) and ``torchvision/``
(torchvision pipelines read onto the fused paths, through one op table). ``base.py`` is the ops'
contract, ``compose.py`` the planner, ``folder.py`` ImageFolder and ``class_check.py`` the class
list check. Every other module directly in vision/ is a kept import path: it is the moved module
under its old name (``pooled_loader.vision.decode`` is ``pooled_loader.vision.io.decode``).
"""
from pooled_loader.vision.compose import Compose
from pooled_loader.vision.io.decode import DecodeImage
from pooled_loader.vision.folder import IMG_EXTENSIONS, ImageFolder, list_image_folder
from pooled_loader.vision.ops import (CenterCrop, Normalize, Op, RandomHorizontalFlip,
                                      RandomResizedCrop, Resize, Spec, ToCHW)



def backend_info() -> dict[str, str]:
    """Which implementations this process uses, e.g. ``{"jpeg_decoder": "roi (libjpeg-turbo
    2.1.5)", "resize_kernel": "c (avx2)"}``: ``jpeg_decoder`` is "roi" (the compiled
    region-of-interest decoder) or "simplejpeg" (whole-image decodes, when the extension was not
    built against libjpeg-turbo or ``POOLED_LOADER_NO_EXT=1``); ``resize_kernel`` is "c (<ISA>)"
    or "opencv"."""
    from pooled_loader.vision.io import decode, kernels

    jpeg = f"roi (libjpeg-turbo {decode.LIBJPEG_VERSION})" if decode.DECODER == "roi" else \
        "simplejpeg (whole image; the ROI decoder is not built or disabled)"
    kernel = f"c ({kernels._kernels.ISA})" if kernels.BACKEND == "c" else "opencv"
    return {"jpeg_decoder": jpeg, "resize_kernel": kernel}


# The layers of vision/, lowest first: a module imports only from its own layer and the ones
# before it, never from one after it (tests/test_vision_layers.py checks every import, lazy
# ones included); the kept import paths come after all of them and nothing in the package
# imports them.
LAYERS = ("base", "io", "ops", "detection", "compose", "class_check", "folder", "torchvision")

__all__ = ["backend_info", "ImageFolder", "IMG_EXTENSIONS", "list_image_folder", "Compose",
           "DecodeImage", "RandomResizedCrop",
           "RandomHorizontalFlip", "Resize", "CenterCrop", "Normalize", "ToCHW", "Op", "Spec"]
