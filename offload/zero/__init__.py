"""ZeRO partitioning: flat layouts, shard ranges per rank, collectives and side streams.

Only ``torch.distributed`` is used (gloo on CPUs, NCCL on GPUs); with no process group the
same code runs for a world of one.
"""
from .comm import all_gather, all_reduce, broadcast, comm_device, reduce_scatter, world_and_rank
from .partition import FlatLayout, Piece, split_ranges
from .streams import SideStream

__all__ = ["FlatLayout", "Piece", "split_ranges", "SideStream", "world_and_rank", "comm_device",
           "reduce_scatter", "all_reduce", "all_gather", "broadcast"]
