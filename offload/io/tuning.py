"""The tuning file written by ``offload bench-io --tune`` and read by the swap layer.

Schema (JSON object; unknown keys are a ``ValueError``, so a typo never falls back silently
to a default -- DeepSpeed's tuner once emitted a key its loader ignored)::

    {
      "schema": "offload-io-tuning/1",
      "engine": "uring",          # uring | threads | aiofiles
      "block_size": 1048576,      # bytes, multiple of 4096
      "queue_depth": 32,
      "direct": true,             # true | false | null (as IOConfig.direct)
      "measured": {"read_gbps": 2.41, "write_gbps": 5.02},   # 10^9 B/s, informative
      "directory": "/nvme/swap",  # where it was measured, informative
      "created": "2026-11-30T17:00:00Z", "tool": "offload bench-io 0.1.0"   # informative
    }

``load_tuning(path)`` returns the ``IOConfig``; ``open_engine(load_tuning(path))`` opens the
tuned engine; ``offload.AdamW(..., offload="nvme", io_engine=path)`` (or the ``IOConfig``)
gives it to the swap pipeline (``offload.optim.options.io_config``).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, Optional

from offload.config import IOConfig

__all__ = ["SCHEMA", "load_tuning", "save_tuning"]

SCHEMA = "offload-io-tuning/1"
_REQUIRED = ("schema", "engine", "block_size", "queue_depth", "direct")
_OPTIONAL = ("measured", "directory", "created", "tool")


def save_tuning(path: "str | os.PathLike[str]", config: IOConfig, *, read_gbps: Optional[float] = None,
                write_gbps: Optional[float] = None, directory: Optional[str] = None,
                tool: str = "offload bench-io") -> Dict[str, Any]:
    """Write ``config`` (and what was measured) to ``path`` atomically; returns the object."""
    if config.engine == "auto":
        raise ValueError("a tuning file names a concrete engine, not 'auto'")
    data: Dict[str, Any] = {
        "schema": SCHEMA,
        "engine": config.engine,
        "block_size": config.block_size,
        "queue_depth": config.queue_depth,
        "direct": config.direct,
        "measured": {"read_gbps": read_gbps, "write_gbps": write_gbps},
        "directory": directory,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "tool": tool,
    }
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
    return data


def load_tuning(path: "str | os.PathLike[str]") -> IOConfig:
    """Read a tuning file into an ``IOConfig``; ``ValueError`` naming the file for any bad content."""
    path = os.fspath(path)
    with open(path) as fh:  # OSError carries errno and path
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a JSON tuning file: {exc}") from None
        except UnicodeDecodeError as exc:  # alone it named neither the file nor what it should be
            raise ValueError(f"{path}: not a JSON tuning file: not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start}); write one with `offload bench-io --tune FILE`") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a tuning file is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(f"{path}: unknown tuning key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(_REQUIRED + _OPTIONAL)}")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{path}: missing tuning key(s) {', '.join(missing)}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"{path}: schema {data['schema']!r} is not {SCHEMA!r}")
    for key in ("block_size", "queue_depth"):
        if isinstance(data[key], bool) or not isinstance(data[key], int):
            raise ValueError(f"{path}: {key} must be an integer, got {data[key]!r}")
    if data["direct"] not in (True, False, None):
        raise ValueError(f"{path}: direct must be true, false or null, got {data['direct']!r}")
    try:
        return IOConfig(engine=data["engine"], queue_depth=data["queue_depth"], block_size=data["block_size"],
                        direct=data["direct"])
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
