"""Bits that must not move: the folded Adam constants, and the SIMD units against each other.

The constants were folded twice before issue #14 (C++ in native/dispatch.cpp, Python in the
numba backend) and are folded once now (``offload.kernels.adam_consts.fold_adam``); the
float32 bit patterns below were produced by the old folding, so a change in rounding, in
the order of an operation or in a degenerate case (x86's negative default NaN, an infinite
step size) shows up here, not as a drift in some trained model. The AVX2 and AVX-512 units
returned identical bits before the change on every case below; they still must.
"""
from __future__ import annotations

from array import array

import pytest
import torch

import offload.kernels as K
from offload.kernels.adam_consts import AdamConsts, fold_adam


def _bits(x: float) -> int:
    return int.from_bytes(array("f", [x]).tobytes(), "little")


BASE = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

# (arguments, the 9 float32 constants as bits in AdamConsts order, use_l2, lerp_from_end)
FOLDED = [
    (dict(BASE, step=1),
     (0x3f800000, 0x3c23d70a, 0x3f7fff58, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3d0186e2, 0x322bcc77, 0xbc23d70a),
     False, False),
    (dict(BASE, step=12345),
     (0x3f800000, 0x3c23d70a, 0x3f7fff58, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3f7fffdc, 0x322bcc77, 0xba83126f),
     False, False),
    (dict(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1, step=7, decoupled=False),
     (0x3f800000, 0x3dcccccd, 0x3f800000, 0x3dcccccd, 0x3f733333, 0x3d4ccccd, 0x3f0c9ae1, 0x358637bd, 0xba16be43),
     True, False),
    (dict(lr=0.3, beta1=0.3, beta2=0.99, eps=1e-3, weight_decay=0.0, step=3, decoupled=True),
     (0x3f800000, 0x0, 0x3f800000, 0xbe99999a, 0x3f7d70a4, 0x3c23d70a, 0x3e3079d7, 0x3a83126f, 0xbe9ddcbe),
     False, True),
    (dict(lr=1e-2, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0, step=2, decoupled=False),
     (0x3f800000, 0x0, 0x3f800000, 0x0, 0x0, 0x3f800000, 0x3f800000, 0x0, 0xbc23d70a),
     False, True),
    (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, step=5, decoupled=False,
          bias_correction=False, grad_scale=0.37),
     (0x3ebd70a4, 0x3d4ccccd, 0x3f800000, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3f800000, 0x322bcc77, 0xbc23d70a),
     True, False),
    (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=9, decoupled=True,
          maximize=True, grad_scale=1 / 1024),
     (0xba800000, 0x3c23d70a, 0x3f7ff972, 0x3dcccccd, 0x3f7fbe77, 0x3a83126f, 0x3dc1e6fc, 0x322bcc77, 0xbc85bac6),
     False, False),
    (dict(lr=0.1, beta1=0.5, beta2=0.5, eps=1e-30, weight_decay=1e-5, step=1, decoupled=True),
     (0x3f800000, 0x3727c5ac, 0x3f7fffef, 0xbf000000, 0x3f000000, 0x3f000000, 0x3f3504f3, 0x0da24260, 0xbe4ccccd),
     False, True),
    # degenerate hyperparameters fold as the C kernel folded them (IEEE, never a Python error):
    # beta1 = 1 divides by a zero bias correction (lr > 0: -inf; lr = 0: 0/0, a NaN)
    (dict(BASE, beta1=1.0, weight_decay=0.0, step=3),
     (0x3f800000, 0x0, 0x3f800000, 0x0, 0x3f7fbe77, 0x3a83126f, 0x3d603c29, 0x322bcc77, 0xff800000),
     False, False),
    (dict(BASE, lr=0.0, beta1=1.0, weight_decay=0.0, step=3),
     (0x3f800000, 0x0, 0x3f800000, 0x0, 0x3f7fbe77, 0x3a83126f, 0x3d603c29, 0x322bcc77, 0x7fc00000),
     False, False),
    # beta2 > 1: the square root of a negative bias correction, x86's default NaN
    (dict(BASE, beta2=1.2, weight_decay=0.0, step=1),
     (0x3f800000, 0x0, 0x3f800000, 0x3dcccccd, 0x3f99999a, 0xbe4ccccd, 0xffc00000, 0x322bcc77, 0xbc23d70a),
     False, False),
    # beta1**step overflows (Python's ** would raise), weight decay past float32's range
    (dict(BASE, beta1=-2.0, weight_decay=1e300, step=2000),
     (0x3f800000, 0x7f800000, 0xff800000, 0x40000000, 0x3f7fbe77, 0x3a83126f, 0x3f6e10f6, 0x322bcc77, 0x0),
     False, True),
    # lerp from the end with w = 1 - beta1 = 1e8: w - 1 is rounded in float32, back to 1e8
    (dict(BASE, beta1=-1e8, step=1),
     (0x3f800000, 0x3c23d70a, 0x3f7fff58, 0x4cbebc20, 0x3f7fbe77, 0x3a83126f, 0x3d0186e2, 0x322bcc77, 0xad2febff),
     False, True),
]


@pytest.mark.parametrize("kw,bits,use_l2,from_end", FOLDED, ids=[str(i) for i in range(len(FOLDED))])
def test_fold_adam_gives_the_old_bits(kw, bits, use_l2, from_end):
    c = fold_adam(**kw)
    assert isinstance(c, AdamConsts)
    got = tuple(_bits(x) for x in c[:9])
    assert got == bits, [(name, hex(a), hex(b)) for name, a, b in zip(c._fields, got, bits) if a != b]
    assert (c.use_l2, c.lerp_from_end) == (use_l2, from_end)
    # each float is a float32 value, whatever rounds it next (a C struct, numpy.float32)
    assert all(array("f", [x])[0] == x for x in c[:9] if x == x)
    assert all(type(x) is bool for x in c[9:])


def test_fold_adam_reads_tensor_and_numpy_scalars():
    import numpy as np
    kw = dict(BASE, step=4)
    ref = fold_adam(**kw)
    assert fold_adam(**dict(kw, lr=torch.tensor(kw["lr"], dtype=torch.float64),
                            beta2=np.float64(kw["beta2"]))) == ref


# ---------------------------------------------------------------- AVX2 == AVX-512

SIZES = [1, 7, 15, 16, 17, 4097, 2**20 + 3]
CONFIGS = {
    "adamw": dict(weight_decay=0.1, decoupled=True),
    "l2-maximize-scaled-nobc": dict(weight_decay=0.05, decoupled=False, maximize=True,
                                    grad_scale=0.37, bias_correction=False),
    "low-beta1": dict(weight_decay=0.1, decoupled=True, beta1=0.3, beta2=0.99, lr=0.3, eps=1e-3),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _run(native, monkeypatch, isa, n, grad_dtype, lowp_dtype, cfg):
    monkeypatch.setenv("OFFLOAD_ISA", isa)
    gen = torch.Generator().manual_seed(n)
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    lowp = None if lowp_dtype is None else torch.empty(n, dtype=lowp_dtype)
    kw = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, **cfg}
    for step in (1, 2):
        g = torch.randn(n, generator=gen).to(grad_dtype)
        native.adam_step(p, g, m, v, step=step, param_lowp=lowp, num_threads=2, **kw)
    out = [t.view(torch.int32) for t in (p, m, v)]
    return out + ([] if lowp is None else [lowp.view(torch.int16)])


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("grad", list(DTYPES))
def test_simd_units_give_identical_adam_bits(monkeypatch, grad, cfg):
    try:
        native = K.get_backend("native")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    if not {"avx2", "avx512"} <= set(native.supported):
        pytest.skip("needs a CPU with AVX2 and AVX-512")
    for n in SIZES:
        for lowp in (None, torch.bfloat16, torch.float16):
            a = _run(native, monkeypatch, "avx2", n, DTYPES[grad], lowp, CONFIGS[cfg])
            b = _run(native, monkeypatch, "avx512", n, DTYPES[grad], lowp, CONFIGS[cfg])
            for name, x, y in zip(("param", "exp_avg", "exp_avg_sq", "lowp"), a, b):
                assert torch.equal(x, y), (n, lowp, name)


def test_fold_cache_returns_what_folding_returns():
    from offload.kernels.adam_consts import FoldCache
    cache = FoldCache()
    base = (1e-3, 0.9, 0.999, 1e-8, 0.0, 5, False, True, False, 1.0)
    assert cache(base) == fold_adam(*base)
    assert cache(base) is cache(base)  # the second call is a hit
    # -0.0 == 0.0 in Python, but its sign reaches the kernel (l2 = -0.0): a different key
    neg = base[:4] + (-0.0,) + base[5:]
    assert _bits(cache(neg).l2) == 0x80000000 and _bits(cache(base).l2) == 0
    # a step past 2**53 folds as float(step) does: what the key holds
    for step in (2**53, 2**53 + 1, 6, 5):
        h = base[:5] + (step,) + base[6:]
        assert cache(h) == fold_adam(*h)
    # arguments that are not plain numbers skip the cache; fold_adam reads or refuses them
    h = (torch.tensor(1e-3),) + base[1:]
    assert cache(h) == fold_adam(*base)
    with pytest.raises(ValueError, match="could not convert string to float: 'fast'"):
        cache(("fast",) + base[1:])
