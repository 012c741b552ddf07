"""The native and numba compressed-state kernels give the same bits on the same input.

Both are held to ``compressed_ref.compose_step`` around their own float32 rule, and the two
float32 rules agree bit for bit (tests/test_kernel_rules.py; Adam since its FMAs are written
out in numba), so the compressed steps must agree too: every rule, every state kind, both
param dtypes, on and off the block grid, serial and parallel sizes. Skips only where the
native library is missing or has no compressed kernel yet (NotImplementedError).
"""
from __future__ import annotations

import pytest
import torch

import offload.kernels as K

from test_numba_compressed import CONFIGS, NUMBA, STATE_KINDS, assert_same_bits, run

SIZES = [1, 17, 257, 4097, 70001]  # 70001: more than one thread's 65536-element chunk
BIG = (1 << 20) + 3  # every rule once at this size (test_native_equals_numba_at_a_million)


def _native():
    try:
        native = K.get_backend("native")
    except RuntimeError as exc:
        pytest.skip(f"no native library: {exc}")
    try:
        run(native, *CONFIGS["adam"], 7, steps=1)
    except NotImplementedError as exc:
        pytest.skip(f"the native library has no compressed kernel: {exc}")
    return native


def _grad_dtype(param_dtype, k):
    """The grad dtype at size index ``k``: float32 grads with float32 params, and with bf16
    params bf16 and float16 grads in turn (bf16 at the parallel size, as in
    test_native_equals_numba_at_a_million). numba compiles a kernel per (rule, state kind,
    param dtype, grad array type), ~2 s of CI's CPU each, and float16 and bfloat16 grads are
    one type to it (uint16 bits and a code): each grad dtype with each param dtype made
    twice the kernels for the same rules and state kinds."""
    if param_dtype != torch.bfloat16:
        return torch.float32
    return (torch.bfloat16, torch.float16)[k % 2]


def _sizes(state_dtype, param_dtype):
    """SIZES, and the parallel one (the last) for one param dtype per state kind: the
    parallel kernel is the serial one over chunks (a prange of three lines), compiled per
    kernel type as well; each rule, state kind and param dtype still runs it."""
    parallel = (state_dtype == "int8") == (param_dtype == torch.bfloat16)
    return SIZES if parallel else SIZES[:-1]


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("state_dtype,stochastic", STATE_KINDS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_equals_numba_bit_for_bit(cfg, state_dtype, stochastic, param_dtype):
    native = _native()
    rule, hp = CONFIGS[cfg]
    for k, n in enumerate(_sizes(state_dtype, param_dtype)):
        lowp = torch.bfloat16 if param_dtype == torch.float32 and k % 2 else None
        kw = dict(state_dtype=state_dtype, stochastic=stochastic, param_dtype=param_dtype,
                  grad_dtype=_grad_dtype(param_dtype, k), lowp_dtype=lowp, offset=1000 * k)
        assert_same_bits(run(native, rule, hp, n, **kw), run(NUMBA, rule, hp, n, **kw),
                         f"{cfg} {state_dtype} n={n}")


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_native_equals_numba_at_a_million(cfg):
    native = _native()
    rule, hp = CONFIGS[cfg]
    kw = dict(state_dtype="int8", stochastic=False, param_dtype=torch.bfloat16,
              grad_dtype=torch.bfloat16, lowp_dtype=None, offset=12345)
    assert_same_bits(run(native, rule, hp, BIG, **kw), run(NUMBA, rule, hp, BIG, **kw), f"{cfg} n={BIG}")


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_native_equals_numba_with_float32_states_and_a_bf16_param(cfg):
    native = _native()
    rule, hp = CONFIGS[cfg]
    for n in (7, 4097):
        kw = dict(state_dtype="float32", param_dtype=torch.bfloat16)
        assert_same_bits(run(native, rule, hp, n, **kw), run(NUMBA, rule, hp, n, **kw),
                         f"{cfg} n={n}")
