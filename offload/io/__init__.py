"""Disk I/O for swap files: io_uring, thread-pool and asyncio engines over O_DIRECT files."""
from offload.config import IOConfig

from .aio import AiofilesEngine, AsyncIO
from .auto import ENGINES, ENV_VAR, engine_status, engine_unavailable_reason, open_engine
from .engine import Engine, IORequest, Ticket
from .files import ALIGN, IOFile, open_file, probe_direct
from .threads import ThreadEngine
from .tuning import load_tuning, save_tuning
from .uring import UringEngine

__all__ = [
    "open_engine", "IORequest", "IOFile", "open_file", "probe_direct", "Ticket", "Engine",
    "UringEngine", "ThreadEngine", "AiofilesEngine", "AsyncIO", "load_tuning", "save_tuning",
    "IOConfig", "ENGINES", "ENV_VAR", "ALIGN", "engine_unavailable_reason", "engine_status",
]
