"""Typed configuration shared by the API, the CLI and the docs.

Every option is a field of a small frozen dataclass with one default, used everywhere.
Unknown keys are errors (``from_dict`` raises ``ValueError`` naming them) so a typo in a
config file never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping, Optional, Union

__all__ = ["IOConfig", "OffloadConfig", "parse_bytes", "from_dict"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000 ** 2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000 ** 3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000 ** 4,
    "p": 1 << 50, "pib": 1 << 50, "pb": 1000 ** 5,
    "e": 1 << 60, "eib": 1 << 60, "eb": 1000 ** 6,  # up to MAX_BYTES, 4 EiB
}

# A number as the command line and config files write it: digits, a decimal point, an
# exponent. Not what float() takes beyond that ("1_000", "+5", non-ASCII digits, "nan"), so
# that byte sizes and parameter counts (plan/inputs.py) read the same numbers.
_NUMBER_RE = re.compile(r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?$")


def exact_number(text: str) -> Optional[Fraction]:
    """``text`` (lower case, no spaces) as an exact fraction, or None when it is not a number
    of ``_NUMBER_RE``'s form. Exact, so that a caller can refuse a value that is not whole
    (``0.3K`` bytes is 307.2) instead of truncating it. An exponent below -400 is refused
    (ValueError): its denominator alone would take minutes to compute."""
    m = _NUMBER_RE.match(text)
    if m is None:
        return None
    if m.group(1) is not None and int(m.group(1)) < -400:
        raise ValueError(f"invalid number {text!r}: exponent out of range")
    return Fraction(text)


# 4 EiB: more than any file system or memory holds, and below the 2**63 at which the OS's
# off_t / size_t arguments overflow (posix_fallocate raised OverflowError on --size 1e30).
MAX_BYTES = 1 << 62


def parse_bytes(value: "int | str") -> int:
    """``"4GiB"`` -> 4294967296, ``"1M"`` -> 1048576, ``"2GB"`` -> 2000000000, ``123`` -> 123.

    Single letters (K, M, G, T, P, E) are binary units, as in fio. A size that is not a whole
    number of bytes (``"0.3K"``) is refused, not truncated.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value}")
        return _bounded(value, value)
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"invalid byte size: {value!r} (examples: 4096, 128K, 1MiB, 4GiB, 2GB)")
    if num.startswith("-"):
        raise ValueError(f"byte size must be >= 0, got {value!r}")
    try:
        number = float(num)
        exact = exact_number(num)
    except ValueError:
        raise ValueError(f"invalid byte size: {value!r}") from None
    if not math.isfinite(number):  # "1e400" parses as inf: int() of it would be an OverflowError
        raise ValueError(f"invalid byte size: {value!r} (not a finite number: too large, nan or inf)")
    if exact is None:  # "1_000", "+5": float() takes them, the grammar of sizes and counts does not
        raise ValueError(f"invalid byte size: {value!r} (examples: 4096, 128K, 1MiB, 4GiB, 2GB)")
    n = exact * _UNITS[unit]
    if n > MAX_BYTES:
        return _bounded(MAX_BYTES + 1, value)
    if n.denominator != 1:
        # "4096.5", "0.3K" (307.2): truncating would size a buffer or a budget other than the
        # one written, and "0.0000001K" became 0
        raise ValueError(f"invalid byte size: {value!r} (not a whole number of bytes: {float(n):.15g})")
    return _bounded(int(n), value)


def _bounded(n: int, value: "int | str") -> int:
    if n > MAX_BYTES:
        raise ValueError(f"byte size {value!r} is too large: more than 2**62 bytes (4 EiB), "
                         "larger than any file system or memory can hold")
    return n


@dataclass(frozen=True)
class IOConfig:
    """How the io layer talks to the disk."""

    engine: str = "auto"
    """``"auto"`` (probe: io_uring with O_DIRECT, else threads), ``"uring"``, ``"threads"``
    or ``"aiofiles"``. ``OFFLOAD_IO_ENGINE`` overrides ``"auto"``."""
    queue_depth: int = 32
    """Requests kept in flight per engine."""
    block_size: int = 1 << 20
    """Largest single request in bytes; larger transfers are split."""
    direct: Optional[bool] = None
    """``True``: O_DIRECT or fail; ``False``: buffered; ``None``: O_DIRECT where the file
    system allows it, buffered with a warning elsewhere (tmpfs)."""

    def __post_init__(self) -> None:
        if self.engine not in ("auto", "uring", "threads", "aiofiles"):
            raise ValueError(f"unknown io engine {self.engine!r}; expected auto, uring, threads or aiofiles")
        from offload.io.engine import MAX_QUEUE_DEPTH

        if isinstance(self.queue_depth, bool) or not isinstance(self.queue_depth, int) \
                or not 1 <= self.queue_depth <= MAX_QUEUE_DEPTH:
            raise ValueError(f"queue_depth must be an int in [1, {MAX_QUEUE_DEPTH}], got {self.queue_depth!r}")
        if self.block_size < 4096 or self.block_size % 4096:
            raise ValueError(f"block_size must be a positive multiple of 4096, got {self.block_size}")


@dataclass(frozen=True)
class OffloadConfig:
    """Where the optimizer keeps its fp32 states and how it streams them."""

    offload: str = "none"
    """``"none"`` (states beside the params), ``"cpu"`` (host memory) or ``"nvme"`` (swap files)."""
    swap_dir: Optional[str] = None
    """Directory for swap files; required with ``offload="nvme"``."""
    max_host_bytes: Optional[int] = None
    """Bound on host memory for the swap pipeline's buffers (``None``: 1 GiB)."""
    sub_group_size: Optional[int] = None
    """Elements per sub-group streamed through the pipeline (``None``: derived from
    ``max_host_bytes``)."""
    verify: bool = False
    """Keep per-block checksums of swap files and check them on every read."""
    resume: Union[bool, str] = False
    """Continue from the consistent step left in ``swap_dir`` by an earlier run (True);
    ``"auto"``: resume when what is left matches these params, start afresh when nothing is
    left; ``"discard"``: remove what a dead earlier run left and start afresh (see
    [Note: restarts] in offload/swap/runs.py)."""
    io: IOConfig = field(default_factory=IOConfig)

    def __post_init__(self) -> None:
        if self.offload not in ("none", "cpu", "nvme"):
            raise ValueError(f"unknown offload target {self.offload!r}; expected 'none', 'cpu' or 'nvme'")
        if self.offload == "nvme" and not self.swap_dir:
            raise ValueError("offload='nvme' needs swap_dir=DIR (a directory on a local disk)")
        if self.max_host_bytes is not None and self.max_host_bytes <= 0:
            raise ValueError(f"max_host_bytes must be > 0, got {self.max_host_bytes}")
        if not (isinstance(self.resume, bool) or (isinstance(self.resume, str) and self.resume in ("auto", "discard"))):
            raise ValueError(f"resume must be True, False, 'auto' or 'discard', got {self.resume!r}")
        if self.sub_group_size is not None and self.sub_group_size <= 0:
            raise ValueError(f"sub_group_size must be > 0, got {self.sub_group_size}")
        if self.swap_dir is not None:
            object.__setattr__(self, "swap_dir", os.fspath(self.swap_dir))


def from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Build config dataclass ``cls`` from a mapping; unknown keys are a ``ValueError``."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    kwargs = dict(data)
    if cls is OffloadConfig and isinstance(kwargs.get("io"), Mapping):
        kwargs["io"] = from_dict(IOConfig, kwargs["io"])
    return cls(**kwargs)
