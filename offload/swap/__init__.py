"""NVMe swap: a private, locked, crash-consistent store of flat typed states and the pipeline
that streams its sub-groups through host buffers around a compute callback, one step at a
time as a session, with the ranks' agreement on each commit.

Knows no optimizer math: ``offload.optim`` plugs the kernel in.
"""
from .agreement import Agreement, Vote
from .layout import SwapLayout
from .pipeline import SwapPipeline, SwapStepError, pipeline_host_bytes, plan_sub_groups
from .session import SwapSession
from .step import StepSession
from .store import FORMAT_VERSION, SwapStore

__all__ = ["SwapLayout", "SwapPipeline", "SwapStepError", "SwapStore", "SwapSession", "StepSession", "Agreement",
           "Vote", "plan_sub_groups", "pipeline_host_bytes", "FORMAT_VERSION"]
