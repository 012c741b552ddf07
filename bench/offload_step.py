"""The full offloaded step for bf16 CPU params against the bare fp32 kernel, side by side.

Contenders, on the same N, interleaved step by step (see MEASURED.md: the first large
allocation of a process page-faults, so each is warmed up and medians are taken):

- ``kernel_fp32``: ``get_backend().adam_step`` on fp32 param/grad/moments (28 B/param moved);
- ``flat_bf16``: ``offload.AdamW`` step on bf16 params with ``max_grad_norm`` and a loss
  scale (unscale + global-norm clip + AdamW + bf16 copy back, fp32 master and moments on
  the host); its grads are read where autograd left them;
- ``flat_bf16_hook``: the same with the grads copied into the host flat buffer by the
  post-accumulate-grad hook (the CUDA path's copy, done on the CPU), copy included.

``--ranks 2`` also runs ``flat_bf16`` partitioned over 2 gloo processes and reports each
rank's step time and state bytes against one rank.

    python bench/offload_step.py --numel 100000000 --steps 7 --threads 2 --ranks 2

``--gpu`` instead runs the GPU check (bench/gpu_check.sh): bf16 params on CUDA whose fp32
Adam states exceed ``--device-budget``, trained with ``offload="cpu"``; step time with the
side streams (overlap) against the same step with synchronous copies, interleaved, plus
the profiler's summary of the stream timeline of one overlapped step.

    python bench/offload_step.py --gpu --width 8192 --layers 8 --device-budget 4GiB
    python bench/offload_step.py --gpu --state-dtype int8 --master-dtype bfloat16   # compressed states

Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import offload  # noqa: E402
from offload.kernels import get_backend  # noqa: E402
from offload.optim.flat_state import FlatState  # noqa: E402
from bench._timeline import summary as device_summary  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PIECES = 4  # params per model: a few large tensors, as in a real layer stack


def _params(numel: int, dtype: torch.dtype):
    sizes = [numel // PIECES] * (PIECES - 1)
    sizes.append(numel - sum(sizes))
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype)) for n in sizes]


def _set_grads(params, seed: int) -> None:
    # Grads as autograd leaves them after a backward: fresh tensors of the param dtype.
    for i, p in enumerate(params):
        g = torch.empty_like(p)
        g.normal_(0, 1e-3, generator=torch.Generator().manual_seed(seed + i))
        p.grad = g


def _fire_hooks(params) -> None:
    # What autograd does after accumulating a leaf's grad; lets the hook path run without a
    # backward pass (the hook reads p.grad, which is all the bench needs).
    for p in params:
        for hook in getattr(p, "_post_accumulate_grad_hooks", {}).values():
            hook(p)


class Kernel:
    name = "kernel_fp32"

    def __init__(self, numel: int, threads: int) -> None:
        self.k = get_backend()
        self.t = [torch.zeros(numel) for _ in range(4)]
        self.t[1].normal_(0, 1e-3)
        self.threads = threads
        self.n = 0

    def step(self) -> float:
        self.n += 1
        t0 = time.perf_counter()
        self.k.adam_step(*self.t, step=self.n, decoupled=True, lr=HP["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=HP["weight_decay"], num_threads=self.threads)
        return time.perf_counter() - t0


class Flat:
    def __init__(self, numel: int, threads: int, hook: bool, stage=None) -> None:
        FlatState.copy_cpu_grads = hook
        self.name = "flat_bf16_hook" if hook else "flat_bf16"
        self.params = _params(numel, torch.bfloat16)
        self.opt = offload.AdamW(self.params, max_grad_norm=1.0, num_threads=threads, stage=stage, **HP)
        FlatState.copy_cpu_grads = False
        self.hook = hook
        self.n = 0
        self.scale = torch.tensor(1024.0)

    def step(self) -> float:
        self.n += 1
        _set_grads(self.params, self.n)
        t0 = time.perf_counter()
        if self.hook:
            _fire_hooks(self.params)  # the grad copy the hook does during backward
        # What GradScaler.step hands the optimizer: the scale (unscale inside the kernel).
        self.opt.grad_scale, self.opt.found_inf = self.scale, torch.tensor(0.0)
        self.opt.step()
        del self.opt.grad_scale, self.opt.found_inf
        dt = time.perf_counter() - t0
        self.opt.zero_grad()
        return dt


def _median_table(contenders, steps: int, warmup: int = 2):
    times = {c.name: [] for c in contenders}
    for i in range(warmup + steps):
        for c in contenders:  # interleaved, so drift hits every contender alike
            dt = c.step()
            if i >= warmup:
                times[c.name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def _rank_main(rank, world, port, numel, threads, steps, outq):
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    c = Flat(numel, threads, hook=False, stage=2)
    med = _median_table([c], steps)
    rep = c.opt.memory_report()
    outq.put((rank, med["flat_bf16"], rep["detail"]["state_bytes"], c.opt.step_stats()["mean"]))


def _ranks(world, numel, threads, steps):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, numel, threads, steps, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join()
    return out


def gpu_main(args) -> int:
    from offload.config import parse_bytes

    dev = torch.device("cuda")
    budget = parse_bytes(args.device_budget)
    layers = [torch.nn.Linear(args.width, args.width, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())])
    numel = sum(p.numel() for p in model.parameters())
    # master (fp32, or none: the bf16 param is its own) + exp_avg + exp_avg_sq as stored
    moment_bytes = {"float32": 8, "bfloat16": 4, "int8": 2 + 8 / 256}[args.state_dtype]
    state_bytes = int((4 * (args.master_dtype is None) + moment_bytes) * numel)
    print(f"GPU {torch.cuda.get_device_name(dev)}; params {numel / 1e6:.0f}M bf16 = {2 * numel / 2**30:.2f} GiB; "
          f"Adam states ({args.state_dtype} moments, {args.master_dtype or 'float32'} master) "
          f"{state_bytes / 2**30:.2f} GiB vs device budget {budget / 2**30:.2f} GiB "
          f"({'exceeds' if state_bytes > budget else 'DOES NOT exceed'} it)")
    threads = args.threads or os.cpu_count()
    t0 = time.perf_counter()
    opt = offload.AdamW(model.parameters(), offload="cpu", num_threads=threads, state_dtype=args.state_dtype,
                        master_dtype=args.master_dtype, max_grad_norm=args.max_grad_norm if args.max_grad_norm > 0 else None, **HP)
    print(f"optimizer set up in {time.perf_counter() - t0:.1f} s (host buffers allocated and pinned); "
          f"kernel backend {get_backend().name}, {threads} threads")
    x = torch.randn(args.batch, args.width, device=dev, dtype=torch.bfloat16)

    def one(overlap: bool) -> float:
        FlatState.overlap = overlap
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).float().pow(2).mean().backward()  # hooks copy grads to the host meanwhile
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    torch.cuda.reset_peak_memory_stats(dev)
    times = {True: [], False: []}
    for i in range(2 + args.steps):
        for ov in (True, False):
            dt = one(ov)
            if i >= 2:
                times[ov].append(dt)
    FlatState.overlap = True
    peak = torch.cuda.max_memory_allocated(dev)
    med = {("overlap" if k else "sync"): statistics.median(v) for k, v in times.items()}
    print(f"{'mode':<10}{'s/step':>10}{'Gparam/s':>10}")
    for k, v in med.items():
        print(f"{k:<10}{v:>10.4f}{numel / v / 1e9:>10.2f}")
    print(f"overlap speed-up {med['sync'] / med['overlap']:.2f}x; peak device memory {peak / 2**30:.2f} GiB "
          f"(budget {budget / 2**30:.2f} GiB: {'within' if peak <= budget else 'OVER'})")
    stats = opt.step_stats()
    print("last step phases (s): " + ", ".join(f"{k}={v:.4f}" for k, v in stats["last"].items()))
    print("memory_report:", json.dumps(opt.memory_report()))
    timeline = None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            one(True)
        # Device-side events only (bench/_timeline.py: annotations left out). The step's
        # kernel runs on the host: this shows the copies against the device's own work.
        timeline = device_summary(prof.events())
        print("device timeline of one overlapped step (ms; the Adam kernel runs on the host, not here):")
        if timeline:
            print(f"  span {timeline['span_ms']:.1f}: kernels {timeline['kernels_ms']:.1f} "
                  f"({timeline['kernels_ops']} ops), HtoD {timeline['htod_ms']:.1f} ({timeline['htod_ops']}), "
                  f"DtoH {timeline['dtoh_ms']:.1f} ({timeline['dtoh_ops']}), other copies "
                  f"{timeline['other_copies_ms']:.1f}; kernels and copies at once {timeline['both_at_once_ms']:.1f}; "
                  f"device idle {timeline['idle_ms']:.1f}")
        out_dir = os.environ.get("OUT")
        if out_dir and os.path.isdir(out_dir):  # the device tool brings $OUT back: the full trace
            trace = os.path.join(out_dir, f"offload_step_gpu_{args.state_dtype}"
                                          f"{'_bf16_master' if args.master_dtype else ''}.json")
            prof.export_chrome_trace(trace)
            print(f"chrome trace: {trace}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    except Exception as exc:  # the profiler is a nice-to-have here; the timings above stand
        print(f"profiler unavailable: {type(exc).__name__}: {exc}")
    opt.close()
    print(json.dumps({"bench": "offload_step_gpu", "numel": numel, "state_dtype": args.state_dtype,
                      "master_dtype": args.master_dtype, "median_s": med, "peak_device_bytes": peak,
                      "budget_bytes": budget, "state_bytes": state_bytes, "timeline": timeline,
                      "speedup_overlap": med["sync"] / med["overlap"]}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (default: 2; with --gpu every core)")
    ap.add_argument("--ranks", type=int, default=2, help="also run partitioned over this many gloo ranks (1: skip)")
    ap.add_argument("--gpu", action="store_true", help="run the GPU check instead (see the docstring)")
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device-budget", default="4GiB")
    ap.add_argument("--max-grad-norm", type=float, default=1.0,
                    help="--gpu: clip (the grad norms are then taken on the device by the hooks); 0: no clipping")
    ap.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16", "int8"),
                    help="--gpu: how the optimizer stores the moments")
    ap.add_argument("--master-dtype", default=None, choices=("bfloat16",),
                    help="--gpu: bfloat16: the bf16 params are their own master (no fp32 master)")
    args = ap.parse_args()
    if args.gpu:
        if not torch.cuda.is_available():
            print("--gpu: torch sees no CUDA device", file=sys.stderr)
            return 2
        return gpu_main(args)  # threads None: every core of the GPU box
    args.threads = args.threads or 2
    torch.set_num_threads(args.threads)
    contenders = [Kernel(args.numel, args.threads), Flat(args.numel, args.threads, hook=False),
                  Flat(args.numel, args.threads, hook=True)]
    med = _median_table(contenders, args.steps)
    state_1 = contenders[1].opt.memory_report()["detail"]["state_bytes"]
    phases = contenders[1].opt.step_stats()["mean"]
    for c in contenders[1:]:
        c.opt.close()
    del contenders
    base = med["kernel_fp32"]
    print(f"backend={get_backend().name} N={args.numel} threads={args.threads} steps={args.steps} (medians)")
    print(f"{'contender':<16}{'s/step':>10}{'Gparam/s':>10}{'x kernel':>10}")
    for name, t in med.items():
        print(f"{name:<16}{t:>10.4f}{args.numel / t / 1e9:>10.2f}{t / base:>10.2f}")
    print("flat_bf16 phases (mean s): " + ", ".join(f"{k}={v:.4f}" for k, v in (phases or {}).items()))
    result = {"bench": "offload_step", "numel": args.numel, "threads": args.threads, "backend": get_backend().name,
              "median_s": med, "ratio_flat_bf16": med["flat_bf16"] / base,
              "ratio_flat_bf16_hook": med["flat_bf16_hook"] / base, "state_bytes_1rank": state_1}
    if args.ranks > 1:
        # Each rank gets threads/ranks kernel threads so the ranks do not fight for cores.
        per = max(1, args.threads // args.ranks)
        rows = _ranks(args.ranks, args.numel, per, args.steps)
        print(f"\n{args.ranks} gloo ranks, stage 2, {per} thread(s) each:")
        print(f"{'rank':<6}{'s/step':>10}{'state bytes':>14}{'x 1 rank time':>15}{'x 1 rank bytes':>16}")
        for rank, t, nbytes, ph in rows:
            print(f"{rank:<6}{t:>10.4f}{nbytes:>14}{t / med['flat_bf16']:>15.2f}{nbytes / state_1:>16.3f}")
        print("rank 0 phases (mean s): " + ", ".join(f"{k}={v:.4f}" for k, v in (rows[0][3] or {}).items()))
        result["ranks"] = [{"rank": r, "step_s": t, "state_bytes": b, "time_ratio": t / med["flat_bf16"],
                            "bytes_ratio": b / state_1} for r, t, b, _ in rows]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
