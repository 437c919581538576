"""The one tree walker (pooled_loader.core.trees) and the formats built on it (layout specs, the cache's
JSON layout, cuda's map over tensors)."""
import collections
import json

import numpy as np
import pytest
import torch

from compare import assert_same

from pooled_loader.engine import layout
from pooled_loader.core import trees
from pooled_loader.cache import format as cache_format
from pooled_loader.engine.cuda import map_tensors

Point = collections.namedtuple("Point", "x y")


class Batch(list):
    """A list subclass that can be rebuilt from its items."""


class Record:
    """An object that is not a container: a leaf."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Record) and other.v == self.v


def _collect(tree):
    """flatten with a leaf function that numbers the leaves: (spec, leaves)."""
    leaves = []

    def leaf(x):
        leaves.append(x)
        return ("leaf", len(leaves) - 1)

    return trees.flatten(tree, leaf), leaves


SAMPLES = [
    (np.arange(6).reshape(2, 3), 7),
    [torch.ones(2, 2), "label", 3.5, True, None],
    {"image": torch.zeros(3, 4, 4, dtype=torch.uint8), "label": np.int64(2), "name": b"raw"},
    collections.OrderedDict(b=1, a=(2, [3])),
    Point(torch.tensor([1.0]), {"k": np.float32(0.5)}),
    Batch([1, Point(2, 3)]),
    ((), [], {}),
    Record(1),
    "just a string",
    42,
]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_flatten_then_unflatten_gives_the_same_tree_back(sample):
    spec, leaves = _collect(sample)
    assert_same(trees.unflatten(spec, lambda node: leaves[node[1]]), sample)
    assert trees.leaf_nodes(spec) == [("leaf", i) for i in range(len(leaves))]


def test_strings_bytes_numbers_arrays_and_tensors_are_leaves_in_order():
    image, mask = np.zeros(3), torch.ones(2)
    spec, leaves = _collect({"a": [image, "txt"], "b": (b"by", 1, 2.0, mask)})
    assert [type(x) for x in leaves] == [np.ndarray, str, bytes, int, float, torch.Tensor]
    assert leaves[0] is image and leaves[5] is mask
    assert spec == ("map", dict, ["a", "b"], [("seq", list, [("leaf", 0), ("leaf", 1)]),
                                              ("seq", tuple, [("leaf", i) for i in range(2, 6)])])


def test_a_namedtuple_keeps_its_type_and_a_defaultdict_comes_back_as_a_dict():
    spec, leaves = _collect(Point(1, 2))
    assert spec[0] == "namedtuple" and trees.unflatten(spec, lambda n: leaves[n[1]]) == Point(1, 2)
    tree = collections.defaultdict(list, a=1)  # defaultdict(items) is not how it is built
    spec, leaves = _collect(tree)
    back = trees.unflatten(spec, lambda n: leaves[n[1]])
    assert type(back) is dict and back == {"a": 1}


def test_flatten_as_gives_the_leaves_of_a_tree_with_a_known_spec():
    spec, _ = _collect({"x": (1, 2), "y": [3]})
    got = []
    trees.flatten_as(spec, {"y": (30,), "x": [10, 20]}, lambda node, v: got.append((node, v)))
    assert got == [(("leaf", 0), 10), (("leaf", 1), 20), (("leaf", 2), 30)]


@pytest.mark.parametrize("tree, path", [
    ({"x": (1, 2)}, []),                    # a key missing
    ({"x": (1, 2), "z": [3]}, []),          # another key
    ({"x": (1,), "y": [3]}, ["x"]),         # a sequence too short
    ({"x": (1, 2), "y": 3}, ["y"]),         # a leaf where a sequence was
    ([1, 2], []),                           # a list where a mapping was
])
def test_flatten_as_raises_a_mismatch_with_the_path_to_the_difference(tree, path):
    spec, _ = _collect({"x": (1, 2), "y": [3]})
    with pytest.raises(trees.Mismatch) as info:
        trees.flatten_as(spec, tree, lambda node, v: None)
    assert info.value.path == path


def test_flatten_as_with_ordered_keys_rejects_keys_in_another_order():
    spec, _ = _collect({"a": 1, "b": 2})
    trees.flatten_as(spec, {"b": 2, "a": 1}, lambda n, v: None)
    with pytest.raises(trees.Mismatch):
        trees.flatten_as(spec, {"b": 2, "a": 1}, lambda n, v: None, ordered_keys=True)


def test_a_leaf_function_can_reject_a_leaf_and_the_path_is_added():
    spec, _ = _collect([{"a": (1, 2)}])

    def leaf(node, v):
        if node == ("leaf", 1):
            raise trees.Mismatch(node, v, "no")

    with pytest.raises(trees.Mismatch) as info:
        trees.flatten_as(spec, [{"a": (1, 2)}], leaf)
    assert info.value.path == [0, "a", 1] and info.value.detail == "no"


def test_lenient_flatten_as_gives_none_below_missing_or_mistyped_parts():
    spec, _ = _collect({"a": (1, 2), "b": [3], "c": 4})
    got = []
    trees.flatten_as(spec, {"a": (10,), "b": "not a list"}, lambda n, v: got.append(v),
                     lenient=True)
    assert got == [10, None, None, None]
    got.clear()
    trees.flatten_as(spec, None, lambda n, v: got.append(v), lenient=True)
    assert got == [None] * 4


def test_map_leaves_rebuilds_the_tree_and_keeps_other_leaves():
    tree = {"t": torch.ones(2), "p": Point(torch.zeros(1), "s"), "l": Batch([torch.ones(1), 3]),
            "od": collections.OrderedDict(x=torch.ones(1))}
    out = trees.map_leaves(tree, lambda t: t + 1, lambda x: isinstance(x, torch.Tensor))
    assert torch.equal(out["t"], torch.full((2,), 2.0))
    assert type(out["p"]) is Point and out["p"].y == "s" and torch.equal(out["p"].x, torch.ones(1))
    assert type(out["l"]) is Batch and out["l"][1] == 3
    assert type(out["od"]) is collections.OrderedDict
    assert torch.equal(tree["t"], torch.ones(2))  # the input is not modified


def test_cuda_map_tensors_walks_the_same_containers():
    seen = []
    map_tensors((torch.ones(1), [torch.zeros(2)], {"a": torch.ones(3)}, "x"), seen.append)
    assert [t.shape[0] for t in seen] == [1, 2, 3]


def test_layout_spec_format_is_unchanged():
    arrays, metas = [], []
    sample = {"img": np.zeros((2, 3), np.uint8), "meta": (1, "s", None), "p": Point([1], ())}
    spec = layout.flatten(sample, arrays, metas, numbers=True)
    assert spec == ("map", dict, ["img", "meta", "p"], [
        ("leaf", 0), ("seq", tuple, [("leaf", 1), ("meta", 0), ("meta", 1)]),
        ("namedtuple", Point, [("seq", list, [("leaf", 2)]), ("seq", tuple, [])])])
    assert metas == ["s", None] and len(arrays) == 3
    assert_same(layout.unflatten(spec, arrays, metas), sample)
    again_a, again_m = [], []
    layout.extract(spec, sample, again_a, again_m)
    assert again_m == metas and all(a is b for a, b in zip(again_a, arrays))
    with pytest.raises(layout.StructureMismatch):
        layout.extract(spec, {**sample, "meta": (1, "s")}, [], [])


# The JSON layout of this sample as written into cache files before trees.py existed: caches
# written then must still read, and new caches must be written the same way.
CACHE_SAMPLE = {"img": np.zeros((2, 3), np.uint8), "meta": (1, 2.5, True, "s", b"b", None),
                "t": torch.ones(3), "p": Point([1, 2], (np.int64(3),))}
CACHE_LAYOUT = json.loads("""
{"t": "dict", "keys": ["img", "meta", "t", "p"], "items": [
  {"t": "leaf", "id": 0, "kind": "array", "dtype": "|u1", "ndim": 2},
  {"t": "tuple", "items": [
    {"t": "leaf", "id": 1, "kind": "int", "dtype": "<i8"},
    {"t": "leaf", "id": 2, "kind": "float", "dtype": "<f8"},
    {"t": "leaf", "id": 3, "kind": "bool", "dtype": "|b1"},
    {"t": "leaf", "id": 4, "kind": "str", "dtype": "|u1", "ndim": 1},
    {"t": "leaf", "id": 5, "kind": "bytes", "dtype": "|u1", "ndim": 1},
    {"t": "leaf", "id": 6, "kind": "none"}]},
  {"t": "leaf", "id": 7, "kind": "tensor", "dtype": "<f4", "ndim": 1},
  {"t": "tuple", "items": [
    {"t": "list", "items": [
      {"t": "leaf", "id": 8, "kind": "int", "dtype": "<i8"},
      {"t": "leaf", "id": 9, "kind": "int", "dtype": "<i8"}]},
    {"t": "tuple", "items": [{"t": "leaf", "id": 10, "kind": "npscalar", "dtype": "<i8"}]}]}]}
""")


def test_cache_layout_json_is_unchanged():
    tree, leaves = cache_format.infer_layout(CACHE_SAMPLE)
    assert tree == CACHE_LAYOUT
    assert cache_format.infer_layout_from_tree(CACHE_LAYOUT)[1] == leaves
    assert [lf["id"] for lf in leaves] == list(range(11))


def test_a_stored_cache_layout_rebuilds_samples_with_plain_containers():
    values = cache_format.leaf_values(CACHE_SAMPLE, CACHE_LAYOUT)
    back = cache_format.make_unflatten(CACHE_LAYOUT)(values)
    expected = {**CACHE_SAMPLE, "p": ([1, 2], (np.int64(3),))}  # a namedtuple is stored as a tuple
    assert_same(back, expected)


@pytest.mark.parametrize("sample, message", [
    ({"img": 1}, "dataset[7]: expected a dict with keys ['img', 'meta', 't', 'p'], got a dict "
                 "with keys ['img']"),
    ({**CACHE_SAMPLE, "img": np.zeros(2, np.uint8)},
     "dataset[7]['img']: expected array ndim=2 dtype=|u1, got array ndim=1 dtype=|u1"),
    ({**CACHE_SAMPLE, "meta": (1, 2.5)}, "dataset[7]['meta']: expected a tuple of 6, got a tuple "
                                         "of 2"),
    ({**CACHE_SAMPLE, "p": ([1, "x"], (np.int64(3),))},
     "dataset[7]['p'][0][1]: expected int dtype=<i8, got str dtype=|u1"),
    (dict(reversed(list(CACHE_SAMPLE.items()))),
     "dataset[7]: expected a dict with keys ['img', 'meta', 't', 'p'], got a dict with keys "
     "['p', 't', 'meta', 'img']"),
])
def test_a_sample_that_does_not_fit_the_cache_layout_is_named_with_its_path(sample, message):
    with pytest.raises(TypeError) as info:
        cache_format.leaf_values(sample, CACHE_LAYOUT, "dataset[7]")
    assert str(info.value) == message


def test_cache_out_leaves_gives_arrays_where_the_out_tree_has_them():
    out = {"img": np.empty((2, 3), np.uint8), "p": ([None, np.empty(1)],)}
    got = cache_format.out_leaves(out, CACHE_LAYOUT)
    assert [i for i, x in enumerate(got) if x is not None] == [0, 9]
    assert cache_format.out_leaves(None, CACHE_LAYOUT) == [None] * 11


def test_non_str_dict_keys_cannot_be_cached():
    with pytest.raises(TypeError, match="only str dict keys"):
        cache_format.infer_layout({1: np.zeros(1)})
