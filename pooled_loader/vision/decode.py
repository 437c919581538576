"""Image decoding into reusable buffers.

JPEGs (YCbCr or grayscale) go through libjpeg-turbo, which decodes straight into a given buffer
and can downscale in the DCT domain by 1/2, 1/4 or 1/8 for almost nothing; that is why
:class:`~pooled_loader.vision.Compose` reads the header first and picks the scale from the crop
it is about to take. Two decoders, picked at import (``DECODER`` names the one in use):

- ``"roi"``: the compiled ``pooled_loader.vision._jpeg`` (csrc/jpeg_roi.c, built where the system
  libjpeg-turbo headers are found): :func:`decode_crop_into` decodes only the rows and iMCU
  columns that hold the crop (plus what the resize filter reads around it), with the GIL
  released. Its pixels equal a full decode's, cropped (tests/test_jpeg_roi.py).
- ``"simplejpeg"``: the whole image, via simplejpeg (when the extension is not built, or with
  ``POOLED_LOADER_NO_EXT=1``).

Everything else (PNG, BMP, WebP, CMYK JPEGs, ...) goes through Pillow and is converted to RGB.
Failures raise :class:`~pooled_loader.errors.SampleError` with the reason; the dataset adds the
file name.
"""
from __future__ import annotations

import io
import math
import os
import warnings
from typing import Callable, NamedTuple, Union

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from pooled_loader.errors import SampleError
from pooled_loader.vision.base import Box, Op, Spec, deliver, fits

_jpeg = None
if os.environ.get("POOLED_LOADER_NO_EXT", "").strip().lower() not in ("1", "true", "yes", "on"):
    try:
        from . import _jpeg  # type: ignore[no-redef]
    except ImportError:  # not built (no libjpeg-turbo headers at install time)
        _jpeg = None

#: The JPEG decoder in use: "roi" (compiled, decodes only the crop) or "simplejpeg" (whole image).
DECODER = "roi" if _jpeg is not None else "simplejpeg"
#: libjpeg-turbo version the "roi" decoder was built against (None without it).
LIBJPEG_VERSION = getattr(_jpeg, "LIBJPEG_VERSION", None)

Buffer = Union[bytes, bytearray, memoryview, np.ndarray]
#: ``alloc(nbytes)`` returns a writable 1-D uint8 array of at least ``nbytes`` (a reused buffer).
Alloc = Callable[[int], np.ndarray]

JPEG_SCALES = (1, 2, 4, 8)  # DCT-domain downscale factors libjpeg-turbo does fast
MAX_PIXELS = 1 << 27  # decoded-size limit (134 M pixels, 400 MB RGB); larger images are refused

_JPEG_SOI = b"\xff\xd8\xff"
_TURBO_COLORSPACES = ("YCbCr", "Gray")  # what simplejpeg converts to RGB correctly


class Header(NamedTuple):
    """Size and decode route of an encoded image, read without decoding the pixels."""

    height: int
    width: int
    turbo: bool  # True: a JPEG that libjpeg-turbo decodes; False: Pillow's route
    jpeg: bool  # a JPEG of any colour space (Pillow can DCT-scale these too, via draft)


def _pil_open(data: Buffer) -> Image.Image:
    try:
        with warnings.catch_warnings():  # MAX_PIXELS is the limit here, not Pillow's warning
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise SampleError("not an image (no known image format)") from None
    except Image.DecompressionBombError as e:
        raise SampleError(f"image too large: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's errors for broken headers
        raise SampleError(f"cannot read image header: {e}") from None


def read_header(data: Buffer) -> Header:
    """Return the image's size and decoder route; raise SampleError for empty or non-image data."""
    if len(data) == 0:
        raise SampleError("empty file (0 bytes)")
    if bytes(data[:3]) == _JPEG_SOI:
        try:
            h, w, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            colorspace = None  # unusual JPEG: let Pillow have a go (and name the error)
        if colorspace in _TURBO_COLORSPACES:
            return Header(h, w, True, True)
    im = _pil_open(data)
    return Header(im.height, im.width, False, im.format == "JPEG")


def scaled_size(header: Header, factor: int) -> tuple[int, int]:
    """(height, width) libjpeg produces at DCT scale 1/factor (it rounds up)."""
    return -(-header.height // factor), -(-header.width // factor)


def _check_pixels(h: int, w: int) -> None:
    if h * w > MAX_PIXELS:
        raise SampleError(f"image too large: {w}x{h} pixels decoded exceeds the limit of "
                          f"{MAX_PIXELS} pixels")


def decode_into(data: Buffer, header: Header, alloc: Alloc, factor: int = 1,
                fast: bool = False) -> np.ndarray:
    """Decode to an RGB uint8 HWC array in memory from ``alloc``, downscaled by about 1/factor.

    ``factor`` must be one of JPEG_SCALES; it applies to JPEGs only (other formats decode at full
    size). Callers map coordinates through the returned array's shape, not through ``factor``.
    ``fast``: libjpeg-turbo's fast integer IDCT and chroma upsampling (a few % faster, about one
    level less accurate).
    """
    if factor not in JPEG_SCALES:
        raise ValueError(f"factor must be one of {JPEG_SCALES}, got {factor}")
    if header.turbo:
        h, w = scaled_size(header, factor)
        _check_pixels(h, w)
        buf = alloc(h * w * 3)
        if _jpeg is not None:
            try:
                _jpeg.decode(data, buf, factor, fast=fast)
            except ValueError as e:
                raise SampleError(f"corrupt JPEG: {e}") from None
            return buf[: h * w * 3].reshape(h, w, 3)
        try:
            img = simplejpeg.decode_jpeg(data, colorspace="RGB", min_factor=factor,
                                         min_height=h, min_width=w, buffer=buf,
                                         fastdct=fast, fastupsample=fast)
        except ValueError as e:
            raise SampleError(f"corrupt JPEG: {e}") from None
        if img.shape != (h, w, 3):  # cannot happen with libjpeg-turbo's scaling factors
            raise SampleError(f"JPEG decoded to {img.shape}, expected {(h, w, 3)}")
        return img
    return _decode_pillow(data, header, alloc, factor)


def scale_box(box: Box, full_hw: tuple[int, int], img_hw: tuple[int, int]) -> Box:
    """Map a box on the full-size image onto its downscaled decode (nearest pixel edges)."""
    sy, sx = img_hw[0] / full_hw[0], img_hw[1] / full_hw[1]
    x0, y0 = min(round(box[0] * sx), img_hw[1] - 1), min(round(box[1] * sy), img_hw[0] - 1)
    x1 = min(max(round((box[0] + box[2]) * sx), x0 + 1), img_hw[1])
    y1 = min(max(round((box[1] + box[3]) * sy), y0 + 1), img_hw[0])
    return x0, y0, x1 - x0, y1 - y0


def filter_margin(box_len: int, out_len: int) -> int:
    """Pixels beyond a box's edge that the bilinear resize of box_len to out_len may read
    (its triangle filter's support, which grows with the downscale, plus one for rounding)."""
    return math.ceil(max(box_len / out_len, 1.0)) + 1


class DecodedCrop(NamedTuple):
    """What :func:`decode_crop_into` returns."""

    image: np.ndarray  # RGB uint8 HWC: the whole (scaled) image, or a part of it holding the box
    box: Box  # the requested box, mapped onto ``image``
    scaled: bool  # decoded at a DCT downscale
    region: bool  # only a region was decoded (the "roi" decoder)


def decode_crop_into(data: Buffer, header: Header, alloc: Alloc, factor: int, box: Box,
                     out_hw: tuple[int, int], fast: bool = False) -> DecodedCrop:
    """Decode what a resize of ``box`` (on the full-size image) to ``out_hw`` needs, downscaled
    by about 1/factor, into memory from ``alloc``.

    With the "roi" decoder and a YCbCr/grey JPEG only the rows and columns holding the box, plus
    the resize filter's margin around it, are decoded, so resizing ``result.box`` of
    ``result.image`` reads exactly the pixels it would read from the whole decode. Otherwise the
    whole image is decoded (as :func:`decode_into`) and the box mapped onto it.
    """
    full = (header.height, header.width)
    if not (header.turbo and _jpeg is not None):
        img = decode_into(data, header, alloc, factor, fast)
        scaled = img.shape[:2] != full
        return DecodedCrop(img, scale_box(box, full, img.shape[:2]) if scaled else box, scaled,
                           False)
    if factor not in JPEG_SCALES:
        raise ValueError(f"factor must be one of {JPEG_SCALES}, got {factor}")
    sh, sw = scaled_size(header, factor)
    _check_pixels(sh, sw)
    x0, y0, bw, bh = scale_box(box, full, (sh, sw)) if factor > 1 else box
    mx, my = filter_margin(bw, out_hw[1]), filter_margin(bh, out_hw[0])
    rx0, ry0 = max(x0 - mx, 0), max(y0 - my, 0)
    rx1, ry1 = min(x0 + bw + mx, sw), min(y0 + bh + my, sh)
    rh = ry1 - ry0
    buf = alloc(rh * sw * 3)  # the widest the region can get (iMCU alignment) is the full width
    try:
        xoff, width = _jpeg.decode(data, buf, factor, rx0, ry0, rx1 - rx0, rh, fast)
    except ValueError as e:
        raise SampleError(f"corrupt JPEG: {e}") from None
    img = buf[: rh * width * 3].reshape(rh, width, 3)
    return DecodedCrop(img, (x0 - xoff, y0 - ry0, bw, bh), factor > 1, True)


def _decode_pillow(data: Buffer, header: Header, alloc: Alloc, factor: int) -> np.ndarray:
    im = _pil_open(data)
    if header.jpeg and factor > 1:  # DCT scaling for the JPEGs libjpeg-turbo's RGB path skips
        im.draft(im.mode, (header.width // factor, header.height // factor))
    _check_pixels(im.height, im.width)
    try:
        im = im.convert("RGB")  # decodes; palette, grey, alpha, CMYK -> RGB
    except (OSError, SyntaxError, ValueError) as e:
        raise SampleError(f"corrupt {im.format or 'image'} data: {e}") from None
    h, w = im.height, im.width
    img = alloc(h * w * 3)[: h * w * 3].reshape(h, w, 3)
    img[...] = np.asarray(im)
    return img


class DecodeImage(Op):
    """Encoded image bytes -> RGB uint8 ``[H, W, 3]``.

    Placed first in a :class:`~pooled_loader.vision.Compose` and followed by a resizing crop, it is
    fused with it: the crop is sampled from the header's size and the JPEG is decoded at the
    smallest DCT scale that keeps the crop at least as large as the output. ``fast=True`` uses
    libjpeg-turbo's fast IDCT and upsampling (a few % faster, about one level less accurate).
    """

    def __init__(self, fast: bool = False) -> None:
        self.fast = bool(fast)

    def spec(self, spec: Spec) -> Spec:
        raise TypeError("DecodeImage's output depends on the data: use header_spec(data)")

    def header_spec(self, data: Buffer) -> Spec:
        """The output spec for ``data``, from its header."""
        h = read_header(data)
        return Spec((h.height, h.width, 3), np.dtype(np.uint8), "HWC")

    def apply(self, x: Buffer, out: np.ndarray, params: object, spec: Spec) -> np.ndarray:
        flat = out.reshape(-1)  # out is C-contiguous: a view
        decode_into(x, read_header(x), lambda n: flat, fast=self.fast)
        return out

    def __call__(self, x: Buffer, out: np.ndarray | None = None) -> np.ndarray:  # type: ignore[override]
        """Decode ``x`` alone, into ``out`` when it fits (the image's own size), else a new
        array."""
        hdr = read_header(x)
        spec = Spec((hdr.height, hdr.width, 3), np.dtype(np.uint8), "HWC")
        flat = (out if fits(out, spec) else np.empty(spec.shape, spec.dtype)).reshape(-1)
        return deliver(decode_into(x, hdr, lambda n: flat, fast=self.fast), out)

    def __repr__(self) -> str:
        return "DecodeImage(fast=True)" if self.fast else "DecodeImage()"
