"""A zero denominator gives torch's inf/NaN through the numba kernels, never an exception.

numba compiles plain loops with Python's error model unless told otherwise: a float division
by zero raised ZeroDivisionError (and the check kept the serial and compressed loops scalar).
AdamW and Adagrad with ``eps=0`` divide by zero on a param whose grads are all zero; torch
gives NaN there. Every numba kernel is compiled with ``error_model="numpy"``, so the numba
backend gives the same NaN as torch, on the serial path (small tensors), the parallel one and
the compressed-state kernel.
"""
from __future__ import annotations

import pytest
import torch

import offload

pytest.importorskip("offload.kernels.numba_backend")

SIZES = [100, 20000]  # the serial kernels' side of 16384 and the parallel one


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_adamw_eps_zero_on_zero_grads_is_nan_as_in_torch(n, state_dtype):
    ours = torch.nn.Parameter(torch.ones(n))
    ref = torch.nn.Parameter(torch.ones(n))
    ours.grad, ref.grad = torch.zeros(n), torch.zeros(n)
    offload.AdamW([ours], lr=1e-3, eps=0.0, state_dtype=state_dtype, backend="numba").step()
    torch.optim.AdamW([ref], lr=1e-3, eps=0.0, foreach=False).step()
    assert ref.isnan().all()  # 0 / 0
    assert ours.isnan().all()


@pytest.mark.parametrize("n", SIZES)
def test_adagrad_eps_zero_on_zero_grads_is_nan_as_in_torch(n):
    ours = torch.nn.Parameter(torch.ones(n))
    ref = torch.nn.Parameter(torch.ones(n))
    ours.grad, ref.grad = torch.zeros(n), torch.zeros(n)
    offload.Adagrad([ours], lr=1e-2, eps=0.0, backend="numba").step()
    torch.optim.Adagrad([ref], lr=1e-2, eps=0.0, foreach=False).step()
    assert ref.isnan().all()
    assert ours.isnan().all()
