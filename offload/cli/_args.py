"""Argument types for the numeric options of the ``offload`` command.

Each factory returns a function for ``argparse``'s ``type=``. A value it refuses (not a
number, ``nan``, ``inf``, too large to represent, negative, out of range) becomes argparse's
own usage error: exit status 2 and ``argument --option: why``, never a traceback. Checks that
relate two options (``--size`` a multiple of ``--block-size``) stay with the command, which
raises ``_outcome.BadUsage`` for them before any work: status 2 too.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Union

__all__ = ["byte_size", "checked", "count", "distinct_outputs", "integer", "rate", "tolerance"]


def _named(fn: Callable, name: str) -> Callable:
    # argparse names the type function in "invalid <name> value" messages of last resort
    fn.__name__ = name
    return fn


def byte_size(*, minimum: int = 0, auto: bool = False) -> Callable[[str], Union[int, str]]:
    """``"4GiB"``, ``"128K"``, ``"1e9"`` -> bytes (``offload.config.parse_bytes``); ``auto``
    passes ``"auto"`` through for the caller to resolve."""
    def parse(text: str) -> Union[int, str]:
        from offload.config import parse_bytes

        if auto and text.strip().lower() == "auto":
            return "auto"
        try:
            n = parse_bytes(text)
        except OverflowError:
            raise argparse.ArgumentTypeError(f"byte size {text!r} is too large") from None
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if n < minimum:
            need = "> 0" if minimum == 1 else f">= {minimum} bytes"
            raise argparse.ArgumentTypeError(f"must be {need}, got {text!r}")
        return n
    return _named(parse, "byte size")


def count(minimum: int = 0, why_minimum: str = "") -> Callable[[str], int]:
    """A parameter count in decimal units: ``125M``, ``7.5B``, ``1e9``."""
    def parse(text: str) -> int:
        from offload.plan.inputs import parse_count

        try:
            n = parse_count(text)
        except (OverflowError, TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:,}{why_minimum}, got {text!r}")
        return n
    return _named(parse, "count")


def integer(minimum: Optional[int] = None, maximum: Optional[int] = None,
            why_maximum: str = "") -> Callable[[str], int]:
    """A whole number in ``[minimum, maximum]`` (written as digits: ``1.5`` and ``1e3`` are refused)."""
    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if minimum is not None and v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        if maximum is not None and v > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}{why_maximum}, got {v}")
        return v
    return _named(parse, "integer")


def rate() -> Callable[[str], float]:
    """A finite number > 0 (a throughput)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(v) and v > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        return v
    return _named(parse, "rate")


def tolerance() -> Callable[[str], float]:
    """A finite number >= 0 (a relative tolerance; 0 asks for equality)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (math.isfinite(v) and v >= 0):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
        return v
    return _named(parse, "tolerance")


def checked(validate: Callable[[str], object], name: str) -> Callable[[str], str]:
    """The text as given, once ``validate(text)`` accepted it: the library's own check, so the
    command accepts exactly what the API does, and a value it refuses is a usage error (exit
    2, ``argument --option: why``) like every other bad option value, not exit 1 after parsing."""
    def parse(text: str) -> str:
        try:
            validate(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return _named(parse, name)


def distinct_outputs(outputs: "list[tuple[str, Optional[str]]]") -> None:
    """``BadUsage`` (status 2) when two output options (``("--json", path)``, ...) name one
    file: ``bench-io --json X --tune X`` wrote the rows and then the tuning over them, silently.
    Compared resolved (``./x`` and ``x``, a symlink and its target, two hard links)."""
    import os

    from ._outcome import BadUsage

    seen: "list[tuple[str, str]]" = []
    for option, path in outputs:
        if not path:
            continue
        real = os.path.realpath(path)
        for other, other_real in seen:
            if real == other_real or (os.path.exists(real) and os.path.exists(other_real)
                                      and os.path.samefile(real, other_real)):
                raise BadUsage(f"{other} and {option} name the same file ({path}): each writes its own output")
        seen.append((option, real))
