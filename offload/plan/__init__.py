"""The bill before and during training: the memory planner and the runtime report.

``estimate(...)`` predicts bytes per rank and tier and the optimizer step time;
``cheapest_fitting(...)`` searches stage and offload target; ``StepLogger`` writes the
per-step JSON lines that ``offload report`` reads back.
"""
from .estimate import (
    COMPONENTS,
    TIERS,
    SWAP_SLOTS,
    Plan,
    estimate,
    zero_paper_bytes,
)
from .search import cheapest_fitting
from .inputs import count_params, parse_count, parse_dtype
from .hf_config import load_hf_config, params_from_hf_config, unit_sizes_from_hf_config
from .stage3 import ShardOptions
from .zero_table import format_zero_table, zero_table
from .rates import (
    DiskProbe,
    KernelProbe,
    Rate,
    disk_rate_from_tune,
    kernel_rate_from_bench,
    probe_disk_rate,
    probe_kernel_rate,
)
from .report import (
    StepLogger,
    attach,
    format_log_summary,
    format_memory_report,
    format_step_stats,
    read_step_log,
    summarize_step_log,
)

__all__ = [
    "estimate", "cheapest_fitting", "Plan", "SWAP_SLOTS", "TIERS", "COMPONENTS",
    "count_params", "parse_count", "parse_dtype", "zero_paper_bytes",
    "params_from_hf_config", "load_hf_config", "unit_sizes_from_hf_config",
    "zero_table", "format_zero_table", "ShardOptions",
    "Rate", "KernelProbe", "DiskProbe", "probe_kernel_rate", "kernel_rate_from_bench", "probe_disk_rate", "disk_rate_from_tune",
    "StepLogger", "attach", "read_step_log", "summarize_step_log", "format_log_summary",
    "format_memory_report", "format_step_stats",
]
