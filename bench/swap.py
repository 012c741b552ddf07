"""The NVMe-swapped AdamW step against its ideal, max(I/O alone, kernel alone), in one run.

    .venv/bin/python bench/swap.py                       # N = 200M fp32 params, 512 MiB bound
    .venv/bin/python bench/swap.py --dtype bf16          # bf16 params: master swapped too
    .venv/bin/python bench/swap.py --numel 20_000_000 --max-host-bytes 64MiB --reps 3

What is measured, interleaved rep by rep (medians reported; see MEASURED.md's pitfall):
- step:        --dtype fp32: SwappedState.step() on every param: read moments, AdamW kernel,
               write back, fdatasync, manifest. fp32 params are their own master (updated in
               place, never swapped), so the swap files hold exp_avg + exp_avg_sq = 8 B/param
               (1.6 GB at N = 200M; twice that on disk: two slots).
               --dtype bf16: offload.AdamW(...).step() on bf16 CPU params (the flat store):
               master, exp_avg and exp_avg_sq swapped (12 B/param), the kernel reads the bf16
               grads and writes the bf16 params in the same pass.
- I/O alone:   the same pipeline with a no-op compute (same reads, writes, fdatasync, manifest).
- kernel alone: the same kernel calls on the same slices, moments in one pipeline buffer, no I/O.
- overlap efficiency = max(I/O alone, kernel alone) / step  (1.0 = perfect overlap).
- peak RSS during the step (sampled every 5 ms) against max_host_bytes + params + grads.
Prints a table, then one JSON line.

``--state-dtype float32,bfloat16,int8`` (and, with ``--dtype bf16``, ``--master-dtype
float32,bfloat16``): one row per combination instead, each an ``offload.AdamW(offload="nvme",
state_dtype=..., master_dtype=...)`` over its own copy of the params (OptimRow says why) and
grads sharing one storage, stepped in
turn rep by rep (rotated order): step, I/O alone (the row's pipeline with a no-op compute),
kernel alone (the row's compressed rule over the same sub-group ranges, states in RAM), the
swap files' bytes per param (measured: the files / 2 slots / N), and the speedup over the
fp32-state row against the issue's targets (fp32 params + int8 states 2.5x; bf16 params +
int8 states 1.7x with an fp32 master, 2.5x with a bf16 master). The ``--params`` tensors are
cut at multiples of 256 elements here (``block_split``: why). No RSS figure (several
optimizers share the process). A row the stores cannot run yet, or whose steps never reached
the compressed kernel, says so instead of a figure.

    .venv/bin/python bench/swap.py --state-dtype float32,bfloat16,int8
    .venv/bin/python bench/swap.py --dtype bf16 --state-dtype float32,int8 --master-dtype float32,bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from offload.config import parse_bytes  # noqa: E402
from offload.kernels import get_backend  # noqa: E402
import offload  # noqa: E402
from offload.optim.swapped_state import SwappedState  # noqa: E402

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """Max RSS seen while the block runs, sampled from another thread."""

    def __init__(self, every: float = 0.005) -> None:
        self.every, self.peak, self._stop = every, 0, threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.every)

    def __enter__(self) -> "RssPeak":
        self.peak = rss_bytes()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_bytes())


class Fp32InPlace:
    """fp32 params updated in place, moments swapped (SwappedState, 8 B/param)."""

    swapped_bytes_per_param = 8
    host_bytes_per_param = 8  # fp32 params + grads

    def __init__(self, sizes, args, bound: int) -> None:
        self.params = [torch.empty(n).normal_() for n in sizes]
        self.grads = [torch.empty(n).normal_() for n in sizes]
        self.st = SwappedState(self.params, swap_dir=args.swap_dir, max_host_bytes=bound,
                               sub_group_size=args.sub_group_size, io_engine=args.engine, num_threads=args.threads,
                               verify=args.verify)
        self.steps = [0] * len(sizes)
        self.sizes, self.threads = sizes, args.threads
        self.layout, self.pipeline, self.store = self.st.layout, self.st.pipeline, self.st.store

    def step(self) -> dict:
        for i in range(len(self.steps)):
            self.steps[i] += 1
        return self.st.step([(HYPER, [(p, g, s) for p, g, s in zip(self.params, self.grads, self.steps)])])

    @property
    def last_stats(self) -> dict:
        return self.st.last_stats

    def kernel_alone(self, kernel) -> float:
        lay, pipe, st = self.layout, self.pipeline, self.st
        buf = pipe.buffers[0]
        t0 = time.perf_counter()
        for g in range(lay.num_groups):
            s, e = lay.group_range(g)
            m, v = pipe.tensors(g, buf)
            for i in st._group_params[g]:
                off = st._offsets[i]
                a, b = max(s, off), min(e, off + self.sizes[i])
                kernel.adam_step(self.params[i].view(-1)[a - off:b - off], self.grads[i].view(-1)[a - off:b - off],
                                 m[a - s:b - s], v[a - s:b - s], step=self.steps[0], num_threads=self.threads,
                                 **HYPER)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.st.close()


class Bf16Flat:
    """bf16 CPU params through offload.AdamW's flat store: fp32 master and moments swapped
    (SwappedShards, 12 B/param), bf16 grads read in place, bf16 params written by the kernel."""

    swapped_bytes_per_param = 12
    host_bytes_per_param = 4  # bf16 params + grads

    def __init__(self, sizes, args, bound: int) -> None:
        # made in bf16 directly: an fp32 temporary would leave freed pages in the RSS figure
        self.params = [torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16).normal_()) for n in sizes]
        self.grads = [torch.empty(n, dtype=torch.bfloat16).normal_() for n in sizes]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.opt = offload.AdamW(self.params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                 eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], offload="nvme",
                                 swap_dir=args.swap_dir, max_host_bytes=bound, sub_group_size=args.sub_group_size,
                                 io_engine=args.engine, num_threads=args.threads, verify=args.verify)
        self.sw = self.opt._store._swap
        self.layout, self.pipeline, self.store = self.sw.layout, self.sw.pipeline, self.sw.store
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes, self.threads = sizes, args.threads

    def step(self) -> dict:
        return self.opt.step()

    @property
    def last_stats(self) -> dict:
        return self.sw.last_stats

    def kernel_alone(self, kernel) -> float:
        lay, pipe = self.layout, self.pipeline
        buf = pipe.buffers[0]
        step = int(max(float(st["step"]) for st in self.opt.state.values()))
        t0 = time.perf_counter()
        for g in range(lay.num_groups):
            s, e = lay.group_range(g)
            master, m, v = pipe.tensors(g, buf)
            for i, off in enumerate(self.offsets):
                a, b = max(s, off), min(e, off + self.sizes[i])
                if a < b:
                    kernel.adam_step(master[a - s:b - s], self.grads[i][a - off:b - off], m[a - s:b - s],
                                     v[a - s:b - s], param_lowp=self.params[i].detach()[a - off:b - off],
                                     step=step, num_threads=self.threads, **HYPER)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.opt.close()


class DeepSpeedPeer:
    """DeepSpeed's PipelinedOptimizerSwapper driven the way ZeRO-3's step drives it
    (deepspeed/runtime/zero/stage3.py: per sub-group swap_in_optimizer_state(p, next),
    DeepSpeedCPUAdam.step on [p], swap_out_optimizer_state(p, async_swap)), on the same grads.
    Its fp32 master lives in the swap files too (ZeRO-3 has no user fp32 param to update in
    place), so it moves 12 B/param each way where we move 8."""

    def __init__(self, swap_dir: str, grads, sub_group_size: int, buffer_count: int, threads: int) -> None:
        import deepspeed
        import deepspeed.comm as dist
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.runtime.swap_tensor.constants import (AIO_BLOCK_SIZE, AIO_INTRA_OP_PARALLELISM,
                                                             AIO_OVERLAP_EVENTS, AIO_QUEUE_DEPTH,
                                                             AIO_SINGLE_SUBMIT, AIO_USE_GDS)
        from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import PipelinedOptimizerSwapper
        from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

        for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                     ("LOCAL_RANK", "0")):
            os.environ.setdefault(k, v)
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        self.grads = [g.view(-1)[i:i + sub_group_size] for g in grads for i in range(0, g.numel(), sub_group_size)]
        self.flat = []
        for k, g in enumerate(self.grads):
            p = torch.empty(g.numel()).normal_()
            p.ds_id = str(k)
            self.flat.append(p)
        self.opt = DeepSpeedCPUAdam(self.flat, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                    eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw_mode=True)
        self.opt.param_groups[0]["params"] = []
        aio = {AIO_BLOCK_SIZE: 1 << 20, AIO_QUEUE_DEPTH: 32, AIO_INTRA_OP_PARALLELISM: 1, AIO_SINGLE_SUBMIT: False,
               AIO_OVERLAP_EVENTS: True, AIO_USE_GDS: False}
        cfg = DeepSpeedZeroOffloadOptimizerConfig(device="nvme", nvme_path=swap_dir, buffer_count=buffer_count,
                                                  pipeline_read=True, pipeline_write=True)
        self.folder = os.path.join(swap_dir, "deepspeed_peer")
        self.swapper = PipelinedOptimizerSwapper(swap_config=cfg, aio_config=aio, base_folder=self.folder,
                                                 optimizer=self.opt, largest_numel=max(g.numel() for g in self.grads),
                                                 device="cpu", dtype=torch.float32, timers=None)
        self.swapper.initialize_parameters(parameters=self.flat, src_tensors=self.flat)
        for p in self.flat:  # the master now lives in the swap files (as after ZeRO-3's init)
            p.data = torch.empty(0)
        self.threads = threads

    def step(self) -> None:
        n = len(self.flat)
        for i, p in enumerate(self.flat):
            nxt = self.flat[i + 1] if i + 1 < n else None
            self.swapper.swap_in_optimizer_state(parameter=p, async_parameter=nxt)
            p.grad = self.grads[i]
            self.opt.param_groups[0]["params"] = [p]
            self.opt.step()
            self.opt.param_groups[0]["params"] = []
            self.swapper.swap_out_optimizer_state(parameter=p, async_swap=nxt is not None)
            p.grad = None

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


# ---------------------------------------------------------------- compressed-state rows
# target speedups over the fp32-state step of the same params (issue 15, "NVMe step")
ROW_TARGETS = {("fp32", "int8", None): 2.5, ("bf16", "int8", None): 1.7, ("bf16", "int8", "bfloat16"): 2.5}


class OptimRow:
    """One row: offload.AdamW(offload="nvme", state_dtype=..., master_dtype=...) over params of
    its own (copies of the same values) and the grads every row shares.

    Not params shared between the rows: each row's step writes them, and a store with an
    fp32 master takes a param another row wrote as the user's new weights ([Note: params
    written by others] in offload/optim/flat/param_sync.py): a synchronous read, merge and
    write of that master on every step. Until the twenty-ninth session the rows shared one
    copy, and the fp32-master rows timed that (4-5x their ideal on an AMD EPYC with a fast
    disk) instead of a training step."""

    def __init__(self, base_params, grads, args, bound: int, state_dtype: str, master_dtype) -> None:
        self.state_dtype, self.master_dtype = state_dtype, master_dtype
        self.params = [torch.nn.Parameter(p.clone()) for p in base_params]
        for p, g in zip(self.params, grads):
            p.grad = g
        extra = {"master_dtype": master_dtype} if master_dtype is not None else {}
        self.swap_dir = tempfile.mkdtemp(prefix=f"rows-{state_dtype}-", dir=args.swap_dir)
        self.opt = offload.AdamW(self.params, lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                 eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], offload="nvme",
                                 swap_dir=self.swap_dir, max_host_bytes=bound,
                                 sub_group_size=args.sub_group_size, io_engine=args.engine,
                                 num_threads=args.threads, verify=args.verify, state_dtype=state_dtype, **extra)
        sw = getattr(self.opt._store, "_swap", self.opt._store)  # flat store (bf16) or per-param (fp32)
        self.layout, self.pipeline, self.store = sw.layout, sw.pipeline, sw.store
        self.rule = self.opt.rules()[0]
        self.sizes, self.threads = [p.numel() for p in self.params], args.threads
        self.kernel_state = self._kernel_buffers()

    def step(self) -> None:
        self.opt.step()

    def io_alone(self) -> None:
        self.pipeline.run(list(range(self.layout.num_groups)), lambda g, s, e, t: None)

    def _kernel_buffers(self):
        """States (and an fp32 master for bf16 params with fp32 master) of one sub-group, in RAM."""
        n = self.layout.sub_group_size
        states = {f.name: torch.zeros(f.storage_numel(n), dtype=f.storage_dtype) for f in self.rule.fields}
        bf16 = self.params[0].dtype == torch.bfloat16
        master = torch.zeros(n) if bf16 and self.master_dtype != "bfloat16" else None
        return states, master

    def kernel_alone(self, kernel) -> float:
        """The step's kernel calls over the same sub-group ranges, states in one RAM buffer."""
        states, master = self.kernel_state
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        step = max(1, int(max(float(st["step"]) for st in self.opt.state.values())) if self.opt.state else 1)
        t0 = time.perf_counter()
        for g in range(self.layout.num_groups):
            s, e = self.layout.group_range(g)
            for p, off, size in zip(self.params, offsets, self.sizes):
                a, b = max(s, off), min(e, off + size)
                if a >= b:
                    continue
                n = b - a
                sv = {f.name: states[f.name][:f.storage_numel(n)] for f in self.rule.fields}
                param, lowp = p.detach().view(-1)[a - off:b - off], None
                if master is not None:
                    param, lowp = master[:n], param
                kernel.rule_step(self.rule, param, p.grad.view(-1)[a - off:b - off], sv, step=step,
                                 param_lowp=lowp, num_threads=self.threads, rounding_seed=step,
                                 element_offset=a, **HYPER)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.opt.close()
        shutil.rmtree(self.swap_dir, ignore_errors=True)


def build_rows(args, bound: int, sizes, combos):
    """The rows that run, and {label: why not} for those that cannot (yet)."""
    from bench._states import CompressedCalls

    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    base = [torch.empty(n, dtype=dtype).normal_() for n in sizes]
    grads = [torch.empty(n, dtype=dtype).normal_() for n in sizes]
    rows, skipped = {}, {}
    for sd, md in combos:
        label = row_label(args.dtype, sd, md)
        try:
            row = OptimRow(base, grads, args, bound, sd, md)
        except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
            skipped[label] = f"not run: {type(exc).__name__}: {exc}".splitlines()[0][:200]
            continue
        try:
            with CompressedCalls(get_backend()) as calls:
                for _ in range(2):  # warm-up steps (the first writes the swap files)
                    row.step()
        except (NotImplementedError, ValueError, TypeError, RuntimeError) as exc:
            row.close()
            skipped[label] = f"not run: {type(exc).__name__}: {exc}".splitlines()[0][:200]
            continue
        why = calls.missing(sd, md)
        if why:
            row.close()
            skipped[label] = f"not supported: {why}"
            continue
        rows[label] = row
    return rows, skipped


def block_split(numel: int, parts: int, block: int = 256):
    """``numel`` in ``parts`` tensors, each but the last a multiple of ``block`` elements, as a
    real model's tensors mostly are (4096 x 4096, ...): a tensor that ends inside an 8-bit
    block makes the stores decode and re-encode the shared block, a cost of odd sizes that
    the rows would otherwise charge to every int8 step (``--params 1`` has no such edge)."""
    each = max(block, numel // parts // block * block)
    sizes = [each] * (parts - 1)
    if sum(sizes) >= numel:
        return [numel]
    return sizes + [numel - sum(sizes)]


def row_label(dtype: str, sd: str, md) -> str:
    short = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}
    label = f"{dtype} params, {short[sd]} states"
    return label + (f", {short[md or 'float32']} master" if dtype == "bf16" else "")


def run_rows(args, bound: int, sizes, combos) -> int:
    """Every (state_dtype, master_dtype) row interleaved rep by rep; ratios to the fp32-state row."""
    kernel = get_backend()
    rows, skipped = build_rows(args, bound, sizes, combos)
    times = {k: {"step": [], "io": [], "kernel": []} for k in rows}
    try:
        for rep in range(args.reps):
            order = list(rows)[rep % max(1, len(rows)):] + list(rows)[:rep % max(1, len(rows))]
            for label in order:  # rotated: no row always runs right after the same neighbour
                row = rows[label]
                t0 = time.perf_counter()
                row.step()
                times[label]["step"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                row.io_alone()
                times[label]["io"].append(time.perf_counter() - t0)
                times[label]["kernel"].append(row.kernel_alone(kernel))
        out = {label: rows_result(row, times[label], args.numel) for label, row in rows.items()}
    finally:
        for row in rows.values():
            row.close()
    print_rows(args, bound, out, skipped, combos, kernel)
    return 0


def rows_result(row: OptimRow, t, numel: int) -> dict:
    med = {k: statistics.median(v) for k, v in t.items()}
    ideal = max(med["io"], med["kernel"])
    return {"state_dtype": row.state_dtype, "master_dtype": row.master_dtype,
            "swapped_bytes_per_param": row.store.disk_bytes() / 2 / numel,  # two slots on disk
            "swap_files_bytes": row.store.disk_bytes(), "sub_group_size": row.layout.sub_group_size,
            "sub_groups": row.layout.num_groups, "step_s": med["step"], "io_alone_s": med["io"],
            "kernel_alone_s": med["kernel"], "step_over_ideal": med["step"] / ideal, "runs": t}


def print_rows(args, bound: int, out: dict, skipped: dict, combos, kernel) -> None:
    gib = 2 ** 30
    base_label = row_label(args.dtype, *combos[0])
    base = out.get(base_label)
    print(f"NVMe-swapped AdamW rows, N={args.numel:,} {args.dtype} params (tensors of {block_split(args.numel, args.params)} "
          f"elements), bound {bound / gib:.2f} GiB, "
          f"kernel {kernel.name} x{args.threads}, {args.reps} reps interleaved (medians)")
    print(f"{'row':<40}{'B/param':>8}{'step s':>9}{'I/O s':>8}{'kernel s':>9}{'/ideal':>7}"
          f"{'speedup':>9}{'target':>8}")
    for label, r in out.items():
        key = (args.dtype, r["state_dtype"], r["master_dtype"])
        speed = base["step_s"] / r["step_s"] if base else None
        r["speedup_vs_fp32_states"] = speed
        target = ROW_TARGETS.get(key)
        verdict = "" if target is None or speed is None else f"{target:.1f}x " + ("ok" if speed >= target else "MISS")
        print(f"{label:<40}{r['swapped_bytes_per_param']:>8.2f}{r['step_s']:>9.3f}{r['io_alone_s']:>8.3f}"
              f"{r['kernel_alone_s']:>9.3f}{r['step_over_ideal']:>7.2f}"
              f"{(f'{speed:.2f}x' if speed else '-'):>9}{verdict:>10}")
    for label, why in skipped.items():
        print(f"{label:<40}  {why}")
    print("(B/param: bytes of the swap files per param and slot; /ideal: step / max(I/O alone, kernel "
          "alone), target <= 1.15; speedup: the fp32-state row's step / this row's)")
    print(json.dumps({"bench": "swap_rows", "dtype": args.dtype, "numel": args.numel,
                      "tensors": block_split(args.numel, args.params), "max_host_bytes": bound,
                      "backend": kernel.name, "kernel_threads": args.threads, "reps": args.reps,
                      "rows": out, "skipped": skipped,
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}))


def row_combos(args):
    """(state_dtype, master_dtype) per row, the fp32-state row first; None if only the default."""
    from bench._states import MASTER_DTYPES, STATE_DTYPES, parse_list

    sds = parse_list(args.state_dtype, STATE_DTYPES, "--state-dtype")
    if args.master_dtype and args.dtype != "bf16":
        raise ValueError("--master-dtype: fp32 params are their own master; use it with --dtype bf16")
    mds = parse_list(args.master_dtype, MASTER_DTYPES, "--master-dtype") if args.master_dtype else (None,)
    # master None and "float32" are the same thing: an fp32 master (fp32 params are their own)
    combos = [(sd, None if md == "float32" else md) for sd in sds for md in mds]
    base = ("float32", None)
    combos = [base] + [c for c in dict.fromkeys(combos) if c != base]
    return None if combos == [base] else combos


def add_row_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--state-dtype", default="float32",
                    help="comma-separated of float32,bfloat16,int8: one row each (offload.AdamW(state_dtype=)), "
                         "interleaved, with the speedup over the fp32-state row")
    ap.add_argument("--master-dtype", default=None,
                    help="with --dtype bf16, comma-separated of float32,bfloat16: rows with this master "
                         "(bfloat16: the bf16 param is its own master, nothing else swapped but the states)")


def checked_combos(ap: argparse.ArgumentParser, args):
    """The rows mode's (state_dtype, master_dtype) combinations, or None (the default run)."""
    try:
        combos = row_combos(args)
    except ValueError as exc:
        ap.error(str(exc))
    if combos is not None and args.deepspeed:
        ap.error("--deepspeed runs with the default rows only (fp32 states)")
    return combos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=lambda s: int(s.replace("_", "")), default=200_000_000)
    ap.add_argument("--params", type=int, default=4, help="split numel into this many params")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="fp32: params are their own master (moments swapped); bf16: master swapped too")
    ap.add_argument("--max-host-bytes", default="512MiB")
    ap.add_argument("--sub-group-size", type=lambda s: int(s.replace("_", "")), default=None)
    ap.add_argument("--swap-dir", default="/var/tmp/offload-bench-swap",
                    help="on a real disk (not tmpfs): O_DIRECT and no page cache")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="kernel threads (default: offload's own, offload.get_num_threads(): what a user's "
                         "step runs with; 1 leaves a core to I/O)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--verify", action="store_true", help="per-block crc32 of every read and write")
    ap.add_argument("--deepspeed", action="store_true",
                    help="also time DeepSpeed's PipelinedOptimizerSwapper on the same grads, step by step "
                         "(needs deepspeed and its AsyncIOBuilder op: Debian libaio-dev)")
    add_row_args(ap)
    args = ap.parse_args()
    if args.threads is None:
        args.threads = offload.get_num_threads()

    os.makedirs(args.swap_dir, exist_ok=True)
    bound = parse_bytes(args.max_host_bytes)
    sizes = [args.numel // args.params + (1 if i < args.numel % args.params else 0) for i in range(args.params)]
    combos = checked_combos(ap, args)
    if combos is not None:
        return run_rows(args, bound, block_split(args.numel, args.params), combos)
    rss0 = rss_bytes()
    subject = (Fp32InPlace if args.dtype == "fp32" else Bf16Flat)(sizes, args, bound)
    kernel = get_backend()
    state_bytes = subject.swapped_bytes_per_param * args.numel
    lay, pipe = subject.layout, subject.pipeline
    try:
        groups = list(range(lay.num_groups))

        def io_alone() -> dict:
            return pipe.run(groups, lambda g, s, e, t: None)

        peer = None
        if args.deepspeed:
            ds_buffers = bound // (lay.sub_group_size * 4)
            peer = DeepSpeedPeer(args.swap_dir, [g.float() for g in subject.grads], lay.sub_group_size, ds_buffers,
                                 args.threads)
            for _ in range(2):
                peer.step()
        for _ in range(2):  # warm-up steps
            subject.step()
        rows = {"step": [], "io": [], "kernel": []}
        if peer is not None:
            rows["deepspeed"] = []
        details, peak = [], 0
        for _ in range(args.reps):
            with RssPeak() as rp:
                t0 = time.perf_counter()
                subject.step()
                rows["step"].append(time.perf_counter() - t0)
            stats = dict(subject.last_stats)
            peak = max(peak, rp.peak)
            details.append(stats)
            t0 = time.perf_counter()
            io_alone()
            rows["io"].append(time.perf_counter() - t0)
            rows["kernel"].append(subject.kernel_alone(kernel))
            if peer is not None:
                t0 = time.perf_counter()
                peer.step()
                rows["deepspeed"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in rows.items()}
        ideal = max(med["io"], med["kernel"])
        budget = bound + subject.host_bytes_per_param * args.numel  # max_host_bytes + params + grads
        phases = {k: statistics.median(d[k] for d in details) for k in (
            "swap_read_s", "swap_write_s", "kernel_s", "wait_read_s", "wait_write_s", "verify_s", "commit_s")}
        result = {
            "bench": "swap", "dtype": args.dtype, "numel": args.numel, "params": args.params,
            "states_in_swap_bytes": state_bytes, "swap_files_bytes": subject.store.disk_bytes(), "max_host_bytes": bound,
            "sub_group_size": lay.sub_group_size, "sub_groups": lay.num_groups, "buffers": len(pipe.buffers),
            "host_buffer_bytes": pipe.host_bytes, "engine": subject.store.engine.name,
            "direct": subject.store.files[0].direct,
            "backend": kernel.name, "kernel_threads": args.threads, "reps": args.reps, "verify": args.verify,
            "step_s": med["step"], "io_alone_s": med["io"], "kernel_alone_s": med["kernel"],
            "overlap_efficiency": ideal / med["step"], "step_over_ideal": med["step"] / ideal,
            "io_GBps": 2 * state_bytes / med["io"] / 1e9, "step_phases_s": phases,
            "peak_rss_bytes": peak, "rss_before_alloc_bytes": rss0, "rss_budget_bytes": budget,
            "peak_rss_over_budget": peak / budget, "peak_rss_minus_baseline_over_budget": (peak - rss0) / budget,
            "machine": f"{platform.node()} {os.cpu_count()} cpus {platform.processor() or platform.machine()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        if peer is not None:
            import deepspeed

            result.update({"peak_rss_includes_deepspeed": True,
                           "deepspeed_version": deepspeed.__version__, "deepspeed_step_s": med["deepspeed"],
                           "deepspeed_buffers": ds_buffers, "deepspeed_bytes_moved": 2 * 12 * args.numel,
                           "step_speedup_vs_deepspeed": med["deepspeed"] / med["step"]})
    finally:
        subject.close()
        if args.deepspeed and "peer" in locals() and peer is not None:
            peer.close()
    gib = 2 ** 30
    what = "moments" if args.dtype == "fp32" else "master + moments"
    print(f"NVMe-swapped AdamW, N={args.numel:,} {args.dtype} params ({len(sizes)} tensors), {what} in swap "
          f"{state_bytes / 1e9:.2f} GB ({result['swap_files_bytes'] / gib:.2f} GiB of files, two slots)")
    print(f"bound {bound / gib:.2f} GiB -> {result['sub_groups']} sub-groups of {result['sub_group_size']:,}, "
          f"{result['buffers']} buffers ({result['host_buffer_bytes'] / gib:.2f} GiB); engine {result['engine']}, "
          f"O_DIRECT {result['direct']}; kernel {result['backend']} x{args.threads} thread(s)")
    print(f"{'what':<28}{'median s':>10}  {'runs'}")
    names = [("step (read+kernel+write)", "step"), ("I/O alone", "io"), ("kernel alone", "kernel")]
    if "deepspeed" in rows:
        names.append(("DeepSpeed pipelined swapper", "deepspeed"))
    for name, key in names:
        print(f"{name:<28}{med[key]:>10.3f}  " + " ".join(f"{x:.3f}" for x in rows[key]))
    print(f"{'overlap efficiency':<28}{result['overlap_efficiency']:>10.3f}  (max(I/O, kernel) / step; "
          f"step = {result['step_over_ideal']:.3f} x ideal, target <= 1.15)")
    print(f"{'I/O rate (read+write)':<28}{result['io_GBps']:>10.2f}  GB/s")
    print(f"{'step phases (median)':<28}" + ", ".join(f"{k}={v:.3f}" for k, v in phases.items()))
    print(f"{'peak RSS in step':<28}{peak / gib:>10.2f}  GiB{' (DeepSpeed in the process too)' if peer else ''}; budget max_host+params+grads = {budget / gib:.2f} GiB "
          f"(x{result['peak_rss_over_budget']:.3f}; x{result['peak_rss_minus_baseline_over_budget']:.3f} without "
          f"the {rss0 / gib:.2f} GiB of the interpreter and torch)")
    if peer is not None:
        print(f"{'DeepSpeed / ours, step time':<28}{result['step_speedup_vs_deepspeed']:>10.2f}  (DeepSpeed {args.threads} "
              f"OMP thread(s), {ds_buffers} buffers of one sub-group, same bound; it moves 12 B/param each way, "
              f"we move {subject.swapped_bytes_per_param})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
