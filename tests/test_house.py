"""The house rules of pooled_loader/ (issue 30): no import ring between its modules, and no
module over 600 lines; (issue 41) imports point down the layer order of the sub-packages, and
docs/layout.md draws that order as the code has it.

An import counts wherever it is written (module top, inside a function, under TYPE_CHECKING):
a lazy import that dodges a ring at run time still ties the two modules both ways. It also counts
for what Python runs first (issue 46): importing ``pkg.sub.mod`` runs ``pkg/sub/__init__.py``, so
the importer depends on that package ``__init__`` too (except its own packages, already running).
Extension modules (``_jpeg``, ``_kernels``) import nothing of the package and are not nodes; C
sources under csrc/ keep the same size rule."""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "pooled_loader")
MAX_LINES = 600
LAYOUT_PAGE = os.path.join(os.path.dirname(PACKAGE), "docs", "layout.md")

# The layers of pooled_loader/, lowest first. A module may import its own layer and any layer
# below it, never one above. FRONT is the modules directly in pooled_loader/: the loader that
# composes the layers, and the public import paths.
FRONT = "front"
LAYERS = ["core", "observability", "engine", "ragged", "shards", "mix", "resume", "vision",
          "video", FRONT, "cache", "tune", "ray"]
# Imports that point up, each with its reason. The test fails on any other, and on one of these
# that is gone (then delete it here).
UPWARD = {
}
# What importing a module may load of the package, checked in a fresh interpreter (sys.modules):
# module -> the sub-packages (or modules of pooled_loader/) it must not load.
LOADS_NOTHING_OF = {
    # `import pooled_loader.<anything>` runs this first: PooledLoader is loaded on first use
    "pooled_loader": {"mix", "shards", "vision", "cache", "resume", "ragged", "loader"},
    "pooled_loader.engine.worker": {"mix", "shards", "vision", "cache", "resume", "loader"},
    "pooled_loader.engine.worker_iter": {"mix", "shards", "vision", "cache", "resume", "loader"},
    "pooled_loader.vision": {"loader", "cache"},
    "pooled_loader.shards": {"engine", "resume", "vision", "cache", "loader"},
}
CSRC = os.path.join(os.path.dirname(PACKAGE), "csrc")
# What users import (docs/layout.md#the-public-surface lists the same): path -> names.
PUBLIC = {
    "pooled_loader": ["PooledLoader", "SlotPool", "SampleError", "WorkerError",
                      "PoolAllocationError", "SkipBudgetExceeded", "get_worker_info"],
    "pooled_loader.loader": ["PooledLoader"],
    "pooled_loader.webdataset": ["WebDataset", "count_samples", "expand_shards"],
    "pooled_loader.shards": ["WebDataset", "count_samples", "expand_shards", "write_shards",
                             "read_shard_classes", "main", "CLASSES_MEMBER"],
    "pooled_loader.collate": ["pad", "packed", "as_list", "Padded", "Packed", "RaggedCollate"],
    "pooled_loader.samplers": ["LengthGroupedSampler", "TokenBudgetBatchSampler"],
    "pooled_loader.tokens": ["TokenDataset", "write_tokens", "main"],
    "pooled_loader.resume": ["merge_rank_states", "ResumableRandomSampler"],
    "pooled_loader.stats": ["gather"],
    "pooled_loader.mix": ["Mix", "merge_mix_states"],
    "pooled_loader.cuda": ["NormalizeImages"],
    "pooled_loader.errors": ["SampleError", "WorkerError", "StateMismatch", "CacheError",
                             "SkipBudgetExceeded"],
    "pooled_loader.distributed": ["rank_and_world", "make_distributed_sampler"],
    "pooled_loader.integrations": ["patch_accelerate"],
    "pooled_loader.tune": ["main"],
    "pooled_loader.cache": ["build_cache", "CachedDataset", "main"],
    "pooled_loader.vision": ["Compose", "DecodeImage", "ImageFolder"],
    "pooled_loader.video": ["VideoClips", "VIDEO_EXTENSIONS"],
}


def _modules(root: str) -> tuple[dict[str, str], set[str]]:
    """{dotted module name: path} of the package at `root`, and its extension modules."""
    top = os.path.basename(root)
    modules: dict[str, str] = {}
    extensions: set[str] = set()
    for folder, _, files in os.walk(root):
        rel = os.path.relpath(folder, os.path.dirname(root)).replace(os.sep, ".")
        for name in files:
            if name.endswith(".py"):
                dotted = rel if name == "__init__.py" else f"{rel}.{name[:-3]}"
                modules[dotted] = os.path.join(folder, name)
            elif name.endswith(".so"):
                extensions.add(f"{rel}.{name.split('.')[0]}")
    assert top in modules, f"{root} is not a package"
    return modules, extensions


def import_graph(root: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its source)."""
    modules, extensions = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in extensions:
                        continue
                    deps.add(sub if sub in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        deps = {d for d in deps if d in modules and d != name}
        # the package __init__s Python runs before an imported module (not the importer's own)
        own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)} | {name}
        for d in list(deps):
            parts = d.split(".")
            deps.update(p for p in (".".join(parts[:k]) for k in range(1, len(parts)))
                        if p in modules and p not in own)
        graph[name] = deps
    return graph


def rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _describe(graph: dict[str, set[str]], group: list[str]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & set(group)))}" for m in group)


def test_no_module_of_the_package_is_in_an_import_ring():
    graph = import_graph(PACKAGE)
    found = rings(graph)
    assert not found, "import rings: " + " | ".join(_describe(graph, g) for g in found)


def modules_over(root: str, max_lines: int) -> dict[str, int]:
    """{module: its line count} of the package's modules longer than `max_lines`."""
    over = {}
    for name, path in _modules(root)[0].items():
        with open(path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > max_lines:
            over[name] = n
    return over


def test_no_module_of_the_package_is_over_600_lines():
    over = modules_over(PACKAGE, MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def test_no_c_source_is_over_600_lines():
    over = {}
    for name in sorted(os.listdir(CSRC)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(CSRC, name), encoding="utf-8") as f:
                n = sum(1 for _ in f)
            if n > MAX_LINES:
                over[name] = n
    assert not over, f"C sources over {MAX_LINES} lines: {over}"


def loaded_by(modules: list[str]) -> dict[str, list[str]]:
    """For each module, the package's modules that `import module` loads, each in a fresh
    interpreter (run side by side)."""
    procs = {}
    for module in modules:
        code = (f"import json, sys\nimport {module}\nprint(json.dumps(sorted("
                "m for m in sys.modules if m.startswith('pooled_loader'))))")
        procs[module] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True,
                                         cwd=os.path.dirname(PACKAGE))
    loaded = {}
    for module, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"import {module} failed:\n{err}"
        loaded[module] = json.loads(out.strip().splitlines()[-1])
    return loaded


def test_importing_a_subsystem_loads_only_what_it_imports():
    """What Python really loads (issue 46): the worker without the datasets or the checkpoint
    format, vision without the loader or the cache, shards without the machinery."""
    loaded_by_each = loaded_by(list(LOADS_NOTHING_OF))
    for module, banned in LOADS_NOTHING_OF.items():
        loaded = loaded_by_each[module]
        wrong = [m for m in loaded if m.count(".") and m.split(".")[1] in banned]
        assert not wrong, f"import {module} loads {wrong}"


def _package(tmp_path, files: dict[str, str]) -> str:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def test_the_ring_check_finds_lazy_and_type_only_rings_and_passes_over_extensions(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .a import A\n",
        "a.py": "from .b import B\nA = 1\n",
        "b.py": "def f():\n    from .a import A\n    return A\nB = 2\n",  # lazy: still a ring
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
        "d.py": "from . import c\nD = 3\n",
        "sub/__init__.py": "",
        "sub/e.py": "from . import _ext\nfrom .. import a\n",  # an extension module: no node
        "sub/_ext.cpython-311-x86_64-linux-gnu.so": "",
    })
    graph = import_graph(root)
    assert rings(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert graph["pkg.sub.e"] == {"pkg.a"}


def test_the_ring_check_sees_the_package_inits_python_runs(tmp_path):
    # pkg.low.a imports pkg.high.b, which runs pkg/high/__init__.py, which imports pkg.low.a:
    # a ring no single module's imports show
    root = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..high.b import B\n",
        "high/__init__.py": "from ..low import a\n",
        "high/b.py": "from . import c\nB = 1\n",  # its own package's __init__ is running
        "high/c.py": "",
    })
    graph = import_graph(root)
    assert graph["pkg.low.a"] == {"pkg.high.b", "pkg.high"}
    assert graph["pkg.high.b"] == {"pkg.high.c"}
    assert rings(graph) == [["pkg.high", "pkg.low.a"]]


def test_the_size_check_counts_lines(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "fits.py": "x = 1\n" * 600,
                               "big.py": "x = 1\n" * 601})
    assert modules_over(root, MAX_LINES) == {"pkg.big": 601}


def subpackages(root: str) -> set[str]:
    """The sub-packages directly under the package at `root`."""
    return {d for d in os.listdir(root)
            if os.path.isfile(os.path.join(root, d, "__init__.py"))}


def layer_of(module: str, subs: set[str]) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in subs else FRONT


def upward_imports(graph: dict[str, set[str]], subs: set[str],
                   layers: list[str]) -> set[tuple[str, str]]:
    """(module, what it imports) for every import that points to a higher layer."""
    rank = {name: i for i, name in enumerate(layers)}
    return {(m, d) for m, deps in graph.items() for d in deps
            if rank[layer_of(m, subs)] < rank[layer_of(d, subs)]}


def test_every_subpackage_has_its_place_in_the_layer_order():
    assert subpackages(PACKAGE) == set(LAYERS) - {FRONT}, \
        "a sub-package was added or removed: place it in LAYERS (and docs/layout.md)"


def test_imports_point_down_the_layers():
    graph = import_graph(PACKAGE)
    found = upward_imports(graph, subpackages(PACKAGE), LAYERS)
    unexpected = sorted(found - set(UPWARD))
    assert not unexpected, "imports of a higher layer: " + "; ".join(
        f"{m} ({layer_of(m, subpackages(PACKAGE))}) -> {d}" for m, d in unexpected)
    assert not set(UPWARD) - found, f"gone, remove from UPWARD: {sorted(set(UPWARD) - found)}"


def test_the_layer_check_finds_upward_imports_lazy_ones_and_into_the_front(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .top import T\n",
        "front.py": "from .low.a import A\n",
        "low/__init__.py": "",
        "low/a.py": "A = 1\ndef f():\n    from ..high import b\n",  # lazy: still up
        "low/c.py": "from .. import front\n",  # the front is above every layer but the apps
        "high/__init__.py": "",
        "high/b.py": "from ..low.a import A\nfrom . import d\n",  # down, and its own layer
        "high/d.py": "",
    })
    layers = ["low", "high", FRONT]
    assert upward_imports(import_graph(root), subpackages(root), layers) == {
        ("pkg.low.a", "pkg.high.b"), ("pkg.low.a", "pkg.high"), ("pkg.low.c", "pkg.front")}


def render_layers(root: str = PACKAGE, layers: list[str] = LAYERS) -> str:
    """The layer stack of docs/layout.md, drawn from the code: top layer first, each box with
    its module count and the layers its modules import (`!` marks an UPWARD exception)."""
    subs = subpackages(root)
    modules = _modules(root)[0]
    graph = import_graph(root)
    label = {name: (f"{name}/" if name != FRONT else "pooled_loader/*.py") for name in layers}
    imports: dict[str, set[str]] = {name: set() for name in layers}
    for m, deps in graph.items():
        for d in deps:
            imports[layer_of(m, subs)].add(layer_of(d, subs))
    rank = {name: i for i, name in enumerate(layers)}
    width = max(len(v) for v in label.values()) + 14
    lines = ["┌" + "─" * width + "┐"]
    for i, name in enumerate(reversed(layers)):
        count = sum(1 for m in modules if layer_of(m, subs) == name)
        box = f" {label[name]:<{width - 13}}{count:>3} modules "
        below = [n + ("!" if rank[n] > rank[name] else "") for n in reversed(layers)
                 if n in imports[name] and n != name]
        lines.append(f"│{box}│ ──► {', '.join(below) if below else '(nothing of the package)'}")
        lines.append(("├" if i < len(layers) - 1 else "└") + "─" * width
                     + ("┤" if i < len(layers) - 1 else "┘"))
    return "\n".join(lines)


def _page_block(heading: str) -> str:
    """The first ```text block after `heading` in docs/layout.md."""
    with open(LAYOUT_PAGE, encoding="utf-8") as f:
        page = f.read()
    at = page.index(heading)
    m = re.search(r"```text\n(.*?)\n```", page[at:], re.S)
    return m.group(1)


def test_the_layout_page_draws_the_layers_as_the_code_has_them():
    assert _page_block("## Layers") == render_layers(), \
        "docs/layout.md's layer stack is out of date: paste the output of python tests/test_house.py"


def test_the_data_path_on_the_layout_page_names_modules_that_exist():
    block = _page_block("## The data path")
    named = re.findall(r"\b((?:[a-z_]+/)+[a-z_]+\.py)\b", block)
    assert len(named) >= 6, named
    missing = [n for n in named if not os.path.isfile(os.path.join(PACKAGE, n))]
    assert not missing, f"docs/layout.md's data path names modules that are not there: {missing}"


def test_the_public_import_paths_keep_working_and_are_on_the_layout_page():
    with open(LAYOUT_PAGE, encoding="utf-8") as f:
        page = f.read()
    surface = page[page.index("## The public surface"):]
    for path, names in PUBLIC.items():
        module = importlib.import_module(path)
        assert [n for n in names if not hasattr(module, n)] == [], path
        assert f"`{path}`" in surface, f"{path} is not listed in docs/layout.md's public surface"


if __name__ == "__main__":
    print(render_layers())


def test_moving_a_module_never_changes_what_files_and_states_say_they_are():
    """Format tags written into shard indexes and checkpoint states are data, not import paths:
    a regroup of the modules must leave them as released (files and states saved before load)."""
    from pooled_loader.mix import state as mix_state
    from pooled_loader.resume import elastic, keys
    from pooled_loader.shards import index
    assert index.FORMAT == "pooled_loader.shard_index/1"
    assert elastic.FORMAT == "pooled_loader.elastic/1"
    assert keys.FORMAT == "pooled_loader.resume/1"
    assert (mix_state.FORMAT, mix_state.MERGED) == ("pooled_loader.mix/1",
                                                   "pooled_loader.mix.merged/1")
