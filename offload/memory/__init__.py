"""Host memory: aligned, reusable (pinned when CUDA is present) buffers, and byte accounting."""
from .accounting import TIERS, Accounting, default_accounting
from .pool import BufferPool, HostBuffer
from .region import HUGE_PAGE, PAGE, anon_huge_bytes

__all__ = ["BufferPool", "HostBuffer", "Accounting", "default_accounting", "TIERS", "PAGE", "HUGE_PAGE",
           "anon_huge_bytes"]
