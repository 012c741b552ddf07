"""The package's shape (issue #14): no file in offload/ over 500 lines, no function over 80,
no import cycle, checked by tools/check_sizes.py; and the checker itself on a made-up package."""
from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _checker():
    spec = importlib.util.spec_from_file_location("check_sizes", os.path.join(ROOT, "tools", "check_sizes.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offload_has_no_long_file_long_function_or_import_cycle():
    cs = _checker()
    files = cs.module_files(os.path.join(ROOT, "offload"))
    assert "offload.plan.estimate" in files and len(files) > 50
    long_files = cs.long_files(files)
    long_funcs = cs.long_functions(files)
    cycles = cs.import_cycles(cs.import_graph(files))
    assert not long_files, f"files over {cs.MAX_FILE_LINES} lines: {long_files}"
    assert not long_funcs, f"functions over {cs.MAX_FUNCTION_LINES} lines: {long_funcs}"
    assert not cycles, f"import cycles: {cycles}"


def _write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def test_the_checker_finds_what_it_looks_for(tmp_path):
    cs = _checker()
    pkg = tmp_path / "pkg"
    _write(pkg, "__init__.py", "")
    # a cycle through a lazy import (a function-level import ties the modules too)
    _write(pkg, "a.py", "from .b import g\n\ndef f():\n    return g()\n")
    _write(pkg, "b.py", "def g():\n    from pkg.a import f\n    return f\n")
    # a TYPE_CHECKING import never runs: no cycle between c and d
    _write(pkg, "c.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    _write(pkg, "d.py", "from . import c\n\nclass D:\n    pass\n")
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    _write(pkg, "sub/__init__.py", "")
    _write(pkg, "sub/long.py", f"class K:\n    def method(self):\n{body}\n        return 0\n" + "\n" * 420)
    files = cs.module_files(str(pkg))
    assert set(files) == {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.sub", "pkg.sub.long"}
    assert cs.import_cycles(cs.import_graph(files)) == [["pkg.a", "pkg.b"]]
    assert cs.import_graph(files)["pkg.d"] == {"pkg.c"}
    assert [(os.path.basename(p), n) for p, n in cs.long_files(files)] == [("long.py", 503)]
    assert [(q, n) for _, q, n in cs.long_functions(files)] == [("K.method", 82)]
    assert cs.main([str(pkg)]) == 1


def test_the_checker_passes_a_clean_package(tmp_path, capsys):
    cs = _checker()
    _write(tmp_path / "ok", "__init__.py", "from .m import f\n")
    _write(tmp_path / "ok", "m.py", "def f():\n    return 1\n")
    assert cs.main([str(tmp_path / "ok")]) == 0
    assert "no import cycle" in capsys.readouterr().out


@pytest.mark.parametrize("module", ["offload.plan.estimate", "offload.plan.render", "offload.plan.result"])
def test_the_planner_modules_import_alone(module):
    # each imports on its own, whatever was imported before (the cycle made the order matter)
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, env=env, cwd=ROOT)
