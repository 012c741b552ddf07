"""CPU Adam kernels side by side: ours (native, numba) against torch and DeepSpeed.

    .venv/bin/python bench/adam.py                  # N = 10M and 100M, 1 and 2 threads
    .venv/bin/python bench/adam.py --quick          # N = 4M, 5 steps: a smoke run
    .venv/bin/python bench/adam.py --rules --sizes 10M   # SGD, Adagrad, Lion instead

Two contests, each timed in one process with the contenders interleaved step by step (in
a fresh random order each step) after a warm-up, sharing one set of buffers, so no contender pays
another's page faults (see MEASURED.md, "Benchmarking pitfall"); the figure is the median
step time.

1. Plain fp32 AdamW step: ours native / numba, torch.optim.AdamW foreach and fused=True,
   DeepSpeedCPUAdam when importable, and a memory-bandwidth probe (a streaming copy,
   counted as 12 B/element: read, write-allocate read, write). Gparam/s, effective GB/s at
   28 B/param (4 reads + 3 writes of fp32), and ratios. The fastest step of each contender
   is printed too: on a shared machine it is the steadier estimate of what the hardware
   allows, while the median (the official figure) absorbs other jobs' interference.
2. Mixed-precision step (loss-scaled grads, unscale + global-norm clip + AdamW + bf16 copy
   of the params): ours = grad_sumsq, then one adam_step with grad_scale = clip/scale and
   param_lowp; torch = clip_grad_norm_ (foreach), fused AdamW with grad_scale/found_inf,
   then bf16 copy_.

3. ``--rules`` (instead of 1 and 2): SGD (momentum 0.9, weight decay), Adagrad and Lion,
   ours native against torch's fastest CPU code of each: SGD and Adagrad foreach and
   fused=True, Lion (no torch optimizer) a foreach-style loop of torch ops as lion-pytorch
   writes it. Effective GB/s at 20 B/param (3 fp32 reads + 2 writes: param, grad, the one
   state; counted as the 28 B of Adam are).

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload.cli.info import cpu_model  # noqa: E402
from offload.kernels import get_backend  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LOSS_SCALE = 1024.0
BYTES_PER_PARAM = 28


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)




def load_deepspeed():
    """DeepSpeedCPUAdam class, or (None, reason)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam, None
    except Exception as exc:  # not installed, or its op failed to build
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


class Buffers:
    """One set of fp32 param/grad/moments shared by every contender (no duplicate RAM)."""

    def __init__(self, n: int):
        self.n = n
        self.param = torch.nn.Parameter(torch.randn(n) * 0.1)
        self.param.grad = torch.randn(n) * 1e-2
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self.lowp = torch.empty(n, dtype=torch.bfloat16)
        self.copy_dst = torch.empty(n)
        for t in (self.exp_avg, self.exp_avg_sq, self.copy_dst):
            t.fill_(0.01)  # touch every page now, not during the first timed step
        self.lowp.fill_(0)
        self.step = 0

    def torch_optim(self, **kw):
        opt = torch.optim.AdamW([self.param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
        # share our moments: torch reads exp_avg/exp_avg_sq from its state dict
        opt.state[self.param] = {"step": torch.tensor(0.0), "exp_avg": self.exp_avg,
                                 "exp_avg_sq": self.exp_avg_sq}
        return opt


def plain_contenders(buf: Buffers, threads: int, ds_cls):
    p, g, m, v = buf.param.data, buf.param.grad, buf.exp_avg, buf.exp_avg_sq
    native, numba = get_backend("native"), get_backend("numba")
    counter = {"native": 0, "numba": 0}

    def ours(backend):
        def run():
            counter[backend.name] += 1
            backend.adam_step(p, g, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                              weight_decay=WD, step=counter[backend.name], decoupled=True,
                              num_threads=threads)
        return run

    out = {"ours_native": ours(native), "ours_numba": ours(numba)}
    foreach = buf.torch_optim(foreach=True)
    fused = buf.torch_optim(fused=True)
    out["torch_foreach"] = foreach.step
    out["torch_fused"] = fused.step
    if ds_cls is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            ds = ds_cls([buf.param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        adamw_mode=True)
        ds.state[buf.param] = {"step": 0, "exp_avg": m, "exp_avg_sq": v}
        out["deepspeed"] = ds.step
    dst = buf.copy_dst
    out["copy_probe"] = lambda: dst.copy_(p)
    return out


def mixed_contenders(buf: Buffers, threads: int):
    """Loss-scaled fp32 grads -> unscale, global-norm clip, AdamW, bf16 param copy."""
    p, g, m, v, lowp = buf.param.data, buf.param.grad, buf.exp_avg, buf.exp_avg_sq, buf.lowp
    native = get_backend("native")
    max_norm = 1e9  # never clips: grads stay unchanged step after step (no denormal drift)
    counter = [0]

    def ours():
        counter[0] += 1
        sumsq, nonfinite = native.grad_sumsq(g, num_threads=threads)
        if nonfinite:
            return  # overflow: skip the step, as GradScaler does
        norm = math.sqrt(sumsq) / LOSS_SCALE
        clip = min(1.0, max_norm / (norm + 1e-6))
        native.adam_step(p, g, m, v, lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                         weight_decay=WD, step=counter[0], decoupled=True,
                         grad_scale=clip / LOSS_SCALE, param_lowp=lowp, num_threads=threads)

    opt = buf.torch_optim(fused=True)
    opt.grad_scale = torch.tensor(LOSS_SCALE)  # what GradScaler hands a fused optimizer
    opt.found_inf = torch.tensor(0.0)

    def torch_seq():
        total = torch.nn.utils.clip_grad_norm_([buf.param], max_norm * LOSS_SCALE, foreach=True)
        opt.found_inf.fill_(float(not torch.isfinite(total)))
        opt.step()
        lowp.copy_(p)

    return {"ours_fused": ours, "torch_sequence": torch_seq}


RULE_BYTES = 20
RULE_HP = {"sgd": dict(lr=1e-2, momentum=0.9, weight_decay=1e-4),
           "adagrad": dict(lr=1e-2, weight_decay=1e-4),
           "lion": dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)}
RULE_STATE = {"sgd": "momentum_buffer", "adagrad": "sum", "lion": "exp_avg"}


def rule_contenders(buf: Buffers, rule: str, threads: int):
    """Ours native against torch's fastest CPU step of ``rule``, sharing param and state."""
    p, g, state = buf.param.data, buf.param.grad, buf.exp_avg
    hp = RULE_HP[rule]
    native = get_backend("native")
    counter = [0]

    def ours():
        counter[0] += 1
        native.rule_step(rule, p, g, {RULE_STATE[rule]: state}, step=counter[0],
                         num_threads=threads, **hp)

    out = {"ours_native": ours}
    if rule == "lion":
        lr, b1, b2, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["weight_decay"]

        def torch_lion():  # lion-pytorch's update_fn over a list, with torch's foreach ops
            ps, ms, gs = [p], [state], [g]
            torch._foreach_mul_(ps, 1 - lr * wd)
            update = torch._foreach_lerp([m.clone() for m in ms], gs, 1 - b1)
            torch._foreach_sign_(update)
            torch._foreach_add_(ps, update, alpha=-lr)
            torch._foreach_lerp_(ms, gs, 1 - b2)
        out["torch_foreach"] = torch_lion
        return out
    cls = torch.optim.SGD if rule == "sgd" else torch.optim.Adagrad
    for kind in ("foreach", "fused"):
        opt = cls([buf.param], **{kind: True}, **hp)
        opt.state[buf.param] = {RULE_STATE[rule]: state}
        if rule == "adagrad":
            opt.state[buf.param]["step"] = torch.tensor(0.0)
        out[f"torch_{kind}"] = opt.step
    return out


def run_rules(sizes, thread_list, warmup: int, steps: int) -> list:
    results = []
    print(f"\n{'N':>6} {'thr':>3} {'rule':<8} {'contender':<14} {'ms/step':>9} "
          f"{'GB/s@20B':>9} {'vs native':>9} {'best ms':>9}")
    for n in sizes:
        buf = Buffers(n)
        for th in thread_list:
            torch.set_num_threads(th)
            for rule in RULE_HP:
                buf.exp_avg.fill_(0.01)  # a valid state for every rule (Adagrad's sum >= 0)
                med, best = time_interleaved(rule_contenders(buf, rule, th), warmup, steps)
                base = med["ours_native"]
                for name, t in med.items():
                    print(f"{n / 1e6:>5.0f}M {th:>3} {rule:<8} {name:<14} {t * 1e3:>9.2f} "
                          f"{RULE_BYTES * n / t / 1e9:>9.1f} {t / base:>8.2f}x "
                          f"{best[name] * 1e3:>9.2f}")
                results.append({"n": n, "threads": th, "kind": rule, "seconds": med,
                                "best_seconds": best,
                                "GBps": {k: RULE_BYTES * n / t / 1e9 for k, t in med.items()}})
        del buf
    return results


def time_interleaved(contenders, warmup: int, steps: int):
    """Median and fastest step of each contender, run in a fresh random order every step.

    A rotation would keep the cyclic order, so a contender would always follow the same
    neighbour; after one of torch's OpenMP regions the pool's threads keep spinning for a
    few ms (libgomp's default wait policy) and slow whatever runs next on their cores: a
    fixed neighbour turned that into a 2x bias against one contender here. A seeded shuffle
    spreads it evenly."""
    names = list(contenders)
    times = {k: [] for k in names}
    rng = random.Random(0)
    for i in range(warmup + steps):
        for name in rng.sample(names, len(names)):
            t0 = time.perf_counter()
            contenders[name]()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: min(v) for k, v in times.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10M,100M", help="comma-separated param counts")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--steps", type=int, default=7, help="timed steps (median taken)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="N=4M, 5 steps")
    ap.add_argument("--rules", action="store_true",
                    help="SGD, Adagrad and Lion instead of the Adam contests")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.steps = "4M", 5
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thread_list = [int(t) for t in args.threads.split(",")]
    if args.steps < 5:
        ap.error(f"--steps must be >= 5, got {args.steps}")

    if args.rules:
        torch_threads = torch.get_num_threads()
        results = run_rules(sizes, thread_list, args.warmup, args.steps)
        torch.set_num_threads(torch_threads)
        print(json.dumps({"bench": "rules", "cpu": cpu_model(), "torch": torch.__version__,
                          "steps": args.steps, "results": results}))
        return 0
    ds_cls, ds_reason = load_deepspeed()
    env = {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "native_isa": get_backend("native").isa(),
           "deepspeed": "available" if ds_cls else f"unavailable: {ds_reason}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           # other jobs on a shared machine skew 2-thread figures most: say how busy it was
           "loadavg_start": round(os.getloadavg()[0], 1)}
    print(f"# {env['cpu']}, {env['cpus']} CPUs, torch {env['torch']}, native ISA "
          f"{env['native_isa']}, DeepSpeedCPUAdam {env['deepspeed']}, {env['date']}, "
          f"load average {env['loadavg_start']}")
    results = []
    torch_threads = torch.get_num_threads()
    hdr = (f"{'N':>6} {'thr':>3} {'contender':<15} {'ms/step':>9} {'Gparam/s':>9} "
           f"{'GB/s@28B':>9} {'vs native':>9} {'best ms':>9} {'best Gp/s':>9}")
    for n in sizes:
        buf = Buffers(n)
        for th in thread_list:
            torch.set_num_threads(th)  # torch's (and DeepSpeed's OpenMP) pool for this row
            print(f"\n{hdr}")
            med, best = time_interleaved(plain_contenders(buf, th, ds_cls), args.warmup,
                                         args.steps)
            row = {"n": n, "threads": th, "kind": "adamw_fp32", "seconds": med,
                   "best_seconds": best}
            base = med["ours_native"]
            for name, t in med.items():
                if name == "copy_probe":
                    print(f"{n / 1e6:>5.0f}M {th:>3} {name:<15} {t * 1e3:>9.2f} {'':>9} "
                          f"{12 * n / t / 1e9:>9.1f} {'(12 B/elem)':>9}")
                    continue
                print(f"{n / 1e6:>5.0f}M {th:>3} {name:<15} {t * 1e3:>9.2f} {n / t / 1e9:>9.3f} "
                      f"{BYTES_PER_PARAM * n / t / 1e9:>9.1f} {t / base:>8.2f}x "
                      f"{best[name] * 1e3:>9.2f} {n / best[name] / 1e9:>9.3f}")
            row["copy_GBps"] = 12 * n / med["copy_probe"] / 1e9
            ratios = {"native_vs_torch_fused": med["torch_fused"] / base,
                      "native_vs_torch_foreach": med["torch_foreach"] / base,
                      "numba_vs_native": base / med["ours_numba"]}
            if "deepspeed" in med:
                ratios["native_vs_deepspeed"] = med["deepspeed"] / base
            row["ratios"] = ratios
            mixed, mbest = time_interleaved(mixed_contenders(buf, th), args.warmup, args.steps)
            for name, t in mixed.items():
                print(f"{n / 1e6:>5.0f}M {th:>3} {'mixed:' + name:<15} {t * 1e3:>9.2f} "
                      f"{n / t / 1e9:>9.3f} {'':>9} {'':>9} {mbest[name] * 1e3:>9.2f} "
                      f"{n / mbest[name] / 1e9:>9.3f}")
            ratios["mixed_ours_vs_torch"] = mixed["torch_sequence"] / mixed["ours_fused"]
            row["mixed_seconds"] = mixed
            row["mixed_best_seconds"] = mbest
            row["best_ratios"] = {
                "native_vs_torch_fused": best["torch_fused"] / best["ours_native"],
                "numba_vs_native": best["ours_native"] / best["ours_numba"],
                "mixed_ours_vs_torch": mbest["torch_sequence"] / mbest["ours_fused"]}
            if "deepspeed" in best:
                row["best_ratios"]["native_vs_deepspeed"] = best["deepspeed"] / best["ours_native"]
            print("   speedups of medians (>1 = ours faster): "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
            print("   speedups of best steps:                  "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in row["best_ratios"].items()))
            results.append(row)
        del buf
    torch.set_num_threads(torch_threads)
    env["loadavg_end"] = round(os.getloadavg()[0], 1)
    print(f"# load average (1 min): {env['loadavg_start']} at start, {env['loadavg_end']} at end")
    print(json.dumps({"bench": "adam", "env": env, "steps": args.steps, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
