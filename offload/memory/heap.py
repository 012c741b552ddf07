"""The C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

[Note: trimming the heap] glibc keeps freed chunks resident: only the top of the heap is
given back on ``free``, and tensors of up to 32 MiB (its largest mmap threshold, reached once
a large tensor is freed) come from the heap. A forward + backward over units of tens of MB
leaves holes between the chunks still in use, resident but free: at 1B params on NVMe 120-530
MB of the heap (mallinfo2's ``fordblks``) at the start of the step, whose own RAM bound
(``offload.swap.pipeline.paged_bound``) counts the pipeline buffers and the paged pages only.
``trim_heap`` returns them (``MADV_DONTNEED`` of every free page); the next forward faults
back in what it reuses (~2.5 us per 4 KiB page here).
"""
from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["trim_heap"]

_TRIM: Any = None


def trim_heap() -> bool:
    """Give the heap's free pages back to the system (see the note); False where the C
    library has no ``malloc_trim`` (musl, macOS)."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
            _TRIM.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _TRIM = False
    if not _TRIM:
        return False
    _TRIM(0)
    return True
