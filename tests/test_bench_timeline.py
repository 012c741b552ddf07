"""bench/_timeline.py, the GPU benches' device-timeline summary, on synthetic profiler events:
the profiler mirrors a CPU-side record_function range (torch's "Optimizer.step#AdamW.step")
onto the device as one event spanning the whole step; counted as a kernel it made
bench/offload_step.py --gpu report 209 ms of kernels for a step with 4 (H200, 2026-12-04)."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace as NS

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._timeline import summary, union  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def ev(name, start_us, end_us, device=CUDA, **extra):
    return NS(name=name, device_type=device, time_range=NS(start=start_us, end=end_us), **extra)


def test_union_counts_overlapping_time_once():
    assert union([]) == 0.0
    assert union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0
    assert union([(5, 6), (0, 10)]) == 10.0


def test_annotations_are_left_out_and_the_shares_add_up():
    events = [
        ev("Optimizer.step#AdamW.step", 0, 200_000, CPU),
        ev("Optimizer.step#AdamW.step", 0, 205_000),  # the same range mirrored on the device
        ev("ProfilerStep#3", 0, 300_000, is_user_annotation=True),
        ev("void gemm_kernel<128>", 0, 4_000),
        ev("Memcpy HtoD (Pinned -> Device)", 2_000, 12_000),
        ev("Memcpy DtoH (Device -> Pinned)", 20_000, 30_000),
        ev("Memset (Device)", 30_000, 30_010),
    ]
    t = summary(events)
    assert t["kernels_ops"] == 1 and t["kernels_ms"] == pytest.approx(4.0)
    assert t["htod_ms"] == pytest.approx(10.0) and t["dtoh_ms"] == pytest.approx(10.0)
    assert t["other_copies_ms"] == pytest.approx(0.01) and t["other_copies_ops"] == 1
    assert t["span_ms"] == pytest.approx(30.01)
    assert t["both_at_once_ms"] == pytest.approx(2.0)  # the gemm and the HtoD copy from 2 to 4 ms
    assert t["idle_ms"] == pytest.approx(30.01 - (4 + 10 + 10 + 0.01 - 2))


def test_no_device_events_give_an_empty_summary():
    assert summary([ev("aten::mm", 0, 10, CPU)]) == {}
