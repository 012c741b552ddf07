#!/usr/bin/env python3
"""Two builds of the native library side by side in one process: CPU ns per element.

    PYTHONPATH=$PWD python tools/kernel_ab.py OLD.so [NEW.so] [--sizes 20M,100M] [--threads 1,2]
        [--state-dtype float32,int8,bfloat16] [--master-dtype float32,bfloat16] [--steps 7]
        [--isa avx512vbmi,avx512]

bench/adam.py's compressed-state rows (AdamW through ``rule_step``, the same buffers and
hyperparameters), each row run by both libraries (NEW defaults to the tree's own
offload/kernels/liboffload_native.so), the contenders interleaved in a fresh random order
every step. The figure is CPU time (``time.process_time``: every thread of the process) per
element, median over the steps: on a shared machine wall time is mostly other jobs' noise,
while CPU time moves far less. Each ISA in ``--isa`` that a library supports is a row of its
own (a library without the avx512vbmi level runs only avx512). "vs fp32" is the fp32 kernel's
CPU time over the row's, same library: the issue's Gparam/s ratio when the run is not
memory bound.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench._states import MASTER_DTYPES, STATE_DTYPES, parse_list  # noqa: E402
from bench.adam import Buffers, StateBuffers, _state_step, adam_rule, parse_size, state_rows  # noqa: E402
from offload.kernels import native_backend  # noqa: E402


def load(path: str) -> native_backend.NativeBackend:
    """The backend over library ``path``. A library of another ABI version is taken too: for
    timing only (the versions so far changed what the kernels compute, not the call, and
    nothing here checks results), with a note on stderr."""
    import ctypes
    keep, keep_abi = native_backend.LIB_PATH, native_backend.ABI_VERSION
    native_backend.LIB_PATH = os.path.abspath(path)
    abi = ctypes.CDLL(native_backend.LIB_PATH).offload_abi_version()
    if abi != keep_abi:
        print(f"note: {path} has ABI {abi}, this tree {keep_abi}: timed as it is", file=sys.stderr)
        native_backend.ABI_VERSION = abi
    try:
        return native_backend.NativeBackend()
    finally:
        native_backend.LIB_PATH, native_backend.ABI_VERSION = keep, keep_abi


def with_isa(isa: str, fn):
    def run():
        os.environ["OFFLOAD_ISA"] = isa
        fn()
    return run


def measure(contenders, warmup: int, steps: int):
    names = list(contenders)
    cpu = {k: [] for k in names}
    rng = random.Random(0)
    for i in range(warmup + steps):
        for name in rng.sample(names, len(names)):
            t0 = time.process_time()
            contenders[name]()
            if i >= warmup:
                cpu[name].append(time.process_time() - t0)
    return {k: statistics.median(v) for k, v in cpu.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=native_backend.LIB_PATH)
    ap.add_argument("--sizes", default="20M")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--state-dtype", default="float32,int8")
    ap.add_argument("--master-dtype", default="")
    ap.add_argument("--isa", default="avx512vbmi,avx512")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    libs = {"old": load(args.old), "new": load(args.new)}
    sds = parse_list(args.state_dtype, STATE_DTYPES, "--state-dtype")
    mds = parse_list(args.master_dtype, MASTER_DTYPES, "--master-dtype") if args.master_dtype else ()
    rows = state_rows(sds, mds)
    isas = args.isa.split(",")
    print("# CPU ns per element (process time, median); 'vs fp32': that library's fp32 kernel / row")
    for n in (parse_size(s) for s in args.sizes.split(",")):
        buf = Buffers(n)
        sbuf = StateBuffers(buf, {sd for _, _, _, sd in rows}, bool(mds))
        for th in (int(t) for t in args.threads.split(",")):
            cont = {}
            for lname, lib in libs.items():
                for isa in (i for i in isas if i in lib.supported):
                    for label, pd, md, sd in rows:
                        if pd == "float32":
                            param, grad, lowp = buf.param.data, buf.param.grad, None
                        elif md == "bfloat16":
                            param, grad, lowp = sbuf.param16, sbuf.grad16, None
                        else:
                            param, grad, lowp = buf.param.data, sbuf.grad16, buf.lowp
                        step = _state_step(lib, adam_rule(sd), param, grad, sbuf.states[sd], lowp, th, False)
                        cont[(lname, isa, label)] = with_isa(isa, step)
            med = measure(cont, args.warmup, args.steps)
            for (lname, isa, label), t in sorted(med.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
                base = med[(lname, isa, "fp32p fp32")]
                print(f"N={n / 1e6:.0f}M thr={th} {label:<18} {lname:<4} {isa:<11} "
                      f"{t / n * 1e9:6.3f} ns/elem   vs fp32 {base / t:5.2f}x")
        del buf, sbuf
    os.environ.pop("OFFLOAD_ISA", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
