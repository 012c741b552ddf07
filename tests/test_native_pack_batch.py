"""The native batch's float32 structs made in one loop (``NativeBackend._pack_f32_batch``)
are byte for byte those of the general way (``batch_plan`` and ``_pack_f32``), for every
float32 rule, with and without a low-precision copy, over several steps and an empty tensor;
a batch with a compressed entry goes the general way."""
from __future__ import annotations

import pytest
import torch

from offload.kernels import native_backend
from offload.kernels._rule_step import StepEntry
from offload.optim.swapped_compute import _Fixed

from test_kernel_batch import CONFIGS
from test_kernels import _native_or_none

SIZES = [64, 7, 0, 300, 1, 64]
STEPS = [3, 1, 2, 3, 3, 1]


def _entries(rule, lowp_every=0):
    g = torch.Generator().manual_seed(0)
    out = []
    for k, (n, step) in enumerate(zip(SIZES, STEPS)):
        states = tuple(torch.zeros(n) for _ in rule.fields)
        lowp = torch.zeros(n, dtype=torch.bfloat16) if lowp_every and k % lowp_every == 0 else None
        out.append(StepEntry(torch.randn(n, generator=g), torch.randn(n, generator=g), states, lowp, step, None))
    return out


@pytest.fixture
def native():
    be = _native_or_none()
    if be is None:
        pytest.skip("no native library")
    return be


def _general(be, rule, entries, hyper, tail, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(native_backend.NativeBackend, "_pack_f32_batch", lambda *a: None)
        return be._pack_batch(rule, entries, hyper, tail)


@pytest.mark.parametrize("lowp_every", [0, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_loop_packs_the_structs_of_the_general_way(native, monkeypatch, name, lowp_every):
    rule, hp = CONFIGS[name]
    entries, hyper, tail = _entries(rule, lowp_every), _Fixed(dict(hp, grad_scale=0.5)), native._tail(1)
    fast = native._pack_f32_batch(rule, entries, hyper, tail)
    assert fast is not None and len(fast) == len([n for n in SIZES if n])
    assert fast == _general(native, rule, entries, hyper, tail, monkeypatch)


def test_a_compressed_entry_goes_the_general_way(native):
    rule, hp = CONFIGS["adamw"]
    entries = _entries(rule)
    entries[3] = entries[3]._replace(quant=object())
    assert native._pack_f32_batch(rule, entries, _Fixed(hp), native._tail(1)) is None
