"""complex64 params ([Note: complex params] in offload/optim/host_dtypes.py): Adam, AdamW,
SGD and Adagrad step them as torch's optimizers do (each as its float32 real view), in the
host store (offload="none" / "cpu"), against torch's (foreach=False) element by element at
DESIGN.md's tolerances, states complex64 in opt.state and state_dict; clipping, checkpoints
and state-dict interchange with torch; every other store, Lion and complex128 refused."""
from __future__ import annotations

import copy

import pytest
import torch

import offload

TOL = dict(rtol=1e-5, atol=1e-6)
STEPS = 12
SIZES = (1, 7, 17, 4097)  # complex elements: 2, 14, 34, 8194 floats (SIMD tails)

CONFIGS = [
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, amsgrad=True, maximize=True, weight_decay=0.1)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.5, dampening=0.3, maximize=True)),
    ("SGD", dict(lr=0.05)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.2, weight_decay=0.1)),
]


def _param(n: int, contiguous: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(n, dtype=torch.complex64, generator=g).requires_grad_()
    # every other element of a wider tensor: a strided param, stepped through a copy
    return torch.randn(n, 2, dtype=torch.complex64, generator=g)[:, 0].detach().requires_grad_()


def _grads(params, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, dtype=p.dtype, generator=g) for p in params]


def _pair(n: int, contiguous: bool):
    """The same values twice, with the same strides (a real param beside, as models mix them)."""
    mine = [_param(n, contiguous, 0), torch.randn(5, generator=torch.Generator().manual_seed(1)).requires_grad_()]
    ref = [_param(n, contiguous, 0), mine[1].detach().clone().requires_grad_()]
    return mine, ref


def _run(opt, params, steps, clip=None):
    for step in range(steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()


@pytest.mark.parametrize("offload_to", ["none", "cpu"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_complex_params_step_as_torch(name, kw, n, contiguous, offload_to):
    mine, ref = _pair(n, contiguous)
    opt = getattr(offload, name)(mine, offload=offload_to, **kw)
    theirs = getattr(torch.optim, name)(ref, foreach=False, **kw)
    _run(opt, mine, STEPS)
    _run(theirs, ref, STEPS)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, **TOL)
    ours_sd, ref_sd = opt.state_dict()["state"], theirs.state_dict()["state"]
    assert ours_sd.keys() == ref_sd.keys()
    for k in ref_sd:
        assert ours_sd[k].keys() == ref_sd[k].keys()
        for key, t in ref_sd[k].items():
            if key != "step":
                assert ours_sd[k][key].dtype == t.dtype  # complex64 for the complex param
            torch.testing.assert_close(ours_sd[k][key], t, **TOL)


def test_adagrad_fills_both_parts_of_a_complex_sum():
    """torch's Adagrad starts a complex param's sum at complex(v, v): every float32 of the
    real view at v, as for a real param."""
    p = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    ours, ref = offload.Adagrad([p], initial_accumulator_value=0.3), torch.optim.Adagrad([p], initial_accumulator_value=0.3)
    assert torch.equal(ours.state[p]["sum"], ref.state[p]["sum"])
    assert ours.state[p]["sum"].dtype == torch.complex64


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_complex_params_with_clipping_and_compressed_states(state_dtype):
    """max_grad_norm takes a complex grad's norm over its real view (torch's clip_grad_norm_:
    |z|^2 = re^2 + im^2); with state_dtype="int8" the complex param keeps complex64 states."""
    mine, ref = _pair(5000, True)
    opt = offload.AdamW(mine, lr=0.01, max_grad_norm=1.0, state_dtype=state_dtype)
    theirs = torch.optim.AdamW(ref, lr=0.01, foreach=False)
    _run(opt, mine, 6)
    _run(theirs, ref, 6, clip=1.0)
    torch.testing.assert_close(mine[0], ref[0], **TOL)
    assert opt.state[mine[0]]["exp_avg"].dtype == torch.complex64
    # the last step's norm before clipping: |z|^2 summed over the complex grad, plus the real one's
    expected = sum(torch.view_as_real(g).square().sum() if g.is_complex() else g.square().sum()
                   for g in _grads(ref, 5)).sqrt()
    assert opt.last_grad_norm == pytest.approx(float(expected), rel=1e-5)


def test_state_dict_moves_between_torch_and_offload():
    mine, ref = _pair(17, True)
    theirs = torch.optim.Adam(ref, lr=0.01, foreach=False)
    _run(theirs, ref, 3)
    opt = offload.Adam(mine, lr=0.01)
    with torch.no_grad():
        for a, b in zip(mine, ref):
            a.copy_(b)
    opt.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (torch's load keeps the tensors it is given)
    _run(opt, mine, 2)
    _run(theirs, ref, 2)  # (grads of steps 0, 1 again: the same for both)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, **TOL)
    back = torch.optim.Adam([p.detach().clone().requires_grad_() for p in mine], lr=0.01)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    torch.testing.assert_close(back.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"],
                               rtol=0, atol=0)
    bad = theirs.state_dict()
    bad["state"][0]["exp_avg"] = torch.view_as_real(bad["state"][0]["exp_avg"])[..., 0].clone()
    with pytest.raises(ValueError, match="not a dense complex64 tensor"):
        opt.load_state_dict(bad)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_checkpoint_round_trip(tmp_path, state_dtype):
    mine, _ = _pair(4097, False)
    opt = offload.Adagrad(mine, lr=0.1, state_dtype=state_dtype)
    _run(opt, mine, 3)
    opt.save_checkpoint(str(tmp_path / "ck"))
    again = offload.Adagrad([p.detach().clone().requires_grad_() for p in mine], lr=0.1, offload="cpu",
                            state_dtype=state_dtype)
    again.load_checkpoint(str(tmp_path / "ck"))
    for k, st in opt.state_dict()["state"].items():
        for key, t in st.items():
            assert torch.equal(again.state_dict()["state"][k][key], t), key


def test_lion_and_complex128_refused(tmp_path):
    # (the other stores' refusal: test_float64_params.py, for both dtypes)
    c = torch.zeros(3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no complex form"):
        offload.Lion([c])
    with pytest.raises(NotImplementedError, match="complex128.*use torch.optim.AdamW"):
        offload.AdamW([torch.zeros(3, dtype=torch.complex128, requires_grad=True)])
    flat = offload.AdamW([torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(ValueError, match="complex64"):
        flat.add_param_group({"params": [c]})
    assert len(flat.param_groups) == 1
    host = offload.AdamW([torch.zeros(4, requires_grad=True)], lr=0.1)
    ref_c = c.detach().clone().requires_grad_()
    ref = torch.optim.AdamW([torch.zeros(4, requires_grad=True)], lr=0.1, foreach=False)
    host.add_param_group({"params": [c]})  # the host store takes one later too
    ref.add_param_group({"params": [ref_c]})
    c.grad, ref_c.grad = torch.full_like(c, 1 - 2j), torch.full_like(c, 1 - 2j)
    host.step()
    ref.step()
    torch.testing.assert_close(c, ref_c, **TOL)
