"""CPU Adam kernels side by side: ours (native, numba) against torch and DeepSpeed.

    .venv/bin/python bench/adam.py                  # N = 10M and 100M, 1 and 2 threads
    .venv/bin/python bench/adam.py --quick          # N = 4M, 5 steps: a smoke run
    .venv/bin/python bench/adam.py --rules --sizes 10M   # SGD, Adagrad, Lion instead
    .venv/bin/python bench/adam.py --sizes 100M --state-dtype float32,bfloat16,int8 \
        --master-dtype float32,bfloat16                  # compressed states, side by side
    .venv/bin/python bench/adam.py --sizes 100M --first-step 20000   # late in a long run

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

3. ``--state-dtype float32,bfloat16,int8`` (instead of 1 and 2): AdamW with compressed
   states through ``rule_step`` and ``Rule.with_state_dtype``, per kernel backend (``--backends``,
   default native,numba): fp32 params (their own master), and with ``--master-dtype float32``
   / ``bfloat16`` bf16 params with bf16 grads (an fp32 master and its bf16 copy written in the
   pass, or the bf16 param as its own master, rounded stochastically). Gparam/s, the effective
   GB/s at each row's bytes (28 B/param for the fp32 kernel, ~16 with int8 states: the states'
   bytes read and written, the param read and written, the grad read, the bf16 copy written),
   that GB/s as a share of the copy probe's (the memory wall), and the ratio to the same
   backend's fp32 kernel. A backend without the compressed kernel yet says so and keeps only
   its fp32 row. bf16 states round stochastically, as the optimizers always round them
   (offload/optim/state_codec.py says why); ``--nearest-states``: the kernel's round to
   nearest even instead.

``--first-step N`` starts the Adam contests (1 to 3) at step N: past step 16,628 (beta2
0.999) beta2's bias correction rounds to one, and the native units skip a division
([Note: a bias correction of one] in native/kernel.h), as they do for most of a long run.

4. ``--rules`` (instead of 1 and 2): SGD (momentum 0.9, weight decay), Adagrad and Lion,
   ours native against torch's fastest CPU code of each: SGD and Adagrad foreach and
   fused=True, Lion (no torch optimizer) a foreach-style loop of torch ops as lion-pytorch
   writes it; and DeepSpeed's DeepSpeedCPULion / DeepSpeedCPUAdagrad where deepspeed imports
   (it has no CPU SGD). Effective GB/s at 20 B/param (3 fp32 reads + 2 writes: param, grad,
   the one state; counted as the 28 B of Adam are).

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
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
from offload.kernels.quant import rounding_seed  # noqa: E402

from bench._states import (MASTER_DTYPES, STATE_DTYPES, adam_rule, parse_list,  # noqa: E402
                           states_bytes)

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
LOSS_SCALE = 1024.0
BYTES_PER_PARAM = 28


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)




DEEPSPEED_CPU = {"adam": ("deepspeed.ops.adam", "DeepSpeedCPUAdam"),
                 "lion": ("deepspeed.ops.lion", "DeepSpeedCPULion"),
                 "adagrad": ("deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad")}


def load_deepspeed(rule: str = "adam"):
    """DeepSpeed's CPU optimizer class of ``rule`` and None, or (None, reason)."""
    if rule not in DEEPSPEED_CPU:
        return None, f"DeepSpeed has no CPU {rule}"
    module, name = DEEPSPEED_CPU[rule]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return getattr(importlib.import_module(module), name), None
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
        opt.state[self.param] = {"step": torch.tensor(float(FIRST_STEP - 1)), "exp_avg": self.exp_avg,
                                 "exp_avg_sq": self.exp_avg_sq}
        return opt


def plain_contenders(buf: Buffers, threads: int, ds_cls):
    p, g, m, v = buf.param.data, buf.param.grad, buf.exp_avg, buf.exp_avg_sq
    native, numba = get_backend("native"), get_backend("numba")
    counter = {"native": FIRST_STEP - 1, "numba": FIRST_STEP - 1}

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
        ds.state[buf.param] = {"step": FIRST_STEP - 1, "exp_avg": m, "exp_avg_sq": v}
        out["deepspeed"] = ds.step
    dst = buf.copy_dst
    out["copy_probe"] = lambda: dst.copy_(p)
    return out


def mixed_contenders(buf: Buffers, threads: int):
    """Loss-scaled fp32 grads -> unscale, global-norm clip, AdamW, bf16 param copy."""
    p, g, m, v, lowp = buf.param.data, buf.param.grad, buf.exp_avg, buf.exp_avg_sq, buf.lowp
    native = get_backend("native")
    max_norm = 1e9  # never clips: grads stay unchanged step after step (no denormal drift)
    counter = [FIRST_STEP - 1]

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


FIRST_STEP = 1  # --first-step
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
    ds_cls, _ = load_deepspeed(rule)
    if ds_cls is not None:
        # its own step over the shared param and state (its state dict pre-filled, so it
        # allocates nothing): DeepSpeedCPULion keeps exp_avg, DeepSpeedCPUAdagrad exp_avg_sq
        if rule == "lion":
            ds = ds_cls([buf.param], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]),
                        weight_decay=hp["weight_decay"])
            ds.state[buf.param] = {"step": 0, "exp_avg": state}
        else:
            ds = ds_cls([buf.param], lr=hp["lr"], weight_decay=hp["weight_decay"])
            ds.state[buf.param] = {"step": 0, "exp_avg_sq": state}
        out["deepspeed"] = ds.step
    out["copy_probe"] = lambda: buf.copy_dst.copy_(p)  # the wall, timed in the same run
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
          f"{'GB/s@20B':>9} {'of copy':>8} {'vs native':>9} {'best ms':>9}")
    for n in sizes:
        buf = Buffers(n)
        for th in thread_list:
            torch.set_num_threads(th)
            for rule in RULE_HP:
                buf.exp_avg.fill_(0.01)  # a valid state for every rule (Adagrad's sum >= 0)
                med, best = time_interleaved(rule_contenders(buf, rule, th), warmup, steps)
                base = med["ours_native"]
                copy_gbps = 12 * n / med["copy_probe"] / 1e9
                for name, t in med.items():
                    if name == "copy_probe":
                        print(f"{n / 1e6:>5.0f}M {th:>3} {rule:<8} {'copy (12 B/el)':<14} "
                              f"{t * 1e3:>9.2f} {copy_gbps:>9.1f} {'(wall)':>8}")
                        continue
                    gbps = RULE_BYTES * n / t / 1e9
                    print(f"{n / 1e6:>5.0f}M {th:>3} {rule:<8} {name:<14} {t * 1e3:>9.2f} "
                          f"{gbps:>9.1f} {gbps / copy_gbps:>7.0%} {t / base:>8.2f}x "
                          f"{best[name] * 1e3:>9.2f}")
                results.append({"n": n, "threads": th, "kind": rule, "seconds": med,
                                "best_seconds": best, "copy_GBps": copy_gbps,
                                "GBps": {k: RULE_BYTES * n / t / 1e9 for k, t in med.items()
                                         if k != "copy_probe"}})
        del buf
    return results


HYPER = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, decoupled=True)


def row_bytes(param_dtype: str, master_dtype, state_dtype: str) -> float:
    """Bytes one step moves per param: states read and written, the param (or master) read
    and written, the grad read, a bf16 copy written."""
    states = 2 * states_bytes(state_dtype)
    if param_dtype == "float32":
        return 4 + 4 + 4 + states  # fp32 param r/w, fp32 grad
    if master_dtype == "bfloat16":
        return 2 + 2 + 2 + states  # bf16 param (its own master) r/w, bf16 grad
    return 4 + 4 + 2 + 2 + states  # fp32 master r/w, bf16 grad, bf16 copy written


def compressed_support(backend) -> "str | None":
    """None if ``backend`` steps int8 states, else why not (one call on 300 elements)."""
    rule = adam_rule("int8")
    n = 300
    states = {f.name: torch.zeros(f.storage_numel(n), dtype=f.storage_dtype) for f in rule.fields}
    try:
        backend.rule_step(rule, torch.zeros(n), torch.zeros(n), states, step=1, **HYPER)
    except NotImplementedError as exc:
        return str(exc)
    return None


class StateBuffers:
    """Per state dtype, Adam's two states over ``n`` elements (fp32: the shared Buffers' own
    moments), plus bf16 params and grads for the master rows; every page touched now."""

    def __init__(self, buf: Buffers, state_dtypes, bf16_rows: bool) -> None:
        n = buf.n
        self.states = {}
        for sd in state_dtypes:
            if sd == "float32":
                self.states[sd] = {"exp_avg": buf.exp_avg, "exp_avg_sq": buf.exp_avg_sq}
                continue
            self.states[sd] = {f.name: torch.empty(f.storage_numel(n), dtype=f.storage_dtype).fill_(0)
                               for f in adam_rule(sd).fields}
        self.param16 = buf.param.detach().to(torch.bfloat16) if bf16_rows else None
        self.grad16 = buf.param.grad.to(torch.bfloat16) if bf16_rows else None


def state_rows(state_dtypes, master_dtypes):
    """(label, param dtype, master dtype, state dtype) of each row; the fp32 kernel first."""
    short = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
    rows = [(f"fp32p {short[sd]}", "float32", None, sd) for sd in state_dtypes]
    rows += [(f"bf16p {short[md]}m {short[sd]}", "bfloat16", md, sd)
             for md in master_dtypes for sd in state_dtypes]
    if ("fp32p fp32", "float32", None, "float32") not in rows:
        rows.insert(0, ("fp32p fp32", "float32", None, "float32"))
    return rows


def state_contenders(buf: Buffers, sbuf: StateBuffers, backends, rows, threads: int, stochastic: bool):
    out = {}
    for backend in backends:
        for label, pd, md, sd in rows:
            if pd == "float32":
                param, grad, lowp = buf.param.data, buf.param.grad, None
            elif md == "bfloat16":
                param, grad, lowp = sbuf.param16, sbuf.grad16, None
            else:  # an fp32 master and its bf16 copy, as the flat store steps bf16 params
                param, grad, lowp = buf.param.data, sbuf.grad16, buf.lowp
            out[f"{backend.name}:{label}"] = _state_step(backend, adam_rule(sd), param, grad,
                                                         sbuf.states[sd], lowp, threads, stochastic)
    out["copy_probe"] = lambda: buf.copy_dst.copy_(buf.param.data)
    return out


def _state_step(backend, rule, param, grad, states, lowp, threads, stochastic):
    count = [FIRST_STEP - 1]

    def run():
        count[0] += 1
        backend.rule_step(rule, param, grad, states, step=count[0], param_lowp=lowp,
                          num_threads=threads, rounding_seed=rounding_seed(count[0]),
                          stochastic_states=stochastic, **HYPER)
    return run


def run_states(args, sizes, thread_list) -> list:
    sds = parse_list(args.state_dtype, STATE_DTYPES, "--state-dtype")
    mds = parse_list(args.master_dtype, MASTER_DTYPES, "--master-dtype") if args.master_dtype else ()
    rows = state_rows(sds, mds)
    backends, full = [], []
    for name in parse_list(args.backends, ("native", "numba", "torch"), "--backends"):
        backend = get_backend(name)
        why = compressed_support(backend)
        backends.append(backend)
        if why is None:
            full.append(name)
        else:
            print(f"# backend {name}: no compressed-state kernel yet ({why}): its fp32 row only")
    results = []
    for n in sizes:
        buf = Buffers(n)
        sbuf = StateBuffers(buf, {sd for _, _, _, sd in rows}, bool(mds))
        for th in thread_list:
            torch.set_num_threads(th)
            cont = state_contenders(buf, sbuf, backends, rows, th, not args.nearest_states)
            cont = {k: v for k, v in cont.items()
                    if k == "copy_probe" or k.split(":")[0] in full or k.endswith(":fp32p fp32")}
            med, best = time_interleaved(cont, args.warmup, args.steps)
            results.append(print_states(n, th, rows, med, best))
        del buf, sbuf
    return results


def fmt_n(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n >= 10**6 else f"{n / 1e3:.0f}K"


def print_states(n: int, th: int, rows, med, best) -> dict:
    copy_gbps = 12 * n / med["copy_probe"] / 1e9
    print(f"\n{'N':>6} {'thr':>3} {'contender':<26} {'ms/step':>9} {'Gparam/s':>9} {'B/param':>8} "
          f"{'GB/s':>7} {'of copy':>8} {'vs fp32':>8} {'best ms':>9}")
    print(f"{fmt_n(n):>6} {th:>3} {'copy_probe (12 B/elem)':<26} {med['copy_probe'] * 1e3:>9.2f} "
          f"{'':>9} {'':>8} {copy_gbps:>7.1f} {'(wall)':>8}")
    bytes_of = {label: row_bytes(pd, md, sd) for label, pd, md, sd in rows}
    row = {"n": n, "threads": th, "kind": "adamw_states", "seconds": med, "best_seconds": best,
           "copy_GBps": copy_gbps, "bytes_per_param": bytes_of, "ratios_vs_fp32": {}}
    for name, t in med.items():
        if name == "copy_probe":
            continue
        backend, label = name.split(":")
        base = med[f"{backend}:fp32p fp32"]
        gbps = bytes_of[label] * n / t / 1e9
        row["ratios_vs_fp32"][name] = base / t
        print(f"{fmt_n(n):>6} {th:>3} {name:<26} {t * 1e3:>9.2f} {n / t / 1e9:>9.3f} "
              f"{bytes_of[label]:>8.2f} {gbps:>7.1f} {gbps / copy_gbps:>7.0%} {base / t:>7.2f}x "
              f"{best[name] * 1e3:>9.2f}")
    return row


def add_state_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--state-dtype", default=None,
                    help="comma-separated of float32,bfloat16,int8: AdamW with these states "
                         "instead of the Adam contests (each row against the fp32 kernel)")
    ap.add_argument("--master-dtype", default=None,
                    help="with --state-dtype: also bf16 params with this master (float32, "
                         "bfloat16: the bf16 param is its own master), comma-separated")
    ap.add_argument("--backends", default="native,numba",
                    help="with --state-dtype: kernel backends, of native,numba,torch")
    ap.add_argument("--nearest-states", action="store_true",
                    help="with --state-dtype: bf16 states rounded to nearest even (default: stochastically, "
                         "as the optimizers round them)")


def states_main(ap: argparse.ArgumentParser, args, sizes, thread_list) -> int:
    """The --state-dtype contest: the table, then one JSON line."""
    if not args.state_dtype:
        ap.error("--master-dtype needs --state-dtype (the rows it adds are compressed-state rows)")
    torch_threads = torch.get_num_threads()
    try:
        results = run_states(args, sizes, thread_list)
    except ValueError as exc:
        ap.error(str(exc))
    finally:
        torch.set_num_threads(torch_threads)
    print(json.dumps({"bench": "adam_states", "cpu": cpu_model(), "torch": torch.__version__,
                      "steps": args.steps, "stochastic_states": not args.nearest_states,
                      "first_step": FIRST_STEP, "results": results}))
    return 0


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
    ap.add_argument("--first-step", type=int, default=1,
                    help="the Adam contests' first step number (e.g. 20000: past the step where "
                         "beta2's bias correction rounds to one, as in most of a long run)")
    ap.add_argument("--rules", action="store_true",
                    help="SGD, Adagrad and Lion instead of the Adam contests")
    add_state_args(ap)
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.steps = "4M", 5
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    thread_list = [int(t) for t in args.threads.split(",")]
    if args.steps < 5:
        ap.error(f"--steps must be >= 5, got {args.steps}")
    if args.first_step < 1:
        ap.error(f"--first-step must be >= 1, got {args.first_step}")
    global FIRST_STEP
    FIRST_STEP = args.first_step

    if args.state_dtype or args.master_dtype:
        return states_main(ap, args, sizes, thread_list)
    if args.rules:
        torch_threads = torch.get_num_threads()
        results = run_rules(sizes, thread_list, args.warmup, args.steps)
        torch.set_num_threads(torch_threads)
        deepspeed = {rule: load_deepspeed(rule)[1] or "available" for rule in RULE_HP}
        print(f"DeepSpeed's CPU optimizers: {deepspeed}")
        print(json.dumps({"bench": "rules", "cpu": cpu_model(), "torch": torch.__version__,
                          "steps": args.steps, "deepspeed": deepspeed, "results": results}))
        return 0
    ds_cls, ds_reason = load_deepspeed()
    env = {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "native_isa": get_backend("native").isa(),
           "deepspeed": "available" if ds_cls else f"unavailable: {ds_reason}",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           # other jobs on a shared machine skew 2-thread figures most: say how busy it was
           "loadavg_start": round(os.getloadavg()[0], 1), "first_step": FIRST_STEP}
    print(f"# {env['cpu']}, {env['cpus']} CPUs, torch {env['torch']}, native ISA "
          f"{env['native_isa']}, DeepSpeedCPUAdam {env['deepspeed']}, {env['date']}, "
          f"load average {env['loadavg_start']}, first step {FIRST_STEP}")
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
