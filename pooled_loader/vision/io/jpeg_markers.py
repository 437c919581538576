"""JPEG marker walking: the frame header (size, sampling, colour space) and the scan count.

vision/io/decode.py picks a JPEG's decode route from a :class:`Frame`: the compiled decoder's
``header()`` (libjpeg's jpeg_read_header) fills it where built, else :func:`frame` reads it
here, not through simplejpeg's header call, which raises a bare ``KeyError`` for sampling that
TurboJPEG names but simplejpeg does not (4:4:1) and refuses others (4x2). The colour space
follows libjpeg's own rules (jdapimin.c ``default_decompress_parms``: JFIF, then Adobe's
transform flag, then the component ids), so both readers agree (tests/test_hostile_jpeg.py).
:func:`count_scans` counts the scans exactly (it skips marker segments by their length and
entropy-coded data up to its next marker), for the routes whose decoder has no scan limit of its
own. Both read untrusted bytes: every length is checked against the data, and a damaged header
raises ValueError.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

SOI, EOI, SOS = 0xD8, 0xD9, 0xDA
_STANDALONE = {0x01, *range(0xD0, 0xD8)}  # TEM and RSTn carry no length
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
_HUFFMAN_8BIT = {0xC0, 0xC1, 0xC2}  # baseline, extended, progressive: what libjpeg-turbo decodes


class Frame(NamedTuple):
    """A JPEG's frame header and the facts around it that pick the decoder."""

    height: int
    width: int
    sampling: tuple[tuple[int, int], ...]  # (h, v) per component
    colorspace: str  # "Gray", "YCbCr", "RGB", "CMYK", "YCCK" or "unknown" (libjpeg's rules)
    progressive: bool
    multi_scan: bool  # progressive, or a first scan without every component: libjpeg then
    # keeps every coefficient of the image in memory
    huffman_8bit: bool  # SOF0/1/2 with 8-bit samples

    def _samples(self) -> list[tuple[int, int]]:
        """(width, height) of each component's plane (libjpeg's rounding)."""
        hmax = max(h for h, _ in self.sampling)
        vmax = max(v for _, v in self.sampling)
        return [(-(-self.width * h // hmax), -(-self.height * v // vmax))
                for h, v in self.sampling]

    def min_bytes(self) -> int:
        """Fewest bytes of entropy-coded data a Huffman-coded JPEG of this size can have (a
        Huffman code is at least 1 bit): sequential, every 8x8 block codes a DC difference and an
        AC symbol; progressive, the first scan (which must be a DC scan) codes a DC difference
        for every block of at least one component. 0 for arithmetic coding."""
        if not self.huffman_8bit:
            return 0
        blocks = [-(-w // 8) * -(-h // 8) for w, h in self._samples()]
        return min(blocks) // 8 if self.progressive else sum(blocks) * 2 // 8

    def coef_bytes(self) -> int:
        """Bytes of the whole-image coefficient buffer a multi-scan decode needs (2 per sample,
        at full size whatever the DCT scale), 0 for a single-scan JPEG."""
        if not self.multi_scan:
            return 0
        return sum(2 * w * h for w, h in self._samples())


def _segments(d: bytes) -> list[tuple[int, int, int]]:
    """(marker, payload offset, payload length) from after SOI up to and including the first
    SOS; ValueError when the data ends first or a length is impossible."""
    out, i, n = [], 2, len(d)
    while True:
        if i + 4 > n:
            raise ValueError("JPEG header ends before the first scan")
        if d[i] != 0xFF:
            raise ValueError(f"no JPEG marker at byte {i}")
        marker = d[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker == SOI or marker == EOI:
            raise ValueError(f"marker 0x{marker:02X} in the JPEG header")
        length = d[i + 2] << 8 | d[i + 3]
        if length < 2 or i + 2 + length > n:
            raise ValueError(f"marker 0x{marker:02X} at byte {i} claims {length} bytes, "
                             f"past the end of the data")
        out.append((marker, i + 4, length - 2))
        if marker == SOS:
            return out
        i += 2 + length


def _colorspace(ncomp: int, jfif: bool, adobe: int | None, ids: tuple[int, ...]) -> str:
    if ncomp == 1:
        return "Gray"
    if ncomp == 3:
        if jfif:
            return "YCbCr"
        if adobe is not None:
            return {0: "RGB", 1: "YCbCr"}.get(adobe, "unknown")  # libjpeg warns on others
        return "RGB" if ids == (82, 71, 66) else "YCbCr"
    if ncomp == 4:
        return {None: "CMYK", 0: "CMYK", 2: "YCCK"}.get(adobe, "unknown")
    return "unknown"


def frame(data: bytes) -> Frame:
    """The frame header of the JPEG ``data`` (which starts with SOI); ValueError if damaged."""
    jfif, adobe, sof, first_scan_comps = False, None, None, 0
    for marker, at, n in _segments(data):
        if marker == 0xE0:
            jfif = jfif or bytes(data[at:at + 5]) == b"JFIF\0"
        elif marker == 0xEE and n >= 12 and bytes(data[at:at + 5]) == b"Adobe":
            adobe = data[at + 11]
        elif marker in _SOF:
            body = bytes(data[at:at + n])
            if sof is not None:
                raise ValueError("two frame headers (SOF) in one JPEG")
            if n < 6 or n < 6 + 3 * body[5]:
                raise ValueError("JPEG frame header (SOF) too short")
            sof = marker, body
        elif marker == SOS:
            first_scan_comps = data[at] if n else 0
    if sof is None:
        raise ValueError("JPEG without a frame header (SOF) before its first scan")
    marker, body = sof
    precision, height, width, ncomp = struct.unpack_from(">BHHB", body)
    ids, sampling = body[6::3][:ncomp], []
    for c in body[7::3][:ncomp]:
        h, v = c >> 4, c & 15
        if not (1 <= h <= 4 and 1 <= v <= 4):
            raise ValueError(f"JPEG frame header with bad sampling factors {h}x{v}")
        sampling.append((h, v))
    if ncomp == 0:
        raise ValueError("JPEG frame header without components")
    progressive = marker in _PROGRESSIVE
    return Frame(height, width, tuple(sampling), _colorspace(ncomp, jfif, adobe, tuple(ids)),
                 progressive, progressive or first_scan_comps < ncomp,
                 marker in _HUFFMAN_8BIT and precision == 8)


def count_scans(data: bytes, stop: int) -> int:
    """The number of scans (SOS markers outside other segments and entropy-coded data) in the
    JPEG ``data``, counting at most up to ``stop``; a damaged file counts what it reaches."""
    if data.count(b"\xff\xda") <= stop:  # an upper bound, found at C speed
        return data.count(b"\xff\xda")
    d, i, n, scans = data, 2, len(data), 0
    while i + 3 < n and scans <= stop:
        if d[i] != 0xFF:
            return scans
        marker = d[i + 1]
        if marker == 0xFF:
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker == EOI:
            return scans
        i += 2 + struct.unpack_from(">H", d, i + 2)[0]
        if marker != SOS:
            continue
        scans += 1
        while True:  # entropy-coded data: up to the next marker that is not a stuffed 0xFF/RST
            i = d.find(b"\xff", i)
            if i < 0 or i + 1 >= n:
                return scans
            if d[i + 1] == 0 or 0xD0 <= d[i + 1] <= 0xD7:
                i += 2
                continue
            break
    return scans
