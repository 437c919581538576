"""The vision modules import one way, down ``pooled_loader.vision.LAYERS`` (the one list), as
Python really imports them: package ``__init__``s included, nothing stubbed.

Two views of the same rule: the source (every import, at the top or inside a function, read
with tests/test_house.py's ``import_graph``, which counts package ``__init__``s), and what a
fresh interpreter loads when it imports the modules of a layer (beyond what ``import
pooled_loader.vision`` loads anyway: that package imports its public surface). Neither may
reach cache/, the loader or cv2 (OpenCV is loaded by ``io/kernels.py`` only, and only when a
path needs it). The modules directly in vision/ that are in no layer are kept import paths:
each is the moved module under its old name, and nothing in the package imports it.
"""
from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys

import pooled_loader.vision
from test_house import PACKAGE, import_graph

VISION = "pooled_loader.vision"
VISION_DIR = os.path.dirname(pooled_loader.vision.__file__)
ROOT = os.path.dirname(PACKAGE)
LAYERS = pooled_loader.vision.LAYERS


def _graph() -> dict[str, set[str]]:
    return {m: deps for m, deps in import_graph(PACKAGE).items()
            if m == VISION or m.startswith(VISION + ".")}


def _kept_target(module: str) -> str | None:
    """The module a kept import path stands for, or None when ``module`` is not one: its source
    imports one vision module and makes it ``sys.modules[__name__]``, nothing more."""
    if module.count(".") != 2:
        return None
    with open(os.path.join(VISION_DIR, module.rsplit(".", 1)[1] + ".py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr)
                                         and isinstance(n.value, ast.Constant))]
    froms = [n for n in body if isinstance(n, ast.ImportFrom)]
    if len(body) != 3 or len(froms) != 1 or len(froms[0].names) != 1 \
            or "sys.modules[__name__]" not in ast.unparse(body[-1]):
        return None
    return f"{froms[0].module}.{froms[0].names[0].name}"


def _layer(module: str) -> int | None:
    """The index in LAYERS of a vision module (its wing, or its own name), None for a kept
    path, len(LAYERS) for the package's own ``__init__``."""
    if module == VISION:
        return len(LAYERS)
    part = module.split(".")[2]
    if part in LAYERS:
        return LAYERS.index(part)
    assert _kept_target(module), f"{module} is in no layer of pooled_loader.vision.LAYERS and " \
        "is not a kept import path: place it in a layer"
    return None


def test_every_vision_module_has_a_layer_or_is_a_kept_path():
    graph = _graph()
    assert len(graph) > 30
    for module in graph:
        _layer(module)
    assert set(LAYERS) <= {m.split(".")[2] for m in graph if m != VISION}, "a layer is gone"


def test_no_vision_module_imports_a_layer_after_its_own_even_lazily():
    graph = _graph()
    for module, deps in sorted(graph.items()):
        layer = _layer(module)
        for dep in deps:
            if not dep.startswith(VISION + "."):
                continue
            assert _layer(dep) is not None, f"{module} imports the kept path {dep}: import " \
                f"{_kept_target(dep)}"
            if layer is not None:
                assert _layer(dep) <= layer, \
                    f"{module} ({LAYERS[layer] if layer < len(LAYERS) else 'the package'}) " \
                    f"imports {dep} ({LAYERS[_layer(dep)]}), a layer after its own"


def test_nothing_in_vision_imports_the_cache_or_the_loader_even_lazily():
    for module, deps in import_graph(PACKAGE).items():
        if module == VISION or module.startswith(VISION + "."):
            bad = {d for d in deps if d.startswith("pooled_loader.cache")
                   or d in ("pooled_loader.loader", "pooled_loader")}
            assert not bad, f"{module} imports {sorted(bad)}"


def test_kept_paths_are_the_moved_modules():
    kept = {m: _kept_target(m) for m in _graph() if _layer(m) is None}
    assert {"pooled_loader.vision.decode", "pooled_loader.vision.kernels",
            "pooled_loader.vision.detection_tv", "pooled_loader.vision.torchvision_fused"} \
        <= set(kept)
    for old, new in kept.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert getattr(pooled_loader.vision, old.rsplit(".", 1)[1]) is sys.modules[new]


_LOADS = """
import importlib, json, sys
import pooled_loader.vision
before = set(sys.modules)
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"before": sorted(m for m in before if m.startswith("pooled_loader")
                                   or m == "cv2"),
                  "after": sorted(m for m in set(sys.modules) - before
                                  if m.startswith("pooled_loader") or m == "cv2")}))
"""


def test_each_layer_loads_only_itself_and_the_layers_below_it():
    """A fresh interpreter per layer (importing each of its modules), with the real package
    ``__init__``s."""
    graph = _graph()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = {}
    for i, layer in enumerate(LAYERS):
        modules = sorted(m for m in graph if m != VISION and _layer(m) == i)
        procs[layer] = subprocess.Popen([sys.executable, "-c", _LOADS, *modules],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env, cwd=ROOT)
    for layer, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"importing the modules of {layer} failed:\n{err}"
        loaded = json.loads(out)
        everything = set(loaded["before"]) | set(loaded["after"])
        assert "cv2" not in everything, f"importing {layer} imported cv2 (kernels loads it lazily)"
        cache = sorted(m for m in everything if m.startswith("pooled_loader.cache"))
        assert not cache, f"importing {layer} loaded {cache}"
        above = sorted(m for m in loaded["after"] if m.startswith(VISION + ".")
                       and (_layer(m) is None or _layer(m) > LAYERS.index(layer)))
        assert not above, f"importing the modules of {layer} loaded {above}"


def test_only_kernels_imports_cv2():
    for module in _graph():
        path = os.path.join(os.path.dirname(PACKAGE), *module.split("."))
        path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
        tree = ast.parse(open(path, encoding="utf-8").read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert module == "pooled_loader.vision.io.kernels" or "cv2" not in names, \
            f"{module} imports cv2"
