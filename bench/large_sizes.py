"""Sizes past 32 bits: one tensor of more than 2**31 elements, one I/O of more than 4 GiB.

The large arrays live in files (``torch.from_file(..., shared=True)``: page cache, which the
kernel can evict; ``time -v`` counts those pages in the RSS), so the checks need little
anonymous memory (``host`` keeps its int8 states, 4.4 GB, in RAM; ``nvme`` with n below 2**30
keeps param and grad in RAM). References are plain torch (torch.optim.AdamW, or the torch
backend's composition for compressed states), computed on windows at the start, around
2**31 and 2**32 and at the end. Default n = 2**31 + 17. Usage (a directory with ~35 GB free;
the files it makes are removed afterwards):

    python bench/large_sizes.py --dir D kernels      # sgd_plain + grad_sumsq
    python bench/large_sizes.py --dir D compressed   # AdamW, bf16 param, int8 states, 2 steps
    python bench/large_sizes.py --dir D io           # one 4 GiB + 12 KiB write and read at
                                                     # offset 4 GiB + 4 KiB, O_DIRECT, each engine
    python bench/large_sizes.py --dir D --n 600000017 nvme   # offload.AdamW fp32 states,
                                                     # slot files of 4.8 GB, checkpoint round trip
    python bench/large_sizes.py --dir D --state-dtype int8 nvme   # n = 2**31 + 17 on nvme
    python bench/large_sizes.py --dir D --state-dtype int8 host   # offload="cpu", int8 states

Prints one line per check: its name, "ok" or the mismatch, and seconds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

N = 2 ** 31 + 17  # elements: past int32 in the count, the index and the byte offset of fp32
CHUNK = 1 << 26


def file_tensor(d: str, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.truncate(n * torch.empty(0, dtype=dtype).element_size())
    return torch.from_file(path, shared=True, size=n, dtype=dtype)


def pattern(start: int, stop: int, salt: int) -> torch.Tensor:
    """Deterministic float32 values of elements [start, stop): depend on the whole index."""
    i = torch.arange(start, stop, dtype=torch.int64)
    return (((i * (2 * salt + 1) + (i >> 31) * 977) % 2039).to(torch.float32) - 1019.0) / 512.0


def fill(t: torch.Tensor, salt: int) -> None:
    for s in range(0, t.numel(), CHUNK):
        e = min(s + CHUNK, t.numel())
        t[s:e] = pattern(s, e, salt).to(t.dtype)


def windows(n: int):
    cuts = [(0, 4096), (2 ** 31 - 4096, 2 ** 31 + 4096), (2 ** 32 - 4096, 2 ** 32 + 4096), (n - 4096, n)]
    return [(max(s, 0), min(e, n)) for s, e in cuts if s < n]


def report(name: str, bad: str, t0: float) -> bool:
    print(f"{name:40s} {bad or 'ok':40s} {time.time() - t0:7.1f} s", flush=True)
    return not bad


def check_sgd(d: str, backend: str, n: int) -> bool:
    from offload.kernels import get_backend

    t0 = time.time()
    p = file_tensor(d, "p.f32", n, torch.float32)
    g = file_tensor(d, "g.bf16", n, torch.bfloat16)
    fill(p, 1)
    fill(g, 2)
    get_backend(backend).rule_step("sgd_plain", p, g, {}, step=1, lr=0.25)
    bad = ""
    for s, e in windows(n):
        ref = pattern(s, e, 1) - 0.25 * pattern(s, e, 2).to(torch.bfloat16).float()
        if not torch.equal(p[s:e], ref):
            i = int((p[s:e] != ref).nonzero()[0])
            bad = f"element {s + i}: {float(p[s + i])} != {float(ref[i])}"
            break
    # sum of squares (max_grad_norm): exact reference in double
    ss, nonfinite = get_backend(backend).grad_sumsq(g)
    ref_ss = sum(float(g[s:s + CHUNK].double().square().sum()) for s in range(0, n, CHUNK))
    if not bad and (nonfinite or abs(ss - ref_ss) > 1e-6 * ref_ss):
        bad = f"sumsq {ss} != {ref_ss} (nonfinite={nonfinite})"
    del p, g
    return report(f"sgd_plain+sumsq {backend} n={n}", bad, t0)


def check_compressed_adam(d: str, backend: str, n: int, state_dtype: str) -> bool:
    """AdamW, bf16 param (its own master, stochastic rounding) and ``state_dtype`` states, two
    steps, against the torch backend (``compressed_ref``'s composition) window by window: the
    windows start on the 256-element block grid, and their element_offset is their index."""
    from offload.kernels import get_backend
    from offload.kernels.fields import ADAM

    t0 = time.time()
    rule = ADAM.with_state_dtype(state_dtype)
    p = file_tensor(d, "p.bf16", n, torch.bfloat16)
    g = file_tensor(d, "g.bf16", n, torch.bfloat16)
    fill(p, 3)
    fill(g, 4)
    states = {f.name: file_tensor(d, f.name, f.storage_numel(n), f.storage_dtype) for f in rule.fields}
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
    for step in (1, 2):
        get_backend(backend).rule_step(rule, p, g, states, step=step, rounding_seed=12345, **hyper)
    bad = ""
    for s, e in windows(n):
        s = s - s % 256
        rp, rg = pattern(s, e, 3).to(torch.bfloat16), pattern(s, e, 4).to(torch.bfloat16)
        rs = {f.name: torch.zeros(f.storage_numel(e - s), dtype=f.storage_dtype) for f in rule.fields}
        for step in (1, 2):
            get_backend("torch").rule_step(rule, rp, rg, rs, step=step, rounding_seed=12345, element_offset=s,
                                           **hyper)
        got = [("param", p[s:e], rp)] + [
            (f.name, states[f.name][f.storage_offset(s):f.storage_offset(s) + f.storage_numel(e - s)], rs[f.name])
            for f in rule.fields]
        for name, x, y in got:
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                i = int((x.view(torch.uint8) != y.view(torch.uint8)).nonzero()[0])
                bad = f"{name} byte {i} of the window at {s} differs"
                break
        if bad:
            break
    del p, g, states
    return report(f"adamw {state_dtype} states {backend} n={n}", bad, t0)


def _torch_adamw_window(p0: torch.Tensor, grads, hyper: dict) -> torch.Tensor:
    """torch.optim.AdamW (foreach=False) over one window of the param: elementwise, so a
    window's steps are the whole tensor's on those elements."""
    w = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([w], foreach=False, **hyper)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def _reference_window(p0: torch.Tensor, grads, hyper: dict, state_dtype: str, offset: int) -> torch.Tensor:
    """The param window after ``grads``: torch.optim.AdamW for float32 states, the torch
    backend's composition (decode, float32 AdamW, encode) for compressed ones."""
    if state_dtype == "float32":
        return _torch_adamw_window(p0, grads, hyper)
    from offload.kernels import get_backend
    from offload.kernels.fields import ADAM

    rule = ADAM.with_state_dtype(state_dtype)
    p = p0.clone()
    st = {f.name: torch.zeros(f.storage_numel(p.numel()), dtype=f.storage_dtype) for f in rule.fields}
    for step, g in enumerate(grads, 1):
        get_backend("torch").rule_step(rule, p, g, st, step=step, element_offset=offset, lr=hyper["lr"],
                                       beta1=hyper["betas"][0], beta2=hyper["betas"][1], eps=hyper["eps"],
                                       weight_decay=hyper["weight_decay"], decoupled=True)
    return p


def _param_tensor(d: str, n: int, file_backed: bool) -> torch.Tensor:
    return file_tensor(d, "param.f32", n, torch.float32) if file_backed else torch.empty(n)


def check_nvme(d: str, n: int, state_dtype: str, file_backed: bool, where: str = "nvme") -> bool:
    """offload.AdamW(offload=where: "nvme", or "cpu") over one fp32 param of ``n`` elements: two steps against
    torch.optim.AdamW (window by window; fp32 states only), then save_checkpoint, a third
    step, and a new optimizer that loads the checkpoint into the params of step 2 (in the
    windows) and takes the same third step: the same bits. ``file_backed``: param and grad in files (for n past 2**31)."""
    import offload

    t0 = time.time()
    swap, ckpt = os.path.join(d, "swap"), os.path.join(d, "ckpt")
    os.makedirs(swap)
    os.makedirs(ckpt)
    param = torch.nn.Parameter(_param_tensor(d, n, file_backed))
    fill(param.data, 5)
    param.grad = file_tensor(d, "grad.f32", n, torch.float32) if file_backed else torch.empty(n)
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    kw = dict(offload="nvme", swap_dir=swap, max_host_bytes="256MiB") if where == "nvme" else dict(offload=where)
    if state_dtype != "float32":
        kw["state_dtype"] = state_dtype
    opt = offload.AdamW([param], **hyper, **kw)
    for step in (1, 2):
        fill(param.grad, 10 + step)
        opt.step()
    swap_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(swap) for f in fs)
    bad = ""
    for s, e in windows(n):
        s = s - s % 256  # (int8 states: the window starts on a block)
        ref = _reference_window(pattern(s, e, 5), [pattern(s, e, 11), pattern(s, e, 12)], hyper, state_dtype, s)
        if not torch.allclose(param.data[s:e], ref, rtol=1e-5, atol=1e-6):
            i = int((~torch.isclose(param.data[s:e], ref, rtol=1e-5, atol=1e-6)).nonzero()[0])
            bad = f"step 2, element {s + i}: {float(param[s + i])} != {float(ref[i])}"
            break
    opt.save_checkpoint(ckpt)
    after2 = [param.data[s:e].clone() for s, e in windows(n)]
    fill(param.grad, 13)
    opt.step()
    after3 = [param.data[s:e].clone() for s, e in windows(n)]
    opt.close()
    for (s, e), x in zip(windows(n), after2):  # the params of step 2 (the checkpoint holds
        param.data[s:e] = x                     # no fp32 CPU param: it is its own master)
    again = offload.AdamW([param], **hyper, **kw)
    again.load_checkpoint(ckpt)
    again.step()
    for (s, e), x in zip(windows(n), after3):
        if not bad and not torch.equal(param.data[s:e], x):
            bad = f"step 3 after load_checkpoint differs in the window at {s}"
    again.close()
    ckpt_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(ckpt) for f in fs)
    del param, opt, again
    for root in (swap, ckpt):
        for r, ds, fs in os.walk(root, topdown=False):
            for f in fs:
                os.unlink(os.path.join(r, f))
            for x in ds:
                os.rmdir(os.path.join(r, x))
        os.rmdir(root)
    return report(f"{where} adamw {state_dtype} n={n} swap {swap_bytes / 1e9:.1f} GB ckpt {ckpt_bytes / 1e9:.1f} GB",
                  bad, t0)


def mapped(d: str, name: str, nbytes: int) -> "tuple[object, memoryview]":
    """A writable byte buffer of ``nbytes`` backed by a file (page cache, not RSS)."""
    import mmap

    path = os.path.join(d, name)
    with open(path, "wb+") as f:
        f.truncate(nbytes)
        m = mmap.mmap(f.fileno(), nbytes)
    return m, memoryview(m)


def check_io(d: str, engine_name: str, ring: str, nbytes: int, offset: int, block_size: int) -> bool:
    """One write of ``nbytes`` from a buffer and one read back into another, at ``offset``,
    through ``engine_name`` with ``block_size`` pieces (O_DIRECT); the bytes must match."""
    import numpy as np

    from offload.io import open_engine

    from offload.io import engine_unavailable_reason, probe_direct
    from offload.io.uring import ring_kind

    t0 = time.time()
    name = f"io {engine_name}{'/' + ring if ring else ''} {nbytes / 2**30:.2f} GiB at {offset / 2**30:.0f} GiB " \
           f"bs={block_size / 2**30:.2f} GiB"
    if ring:
        os.environ["OFFLOAD_URING_RING"] = ring
    why = engine_unavailable_reason(engine_name) or (ring and ring_kind() != ring and f"no {ring} ring here")
    if why:
        os.environ.pop("OFFLOAD_URING_RING", None)
        print(f"{name:40s} skipped: {why}", flush=True)
        return True
    src_map, src = mapped(d, "src", nbytes)
    dst_map, dst = mapped(d, "dst", nbytes)
    a = np.frombuffer(src, dtype=np.uint64)
    for s in range(0, a.size, CHUNK):  # every 8 bytes hold their own byte offset
        a[s:s + CHUNK] = np.arange(s, min(s + CHUNK, a.size), dtype=np.uint64) * 8
    bad = ""
    try:
        with open_engine(engine_name, block_size=block_size, directory=d, direct=probe_direct(d)[0]) as eng:
            with eng.open(os.path.join(d, "file"), write=True, create=True) as f:
                wrote = eng.write(f, offset, src)
                got = eng.read(f, offset, dst)
                stats = eng.stats()
        b = np.frombuffer(dst, dtype=np.uint64)
        if wrote != nbytes or got != nbytes:
            bad = f"wrote {wrote}, read {got} of {nbytes}"
        for s in range(0, a.size, CHUNK):
            if not bad and not np.array_equal(a[s:s + CHUNK], b[s:s + CHUNK]):
                i = s + int(np.nonzero(a[s:s + CHUNK] != b[s:s + CHUNK])[0][0])
                bad = f"byte {8 * i}: {int(b[i])} != {int(a[i])}"
        del a, b
    except Exception as exc:  # the check reports what the engine raised
        bad = f"{type(exc).__name__}: {exc}"[:200]
        stats = {}
    finally:
        src.release()
        dst.release()
        src_map.close()
        dst_map.close()
        os.environ.pop("OFFLOAD_URING_RING", None)
    return report(name + f" resub={stats.get('resubmits')}", bad, t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--n", type=int, default=N)
    ap.add_argument("--state-dtype", default="float32", help="nvme: float32, bfloat16 or int8 states")
    ap.add_argument("--backends", default="native,numba", help="kernels, compressed: the kernel backends to check")
    ap.add_argument("--io-bytes", type=int, default=2 ** 32 + 3 * 4096,
                    help="io: bytes of the one request (a multiple of 4096; default past the 32-bit SQE length)")
    ap.add_argument("what", nargs="+", choices=["kernels", "compressed", "io", "nvme", "host"])
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ok = True
    try:
        if "kernels" in args.what:
            for backend in args.backends.split(","):
                ok &= check_sgd(args.dir, backend, args.n)
        if "compressed" in args.what:
            for backend in args.backends.split(","):
                ok &= check_compressed_adam(args.dir, backend, args.n, "int8")
        if "io" in args.what:
            for engine, ring in (("uring", "liburing"), ("uring", "native"), ("threads", ""), ("aiofiles", "")):
                ok &= check_io(args.dir, engine, ring, args.io_bytes, 2 ** 32 + 4096, 8 << 30)
        if "nvme" in args.what:
            ok &= check_nvme(args.dir, args.n, args.state_dtype, args.n > 2 ** 30)
        if "host" in args.what:
            ok &= check_nvme(args.dir, args.n, args.state_dtype, args.n > 2 ** 30, where="cpu")
    finally:
        for name in ("p.f32", "g.bf16", "p.bf16", "exp_avg", "exp_avg_sq", "src", "dst", "file", "param.f32",
                     "grad.f32"):
            if os.path.exists(os.path.join(args.dir, name)):
                os.unlink(os.path.join(args.dir, name))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
