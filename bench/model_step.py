"""A whole ``opt.step()`` over param lists shaped like real models: ours against torch.

    .venv/bin/python bench/model_step.py                       # every shape, 1 and 2 threads
    .venv/bin/python bench/model_step.py --shapes resnet50 --threads 1 --steps 15
    .venv/bin/python bench/model_step.py --quick               # a smoke run
    .venv/bin/python bench/model_step.py --shapes 2000x64,200x4096,20x1M   # the per-step overhead

bench/adam.py times the kernel on one large tensor, where the memory wall decides. A model
is many tensors of many sizes, and each tensor costs its optimizer a fixed amount of work
besides its bytes (ours: ~20 us of Python bookkeeping and a ctypes call per tensor; torch's
fused step: one C++ loop over all of them). This bench shows where that matters:

- ``resnet50``: the 149 weight and BatchNorm tensors of a ResNet-50 (22.8M params), shapes
  computed from its layout (torchvision is not a dependency);
- ``gpt2``: the 148 tensors of GPT-2 small (124M params), from its layout;
- ``small``: 2000 tensors of 64 elements, the per-tensor cost alone;
- ``NxM`` (``2000x64``, ``200x4096``, ``20x1M``): N tensors of M elements each (``K``/``M``
  suffixes: 2**10, 2**20), the same total cut fewer and fewer ways, from the cost per tensor
  to the memory wall.

Each contender gets its own params and grads (same values), all fp32 on the CPU: ours
``offload.AdamW`` with ``offload="none"`` (``ours``: states in RAM, as torch's), ``"cpu"``
(``ours_cpu``: the same host store) and ``"nvme"`` (``ours_nvme``: states in swap files under
``--swap-dir``, read and written each step), torch's AdamW fused=True, foreach and for-loop
(``--contenders`` picks some). Contenders are stepped interleaved, in a fresh random order
each round, after a warm-up; the figure is the median step time. The table gives each of ours
over torch fused (< 1: ours faster; the JSON keeps ``fused_over_ours`` too). Prints a table
and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

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


def shape_sizes(name: str) -> Optional[List[int]]:
    """A named layout, or ``NxM`` (N tensors of M elements, M with an optional K or M
    suffix); None for anything else."""
    if name in SHAPES:
        return SHAPES[name]()
    count, _, numel = name.partition("x")
    scale = {"K": 1 << 10, "M": 1 << 20}.get(numel[-1:], 1)
    numel = numel[:-1] if scale > 1 else numel
    if not (count.isdigit() and numel.isdigit() and int(count) > 0 and int(numel) > 0):
        return None
    return [int(numel) * scale] * int(count)


def _params(sizes: List[int], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


SWAP_DIR = os.path.join(tempfile.gettempdir(), "offload-model-step")  # --swap-dir

CONTENDERS = {
    "ours": lambda ps: offload.AdamW(ps, lr=1e-4, weight_decay=0.01),
    "ours_cpu": lambda ps: offload.AdamW(ps, lr=1e-4, weight_decay=0.01, offload="cpu"),
    "ours_nvme": lambda ps: offload.AdamW(ps, lr=1e-4, weight_decay=0.01, offload="nvme", swap_dir=SWAP_DIR),
    "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, fused=True),
    "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=True),
    "torch_forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, foreach=False),
}


def run_shape(name: str, threads: int, steps: int, warmup: int,
              contenders: Optional[List[str]] = None) -> Dict[str, object]:
    torch.set_num_threads(threads)
    offload.set_num_threads(threads)
    sizes = shape_sizes(name)
    opts = {k: CONTENDERS[k](_params(sizes, 0)) for k in (contenders or list(CONTENDERS))}
    times: Dict[str, List[float]] = {k: [] for k in opts}
    rng = random.Random(0)
    try:
        for i in range(warmup + steps):
            order = list(opts)
            rng.shuffle(order)
            for k in order:
                t = time.perf_counter()
                opts[k].step()
                if i >= warmup:
                    times[k].append(time.perf_counter() - t)
    finally:
        for opt in opts.values():  # ours: frees the buffers and removes the swap files now
            getattr(opt, "close", lambda: None)()
    med = {k: statistics.median(v) for k, v in times.items()}
    fused = med.get("torch_fused")
    row: Dict[str, object] = {"shape": name, "tensors": len(sizes), "params": sum(sizes), "threads": threads,
                              "median_ms": {k: round(v * 1e3, 3) for k, v in med.items()}}
    if fused is not None:
        row["over_fused"] = {k: round(v / fused, 3) for k, v in med.items() if k.startswith("ours")}
        if "ours" in med:
            row["fused_over_ours"] = round(fused / med["ours"], 3)
    return row


def _print_table(rows: List[Dict[str, object]], names: List[str]) -> None:
    ours = [k for k in names if k.startswith("ours")] if "torch_fused" in names else []
    print(f"{'shape':9} {'tensors':>7} {'params':>9} thr " + " ".join(f"{k:>13}" for k in names)
          + "".join(f" {k + '/fused':>15}" for k in ours))
    for r in rows:
        print(f"{r['shape']:9} {r['tensors']:7d} {r['params'] / 1e6:8.2f}M {r['threads']:3d} "
              + " ".join(f"{r['median_ms'][k]:10.2f} ms" for k in names)
              + "".join(f" {r['over_fused'][k]:14.2f}x" for k in ours))
    print("median step time; ours/fused < 1: ours faster")


def main(argv=None) -> int:
    global SWAP_DIR
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)} or NxM")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    ap.add_argument("--swap-dir", default=None, help="where ours_nvme's swap files go (default: a new "
                                                     "directory under the temp dir, removed at the end)")
    ap.add_argument("--quick", action="store_true", help="small and resnet50, 1 thread, 3 steps")
    args = ap.parse_args(argv)
    shapes = ["small", "resnet50"] if args.quick else [s for s in args.shapes.split(",") if s]
    for s in shapes:
        if shape_sizes(s) is None:
            ap.error(f"--shapes: unknown shape {s!r} (one of {', '.join(SHAPES)}, or NxM such as 2000x64, 20x1M)")
    names = [c for c in args.contenders.split(",") if c]
    for c in names:
        if c not in CONTENDERS:
            ap.error(f"--contenders: unknown contender {c!r} (one of {', '.join(CONTENDERS)})")
    try:
        threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: comma-separated integers, got {args.threads!r}")
    steps = 3 if args.quick else args.steps
    made = args.swap_dir is None and "ours_nvme" in names
    SWAP_DIR = tempfile.mkdtemp(prefix="offload-model-step-", dir="/var/tmp") if made else (args.swap_dir or SWAP_DIR)
    try:
        rows = [run_shape(s, t, steps, 1 if args.quick else args.warmup, names) for s in shapes for t in threads]
    finally:
        if made:
            shutil.rmtree(SWAP_DIR, ignore_errors=True)
    _print_table(rows, names)
    print(json.dumps({"rows": rows, "torch": torch.__version__, "cpu_threads": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
