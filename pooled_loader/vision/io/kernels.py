"""Fused crop -> resize -> flip -> HWC-to-CHW (-> normalize) for the vision pipeline.

``crop_resize_flip_chw(src, box, out, flip=False, mean=None, std=None) -> out``

- ``src``: ``(H, W, 3)`` uint8 array, rows of contiguous RGB pixels (pixel stride 3, channel
  stride 1); the row stride may be larger than ``3*W`` (a view/crop of a bigger buffer is fine).
- ``box = (x0, y0, w, h)``: integers, inside ``src``. The crop is only an offset into ``src``.
- ``out``: writable C-contiguous ``(3, oh, ow)`` array, uint8 or float32. float32 requires
  ``mean`` and ``std`` (3 values each, or one value for all channels) and holds
  ``(v/255 - mean)/std`` where ``v`` is exactly the uint8 result.
- Bilinear resampling, antialiased when downscaling, Pillow's geometry: the result matches
  ``Image.resize((ow, oh), Image.BILINEAR, box=(x0, y0, x0+w, y0+h))`` (then flipped, transposed)
  within one level (the filter may read pixels just outside the box, as Pillow does).
- ``flip=True`` mirrors the output horizontally.

Two implementations:

- ``"c"``: the compiled ``pooled_loader.vision._kernels`` (csrc/resize.c): separable
  fixed-point/SIMD passes (AVX2, SSSE3 or SSE2 picked at import), no intermediate image, GIL
  released.  Used when importable, unless the environment variable ``POOLED_LOADER_NO_EXT=1``.
  About 120 us per 224x224 RandomResizedCrop from a 400x500 image on one core (AVX2), ~4.5x the
  OpenCV path below and ~6.5x Pillow (scripts/benchmarks/bench_kernels.py).
- ``"opencv"``: ``cv2.resize`` (INTER_AREA when shrinking along both axes, INTER_LINEAR when
  enlarging along both, one pass per axis otherwise) into reused per-thread scratch, then
  ``cv2.split`` straight into the planes of ``out`` (flip first with ``cv2.flip(dst=)``).  It is
  not Pillow's filter: against the compiled path, mean abs diff 0.3-0.7 on RandomResizedCrop
  boxes (<= 1.5 asserted), more for strong downscales (INTER_AREA's box filter is narrower than
  the triangle: ~2 at 4x, ~3-6 at 20x) and for 1-pixel boxes (see tests/test_kernels.py).

Both allocate nothing per call in steady state (the OpenCV path's temporaries live in the
calling thread's ``buffers.thread_scratch()``, grown to the largest shape seen).
``BACKEND`` names the one in use; ``crop_resize_flip_chw_c`` / ``crop_resize_flip_chw_opencv``
call one explicitly (same validation and errors).

``resize_hwc`` (the unfused resize, HWC to HWC) and ``flip_horizontal_`` use OpenCV too. cv2 is
imported in this module only (``_get_cv2``), and only when a path needs it.
"""
from __future__ import annotations

import functools
import operator
import os

import numpy as np

from pooled_loader.vision.io.buffers import thread_scratch

__all__ = ["crop_resize_flip_chw", "crop_resize_flip_chw_c", "crop_resize_flip_chw_opencv",
           "resize_hwc", "flip_horizontal_", "transpose_into", "BACKEND", "ext_available"]

_kernels = None
if os.environ.get("POOLED_LOADER_NO_EXT", "").strip().lower() not in ("1", "true", "yes", "on"):
    try:
        from .. import _kernels  # type: ignore[no-redef]  (built at vision/, see setup.py)
    except ImportError:  # not built (no compiler at install time): OpenCV path
        _kernels = None

BACKEND = "c" if _kernels is not None else "opencv"


def ext_available() -> bool:
    """True when the compiled kernel is in use (built and not disabled by POOLED_LOADER_NO_EXT)."""
    return _kernels is not None


# ----------------------------------------------------------------------------------------------
# argument checking (shared by both paths, so both raise the same errors)

def _as_array(obj, name):
    if isinstance(obj, np.ndarray):
        return obj
    try:
        arr = np.asarray(obj)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{name} must be a numpy array (or a CPU tensor), got "
                        f"{type(obj).__name__}") from e
    if arr.dtype == object or (name == "out" and arr.base is None):
        # a list, or anything np.asarray had to copy: writing into it would be lost
        raise TypeError(f"{name} must be a numpy array (or a CPU tensor), got "
                        f"{type(obj).__name__}")
    return arr


def _triple(v, name):
    if isinstance(v, (int, float, np.integer, np.floating)):
        vals = (float(v),) * 3
    else:
        try:
            vals = tuple(float(x) for x in v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be a float or a sequence of 3 floats") from e
        if len(vals) != 3:
            raise ValueError(f"{name} must have 3 values (one per channel), got {len(vals)}")
    if not all(np.isfinite(vals)):
        raise ValueError(f"{name} must be finite, got {vals}")
    return vals


def _check(src, box, out, mean, std):
    """Validate; return (src_array, out_array, (x0, y0, w, h), mean3 or None, std3 or None)."""
    s = _as_array(src, "src")
    o = _as_array(out, "out")
    if s.dtype != np.uint8:
        raise TypeError(f"src must be uint8, got {s.dtype}")
    if s.ndim != 3 or s.shape[2] != 3:
        raise ValueError(f"src must have shape (H, W, 3), got {s.shape}")
    H, W = s.shape[0], s.shape[1]
    st = s.strides
    if st[2] != 1 or st[1] != 3 or st[0] < 3 * W:
        raise ValueError(
            f"src rows must be contiguous HWC pixels (strides (>= {3 * W}, 3, 1)), got strides "
            f"{st}; a crop of a bigger C-contiguous image is fine, a channel/column slice is not "
            "(use np.ascontiguousarray)")
    if o.dtype != np.uint8 and o.dtype != np.float32:
        raise TypeError(f"out must be uint8 or float32, got {o.dtype}")
    if o.ndim != 3 or o.shape[0] != 3 or o.shape[1] < 1 or o.shape[2] < 1:
        raise ValueError(f"out must have shape (3, oh, ow) with oh, ow >= 1, got {o.shape}")
    if not o.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    if not o.flags.writeable:
        raise ValueError("out must be writable")
    if not o.flags.aligned:
        raise ValueError("out must be aligned (float32 at a 4-byte address)")
    try:
        if len(box) != 4:
            raise ValueError(f"box must be (x0, y0, w, h), got {box!r}")
        x0, y0, w, h = (operator.index(v) for v in box)
    except TypeError as e:
        raise TypeError(f"box must be 4 integers (x0, y0, w, h), got {box!r}") from e
    if w < 1 or h < 1 or x0 < 0 or y0 < 0 or x0 + w > W or y0 + h > H:
        raise ValueError(f"box (x0={x0}, y0={y0}, w={w}, h={h}) must have w, h >= 1 and lie "
                         f"inside src (W={W}, H={H})")
    if o.dtype == np.float32:
        if mean is None or std is None:
            raise ValueError("float32 out requires mean and std")
        m3, s3 = _triple(mean, "mean"), _triple(std, "std")
        if any(v == 0.0 for v in s3):
            raise ValueError(f"std must be non-zero, got {s3}")
    else:
        if mean is not None or std is not None:
            raise ValueError("mean/std apply only to float32 out (uint8 out is not normalized)")
        m3 = s3 = None
    if np.may_share_memory(s, o):
        raise ValueError("src and out must not overlap in memory")
    return s, o, (x0, y0, w, h), m3, s3


# ----------------------------------------------------------------------------------------------
# compiled path

def crop_resize_flip_chw_c(src, box, out, flip=False, mean=None, std=None):
    """The compiled kernel; raises RuntimeError when the extension is not available."""
    if _kernels is None:
        raise RuntimeError("pooled_loader.vision._kernels is not available (not built, or "
                           "POOLED_LOADER_NO_EXT=1)")
    # Fast path: the extension checks everything itself (buffer formats, shapes, strides, box,
    # mean/std, overlap), so well-formed calls skip the Python checks.  When it refuses, the
    # Python checks run to give the canonical error (and to convert e.g. a tensor `out` or a
    # scalar mean/std), then the call is retried once with the normalized arguments.
    try:
        x0, y0, w, h = box
        _kernels.crop_resize_flip_chw(src, x0, y0, w, h, out, flip, mean, std)
        return out
    except (TypeError, ValueError, BufferError):
        pass
    s, o, (x0, y0, w, h), m3, s3 = _check(src, box, out, mean, std)
    _kernels.crop_resize_flip_chw(s, x0, y0, w, h, o, bool(flip), m3, s3)
    return out


# ----------------------------------------------------------------------------------------------
# OpenCV path

_cv2 = None


def _get_cv2():
    global _cv2
    if _cv2 is None:
        try:
            import cv2
        except ImportError as e:
            raise ImportError("pooled_loader.vision.kernels needs opencv-python-headless when the "
                              "compiled _kernels extension is not available "
                              "(pip install opencv-python-headless)") from e
        _cv2 = cv2
    return _cv2


def transpose_into(src: np.ndarray, dst: np.ndarray) -> bool:
    """``dst[...] = src.T`` with OpenCV's blocked transpose (2-D, dtypes OpenCV takes); False
    (nothing written) when OpenCV is not installed."""
    try:
        cv2 = _get_cv2()
    except ImportError:
        return False
    cv2.transpose(src, dst=dst)
    return True


@functools.lru_cache(maxsize=16)
def _norm_consts(m3, s3):
    """float32 (scale, bias), shape (3, 1, 1), with v * scale + bias == (v/255 - mean)/std."""
    std = np.array(s3, np.float64)
    scale = (1.0 / (255.0 * std)).astype(np.float32).reshape(3, 1, 1)
    bias = (-np.array(m3, np.float64) / std).astype(np.float32).reshape(3, 1, 1)
    scale.setflags(write=False)
    bias.setflags(write=False)
    return scale, bias


def crop_resize_flip_chw_opencv(src, box, out, flip=False, mean=None, std=None):
    """OpenCV implementation (always available where cv2 is installed)."""
    cv2 = _get_cv2()
    s, o, (x0, y0, w, h), m3, s3 = _check(src, box, out, mean, std)
    oh, ow = o.shape[1], o.shape[2]
    crop = s[y0:y0 + h, x0:x0 + w]
    scratch = thread_scratch()
    hwc = scratch.array("kernels.hwc", (oh, ow, 3), np.uint8)
    shrink_x, shrink_y = w >= ow, h >= oh
    if shrink_x and shrink_y:
        # INTER_AREA averages: the closest OpenCV has to Pillow's antialiased triangle filter
        cv2.resize(crop, (ow, oh), dst=hwc, interpolation=cv2.INTER_AREA)
    elif not shrink_x and not shrink_y:
        cv2.resize(crop, (ow, oh), dst=hwc, interpolation=cv2.INTER_LINEAR)
    else:
        # shrinks along one axis, enlarges along the other: one pass per axis, each with its own
        # interpolation (a single INTER_LINEAR would alias along the shrinking axis)
        mid = scratch.array("kernels.mid", (h, ow, 3), np.uint8)
        cv2.resize(crop, (ow, h), dst=mid,
                   interpolation=cv2.INTER_AREA if shrink_x else cv2.INTER_LINEAR)
        cv2.resize(mid, (ow, oh), dst=hwc,
                   interpolation=cv2.INTER_AREA if shrink_y else cv2.INTER_LINEAR)
    if flip:
        hwc2 = scratch.array("kernels.hwc_flip", (oh, ow, 3), np.uint8)
        cv2.flip(hwc, 1, dst=hwc2)
        hwc = hwc2
    if o.dtype == np.uint8:
        planes = o
    else:
        planes = scratch.array("kernels.chw", (3, oh, ow), np.uint8)
    cv2.split(hwc, [planes[0], planes[1], planes[2]])
    if o.dtype == np.float32:
        scale, bias = _norm_consts(m3, s3)
        np.copyto(o, planes)  # u8 -> f32 without the ufunc's 32 kB casting buffer
        np.multiply(o, scale, out=o)
        np.add(o, bias, out=o)
    return out


def resize_hwc(src: np.ndarray, box, out: np.ndarray) -> np.ndarray:
    """Resize ``src[box]`` (``box = (x0, y0, w, h)``) into ``out`` (HWC, any channel count),
    bilinear with antialiasing when shrinking; OpenCV. The unfused path of a resizing op.

    Shrinking by >= 2 uses area averaging; by 1.6..2 a [1, 2, 1] blur then bilinear; less,
    plain bilinear. Within mean abs diff ~1 of Pillow's antialiased BILINEAR on photos.
    """
    cv2 = _get_cv2()
    x0, y0, bw, bh = box
    oh, ow = out.shape[:2]
    roi = src[y0:y0 + bh, x0:x0 + bw]
    rx, ry = bw / ow, bh / oh
    if max(rx, ry) >= 2.0:
        cv2.resize(roi, (ow, oh), dst=out, interpolation=cv2.INTER_AREA)
    elif max(rx, ry) >= 1.6:
        tmp = thread_scratch().array("resize_hwc.blur", roi.shape, roi.dtype)
        cv2.GaussianBlur(roi, (3 if rx >= 1.6 else 1, 3 if ry >= 1.6 else 1), 0, dst=tmp)
        cv2.resize(tmp, (ow, oh), dst=out, interpolation=cv2.INTER_LINEAR)
    else:
        cv2.resize(roi, (ow, oh), dst=out, interpolation=cv2.INTER_LINEAR)
    return out


def flip_horizontal_(img: np.ndarray) -> np.ndarray:
    """Mirror an HWC image left-right in place; returns it."""
    _get_cv2().flip(img, 1, dst=img)
    return img


# ----------------------------------------------------------------------------------------------

def crop_resize_flip_chw(src, box, out, flip=False, mean=None, std=None):
    """Crop ``box = (x0, y0, w, h)`` of HWC uint8 ``src``, resize it (bilinear, antialiased) to
    ``out``'s (oh, ow), mirror it when ``flip``, and write it as CHW into ``out`` (uint8, or
    float32 normalized with ``mean``/``std``). Returns ``out``. See the module docstring."""
    if _kernels is not None:
        try:  # same fast path as crop_resize_flip_chw_c, one Python call less
            x0, y0, w, h = box
            _kernels.crop_resize_flip_chw(src, x0, y0, w, h, out, flip, mean, std)
            return out
        except (TypeError, ValueError, BufferError):
            return crop_resize_flip_chw_c(src, box, out, flip, mean, std)
    return crop_resize_flip_chw_opencv(src, box, out, flip, mean, std)
