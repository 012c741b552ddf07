"""``open_engine``: pick an engine by probing, or honour the one asked for, and say why.

``"auto"`` probes once per process whether an io_uring ring can be set up and, when a
directory is given, whether O_DIRECT works there. io_uring with O_DIRECT is the fast path;
where the directory refuses O_DIRECT we take the threads engine with buffered I/O (io_uring
buys nothing over threads for page-cache copies), and where io_uring is blocked the threads
engine. ``OFFLOAD_IO_ENGINE`` replaces ``"auto"``; an engine asked for by name that cannot
work here is an error saying why, never a silent switch.
"""
from __future__ import annotations

import errno
import logging
import os
from typing import Any, Dict, Optional, Union

from offload.config import IOConfig

from .engine import Engine
from .files import probe_direct

__all__ = ["ENGINES", "ENV_VAR", "open_engine", "resolve_engine", "engine_unavailable_reason", "engine_status"]

log = logging.getLogger(__name__)

ENGINES = ("uring", "threads", "aiofiles")
ENV_VAR = "OFFLOAD_IO_ENGINE"
_UNSET: Any = object()


_URING_WORKS = []  # [True] once a probe succeeded


def _uring_reason() -> Optional[str]:
    """Why io_uring cannot run here (None: it can). A success is kept for the process; a
    failure is probed again next time, as it may pass (no free descriptor, memory)."""
    if _URING_WORKS:
        return None
    from .uring import uring_unavailable_reason

    why = uring_unavailable_reason()
    if why is None:
        _URING_WORKS.append(True)
    return why


def engine_unavailable_reason(name: str) -> Optional[str]:
    """None if engine ``name`` can run here, else why not."""
    if name == "uring":
        return _uring_reason()
    if name == "aiofiles":
        try:
            import aiofiles.os  # noqa: F401
        except ImportError as exc:
            return f"the aiofiles package is not installed ({exc}); pip install aiofiles"
        return None
    if name == "threads":
        return None
    raise ValueError(f"unknown io engine {name!r}; expected one of {', '.join(ENGINES)} or auto")


def _make(name: str, **kwargs: Any) -> Engine:
    if name == "uring":
        from .uring import UringEngine

        return UringEngine(**kwargs)
    if name == "threads":
        from .threads import ThreadEngine

        return ThreadEngine(**kwargs)
    from .aio import AiofilesEngine

    return AiofilesEngine(**kwargs)


def open_engine(name: Union[str, IOConfig] = "auto", *, directory: "Optional[str | os.PathLike[str]]" = None,
                queue_depth: Optional[int] = None, block_size: Optional[int] = None,
                direct: Optional[bool] = _UNSET) -> Engine:
    """Open an I/O engine.

    ``name``: ``"auto"``, ``"uring"``, ``"threads"``, ``"aiofiles"``, or an ``IOConfig``
    (e.g. from ``load_tuning``) whose fields are the defaults of the keyword arguments.
    ``directory``: where the files will live; probed for O_DIRECT. ``direct``: as in
    ``open_file``, kept on the engine (``eng.direct``, used by ``eng.open``); ``"auto"`` turns
    None into False where the directory refuses O_DIRECT. ``eng.reason`` says why this engine.
    Raises ``RuntimeError`` when a requested engine cannot work here, ``OSError`` when
    ``direct=True`` but the directory refuses O_DIRECT, ``ValueError`` for bad values.
    """
    cfg = name if isinstance(name, IOConfig) else None
    if cfg is not None:
        name = cfg.engine
        queue_depth = cfg.queue_depth if queue_depth is None else queue_depth
        block_size = cfg.block_size if block_size is None else block_size
        direct = cfg.direct if direct is _UNSET else direct
    queue_depth = 32 if queue_depth is None else queue_depth
    block_size = (1 << 20) if block_size is None else block_size
    direct = None if direct is _UNSET else direct
    if name not in ENGINES + ("auto",):
        raise ValueError(f"unknown io engine {name!r}; expected auto, {', '.join(ENGINES)}")
    forced_by = "the caller" if name != "auto" else None
    env = os.environ.get(ENV_VAR, "").strip()
    if name == "auto" and env and env != "auto":
        if env not in ENGINES:
            raise ValueError(f"{ENV_VAR}={env!r} is not an io engine; expected one of {', '.join(ENGINES)} or auto")
        name, forced_by = env, f"{ENV_VAR}={env}"

    direct_ok: Optional[bool] = None
    direct_why = ""
    if directory is not None:
        directory = os.fspath(directory)
        direct_ok, direct_why = probe_direct(directory)
        if direct is True and not direct_ok:
            raise OSError(errno.EINVAL, f"direct=True but {direct_why}", directory)

    if name == "auto":
        uring_why = _uring_reason()
        if uring_why is None and direct_ok is not False:
            name = "uring"
            reason = "io_uring works" + (f" and O_DIRECT is accepted in {directory}" if directory else "")
        elif uring_why is None:
            name = "threads"
            reason = f"{direct_why} in {directory}: threads engine with buffered I/O"
        else:
            name = "threads"
            reason = f"io_uring unavailable: {uring_why}"
            if direct_ok is False:
                reason += f"; {direct_why} in {directory}: buffered I/O"
        log.info("io engine %s: %s", name, reason)
    else:
        why = engine_unavailable_reason(name)
        if why is not None:
            raise RuntimeError(f"io engine {name!r} (asked for by {forced_by}) cannot work here: {why}")
        reason = f"asked for by {forced_by}"
        log.debug("io engine %s: %s", name, reason)
    if direct_ok is False and direct is None:
        direct = False  # files there will be buffered anyway; say so up front, no warning per file
    engine = _make(name, queue_depth=queue_depth, block_size=block_size, direct=direct)
    engine.reason = reason
    return engine


def engine_status() -> Dict[str, str]:
    """For ``offload info``: each engine's availability (with the reason when not), what
    ``"auto"`` picks here without a directory to probe, and ``OFFLOAD_IO_ENGINE``."""
    out: Dict[str, str] = {}
    for name in ENGINES:
        why = engine_unavailable_reason(name)
        out[name] = "available" if why is None else f"unavailable: {why}"
    env = os.environ.get(ENV_VAR, "").strip()
    out["env " + ENV_VAR] = env or "unset"
    if env and env != "auto":
        out["auto picks"] = f"{env} (forced by {ENV_VAR})" if env in ENGINES else f"error: {env!r} is not an engine"
    elif _uring_reason() is None:
        out["auto picks"] = "uring (threads with buffered I/O where a directory refuses O_DIRECT)"
    else:
        out["auto picks"] = "threads (io_uring unavailable)"
    if _uring_reason() is None:
        from .uring import liburing_unavailable_reason, ring_kind

        kind = ring_kind()
        out["uring ring"] = "python-liburing" if kind == "liburing" else \
            f"native (liburing's cannot run: {liburing_unavailable_reason()})" if kind == "native" else "none"
        out["uring registered buffers"] = _fixed_buffers_status()
    return out


def _fixed_buffers_status() -> str:
    """Whether the uring engine can register buffers here (probed with a 4 KiB one)."""
    import resource

    from .uring import UringEngine

    eng = UringEngine(queue_depth=2)
    try:
        handle = eng.register_buffers([bytearray(4096)])
        if handle is None:
            return f"no: {eng.fixed_buffers_reason}"
        eng.unregister_buffers(handle)
    finally:
        eng.close()
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.0f} MiB"
    return f"yes (they count against RLIMIT_MEMLOCK, here {limit}, unless the process has CAP_IPC_LOCK)"


def resolve_engine(io_engine: Any, directory: str):
    """(engine, owned): ``None``/str/``IOConfig`` open one (owned); an object with ``submit``
    and ``wait`` is used as is (tests inject slow or faulty wrappers this way)."""
    if io_engine is not None and hasattr(io_engine, "submit") and hasattr(io_engine, "wait"):
        return io_engine, False
    if io_engine is None or isinstance(io_engine, str):
        cfg = IOConfig(engine=io_engine or "auto")
    elif isinstance(io_engine, IOConfig):
        cfg = io_engine
    else:
        raise ValueError(f"io_engine must be None, an engine name, an IOConfig or an engine object, got {io_engine!r}")
    return open_engine(cfg, directory=directory), True
