"""On-disk format of a ``pooled_loader.cache`` file, and the sample layout it stores.

One file holds every sample of a dataset (``count`` indices x ``variants`` outputs each)::

    offset 0      preamble (64 bytes, little-endian)
                    magic    8s   b"PLCACHE\\0"
                    version  u32  FORMAT_VERSION
                    state    u32  0 = still being built, 1 = complete
                    hdr_off  u64  offset of the JSON header (0 while building)
                    hdr_len  u64  its length in bytes
                    hdr_crc  u32  crc32 of the JSON header bytes
                    pre_crc  u32  crc32 of the 36 bytes above
    4096          data: one record per (index, variant) and variable-size leaf, each at a
                  64-byte aligned offset, in the order the build finished them
    ...           trailer: the index arrays (64-byte aligned, raw little-endian), then the
                  JSON header that names them: {"arrays": {name: {offset, dtype, shape, crc}}, ...}

The trailer is written last, so a build appends records without knowing their sizes in advance
and finishing it copies nothing. Index arrays, per leaf ``j`` of the sample layout:

- array/str/bytes leaves: ``leaf{j}.offset`` u64 and ``leaf{j}.nbytes`` u64 of shape
  ``(count, variants)``, ``leaf{j}.shape`` i64 ``(count, variants, ndim)`` (each record keeps its
  own shape), ``leaf{j}.crc`` u32 ``(count, variants)`` (crc32 of the record's bytes);
- scalar leaves (int, float, bool, numpy scalars): ``leaf{j}.value`` ``(count, variants)``;
- ``None`` leaves store nothing.

Each array's entry in the JSON header carries the crc32 of its bytes (format version 2), checked
when the file is opened, so a changed label or offset is found like a changed record. The JSON
header itself is checked against a schema (types, bounds, nesting) before it is used.

A cache built with ``on_error="skip"`` leaves bad samples out and numbers the rest densely: the
JSON header's ``count`` is the number of samples stored, ``source_count`` the source dataset's
length, ``skipped`` a list of ``{"index", "path", "reason"}`` (source indices), and the index
array ``source_index`` i64 ``(count,)`` maps each stored sample to its source index. Without
skipped samples ``skipped`` is empty and ``source_index`` absent (the identity).

While a build runs, records go to ``PATH.partial`` (preamble state 0, no trailer) and every
finished record is appended to ``PATH.partial.journal``: ``JOURNAL_MAGIC``, u32 length, a JSON
header (journal and format version, fingerprint and source description, count, variants, seed,
layout), then one packed row per record (``entry_dtype``: index, variant, the source sample's
identity, per leaf offset/nbytes/crc/shape or value, crc32 of the row); a sample that failed
has no row. A resumed build keeps the rows whose row and record checksums hold; the identities
let it accept a source in which only samples without a finished record changed (a bad file
fixed or removed).

The layout (JSON) is the tree of the first sample: ``{"t": "tuple"|"list", "items": [...]}``,
``{"t": "dict", "keys": [...], "items": [...]}`` or a leaf ``{"t": "leaf", "kind": ..., "id": j,
"dtype": ..., "ndim": ...}`` with kind one of ``array``, ``tensor``, ``str``, ``bytes``, ``int``,
``float``, ``bool``, ``npscalar``, ``none``. PIL images are stored as HWC uint8 ``array`` leaves.
"""
from __future__ import annotations

import fcntl
import json
import os
import reprlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..core import trees
from ..core.constants import ALIGN, round_up
from ..core.safe_open import open_regular
from ..core.errors import (  # noqa: F401  (the cache's errors, importable from here as before)
    CacheError, CacheFormatError, CacheIncompleteError, CacheMismatchError, CacheRecordError,
    CacheSampleError,
)

MAGIC = b"PLCACHE\x00"
FORMAT_VERSION = 2  # 2: each index array has a crc32 in the header (labels are covered)
PREAMBLE = struct.Struct("<8sIIQQII")  # 40 bytes, padded to PREAMBLE_SIZE
PREAMBLE_SIZE = 64
DATA_START = 4096
STATE_BUILDING, STATE_COMPLETE = 0, 1
JOURNAL_MAGIC = b"PLJRNL\x00\x00"  # build journal: magic, u32 length, JSON, entries
JOURNAL_HEAD = struct.Struct("<8sI")  # JOURNAL_MAGIC, length of the JSON header that follows
JOURNAL_VERSION = 2  # 2: rows carry the source sample's identity
JOURNAL_HEADER_MAX = 1 << 20  # the JSON header holds no per-sample data: 1 MiB is plenty

VAR_KINDS = ("array", "tensor", "str", "bytes")
SCALAR_KINDS = {"int": "<i8", "float": "<f8", "bool": "|b1"}
KINDS = (*VAR_KINDS, *SCALAR_KINDS, "npscalar", "none")
# Bounds on a header's contents, checked before any is used (a crafted header with a valid CRC
# must fail as a CacheFormatError, not a KeyError or RecursionError or a huge allocation)
MAX_DEPTH = 32  # nesting of the sample layout
MAX_LEAVES = 4096  # leaves of one sample
MAX_NDIM = 32  # numpy's own limit on an array's dimensions (NPY_MAXDIMS)
MAX_COUNT = 1 << 40  # samples
MAX_VARIANTS = 1 << 16


align = round_up  # records and index arrays start at multiples of ALIGN (64 bytes)


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


# ---------------------------------------------------------------------------------------------
# Sample layout: tree of leaves


# The layout is stored as JSON; in memory it is walked as a trees.py spec whose leaf nodes are the
# JSON leaf dicts. Namedtuples are stored (and read back) as tuples, mappings as dicts.


def infer_layout(sample: Any) -> tuple[dict, list[dict]]:
    """Layout tree of ``sample`` and its leaves in flattening order."""
    leaves: list[dict] = []

    def leaf(x: Any) -> dict:
        node = {"t": "leaf", "id": len(leaves), **_leaf_kind(x)}
        leaves.append(node)
        return node

    return _to_json(trees.flatten(sample, leaf)), leaves


def _to_json(spec: Any) -> dict:
    """The JSON layout tree of a trees.py spec whose leaf nodes are JSON leaf dicts."""
    if isinstance(spec, dict):
        return spec
    if spec[0] == trees.MAP:
        keys = spec[2]
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"only str dict keys can be cached, got {keys!r}")
        return {"t": "dict", "keys": keys, "items": [_to_json(c) for c in spec[3]]}
    t = "tuple" if issubclass(spec[1], tuple) else "list"
    return {"t": t, "items": [_to_json(c) for c in spec[2]]}


def _spec(tree: dict, leaf: Callable[[dict], Any] = lambda node: node) -> Any:
    """The trees.py spec of a JSON layout tree; its leaf nodes are ``leaf(JSON leaf dict)``."""
    t = tree["t"]
    if t == "leaf":
        return leaf(tree)
    children = [_spec(n, leaf) for n in tree["items"]]
    if t == "dict":
        return (trees.MAP, dict, tree["keys"], children)
    return (trees.SEQ, tuple if t == "tuple" else list, children)


_last_spec: tuple = (None, None)  # (JSON tree, its spec): a reader passes the same tree each time


def _spec_of(tree: dict) -> Any:
    """``_spec(tree)``, remembered for the last tree (layout trees are never modified)."""
    global _last_spec
    last = _last_spec
    if last[0] is tree:
        return last[1]
    spec = _spec(tree)
    _last_spec = (tree, spec)
    return spec


def _leaf_kind(x: Any) -> dict:
    if x is None:
        return {"kind": "none"}
    if isinstance(x, bool):
        return {"kind": "bool", "dtype": SCALAR_KINDS["bool"]}
    if isinstance(x, int):
        return {"kind": "int", "dtype": SCALAR_KINDS["int"]}
    if isinstance(x, float):
        return {"kind": "float", "dtype": SCALAR_KINDS["float"]}
    if isinstance(x, np.generic):
        return {"kind": "npscalar", "dtype": x.dtype.newbyteorder("<").str}
    if isinstance(x, str):
        return {"kind": "str", "dtype": "|u1", "ndim": 1}
    if isinstance(x, (bytes, bytearray)):
        return {"kind": "bytes", "dtype": "|u1", "ndim": 1}
    kind = "tensor" if _is_tensor(x) else "array"
    a = leaf_to_array(x, {"kind": kind})
    if a.dtype.hasobject:
        raise TypeError(f"cannot cache an object array leaf ({type(x).__name__})")
    return {"kind": kind, "dtype": a.dtype.newbyteorder("<").str if a.dtype.byteorder != "|"
            else a.dtype.str, "ndim": a.ndim}


def _is_tensor(x: Any) -> bool:
    t = type(x)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


def leaf_to_array(x: Any, leaf: dict) -> np.ndarray:
    """The C-contiguous numpy array stored for a variable-size leaf value."""
    kind = leaf["kind"]
    if kind == "str":
        return np.frombuffer(x.encode("utf-8"), np.uint8)
    if kind == "bytes":
        return np.frombuffer(bytes(x), np.uint8)
    if kind == "tensor":
        x = x.detach().cpu().numpy()
    a = np.ascontiguousarray(np.asarray(x))  # PIL images convert to HWC uint8 here
    if "dtype" in leaf and a.dtype.str != leaf["dtype"]:
        a = a.astype(leaf["dtype"])  # only byte order can differ once the layout matched
    return a


def leaf_values(sample: Any, tree: dict, where: str = "sample") -> list:
    """Leaf values of ``sample`` in layout order; TypeError when it does not fit ``tree``."""
    out: list = []

    def leaf(node: dict, x: Any) -> None:
        got = _leaf_kind(x)
        if got["kind"] != node["kind"] or got.get("dtype") != node.get("dtype") \
                or got.get("ndim") != node.get("ndim"):
            raise trees.Mismatch(node, x, f"expected {_leaf_desc(node)}, got {_leaf_desc(got)}")
        out.append(x)

    try:
        trees.flatten_as(_spec_of(tree), sample, leaf, ordered_keys=True)
    except trees.Mismatch as e:
        at = where + "".join(f"[{k!r}]" for k in e.path)
        raise TypeError(f"{at}: {e.detail or _expected(e.node, e.value)}") from None
    return out


def _expected(node: tuple, x: Any) -> str:
    if node[0] == trees.MAP:
        return f"expected a dict with keys {node[2]}, got {_desc(x)}"
    return f"expected a {node[1].__name__} of {len(node[-1])}, got {_desc(x)}"


def _desc(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, dict):
        return f"a dict with keys {list(x)}"
    return type(x).__name__


def _leaf_desc(leaf: dict) -> str:
    s = leaf["kind"]
    if "ndim" in leaf and leaf["kind"] in ("array", "tensor"):
        s += f" ndim={leaf['ndim']}"
    if "dtype" in leaf:
        s += f" dtype={leaf['dtype']}"
    return s


def _flat_seq(tree: dict) -> bool:
    """True for the common layout: one tuple or list of leaves, e.g. ``(image, label)``."""
    items = tree["items"] if tree["t"] in ("tuple", "list") else ()
    return bool(items) and all(n["t"] == "leaf" and n["id"] == i for i, n in enumerate(items))


def make_unflatten(tree: dict):
    """A function ``values -> sample`` rebuilding the tree from leaf values."""
    if _flat_seq(tree):  # leaf ids are the positions: the tree is the value list itself
        return tuple if tree["t"] == "tuple" else list
    spec = _spec(tree, lambda node: node["id"])  # leaf nodes: the index of the leaf's value
    return lambda values: trees.unflatten(spec, values.__getitem__)


def out_leaves(out: Any, tree: dict) -> list:
    """Leaves of a ``getitem_into`` ``out`` tree in layout order (``None`` where it has none)."""
    res: list = []
    trees.flatten_as(_spec_of(tree), out, lambda node, x: res.append(
        x if isinstance(x, np.ndarray) else None), lenient=True)
    return res


def make_out_leaves(tree: dict):
    """A function ``out -> out_leaves(out, tree)``, without the tree walk for a flat layout."""
    if not _flat_seq(tree):
        return lambda out: out_leaves(out, tree)
    n = len(tree["items"])

    def flat(out: Any) -> list:
        x = out if isinstance(out, (list, tuple)) else ()
        return [v if isinstance(v, np.ndarray) else None for v in x[:n]] + [None] * (n - len(x))
    return flat


def header_bytes(header: dict) -> bytes:
    """Canonical JSON encoding of a header."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Index arrays and build-journal entries (one packed row per finished record)


def entry_dtype(leaves: list[dict]) -> np.dtype:
    """Packed journal row of one record; ``source`` identifies the sample's source (0: unknown)."""
    fields: list = [("index", "<i8"), ("variant", "<i4"), ("source", "<u8")]
    for lf in leaves:
        j = lf["id"]
        if lf["kind"] in VAR_KINDS:
            fields += [(f"o{j}", "<u8"), (f"n{j}", "<u8"), (f"c{j}", "<u4")]
            if lf["ndim"]:
                fields.append((f"s{j}", "<i8", (lf["ndim"],)))
        elif lf["kind"] != "none":
            fields.append((f"v{j}", lf["dtype"]))
    fields.append(("ecrc", "<u4"))
    return np.dtype(fields)  # packed: no padding between fields


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


def apply_entries(arrs: dict[str, np.ndarray], done: np.ndarray, e: np.ndarray,
                   leaves: list[dict]) -> None:
    i, k = e["index"], e["variant"]
    for lf in leaves:
        j = lf["id"]
        if lf["kind"] in VAR_KINDS:
            arrs[f"leaf{j}.offset"][i, k] = e[f"o{j}"]
            arrs[f"leaf{j}.nbytes"][i, k] = e[f"n{j}"]
            arrs[f"leaf{j}.crc"][i, k] = e[f"c{j}"]
            if lf["ndim"]:
                arrs[f"leaf{j}.shape"][i, k] = e[f"s{j}"]
        elif lf["kind"] != "none":
            arrs[f"leaf{j}.value"][i, k] = e[f"v{j}"]
    done[i, k] = True


def pack_journal_header(header: dict) -> bytes:
    """Journal start: magic, length, canonical JSON."""
    hb = header_bytes(header)
    return JOURNAL_HEAD.pack(JOURNAL_MAGIC, len(hb)) + hb


def unpack_journal_header(raw: bytes) -> tuple[dict, int] | None:
    """(JSON header, offset of the first row) of a journal's first bytes; None if unreadable."""
    if len(raw) < JOURNAL_HEAD.size or raw[:len(JOURNAL_MAGIC)] != JOURNAL_MAGIC:
        return None
    n = JOURNAL_HEAD.unpack_from(raw)[1]
    start = JOURNAL_HEAD.size + n
    if start > len(raw):
        return None
    try:
        return json.loads(raw[JOURNAL_HEAD.size:start]), start
    except ValueError:
        return None


def reserve(fd: int, nbytes: int) -> int:
    """Reserve ``nbytes`` at the end of the file shared by all build processes; its offset.

    ``flock`` is released by the kernel when a process dies, so no lock can stay held.
    """
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = align(max(os.fstat(fd).st_size, DATA_START))
        os.ftruncate(fd, start + align(max(nbytes, 1)))
        return start
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def infer_layout_from_tree(tree: dict) -> tuple[dict, list[dict]]:
    """The leaves of a stored layout tree in flattening order."""
    return tree, trees.leaf_nodes(_spec(tree))


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


def partial_progress(path: str | os.PathLike) -> tuple[int, int] | None:
    """(records journaled, records in all) of an unfinished build of ``path``, or None."""
    journal = os.fspath(path) + ".partial.journal"
    try:
        with open(journal, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    head = unpack_journal_header(raw)
    if head is None or "layout" not in head[0]:
        return None
    jhead, start = head
    _, leaves = infer_layout_from_tree(jhead["layout"])
    done = (len(raw) - start) // entry_dtype(leaves).itemsize
    return done, jhead["count"] * jhead["variants"]
