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



def backend_info() -> dict[str, str]:
    """Which implementations this process uses, e.g. ``{"jpeg_decoder": "roi (libjpeg-turbo
    2.1.5)", "resize_kernel": "c (avx2)"}``: ``jpeg_decoder`` is "roi" (the compiled
    region-of-interest decoder) or "simplejpeg" (whole-image decodes, when the extension was not
    built against libjpeg-turbo or ``POOLED_LOADER_NO_EXT=1``); ``resize_kernel`` is "c (<ISA>)"
    or "opencv"."""
    from pooled_loader.vision import decode, kernels

    jpeg = f"roi (libjpeg-turbo {decode.LIBJPEG_VERSION})" if decode.DECODER == "roi" else \
        "simplejpeg (whole image; the ROI decoder is not built or disabled)"
    kernel = f"c ({kernels._kernels.ISA})" if kernels.BACKEND == "c" else "opencv"
    return {"jpeg_decoder": jpeg, "resize_kernel": kernel}


__all__ = ["backend_info", "ImageFolder", "IMG_EXTENSIONS", "list_image_folder", "Compose",
           "DecodeImage", "RandomResizedCrop",
           "RandomHorizontalFlip", "Resize", "CenterCrop", "Normalize", "ToCHW", "Op", "Spec"]
