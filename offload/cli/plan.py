"""``offload plan``: bytes per tier and a predicted optimizer step, before renting the machine.

Rates for the predicted step come, in order, from flags (``--kernel-gparams``,
``--disk-gbps``), from files benchmarks wrote (``--adam-bench``, ``--io-tune``), or from a
short probe on this machine (the kernel on 10M params, the disk in ``--swap-dir``) unless
``--no-probe``. The output says which.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any, Dict, Optional

from ._args import byte_size, checked, count, integer, rate

__all__ = ["add_parser", "run"]

log = logging.getLogger("offload.plan")


def _dtype(text: str) -> None:
    from offload.plan.inputs import parse_dtype
    parse_dtype(text)


def _optimizer(text: str) -> None:
    from offload.plan.states import OPTIMIZER_RULES
    if text.lower() not in OPTIMIZER_RULES:
        raise ValueError(f"unknown optimizer {text!r}; expected one of {', '.join(OPTIMIZER_RULES)}")


def _device(text: str) -> None:
    from offload.plan.estimate import _device_name
    _device_name(text)


def add_parser(subparsers: Any, name: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name,
        help="memory per tier and predicted step time for a model",
        description="Plan the bytes per rank on device, pinned host, pageable host and NVMe for "
                    "training a model with offload.AdamW, and predict its optimizer step.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=count(), help="parameter count, e.g. 125M, 7.5B, 1e9 (decimal units)")
    src.add_argument("--model-config", metavar="CONFIG_JSON",
                     help="Hugging Face config.json (or its directory), read locally")
    p.add_argument("--world-size", type=integer(1), default=1, help="data-parallel ranks N_d (default 1)")
    p.add_argument("--stage", type=integer(0, 3), default=0,
                   help="ZeRO stage 0, 1, 2 or 3 (3: params partitioned, offload.shard) (default 0)")
    p.add_argument("--offload", default="none", choices=("none", "cpu", "nvme"),
                   help="where the optimizer states live: none, cpu or nvme (default none)")
    p.add_argument("--offload-params", default="none", choices=("none", "cpu", "nvme"),
                   help="stage 3: where this rank's param shards live: none (with the compute), cpu or nvme")
    p.add_argument("--unit-params", type=count(1),
                   help="stage 3: params per fetch unit (default: one unit per layer with --model-config, "
                        "else 32 units)")
    p.add_argument("--max-live-params", type=count(1), help="stage 3: bound on the gathered params (live window)")
    p.add_argument("--max-live-bytes", type=byte_size(minimum=1), help="stage 3: the same bound in bytes")
    p.add_argument("--prefetch", type=integer(0), default=None, help="stage 3: units gathered ahead (default 1)")
    p.add_argument("--release-grads", action="store_true",
                   help="stages 0-2, device params: free each grad on the device once copied to the host "
                        "(ZeRO-Offload's footprint; p.grad is then not readable after backward)")
    p.add_argument("--zero-table", action="store_true",
                   help="print the ZeRO paper's table (baseline, P_os, P_os+g, P_os+g+p) for --params, "
                        "--world-size and --k, and nothing else")
    p.add_argument("--k", type=integer(0), default=12,
                   help="K of --zero-table: optimizer bytes per param (default 12, mixed-precision Adam)")
    p.add_argument("--param-dtype", default="bf16", type=checked(_dtype, "dtype"), help="fp32, bf16 or fp16 (default bf16)")
    p.add_argument("--grad-dtype", default=None, type=checked(_dtype, "dtype"), help="default: the param dtype")
    p.add_argument("--optimizer", default="adamw", type=checked(_optimizer, "optimizer"),
                   help="adam, adamw, sgd (with momentum: a momentum_buffer), sgd_plain (without momentum: no "
                        "state), adagrad or lion (default adamw)")
    p.add_argument("--amsgrad", action="store_true",
                   help="Adam's amsgrad=True (in any param group: the flat and swapped stores keep it for "
                        "every param): a third fp32 state per param (max_exp_avg_sq), K 16 instead of 12")
    p.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                   help="how the optimizer states are stored (the optimizers' state_dtype; default float32)")
    p.add_argument("--master-dtype", default=None, choices=("float32", "bfloat16"),
                   help="bfloat16: bf16 params are their own master, no fp32 copy (default: an fp32 master)")
    p.add_argument("--param-device", default="cuda", type=checked(_device, "device"), help="where the params live: cuda or cpu (default cuda)")
    p.add_argument("--device-memory", type=byte_size(auto=True), help="memory per accelerator, e.g. 80GiB, or 'auto' (this machine's GPU 0)")
    p.add_argument("--host-memory", type=byte_size(auto=True), help="host memory per node, e.g. 512GiB, or 'auto' (this machine's MemTotal)")
    p.add_argument("--ranks-per-node", type=integer(1), default=None, help="ranks sharing a node (default min(N_d, 8))")
    p.add_argument("--max-host-bytes", type=byte_size(minimum=1), help="bound on the swap pipeline's host buffers (default 1GiB)")
    p.add_argument("--sub-group-size", type=integer(1), default=None, help="elements per swapped sub-group")
    p.add_argument("--swap-dir", help="swap directory: its free space is the NVMe capacity, and the disk probe runs there")
    p.add_argument("--nvme-capacity", type=byte_size(), help="NVMe bytes available per node (default: free space of --swap-dir)")
    p.add_argument("--disk-gbps", type=rate(), help="disk rate in GB/s (10^9 B/s) for reads and writes")
    p.add_argument("--disk-read-gbps", type=rate(), help="disk read rate in GB/s")
    p.add_argument("--disk-write-gbps", type=rate(), help="disk write rate in GB/s")
    p.add_argument("--io-tune", metavar="FILE", help="file written by `offload bench-io --tune` (disk rates)")
    p.add_argument("--kernel-gparams", type=rate(),
                   help="CPU Adam rate in 10^9 params/s, of the kernel with the --state-dtype planned (the probe "
                        "measures that one: compressed states' kernel is slower than the fp32 one)")
    p.add_argument("--adam-bench", metavar="FILE", help="bench/adam.py output (kernel rate)")
    p.add_argument("--no-probe", action="store_true", help="never run the short kernel/disk probes")
    p.add_argument("--cheapest", action="store_true",
                   help="also search stage and offload for the cheapest configuration that fits")
    p.add_argument("--explain", action="store_true", help="print the formulas behind the numbers")
    p.add_argument("--json", action="store_true", help="print one JSON object (bytes, not GiB)")
    p.set_defaults(run=run)
    return p


def _rates(args: argparse.Namespace, need_kernel: bool, need_disk: bool) -> Dict[str, Any]:
    """Resolve kernel and disk rates: flags, then files, then probes."""
    from offload.plan import disk_rate_from_tune, kernel_rate_from_bench, probe_disk_rate, probe_kernel_rate
    from offload.plan.rates import Rate

    out: Dict[str, Optional[Rate]] = {"kernel": None, "disk_read": None, "disk_write": None}
    if args.kernel_gparams is not None:
        out["kernel"] = Rate(args.kernel_gparams, "Gparam/s", "--kernel-gparams")
    elif args.adam_bench:
        out["kernel"] = kernel_rate_from_bench(args.adam_bench)
    elif need_kernel and not args.no_probe:
        out["kernel"] = probe_kernel_rate(state_dtype=args.state_dtype)

    if args.disk_gbps is not None:
        out["disk_read"] = out["disk_write"] = Rate(args.disk_gbps, "GB/s", "--disk-gbps")
    if args.disk_read_gbps is not None:
        out["disk_read"] = Rate(args.disk_read_gbps, "GB/s", "--disk-read-gbps")
    if args.disk_write_gbps is not None:
        out["disk_write"] = Rate(args.disk_write_gbps, "GB/s", "--disk-write-gbps")
    if (out["disk_read"] is None or out["disk_write"] is None) and args.io_tune:
        r, w = disk_rate_from_tune(args.io_tune)
        out["disk_read"] = out["disk_read"] or r
        out["disk_write"] = out["disk_write"] or w
    if need_disk and (out["disk_read"] is None or out["disk_write"] is None) and args.swap_dir and not args.no_probe:
        try:
            r, w = probe_disk_rate(args.swap_dir)
        except RuntimeError as exc:  # no io layer: plan the bytes anyway, say why no step time
            log.warning("disk probe skipped: %s", exc)
        else:
            out["disk_read"] = out["disk_read"] or r
            out["disk_write"] = out["disk_write"] or w
    return out


def _auto_memory(flag: str, value: "int | str | None") -> "int | str | None":
    """``auto``: this machine's capacity (GPU 0's memory, or MemTotal from /proc/meminfo)."""
    if value is None or str(value).lower() != "auto":
        return value
    if flag == "device":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device-memory auto: torch sees no CUDA device on this machine; give a size")
        return str(torch.cuda.get_device_properties(0).total_memory)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return str(int(line.split()[1]) * 1024)
    except OSError as exc:
        raise OSError(exc.errno, f"--host-memory auto: cannot read MemTotal ({exc.strerror})", "/proc/meminfo") from None
    raise ValueError("--host-memory auto: no MemTotal line in /proc/meminfo; give a size")


def _plan_kwargs(args: argparse.Namespace, rates: Dict[str, Any]) -> Dict[str, Any]:
    return dict(
        world_size=args.world_size,
        param_dtype=args.param_dtype,
        grad_dtype=args.grad_dtype,
        optimizer=args.optimizer,
        amsgrad=args.amsgrad,
        state_dtype=args.state_dtype,
        master_dtype=args.master_dtype,
        param_device=args.param_device,
        device_memory=_auto_memory("device", args.device_memory),
        host_memory=_auto_memory("host", args.host_memory),
        ranks_per_node=args.ranks_per_node,
        max_host_bytes=args.max_host_bytes,
        sub_group_size=args.sub_group_size,
        swap_dir=args.swap_dir,
        nvme_capacity=args.nvme_capacity,
        kernel_gparams=rates["kernel"].value if rates["kernel"] else None,
        disk_read_gbps=rates["disk_read"].value if rates["disk_read"] else None,
        disk_write_gbps=rates["disk_write"].value if rates["disk_write"] else None,
        release_grads=args.release_grads,
    )


def _stage3_kwargs(args: argparse.Namespace) -> Dict[str, Any]:
    """The stage-3 options (refused by ``estimate`` at stages 0-2); a model config's units
    are one per decoder layer plus the root unit."""
    units: Any = args.unit_params
    if units is None and args.model_config is not None and args.stage == 3:
        from offload.plan import unit_sizes_from_hf_config
        units = unit_sizes_from_hf_config(args.model_config)
    return dict(offload_params=args.offload_params, unit_params=units, max_live_params=args.max_live_params,
                max_live_bytes=args.max_live_bytes, prefetch=args.prefetch)


def _zero_table(args: argparse.Namespace) -> int:
    from offload.plan import format_zero_table, params_from_hf_config, zero_table

    n = args.params if args.params is not None else params_from_hf_config(args.model_config)
    if args.json:
        print(json.dumps({"schema": "offload.zero_table/1", "num_params": n, "world_size": args.world_size,
                          "k": args.k, "rows": zero_table(n, args.world_size, args.k)}, indent=2, sort_keys=True))
    else:
        print(format_zero_table(n, args.world_size, args.k))
    return 0


def _json_safe(obj: Any) -> Any:
    """``obj`` with every string JSON can carry: a path of bytes that are not UTF-8
    (``--swap-dir $'/tmp/sw\\xff'``) is a string with lone surrogates ("\\udcff"), which
    json.dumps wrote as such, and strict readers (jq, Go, Rust) refuse or mangle. Such a
    string is written with its undecodable bytes as ``\\xff`` (os.fsencode, then
    backslashreplace: what ``ls -b`` shows), readable and valid UTF-8."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            try:
                return os.fsencode(obj).decode("utf-8", "backslashreplace")
            except UnicodeError:  # a surrogate no file name decodes to
                return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    return obj


def run(args: argparse.Namespace) -> int:
    from ._signals import sigterm_raises

    with sigterm_raises():  # SIGTERM removes the disk probe's file (256 MiB in --swap-dir), as Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from offload.plan import cheapest_fitting, estimate
    from offload.plan.inputs import swap_dir_path
    from offload.plan.render import gib

    if args.zero_table:
        return _zero_table(args)
    source = args.params if args.params is not None else args.model_config
    if args.model_config is not None:
        # A config path must never be mistaken for a count; resolve it here.
        from offload.plan import params_from_hf_config
        source = params_from_hf_config(args.model_config)
    swap_dir_path(args.swap_dir)  # a file or a missing directory refused before any probe
    need_kernel = True  # this engine runs the update on the CPU whatever the offload target
    need_disk = args.offload == "nvme" or args.offload_params == "nvme" or args.cheapest
    rates = _rates(args, need_kernel, need_disk)
    kw = _plan_kwargs(args, rates)
    plan = estimate(source, stage=args.stage, offload=args.offload, **kw, **_stage3_kwargs(args))
    if args.model_config is not None:
        plan.inputs["source"] = f"{args.model_config} ({plan.inputs['num_params']:,} params)"

    best = None
    tried = []
    if args.cheapest:
        best, tried = cheapest_fitting(source, **kw)

    if args.json:
        doc = plan.to_dict()
        doc["rates"] = {k: (None if r is None else {"value": r.value, "unit": r.unit, "source": r.source})
                        for k, r in rates.items()}
        doc["cheapest"] = None
        if args.cheapest:
            doc["cheapest"] = {
                "found": best is not None,
                "stage": best.inputs["stage"] if best else None,
                "offload": best.inputs["offload"] if best else None,
                "per_rank": best.per_rank if best else None,
                "step_time_s": best.step_time_s if best else None,
                "candidates": [
                    {"stage": c.inputs["stage"], "offload": c.inputs["offload"], "fits": c.fits,
                     "fits_all": c.fits_all, "per_rank": c.per_rank, "step_time_s": c.step_time_s}
                    for c in tried
                ],
            }
        print(json.dumps(_json_safe(doc), indent=2, sort_keys=True))
        return 0

    print(plan.table())
    for k, r in rates.items():
        if r is not None:
            print(f"rate {k}: {r.value:.3f} {r.unit} ({r.source})")
    if args.cheapest:
        print("configurations, cheapest first (host memory before disk, then step time, bytes, higher stage):")
        for c in tried:
            mark = "fits" if c.fits_all else "does not fit"
            t = c.step_time_s
            print(f"  stage {c.inputs['stage']} offload={c.inputs['offload']:<5} device {gib(c.per_rank['device'])} "
                  f"host {gib(c.host_bytes)} nvme {gib(c.per_rank['nvme'])} GiB"
                  + (f", step {t * 1e3:.0f} ms" if t is not None else "") + f": {mark}")
        if best is None:
            print("  nothing fits: more ranks, more host memory or a bigger disk are needed")
        else:
            print(f"  -> stage {best.inputs['stage']}, offload={best.inputs['offload']}")
    elif plan.supported and not plan.fits_all:
        print("this configuration does not fit: --cheapest searches stage and offload for the cheapest one that does")
    if args.explain:
        print()
        print(plan.explain())
    return 0
