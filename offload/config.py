"""Typed configuration shared by the API, the CLI and the docs.

Every option is a field of a small frozen dataclass with one default, used everywhere.
Unknown keys are errors (``from_dict`` raises ``ValueError`` naming them) so a typo in a
config file never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

__all__ = ["IOConfig", "OffloadConfig", "parse_bytes", "from_dict"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000 ** 2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000 ** 3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000 ** 4,
}

# 4 EiB: more than any file system or memory holds, and below the 2**63 at which the OS's
# off_t / size_t arguments overflow (posix_fallocate raised OverflowError on --size 1e30).
MAX_BYTES = 1 << 62


def parse_bytes(value: "int | str") -> int:
    """``"4GiB"`` -> 4294967296, ``"1M"`` -> 1048576, ``"2GB"`` -> 2000000000, ``123`` -> 123.

    Single letters (K, M, G, T) are binary units, as in fio.
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
    try:
        number = float(num)
    except ValueError:
        raise ValueError(f"invalid byte size: {value!r}") from None
    if not math.isfinite(number):  # "1e400" parses as inf: int() of it would be an OverflowError
        raise ValueError(f"invalid byte size: {value!r} (not a finite number: too large, nan or inf)")
    if number < 0:
        raise ValueError(f"byte size must be >= 0, got {value!r}")
    if _UNITS[unit] == 1 and number != math.floor(number):
        # "4096.5" bytes: truncating would size a buffer or a budget other than the one
        # written (a fraction of a larger unit, "0.9GiB", is floored to the byte below)
        raise ValueError(f"invalid byte size: {value!r} (not a whole number of bytes)")
    # Whole numbers exactly: float("9223372036854775807") rounds up to 2**63.
    whole = int(num) if num.isdigit() else number
    return _bounded(int(whole * _UNITS[unit]), value)


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
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth must be >= 1, got {self.queue_depth}")
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
