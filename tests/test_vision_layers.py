"""The vision modules import one way: each only from the layers below it (see vision/base.py).

Each module is imported alone in a fresh interpreter, with the package ``__init__`` files kept out
of the way (they import everything), and what got loaded is compared with the layers; the source
is also read for imports inside functions, which loading alone would not reveal.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pooled_loader.vision

VISION_DIR = os.path.dirname(pooled_loader.vision.__file__)
PKG_DIR = os.path.dirname(VISION_DIR)

# module -> layer; a module may import only modules of a strictly lower layer
LAYERS = {"buffers": 0, "jpeg_markers": 0, "torchvision_plan": 0, "kernels": 1, "base": 2,
          "jitter": 2, "decode": 3, "ops": 3, "compose": 4, "folder": 5, "__init__": 6,
          "torchvision_fused": 6,
          "class_check": 0,  # (reads cache/ and shards/ headers, nothing of vision)
          # detection (issue 38): geometry (OpenCV's transpose through kernels), the ops, the
          # glue, the readers, then the torchvision recogniser and the loader's routed wrapper
          "targets": 2, "detection_ops": 3, "detection": 4, "detection_batch": 4, "coco": 4,
          "voc": 5, "detection_tv": 6, "detection_fused": 7}
EXTENSIONS = {"_jpeg", "_kernels"}  # compiled leaves, importing nothing

_LOAD_ALONE = """
import importlib, json, sys, types
for name, path in (("pooled_loader", {pkg!r}), ("pooled_loader.vision", {vision!r})):
    stub = types.ModuleType(name)
    stub.__path__ = [path]
    sys.modules[name] = stub
importlib.import_module("pooled_loader.vision." + {module!r})
print(json.dumps(sorted(m for m in sys.modules if m.startswith("pooled_loader.vision.")
                        or m == "cv2")))
"""


def _vision_modules() -> list[str]:
    return sorted(f[:-3] for f in os.listdir(VISION_DIR) if f.endswith(".py"))


def test_every_vision_module_has_a_layer():
    assert set(_vision_modules()) == set(LAYERS)


def test_each_vision_module_loads_alone_without_the_layers_above_it_or_cv2():
    modules = [m for m in _vision_modules() if m != "__init__"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {m: subprocess.Popen(
        [sys.executable, "-c", _LOAD_ALONE.format(pkg=PKG_DIR, vision=VISION_DIR, module=m)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for m in modules}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"importing vision.{module} alone failed:\n{err}"
        loaded = {m.rsplit(".", 1)[-1] for m in json.loads(out)}
        assert "cv2" not in loaded, f"importing vision.{module} imported cv2 (kernels loads it lazily)"
        above = {m for m in loaded - EXTENSIONS - {module} if LAYERS[m] >= LAYERS[module]}
        assert not above, f"vision.{module} (layer {LAYERS[module]}) loaded {sorted(above)}"


def _imported_vision_modules(path: str) -> set[str]:
    """Every vision module a source file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:  # from . import x / from .x import y
                names = [base] if base else [a.name for a in node.names]
            elif node.level == 0 and base.startswith("pooled_loader.vision."):
                names = [base.split(".")[2]]
            elif node.level == 0 and base == "pooled_loader.vision":
                names = [a.name for a in node.names]
            else:
                names = []
            found.update(n.split(".")[0] for n in names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names
                         if a.name.startswith("pooled_loader.vision."))
    return {n for n in found if n in LAYERS or n in EXTENSIONS}


def test_no_vision_module_imports_a_layer_above_it_even_lazily():
    for module in _vision_modules():
        imported = _imported_vision_modules(os.path.join(VISION_DIR, module + ".py"))
        above = {m for m in imported - EXTENSIONS if LAYERS[m] >= LAYERS[module]}
        assert not above, f"vision/{module}.py imports {sorted(above)} (layer >= its own)"


def test_only_kernels_imports_cv2():
    for module in _vision_modules():
        tree = ast.parse(open(os.path.join(VISION_DIR, module + ".py")).read())
        names = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                 for a in (n.names if isinstance(n, ast.Import) else [])}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert module == "kernels" or "cv2" not in names, f"vision/{module}.py imports cv2"
