"""Gradient accumulation over 2 gloo ranks: step time with ``opt.no_sync()`` against without.

Stage 2 with the reduction started during backward (``FlatState.reduce_in_backward``): without
``no_sync()`` every micro-batch's backward reduces every bucket; with it, the micro-batches
before the last send nothing and the last sends the accumulated grads once. Both variants run
interleaved in the same processes; medians per rank.

    python bench/no_sync.py --width 1024 --layers 8 --micro 4 --steps 6

Prints a line per rank and a final JSON line.
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
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(rank: int, world: int, port: int, args, q) -> None:
    import offload
    from offload.optim.flat_state import FlatState

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    FlatState.reduce_in_backward = True
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = offload.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, args.width)
    times = {"every_micro_batch": [], "no_sync": []}
    for i in range(2 + args.steps):
        for mode in times:  # interleaved: drift hits both alike
            dist.barrier()
            t = time.perf_counter()
            for micro in range(args.micro):
                if mode == "no_sync" and micro < args.micro - 1:
                    with opt.no_sync():
                        model(x).pow(2).mean().backward()
                else:
                    model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if i >= 2:
                times[mode].append(time.perf_counter() - t)
    q.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    opt.close()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    numel = args.layers * (args.width * args.width + args.width)
    for r, med in out:
        print(f"rank {r}: every micro-batch {med['every_micro_batch']:.3f} s/step, no_sync {med['no_sync']:.3f} "
              f"s/step: {med['no_sync'] / med['every_micro_batch']:.2f}x")
    print(json.dumps({"bench": "no_sync", "numel": numel, "micro": args.micro, "median_s": dict(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
