"""AutoAugment-family pixel ops, in place on a uint8 CHW image, as torchvision or timm does them.

``apply_op(img, name, magnitude, ...)`` does what ``torchvision.transforms.autoaugment._apply_op``
does for the same op name and magnitude (v2's ``_apply_image_or_video_transform`` is the same
mapping except Solarize: here, as in v1, the magnitude is the threshold, so v2's ``magnitude``
arrives as ``255 * magnitude``), on a C-contiguous (3, H, W) uint8 array, e.g. a row of a batch
slot. ``arithmetic="pil"`` reproduces torchvision on a PIL image (Pillow's ``ImageEnhance``
blends, ``ImageOps`` tables, ``Image.transform``), ``"tensor"`` torchvision v2 on a uint8 tensor
(float32 blends, FMA included, truncated; ``grid_sample`` geometry). ``augmix_mix`` is AugMix's
mixing, ``apply_timm_op`` timm's RandAugment ops (Pillow arithmetic). Every op of timm's
``rand-*`` op lists maps (and the non-"Increasing" variants, Desaturate); timm's GaussianBlur,
GaussianBlurRand (AutoAugment "3a" only) do not.

How: colour ops are 256-entry tables (``cv2.LUT``) or float32 passes with ``out=`` (v2's FMAs
reproduced in float64); Sharpness is ``cv2.filter2D`` (Pillow's SMOOTH, exact) then the blend;
translations are whole-pixel copies. Nearest rotate/shear gather through ``cv2.remap`` with
source indices computed as the reference does (Pillow's 16.16 fixed point, v2's float32 grid),
so ties break the same way. Bilinear/bicubic are ``cv2.warpAffine`` on float32 planes with the
inverse matrix moved to OpenCV's pixel centres, then truncated (Pillow) or rounded half to even
(tensors); Pillow's border (edge pixels replicated, fill where the sample point is outside)
comes from a nearest warp of a blank plane, v2's fill blend from a warped ones plane.
Temporaries live in the caller's ``Scratch`` (names ``aa.*``): steady-state calls allocate only
O(256 + H + W) temporaries (tables, index vectors) and the 2x3 matrix.

Measured against torchvision 0.29 / Pillow 13 / timm 1.0.31 on JPEGs (223x171, 224x224, grey and
CMYK sources), the magnitudes of tests/test_autoaugment_ops.py, fill None / zeros / per channel;
worst case over images and magnitudes of mean abs diff / max abs diff ("=": bit-exact):

=====================================  ============  ==================  ================
op                                     pil           tensor v2           tensor v1
=====================================  ============  ==================  ================
Identity, Invert, Posterize, Solarize  =             =                   =
Equalize, Brightness, Contrast         =             =                   =
AutoContrast / Color / Sharpness       =             =                   .011 .014 .086 /1
TranslateX/Y (any interpolation)       =             =                   =
ShearX/Y, Rotate: nearest              =             =                   =
ShearX/Y, Rotate: bilinear             .0007 / 1     .030 / 1            .030 / 1
Rotate, Shear, Translate: bicubic      .29 / 9       (refused)
AugMix mix, nearest / bilinear                       = / .01 / 1         .001 / 1, .01 / 1
timm colour and table ops              =
timm Rotate/ShearX/Y bilinear          .0007 / 1
timm TranslateX/YRel bilinear          .034 / 1
=====================================  ============  ==================  ================

Bicubic is OpenCV's a=-0.75 kernel against Pillow's a=-1. Posterize to 0 bits gives zeros, as
tensors do; timm's ops (Pillow's) raise what the installed Pillow raises for it (Pillow 13
refuses 0 bits, which timm's PosterizeIncreasing asks for at level 10).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from pooled_loader.vision.io.buffers import Scratch
from pooled_loader.vision.io.kernels import _get_cv2
from pooled_loader.vision.ops import jitter

__all__ = ["OPS", "TIMM_OPS", "apply_op", "augmix_mix", "apply_timm_op"]

OPS = frozenset({"Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate",
                 "Brightness", "Color", "Contrast", "Sharpness", "Posterize", "Solarize",
                 "AutoContrast", "Equalize", "Invert"})
_ARITHMETIC = ("pil", "tensor")
_RAMP = np.arange(256, dtype=np.float64)
_RAMP32 = np.arange(256, dtype=np.float32)
_F32 = np.float32


def _f64(x: float) -> np.float64:
    """A float32 value widened: products of two of these are exact in float64, which is how the
    FMA torch's vectorised ``add(..., alpha=)`` does (a*b + c, one rounding) is reproduced."""
    return np.float64(np.float32(x))


# ---------------------------------------------------------------- tables (per byte value)

def _lut_all(img: np.ndarray, lut: np.ndarray) -> None:
    planes = img.reshape(img.shape[0] * img.shape[1], img.shape[2])
    _get_cv2().LUT(planes, lut, dst=planes)


def _to_u8(values: np.ndarray) -> np.ndarray:
    """float table -> uint8 by clipping to 0..255 and truncating (values are >= 0 after clip)."""
    return np.clip(values, 0, 255).astype(np.uint8)


def _posterize_(img: np.ndarray, bits: int) -> None:
    """Keep the ``bits`` high bits (0 bits: all zero, as tensors; 8 or more: unchanged)."""
    if bits < 8:
        np.bitwise_and(img, np.uint8(0xFF & ~((1 << (8 - max(bits, 0))) - 1)), out=img)


def _solarize_lut(threshold: float, tensor: bool) -> np.ndarray:
    ramp = _RAMP32 if tensor else _RAMP  # torch compares in float32, Pillow's table in double
    t = np.float32(threshold) if tensor else float(threshold)
    return np.where(ramp >= t, 255 - np.arange(256), np.arange(256)).astype(np.uint8)


def _per_channel_lut_(img: np.ndarray, make_lut, scratch: Scratch) -> None:
    cv2 = _get_cv2()
    for c in range(img.shape[0]):
        lut = make_lut(img[c], scratch)
        if lut is not None:
            cv2.LUT(img[c], lut, dst=img[c])


def _autocontrast_lut(plane: np.ndarray, tensor: bool) -> np.ndarray | None:
    lo, hi = _get_cv2().minMaxLoc(plane)[:2]
    if hi <= lo:
        return None
    if tensor:  # (x - min) / ((max - min) * (1/255)) in float32
        inv_scale = _F32(hi - lo) * _F32(1.0 / 255)
        return _to_u8((_RAMP32 - _F32(lo)) / inv_scale)
    scale = 255.0 / (hi - lo)  # ImageOps.autocontrast: int(ix * scale + offset), clipped
    return _to_u8(np.trunc(_RAMP * scale + (-lo * scale)))


def _equalize_lut(plane: np.ndarray, scratch: Scratch) -> np.ndarray | None:
    """ImageOps.equalize's table (torchvision v1/v2 tensors use the same one)."""
    hist = scratch.array("aa.hist", (256, 1), np.float32)
    _get_cv2().calcHist([plane], [0], None, [256], [0, 256], hist=hist)
    h = hist.ravel().astype(np.int64)
    nonzero = np.flatnonzero(h)
    if nonzero.size <= 1:
        return None
    step = (int(h.sum()) - int(h[nonzero[-1]])) // 255
    if step == 0:
        return None
    n = np.empty(256, np.int64)
    n[0] = step // 2
    np.cumsum(h[:-1], out=n[1:])
    n[1:] += step // 2
    return np.minimum(n // step, 255).astype(np.uint8)


# ---------------------------------------------------------------- colour ops, tensor arithmetic

def _grey_floor(img: np.ndarray, scratch: Scratch) -> np.ndarray:
    """floor(r*0.2989 + g*0.587 + b*0.114) as v2 computes it (mul, then two FMAs), float32."""
    h, w = img.shape[1:]
    g = scratch.array("aa.grey", (h, w), np.float32)
    t = scratch.array("aa.f64", (h, w), np.float64)
    np.multiply(img[0], _F32(0.2989), out=g)
    for c, k in ((1, 0.587), (2, 0.114)):
        np.multiply(img[c], _f64(k), out=t)
        t += g
        np.copyto(g, t, casting="same_kind")
    return np.floor(g, out=g)


def _blend_fma_(img: np.ndarray, c: int, other: np.ndarray, ratio: float, scratch: Scratch) -> None:
    """img[c] = uint8(clamp(fma(other, 1 - ratio, img[c] * ratio))): v2's ``_blend``."""
    t = scratch.array("aa.f64", other.shape, np.float64)
    p = scratch.array("aa.f32", other.shape, np.float32)
    np.multiply(img[c], _F32(ratio), out=p)
    np.multiply(other, _f64(1.0 - ratio), out=t)
    t += p
    np.copyto(p, t, casting="same_kind")
    np.clip(p, 0, 255, out=p)
    np.copyto(img[c], p, casting="unsafe")


def _contrast_tensor_(img: np.ndarray, factor: float, scratch: Scratch) -> None:
    g = _grey_floor(img, scratch)
    mean = _F32(g.sum(dtype=np.float64)) / _F32(g.size)  # exact sum below 2**24 / 255 pixels
    p = _RAMP32 * _F32(factor)
    _lut_all(img, _to_u8((np.float64(mean) * _f64(1.0 - factor) + p).astype(np.float32)))


def _saturation_tensor_(img: np.ndarray, factor: float, scratch: Scratch) -> None:
    g = _grey_floor(img, scratch)
    for c in range(img.shape[0]):
        _blend_fma_(img, c, g, factor, scratch)


_SMOOTH = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13


def _sharpness_(img: np.ndarray, factor: float, tensor: bool, scratch: Scratch) -> None:
    """Pillow: blend(SMOOTH(x), x, f); v2: x + (1-f)*(round(blur) - x) (one FMA). Both keep the
    outermost rows and columns (Pillow's 3x3 filter copies them; v2 blends the interior only)."""
    cv2 = _get_cv2()
    h, w = img.shape[1:]
    if h <= 2 or w <= 2:
        return
    blur = scratch.array("aa.blur", (h, w), np.uint8)
    d = scratch.array("aa.f32", (h, w), np.float32)
    t = scratch.array("aa.f64", (h, w), np.float64)
    for c in range(img.shape[0]):
        x = img[c]
        cv2.filter2D(x, -1, _SMOOTH, dst=blur, borderType=cv2.BORDER_REPLICATE)  # exact rounding
        blur[0], blur[-1], blur[:, 0], blur[:, -1] = x[0], x[-1], x[:, 0], x[:, -1]
        if tensor:
            np.subtract(blur, x, out=t, dtype=np.float64)
            t *= _f64(1.0 - factor)
            t += x
            np.copyto(d, t, casting="same_kind")
        else:
            np.subtract(x, blur, out=d, dtype=np.float32)
            d *= _F32(factor)
            d += blur
        np.clip(d, 0, 255, out=d)
        np.copyto(x, d, casting="unsafe")


_ENHANCE = {"Brightness": 0, "Contrast": 1, "Color": 2}  # _enhance_'s ``which``


def _enhance_(img: np.ndarray, which: int, factor: float, tensor: bool, scratch: Scratch) -> None:
    """0 brightness, 1 contrast, 2 colour (saturation); Pillow's via ``jitter``."""
    if not tensor:
        factors = [None, None, None, None]
        factors[which] = factor
        jitter.jitter_(img, [which], tuple(factors), scratch)
    elif which == 0:
        _lut_all(img, _to_u8(_RAMP32 * _F32(factor)))
    elif which == 1:
        _contrast_tensor_(img, factor, scratch)
    else:
        _saturation_tensor_(img, factor, scratch)


# ---------------------------------------------------------------- geometry

_INTER = {"nearest": "INTER_NEAREST", "bilinear": "INTER_LINEAR", "bicubic": "INTER_CUBIC"}


def _inverse_affine(center, angle: float, translate, shear) -> list[float]:
    """The output-to-input matrix of torchvision's ``affine`` (scale 1): the inverse of
    T * C * R(angle) * ShearY * ShearX * C^-1, in the order torchvision's floats are computed."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d, -b, 0.0, -c, a, 0.0]  # det == 1
    (cx, cy), (tx, ty) = center, translate
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty)
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty)
    m[2] += cx
    m[5] += cy
    return m


def _pil_rotate_matrix(angle: float, w: int, h: int) -> list[float]:
    """``Image.rotate``'s matrix (about (w/2, h/2), cos/sin rounded to 15 digits)."""
    t = -math.radians(angle)
    cs, sn = round(math.cos(t), 15), round(math.sin(t), 15)
    cx, cy = w / 2, h / 2
    return [cs, sn, cs * -cx + sn * -cy + cx, -sn, cs, -sn * -cx + cs * -cy + cy]


def _to_cv(m: Sequence[float], w: int, h: int, pil: bool) -> np.ndarray:
    """Move an inverse matrix to OpenCV's convention (pixel (x, y) has its centre at (x, y)).
    Pillow samples ``m @ (x + .5, y + .5)`` with centres at +.5; ``grid_sample`` samples
    ``m @ (x - (w-1)/2, y - (h-1)/2) + (w-1)/2`` (the centred grid, align_corners=False)."""
    a, b, c, d, e, f = m
    if pil:
        return np.array([[a, b, c + (a + b) * 0.5 - 0.5], [d, e, f + (d + e) * 0.5 - 0.5]])
    ox, oy = (w - 1) * 0.5, (h - 1) * 0.5
    return np.array([[a, b, c + ox - a * ox - b * oy], [d, e, f + oy - d * ox - e * oy]])


def _fill_values(fill, pil: bool) -> tuple[float, ...] | None:
    """Per-channel fill: Pillow's fillcolor takes ``int(v)``; the tensor path keeps the floats
    (None stays None there: zero padding, where a given fill, zeros included, is blended)."""
    if fill is None:
        return (0.0, 0.0, 0.0) if pil else None
    vals = [fill] if isinstance(fill, (int, float)) else list(fill)
    vals = vals * 3 if len(vals) == 1 else vals
    return tuple(float(int(v)) if pil else float(v) for v in vals)


_EPS = 2.0 ** -20  # px: Pillow's edge test (x + .5 in [0, w)) as OpenCV's nearest decides it


def _warp_(img: np.ndarray, lib_m: Sequence[float], interpolation: str, fill: tuple, pil: bool,
           scratch: Scratch) -> None:
    cv2 = _get_cv2()
    h, w = img.shape[1:]
    if interpolation == "nearest":
        fill = fill or (0.0, 0.0, 0.0)
        mx, my = _nearest_maps(lib_m, w, h, pil, scratch)
        src = scratch.array("aa.src", img.shape, np.uint8)
        np.copyto(src, img)
        for c in range(img.shape[0]):
            v = min(max(float(np.rint(fill[c])), 0.0), 255.0)  # the tensor path rounds it
            cv2.remap(src[c], mx, my, cv2.INTER_NEAREST, dst=img[c],
                      borderMode=cv2.BORDER_CONSTANT, borderValue=v)
        return
    inverse = cv2.WARP_INVERSE_MAP
    m = _to_cv(lib_m, w, h, pil)
    near = m + np.array([[0.0, 0.0, _EPS], [0.0, 0.0, _EPS]]) if pil else m
    # float32 warps: Pillow truncates its double result, grid_sample's float32 result is rounded
    # (half to even); OpenCV's uint8 warp rounds its fixed-point result (+-1 on ~40% of pixels)
    flags = getattr(cv2, _INTER[interpolation]) | inverse
    f = scratch.array("aa.wsrc", (h, w), np.float32)
    o = scratch.array("aa.wdst", (h, w), np.float32)
    mask = scratch.array("aa.wmask", (h, w), np.float32)
    if pil:  # neighbours clamped; fill only where a nearest warp would read outside the image
        f.fill(0)
        cv2.warpAffine(f, near, (w, h), dst=mask, flags=cv2.INTER_NEAREST | inverse,
                       borderMode=cv2.BORDER_CONSTANT, borderValue=1)
        outside = scratch.array("aa.outside", (h, w), np.bool_)
        np.not_equal(mask, 0, out=outside)
    elif fill is not None:  # v2: mask * (sample - fill) + fill, mask the warped ones plane
        f.fill(1)
        cv2.warpAffine(f, m, (w, h), dst=mask, flags=flags, borderMode=cv2.BORDER_CONSTANT)
    for c in range(img.shape[0]):
        np.copyto(f, img[c])
        cv2.warpAffine(f, m, (w, h), dst=o, flags=flags,
                       borderMode=cv2.BORDER_REPLICATE if pil else cv2.BORDER_CONSTANT)
        if pil:
            if interpolation == "bicubic":
                np.clip(o, 0, 255, out=o)  # overshoots
            np.copyto(img[c], o, casting="unsafe")
            np.copyto(img[c], np.uint8(fill[c]), where=outside)
            continue
        if fill is not None:
            o -= _F32(fill[c])
            o *= mask
            o += _F32(fill[c])
        np.rint(o, out=o)
        np.clip(o, 0, 255, out=o)
        np.copyto(img[c], o, casting="unsafe")


def _nearest_maps(m: Sequence[float], w: int, h: int, pil: bool, scratch: Scratch):
    """The source pixel of every output pixel, as the reference computes it (ties and rounding
    included), as float32 maps for ``cv2.remap``. Pillow: 16.16 fixed point stepped per pixel
    (``affine_fixed``), or doubles accumulated per pixel for a scale-only matrix; torchvision's
    tensors: the float32 grid of ``_affine_grid``, unnormalised and rounded half to even."""
    mx = scratch.array("aa.mapx", (h, w), np.float32)
    my = scratch.array("aa.mapy", (h, w), np.float32)
    a, b, c, d, e, f = m
    if pil and b == 0 and d == 0:
        np.floor(np.cumsum(np.r_[c + a * 0.5, np.full(w - 1, a)]), out=mx[0])
        np.floor(np.cumsum(np.r_[f + e * 0.5, np.full(h - 1, e)]), out=my[:, 0])
        mx[1:] = mx[0]
        my[:, 1:] = my[:, :1]
    elif pil:
        def fix(v: float) -> int:
            return math.floor(v * 65536.0 + 0.5)
        ix = scratch.array("aa.fixed", (h, w), np.int32)
        for out, start, dx, dy in ((mx, fix(c + a * 0.5 + b * 0.5), fix(a), fix(b)),
                                   (my, fix(f + d * 0.5 + e * 0.5), fix(d), fix(e))):
            np.add.outer(np.arange(h, dtype=np.int32) * dy + start,
                         np.arange(w, dtype=np.int32) * dx, out=ix)
            np.right_shift(ix, 16, out=ix)
            np.copyto(out, ix, casting="unsafe")
    else:
        theta = np.array([[a, d], [b, e], [c, f]], np.float32) / np.array([w * 0.5, h * 0.5],
                                                                           np.float32)
        bx = np.arange(w, dtype=np.float32) - _F32((w - 1) * 0.5)
        by = np.arange(h, dtype=np.float32) - _F32((h - 1) * 0.5)
        for out, j, size in ((mx, 0, w), (my, 1, h)):
            np.add.outer(by * theta[1, j], bx * theta[0, j], out=out)
            out += theta[2, j]
            out += _F32(1)
            out *= _F32(size * 0.5)
            out -= _F32(0.5)
            np.rint(out, out=out)
    return mx, my


def _rotate_fast_(img: np.ndarray, angle: float, scratch: Scratch) -> bool:
    """Pillow's and v2's exact paths for multiples of 90 degrees (90/270 on square images only)."""
    cv2 = _get_cv2()
    h, w = img.shape[1:]
    angle = angle % 360.0
    if angle == 0:
        return True
    if angle == 180:
        code = cv2.ROTATE_180
    elif angle in (90, 270) and w == h:
        code = cv2.ROTATE_90_COUNTERCLOCKWISE if angle == 90 else cv2.ROTATE_90_CLOCKWISE
    else:
        return False
    src = scratch.array("aa.src", img.shape, np.uint8)
    np.copyto(src, img)
    for c in range(img.shape[0]):
        cv2.rotate(src[c], code, dst=img[c])
    return True


def _shift_(img: np.ndarray, shift: tuple[int, int], fill: tuple, scratch: Scratch) -> None:
    """out[y, x] = img[y - dy, x - dx], fill (rounded: the tensor path's ``round_``) elsewhere."""
    dx, dy = shift
    h, w = img.shape[1:]
    fill = fill or (0.0, 0.0, 0.0)
    src = scratch.array("aa.src", img.shape, np.uint8)
    np.copyto(src, img)
    for c in range(img.shape[0]):
        img[c].fill(min(max(int(np.rint(fill[c])), 0), 255))
    if abs(dx) < w and abs(dy) < h:
        img[:, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
            src[:, max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]


def _geometric_(img, name: str, magnitude: float, interpolation: str, fill, pil: bool,
                scratch: Scratch) -> None:
    h, w = img.shape[1:]
    if name == "Rotate":
        if _rotate_fast_(img, magnitude, scratch):
            return
        m = (_pil_rotate_matrix(magnitude, w, h) if pil
             else _inverse_affine([0.0, 0.0], -magnitude, [0.0, 0.0], [0.0, 0.0]))
    elif name in ("ShearX", "ShearY"):
        deg = math.degrees(math.atan(magnitude))
        shear = [deg, 0.0] if name == "ShearX" else [0.0, deg]
        # center=[0, 0]: the image corner; the tensor path's centre is relative to the middle
        m = _inverse_affine([0.0, 0.0] if pil else [-w * 0.5, -h * 0.5], 0.0, [0.0, 0.0], shear)
    else:  # a whole-pixel shift in both libraries, whatever the interpolation
        shift = (int(magnitude), 0) if name == "TranslateX" else (0, int(magnitude))
        _shift_(img, shift, _fill_values(fill, pil), scratch)
        return
    _warp_(img, m, interpolation, _fill_values(fill, pil), pil, scratch)


# ---------------------------------------------------------------- public

def apply_op(img: np.ndarray, name: str, magnitude: float, *, interpolation: str,
             fill: Sequence[float] | float | None, arithmetic: str, scratch: Scratch) -> None:
    """torchvision's ``_apply_op(img, name, magnitude, interpolation, fill)`` in place on a
    C-contiguous (3, H, W) uint8 image.

    Args:
        img: the image, modified in place.
        name: one of :data:`OPS`.
        magnitude: as torchvision's ``_apply_op`` takes it (Solarize: the threshold, 0..255).
        interpolation: "nearest", "bilinear" (or "bicubic", Pillow arithmetic only).
        fill: None (zeros), a number or per-channel values, as torchvision receives them.
        arithmetic: "pil" (torchvision on a PIL image) or "tensor" (v2 on a uint8 tensor).
        scratch: where the temporaries live.
    """
    if arithmetic not in _ARITHMETIC:
        raise ValueError(f"arithmetic must be 'pil' or 'tensor', got {arithmetic!r}")
    if interpolation not in _INTER or (arithmetic == "tensor" and interpolation == "bicubic"):
        raise ValueError(f"interpolation {interpolation!r} is not supported with {arithmetic} "
                         "arithmetic (nearest or bilinear; bicubic on PIL images only)")
    tensor = arithmetic == "tensor"
    if name in ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"):
        _geometric_(img, name, magnitude, interpolation, fill, not tensor, scratch)
    elif name in _ENHANCE:
        _enhance_(img, _ENHANCE[name], 1.0 + magnitude, tensor, scratch)
    elif name == "Sharpness":
        _sharpness_(img, 1.0 + magnitude, tensor, scratch)
    elif name == "Posterize":
        _posterize_(img, int(magnitude))
    elif name == "Solarize":
        _lut_all(img, _solarize_lut(magnitude, tensor))
    elif name == "AutoContrast":
        _per_channel_lut_(img, lambda p, s: _autocontrast_lut(p, tensor), scratch)
    elif name == "Equalize":
        _per_channel_lut_(img, _equalize_lut, scratch)
    elif name == "Invert":
        np.subtract(255, img, out=img)
    elif name != "Identity":
        raise ValueError(f"unknown op {name!r}; expected one of {sorted(OPS)}")


def augmix_mix(img: np.ndarray, m0: float, chains: list[tuple[float, list[tuple[str, float]]]], *,
               interpolation: str, fill: Sequence[float] | float | None, scratch: Scratch) -> None:
    """AugMix's mixing in place: ``m0 * img + sum(weight * chain(img))`` in float32, truncated
    to uint8, each chain's ops applied in turn to a copy of the original image in tensor
    arithmetic (AugMix runs its ops on tensors, PIL input included).

    Args:
        img: the (3, H, W) uint8 image, replaced by the mix.
        m0: the original image's weight (AugMix's ``m[:, 0]``).
        chains: per chain, its weight (``combined_weights[:, i]``) and its (op name, magnitude)
            list, as :func:`apply_op` takes them.
        interpolation, fill, scratch: as :func:`apply_op`.
    """
    orig = scratch.array("aa.mix.orig", img.shape, np.uint8)
    aug = scratch.array("aa.mix.aug", img.shape, np.uint8)
    mix = scratch.array("aa.mix.sum", img.shape, np.float32)
    term = scratch.array("aa.mix.term", img.shape, np.float32)
    np.copyto(orig, img)
    np.multiply(orig, _F32(m0), out=mix)
    for weight, ops in chains:
        np.copyto(aug, orig)
        for name, magnitude in ops:
            apply_op(aug, name, magnitude, interpolation=interpolation, fill=fill,
                     arithmetic="tensor", scratch=scratch)
        np.multiply(aug, _F32(weight), out=term)  # torch: mix.add_(w * aug), the product rounded
        mix += term
    np.copyto(img, mix, casting="unsafe")  # .to(uint8) truncates


# ---------------------------------------------------------------- timm (Pillow arithmetic)

TIMM_OPS = frozenset({"AutoContrast", "Equalize", "Invert", "Rotate", "Posterize",
                      "PosterizeIncreasing", "PosterizeOriginal", "Solarize", "SolarizeIncreasing",
                      "SolarizeAdd", "Color", "ColorIncreasing", "Contrast", "ContrastIncreasing",
                      "Brightness", "BrightnessIncreasing", "Sharpness", "SharpnessIncreasing",
                      "ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel",
                      "TranslateYRel", "Desaturate"})


def _pillow_posterize_check(bits: int) -> None:
    """Raise what the installed Pillow's ``ImageOps.posterize`` raises for ``bits`` (outside
    1..8: Pillow 13 refuses 0, older ones gave black), on a 1x1 image."""
    if not 1 <= bits <= 8:
        from PIL import Image, ImageOps
        ImageOps.posterize(Image.new("RGB", (1, 1)), bits)


def apply_timm_op(img: np.ndarray, name: str, level_args: tuple, *, resample: str,
                  fill: Sequence[int] | int | None, scratch: Scratch) -> None:
    """timm's ``auto_augment`` op ``name`` (a key of its ``NAME_TO_OP``) in place, in Pillow's
    arithmetic.

    Args:
        img: a C-contiguous (3, H, W) uint8 image.
        name: one of :data:`TIMM_OPS`.
        level_args: what timm's level function returned (the op's arguments after the image).
        resample: "nearest", "bilinear" or "bicubic" (timm draws one per geometric op).
        fill: timm's ``fillcolor`` (``img_mean``), or None for Pillow's black.
        scratch: where the temporaries live.
    """
    h, w = img.shape[1:]
    base = name.replace("Increasing", "").replace("Original", "")
    if name in ("AutoContrast", "Equalize", "Invert"):
        apply_op(img, name, 0.0, interpolation="nearest", fill=None, arithmetic="pil",
                 scratch=scratch)
    elif base == "Posterize":
        bits = int(level_args[0])
        if bits < 8:  # timm hands Pillow what it keeps: Pillow's own bounds (13 refuses 0)
            _pillow_posterize_check(bits)
            _posterize_(img, bits)
    elif base == "Solarize":
        _lut_all(img, _solarize_lut(level_args[0], tensor=False))
    elif name == "SolarizeAdd":
        add, thresh = level_args[0], (level_args[1] if len(level_args) > 1 else 128)
        _lut_all(img, np.where(_RAMP < thresh, np.minimum(_RAMP + add, 255), _RAMP)
                 .astype(np.uint8))
    elif base in _ENHANCE:
        _enhance_(img, _ENHANCE[base], float(level_args[0]), False, scratch)
    elif name == "Desaturate":
        _enhance_(img, 2, min(1.0, max(0.0, 1.0 - level_args[0])), False, scratch)
    elif base == "Sharpness":
        _sharpness_(img, float(level_args[0]), False, scratch)
    elif name in TIMM_OPS:
        if resample not in _INTER:
            raise ValueError(f"resample must be one of {sorted(_INTER)}, got {resample!r}")
        v = float(level_args[0])
        if name == "Rotate":
            if _rotate_fast_(img, v, scratch):
                return
            m = _pil_rotate_matrix(v, w, h)
        else:
            m = {"ShearX": (1, v, 0, 0, 1, 0), "ShearY": (1, 0, 0, v, 1, 0),
                 "TranslateX": (1, 0, v, 0, 1, 0), "TranslateY": (1, 0, 0, 0, 1, v),
                 "TranslateXRel": (1, 0, v * w, 0, 1, 0),
                 "TranslateYRel": (1, 0, 0, 0, 1, v * h)}[name]
        _warp_(img, [float(x) for x in m], resample, _fill_values(fill, True), True, scratch)
    else:
        raise ValueError(f"unknown timm op {name!r}; expected one of {sorted(TIMM_OPS)}")
