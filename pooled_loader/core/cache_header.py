"""The preamble and JSON header of a ``pooled_loader.cache`` file, read and checked (the byte
layout is described in ``cache/format.py``).

Why here, in core/: ``ImageFolder.check_classes`` (vision/) compares a folder's classes with the
class list a cache file keeps in its header, and vision/ sits below cache/ (whose builder runs
the loader): reading a header must not load the cache builder, the loader or anything above
vision. ``cache/format.py`` imports everything here back, so its names stay where they were.

A header is checked against a schema (types, bounds, nesting) before any of it is used: a
crafted header with a valid CRC fails as a ``CacheFormatError`` naming the file, not as a
KeyError, a RecursionError or a huge allocation. Imports nothing of pooled_loader outside core/.
"""
from __future__ import annotations

import json
import os
import reprlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .errors import CacheFormatError, CacheIncompleteError
from .safe_open import open_regular

MAGIC = b"PLCACHE\x00"
FORMAT_VERSION = 2  # 2: each index array has a crc32 in the header (labels are covered)
PREAMBLE = struct.Struct("<8sIIQQII")  # 40 bytes, padded to PREAMBLE_SIZE
PREAMBLE_SIZE = 64
DATA_START = 4096
STATE_BUILDING, STATE_COMPLETE = 0, 1

VAR_KINDS = ("array", "tensor", "str", "bytes")
SCALAR_KINDS = {"int": "<i8", "float": "<f8", "bool": "|b1"}
KINDS = (*VAR_KINDS, *SCALAR_KINDS, "npscalar", "none")
# Bounds on a header's contents, checked before any is used
MAX_DEPTH = 32  # nesting of the sample layout
MAX_LEAVES = 4096  # leaves of one sample
MAX_NDIM = 32  # numpy's own limit on an array's dimensions (NPY_MAXDIMS)
MAX_COUNT = 1 << 40  # samples
MAX_VARIANTS = 1 << 16


def pack_preamble(state: int, hdr_off: int = 0, hdr_len: int = 0, hdr_crc: int = 0) -> bytes:
    """The 64-byte preamble."""
    head = PREAMBLE.pack(MAGIC, FORMAT_VERSION, state, hdr_off, hdr_len, hdr_crc, 0)[:-4]
    return (head + struct.pack("<I", zlib.crc32(head))).ljust(PREAMBLE_SIZE, b"\x00")


@dataclass
class Preamble:
    version: int
    state: int
    hdr_off: int
    hdr_len: int
    hdr_crc: int


def unpack_preamble(raw: bytes, path: str) -> Preamble:
    """Parse and check a preamble; raise CacheFormatError naming ``path`` when it is not one."""
    rebuild = "rebuild it with build_cache() / `python -m pooled_loader cache build`"
    if len(raw) < PREAMBLE.size or raw[:8] != MAGIC:
        raise CacheFormatError(f"{path}: not a pooled_loader cache file (bad magic); {rebuild}")
    magic, version, state, off, length, hcrc, pcrc = PREAMBLE.unpack(raw[:PREAMBLE.size])
    if version != FORMAT_VERSION:
        raise CacheFormatError(
            f"{path}: cache format version {version}, this pooled_loader reads version "
            f"{FORMAT_VERSION}; {rebuild} (or use the pooled_loader that wrote it)")
    if zlib.crc32(raw[:PREAMBLE.size - 4]) != pcrc:
        raise CacheFormatError(f"{path}: corrupted preamble (checksum mismatch); {rebuild}")
    return Preamble(version, state, off, length, hcrc)


def index_arrays(leaves: list[dict], count: int, variants: int) -> dict[str, np.ndarray]:
    arrs: dict[str, np.ndarray] = {}
    for lf in leaves:
        j = lf["id"]
        if lf["kind"] in VAR_KINDS:
            arrs[f"leaf{j}.offset"] = np.zeros((count, variants), "<u8")
            arrs[f"leaf{j}.nbytes"] = np.zeros((count, variants), "<u8")
            arrs[f"leaf{j}.crc"] = np.zeros((count, variants), "<u4")
            if lf["ndim"]:
                arrs[f"leaf{j}.shape"] = np.zeros((count, variants, lf["ndim"]), "<i8")
        elif lf["kind"] != "none":
            arrs[f"leaf{j}.value"] = np.zeros((count, variants), lf["dtype"])
    return arrs


def read_header(path: str, fsize: int | None = None, pre: bytes | None = None,
                fd: int | None = None) -> dict:
    """Check the preamble and return the JSON header of a complete cache file, validated by
    ``check_header`` (CacheFormatError naming ``path`` for anything amiss). ``fd``: the file
    already open (``fsize`` and ``pre`` read from it); else ``path`` is opened, refused if it
    is not a regular file."""
    if fd is None:
        with os.fdopen(open_regular(path, what="cache file", follow=True), "rb") as f:
            return read_header(path, os.fstat(f.fileno()).st_size, f.read(PREAMBLE_SIZE),
                               f.fileno())
    p = unpack_preamble(pre, path)
    if p.state != STATE_COMPLETE:
        raise CacheIncompleteError(f"{path}: unfinished build (never completed); run "
                                   "build_cache() on the same dataset again to finish it")
    if p.hdr_off + p.hdr_len > fsize:
        raise CacheFormatError(f"{path}: truncated: {fsize} bytes, the header ends at byte "
                               f"{p.hdr_off + p.hdr_len}; rebuild the cache")
    hb = os.pread(fd, p.hdr_len, p.hdr_off)
    if zlib.crc32(hb) != p.hdr_crc:
        raise CacheFormatError(f"{path}: corrupted header (checksum mismatch); rebuild the cache")
    try:
        hdr = json.loads(hb)
    except (ValueError, RecursionError) as e:
        raise CacheFormatError(f"{path}: header is not valid JSON ({type(e).__name__}); "
                               "rebuild the cache") from None
    check_header(hdr, path, fsize, p.hdr_off)
    return hdr


def check_header(hdr: Any, path: str, fsize: int, hdr_off: int) -> None:
    """Raise CacheFormatError naming ``path`` unless ``hdr`` is a well-formed cache header whose
    layout, counts and index arrays fit each other and the file (``fsize`` bytes, the header at
    ``hdr_off``)."""
    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: malformed header: {what}; rebuild the cache")

    def num(d: dict, key: str, lo: int, hi: int) -> int:
        v = d.get(key)
        if type(v) is not int or not lo <= v <= hi:
            raise bad(f"{key} is {_short(v)}, not an integer in [{lo}, {hi}]")
        return v

    if not isinstance(hdr, dict):
        raise bad("not a JSON object")
    if hdr.get("format_version") != FORMAT_VERSION:
        raise bad(f"format_version {_short(hdr.get('format_version'))}")
    count = num(hdr, "count", 0, MAX_COUNT)
    variants = num(hdr, "variants", 1, MAX_VARIANTS)
    num(hdr, "seed", -(1 << 63), (1 << 64) - 1)
    source_count = num(hdr, "source_count", count, MAX_COUNT) if "source_count" in hdr else count
    data_start = num(hdr, "data_start", DATA_START, fsize)
    data_end = num(hdr, "data_end", data_start, min(fsize, hdr_off))
    if not isinstance(hdr.get("created"), str) or not isinstance(hdr.get("source"), dict) \
            or not isinstance(hdr["source"].get("fingerprint"), str):
        raise bad("created or source (with its fingerprint) missing")
    skipped = hdr.get("skipped", [])
    if not isinstance(skipped, list) or len(skipped) > source_count or not all(
            isinstance(e, dict) and type(e.get("index")) is int and 0 <= e["index"] < source_count
            and isinstance(e.get("path"), (str, type(None))) and isinstance(e.get("reason"), str)
            for e in skipped):
        raise bad("skipped is not a list of {index, path, reason} within the source")
    leaves = _check_layout(hdr.get("layout"), bad)
    want = {name: (a.dtype, a.shape) for name, a in
            index_arrays(leaves, 0, variants).items()}  # shapes with count 0: fixed below
    if "source_index" in hdr.get("arrays", {}):
        want["source_index"] = (np.dtype("<i8"), (0,))
    arrays = hdr.get("arrays")
    if not isinstance(arrays, dict) or set(arrays) != set(want):
        raise bad(f"index arrays {sorted(arrays) if isinstance(arrays, dict) else arrays!r} "
                  f"are not those of the layout ({sorted(want)})")
    for name, a in arrays.items():
        dt, shape = want[name]
        shape = (count,) + shape[1:]
        if not isinstance(a, dict) or a.get("dtype") != dt.str or a.get("shape") != list(shape) \
                or type(a.get("crc")) is not int:
            raise bad(f"index array {name} is not {dt.str} of shape {list(shape)} with a crc")
        num(a, "offset", data_end, fsize - dt.itemsize * int(np.prod(shape, dtype=object)))


def _check_layout(tree: Any, bad: Callable[[str], CacheFormatError]) -> list[dict]:
    """The leaves of a stored layout tree, in order, after checking its schema."""
    leaves: list[dict] = []

    def walk(node: Any, depth: int) -> None:
        if depth > MAX_DEPTH or len(leaves) > MAX_LEAVES:
            raise bad(f"layout nested deeper than {MAX_DEPTH} or with over {MAX_LEAVES} leaves")
        t = node.get("t") if isinstance(node, dict) else None
        if t == "leaf":
            leaves.append(_check_leaf(node, len(leaves), bad))
            return
        items = node.get("items") if t in ("tuple", "list", "dict") else None
        if not isinstance(items, list):
            raise bad(f"layout node {_short(node)}")
        if t == "dict":
            keys = node.get("keys")
            if not isinstance(keys, list) or len(keys) != len(items) or len(set(keys)) != len(
                    keys) or not all(isinstance(k, str) for k in keys):
                raise bad(f"dict node keys {_short(keys)}")
        for child in items:
            walk(child, depth + 1)

    walk(tree, 0)
    return leaves


def _check_leaf(lf: dict, id_: int, bad: Callable[[str], CacheFormatError]) -> dict:
    kind = lf.get("kind")
    if lf.get("id") != id_ or type(lf.get("id")) is not int or kind not in KINDS:
        raise bad(f"leaf {_short(lf)} (expected id {id_} and a known kind)")
    if kind == "none":
        return lf
    try:
        dt = np.dtype(lf["dtype"]) if isinstance(lf.get("dtype"), str) else None
    except (TypeError, ValueError, SyntaxError):  # numpy parses "3i4"-style strings with ast
        dt = None
    if dt is None or dt.hasobject or (
            kind in SCALAR_KINDS and lf["dtype"] != SCALAR_KINDS[kind]) or (
            kind in ("str", "bytes") and (lf["dtype"], lf.get("ndim")) != ("|u1", 1)):
        raise bad(f"leaf {id_} has dtype {_short(lf.get('dtype'))}")
    if kind in VAR_KINDS and (type(lf.get("ndim")) is not int or not 0 <= lf["ndim"] <= MAX_NDIM):
        raise bad(f"leaf {id_} has ndim {_short(lf.get('ndim'))}")
    return lf


def _short(value: Any) -> str:
    return reprlib.repr(value)  # bounded in depth and length, whatever a header holds


__all__ = ["MAGIC", "FORMAT_VERSION", "PREAMBLE", "PREAMBLE_SIZE", "DATA_START", "STATE_BUILDING",
           "STATE_COMPLETE", "VAR_KINDS", "SCALAR_KINDS", "KINDS", "Preamble", "pack_preamble",
           "unpack_preamble", "index_arrays", "read_header", "check_header"]
