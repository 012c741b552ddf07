"""Text forms of a plan: the per-rank table (GiB, binary) and the ``--explain`` derivation."""
from __future__ import annotations

from typing import Any, List, Optional

from .placement import COMPONENTS, TIERS
from .render3 import sharding_explain_lines, sharding_table_lines

__all__ = ["plan_table", "explain_text", "gib", "fmt_bytes"]

_GiB = float(1 << 30)


def gib(n: float) -> str:
    """Bytes as GiB (2^30) with two decimals."""
    return f"{n / _GiB:.2f}"


def fmt_bytes(n: Optional[float]) -> str:
    """Human form in binary units (KiB, MiB, GiB, TiB), never GB for 2^30."""
    if n is None:
        return "-"
    n = float(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fit_word(v: Optional[bool]) -> str:
    return "unknown (capacity not given)" if v is None else ("yes" if v else "NO")


def _byte_rows(plan: Any) -> List[str]:
    """The table proper: a row per component, a column per tier, and with swap files a
    column that splits the NVMe bytes into one slot x the slots kept (so 8 B/param of an
    fp32 state on NVMe explains itself)."""
    slots = (plan.inputs.get("swap") or {}).get("slots")
    comps = [c for c in COMPONENTS if any(plan.breakdown[t][c] for t in TIERS)]
    b = plan.breakdown
    # a column as wide as its widest figure: at 10^15 params the totals ran together
    # ("3725290.3011175870.90")
    w = 1 + max([10] + [len(gib(v)) for t in TIERS for v in list(b[t].values()) + [plan.per_rank[t]]])
    head = f"  {'':<14}" + "".join(f"{t:>{w}}" for t in TIERS)

    # stage 3 keeps its param and grad shard files in fewer slots than the states (stage3.py)
    kept = {c: k for c, k in plan.sharding.get("nvme_slots", {}).items() if b["nvme"][c]}

    def slot_cell(nvme: int, k: Optional[int]) -> str:
        return f"{gib(nvme // k)} x {k}" if k and nvme else ""

    out = [head + (f"{'nvme = slot x slots':>22}" if slots else "")]
    for c in comps:
        out.append((f"  {c:<14}" + "".join(f"{gib(b[t][c]):>{w}}" for t in TIERS)
                    + (f"{slot_cell(b['nvme'][c], kept.get(c, slots)):>22}" if slots else "")).rstrip())
    totals = plan.per_rank
    same = all(k == slots for k in kept.values())
    out.append((f"  {'total':<14}" + "".join(f"{gib(totals[t]):>{w}}" for t in TIERS)
                + (f"{slot_cell(totals['nvme'], slots if same else None):>22}" if slots else "")).rstrip())
    if slots:
        fp32 = plan.inputs.get("state_dtype", "float32") == "float32" and plan.inputs.get("master_dtype") is None
        each = "fp32 state is kept in {} slots (4 B per element each" if fp32 else \
            "state is kept in {} slots (each its dtype's bytes per element: bf16 2, int8 1 + 4 per 256"
        out.append(f"  nvme: each swapped {each.format(slots)}, plus padding to 4 KiB per sub-group),")
        out.append("  written alternately so that a crash leaves one complete step: a step reads one slot and "
                   "writes the other")
    return out


def plan_table(plan: Any) -> str:
    """The per-rank table of an ``offload.plan.Plan`` (typed ``Any``: ``result`` imports this
    module, and nothing may import in a cycle)."""
    i = plan.inputs
    lines: List[str] = []
    lines.append(
        f"offload plan: {i['source']}, world size {i['world_size']}, stage {i['stage']}, "
        f"offload={i['offload']}, params {i['param_dtype']} on {i['param_device']}, grads {i['grad_dtype']}, "
        f"{i['optimizer']}"
    )
    if not plan.supported:
        lines.append("not offered by this engine")
    lines.append("bytes per rank, in GiB (2^30 bytes):")
    lines.extend(_byte_rows(plan))
    lines.extend(sharding_table_lines(plan))
    totals = plan.per_rank
    cap = plan.capacity
    fits = plan.fits
    if i["param_device"] == "cpu":
        dev = "device not used (params on the CPU)"
    else:
        dev = (f"device {_fit_word(fits['device'])} (needs {gib(totals['device'])} of "
               f"{gib(cap['device']) if cap['device'] is not None else '?'} GiB)")
    lines.append(
        f"fits: {dev}; host {_fit_word(fits['host'])} "
        f"(needs {gib(plan.host_bytes)} of {gib(cap['host']) if cap['host'] is not None else '?'} GiB per rank); "
        f"nvme {_fit_word(fits['nvme'])} (needs {gib(totals['nvme'])} of "
        f"{gib(cap['nvme']) if cap['nvme'] is not None else '?'} GiB per rank)"
    )
    s = plan.step
    disk = i["offload"] == "nvme" or plan.sharding.get("offload_params") == "nvme"
    if s.get("step_time_s") is not None:
        parts = [f"kernel {s['kernel_s'] * 1e3:.1f} ms at {s['kernel_gparams']:.2f} Gparam/s"]
        if disk:
            def at(r: Optional[float]) -> str:
                return f" at {r:.2f} GB/s" if r is not None else ""
            parts.append(
                f"I/O {s['io_s'] * 1e3:.1f} ms for {gib(s['read_bytes'])} GiB read{at(s['disk_read_gbps'])} "
                f"+ {gib(s['write_bytes'])} GiB written{at(s['disk_write_gbps'])} (GB = 10^9 B)"
            )
        lines.append(f"predicted optimizer step: {s['step_time_s'] * 1e3:.1f} ms = max({'; '.join(parts)})")
    else:
        missing = []
        if s.get("kernel_gparams") is None:
            missing.append("a kernel rate (--kernel-gparams, --adam-bench or the probe)")
        if disk and (s.get("disk_read_gbps") is None or s.get("disk_write_gbps") is None):
            missing.append("disk rates (--disk-gbps, --io-tune or --swap-dir for the probe)")
        if missing:
            lines.append(f"predicted optimizer step: needs {' and '.join(missing)}")
    paper = plan.zero_paper_bytes
    lines.append(f"ZeRO paper figure for stage {i['stage']} (all model states on the device, 2-byte params and "
                 f"grads, K = {i['k']}): {paper / 1e9:.2f} GB = {gib(paper)} GiB per rank")
    for n in plan.problems:
        lines.append(f"PROBLEM: {n}")
    for n in plan.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def explain_text(plan: Any) -> str:
    """The formulas behind the numbers, with this plan's values substituted."""
    i = plan.inputs
    n, N, st, k = i["num_params"], i["world_size"], i["stage"], i["k"]
    paper = plan.zero_paper_bytes
    lines = [
        "How these numbers are computed (Ψ = params, N_d = data-parallel ranks):",
        f"  Ψ = {n:,}, N_d = {N}, K = {k} (fp32 master 4 + exp_avg 4 + exp_avg_sq 4 "
        + ("+ max_exp_avg_sq 4 bytes per param, mixed-precision Adam with amsgrad)" if i.get("amsgrad")
           else "bytes per param, mixed-precision Adam)"),
        "ZeRO paper (Rajbhandari et al. 2020, table 1), 2-byte params and grads:",
        "  stage 0: (2 + 2 + K)Ψ;  stage 1 (P_os): 4Ψ + KΨ/N_d;  stage 2 (P_os+g): 2Ψ + (2 + K)Ψ/N_d;",
        "  stage 3 (P_os+g+p): (2 + 2 + K)Ψ/N_d",
        f"  -> stage {st}: {paper / 1e9:.2f} GB (10^9 B) = {paper / (1 << 30):.2f} GiB per rank",
        "This engine places the same states on tiers and adds its own buffers:",
    ]
    if st == 3:
        lines.extend(sharding_explain_lines(plan))
        return "\n".join(lines + _explain_tail(i))
    lines += [
        f"  shard = ceil(Ψ / N_d) = {i['shard_numel']:,} elements for stages 1-2 (Ψ for stage 0)",
        f"  params {i['param_dtype']} and grads {i['grad_dtype']} on {i['param_device']}, whole on every rank "
        "(p.grad keeps torch's meaning; the engine reads it at step time and does not free it)",
    ]
    if i.get("master_dtype") == "bfloat16":
        lines.append("  master_dtype='bfloat16': the bf16 params are their own master (stepped in place with "
                     "stochastic rounding), no fp32 master in the flat store")
    elif not i["separate_master"]:
        lines.append("  fp32 CPU params at stage 0 (any number of ranks) are their own master, updated in "
                     "place (K = 8): exp_avg + exp_avg_sq = 8 B x Ψ")
    else:
        lines.append("  flat fp32 master (4 B x shard) and exp_avg + exp_avg_sq (8 B x shard) in host buffers, "
                     "also with offload='none' (this engine keeps the states of device params on the host), or "
                     "all three in swap files with offload='nvme'. Pinned, with CUDA only: what DMA touches "
                     "(the host grad copies and staging buffers, and the master of fp32 device params)")
    if i.get("state_dtype", "float32") != "float32":
        lines.append(f"  state_dtype={i['state_dtype']}: exp_avg and exp_avg_sq take 2 B per element (bfloat16) "
                     "or 260 B per block of 256 (int8: codes + a float32 scale) instead of 4 B; with int8 the "
                     "flat store starts each param on a block and cuts shards at whole blocks")
    off = i["offload"]
    if off == "nvme":
        sw = i.get("swap")
        lines.append("  offload=nvme: the streamed states live in swap files, every state padded to 4 KiB per "
                     "sub-group, in 2 slots written alternately (a crash leaves one complete step)")
        if sw:
            bound = "default 1 GiB" if i["max_host_bytes"] is None else f"{i['max_host_bytes']:,} B"
            pin = "pageable (they only travel between the disk and the CPU kernel: never pinned)"
            lines.append(
                f"    sub-groups of {sw['sub_group_size']:,} elements x {sw['nstates']} states "
                f"({sw['num_groups']} groups); host: {sw['buffers']} pipeline buffers of {sw['region_bytes']:,} B "
                f"within max_host_bytes ({bound}), {pin}"
            )
    if i["separate_master"]:
        if N > 1 and st >= 1:
            lines.append("  N_d > 1: grad_buffers = fp32 sum of this rank's shard (4 B x shard); lowp_buffers = "
                         "bf16/fp16 shard for the all-gather (2 B x shard); comm_buffers = per-bucket send "
                         "(N_d x chunk x 4 B), gather (N_d x chunk x param bytes) and reduce-scatter output "
                         "(chunk x 4 B), chunk = min(shard, 4 Mi / N_d), on the collective's device")
        elif i["param_device"] != "cpu":
            lines.append("  one rank, device params: grad_buffers = host copy of the grads in their own dtype "
                         "(grad bytes x Ψ); lowp_buffers = bf16/fp16 staging of updated params (2 B x shard)")
    return "\n".join(lines + _explain_tail(i))


def _explain_tail(i: Any) -> List[str]:
    """What every stage's derivation ends with: shared host memory, what is not counted, the step."""
    lines = [
        "Host memory is shared by the ranks of a node: capacity per rank = host_memory / ranks_per_node "
        f"({i['ranks_per_node']}).",
        "Not counted: activations, temporary buffers of the forward/backward, the CUDA context, allocator "
        "fragmentation, the Python process itself.",
    ]
    lines.append(
        "Step time (ideal of the pipelined step) = max(kernel, I/O): kernel = shard / (Gparam/s x 10^9); "
        "I/O (nvme) = bytes read / read GB/s + bytes written / write GB/s, every streamed state read and "
        "written once per step. This is the ideal of a perfect pipeline, a lower bound: how far "
        "a real step lands above it on a given machine is measured by bench/plan_accuracy.py (figures in "
        "bench/RESULTS.md)."
    )
    return lines
