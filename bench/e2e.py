"""End to end: a model whose fp32 params + grads + Adam states exceed a RAM budget, trained
with its optimizer states in NVMe swap files.

    .venv/bin/python bench/e2e.py                       # ~1B params, 3 steps, 2 GiB of host buffers
    .venv/bin/python bench/e2e.py --params 200M --steps 4 --ram-budget 12GiB
    .venv/bin/python bench/e2e.py --dtype bfloat16      # bf16 params: fp32 masters swapped too
    .venv/bin/python bench/e2e.py --dtype bfloat16 --state-dtype int8 --master-dtype bfloat16
    .venv/bin/python bench/e2e.py --dtype bfloat16 --state-dtype int8 --master-dtype bfloat16 \
        --disk-bytes 4GiB                               # the largest model on that much disk

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

``--state-dtype`` / ``--master-dtype`` go to ``offload.AdamW``; a run whose steps never
reached the compressed kernel (a store that does not support them yet) says so and prints no
figure (bench/_states.py).

``--disk-bytes N`` (or ``free``: the swap directory's free space) instead: the largest TinyGPT
config whose swap files fit in N bytes (the planner's NVMe bytes: two slots of the swapped
states), for fp32 states (with ``--dtype``'s params: fp32 master for bf16 params) and for the
asked ``--state-dtype`` / ``--master-dtype``; each is trained ``--steps`` steps (``--no-train``:
sizes only) and its measured bytes on disk, step time and the ratio of the two sizes are
printed (target: >= 2.5x for bf16 params with int8 states and a bf16 master).

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
from typing import Any, Dict, Optional, Tuple

import torch

GiB = float(1 << 30)


def _worker(args: argparse.Namespace) -> None:
    """Train in this process and print one JSON line with what was measured."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._states import CompressedCalls
    from offload.demo.train import DemoConfig, run
    from offload.kernels import get_backend
    from offload.optim.stats import process_rss_bytes

    cfg = DemoConfig(params=args.params, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                     offload="nvme", swap_parent=args.swap_dir, max_host_bytes=args.max_host_bytes,
                     lr=args.lr, warmup=1, seed=0, torch_impl="fused", dtype=args.dtype,
                     state_dtype=args.state_dtype, master_dtype=args.master_dtype)
    t0 = time.perf_counter()

    def progress(rec):
        print(f"[{args.worker}] step {rec.step}: loss {rec.loss:.4f}, {rec.seconds:.2f} s "
              f"(opt.step {rec.opt_seconds:.2f} s), RSS {process_rss_bytes() / GiB:.2f} GiB", file=sys.stderr, flush=True)

    compressed = args.state_dtype != "float32" or args.master_dtype == "bfloat16"
    try:
        with CompressedCalls(get_backend()) as calls:
            res = run(cfg, "offload" if args.worker == "offload" else "torch", on_step=progress)
    except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
        if not compressed:
            raise  # the float32 run works on main: its failure is a bug, not a missing feature
        why = f"not run: {type(exc).__name__}: {exc}".splitlines()[0][:240]
        print("RESULT " + json.dumps({"worker": args.worker, "skipped": why}), flush=True)
        return
    missing = calls.missing(args.state_dtype, args.master_dtype) if args.worker == "offload" else None
    if missing:
        print("RESULT " + json.dumps({"worker": args.worker, "skipped": f"not supported: {missing}"}), flush=True)
        return
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
        "compressed_calls": calls.summary(),
    }
    print("RESULT " + json.dumps(out, default=str), flush=True)


def _spawn(kind: str, args: argparse.Namespace, timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--params", str(args.params),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--max-host-bytes", str(args.max_host_bytes), "--swap-dir", args.swap_dir, "--lr", repr(args.lr),
           "--dtype", args.dtype, "--state-dtype", args.state_dtype]
    if args.master_dtype:
        cmd += ["--master-dtype", args.master_dtype]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} worker exited {proc.returncode} without a result")
    return json.loads(lines[-1][len("RESULT "):])


_ASKED = object()


def _plan(n: int, offload: str, args: argparse.Namespace, *, state_dtype: Any = _ASKED,
          master_dtype: Any = _ASKED):
    """The planner's figures (for ``args``' state/master dtypes unless given), with the
    state/master dtypes when it takes them (else float32 states: ``plan.state_aware`` says)."""
    import inspect

    from offload.plan import estimate

    sd = args.state_dtype if state_dtype is _ASKED else state_dtype
    md = args.master_dtype if master_dtype is _ASKED else master_dtype
    kw: Dict[str, Any] = {}
    aware = "state_dtype" in inspect.signature(estimate).parameters
    if aware:
        kw.update(state_dtype=sd, master_dtype=md)
    plan = estimate(n, offload=offload, param_dtype=getattr(torch, args.dtype), param_device="cpu",
                    host_memory=args.ram_budget,
                    max_host_bytes=args.max_host_bytes if offload == "nvme" else None, **kw)
    plan.state_aware = aware or (sd == "float32" and md != "bfloat16")
    return plan


def _disk_bytes_of(n: int, args: argparse.Namespace, sd: str, md: Optional[str]) -> Tuple[int, str]:
    """Bytes of swap files (two slots) for ``n`` params: the planner's NVMe bytes, or, while the
    planner does not take ``state_dtype``, two slots of the swapped fields (says which)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._states import states_bytes

    plan = _plan(n, "nvme", args, state_dtype=sd, master_dtype=md)
    if plan.state_aware:
        return int(plan.per_rank["nvme"]), "planner"
    master = 4 if args.dtype == "bfloat16" and md != "bfloat16" else 0  # an fp32 param is its own master
    return int(2 * n * (master + states_bytes(sd))), "fields (the planner does not take state_dtype yet)"


def _largest_fitting(args: argparse.Namespace, sd: str, md: Optional[str]) -> Tuple[int, int, int, str]:
    """(target count, num_params, disk bytes, source) of the largest TinyGPT config whose swap
    files fit in ``args.disk_bytes``: a bisection over the target count ``config_for_params`` takes."""
    from offload.demo.model import config_for_params

    def size(t: int) -> Tuple[int, int, str]:
        n = config_for_params(t, block_size=args.seq_len).num_params
        return (n, *_disk_bytes_of(n, args, sd, md))

    room = args.disk_bytes - _store_overhead()
    lo, hi = 10_000, max(20_000, int(args.disk_bytes))  # >= 1 byte per param on disk
    if size(lo)[1] > room:
        raise ValueError(f"--disk-bytes {args.disk_bytes}: not even the smallest TinyGPT fits")
    while hi - lo > max(1, lo // 1000):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid)[1] <= room else (lo, mid)
    return (lo, *size(lo))


def _store_overhead() -> int:
    """Bytes a swap store keeps beside its two slots, which the planner's NVMe figure leaves
    out: reserve.bin (room for the manifest on a full disk, at least 1 MiB: offload/swap/store.py)
    and a page each for the lock and the manifest."""
    try:
        from offload.swap.reserve import _RESERVE_MIN as reserve
    except ImportError:
        reserve = 1 << 20
    return reserve + 2 * 4096


def _disk_mode(args: argparse.Namespace) -> int:
    """The largest model per row on ``--disk-bytes`` of swap, trained; the ratio of the sizes."""
    from offload.plan.render import fmt_bytes

    rows = [("float32", None), (args.state_dtype, args.master_dtype)]
    out: Dict[str, Any] = {}
    print(f"e2e --disk-bytes {fmt_bytes(args.disk_bytes)} under {args.swap_dir}: the largest TinyGPT whose "
          f"swap files fit, {args.dtype} params, {args.steps} steps each")
    for sd, md in rows:
        key = f"{sd} states" + (f", {md} master" if md else "")
        target, n, disk, source = _largest_fitting(args, sd, md)
        row: Dict[str, Any] = {"params": n, "predicted_disk_bytes": disk, "predicted_by": source}
        if not args.no_train:
            sub = argparse.Namespace(**{**vars(args), "params": target, "state_dtype": sd, "master_dtype": md})
            res = _spawn("offload", sub, args.timeout)
            row.update({k: res[k] for k in ("skipped", "iter_s_median", "opt_step_s_median", "swap_bytes_on_disk",
                                             "peak_rss") if k in res})
            if "swap_bytes_on_disk" in row:
                row["fits_measured"] = row["swap_bytes_on_disk"] <= args.disk_bytes
        out[key] = row
    _print_disk_rows(args, out)
    return 0


def _print_disk_rows(args: argparse.Namespace, out: Dict[str, Any]) -> None:
    from offload.plan.render import fmt_bytes

    print(f"\n  {'row':<34}{'params':>14}{'disk (pred.)':>14}{'disk (meas.)':>16}{'iter s':>9}{'opt.step s':>11}")
    for key, r in out.items():
        meas = fmt_bytes(r["swap_bytes_on_disk"]) if "swap_bytes_on_disk" in r else "-"
        if "fits_measured" in r and not r["fits_measured"]:
            meas += " (OVER)"
        times = (f"{r['iter_s_median']:>9.2f}{r['opt_step_s_median']:>11.2f}" if "iter_s_median" in r
                 else f"  {r.get('skipped', 'not trained (--no-train)')}")
        print(f"  {key:<34}{r['params']:>14,}{fmt_bytes(r['predicted_disk_bytes']):>14}{meas:>16}{times}")
    print("  (disk pred.: the two slots as sized; meas.: every file in the swap directory, allocated blocks, "
          "reserve.bin included)")
    base, other = list(out.values())
    ratio = other["params"] / base["params"]
    trained = "iter_s_median" in base and "iter_s_median" in other
    target = (" (target >= 2.5x)" if (args.dtype, args.state_dtype, args.master_dtype)
              == ("bfloat16", "int8", "bfloat16") else "")
    print(f"  size ratio {ratio:.2f}x{target}; "
          + ("both trained" if trained else "sizes from " + other["predicted_by"] + ", not both trained"))
    for r in out.values():
        if r["predicted_by"] != "planner":
            print(f"  note: {r['params']:,}-param row sized from the {r['predicted_by']}")
    print(json.dumps({"bench": "e2e_disk", "dtype": args.dtype, "disk_bytes": args.disk_bytes, "steps": args.steps,
                      "rows": out, "params_ratio": ratio, "both_trained": trained}, default=str))


def _add_state_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16", "int8"), default="float32",
                    help="offload.AdamW's state_dtype")
    ap.add_argument("--master-dtype", choices=("float32", "bfloat16"), default=None,
                    help="offload.AdamW's master_dtype (bfloat16 needs --dtype bfloat16)")
    ap.add_argument("--disk-bytes", default=None,
                    help="instead: the largest model whose swap files fit in this many bytes ('free': the "
                         "swap directory's free space), fp32 states against --state-dtype/--master-dtype")
    ap.add_argument("--no-train", action="store_true", help="with --disk-bytes: the sizes only")


def _check_state_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalizes --master-dtype (float32 is None: an fp32 master) and --disk-bytes (bytes)."""
    import shutil

    from offload.config import parse_bytes

    if args.master_dtype == "float32":
        args.master_dtype = None  # the same thing: an fp32 master (fp32 params are their own)
    if args.master_dtype and args.dtype != "bfloat16":
        ap.error("--master-dtype bfloat16 needs --dtype bfloat16 (fp32 params are their own master)")
    if args.no_train and args.disk_bytes is None:
        ap.error("--no-train goes with --disk-bytes")
    if args.disk_bytes is not None and not args.worker:
        args.disk_bytes = (shutil.disk_usage(args.swap_dir).free if args.disk_bytes == "free"
                           else parse_bytes(args.disk_bytes))


def _print_skipped(args: argparse.Namespace, n: int, why: str) -> int:
    """A run that could not use the asked states: said, and no figure."""
    print(f"offload nvme with state_dtype={args.state_dtype!r}, master_dtype={args.master_dtype!r}: {why}")
    print(json.dumps({"bench": "e2e", "dtype": args.dtype, "state_dtype": args.state_dtype,
                      "master_dtype": args.master_dtype, "params": n, "skipped": why}))
    return 0


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
    _add_state_args(ap)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per contender")
    ap.add_argument("--worker", choices=("offload", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.swap_dir = args.swap_dir or default_swap_parent()
    _check_state_args(ap, args)
    if args.worker:
        _worker(args)
        return 0
    if args.disk_bytes is not None:
        try:
            return _disk_mode(args)
        except ValueError as exc:
            ap.error(str(exc))

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
          f"nvme {fmt_bytes(plan_nvme.per_rank['nvme'])}"
          + ("" if plan_nvme.state_aware else " (float32 states: the planner does not take state_dtype yet)"))

    ours = _spawn("offload", args, args.timeout)
    if "skipped" in ours:
        return _print_skipped(args, n, ours["skipped"])
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
        "bench": "e2e", "dtype": args.dtype, "state_dtype": args.state_dtype, "master_dtype": args.master_dtype,
        "params": n, "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
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
