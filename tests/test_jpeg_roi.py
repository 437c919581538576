"""Region-of-interest JPEG decoding (pooled_loader.vision._jpeg, csrc/jpeg_roi.c).

The region's pixels must equal a full decode's, cropped, for every chroma subsampling, scale,
IDCT/upsampling mode, progressive and restart-marker files, and greyscale; damaged files must
raise, CMYK JPEGs must take Pillow's route; and the pipeline's output must not change at all.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import cv2
import numpy as np
import pytest
import simplejpeg

import imgutil
from pooled_loader.core.errors import SampleError
from pooled_loader.vision import (Compose, DecodeImage, Normalize, RandomHorizontalFlip,
                                  RandomResizedCrop, ToCHW, backend_info)
from pooled_loader.vision.io import decode

needs_roi = pytest.mark.skipif(decode.DECODER != "roi",
                               reason="pooled_loader.vision._jpeg not built (no libjpeg-turbo "
                                      "headers at build time) or disabled")
_jpeg = decode._jpeg

# (name, bytes) of the kinds of JPEG the decoder must get right; odd sizes, so the last iMCU
# row and column are partial
IMG = imgutil.rgb("astronaut", (453, 301))


def _kinds() -> list[tuple[str, bytes]]:
    rst = cv2.imencode(".jpg", cv2.cvtColor(IMG, cv2.COLOR_RGB2BGR),
                       [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_RST_INTERVAL, 3])[1]
    return [("420", imgutil.encode(IMG, subsampling=2)),
            ("422", imgutil.encode(IMG, subsampling=1)),
            ("444", imgutil.encode(IMG, subsampling=0)),
            ("progressive", imgutil.encode(IMG, progressive=True)),
            ("grey", imgutil.encode(IMG, mode="L")),
            ("restart_markers", rst.tobytes())]


KINDS = _kinds()


def full_decode(data: bytes, factor: int, fast: bool) -> np.ndarray:
    hdr = decode.read_header(data)
    h, w = decode.scaled_size(hdr, factor)
    buf = np.empty(h * w * 3, np.uint8)
    assert _jpeg.decode(data, buf, factor, fast=fast) == (0, w)
    return buf.reshape(h, w, 3)


def region_decode(data: bytes, factor: int, fast: bool, x0: int, y0: int, w: int, h: int):
    full_w = decode.scaled_size(decode.read_header(data), factor)[1]
    buf = np.empty(h * full_w * 3, np.uint8)
    xoff, width = _jpeg.decode(data, buf, factor, x0, y0, w, h, fast)
    assert xoff <= x0 and xoff + width >= x0 + w
    return buf[: h * width * 3].reshape(h, width, 3)[:, x0 - xoff:x0 - xoff + w]


@needs_roi
def test_restart_marker_file_really_has_restart_markers():
    data = dict(KINDS)["restart_markers"]
    assert any(bytes([0xFF, 0xD0 + i]) in data for i in range(8))


@needs_roi
@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
def test_region_pixels_equal_the_full_decode_cropped(kind):
    data = dict(KINDS)[kind]
    rng = random.Random(kind)
    for factor in decode.JPEG_SCALES:
        for fast in (False, True):
            full = full_decode(data, factor, fast)
            H, W = full.shape[:2]
            boxes = [(0, 0, W, H), (0, 0, 1, 1), (W - 1, H - 1, 1, 1), (1, 1, W - 2, H - 2)]
            for _ in range(25):
                w, h = rng.randint(1, W), rng.randint(1, H)
                boxes.append((rng.randint(0, W - w), rng.randint(0, H - h), w, h))
            for x0, y0, w, h in boxes:
                got = region_decode(data, factor, fast, x0, y0, w, h)
                np.testing.assert_array_equal(got, full[y0:y0 + h, x0:x0 + w],
                                              err_msg=f"{kind} 1/{factor} fast={fast} "
                                                      f"box={(x0, y0, w, h)}")


@needs_roi
@pytest.mark.parametrize("kind", [k for k, _ in KINDS])
def test_full_decode_equals_simplejpeg(kind):
    data = dict(KINDS)[kind]
    for factor in (1, 2, 8):
        for fast in (False, True):
            ours = full_decode(data, factor, fast)
            ref = simplejpeg.decode_jpeg(data, colorspace="RGB", min_factor=factor,
                                         min_height=ours.shape[0], min_width=ours.shape[1],
                                         fastdct=fast, fastupsample=fast)
            np.testing.assert_array_equal(ours, ref)


@needs_roi
def test_corrupt_truncated_and_non_jpeg_data_raise_value_error():
    data = dict(KINDS)["420"]
    out = np.empty(IMG.size, np.uint8)
    broken = bytearray(data)
    mid = len(data) // 2
    broken[mid:mid + 64] = bytes(range(64))  # garbage in the entropy-coded data
    for bad, why in [(data[: len(data) // 2], "Premature end"), (bytes(broken), None),
                     (b"\xff\xd8\xff" + b"\0" * 100, None), (b"not a jpeg", "Not a JPEG"),
                     (b"", "empty")]:
        with pytest.raises(ValueError, match=why):
            _jpeg.decode(bad, out, 1)


@needs_roi
def test_truncation_below_the_region_is_not_read():
    """Rows after the region are never decoded: a file cut near its end still gives its top."""
    data = dict(KINDS)["420"]
    full = full_decode(data, 1, False)
    cut = data[: int(len(data) * 0.9)]
    np.testing.assert_array_equal(region_decode(cut, 1, False, 10, 0, 100, 40), full[:40, 10:110])
    with pytest.raises(ValueError, match="Premature end"):
        full_decode(cut, 1, False)


@needs_roi
def test_bad_arguments_are_refused():
    data = dict(KINDS)["420"]
    out = np.empty(IMG.size, np.uint8)
    with pytest.raises(ValueError, match="factor"):
        _jpeg.decode(data, out, 3)
    with pytest.raises(ValueError, match="outside"):
        _jpeg.decode(data, out, 1, 400, 0, 100, 10)
    with pytest.raises(ValueError, match="too small"):
        _jpeg.decode(data, np.empty(100, np.uint8), 1)
    with pytest.raises(BufferError):
        _jpeg.decode(data, b"read-only", 1)


@needs_roi
def test_cmyk_jpeg_is_refused_by_the_roi_decoder_and_decoded_by_pillow():
    data = imgutil.encode(IMG, mode="CMYK")
    with pytest.raises(ValueError, match="colour space"):
        _jpeg.decode(data, np.empty(IMG.size, np.uint8), 1)
    hdr = decode.read_header(data)
    assert not hdr.turbo and hdr.jpeg
    crop = decode.decode_crop_into(data, hdr, lambda n: np.empty(n, np.uint8), 1,
                                   (10, 20, 200, 100), (50, 50))
    assert not crop.region and crop.box == (10, 20, 200, 100)
    assert crop.image.shape == IMG.shape
    assert np.abs(crop.image.astype(int) - IMG).mean() < 8  # CMYK round trip, lossy


def _pipelines(fast: bool):
    norm = Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    for tail in ([], [norm]):
        yield [DecodeImage(fast), RandomResizedCrop(96), RandomHorizontalFlip(), ToCHW(), *tail]


@needs_roi
@pytest.mark.parametrize("fast", [False, True])
def test_pipeline_output_is_identical_with_and_without_the_roi_decoder(fast, monkeypatch):
    datas = [d for _, d in KINDS] + [imgutil.jpeg("chelsea", (900, 700)),
                                     imgutil.jpeg("coffee", (1900, 1300))]
    for ops in _pipelines(fast):
        roi, whole = Compose(ops), Compose(ops)
        random.seed(0)
        got = [roi(d).copy() for _ in range(12) for d in datas]
        with monkeypatch.context() as m:
            m.setattr(decode, "_jpeg", None)
            random.seed(0)
            want = [whole(d).copy() for _ in range(12) for d in datas]
        assert roi.stats()["roi_decoded"] == len(got) and whole.stats()["roi_decoded"] == 0
        assert roi.stats()["dct_scaled"] == whole.stats()["dct_scaled"] > 0
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)


@needs_roi
def test_damaged_jpeg_in_the_pipeline_raises_sample_error():
    data = dict(KINDS)["420"]
    with pytest.raises(SampleError, match="corrupt JPEG"):
        Compose([DecodeImage(), RandomResizedCrop(64, scale=(1.0, 1.0)), ToCHW()])(
            data[: len(data) // 2])


def test_backend_info_names_the_decoder_and_kernel_in_use():
    info = backend_info()
    assert info["jpeg_decoder"].startswith(decode.DECODER)
    env = dict(os.environ, POOLED_LOADER_NO_EXT="1")
    code = ("import random, imgutil; from pooled_loader.vision import *; "
            "from pooled_loader.vision import backend_info; print(backend_info()); "
            "tf = Compose([DecodeImage(), RandomResizedCrop(64), ToCHW()]); "
            "print(tf(imgutil.jpeg()).shape, tf.stats()['roi_decoded'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=os.path.dirname(__file__), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "'jpeg_decoder': 'simplejpeg" in out.stdout and "'resize_kernel': 'opencv'" in out.stdout
    assert "(3, 64, 64) 0" in out.stdout  # the fallback path decodes whole images
