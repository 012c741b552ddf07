"""offload: train PyTorch models larger than accelerator memory.

``offload.AdamW(model.parameters(), lr=..., offload="nvme", swap_dir=...)`` in an unchanged
training loop keeps the fp32 optimizer states in host memory or NVMe swap files and updates
them with a SIMD CPU kernel.

[Note: a light package import] The names below are imported on first use (PEP 562), not by
``import offload``: that imported torch, ~1.5 s before any code of the ``offload`` command
could run, and a Ctrl-C in that time landed inside torch's import (a traceback; one inside
the NumPy import that torch's C++ init makes was swallowed by torch, and the command ran to
the end). The command now holds signals while it imports them (offload/cli/_signals.py).
"""
import importlib as _importlib
import sys as _sys
import types as _types

from offload import _fork  # noqa: F401  (forks seen from the package's import on: offload/_fork.py)
from offload._version import __version__

__all__ = ["Adam", "AdamW", "SGD", "Adagrad", "Lion", "adam_step", "from_deepspeed_config", "shard", "full_state_dict",
           "set_num_threads", "get_num_threads",
           "__version__"]

# What type checkers and IDEs read (never executed; ``typing`` is not imported for it, as the
# command imports this file before it holds its signals): without it, the package ships py.typed
# and mypy saw ``offload.AdamW`` as Any, IDEs neither completed nor went to these names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from offload.integrations.deepspeed import from_deepspeed_config
    from offload.kernels import get_num_threads, set_num_threads
    from offload.optim import SGD, Adagrad, Adam, AdamW, Lion, adam_step
    from offload.shard import full_state_dict, shard
del TYPE_CHECKING  # (only the checkers' name: not one of the package's)

_HOME = {
    "get_num_threads": "offload.kernels", "set_num_threads": "offload.kernels",
    "SGD": "offload.optim", "Adagrad": "offload.optim", "Adam": "offload.optim", "AdamW": "offload.optim",
    "Lion": "offload.optim", "adam_step": "offload.optim",
    "from_deepspeed_config": "offload.integrations.deepspeed",
    "shard": "offload.shard", "full_state_dict": "offload.shard",
}


def __getattr__(name: str):
    if name.startswith("__"):  # copy, pickle, inspect probe dunders: never a submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in _HOME:
        value = getattr(_importlib.import_module(_HOME[name]), name)
    else:
        # a subpackage as an attribute (``import offload; offload.kernels.x``), as when this
        # file imported them all; anything else is the usual AttributeError
        try:
            value = _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted({n for n in globals() if not n.startswith("_") or n.startswith("__")} | set(__all__))


class _Package(_types.ModuleType):
    """``offload.shard`` is the function (``from offload.shard import shard`` made it so when this
    file imported everything), not the subpackage of that name, which the import system binds
    here once it has loaded it: then its ``shard`` takes the name instead. The subpackage stays
    in ``sys.modules`` (``import offload.shard.api``, ``from offload.shard import ...``)."""

    def __setattr__(self, name: str, value) -> None:
        if name == "shard" and isinstance(value, _types.ModuleType):
            value = value.shard
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
