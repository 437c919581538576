"""Nested samples and batches: the one place that decides what is a container and how to rebuild it.

A sample or batch is a tree. Its containers are mappings (any `collections.abc.Mapping`: dict,
OrderedDict, ...), namedtuples, and lists and tuples (with their subclasses); everything else is a
leaf. `flatten` turns a tree into a *spec*, which describes the containers, and gives every leaf
to a function of the caller, whose result becomes that leaf's node in the spec. `unflatten` is the
inverse, `flatten_as` re-flattens a tree whose spec is already known (checking that it fits), and
`map_leaves` rebuilds a tree with a function applied to some of its leaves.

Spec nodes (plain tuples, cheap to pickle)::

    ("map", type, keys, children)      ("namedtuple", type, children)      ("seq", type, children)

Any other node is a leaf node: whatever the caller's function returned for that leaf. It must not
be a tuple starting with one of the three tags above. The batch layout (`layout.py`) uses
``("leaf", i)`` and ``("meta", i)``; the cache file (`cache/format.py`) uses its JSON leaf dicts.

Rebuilding calls the container's type on its items (``type(dict)``, ``type(list)``, or
``type(*items)`` for a namedtuple). A mapping or sequence type that cannot be built that way (a
defaultdict, a class with other constructor arguments) comes back as a plain dict or list.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

MAP, NAMEDTUPLE, SEQ = "map", "namedtuple", "seq"
_CONTAINER_TAGS = frozenset((MAP, NAMEDTUPLE, SEQ))


class Mismatch(Exception):
    """A tree does not have the structure of the spec it is flattened as.

    ``path`` holds the keys and indices from the root to where it differs, ``node`` the spec node
    there and ``value`` the part of the tree found instead (all None when raised without them).
    """

    def __init__(self, node: Any = None, value: Any = None, detail: str = ""):
        super().__init__(detail)
        self.node, self.value, self.detail = node, value, detail
        self.path: list = []


def _tag(node: Any) -> str | None:
    """The container tag of a spec node, or None for a leaf node."""
    if type(node) is tuple and node and node[0] in _CONTAINER_TAGS:
        return node[0]
    return None


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _build(tag: str, typ: type, keys: list | None, values: list) -> Any:
    """A container of type `typ` holding `values` (under `keys` for a mapping)."""
    if tag == NAMEDTUPLE:
        return typ(*values)
    items: Any = dict(zip(keys, values)) if tag == MAP else values
    try:
        return typ(items)
    except TypeError:
        return items


def flatten(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """The spec of `tree`; `leaf(x)` is called on every leaf, in order, and gives its node."""
    if isinstance(tree, Mapping):
        keys = list(tree.keys())
        return (MAP, type(tree), keys, [flatten(tree[k], leaf) for k in keys])
    if _is_namedtuple(tree):
        return (NAMEDTUPLE, type(tree), [flatten(v, leaf) for v in tree])
    if isinstance(tree, (list, tuple)):
        return (SEQ, type(tree), [flatten(v, leaf) for v in tree])
    return leaf(tree)


def unflatten(spec: Any, leaf: Callable[[Any], Any]) -> Any:
    """Rebuild the tree that `spec` describes; `leaf(node)` gives the value of each leaf node."""
    if type(spec) is not tuple or not spec or spec[0] not in _CONTAINER_TAGS:
        return leaf(spec)
    tag = spec[0]
    if tag == MAP:
        _, typ, keys, children = spec
        return _build(MAP, typ, keys, [unflatten(c, leaf) for c in children])
    _, typ, children = spec
    return _build(tag, typ, None, [unflatten(c, leaf) for c in children])


def leaf_nodes(spec: Any) -> list:
    """The leaf nodes of `spec`, in flattening order."""
    out: list = []

    def walk(node: Any) -> None:
        if _tag(node) is None:
            out.append(node)
        else:
            for child in node[-1]:
                walk(child)

    walk(spec)
    return out


def flatten_as(spec: Any, tree: Any, leaf: Callable[[Any, Any], None], *,
               ordered_keys: bool = False, lenient: bool = False) -> None:
    """Walk `tree` along a known `spec`: `leaf(node, value)` is called for each leaf, in order.

    A mapping must have the spec's keys (in the same order too with `ordered_keys`), and a
    sequence (list, tuple or namedtuple alike) the spec's length; otherwise `Mismatch` is raised,
    with the path to where the tree differs. `leaf` may raise `Mismatch` too (to reject a leaf), and
    gets the path added. With `lenient`, the containers are not checked: a missing or mistyped part
    of the tree gives None for every leaf below it.
    """
    if lenient:
        _walk_lenient(spec, tree, leaf)
    else:
        _walk_strict(spec, tree, leaf, ordered_keys)


# The two walks below run once per sample in the workers, so they test "is this a container
# node" inline (type, then tag) and call `leaf` from the parent's loop rather than recursing into
# leaves; one try per container records the path on the way out of a Mismatch.

def _walk_strict(node: Any, x: Any, leaf: Callable[[Any, Any], None], ordered_keys: bool) -> None:
    if type(node) is not tuple or not node or node[0] not in _CONTAINER_TAGS:
        leaf(node, x)
        return
    if node[0] == MAP:
        keys, children = node[2], node[3]
        if not (type(x) is dict or isinstance(x, Mapping)) or len(x) != len(keys) or (
                ordered_keys and list(x) != keys):
            raise Mismatch(node, x)
        at: Any = keys
    else:
        children = node[-1]
        if not isinstance(x, (list, tuple)) or len(x) != len(children):
            raise Mismatch(node, x)
        at = range(len(children))
    key = None
    try:
        for key, child in zip(at, children):
            value = x[key]
            if type(child) is tuple and child and child[0] in _CONTAINER_TAGS:
                _walk_strict(child, value, leaf, ordered_keys)
            else:
                leaf(child, value)
    except KeyError:
        raise Mismatch(node, x) from None
    except Mismatch as e:
        e.path.insert(0, key)
        raise


_EMPTY: dict = {}


def _walk_lenient(node: Any, x: Any, leaf: Callable[[Any, Any], None]) -> None:
    if type(node) is not tuple or not node or node[0] not in _CONTAINER_TAGS:
        leaf(node, x)
        return
    if node[0] == MAP:
        x = x if isinstance(x, Mapping) else _EMPTY
        for key, child in zip(node[2], node[3]):
            _walk_lenient(child, x.get(key), leaf)
        return
    x = x if isinstance(x, (list, tuple)) else ()
    for i, child in enumerate(node[-1]):
        _walk_lenient(child, x[i] if i < len(x) else None, leaf)


def map_leaves(tree: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool]) -> Any:
    """`tree` rebuilt with `fn(x)` in place of every leaf `x` for which `is_leaf(x)`; other leaves
    are kept as they are."""
    if is_leaf(tree):
        return fn(tree)
    if isinstance(tree, Mapping):
        keys = list(tree.keys())
        return _build(MAP, type(tree), keys, [map_leaves(tree[k], fn, is_leaf) for k in keys])
    if _is_namedtuple(tree):
        return _build(NAMEDTUPLE, type(tree), None, [map_leaves(v, fn, is_leaf) for v in tree])
    if isinstance(tree, (list, tuple)):
        return _build(SEQ, type(tree), None, [map_leaves(v, fn, is_leaf) for v in tree])
    return tree
