"""End to end: a model whose fp32 params + grads + Adam states exceed a RAM budget, trained
with its optimizer states in NVMe swap files.

    .venv/bin/python bench/e2e.py                       # ~1B params, 3 steps, 2 GiB of host buffers
    .venv/bin/python bench/e2e.py --params 200M --steps 4 --ram-budget 12GiB
    .venv/bin/python bench/e2e.py --dtype bfloat16      # bf16 params: fp32 masters swapped too

The model is the demo's TinyGPT (offload.demo) scaled with ``--params``; the loop is the
demo's (forward, backward, ``opt.step()``). Each contender runs in its own process so that
its peak RSS is its own:

- ``offload.AdamW(offload="nvme", max_host_bytes=...)``: step time (median of the steps
  after the first, which creates the swap files), its breakdown from ``opt.step_stats()``,
  peak RSS, bytes allocated on disk, host buffers from ``opt.memory_report()``;
- ``torch.optim.AdamW(fused=True)`` (torch's fastest CPU path; its default for CPU tensors
  is the much slower single-tensor loop) with everything in RAM, run only when the planner
  (``offload.plan.estimate``) says it fits in ``--ram-budget``; otherwise "does not fit"
  with the planner's bytes. With ``--dtype bfloat16`` the in-RAM contender is not run (torch's
  AdamW on bf16 params keeps no fp32 master: another algorithm); the planner's figure for the
  same states in RAM (``offload="cpu"``) is printed instead.

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, Optional

import torch

GiB = float(1 << 30)


def _worker(args: argparse.Namespace) -> None:
    """Train in this process and print one JSON line with what was measured."""
    from offload.demo.train import DemoConfig, run
    from offload.optim.stats import process_rss_bytes

    cfg = DemoConfig(params=args.params, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     offload="nvme", swap_parent=args.swap_dir, max_host_bytes=args.max_host_bytes,
                     lr=args.lr, warmup=1, seed=0, torch_impl="fused", dtype=args.dtype)
    t0 = time.perf_counter()

    def progress(rec):
        print(f"[{args.worker}] step {rec.step}: loss {rec.loss:.4f}, {rec.seconds:.2f} s "
              f"(opt.step {rec.opt_seconds:.2f} s), RSS {process_rss_bytes() / GiB:.2f} GiB", file=sys.stderr, flush=True)

    res = run(cfg, "offload" if args.worker == "offload" else "torch", on_step=progress)
    later = res.records[1:] or res.records
    out: Dict[str, Any] = {
        "worker": args.worker,
        "params": res.model.num_params,
        "model": {"n_layer": res.model.n_layer, "d_model": res.model.d_model, "n_head": res.model.n_head},
        "losses": res.losses,
        "iter_s": [r.seconds for r in res.records],
        "opt_step_s": [r.opt_seconds for r in res.records],
        "iter_s_median": statistics.median(r.seconds for r in later),
        "opt_step_s_median": statistics.median(r.opt_seconds for r in later),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "wall_s": time.perf_counter() - t0,
        "swap_bytes_on_disk": res.swap_bytes_on_disk,
        "leftover_files": res.leftover_files,
        "memory_report": res.memory_report,
        "step_stats": res.step_stats,
        "max_host_bytes": res.max_host_bytes,
    }
    print("RESULT " + json.dumps(out, default=str), flush=True)


def _spawn(kind: str, args: argparse.Namespace, timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--params", str(args.params),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--max-host-bytes", str(args.max_host_bytes), "--swap-dir", args.swap_dir, "--lr", repr(args.lr),
           "--dtype", args.dtype]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} worker exited {proc.returncode} without a result")
    return json.loads(lines[-1][len("RESULT "):])


def _plan(n: int, offload: str, args: argparse.Namespace):
    from offload.plan import estimate

    return estimate(n, offload=offload, param_dtype=getattr(torch, args.dtype), param_device="cpu",
                    host_memory=args.ram_budget,
                    max_host_bytes=args.max_host_bytes if offload == "nvme" else None)


def main(argv: Optional[list] = None) -> int:
    from offload.config import parse_bytes
    from offload.demo.model import config_for_params
    from offload.demo.train import default_swap_parent
    from offload.plan import parse_count
    from offload.plan.render import fmt_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=parse_count, default=parse_count("1B"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-5,
                    help="peak learning rate, cosine decay over the steps (default 1e-5: with 64 tokens a "
                         "step and no warm-up, 1e-4 already makes the next batch's loss jump, with torch's "
                         "AdamW as with ours)")
    ap.add_argument("--max-host-bytes", type=parse_bytes, default=parse_bytes("2GiB"))
    ap.add_argument("--ram-budget", type=parse_bytes, default=parse_bytes("12GiB"),
                    help="host memory the in-RAM AdamW may use (default 12 GiB of this 24 GiB machine)")
    ap.add_argument("--swap-dir", default=None)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="params dtype (bfloat16: the optimizer's fp32 masters go to the swap files too)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    ap.add_argument("--worker", choices=("offload", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.swap_dir = args.swap_dir or default_swap_parent()
    if args.worker:
        _worker(args)
        return 0

    n = config_for_params(args.params, block_size=args.seq_len).num_params
    plan_ram = _plan(n, "none" if args.dtype == "float32" else "cpu", args)
    plan_nvme = _plan(n, "nvme", args)
    print(f"e2e: TinyGPT {n:,} params, batch {args.batch_size} x {args.seq_len} tokens, {args.steps} steps, "
          f"{torch.get_num_threads()} torch threads, swap under {args.swap_dir}, "
          f"max_host_bytes {fmt_bytes(args.max_host_bytes)}, RAM budget {fmt_bytes(args.ram_budget)}")
    print(f"planner, in-RAM AdamW: host {fmt_bytes(plan_ram.host_bytes)} (params, grads, "
          f"{'exp_avg, exp_avg_sq' if args.dtype == 'float32' else 'fp32 master, exp_avg, exp_avg_sq'}) -> "
          f"{'fits' if plan_ram.fits['host'] else 'DOES NOT FIT'} in {fmt_bytes(args.ram_budget)}")
    print(f"planner, nvme offload: host {fmt_bytes(plan_nvme.host_bytes)} (params, grads, I/O buffers), "
          f"nvme {fmt_bytes(plan_nvme.per_rank['nvme'])}")

    ours = _spawn("offload", args, args.timeout)
    ref = _spawn("torch", args, args.timeout) if plan_ram.fits["host"] and args.dtype == "float32" else None
    no_ref = "does not fit" if not plan_ram.fits["host"] else "not run (bf16)"

    stats = (ours.get("step_stats") or {}).get("mean") or {}
    tiers = (ours.get("memory_report") or {}).get("tiers") or {}
    rows = [
        ("params", f"{n:,}", ""),
        ("iteration (fwd+bwd+step), median of steps 2..", f"{ours['iter_s_median']:.2f} s",
         f"{ref['iter_s_median']:.2f} s" if ref else no_ref),
        ("opt.step, median of steps 2..", f"{ours['opt_step_s_median']:.2f} s",
         f"{ref['opt_step_s_median']:.2f} s" if ref else "-"),
        ("peak RSS", fmt_bytes(ours['peak_rss']),
         fmt_bytes(ref['peak_rss']) if ref else f"planner: {fmt_bytes(plan_ram.host_bytes)}"),
        ("optimizer host buffers", fmt_bytes(tiers.get('pinned', 0) + tiers.get('pageable', 0)), ""),
        ("bytes on disk (allocated)", fmt_bytes(ours['swap_bytes_on_disk']), "0"),
    ]
    print(f"\n  {'':<46}{'offload nvme':>16}{'torch fused, RAM':>22}")
    for name, a, b in rows:
        print(f"  {name:<46}{a:>16}{b:>22}")
    print("\n  opt.step breakdown (mean over the steps, ms; phases overlap):")
    for k in ("kernel", "swap_read", "swap_write", "wait_read", "wait_write", "commit", "step"):
        if k in stats:
            print(f"    {k:<12}{stats[k] * 1e3:10.1f}")
    if "overlap_efficiency" in stats:
        print(f"    overlap efficiency (ideal / actual): {stats['overlap_efficiency']:.3f}")
    if ours["leftover_files"]:
        print(f"  WARNING: files left in the swap directory: {ours['leftover_files']}")
    result = {
        "bench": "e2e", "dtype": args.dtype, "params": n, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "max_host_bytes": args.max_host_bytes, "ram_budget": args.ram_budget,
        "offload": {k: ours[k] for k in ("iter_s_median", "opt_step_s_median", "peak_rss", "swap_bytes_on_disk",
                                         "losses", "wall_s")},
        "offload_step_mean": stats, "offload_tiers": tiers,
        "torch": None if ref is None else {k: ref[k] for k in ("iter_s_median", "opt_step_s_median", "peak_rss",
                                                                  "losses", "wall_s")},
        "torch_fits": bool(plan_ram.fits["host"]), "planner_ram_host_bytes": plan_ram.host_bytes,
        "planner_nvme_host_bytes": plan_nvme.host_bytes, "planner_nvme_bytes": plan_nvme.per_rank["nvme"],
    }
    if ref is not None:
        result["ratio_iter_offload_over_torch"] = ours["iter_s_median"] / ref["iter_s_median"]
        result["losses_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ref["losses"]))
    print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
