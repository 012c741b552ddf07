"""state_dict() / load_state_dict() and checkpoints of compressed host states: torch's
float32 layout out (decoded), encoded on the way in (offload/optim/state_codec.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.kernels import quant
from offload.kernels.fields import ADAGRAD, ADAM, SGD as SGD_RULE, StateField
from offload.optim.state_codec import from_torch_layout, to_torch_layout

SIZES = (7, 4095, 5000, 70001)


def _params(sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _train(opt, params, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen) ** 3
        opt.step()


def _field(rule, name, state_dtype, numel):
    fields = rule.with_state_dtype(state_dtype).fields if numel >= 4096 else rule.fields
    return next(f for f in fields if f.name == name)


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


TORCH = {"adam": (torch.optim.AdamW, offload.AdamW, ADAM, dict(lr=1e-2, weight_decay=0.01)),
         "sgd": (torch.optim.SGD, offload.SGD, SGD_RULE, dict(lr=0.05, momentum=0.9)),
         "adagrad": (torch.optim.Adagrad, offload.Adagrad, ADAGRAD, dict(lr=0.05, initial_accumulator_value=0.1))}


# ---------------------------------------------------------------- the codec
@pytest.mark.parametrize("field", [StateField("m", torch.bfloat16), StateField("m", torch.int8, 256),
                                   StateField("v", torch.uint8, 256), StateField("m")])
@pytest.mark.parametrize("numel", [1, 7, 255, 256, 257, 4097])
def test_codec_round_trip(field, numel):
    gen = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=gen) * torch.rand(numel, generator=gen) ** 4
    if not field.signed and field.blocked:
        x = x.abs()
    stored = from_torch_layout(field, x.view(1, -1))
    assert stored.dtype == field.storage_dtype and stored.numel() == field.storage_numel(numel)
    back = to_torch_layout(field, stored, numel, (1, numel))
    assert back.dtype == torch.float32 and back.shape == (1, numel)
    if field.blocked:  # loading encodes exactly where a scale gives the values back ([Note: exact re-encoding])
        assert torch.equal(stored, quant.encode_blocks_exact(x, field.signed))
        assert torch.equal(back.view(-1), quant.decode_blocks(stored, numel, field.signed))
        again = to_torch_layout(field, from_torch_layout(field, back), numel, (1, numel))
        assert torch.equal(again, back)  # decoded values load back bit for bit
    elif field.dtype == torch.bfloat16:
        assert torch.equal(_bits(stored.view(-1)), _bits(quant.round_bf16_nearest(x)))
        assert torch.equal(_bits(from_torch_layout(field, back)), _bits(stored))  # bf16: exact both ways
    else:
        assert torch.equal(back.view(-1), x)
    assert back.data_ptr() != stored.data_ptr() and stored.data_ptr() != x.data_ptr()  # new tensors


def test_codec_refuses_wrong_storage():
    f = StateField("m", torch.int8, 256)
    with pytest.raises(ValueError, match="stored as 260 torch.uint8 values, got 10 torch.uint8"):
        to_torch_layout(f, torch.zeros(10, dtype=torch.uint8), 10)
    with pytest.raises(TypeError, match="expected a floating-point tensor"):
        from_torch_layout(f, torch.zeros(10, dtype=torch.int64))


# ---------------------------------------------------------------- state_dict out
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_state_dict_is_float32_torch_layout(state_dtype):
    params = _params()
    opt = offload.AdamW(params, state_dtype=state_dtype)
    _train(opt, params)
    sd = opt.state_dict()
    for i, p in enumerate(params):
        entry = sd["state"][i]
        assert list(entry) == ["step", "exp_avg", "exp_avg_sq"]  # torch's key order
        for name in ("exp_avg", "exp_avg_sq"):
            t = entry[name]
            assert t.dtype == torch.float32 and t.shape == p.shape
            f = _field(ADAM, name, state_dtype, p.numel())
            want = to_torch_layout(f, opt.state[p][name], p.numel(), p.shape)
            assert torch.equal(t, want)
    frozen = copy.deepcopy(sd)
    _train(opt, params, steps=2, seed=5)  # the dict holds new tensors: stepping leaves it alone
    for i in sd["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            if params[i].numel() >= 4096:
                assert torch.equal(sd["state"][i][name], frozen["state"][i][name])
    assert opt.state[params[2]]["exp_avg"].dtype == (torch.bfloat16 if state_dtype == "bfloat16" else torch.uint8)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("rule", list(TORCH))
def test_to_torch_and_back(rule, state_dtype):
    """offload (compressed) -> torch's optimizer, which continues; and torch -> offload
    (compressed): the loaded states are torch's, encoded."""
    torch_cls, ours, rule_obj, hyper = TORCH[rule]
    params = _params()
    opt = ours(params, state_dtype=state_dtype, **hyper)
    _train(opt, params)
    sd = opt.state_dict()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch_cls(twins, foreach=False, **hyper)
    theirs.load_state_dict(sd)
    for i, p in enumerate(twins):
        for name in rule_obj.names:
            assert torch.equal(theirs.state[p][name], sd["state"][i][name])
    _train(theirs, twins, steps=2, seed=7)  # torch steps on what we gave it
    back = theirs.state_dict()
    fresh = _params()
    for f, t in zip(fresh, twins):
        f.data.copy_(t.detach())
    mine = ours(fresh, state_dtype=state_dtype, **hyper)
    mine.load_state_dict(back)
    for i, p in enumerate(fresh):
        for name in rule_obj.names:
            f = _field(rule_obj, name, state_dtype, p.numel())
            got = mine.state[p][name]
            want = from_torch_layout(f, back["state"][i][name], p.shape)
            assert torch.equal(_bits(got), _bits(want)), (i, name)
            if p.numel() >= 4096:  # (float32 states share the loaded tensors, as torch's do)
                assert got.data_ptr() != back["state"][i][name].data_ptr()
    assert mine.memory_report()["tiers"]["pageable"] == sum(
        t.numel() * t.element_size() for p in fresh for k, t in mine.state[p].items() if k != "step")


@pytest.mark.parametrize("src,dst", [("int8", "float32"), ("float32", "int8"), ("bfloat16", "int8"),
                                     ("int8", "bfloat16"), ("bfloat16", "bfloat16")])
def test_between_state_dtypes(src, dst):
    params = _params()
    a = offload.AdamW(params, state_dtype=src)
    _train(a, params)
    sd = a.state_dict()
    b = offload.AdamW(_params(), state_dtype=dst)
    b.load_state_dict(sd)
    out = b.state_dict()
    for i, p in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            f = _field(ADAM, name, dst, p.numel())
            want = to_torch_layout(f, from_torch_layout(f, sd["state"][i][name]), p.numel(), p.shape)
            assert torch.equal(out["state"][i][name], want)
            if dst == "float32" or src == dst == "bfloat16" or p.numel() < 4096:
                assert torch.equal(out["state"][i][name], sd["state"][i][name])  # nothing lost


def test_int8_reload_changes_at_most_one_code_step():
    """decode -> encode of int8 blocks is exact but where a block's absmax came from a
    negative value (the signed map ends at -0.9775): there it moves by less than one step."""
    params = _params((70001,))
    a = offload.AdamW(params, state_dtype="int8")
    _train(a, params)
    sd = a.state_dict()
    b = offload.AdamW(_params((70001,)), state_dtype="int8")
    b.load_state_dict(sd)
    again = b.state_dict()["state"][0]["exp_avg"].view(-1, 1)
    first = sd["state"][0]["exp_avg"].view(-1)
    pad = (-first.numel()) % 256
    blocks = torch.cat([first, first.new_zeros(pad)]).view(-1, 256)
    absmax = blocks.abs().amax(1, keepdim=True)
    err = (torch.cat([again.view(-1), first.new_zeros(pad)]).view(-1, 256) - blocks).abs()
    gaps = quant.SIGNED_MAP.diff().max()
    assert torch.all(err <= absmax * gaps)
    stored_a = a.state[params[0]]["exp_avg_sq"]  # unsigned: absmax from a positive value, exact
    assert torch.equal(b.state[b.param_groups[0]["params"][0]]["exp_avg_sq"], stored_a)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_adagrad_before_first_step(state_dtype):
    params = _params((5000, 3))
    opt = offload.Adagrad(params, lr=0.1, initial_accumulator_value=0.1, state_dtype=state_dtype)
    st = opt.state[params[0]]["sum"]
    assert st.dtype == (torch.bfloat16 if state_dtype == "bfloat16" else torch.uint8)
    sd = opt.state_dict()
    want = 0.1 if state_dtype == "int8" else quant.round_bf16_nearest(torch.tensor([0.1])).float().item()
    assert torch.equal(sd["state"][0]["sum"], torch.full((5000,), want))
    assert torch.equal(sd["state"][1]["sum"], torch.full((3,), 0.1))
    theirs = torch.optim.Adagrad([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.1)
    theirs.load_state_dict(sd)


def test_sgd_state_dict_has_torch_keys():
    params = _params((5000,))
    opt = offload.SGD(params, lr=0.1, momentum=0.9, state_dtype="int8")
    _train(opt, params, steps=2)
    sd = opt.state_dict()
    assert list(sd["state"][0]) == ["momentum_buffer"] and sd["state"][0]["momentum_buffer"].dtype == torch.float32


def test_lion_state_dict_is_lion_pytorch_layout():
    params = _params((5000,))
    opt = offload.Lion(params, state_dtype="bfloat16")
    _train(opt, params, steps=2)
    entry = opt.state_dict()["state"][0]
    assert list(entry) == ["step", "exp_avg"] and entry["exp_avg"].dtype == torch.float32


def test_bad_loaded_entry_leaves_the_optimizer_unchanged():
    params = _params((5000,))
    opt = offload.AdamW(params, state_dtype="int8")
    _train(opt, params, steps=1)
    before = opt.state[params[0]]["exp_avg"].clone()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = torch.zeros(17)
    with pytest.raises(ValueError, match=r"has shape \[17\], its param \[5000\]"):
        opt.load_state_dict(sd)
    assert torch.equal(opt.state[params[0]]["exp_avg"], before)


# ---------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("src,dst", [("int8", "int8"), ("bfloat16", "bfloat16"), ("int8", "float32"),
                                     ("float32", "bfloat16")])
def test_checkpoint_round_trip(tmp_path, src, dst):
    params = _params()
    a = offload.AdamW(params, state_dtype=src, offload="cpu")
    _train(a, params)
    a.save_checkpoint(str(tmp_path / "ck"))
    fresh = _params()
    b = offload.AdamW(fresh, state_dtype=dst, offload="cpu")
    b.load_checkpoint(str(tmp_path / "ck"))
    sa, sb = a.state_dict(), b.state_dict()
    for i, p in enumerate(fresh):
        assert sb["state"][i]["step"] == sa["state"][i]["step"]
        for name in ("exp_avg", "exp_avg_sq"):
            f = _field(ADAM, name, dst, p.numel())
            assert b.state[p][name].dtype == f.storage_dtype
            if src == dst or dst == "float32":  # the same state_dtype: the stored bytes, as they were
                assert torch.equal(sb["state"][i][name], sa["state"][i][name])
            else:  # another: decoded and encoded again, as load_state_dict does
                want = to_torch_layout(f, from_torch_layout(f, sa["state"][i][name]), p.numel(), p.shape)
                assert torch.equal(sb["state"][i][name], want)


def test_pickled_optimizer_keeps_compressed_states():
    params = _params((5000,))
    opt = offload.AdamW(params, state_dtype="int8")
    _train(opt, params, steps=2)
    twin = copy.deepcopy(opt)
    p2 = twin.param_groups[0]["params"][0]
    assert torch.equal(twin.state[p2]["exp_avg"], opt.state[params[0]]["exp_avg"])
    assert twin._store.state_dtype == "int8"  # the copy steps as the original would


@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("kw", [dict(state_dtype="bfloat16"), dict(master_dtype="bfloat16")])
def test_sgd_with_stochastic_rounding_goes_on_as_the_other_after_load(kw, momentum):
    """SGD's torch layout has no "step", but bf16 states (and a bf16 own master, with or
    without momentum) round with seeds of the step count: the dict keeps it, so a loading
    optimizer goes on bit for bit."""
    import copy
    torch.manual_seed(0)
    dt = torch.bfloat16 if "master_dtype" in kw else torch.float32
    p = torch.nn.Parameter(torch.randn(8192).to(dt))
    a = offload.SGD([p], lr=1e-2, momentum=momentum, **kw)
    for _ in range(3):
        p.grad = torch.randn(8192).to(dt)
        a.step()
    q = torch.nn.Parameter(p.detach().clone())
    b = offload.SGD([q], lr=1e-2, momentum=momentum, **kw)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for _ in range(3):
        g = torch.randn(8192).to(dt)
        p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert torch.equal(p, q)
    sa, sb = a.state_dict()["state"][0], b.state_dict()["state"][0]
    assert sorted(sa) == sorted(sb) and float(sa["step"]) == float(sb["step"]) == 6.0
    if momentum:
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])
    ref = torch.optim.SGD([torch.nn.Parameter(p.detach().float().clone())], lr=1e-2, momentum=momentum)
    ref.load_state_dict(a.state_dict())  # torch's SGD takes the dict (the extra "step" unused)
    ref.param_groups[0]["params"][0].grad = torch.ones(8192)
    ref.step()
