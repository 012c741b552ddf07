"""Host memory: aligned, reusable (pinned when CUDA is present) buffers, and byte accounting.

    pool = BufferPool()                 # pin=None: cudaHostRegister only when CUDA is present
    buf = pool.acquire(nbytes)          # 4 KiB-aligned piece of a 2 MiB-aligned THP region
    t = buf.tensor(torch.float32)       # zero-copy view (any dtype); buf.memoryview, buf[a:b]
    pool.release(buf)                   # reused by the next acquire of a fitting size
    pool.stats()                        # pinned/pageable/in-use/reserved bytes
    pool.close()                        # munmap; BufferError while views are alive

``default_accounting()`` sums bytes per tier (device, pinned_host, pageable_host, nvme) over
the owners that report into it (pools do so automatically).
"""
from .accounting import TIERS, Accounting, default_accounting
from .pool import BufferPool, HostBuffer
from .region import HUGE_PAGE, PAGE, anon_huge_bytes

__all__ = ["BufferPool", "HostBuffer", "Accounting", "default_accounting", "TIERS", "PAGE", "HUGE_PAGE",
           "anon_huge_bytes"]
