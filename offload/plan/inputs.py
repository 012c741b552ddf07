"""What the planner is given: parameter counts, dtypes, byte sizes and rates, checked.

Bad input is a ``ValueError`` carrying the bad value (a config file that is missing is a
``FileNotFoundError`` naming it, from ``hf_config``).
"""
from __future__ import annotations

import errno
import math
import os
import re
from fractions import Fraction
from typing import Any, Optional, Tuple, Union

import torch

from offload.config import exact_number

from .hf_config import params_from_hf_config

__all__ = ["parse_count", "parse_dtype", "dtype_name", "count_params", "resolve_params",
           "nonneg_bytes", "positive_rate", "swap_dir_path"]


# a number (offload.config.exact_number's grammar: no "1_000", as parse_bytes), then a unit
_COUNT_RE = re.compile(r"^\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_COUNT_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "b": 10 ** 9, "t": 10 ** 12}


def parse_count(value: Union[int, str]) -> int:
    """``"7.5B"`` -> 7_500_000_000, ``"125M"`` -> 125_000_000, ``42`` -> 42 (decimal units:
    parameter counts are quoted in powers of ten). A count that is not a whole number of
    params (``"1.5"``, ``"1.0000000001B"``) is refused, not rounded."""
    if isinstance(value, bool):
        raise ValueError(f"invalid parameter count: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"parameter count must be >= 0, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"parameter count must be a finite number >= 0, got {value}")
        if not value.is_integer():
            raise ValueError(f"parameter count must be a whole number, got {value!r}")
        return int(value)
    m = _COUNT_RE.match(str(value))
    number = exact_number(m.group(1).lower()) if m else None  # the numbers parse_bytes reads
    if number is None:
        if str(value).strip().startswith("-"):
            raise ValueError(f"parameter count must be >= 0, got {value!r}")
        raise ValueError(f"invalid parameter count: {value!r} (examples: 125M, 7.5B, 1e9)")
    unit = _COUNT_UNITS[m.group(2).lower()]
    if not math.isfinite(float(m.group(1)) * unit):  # "1e400": float() gives inf, which int() cannot hold
        raise ValueError(f"parameter count {value!r} is too large")
    n = number * unit  # exact: "1.1B" is 1,100,000,000, "1.5" is not a count
    if n.denominator != 1:
        raise ValueError(f"parameter count must be a whole number, got {value!r} ({float(n):,.15g} params)")
    return int(n)


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "f32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "f16": torch.float16,
}


def parse_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """A torch dtype or one of its names (``bf16``, ``fp16``, ``fp32`` ...); others: ValueError."""
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {value}; expected float32, bfloat16 or float16")
        return value
    key = str(value).strip().lower().replace("torch.", "")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of fp32, bf16, fp16 (or torch dtypes)")
    return _DTYPES[key]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def count_params(module: torch.nn.Module, trainable_only: bool = True) -> int:
    """Parameters the optimizer would receive: each tensor once (tied weights count once)."""
    seen = set()
    total = 0
    for p in module.parameters():
        if trainable_only and not p.requires_grad:
            continue
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def resolve_params(source: Any) -> Tuple[int, str, Optional[torch.nn.Module]]:
    """(count, description, module or None) for an int, "7.5B", a Module or a config path."""
    if isinstance(source, torch.nn.Module):
        return count_params(source), f"{type(source).__name__} module", source
    if isinstance(source, (int, float)) and not isinstance(source, bool):
        n = parse_count(source)
        return n, f"{n:,} params", None
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if _COUNT_RE.match(text) or text.strip().startswith("-"):
            n = parse_count(text)
            return n, f"{n:,} params", None
        if not os.path.exists(text) and os.sep not in text and not text.endswith(".json"):
            raise ValueError(f"invalid parameter count: {text!r} (examples: 125M, 7.5B, 1e9; or a config.json path)")
        n = params_from_hf_config(text)
        return n, f"{text} ({n:,} params)", None
    raise ValueError(f"num_params must be a count, a torch.nn.Module or a config.json path, got {type(source).__name__}")


def check_amsgrad(amsgrad: Any, optimizer: str) -> None:
    """``amsgrad`` a bool, and True only for Adam's rules."""
    if not isinstance(amsgrad, bool):
        raise ValueError(f"amsgrad must be True or False, got {type(amsgrad).__name__} {amsgrad!r}")
    if amsgrad and optimizer not in ("adam", "adamw"):
        raise ValueError(f"amsgrad is Adam's option (optimizer 'adam' or 'adamw'); optimizer {optimizer!r} has none")


def nonneg_bytes(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, str):
        from offload.config import parse_bytes
        value = parse_bytes(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a byte count >= 0, got {value!r}")
    return int(value)


def positive_rate(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return v


def swap_dir_path(swap_dir: Any) -> Optional[str]:
    """``swap_dir`` as a path (None: not given), refused by name unless it is a directory
    that exists (a file there was planned for with its file system's free space)."""
    if swap_dir is None:
        return None
    path = os.fspath(swap_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(errno.ENOENT, "swap directory does not exist", path)
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "swap directory is a file, not a directory (the optimizers make "
                                 "their swap files in a directory there)", path)
    return path
