"""Bad and extreme inputs: SampleError naming the file and the reason, or a correct result."""
from __future__ import annotations

import os
import random
import struct
import zlib

import numpy as np
import pytest

import imgutil
from pooled_loader.core.errors import SampleError
from pooled_loader.vision import (Compose, DecodeImage, ImageFolder, RandomHorizontalFlip,
                                  RandomResizedCrop, Resize, ToCHW)
from pooled_loader.vision.io import decode


def train_tf() -> Compose:
    return Compose([DecodeImage(), RandomResizedCrop(224), RandomHorizontalFlip(), ToCHW()])


def one_file_folder(tmp_path, name: str, data: bytes, transform=None) -> ImageFolder:
    imgutil.write(str(tmp_path / "cls" / name), data)
    return ImageFolder(str(tmp_path), transform=transform if transform is not None else train_tf())


def expect_error(ds: ImageFolder, reason: str) -> SampleError:
    path = ds.samples[0][0]
    out = np.empty((3, 224, 224), np.uint8)
    for call in (lambda: ds[0], lambda: ds.getitem_into(0, (out, None))):
        with pytest.raises(SampleError) as info:
            call()
        msg = str(info.value)
        assert path in msg and reason in msg, msg
    return info.value


def sof_patched(data: bytes, width: int, height: int) -> bytes:
    """A JPEG whose SOF0 header claims another size (the scan data is unchanged)."""
    i = data.index(b"\xff\xc0")
    return data[:i + 5] + struct.pack(">HH", height, width) + data[i + 9:]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height but holds a few bytes of pixel data."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))


def test_truncated_jpeg(tmp_path):
    data = imgutil.jpeg("astronaut", (400, 300))
    expect_error(one_file_folder(tmp_path, "trunc.jpg", data[: len(data) // 2]), "corrupt JPEG")


def test_corrupt_jpeg_header(tmp_path):
    data = imgutil.jpeg("astronaut", (400, 300))
    rng = np.random.default_rng(0)
    bad = data[:3] + rng.integers(0, 256, 600, dtype=np.uint8).tobytes()  # garbage after SOI
    expect_error(one_file_folder(tmp_path, "garbage.jpg", bad), "image")


def test_corrupt_jpeg_scan(tmp_path):
    data = bytearray(imgutil.jpeg("astronaut", (400, 300)))
    sos = data.index(b"\xff\xda")
    data[sos + 200: sos + 260] = b"\xff\xd9" * 30  # end-of-image markers inside the scan
    expect_error(one_file_folder(tmp_path, "scan.jpg", bytes(data)), "corrupt JPEG")


def test_non_image_file(tmp_path):
    ds = one_file_folder(tmp_path, "readme.jpg", b"this is a text file, not a picture\n" * 20)
    expect_error(ds, "not an image")


def test_zero_byte_file(tmp_path):
    expect_error(one_file_folder(tmp_path, "empty.jpg", b""), "empty file")


def test_unreadable_file(tmp_path):
    ds = one_file_folder(tmp_path, "gone.jpg", imgutil.jpeg(size=(64, 64)))
    os.remove(ds.samples[0][0])
    expect_error(ds, "No such file")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_one_pixel_image(tmp_path, fmt):
    img = np.array([[[200, 30, 90]]], np.uint8)
    ds = one_file_folder(tmp_path, "dot." + fmt.lower(), imgutil.encode(img, fmt, quality=95))
    x, label = ds[0]
    assert x.shape == (3, 224, 224) and label == 0
    assert np.abs(x.astype(int) - img[0, 0][:, None, None]).max() <= 3  # one colour everywhere


@pytest.mark.parametrize("size", [(20000, 16), (16, 20000)])
def test_very_long_image(tmp_path, size):
    """20000 x 16: RandomResizedCrop falls back to a centre crop clamped to 4:3, which works."""
    w, h = size
    ramp = np.linspace(0, 255, max(w, h)).astype(np.uint8)  # a grey ramp along the long side
    img = np.tile(ramp[None, :, None], (h, 1, 3)) if w > h else np.tile(ramp[:, None, None],
                                                                       (1, w, 3))
    ds = one_file_folder(tmp_path, "long.jpg", imgutil.encode(img, "JPEG", quality=90))
    random.seed(0)
    x, _ = ds[0]
    assert x.shape == (3, 224, 224)
    # the crop is the central 21 x 16 (or 16 x 21) pixels: values near the middle grey
    assert abs(float(x.mean()) - 127.5) < 4
    y = Compose([DecodeImage(), Resize(max_side=1000)])(np.fromfile(ds.samples[0][0], np.uint8))
    assert max(y.shape[:2]) == 1000 and min(y.shape[:2]) == 1


def test_huge_claimed_size_is_refused_before_allocating(tmp_path):
    small = imgutil.jpeg("astronaut", (64, 64))
    big = sof_patched(small, 60000, 60000)  # 3.6 G pixels: 10.8 GB as RGB
    assert decode.read_header(big)[:2] == (60000, 60000)
    ds = one_file_folder(tmp_path, "huge.jpg", big, Compose([DecodeImage(), ToCHW()]))
    expect_error(ds, "too large")
    for side in (100000, 12000):  # above Pillow's own bomb limit; between ours and Pillow's
        png = png_header_only(side, side)
        ds = one_file_folder(tmp_path / str(side), "huge.png", png,
                             Compose([DecodeImage(), ToCHW()]))
        expect_error(ds, "too large")


def test_huge_claimed_size_with_crop_decodes_scaled_or_fails_cleanly(tmp_path):
    """With a crop, a 60000^2 JPEG would be decoded at 1/8 (7500^2, under the limit): its fake
    header is then caught by the decoder, not by an out-of-memory kill."""
    big = sof_patched(imgutil.jpeg("astronaut", (64, 64)), 60000, 60000)
    expect_error(one_file_folder(tmp_path, "huge.jpg", big), "corrupt JPEG")


def test_error_message_without_folder():
    with pytest.raises(SampleError, match="empty file"):
        train_tf()(b"")
    with pytest.raises(SampleError, match="not an image"):
        train_tf()(b"GIF89a-but-not-really")
