"""Disk I/O for swap files: io_uring, thread-pool and asyncio engines over O_DIRECT files.

    from offload.io import open_engine, open_file, IORequest, load_tuning
    from offload.memory import BufferPool

    eng = open_engine("auto", directory=swap_dir)        # or open_engine(load_tuning(path))
    f = eng.open(f"{swap_dir}/states.bin", write=True, create=True)   # O_DIRECT where possible
    f.preallocate(nbytes)
    buf = BufferPool().acquire(nbytes)                   # 4 KiB-aligned, huge pages
    t = eng.submit([IORequest("write", f, 0, buf)])      # returns at once
    ...                                                  # compute: the queue keeps moving
    eng.wait(t)                                          # [bytes per request]; OSError(errno, msg, path)

Engines split requests into ``block_size`` pieces, keep ``queue_depth`` in flight, resubmit
short transfers, report end of file exactly, route unaligned pieces through a buffered
descriptor, and never hold the GIL while waiting. ``OFFLOAD_IO_ENGINE`` overrides ``"auto"``.
"""
from offload.config import IOConfig

from .aio import AiofilesEngine, AsyncIO
from .auto import ENGINES, ENV_VAR, engine_status, engine_unavailable_reason, open_engine
from .engine import Engine, IORequest, Ticket
from .files import ALIGN, IOFile, NotRegularFile, open_file, open_regular, probe_direct
from .threads import ThreadEngine
from .tuning import load_tuning, save_tuning
from .uring import UringEngine

__all__ = [
    "open_engine", "IORequest", "IOFile", "open_file", "open_regular", "NotRegularFile", "probe_direct",
    "Ticket", "Engine",
    "UringEngine", "ThreadEngine", "AiofilesEngine", "AsyncIO", "load_tuning", "save_tuning",
    "IOConfig", "ENGINES", "ENV_VAR", "ALIGN", "engine_unavailable_reason", "engine_status",
]
