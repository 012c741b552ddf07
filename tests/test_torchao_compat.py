"""torchao's ``CPUOffloadOptimizer(params, optimizer_class, *, offload_gradients, **kwargs)`` call
answered by offload's optimizers (offload/integrations/torchao.py): the rule each
``optimizer_class`` (a class or a torchtune config's dotted path) picks, the keywords it adds,
the steps against the offload optimizer built directly (bit for bit) and against torch's, and
the refusals. torchao itself is not needed: its classes are named by their paths."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.integrations.torchao import CPUOffloadOptimizer


def _params(dtype=torch.float32, n=4097):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)), torch.nn.Parameter(torch.randn(7, generator=g).to(dtype))]


def _steps(params, opt, steps=4):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


@pytest.mark.parametrize("cls, ours", [(torch.optim.AdamW, offload.AdamW), ("torch.optim.AdamW", offload.AdamW),
                                       (torch.optim.Adam, offload.Adam), (torch.optim.SGD, offload.SGD),
                                       ("torch.optim.Adagrad", offload.Adagrad), (offload.Lion, offload.Lion)])
def test_optimizer_class_picks_the_rule(cls, ours):
    kw = dict(lr=1e-2, momentum=0.9) if ours is offload.SGD else dict(lr=1e-2)
    a, b = _params(torch.bfloat16), _params(torch.bfloat16)
    opt = CPUOffloadOptimizer(a, cls, **kw)
    ref = ours(b, offload="cpu", **kw)
    assert type(opt) is ours and opt.config.offload == "cpu"
    _steps(a, opt)
    _steps(b, ref)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    opt.close()
    ref.close()


def test_default_is_adamw_and_steps_as_torchs():
    a, b = _params(), _params()
    opt = CPUOffloadOptimizer(a, lr=1e-2, fused=True)  # (torchtune passes fused=True)
    ref = torch.optim.AdamW(b, lr=1e-2, foreach=False)
    _steps(a, opt)
    _steps(b, ref)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    opt.close()


def test_torchao_classes_by_path():
    opt = CPUOffloadOptimizer(_params(), "torchao.optim.AdamW8bit", lr=1e-3, block_size=256)
    assert type(opt) is offload.AdamW and opt.state_dtype == "int8"
    opt.close()
    opt = CPUOffloadOptimizer(_params(torch.bfloat16), "torchao.prototype.low_bit_optim.AdamW8bit",
                              bf16_stochastic_round=True)
    assert opt.state_dtype == "int8" and opt.master_dtype == "bfloat16"
    opt.close()
    opt = CPUOffloadOptimizer(_params(torch.bfloat16), "torchao.optim.AdamW", bf16_stochastic_round=True)
    assert opt.state_dtype == "float32" and opt.master_dtype == "bfloat16"
    opt.close()


def test_offload_gradients_is_release_grads(workdir):
    """(release_grads frees CUDA params' grads: with CPU params, whose grads are on the host
    already, it is refused; no GPU here to build one)"""
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="release_grads=True frees device grads"):
            CPUOffloadOptimizer(_params(dtype), torch.optim.AdamW, offload_gradients=True)
    opt = CPUOffloadOptimizer(_params(), torch.optim.AdamW, offload="nvme", swap_dir=str(workdir))
    assert opt.config.offload == "nvme"
    opt.close()


def test_refusals_name_what_is_supported():
    for cls in ("torchao.optim.AdamW4bit", "torchao.optim.AdamWFp8", torch.optim.RMSprop, "bitsandbytes.optim.AdamW8bit"):
        with pytest.raises(ValueError, match="supported: torch.optim.AdamW"):
            CPUOffloadOptimizer(_params(), cls)
    with pytest.raises(TypeError, match="optimizer_class"):
        CPUOffloadOptimizer(_params(), 3)
    with pytest.raises(TypeError, match="offload_gradients"):
        CPUOffloadOptimizer(_params(), offload_gradients="yes")
    with pytest.raises(ValueError, match="blocks of 256"):
        CPUOffloadOptimizer(_params(), "torchao.optim.AdamW8bit", block_size=128)
    with pytest.raises(ValueError, match="contradicts"):
        CPUOffloadOptimizer(_params(), "torchao.optim.AdamW8bit", state_dtype="bfloat16")
    with pytest.raises(ValueError, match="master_dtype='bfloat16' makes no sense for fp32"):
        CPUOffloadOptimizer(_params(), "torchao.optim.AdamW", bf16_stochastic_round=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls, kw", [("torchao.optim.AdamW8bit", {}), ("torchao.optim.AdamW", {}),
                                     ("torchao.optim.AdamW", {"bf16_stochastic_round": True}),
                                     ("torch.optim.SGD", {"lr": 0.1, "momentum": 0.9})])
def test_torchaos_smoke_flow(tmp_path, cls, kw, dtype):
    """torchao's own smoke test of its optimizers, run on what the call gives: a step, the
    state_dict through torch.save / torch.load into an optimizer over a deepcopy of the model,
    then both step alike: the same bits."""
    if kw.get("bf16_stochastic_round") and dtype == torch.float32:
        pytest.skip("a bf16 master is for bf16 params")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32)).to(dtype)
    opt = CPUOffloadOptimizer(model.parameters(), cls, **kw)
    model(torch.randn(4, 32, dtype=dtype)).sum().backward()
    opt.step()
    opt.zero_grad()
    torch.save(opt.state_dict(), tmp_path / "sd.pt")
    model2 = copy.deepcopy(model)
    opt2 = CPUOffloadOptimizer(model2.parameters(), cls, **kw)
    opt2.load_state_dict(torch.load(tmp_path / "sd.pt", map_location="cpu"))
    for _ in range(2):
        x = torch.randn(4, 32, dtype=dtype)
        for m, o in ((model, opt), (model2, opt2)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    opt.close()
    opt2.close()


class _Wrapped(torch.Tensor):
    """A tensor subclass that wraps its values and implements only ``detach`` and ``copy_``
    out of itself, as torchao's ``OptimState8bit`` (AdamW8bit's states) does for a load."""

    @staticmethod
    def __new__(cls, values, copyable=True):
        return torch.Tensor._make_wrapper_subclass(cls, values.shape, dtype=values.dtype, device=values.device)

    def __init__(self, values, copyable=True):
        self.values, self.copyable = values, copyable

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return _Wrapped(args[0].values, args[0].copyable)
        if func is torch.ops.aten.copy_.default and type(args[1]) is _Wrapped and args[1].copyable:
            return args[0].copy_(args[1].values)
        raise NotImplementedError(f"_Wrapped: {func}")

    def __repr__(self):
        return "_Wrapped()"


def _wrapped(sd, copyable=True):
    return dict(sd, state={i: {k: (_Wrapped(v, copyable) if k.startswith("exp_avg") else v) for k, v in st.items()}
                           for i, st in sd["state"].items()})


@pytest.mark.parametrize("offl", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_a_state_dict_of_wrapped_states_loads_as_its_values(workdir, offl, state_dtype):
    # torchao's AdamW8bit state_dict into offload.AdamW: with offload "none"/"cpu" the load
    # failed with torchao's NotImplementedError (aten.eq, in the int8 encode), or kept the
    # subclass in opt.state with float32 states and every step refused it ("exp_avg_sq
    # overlaps exp_avg in memory"); "nvme" loaded it. Now each store loads its values.
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=1e-2)
    _steps(src, torch_opt, 2)
    sd = torch_opt.state_dict()
    kw = dict(swap_dir=str(workdir)) if offl == "nvme" else {}
    a, b = _params(), _params()
    plain = offload.AdamW(a, lr=1e-2, offload=offl, state_dtype=state_dtype, **kw)
    plain.load_state_dict(copy.deepcopy(sd))
    if offl == "nvme":
        kw = dict(swap_dir=str(workdir / "b"))
        (workdir / "b").mkdir()
    wrapped = offload.AdamW(b, lr=1e-2, offload=offl, state_dtype=state_dtype, **kw)
    wrapped.load_state_dict(_wrapped(copy.deepcopy(sd)))
    for i, st in plain.state_dict()["state"].items():
        got = wrapped.state_dict()["state"][i]
        assert all(type(v) is torch.Tensor for v in got.values())
        for k, v in st.items():
            assert torch.equal(got[k], v), (i, k)
    _steps(a, plain, 2)
    _steps(b, wrapped, 2)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    plain.close()
    wrapped.close()


def test_wrapped_states_that_cannot_be_copied_out_are_refused_before_anything_loads():
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=1e-2)
    _steps(src, torch_opt, 1)
    ps = _params()
    opt = offload.AdamW(ps, lr=1e-2, offload="cpu")
    _steps(ps, opt, 1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] is a _Wrapped whose values cannot be copied out"):
        opt.load_state_dict(_wrapped(torch_opt.state_dict(), copyable=False))
    after = opt.state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v)
    opt.close()
