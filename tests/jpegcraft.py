"""Valid but unusual JPEGs, built by splicing Pillow's own encodings (no encoder of our own).

- :func:`sampled`: a YCbCr JPEG with any sampling factors (4:4:1, 4x2, 2x4, ...) that Pillow
  cannot write: each plane is encoded by Pillow as a greyscale JPEG of the plane's own size
  (same quantisation and Huffman tables), and the three entropy-coded segments become three
  non-interleaved scans of one baseline frame. A non-interleaved scan codes a component's
  blocks in raster order whatever its sampling, so the result is a valid JPEG.
- :func:`many_scans`: a progressive JPEG followed by ``n`` more valid scans (DC first scans,
  point transform 0, every difference 0), the shape of a scan-count bomb.
"""
from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image

SOF0, SOF2, DHT, DQT, SOS, EOI = 0xC0, 0xC2, 0xC4, 0xDB, 0xDA, 0xD9


def segments(data: bytes) -> tuple[list[tuple[int, bytes]], bytes]:
    """The marker segments before the first SOS (marker, payload) and the rest from that SOS."""
    out, i = [], 2
    while True:
        marker, n = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker == SOS:
            return out, data[i:]
        out.append((marker, data[i + 4:i + 2 + n]))
        i += 2 + n


def seg(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _grey_jpeg(plane: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(plane, "L").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def sampled(rgb: np.ndarray, factors: tuple[tuple[int, int], ...], quality: int = 90) -> bytes:
    """A baseline YCbCr JPEG of ``rgb`` with per-component (h, v) sampling ``factors``."""
    H, W = rgb.shape[:2]
    hmax, vmax = max(f[0] for f in factors), max(f[1] for f in factors)
    ycc = np.asarray(Image.fromarray(rgb).convert("YCbCr"))
    frame, scans, tables = [], [], None
    for c, (h, v) in enumerate(factors):
        cw, ch = -(-W * h // hmax), -(-H * v // vmax)  # libjpeg's component size (rounded up)
        plane = np.asarray(Image.fromarray(ycc[:, :, c]).resize((cw, ch), Image.BILINEAR))
        segs, scan = segments(_grey_jpeg(np.ascontiguousarray(plane), quality))
        t = [s for s in segs if s[0] in (DQT, DHT)]
        assert tables is None or t == tables, "planes were coded with different tables"
        tables = t
        frame.append(bytes([c + 1, h << 4 | v, 0]))
        body = scan[2 + struct.unpack(">H", scan[2:4])[0]:]
        assert body.endswith(b"\xff\xd9")
        scans.append(seg(SOS, bytes([1, c + 1, 0x00, 0, 63, 0])) + body[:-2])
    jfif = seg(0xE0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0")
    sof = seg(SOF0, struct.pack(">BHHB", 8, H, W, len(factors)) + b"".join(frame))
    return (b"\xff\xd8" + jfif + b"".join(seg(m, p) for m, p in tables) + sof
            + b"".join(scans) + b"\xff\xd9")


def many_scans(progressive: bytes, n: int, component: int = 1) -> bytes:
    """``progressive`` (one of Pillow's, whose script leaves every coefficient at point
    transform 0) plus ``n`` DC first scans of ``component`` (1-based) coding every difference
    as 0: valid, and each one re-reads the whole component."""
    segs, _ = segments(progressive)
    sof = next(p for m, p in segs if m == SOF2)
    H, W, nc = struct.unpack(">HHB", sof[1:6])
    comps = [sof[6 + 3 * i:9 + 3 * i] for i in range(nc)]
    hmax = max(c[1] >> 4 for c in comps)
    vmax = max(c[1] & 15 for c in comps)
    h, v = comps[component - 1][1] >> 4, comps[component - 1][1] & 15
    blocks = -(-(-(-W * h // hmax)) // 8) * -(-(-(-H * v // vmax)) // 8)
    # DC table 3: one symbol (difference category 0) with the 1-bit code "0"
    table = seg(DHT, bytes([0x03, 1] + [0] * 15 + [0]))
    bits = "0" * blocks + "1" * (-blocks % 8)
    data = int(bits, 2).to_bytes(len(bits) // 8, "big")
    assert b"\xff" not in data
    scan = seg(SOS, bytes([1, comps[component - 1][0], 0x30, 0, 0, 0])) + data
    assert progressive.endswith(b"\xff\xd9")
    return progressive[:-2] + table + scan * n + b"\xff\xd9"
