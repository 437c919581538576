"""The cache package imports one way: format and fingerprint at the bottom, the worker-side tasks
above them, then the build, the dataset, the CLI, and the package's public names on top."""
from __future__ import annotations

import ast
import os

import pooled_loader.cache

CACHE_DIR = os.path.dirname(pooled_loader.cache.__file__)
# module -> layer; a module may import only modules of a strictly lower layer
LAYERS = {"format": 0, "fingerprint": 0, "tasks": 1, "build": 2, "dataset": 2, "cli": 3,
          "__init__": 4, "__main__": 5}


def _imported_cache_modules(path: str) -> set[str]:
    """Sibling modules a file imports (``from .x import``, ``from . import x``), anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:  # from . import x: a sibling module, or a name of the package's __init__
                found.update(a.name if a.name in LAYERS else "__init__" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("pooled_loader.cache."):
            found.add(node.module.split(".")[2])
    return found


def test_every_cache_module_has_a_layer():
    assert {f[:-3] for f in os.listdir(CACHE_DIR) if f.endswith(".py")} == set(LAYERS)


def test_no_cache_module_imports_a_layer_above_it():
    for module, layer in LAYERS.items():
        imported = _imported_cache_modules(os.path.join(CACHE_DIR, module + ".py"))
        above = {m for m in imported if LAYERS[m] >= layer and m != module}
        assert not above, f"cache/{module}.py imports {sorted(above)} (layer >= its own)"
