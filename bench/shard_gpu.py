"""Stage 3 on a GPU (bench/gpu_check.sh's stage-3 entry): forward + backward of a GPT-2-sized
TinyGPT sharded with ``offload.shard(offload_params="cpu")`` (shards in pinned host memory,
gathered to the device unit by unit, grads back to the host), with the gathers on their side
stream (``overlap``) against the same with the gathers' copies on the compute stream
(``sync``: offload/shard/device.py ``overlap = False``), interleaved iteration by iteration;
medians, their ratio, and the bytes gathered per iteration. One rank, no process group.
Then (``--no-profile`` skips it) one profiled iteration per mode: the device's busy time by
kind (kernels, host-to-device and device-to-host copies), how much of it kernels and copies
spent at once, and how long the device sat idle within the iteration's span (kernels and
copies at once near 0 in the overlap mode: the copies wait for compute or compute for them; a
large idle share: the host sets the pace). With $OUT set (the device tool's output folder)
the two chrome traces go there.

    python bench/shard_gpu.py --layers 12 --width 768 --seq 512 --batch 8 --iters 5

Without CUDA it prints a line saying so and exits 0 (CI imports and runs it that way).
Prints a table and a final JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def build(args):
    import offload
    from offload.demo.model import GPTConfig, TinyGPT

    cfg = GPTConfig(block_size=args.seq, n_layer=args.layers, n_head=args.width // 64, d_model=args.width)
    torch.manual_seed(0)
    model = offload.shard(TinyGPT(cfg).to("cuda"), offload_params="cpu", prefetch=args.prefetch)
    return cfg, model


def one(model, x, y, overlap: bool) -> float:
    """Seconds of one forward + backward, the device's work included."""
    from offload.shard import device

    device.overlap = overlap
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def profiled(model, x, y, overlap: bool) -> dict:
    """One forward + backward under the profiler: the device timeline's shares, in ms."""
    from torch.profiler import ProfilerActivity, profile

    from bench._timeline import summary

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one(model, x, y, overlap)
    t = summary(prof.events())
    out_dir = os.environ.get("OUT")
    if out_dir and os.path.isdir(out_dir):
        prof.export_chrome_trace(os.path.join(out_dir, f"shard_gpu_{'overlap' if overlap else 'sync'}.json"))
    return t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5, help="measured iterations per mode (after 2 warm-ups)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled iteration per mode")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("shard_gpu: torch sees no CUDA device: skipped")
        return 0
    from offload.shard import device, runtime_of

    cfg, model = build(args)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to("cuda")
    x, y = idx[:, :-1], idx[:, 1:]
    rt = runtime_of(model)
    gathered = sum(f.nbytes for u in rt.units for f in u.flats)  # each unit: forward and backward
    times = {True: [], False: []}
    peaks = {True: 0, False: 0}  # each mode's own peak of allocated device memory
    per_iter = []  # (iteration, mode, peak MiB): which iteration sets a mode's peak
    try:
        for i in range(args.iters + 2):
            for mode in (True, False) if i % 2 == 0 else (False, True):
                torch.cuda.reset_peak_memory_stats()
                dt = one(model, x, y, mode)
                top = torch.cuda.max_memory_allocated()
                peaks[mode] = max(peaks[mode], top)
                per_iter.append((i, "overlap" if mode else "sync", round(top / 2**20)))
                if i >= 2:
                    times[mode].append(dt)
    finally:
        device.overlap = True
    med = {("overlap" if k else "sync"): statistics.median(v) for k, v in times.items()}
    peak = max(peaks.values())
    print(f"TinyGPT {cfg.num_params / 1e6:.0f}M params ({args.layers} x {args.width}), batch {args.batch} x "
          f"{args.seq}, offload_params='cpu', {len(rt.units)} units, {2 * gathered / 2**20:.0f} MiB gathered "
          "per forward + backward")
    for k, v in med.items():
        print(f"  {k:8s} forward+backward {v * 1e3:8.1f} ms (median of {args.iters}); peak device memory "
              f"{peaks[k == 'overlap'] / 2**30:.2f} GiB")
    print(f"overlap ratio (sync / overlap) {med['sync'] / med['overlap']:.2f}x; peak device memory "
          f"{peak / 2**30:.2f} GiB")
    print("peak device memory per iteration (MiB): " + ", ".join(f"{i}:{m[0]}={mib}" for i, m, mib in per_iter))
    pinned = all(f.shard.is_pinned() for u in rt.units for f in u.flats)
    print(f"host shards pinned: {pinned}")
    timelines = {}
    if not args.no_profile:
        try:
            for mode in (True, False):
                timelines["overlap" if mode else "sync"] = t = profiled(model, x, y, mode)
                if t:
                    print(f"  {'overlap' if mode else 'sync':8s} profiled: span {t['span_ms']:.1f} ms; kernels "
                          f"{t['kernels_ms']:.1f}, HtoD {t['htod_ms']:.1f}, DtoH {t['dtoh_ms']:.1f}, kernels and "
                          f"copies at once {t['both_at_once_ms']:.1f}, device idle {t['idle_ms']:.1f} ms")
        except Exception as exc:  # the profiler is a nice-to-have; the timings above stand
            print(f"profiler unavailable: {type(exc).__name__}: {exc}")
        finally:
            device.overlap = True
    print(json.dumps({"params": cfg.num_params, "host_shards_pinned": pinned, "timeline": timelines, "units": len(rt.units), "gathered_bytes_per_iter": 2 * gathered,
                      "fwd_bwd_overlap_s": med["overlap"], "fwd_bwd_sync_s": med["sync"],
                      "overlap_ratio": med["sync"] / med["overlap"], "peak_device_bytes": peak,
                      "peak_device_bytes_overlap": peaks[True], "peak_device_bytes_sync": peaks[False],
                      "peak_mib_per_iteration": per_iter}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
