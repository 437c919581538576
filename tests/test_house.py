"""The house rules of pooled_loader/ (issue 30): no import ring between its modules, and no
module over 600 lines.

An import counts wherever it is written (module top, inside a function, under TYPE_CHECKING):
a lazy import that dodges a ring at run time still ties the two modules both ways. Extension
modules (``_jpeg``, ``_kernels``) import nothing of the package and are not nodes."""
from __future__ import annotations

import ast
import os
import textwrap

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "pooled_loader")
MAX_LINES = 600


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
        graph[name] = {d for d in deps if d in modules and d != name}
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


def test_the_size_check_counts_lines(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "fits.py": "x = 1\n" * 600,
                               "big.py": "x = 1\n" * 601})
    assert modules_over(root, MAX_LINES) == {"pkg.big": 601}
