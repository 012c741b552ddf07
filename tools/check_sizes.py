#!/usr/bin/env python3
"""The shape of the package: files over 500 lines, functions over 80 lines, import cycles.

    python tools/check_sizes.py [PACKAGE_DIR]      (default: offload/ next to this tools/)

Prints what it finds and exits 1 if anything is found. Reads the source only (``ast``), so
it runs without torch or the native library. tests/test_code_shape.py runs the same checks
with an allow-list of the places still being reshaped.

An import is any ``import``/``from ... import`` inside the package, at module level or inside
a function (a lazy import still ties two modules together), except under ``if
TYPE_CHECKING:``, which never runs. ``from pkg import name`` depends on ``pkg.name`` when that
is a module, else on ``pkg`` itself (its ``__init__``).
"""
from __future__ import annotations

import ast
import os
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def module_files(root: str) -> Dict[str, str]:
    """Dotted module name -> path, for every ``.py`` file under the package ``root``."""
    base = os.path.dirname(os.path.abspath(root))
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                parts = os.path.relpath(path, base)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as fh:
        return ast.parse(fh.read(), filename=path)


def long_files(files: Dict[str, str], limit: int = MAX_FILE_LINES) -> List[Tuple[str, int]]:
    """(path, lines) of the files over ``limit`` lines."""
    out = []
    for path in files.values():
        with open(path, encoding="utf-8") as fh:
            n = sum(1 for _ in fh)
        if n > limit:
            out.append((path, n))
    return sorted(out)


def long_functions(files: Dict[str, str], limit: int = MAX_FUNCTION_LINES) -> List[Tuple[str, str, int]]:
    """(path, qualified name, lines) of the functions over ``limit`` lines (decorators and
    docstring included: what a reader has to scroll through)."""
    out = []
    for path in files.values():
        for qual, node in _functions(_parse(path)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            n = node.end_lineno - first + 1
            if n > limit:
                out.append((path, qual, n))
    return sorted(out)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[Tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _type_checking(node: ast.AST) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            yield from (x for n in node.orelse for x in _imports_and_self(n))
            continue
        yield from _imports_and_self(node)


def _imports_and_self(node: ast.AST) -> Iterator[ast.AST]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def _targets(module: str, is_pkg: bool, node: ast.AST, known: Set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for a in node.names:
            yield a.name
        return
    if node.level:
        parts = module.split(".") if is_pkg else module.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    for a in node.names:
        sub = f"{base}.{a.name}"
        yield sub if sub in known else base


def import_graph(files: Dict[str, str]) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (itself and outside modules left out)."""
    known = set(files)
    graph: Dict[str, Set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.endswith("__init__.py")
        deps = set()
        for node in _imports(_parse(path)):
            for t in _targets(mod, is_pkg, node, known):
                while t and t not in known:  # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    deps.add(t)
        graph[mod] = deps
    return graph


def import_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted.

    A package's ``__init__`` that imports its own modules, and a module of it that imports
    the package, form a cycle too: Python copes with most of them, but they make the import
    order matter, which is what this check is for.
    """
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "offload")
    files = module_files(os.path.normpath(root))
    found = 0
    for path, n in long_files(files):
        print(f"file over {MAX_FILE_LINES} lines: {path} ({n})")
        found += 1
    for path, qual, n in long_functions(files):
        print(f"function over {MAX_FUNCTION_LINES} lines: {path}:{qual} ({n})")
        found += 1
    for comp in import_cycles(import_graph(files)):
        print("import cycle: " + " <-> ".join(comp))
        found += 1
    if not found:
        print(f"{len(files)} modules: no file over {MAX_FILE_LINES} lines, no function over "
              f"{MAX_FUNCTION_LINES}, no import cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
