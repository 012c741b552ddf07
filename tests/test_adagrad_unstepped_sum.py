"""torch's Adagrad has every param's ``sum`` from construction: one written before the param's
first step is in its state_dict and is where that step starts. Ours lost it in the host
store's checkpoints (their load kept only the params that stepped) and in the swapped
store's state_dict() (it exported only the params that stepped), found by
tools/history_fuzz.py (seeds 261 and 533)."""
from __future__ import annotations

import copy

import pytest
import torch

import offload

SIZES = (4097, 17, 7)
STORES = {"host": (torch.float32, {"offload": "cpu"}), "host-int8": (torch.float32, {"state_dtype": "int8"}),
          "nvme": (torch.float32, {"offload": "nvme"}), "flat": (torch.bfloat16, {"offload": "cpu"}),
          "flat-nvme": (torch.bfloat16, {"offload": "nvme"})}
KW = dict(lr=0.1, initial_accumulator_value=0.1)


def _params(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen).to(dtype).requires_grad_() for n in SIZES]


def _opt(store, tmp_path, name):
    dtype, kw = STORES[store]
    if kw.get("offload") == "nvme":
        (tmp_path / name).mkdir()
        kw = dict(kw, swap_dir=str(tmp_path / name))
    params = _params(dtype)
    return offload.Adagrad(params, **KW, **kw), params


def _write(opt, params):
    """Param 0's sum filled (assigned where the host store holds it as int8 blocks, which
    opt.state shows as they are), param 2's assigned; param 1's left (none of them stepped)."""
    if getattr(opt, "state_dtype", "float32") == "int8":
        opt.state[params[0]]["sum"] = torch.full(params[0].shape, 0.5)
    else:
        opt.state[params[0]]["sum"].fill_(0.5)
    opt.state[params[2]]["sum"] = torch.full(params[2].shape, 2.0)


def _torch_written():
    params = _params()
    ref = torch.optim.Adagrad(params, **KW)
    _write(ref, params)
    return ref, params


def _same_sums(got, want):
    assert sorted(got["state"]) == sorted(want["state"])
    for i, e in want["state"].items():
        assert float(got["state"][i]["step"]) == float(e["step"])
        torch.testing.assert_close(got["state"][i]["sum"], e["sum"], rtol=0, atol=0)


@pytest.mark.parametrize("store", sorted(STORES))
def test_a_sum_written_before_the_first_step_is_in_state_dict(store, tmp_path):
    opt, params = _opt(store, tmp_path, "swap")
    _write(opt, params)
    ref, _ = _torch_written()
    _same_sums(opt.state_dict(), ref.state_dict())
    opt.close()


@pytest.mark.parametrize("dst", ["host", "host-int8", "nvme"])
@pytest.mark.parametrize("src", ["host", "host-int8", "nvme"])
def test_a_sum_written_before_the_first_step_survives_a_checkpoint(src, dst, tmp_path):
    """(fp32 params: the stage-0 checkpoint format every such store reads; a flat store's
    has masters.)"""
    opt, params = _opt(src, tmp_path, "a")
    _write(opt, params)
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    back, back_params = _opt(dst, tmp_path, "b")
    back.load_checkpoint(str(tmp_path / "ckpt"))
    ref, ref_params = _torch_written()
    _same_sums(back.state_dict(), ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in ref_params]
    for p, q, g in zip(back_params, ref_params, grads):  # the first step starts from them
        p.grad, q.grad = g.to(p.dtype), g.float()
    back.step()
    ref.step()
    got, want = back.state_dict()["state"], ref.state_dict()["state"]
    for i in range(len(SIZES)):
        if dst == "host-int8" and SIZES[i] >= 4096:
            continue  # (compressed: values compared by the int8 tests)
        torch.testing.assert_close(got[i]["sum"], want[i]["sum"], rtol=1e-6, atol=0)
    back.close()
    opt.close()
