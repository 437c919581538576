"""Image decoding into reusable buffers.

JPEGs (YCbCr or grayscale) go through libjpeg-turbo (``simplejpeg``), which decodes straight into a
given buffer and can downscale in the DCT domain by 1/2, 1/4 or 1/8 for almost nothing; that is
why :class:`~pooled_loader.vision.Compose` reads the header first and picks the scale from the
crop it is about to take. Everything else (PNG, BMP, WebP, CMYK JPEGs, ...) goes through Pillow
and is converted to RGB. Failures raise :class:`~pooled_loader.errors.SampleError` with the reason;
the dataset adds the file name.
"""
from __future__ import annotations

import io
import warnings
from typing import Callable, NamedTuple, Union

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from pooled_loader.errors import SampleError
from pooled_loader.vision.ops import Op, Spec

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

    def __repr__(self) -> str:
        return "DecodeImage(fast=True)" if self.fast else "DecodeImage()"
