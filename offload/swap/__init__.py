"""NVMe swap: a private, locked, crash-consistent store of flat fp32 states and the pipeline
that streams its sub-groups through host buffers around a compute callback.

Knows no optimizer math: ``offload.optim.swapped_state`` plugs the Adam kernel in.
"""
from .layout import SwapLayout
from .pipeline import SwapPipeline, SwapStepError, pipeline_host_bytes, plan_sub_groups
from .store import FORMAT_VERSION, SwapStore

__all__ = ["SwapLayout", "SwapPipeline", "SwapStepError", "SwapStore", "plan_sub_groups", "pipeline_host_bytes",
           "FORMAT_VERSION"]
