#!/usr/bin/env python3
"""Every float32 in [-1, 1] through a backend's int8 encoder, against quant.py's scheme.

    PYTHONPATH=$PWD python tools/q8_exhaustive.py [--backends native,numba]
        [--isas avx512vbmi,avx512,avx2,scalar] [--maps signed,unsigned] [--threads 2] [--stride 1]

The encoder's code of xn is #{i : mid[i] < xn} (quant.py; native/q8_buckets.h, [Note:
bucketed encoder], computes it from a table indexed by the float bits). With absmax 1 the
kernel divides by 1, so xn is the value itself: the values go in as SGD's first-step momentum
buffer (buf = grad, lr 0) in blocks of 255 values and one 1.0 (each block's absmax), in
ascending order, 2**31 + 2 values per map. The expected codes of a chunk come from where
each midpoint falls in the sorted chunk (searchsorted + a running count), not from the
encoder's own method. The unsigned map goes through the same signed state: the native
library reads the maps through the pointers the backend passes, so for that run the signed
slots point at the unsigned map and midpoints (numba: its table dict is patched the same
way). ``--stride k`` checks every k-th float only (a quick look). Exits 1 on the first
mismatch, printing the value, the code and the expected code. The native ISAs default to every
level the CPU supports: avx512vbmi (native/q8_avx512vbmi.cpp's byte-permute encoder) included
where the CPU has VBMI.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import offload.kernels as K
from offload.kernels import native_backend, numba_backend, quant
from offload.kernels.fields import SGD

NEG = 0x3F800001  # -1.0 .. -0.0: bit patterns 0xBF800000 down to 0x80000000
TOTAL = 2 * NEG  # then +0.0 .. 1.0
BLOCKS = 1 << 16  # a chunk: 65536 blocks of 255 values and a 1.0


def ascending(start: int, count: int, stride: int) -> np.ndarray:
    """Values start, start + stride, ... (count of them) of the ascending list of [-1, 1]."""
    stop = start + count * stride
    parts = []
    if start < NEG:  # the negative half, bits descending (arange in uint32: half the bytes)
        k = min(count, -(-(NEG - start) // stride))
        parts.append(np.arange(0xBF800000 - start, 0xBF800000 - start - k * stride, -stride, dtype=np.int64))
    if stop > NEG:
        first = start + max(0, -(-(NEG - start) // stride)) * stride  # first index >= NEG
        parts.append(np.arange(first - NEG, stop - NEG, stride, dtype=np.int64))
    return np.concatenate(parts).astype(np.uint32).view(np.float32)


def expected_codes(vals: np.ndarray, mid: np.ndarray) -> np.ndarray:
    """#{i : mid[i] < v} for sorted vals: the running count of midpoints passed."""
    first_above = np.searchsorted(vals, mid, side="right")  # first value > mid[i]
    return np.cumsum(np.bincount(first_above, minlength=vals.size + 1))[:vals.size].astype(np.uint8)


def blocks_of(vals: np.ndarray) -> torch.Tensor:
    """vals in blocks of 255 and a 1.0 (each block's absmax), zeros after the last value."""
    m = -(-vals.size // 255)
    padded = np.zeros(m * 255, dtype=np.float32)
    padded[:vals.size] = vals
    g = np.empty((m, 256), dtype=np.float32)
    g[:, :255] = padded.reshape(m, 255)
    g[:, 255] = 1.0
    return torch.from_numpy(g).view(-1)


def encode(backend, g: torch.Tensor, count: int, threads: int) -> np.ndarray:
    """The backend's codes of the first count values of blocks g."""
    n = g.numel()
    crule = SGD.with_state_dtype("int8")
    f = crule.fields[0]
    buf = torch.zeros(f.storage_numel(n), dtype=f.storage_dtype)
    backend.rule_step(crule, torch.zeros(n), g, {"momentum_buffer": buf}, step=1, lr=0.0,
                      momentum=0.9, num_threads=threads)
    codes = buf.view(torch.uint8).numpy().reshape(n // 256, quant.PACKED_BLOCK)[:, :255]
    return codes.reshape(-1)[:count]


class unsigned_tables:
    """Within the block, the backends' signed map and midpoints are the unsigned ones."""

    def __enter__(self):
        self.ptrs = native_backend._TABLE_PTRS
        u_map, u_mid = self.ptrs[2], self.ptrs[3]
        native_backend._TABLE_PTRS = (u_map, u_mid, u_map, u_mid)
        self.maps = dict(numba_backend._QUANT_MAPS)
        # the unsigned midpoints without the square root the unsigned states take first:
        # this checks the encoder's count of midpoints below xn, which both codes share
        numba_backend._QUANT_MAPS[True] = numba_backend._QUANT_MAPS[False][:4] + (False,)
        return self

    def __exit__(self, *exc):
        native_backend._TABLE_PTRS = self.ptrs
        numba_backend._QUANT_MAPS.clear()
        numba_backend._QUANT_MAPS.update(self.maps)


def check(encoders, signed: bool, threads: int, stride: int) -> bool:
    """Every encoder (name, backend, isa) on the map's values; False at the first mismatch."""
    mid = quant.quant_map(signed)[1].numpy()
    which = "signed" if signed else "unsigned"
    total = -(-TOTAL // stride)
    chunk = BLOCKS * 255
    t0 = time.perf_counter()
    for start in range(0, total, chunk):
        vals = ascending(start * stride, min(chunk, total - start), stride)
        want = expected_codes(vals, mid)
        g = blocks_of(vals)
        for name, backend, isa in encoders:
            if isa:
                os.environ["OFFLOAD_ISA"] = isa
            bad = np.flatnonzero(encode(backend, g, vals.size, threads) != want)
            if bad.size:
                j = bad[0]
                got = encode(backend, g, vals.size, threads)[j]
                print(f"{name} {which}: {bad.size} mismatches in a chunk; first: x = {vals[j]!r} "
                      f"(bits {vals[j:j + 1].view(np.uint32)[0]:#010x}) code {got} expected {want[j]}")
                return False
    print(f"{which}: {total} values, every encoder ({', '.join(e[0] for e in encoders)}) equal "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="native")
    ap.add_argument("--isas", default="", help="native ISAs (default: every supported one)")
    ap.add_argument("--maps", default="signed,unsigned")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stride", type=int, default=1)
    args = ap.parse_args()
    encoders = []
    for bname in args.backends.split(","):
        backend = K.get_backend(bname)
        isas = (args.isas.split(",") if args.isas else backend.supported) if bname == "native" else [""]
        encoders += [(f"{bname} {isa}".strip(), backend, isa) for isa in isas]
    ok = True
    for m in args.maps.split(","):
        if m == "signed":
            ok &= check(encoders, True, args.threads, args.stride)
        else:
            with unsigned_tables():
                ok &= check(encoders, False, args.threads, args.stride)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
