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


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("state_dtype,stochastic", STATE_KINDS)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_native_equals_numba_bit_for_bit(cfg, state_dtype, stochastic, param_dtype):
    native = _native()
    rule, hp = CONFIGS[cfg]
    for k, n in enumerate(SIZES):
        lowp = torch.bfloat16 if param_dtype == torch.float32 and k % 2 else None
        # Every grad dtype among the serial sizes; float32 grads at the parallel one (70001),
        # whose kernel the numba pass compiles too: a 16-bit grad there was a numba
        # specialization of this test alone, ~5 s of CI's CPU each. The parallel kernel runs
        # the serial one over chunks, so the 16-bit grads are covered there.
        kw = dict(state_dtype=state_dtype, stochastic=stochastic, param_dtype=param_dtype,
                  grad_dtype=(torch.float16, torch.float32, torch.bfloat16)[k % 3] if k < 4 else torch.float32,
                  lowp_dtype=lowp, offset=1000 * k)
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
