"""Planner accuracy: predicted against measured optimizer step (and bytes) at N = 100M.

For ``offload="cpu"`` and ``offload="nvme"`` on fp32 CPU params, and ``offload="cpu"`` on bf16
CPU params (``cpu-bf16``: the flat store, with a separate fp32 master), in one run, ``--steps``
times in turn: one step of the planner's kernel probe (10M params), one pass of its disk
probe (nvme only; 256 MiB written then read with O_DIRECT in the swap directory), one real
``offload.AdamW`` step. The medians give the rates, ``offload.plan.estimate`` turns them into
a predicted step (max(kernel, I/O)) and bytes per tier, compared with the median real step
and ``memory_report()``. Interleaving matters on a shared machine: a noisy neighbour then
shifts probe and measurement alike. ``--rounds`` repeats it; the median ratio is the figure.
Target (issue 6): predicted step within 25 % of measured; bytes within 5 %.

    .venv/bin/python bench/plan_accuracy.py [--n 100000000] [--dir DIR] [--steps 5]

``--dir`` must be on a file system with O_DIRECT (not tmpfs); default: bench/.scratch.
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from offload.plan import TIERS, estimate  # noqa: E402
from offload.plan.rates import DiskProbe, KernelProbe  # noqa: E402


# target -> (offload, param dtype): "cpu-bf16" runs bf16 CPU params through the flat store
# (fp32 master + moments, grads upcast and the bf16 copy written in the kernel pass).
TARGETS = {"cpu": ("cpu", torch.float32), "nvme": ("nvme", torch.float32), "cpu-bf16": ("cpu", torch.bfloat16)}


def make_optimizer(n: int, target: str, swap_dir: str, max_host_bytes: int):
    """``offload.AdamW`` over one tensor of ``n`` CPU params for ``target``."""
    import offload

    off, dtype = TARGETS[target]
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    p.grad = (torch.randn(n) * 1e-2).to(dtype)
    kw = dict(offload=off)
    if off == "nvme":
        kw.update(swap_dir=swap_dir, max_host_bytes=max_host_bytes)
    return offload.AdamW([p], lr=1e-3, **kw)


def interleaved(opt, steps: int, kprobe: KernelProbe, dprobe: "DiskProbe | None"):
    """Median seconds of: one kernel probe step, one disk probe pass (read, write), one real
    step, taken in turn ``steps`` times so that a noisy neighbour shifts all three alike."""
    tk, tr, tw, ts = [], [], [], []
    for _ in range(steps):
        tk.append(kprobe.time_once())
        if dprobe is not None:
            r, w = dprobe.measure()
            tr.append(r)
            tw.append(w)
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    med = statistics.median
    return med(tk), (med(tr) if tr else None), (med(tw) if tw else None), med(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000_000)
    ap.add_argument("--dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".scratch"))
    ap.add_argument("--rounds", type=int, default=3, help="probe-then-measure rounds, interleaved")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and target (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-host-bytes", type=int, default=256 << 20)
    ap.add_argument("--targets", default="cpu,nvme,cpu-bf16", help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--probe-numel", type=int, default=10_000_000, help="params in the kernel probe (planner default 10M)")
    args = ap.parse_args()
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {', '.join(unknown)}; expected {', '.join(TARGETS)}")

    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="plan-accuracy-", dir=args.dir)
    opts, rows = {}, []
    try:
        for t in targets:
            os.makedirs(os.path.join(work, t))
            opts[t] = make_optimizer(args.n, t, os.path.join(work, t), args.max_host_bytes)
            for _ in range(args.warmup):
                opts[t].step()
        probe_dir = os.path.join(work, "probe")
        os.makedirs(probe_dir)
        kprobe = KernelProbe(args.probe_numel)
        dprobe = DiskProbe(probe_dir)
        try:
            for r in range(args.rounds):
                for t in targets:
                    tk, tr, tw, measured = interleaved(opts[t], args.steps, kprobe, dprobe if t == "nvme" else None)
                    kg = args.probe_numel / tk / 1e9
                    rg = dprobe.nbytes / tr / 1e9 if tr else None
                    wg = dprobe.nbytes / tw / 1e9 if tw else None
                    plan = estimate(args.n, offload=TARGETS[t][0], param_dtype=TARGETS[t][1], param_device="cpu",
                                    max_host_bytes=args.max_host_bytes if t == "nvme" else None,
                                    kernel_gparams=kg, disk_read_gbps=rg, disk_write_gbps=wg)
                    report = opts[t].memory_report()["tiers"]
                    errs = [abs(report[k] - plan.optimizer_bytes[k]) / max(1, plan.optimizer_bytes[k])
                            for k in TIERS if plan.optimizer_bytes[k] or report[k]]
                    last = (opts[t].step_stats() or {}).get("last") or {}
                    rows.append({
                        "round": r, "target": t, "n": args.n,
                        "kernel_gparams": kg, "disk_read_gbps": rg, "disk_write_gbps": wg,
                        "predicted_s": plan.step_time_s, "predicted_kernel_s": plan.step["kernel_s"],
                        "predicted_io_s": plan.step["io_s"], "measured_s": measured,
                        "ratio": measured / plan.step_time_s,
                        "overlap_efficiency": last.get("overlap_efficiency"),
                        "planned_bytes": plan.optimizer_bytes, "reported_bytes": report,
                        "bytes_max_rel_err": max(errs) if errs else 0.0,
                    })
        finally:
            dprobe.close()
    finally:
        for o in opts.values():
            if hasattr(o, "close"):
                o.close()
        shutil.rmtree(work, ignore_errors=True)

    print(f"N = {args.n:,} CPU params in one tensor, AdamW. Each round, {args.steps} times in turn: one kernel probe step "
          f"({args.probe_numel:,} params), one disk probe pass (256 MiB, O_DIRECT; nvme only), one real step; "
          "medians -> rates -> plan. GB = 10^9 B.")
    print(f"{'round':>5} {'target':<9}{'kernel Gp/s':>12}{'read GB/s':>10}{'write GB/s':>11}{'pred ms':>9}"
          f"{'meas ms':>9}{'meas/pred':>10}{'bytes err':>10}{'overlap':>8}")
    for r in rows:
        eff = "-" if r["overlap_efficiency"] is None else f"{r['overlap_efficiency']:.2f}"
        rd = "-" if r["disk_read_gbps"] is None else f"{r['disk_read_gbps']:.2f}"
        wr = "-" if r["disk_write_gbps"] is None else f"{r['disk_write_gbps']:.2f}"
        print(f"{r['round']:>5} {r['target']:<9}{r['kernel_gparams']:>12.3f}{rd:>10}"
              f"{wr:>11}{r['predicted_s'] * 1e3:>9.1f}{r['measured_s'] * 1e3:>9.1f}"
              f"{r['ratio']:>10.3f}{100 * r['bytes_max_rel_err']:>9.2f}%{eff:>8}")
    summary = {}
    for t in targets:
        ratios = [r["ratio"] for r in rows if r["target"] == t]
        med = statistics.median(ratios)
        summary[t] = {"median_ratio": med, "within_25pct": abs(med - 1) <= 0.25,
                      "rounds_within_25pct": sum(abs(x - 1) <= 0.25 for x in ratios), "rounds": len(ratios),
                      "bytes_max_rel_err": max(r["bytes_max_rel_err"] for r in rows if r["target"] == t)}
        print(f"{t}: median measured/predicted {med:.3f} ({'within' if summary[t]['within_25pct'] else 'NOT within'} "
              f"25 %; {summary[t]['rounds_within_25pct']}/{len(ratios)} rounds within); "
              f"bytes max error {100 * summary[t]['bytes_max_rel_err']:.2f} %")
    print(json.dumps({
        "bench": "plan_accuracy",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg_1m": os.getloadavg()[0]},
        "probe_numel": args.probe_numel,
        "summary": summary,
        "rows": rows,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
