"""A test module's heavy optional import, done when one of its tests first uses it.

Every pytest worker collects every test module, and so runs each module's top-level imports,
but runs the tests of only some modules. transformers, torch's optimizer database
(``torch.testing._internal.common_optimizers``, which imports all of torch's OpInfos),
torch.distributed.checkpoint and torch.distributed.optim cost each worker 0.4-2.6 s of CPU
at collection, in both passes of ``make test``, for the one worker that runs the module
(forty-fourth session: ~5 s of each worker's ~10 s of collection).

``lazy_import("transformers")`` stands for the module: its first public attribute imports
it (a failed import skips the test that asked); a package that is not installed skips the
module at once, as ``pytest.importorskip``. Attributes starting with ``_`` do not import it: pytest's collection looks
for its markers on every module-level object. ``lazy_value(make)`` is a value computed the
same way, on first use (``make`` may skip, or raise).
"""
from __future__ import annotations

import importlib
import importlib.util
import types

import pytest

__all__ = ["lazy_import", "lazy_value"]


class _LazyModule(types.ModuleType):
    def __init__(self, name: str, load) -> None:
        super().__init__(name)
        object.__setattr__(self, "_lazy_load", load)
        object.__setattr__(self, "_lazy_module", None)

    def _lazy_target(self):
        mod = object.__getattribute__(self, "_lazy_module")
        if mod is None:
            mod = object.__getattribute__(self, "_lazy_load")()
            object.__setattr__(self, "_lazy_module", mod)
        return mod

    def __getattr__(self, attr: str):
        # only names the module itself lacks come here; pytest's probes (_pytestfixturefunction,
        # __test__ ...) must not import it at collection
        if attr.startswith("_") and attr not in ("__version__", "__file__", "__path__"):
            raise AttributeError(attr)
        return getattr(self._lazy_target(), attr)


def lazy_import(name: str) -> types.ModuleType:
    """A stand-in for ``pytest.importorskip(name)`` that imports on first use. A package
    that is not installed skips the whole module at once, as importorskip does (its tests
    also ``from transformers import ...`` by themselves): its top-level package is looked
    up without importing it."""
    top = name.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        pytest.skip(f"could not import {name!r}: No module named {top!r}", allow_module_level=True)

    def load():
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            pytest.skip(f"could not import {name!r}: {exc}")
    return _LazyModule(name, load)


class lazy_value:
    """``make()``'s value, computed on first use of an attribute, item, ``in``, ``len`` or
    iteration (a mapping or a namespace built from a lazy import)."""

    def __init__(self, make) -> None:
        self._make = make
        self._value = None
        self._made = False

    def get(self):
        if not self._made:
            self._value = self._make()
            self._made = True
        return self._value

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(self.get(), attr)

    def __getitem__(self, key):
        return self.get()[key]

    def __contains__(self, key) -> bool:
        return key in self.get()

    def __iter__(self):
        return iter(self.get())

    def __len__(self) -> int:
        return len(self.get())
