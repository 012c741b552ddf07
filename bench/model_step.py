"""A whole ``opt.step()`` over param lists shaped like real models: ours against torch.

    .venv/bin/python bench/model_step.py                       # every shape, 1 and 2 threads
    .venv/bin/python bench/model_step.py --shapes resnet50 --threads 1 --steps 15
    .venv/bin/python bench/model_step.py --quick               # a smoke run

bench/adam.py times the kernel on one large tensor, where the memory wall decides. A model
is many tensors of many sizes, and each tensor costs its optimizer a fixed amount of work
besides its bytes (ours: ~20 us of Python bookkeeping and a ctypes call per tensor; torch's
fused step: one C++ loop over all of them). This bench shows where that matters:

- ``resnet50``: the 149 weight and BatchNorm tensors of a ResNet-50 (22.8M params), shapes
  computed from its layout (torchvision is not a dependency);
- ``gpt2``: the 148 tensors of GPT-2 small (124M params), from its layout;
- ``small``: 2000 tensors of 64 elements, the per-tensor cost alone.

Each contender gets its own params and grads (same values), all fp32 on the CPU: ours
``offload.AdamW`` (``offload="none"``: states in RAM, as torch's), torch's AdamW fused=True,
foreach and for-loop. Contenders are stepped interleaved, in a fresh random order each round,
after a warm-up; the figure is the median step time, and the ratio is torch fused's time over
ours (> 1: ours faster). Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import offload  # noqa: E402


def resnet50_sizes() -> List[int]:
    """Element counts of ResNet-50's conv weights, BatchNorm weights and biases, and fc."""
    sizes = [64 * 3 * 7 * 7, 64, 64]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            for cout, k, cin_ in ((width, 1, cin), (width, 3, width), (4 * width, 1, width)):
                sizes += [cout * cin_ * k * k, cout, cout]
            if b == 0:  # the downsample branch
                sizes += [4 * width * cin, 4 * width, 4 * width]
            cin = 4 * width
    return sizes + [2048 * 1000, 1000]


def gpt2_sizes(layers: int = 12, d: int = 768, vocab: int = 50257, ctx: int = 1024) -> List[int]:
    """GPT-2's tensors: token and position embeddings, per block two LayerNorms, the fused
    qkv and the output projection, the MLP's two, and the final LayerNorm."""
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [vocab * d, ctx * d] + block * layers + [d, d]


SHAPES: Dict[str, Callable[[], List[int]]] = {
    "resnet50": resnet50_sizes, "gpt2": gpt2_sizes, "small": lambda: [64] * 2000}


def _params(sizes: List[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


CONTENDERS = {
    "ours": lambda ps: offload.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
    "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
    "torch_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=False),
}


def run_shape(name: str, threads: int, steps: int, warmup: int) -> Dict[str, object]:
    torch.set_num_threads(threads)
    offload.set_num_threads(threads)
    sizes = SHAPES[name]()
    opts = {k: make(_params(sizes, 0)) for k, make in CONTENDERS.items()}
    times: Dict[str, List[float]] = {k: [] for k in opts}
    rng = random.Random(0)
    for i in range(warmup + steps):
        order = list(opts)
        rng.shuffle(order)
        for k in order:
            t = time.perf_counter()
            opts[k].step()
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"shape": name, "tensors": len(sizes), "params": sum(sizes), "threads": threads,
            "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
            "fused_over_ours": round(med["torch_fused"] / med["ours"], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small and resnet50, 1 thread, 3 steps")
    args = ap.parse_args(argv)
    shapes = ["small", "resnet50"] if args.quick else [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"--shapes: unknown shape {s!r} (one of {', '.join(SHAPES)})")
    try:
        threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: comma-separated integers, got {args.threads!r}")
    steps = 3 if args.quick else args.steps
    rows = [run_shape(s, t, steps, 1 if args.quick else args.warmup) for s in shapes for t in threads]
    print(f"{'shape':9} {'tensors':>7} {'params':>9} thr " + " ".join(f"{k:>14}" for k in CONTENDERS)
          + "   fused/ours")
    for r in rows:
        print(f"{r['shape']:9} {r['tensors']:7d} {r['params'] / 1e6:8.2f}M {r['threads']:3d} "
              + " ".join(f"{r['median_ms'][k]:11.2f} ms" for k in CONTENDERS) + f"   {r['fused_over_ours']:.2f}x")
    print("median step time; fused/ours > 1: ours faster")
    print(json.dumps({"rows": rows, "torch": torch.__version__, "cpu_threads": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
