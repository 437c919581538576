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
header itself is checked against a schema (types, bounds, nesting) before it is used
(``core/cache_header.py``, the reader of preamble and header: below vision/, which reads the
class list a cache keeps).

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
import struct
from typing import Any, Callable

import numpy as np

from ..core import trees
from ..core.constants import ALIGN, round_up
from ..core.cache_header import (  # noqa: F401  (the header reader: importable from here as before)
    DATA_START, FORMAT_VERSION, KINDS, MAGIC, MAX_COUNT, MAX_DEPTH, MAX_LEAVES, MAX_NDIM,
    MAX_VARIANTS, PREAMBLE, PREAMBLE_SIZE, SCALAR_KINDS, STATE_BUILDING, STATE_COMPLETE, VAR_KINDS,
    Preamble, check_header, index_arrays, pack_preamble, read_header, unpack_preamble,
)
from ..core.errors import (  # noqa: F401  (the cache's errors, importable from here as before)
    CacheError, CacheFormatError, CacheIncompleteError, CacheMismatchError, CacheRecordError,
    CacheSampleError,
)

JOURNAL_MAGIC = b"PLJRNL\x00\x00"  # build journal: magic, u32 length, JSON, entries
JOURNAL_HEAD = struct.Struct("<8sI")  # JOURNAL_MAGIC, length of the JSON header that follows
JOURNAL_VERSION = 2  # 2: rows carry the source sample's identity
JOURNAL_HEADER_MAX = 1 << 20  # the JSON header holds no per-sample data: 1 MiB is plenty

align = round_up  # records and index arrays start at multiples of ALIGN (64 bytes)


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
