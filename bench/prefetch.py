"""Does software prefetch pay on this CPU? The native kernels with it forced on and off.

    .venv/bin/python bench/prefetch.py                     # N = 100M, 1 and 2 threads
    .venv/bin/python bench/prefetch.py --size 25M --threads 1 --rounds 9
    .venv/bin/python bench/prefetch.py --quick             # a smoke run

The native loops issue software prefetches where the step asks ([Note: software prefetch] in
native/kernel.h); by default only on Intel CPUs, where they were measured to help, and not
on others (an AMD EPYC, Zen 4, lost 15-30 % of fp32 AdamW's speed to them). This bench holds
a new CPU to that choice: the same step, the same tensors, ``OFFLOAD_PREFETCH=on`` and
``off`` alternated call by call in one process (so the machine's drift hits both alike),
for fp32 AdamW, AdamW over bf16 moments (the fused loop) and SGD with momentum. Prints the
median of each and on/off (< 1: prefetch faster), then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from offload.kernels import get_backend  # noqa: E402
from offload.kernels.fields import ADAM, SGD  # noqa: E402
from offload.kernels.quant import rounding_seed  # noqa: E402
from offload.plan.inputs import parse_count  # noqa: E402

ADAMW = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def _cases(n: int) -> Dict[str, tuple]:
    """name -> (rule, param, grad, states, extra keywords); each case has its own tensors."""
    gen = torch.Generator().manual_seed(0)

    def vec(dtype=torch.float32, scale=1.0):
        return (torch.randn(n, generator=gen) * scale).to(dtype)

    bf16 = ADAM.with_state_dtype("bfloat16")
    return {
        "adamw_fp32": (ADAM, vec(), vec(scale=1e-3), {"exp_avg": vec(scale=1e-3), "exp_avg_sq": vec().abs() * 1e-6},
                       ADAMW),
        "adamw_bf16_states": (bf16, vec(), vec(scale=1e-3),
                              {"exp_avg": vec(torch.bfloat16, 1e-3), "exp_avg_sq": vec(torch.bfloat16).abs() * 1e-6},
                              dict(ADAMW, rounding_seed=rounding_seed(5, 0), stochastic_states=True)),
        "sgd_momentum": (SGD, vec(), vec(scale=1e-3), {"momentum_buffer": vec(scale=1e-3)},
                         dict(lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False)),
    }


def run(n: int, threads: List[int], rounds: int) -> List[dict]:
    native = get_backend("native")
    rows = []
    for case, (rule, p, g, states, kw) in _cases(n).items():
        for t in threads:
            times: Dict[str, List[float]] = {"on": [], "off": []}
            for r in range(rounds + 1):  # round 0 warms both up
                for mode in ("on", "off") if r % 2 else ("off", "on"):
                    os.environ["OFFLOAD_PREFETCH"] = mode
                    t0 = time.perf_counter()
                    native.rule_step(rule, p, g, states, step=5, num_threads=t, **kw)
                    if r:
                        times[mode].append(time.perf_counter() - t0)
            on, off = statistics.median(times["on"]), statistics.median(times["off"])
            rows.append({"case": case, "threads": t, "on_ms": on * 1e3, "off_ms": off * 1e3, "on_over_off": on / off})
    os.environ.pop("OFFLOAD_PREFETCH", None)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="100M", help="elements per tensor (e.g. 25M)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=9, help="timed calls of each mode (median taken)")
    ap.add_argument("--quick", action="store_true", help="N = 1M, 1 thread, 3 rounds")
    args = ap.parse_args(argv)
    try:
        n, threads = parse_count(args.size), [int(x) for x in args.threads.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if n < 1 or args.rounds < 1 or any(t < 1 for t in threads):
        ap.error("--size, --rounds and each of --threads must be >= 1")
    rounds = args.rounds
    if args.quick:
        n, threads, rounds = 1 << 20, [1], 3
    try:
        get_backend("native")
    except RuntimeError as exc:
        print(f"the native backend is not available: {exc}", file=sys.stderr)
        return 2
    rows = run(n, threads, rounds)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown") if os.path.exists("/proc/cpuinfo") else "unknown"
    print(f"{'case':20s} {'thr':>3s} {'prefetch on':>12s} {'off':>10s} {'on/off':>7s}   ({cpu}, N = {n:,})")
    for r in rows:
        print(f"{r['case']:20s} {r['threads']:3d} {r['on_ms']:9.2f} ms {r['off_ms']:7.2f} ms {r['on_over_off']:7.3f}")
    print("on/off < 1: prefetch faster on this CPU")
    print(json.dumps({"bench": "prefetch", "cpu": cpu, "n": n, "rounds": rounds, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
