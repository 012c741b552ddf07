"""The names ``import offload`` resolves on first use (PEP 562, [Note: a light package import]
in offload/__init__.py) are still there for type checkers and IDEs, which never run the module
``__getattr__``: the package ships py.typed, and once the names became lazy mypy typed
``offload.AdamW`` and ``offload.shard`` as Any (no error for a wrong argument) and IDEs
neither completed them nor went to their definitions."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import offload


def _type_checking_imports() -> dict:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in offload/__init__.py."""
    tree = ast.parse(Path(offload.__file__).read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                found.update({a.asname or a.name: imp.module for a in imp.names})
    return found


def test_every_lazy_name_is_imported_for_type_checkers_from_where_it_lives():
    assert set(offload._HOME) == set(offload.__all__) - {"__version__"}
    assert _type_checking_imports() == offload._HOME
    # the block never runs (torch stays unimported), and its flag is not a name of the package
    assert "TYPE_CHECKING" not in vars(offload)
    assert not {"TYPE_CHECKING", "importlib", "sys", "types"} & set(dir(offload))
    for name, module in offload._HOME.items():
        assert getattr(offload, name) is getattr(importlib.import_module(module), name), name
