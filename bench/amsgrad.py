"""AMSGrad (AdamW with amsgrad=True) on the CPU: ours against torch, side by side.

    .venv/bin/python bench/amsgrad.py                   # N = 10M and 100M, 1 and 2 threads
    .venv/bin/python bench/amsgrad.py --sizes 10M --threads 1 --steps 5

Contenders, interleaved in a fresh random order every step after a warm-up, sharing one set
of buffers (bench/adam.py's method and its pitfalls): ours native and numba
(``rule_step(ADAM_AMSGRAD)``), torch.optim.AdamW(amsgrad=True) foreach and fused=True (its
fastest CPU paths; DeepSpeed's CPU Adam has no amsgrad), our plain AdamW kernel (what the
third state costs), and the copy probe (the memory wall, 12 B per element). Effective GB/s at
36 B/param for AMSGrad (5 fp32 reads: param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq; 4
writes) and 28 for plain Adam. Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.adam import BETAS, EPS, LR, WD, Buffers, parse_size, time_interleaved  # noqa: E402
from offload.cli.info import cpu_model  # noqa: E402
from offload.kernels import get_backend  # noqa: E402
from offload.kernels.fields import ADAM, ADAM_AMSGRAD  # noqa: E402

AMSGRAD_BYTES, ADAM_BYTES = 36, 28
HYPER = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True)


def contenders(buf: Buffers, vmax: torch.Tensor, threads: int) -> dict:
    p, g, m, v = buf.param.data, buf.param.grad, buf.exp_avg, buf.exp_avg_sq
    steps = {}

    def ours(backend, rule):
        key = (backend.name, rule.name)
        steps[key] = 0
        states = {"exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax}
        states = {k: states[k] for k in rule.names}

        def run():
            steps[key] += 1
            backend.rule_step(rule, p, g, states, step=steps[key], num_threads=threads, **HYPER)
        return run

    out = {"ours_native": ours(get_backend("native"), ADAM_AMSGRAD),
           "ours_numba": ours(get_backend("numba"), ADAM_AMSGRAD),
           "ours_adam_only": ours(get_backend("native"), ADAM)}
    for kind in ("foreach", "fused"):
        opt = torch.optim.AdamW([buf.param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                amsgrad=True, **{kind: True})
        opt.state[buf.param] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v,
                                "max_exp_avg_sq": vmax}
        out[f"torch_{kind}"] = opt.step
    out["copy_probe"] = lambda: buf.copy_dst.copy_(p)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10M,100M", help="comma-separated param counts")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--steps", type=int, default=7, help="timed steps (median taken)")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"cpu: {cpu_model()}; torch {torch.__version__}; ISA {get_backend('native').isa()}")
    print(f"\n{'N':>6} {'thr':>3} {'contender':<15} {'ms/step':>9} {'GB/s':>7} {'of copy':>8} "
          f"{'vs native':>9} {'best ms':>9}")
    results = []
    for n in sizes:
        buf = Buffers(n)
        vmax = torch.full((n,), 0.01)
        for th in threads:
            torch.set_num_threads(th)
            med, best = time_interleaved(contenders(buf, vmax, th), args.warmup, args.steps)
            copy_gbps = 12 * n / med["copy_probe"] / 1e9
            base = med["ours_native"]
            for name, t in med.items():
                if name == "copy_probe":
                    print(f"{n / 1e6:>5.0f}M {th:>3} {'copy (12 B/el)':<15} {t * 1e3:>9.2f} "
                          f"{copy_gbps:>7.1f} {'(wall)':>8}")
                    continue
                gbps = (ADAM_BYTES if name == "ours_adam_only" else AMSGRAD_BYTES) * n / t / 1e9
                print(f"{n / 1e6:>5.0f}M {th:>3} {name:<15} {t * 1e3:>9.2f} {gbps:>7.1f} "
                      f"{gbps / copy_gbps:>7.0%} {t / base:>8.2f}x {best[name] * 1e3:>9.2f}")
            results.append({"n": n, "threads": th, "seconds": med, "best_seconds": best,
                            "copy_GBps": copy_gbps})
        del buf, vmax
    print(json.dumps({"bench": "amsgrad", "cpu": cpu_model(), "torch": torch.__version__,
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
