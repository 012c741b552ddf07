"""The device side of a torch.profiler run, for the GPU benches (offload_step.py --gpu,
shard_gpu.py): each device event's kind, how long each kind kept the device busy, how much
of that kernels and copies spent at once, and how long the device sat idle.

User annotations are left out. The profiler mirrors a CPU-side ``record_function`` range
(torch's own ``Optimizer.step#AdamW.step`` among them) onto the device timeline as one event
spanning everything the range queued: counted as a kernel, it made the 4 ms of kernels of
bench/offload_step.py's step on an H200 read 209 ms (2026-12-04). An event is an annotation
when the profiler says so (``is_user_annotation``) or when a CPU event has its name (kernels
and copies are named by the device, never like a CPU op).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

KINDS = ("kernels", "HtoD", "DtoH", "other copies")


def kind_of(name: str) -> str:
    if "HtoD" in name:
        return "HtoD"
    if "DtoH" in name:
        return "DtoH"
    if "Memcpy" in name or "Memset" in name:
        return "other copies"
    return "kernels"


def union(spans: List[Tuple[float, float]]) -> float:
    """Total length covered by the (start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def device_spans(events) -> Dict[str, List[Tuple[float, float]]]:
    """Kind -> the (start, end) of each device event, in ms; annotations left out."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = list(events)
    cpu_names = {ev.name for ev in events if ev.device_type == cpu}
    spans: Dict[str, List[Tuple[float, float]]] = {k: [] for k in KINDS}
    for ev in events:
        if ev.device_type != cuda or getattr(ev, "is_user_annotation", False) or ev.name in cpu_names:
            continue
        spans[kind_of(ev.name)].append((ev.time_range.start / 1e3, ev.time_range.end / 1e3))
    return spans


def summary(events) -> Dict[str, float]:
    """ms: the span from the first device event to the last; each kind's busy time and event
    count; kernels and copies at once; the device idle within the span. {} without events."""
    spans = device_spans(events)
    every = [s for v in spans.values() for s in v]
    if not every:
        return {}
    kernels = union(spans["kernels"])
    copies = union(spans["HtoD"] + spans["DtoH"] + spans["other copies"])
    busy = union(every)
    out = {"span_ms": max(b for _, b in every) - min(a for a, _ in every)}
    for k in KINDS:
        key = k.lower().replace(" ", "_")
        out[f"{key}_ms"] = union(spans[k])
        out[f"{key}_ops"] = len(spans[k])
    out["both_at_once_ms"] = kernels + copies - busy
    out["idle_ms"] = out["span_ms"] - busy
    return out
