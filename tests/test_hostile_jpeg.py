"""Hostile and unusual JPEGs (issue 24): each test builds its input itself.

Overflowing region arguments, odd sampling (4:4:1, 4x2, 2x4), images smaller than the DCT factor
or without pixels, decompression bombs (a tiny file claiming a huge size, damaged data that
Pillow would pad with grey), scan-count bombs, regions that libjpeg-turbo 2.1.5 crops inexactly,
and a short mutation fuzz over the library's own decode entry points. Every route is covered:
the compiled ROI decoder, simplejpeg (``decode._jpeg`` patched out) and Pillow (CMYK JPEGs).
"""
from __future__ import annotations

import io
import os
import random
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image, ImageFile

import imgutil
import jpegcraft
from pooled_loader.core.errors import SampleError
from pooled_loader.vision import Compose, DecodeImage, ImageFolder, RandomResizedCrop, Resize, ToCHW
from pooled_loader.vision.io import decode

needs_roi = pytest.mark.skipif(decode.DECODER != "roi", reason="pooled_loader.vision._jpeg not "
                               "built (no libjpeg-turbo headers at build time) or disabled")
_jpeg = decode._jpeg
IMG = imgutil.rgb("astronaut", (97, 61))  # odd sizes: partial last iMCU row and column
ODD = {"441": ((1, 4), (1, 1), (1, 1)), "4x2": ((4, 2), (1, 1), (1, 1)),
       "2x4": ((2, 4), (1, 1), (1, 1)), "4x4": ((4, 4), (1, 1), (1, 1))}


@pytest.fixture(params=["roi", "simplejpeg"])
def route(request, monkeypatch):
    """Run the test with the compiled decoder and again with simplejpeg in its place."""
    if request.param == "roi":
        if _jpeg is None:
            pytest.skip("pooled_loader.vision._jpeg not built")
    else:
        monkeypatch.setattr(decode, "_jpeg", None)
    return request.param


def folder(tmp_path, name: str, data: bytes, transform=None) -> ImageFolder:
    imgutil.write(str(tmp_path / "cls" / name), data)
    tf = transform or Compose([DecodeImage(), RandomResizedCrop(32), ToCHW()])
    return ImageFolder(str(tmp_path), transform=tf)


def expect_error(ds: ImageFolder, *reasons: str) -> str:
    """The sample raises SampleError naming its file and every reason, by both entry points."""
    path = ds.samples[0][0]
    for call in (lambda: ds[0], lambda: ds.getitem_into(0, (np.empty((3, 32, 32), np.uint8), 0))):
        with pytest.raises(SampleError) as info:
            call()
        msg = str(info.value)
        assert path in msg and all(r in msg for r in reasons), msg
    return msg


def sof_patched(data: bytes, width: int, height: int) -> bytes:
    i = next(i for i in range(len(data)) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC2))
    return data[:i + 5] + struct.pack(">HH", height, width) + data[i + 9:]


def whole(data: bytes, factor: int = 1, fast: bool = False) -> np.ndarray:
    hdr = decode.read_header(data)
    return decode.decode_into(data, hdr, lambda n: np.empty(n, np.uint8), factor, fast)


def pillow_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


# ---------------------------------------------------------------- 1. region arguments

@needs_roi
def test_region_arguments_that_would_overflow_or_be_cut_to_32_bits_raise_value_error():
    data = imgutil.encode(IMG)
    out = np.empty(IMG.size, np.uint8)
    W, H = IMG.shape[1], IMG.shape[0]
    bad = [dict(x0=2**62, w=2**62, y0=0, h=10),  # x0 + w wraps in 64 bits
           dict(x0=2**63 - 1, w=1, y0=0, h=1), dict(x0=0, w=2**63 - 1, y0=0, h=1),
           dict(x0=2**32 + 1, w=1, y0=0, h=1),  # 1 once cut to 32 bits
           dict(x0=0, w=2**32 + 5, y0=0, h=5), dict(x0=-1, w=5, y0=0, h=5),
           dict(x0=0, w=5, y0=-(2**40), h=5), dict(x0=0, w=5, y0=0, h=2**64),
           dict(x0=W - 1, w=2**31 - 1, y0=0, h=1), dict(x0=0, w=1, y0=H, h=1),
           dict(x0=0, w=1, y0=0, h=0), dict(x0=3, w=0, y0=0, h=0)]
    for kw in bad:
        with pytest.raises(ValueError):
            _jpeg.decode(data, out, 1, kw["x0"], kw["y0"], kw["w"], kw["h"])
    for kw in [dict(factor=2**32 + 1), dict(factor=-8), dict(max_scans=-1),
               dict(max_scans=2**31), dict(max_memory=2**63), dict(max_memory=-5)]:
        with pytest.raises(ValueError):
            _jpeg.decode(data, out, **kw)
        with pytest.raises(ValueError):
            _jpeg.check(data, **kw)
    with pytest.raises(TypeError):
        _jpeg.decode(data, out, 1, 0.5)
    # the largest region that fits still decodes
    assert _jpeg.decode(data, out, 1, 0, 0, W, H) == (0, W)


# ---------------------------------------------------------------- 2. odd sampling

def test_a_4_4_1_sampled_jpeg_decodes_to_pillows_pixels(route):
    data = jpegcraft.sampled(IMG, ODD["441"])
    hdr = decode.read_header(data)  # was a bare KeyError: 6 from simplejpeg's header call
    assert (hdr.height, hdr.width, hdr.jpeg) == (61, 97, True)
    np.testing.assert_array_equal(whole(data), pillow_rgb(data))
    np.testing.assert_array_equal(DecodeImage()(data), pillow_rgb(data))
    random.seed(1)
    y = Compose([DecodeImage(), RandomResizedCrop(24), ToCHW()])(data)
    assert y.shape == (3, 24, 24)


@pytest.mark.parametrize("name", sorted(ODD))
def test_every_odd_sampling_decodes_whole_like_pillow(name, route):
    data = jpegcraft.sampled(IMG, ODD[name])
    assert decode.read_header(data).frame.sampling == ODD[name]
    np.testing.assert_array_equal(whole(data), pillow_rgb(data))


# ---------------------------------------------------------------- 3. tiny and empty images

@pytest.mark.parametrize("mode", [None, "CMYK"])  # libjpeg-turbo's route and Pillow's
@pytest.mark.parametrize("size", [(1, 1), (3, 2), (2, 7), (7, 5)])
def test_images_smaller_than_the_dct_factor_decode_at_every_factor(size, mode, route):
    img = imgutil.rgb("chelsea", size)
    data = imgutil.encode(img, quality=95, mode=mode)
    alloc = lambda n: np.empty(n, np.uint8)  # noqa: E731
    hdr = decode.read_header(data)
    for factor in decode.JPEG_SCALES:
        a = decode.decode_into(data, hdr, alloc, factor)
        assert a.shape[2] == 3 and 1 <= a.shape[0] <= size[1] and 1 <= a.shape[1] <= size[0]
        c = decode.decode_crop_into(data, hdr, alloc, factor, (0, 0, size[0], size[1]), (1, 1))
        assert c.image.size >= 3
    for tf in (Compose([DecodeImage(), RandomResizedCrop(1), ToCHW()]),
               Compose([DecodeImage(), RandomResizedCrop(16), ToCHW()]),
               Compose([DecodeImage(), Resize(max_side=3)])):
        for _ in range(5):
            assert tf(data).size > 0


@pytest.mark.parametrize("name,data", [("bufr.jpg", b"BUFR" + bytes(200)),
                                       ("hdf5.jpg", b"\x89HDF\r\n\x1a\n" + bytes(200))])
def test_pillow_stub_formats_are_a_clear_error_naming_the_file(tmp_path, name, data):
    expect_error(folder(tmp_path, name, data), "unsupported image format", "no decoder")


def test_a_jpeg_claiming_zero_width_or_height_is_a_clear_error(tmp_path, route):
    small = imgutil.encode(IMG)
    for k, (w, h) in enumerate([(0, 61), (97, 0), (0, 0)]):
        msg = expect_error(folder(tmp_path / str(k), "zero.jpg", sof_patched(small, w, h)),
                           "JPEG")  # libjpeg: "Empty JPEG image (DNL not supported)"
        assert f"without pixels ({w}x{h})" in msg or "Empty JPEG image" in msg, msg


def test_resizing_ops_refuse_an_image_without_pixels_with_value_error():
    for h, w in [(0, 5), (5, 0), (0, 0)]:
        with pytest.raises(ValueError, match="without pixels"):
            RandomResizedCrop(8).box(h, w)
        with pytest.raises(ValueError, match="without pixels"):
            Resize(8).out_hw(h, w)


# ---------------------------------------------------------------- 4. bombs and damaged data

_RSS_CHILD = r"""
import resource, sys, numpy as np
sys.path.insert(0, {tests!r})
from pooled_loader.core.errors import SampleError
from pooled_loader.vision import Compose, DecodeImage, ToCHW, decode
if {no_ext}:
    decode._jpeg = None
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    Compose([DecodeImage(), ToCHW()])(data)
    print("DECODED")
except SampleError as e:
    print("ERROR", e)
print("RSS_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.parametrize("mode,no_ext", [(m, n) for m in ("CMYK", None, "progressive")
                                         for n in (False, True)])
def test_a_749_byte_file_claiming_11585_squared_is_an_error_in_little_memory(tmp_path, mode,
                                                                             no_ext):
    """Under MAX_PIXELS, so the size is allowed; its data is damaged, which must be an error,
    not 1.5 GB of grey (Pillow's route: CMYK), found before the big buffers are touched."""
    if _jpeg is None and not no_ext:
        pytest.skip("pooled_loader.vision._jpeg not built")
    small = imgutil.encode(imgutil.rgb("astronaut", (64, 64)), quality=50,
                           **({"progressive": True} if mode == "progressive" else {"mode": mode}))
    bomb = sof_patched(small, 11585, 11585)[:747] + b"\xff\xd9"  # Pillow: grey after the EOI
    assert 11585 ** 2 <= decode.MAX_PIXELS and len(bomb) == 749
    path = imgutil.write(str(tmp_path / "bomb.jpg"), bomb)
    code = _RSS_CHILD.format(tests=os.path.dirname(__file__), no_ext=no_ext)
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "corrupt JPEG" in out.stdout, out.stdout
    rss = float(out.stdout.split("RSS_MB")[1])
    assert rss < 100, f"the refused bomb still took {rss:.0f} MB"


def test_damaged_scan_data_is_an_error_on_every_route_not_grey(tmp_path, route):
    for k, mode in enumerate([None, "CMYK", "L"]):
        data = bytearray(imgutil.encode(IMG, mode=mode))
        sos = data.index(b"\xff\xda")
        data[sos + 60:sos + 100] = b"\xff\xd9" * 20  # end-of-image markers inside the scan
        assert Image.open(io.BytesIO(bytes(data))).convert("RGB").size == (97, 61)  # Pillow: grey
        ds = folder(tmp_path / str(k), "damaged.jpg", bytes(data),
                    Compose([DecodeImage(), ToCHW()]))
        expect_error(ds, "corrupt JPEG")


def test_truncated_png_is_an_error_even_when_the_process_allows_truncated_images(tmp_path,
                                                                                  monkeypatch):
    png = imgutil.encode(IMG, "PNG")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    expect_error(folder(tmp_path, "cut.png", png[:len(png) * 2 // 3],
                        Compose([DecodeImage(), ToCHW()])), "truncated")
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # the process's setting is restored


def test_a_progressive_jpeg_whose_coefficients_exceed_the_memory_limit_is_refused_first(
        tmp_path, route):
    """A 30000^2 progressive JPEG is decodable at 1/8 (3750^2, under MAX_PIXELS), but libjpeg
    would keep 2.7 GB of coefficients: refused from its header, before any allocation."""
    prog = imgutil.encode(imgutil.rgb("astronaut", (64, 64)), progressive=True)
    padding = jpegcraft.seg(0xEC, bytes(60000)) * 8  # long enough for its claimed blocks
    big = sof_patched(prog[:2] + padding + prog[2:], 30000, 30000)
    assert len(big) >= decode.read_header(big).frame.min_bytes()
    assert decode.read_header(big).frame.coef_bytes() > decode.MAX_DECODER_MEMORY
    msg = expect_error(folder(tmp_path, "prog.jpg", big), "coefficients", "limit")
    assert "MAX_DECODER_MEMORY" in msg
    expect_error(folder(tmp_path / "w", "prog.jpg", big, Compose([DecodeImage(), ToCHW()])),
                 "too large")


# ---------------------------------------------------------------- 5. scan-count bombs

def _progressive(mode=None) -> bytes:
    return imgutil.encode(imgutil.rgb("coffee", (120, 90)), progressive=True, mode=mode)


@pytest.mark.parametrize("mode", [None, "CMYK"])
def test_a_896_scan_progressive_jpeg_is_refused_naming_the_scan_limit(tmp_path, mode, route):
    bomb = jpegcraft.many_scans(_progressive(mode), 896)
    assert len(pillow_rgb(bomb)) == 90  # valid: Pillow decodes it (slowly)
    for k, tf in enumerate([None, Compose([DecodeImage(), ToCHW()])]):
        msg = expect_error(folder(tmp_path / str(k), "scans.jpg", bomb, tf),
                           f"more than {decode.MAX_SCANS} scans")
        assert "MAX_SCANS" in msg


@pytest.mark.parametrize("mode", [None, "CMYK"])
def test_a_jpeg_with_exactly_the_scan_limit_decodes(mode, route):
    base = _progressive(mode)
    n = base.count(b"\xff\xda")
    ok = jpegcraft.many_scans(base, decode.MAX_SCANS - n)
    assert decode.jpeg_markers.count_scans(ok, 10**6) == decode.MAX_SCANS
    np.testing.assert_array_equal(whole(ok), pillow_rgb(ok))
    with pytest.raises(SampleError, match="scans"):
        whole(jpegcraft.many_scans(base, decode.MAX_SCANS - n + 1))


def test_the_scan_count_skips_segments_and_entropy_data(route):
    """SOS byte pairs inside an APP segment (an EXIF thumbnail, say) are not scans, nor are
    stuffed 0xFF bytes in entropy-coded data."""
    base = _progressive()
    scans = base.count(b"\xff\xda")
    assert b"\xff\x00" in base and scans < 20
    data = base[:2] + jpegcraft.seg(0xE1, b"Exif\0\0" + b"\xff\xda" * 300) + base[2:]
    assert decode.jpeg_markers.count_scans(data, decode.MAX_SCANS) == scans
    np.testing.assert_array_equal(whole(data), pillow_rgb(base))


# ---------------------------------------------------------------- 6. exact regions

def _region(data: bytes, factor: int, fast: bool, box: tuple[int, int, int, int], full_w: int):
    x0, y0, w, h = box
    buf = np.full(h * full_w * 3, 0xA5, np.uint8)
    xoff, width = _jpeg.decode(data, buf, factor, x0, y0, w, h, fast)
    assert xoff <= x0 and xoff + width >= x0 + w
    return buf[:h * width * 3].reshape(h, width, 3)[:, x0 - xoff:x0 - xoff + w]


@needs_roi
@pytest.mark.parametrize("name", ["420", "4x2", "2x4", "4x4", "441"])
def test_region_pixels_equal_the_whole_decode_cropped_for_narrow_regions_and_odd_sampling(name):
    img = imgutil.rgb("astronaut", (203, 157))
    data = (imgutil.encode(img, subsampling=2) if name == "420"
            else jpegcraft.sampled(img, ODD[name]))
    rng = random.Random(name)
    for factor in decode.JPEG_SCALES:
        for fast in (False, True):
            full = whole(data, factor, fast)
            H, W = full.shape[:2]
            boxes = [(x, 0, 1, H) for x in range(0, W, max(1, W // 13))]  # 1 pixel wide
            boxes += [(0, 0, 1, H), (W - 1, 0, 1, H), (0, H // 3, 1, 1), (1, 0, 2, H)]
            for _ in range(12):
                bw, bh = rng.randint(1, W), rng.randint(1, H)
                boxes.append((rng.randint(0, W - bw), rng.randint(0, H - bh), bw, bh))
            for x0, y0, bw, bh in boxes:
                np.testing.assert_array_equal(
                    _region(data, factor, fast, (x0, y0, bw, bh), W),
                    full[y0:y0 + bh, x0:x0 + bw], err_msg=f"{name} 1/{factor} fast={fast} "
                                                          f"box={(x0, y0, bw, bh)}")


# ---------------------------------------------------------------- mutation fuzz

def _seeds() -> list[bytes]:
    img = imgutil.rgb("chelsea", (40, 30))
    return [imgutil.encode(img, quality=80), imgutil.encode(img, progressive=True),
            imgutil.encode(img, mode="L"), imgutil.encode(img, mode="CMYK"),
            jpegcraft.sampled(img, ODD["441"]), jpegcraft.sampled(img, ODD["4x2"])]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    d = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(d[:rng.randrange(3, len(d))])  # truncated
    if kind == 1:
        for _ in range(rng.randint(1, 4)):
            d[rng.randrange(2, len(d))] ^= 1 << rng.randrange(8)  # bit flips
    elif kind == 2:
        i = rng.randrange(2, len(d))
        d[i:i + rng.randint(1, 8)] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:  # a header byte set to an extreme (sizes, sampling, lengths, table ids)
        d[rng.randrange(2, min(len(d), 700))] = rng.choice([0, 1, 0x7F, 0xFF, 0x44])
    return bytes(d)


def test_mutated_jpegs_decode_or_raise_sample_error_on_every_route(route):
    """A few seconds of random truncations, bit flips and byte changes through read_header,
    decode_into, decode_crop_into and the fused pipeline: each either decodes or raises
    SampleError, never another exception, a crash or a hang."""
    rng = random.Random(24)
    seeds = _seeds()
    tf = Compose([DecodeImage(), RandomResizedCrop(16), ToCHW()])
    alloc = lambda n: np.empty(n, np.uint8)  # noqa: E731
    counts = {"decoded": 0, "refused": 0}
    deadline = time.monotonic() + 3.0
    for i in range(2000):
        if time.monotonic() > deadline:
            break
        data = _mutate(rng, rng.choice(seeds))
        try:
            hdr = decode.read_header(data)
            factor = rng.choice(decode.JPEG_SCALES)
            decode.decode_into(data, hdr, alloc, factor)
            box = (0, 0, max(1, hdr.width // 2), max(1, hdr.height // 2))
            decode.decode_crop_into(data, hdr, alloc, factor, box, (8, 8))
            assert tf(data).shape == (3, 16, 16)
            counts["decoded"] += 1
        except SampleError:
            counts["refused"] += 1
    assert counts["decoded"] > 10 and counts["refused"] > 10, counts


@needs_roi
def test_our_marker_walk_reads_the_frame_header_as_libjpeg_does():
    """The fallback header reader (no compiled decoder) agrees with libjpeg's jpeg_read_header
    on every kind of JPEG the tests build."""
    rgb_adobe = imgutil.encode(IMG, mode="RGB", keep_rgb=True)
    kinds = [imgutil.encode(IMG), imgutil.encode(IMG, progressive=True),
             imgutil.encode(IMG, mode="L"), imgutil.encode(IMG, mode="CMYK"),
             imgutil.encode(IMG, mode="CMYK", progressive=True), rgb_adobe,
             jpegcraft.many_scans(_progressive(), 3)]
    kinds += [jpegcraft.sampled(IMG, f) for f in ODD.values()]
    for data in kinds:
        assert decode.jpeg_markers.frame(data) == decode.jpeg_markers.Frame(*_jpeg.header(data))
    assert decode.jpeg_markers.frame(rgb_adobe).colorspace == "RGB"
    for bad in (b"\xff\xd8\xff", kinds[0][:300], b"\xff\xd8\xff\xe0\x00\x01"):
        with pytest.raises(ValueError):
            decode.jpeg_markers.frame(bad)
        with pytest.raises(ValueError):
            _jpeg.header(bad)
