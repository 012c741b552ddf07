"""How fast could the compressed-state kernels be? Each AdamW kernel's compute floor beside its
in-memory speed, and the ratio to the fp32 kernel that the floor allows.

    .venv/bin/python bench/kernel_floor.py                       # N = 100M, 1 and 2 threads
    .venv/bin/python bench/kernel_floor.py --size 20M --threads 1 --backend native

#15 asks the int8 and bf16 state kernels for >= 1.2x the fp32 kernel's Gparam/s at N = 100M,
because they move fewer bytes (16 and 20 B/param against 28). Fewer bytes only pay while the
fp32 kernel waits on memory. This bench separates the two costs, per state dtype, in one run:

- **floor**: ns per element on a cache-resident slice (``--cache-size``, default 128K
  elements: ~3.5 MB of fp32 param, grad and states, L2/L3) on one thread, the per-call
  overhead (a call on 256 elements) subtracted; the best of ``--reps`` rounds, as the least
  disturbed. At T threads the floor is that over T (perfect scaling: a slice this small does
  not split well across threads, so it is not measured on T). No kernel can step a large N
  faster than this: the arithmetic, decode and encode are all still there, and only the
  memory stalls are gone.
- **in memory**: ns per element at ``--size``, the contenders interleaved step by step (median),
  as bench/adam.py times them.
- **ceiling vs fp32** = the fp32 kernel's in-memory time / the row's floor: the most this row's
  Gparam/s can be over the fp32 kernel's at this N on this machine, however the memory traffic
  is overlapped. A ceiling under a target means the target needs less arithmetic, not fewer
  bytes. The float32 row's own ceiling is that of any kernel doing Adam's arithmetic and
  nothing more: a compressed-state kernel whose decode and encode cost nothing.

fp32 params (their own master), AdamW, the hyperparameters of bench/adam.py. Prints a table,
then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.adam import (Buffers, StateBuffers, _state_step, adam_rule, cpu_model, parse_size,  # noqa: E402
                        time_interleaved)
from offload.kernels import registry  # noqa: E402

DTYPES = ("float32", "bfloat16", "int8")


def stepper(backend, n: int, threads: int):
    """state dtype -> one AdamW step over ``n`` elements (shared param and grad)."""
    buf = Buffers(n)
    sbuf = StateBuffers(buf, DTYPES, False)
    return {sd: _state_step(backend, adam_rule(sd), buf.param.data, buf.param.grad, sbuf.states[sd],
                            None, threads, True) for sd in DTYPES}


def best_per_call(fn, calls: int, reps: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def floors(backend, cache_n: int, reps: int) -> dict:
    """state dtype -> compute floor on one thread, ns/element (the per-call overhead taken off)."""
    tiny, cached = stepper(backend, 256, 1), stepper(backend, cache_n, 1)
    out = {}
    for sd in DTYPES:
        overhead = best_per_call(tiny[sd], 400, reps)
        out[sd] = max(0.0, best_per_call(cached[sd], 100, reps) - overhead) / cache_n * 1e9
    return out


def in_memory(backend, n: int, threads: int, warmup: int, steps: int) -> dict:
    """state dtype -> median ns/element at ``n``, the rows interleaved (bench/adam.py's timing)."""
    median, _ = time_interleaved(stepper(backend, n, threads), warmup, steps)
    return {sd: t / n * 1e9 for sd, t in median.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="100M", help="in-memory param count")
    ap.add_argument("--cache-size", default="128K", help="cache-resident param count of the floor")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--backend", default="native", choices=("native", "numba"))
    ap.add_argument("--steps", type=int, default=7, help="timed in-memory steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="rounds of the floor (best taken)")
    args = ap.parse_args(argv)
    n, cache_n = parse_size(args.size), parse_size(args.cache_size)
    thread_counts = [int(t) for t in args.threads.split(",") if t.strip()]
    if n < 1 or cache_n < 256 or not thread_counts or min(thread_counts) < 1:
        ap.error("--size >= 1, --cache-size >= 256 and --threads of counts >= 1")
    backend = registry.get_backend(args.backend)
    results = []
    print(f"AdamW, fp32 params, {args.backend} kernels; floor at {cache_n:,} elements, in memory at {n:,}")
    print(f"{'thr':>3} {'states':9} {'floor ns/el':>11} {'in-mem ns/el':>12} {'stalled':>8} "
          f"{'vs fp32':>8} {'ceiling vs fp32':>15}")
    torch.set_num_threads(1)
    floor1 = floors(backend, cache_n, args.reps)
    for threads in thread_counts:
        torch.set_num_threads(threads)
        floor = {sd: f / threads for sd, f in floor1.items()}
        mem = in_memory(backend, n, threads, args.warmup, args.steps)
        for sd in DTYPES:
            row = {"threads": threads, "state_dtype": sd, "floor_ns": floor[sd], "in_memory_ns": mem[sd],
                   "ratio_vs_fp32": mem["float32"] / mem[sd],
                   "ceiling_vs_fp32": mem["float32"] / floor[sd] if floor[sd] else float("inf")}
            results.append(row)
            stalled = 1 - floor[sd] / mem[sd]  # share of the in-memory time spent waiting on memory
            print(f"{threads:>3} {sd:9} {floor[sd]:11.3f} {mem[sd]:12.3f} {stalled:8.0%} "
                  f"{row['ratio_vs_fp32']:7.2f}x {row['ceiling_vs_fp32']:14.2f}x")
    print(json.dumps({"bench": "kernel_floor", "cpu": cpu_model(),
                      "torch": torch.__version__, "backend": args.backend, "size": n, "cache_size": cache_n,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
