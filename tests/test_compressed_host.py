"""Compressed states (state_dtype="bfloat16" / "int8") in the host store: fp32 CPU params
with offload="none" / "cpu", states in opt.state[p].

Every rule is held bit for bit to tests/_compressed_ref.py (quant.py's scheme around torch's
own single-tensor update) with the torch backend, the one whose float32 rule is torch's
statement for statement; the other backends differ from torch in float32 rounding, so their
compressed steps are held to the scheme by the kernel tests, not here.
"""
from __future__ import annotations

import pytest
import torch

import offload
from offload.kernels import quant
from offload.kernels.fields import ADAM, SGD as SGD_RULE

from _compressed_ref import Reference

SIZES = (1, 7, 15, 16, 17, 4095, 4096, 4097, 70001)

CASES = {
    "adamw": (offload.AdamW, "adam", dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)),
    "adam_l2": (offload.Adam, "adam", dict(lr=1e-2, weight_decay=0.1)),
    "sgd_momentum": (offload.SGD, "sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd_nesterov": (offload.SGD, "sgd", dict(lr=0.05, momentum=0.9, nesterov=True)),
    "adagrad": (offload.Adagrad, "adagrad", dict(lr=0.05, lr_decay=0.01, weight_decay=0.01,
                                                 initial_accumulator_value=0.1, eps=1e-10)),
    "lion": (offload.Lion, "lion", dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def _params(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    # a spread of magnitudes, so the blocks' absmax and the small codes both matter
    return [torch.randn(p.shape, generator=gen) * torch.rand(p.shape, generator=gen) ** 4 for p in params]


def _reference(kind, params, state_dtype):
    cls, rule, hyper = CASES[kind]
    fill = hyper.get("initial_accumulator_value", 0.0) if rule == "adagrad" else 0.0
    return Reference(rule, params, state_dtype, hyper, fill)


def _assert_same(opt, params, ref, state_dtype):
    for i, p in enumerate(params):
        assert torch.equal(p.detach(), ref.params[i]), f"param {i} ({p.numel()} elements)"
        for name in ref.names:
            got, want = opt.state[p][name], ref.states[i][name]
            assert got.dtype == want.dtype and got.shape == want.shape, (i, name, got.dtype, got.shape)
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bfloat16 else got,
                               want.view(torch.uint8) if want.dtype == torch.bfloat16 else want), (i, name)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("kind", [k for k in CASES if k != "adam_l2"])
def test_rule_matches_plain_torch_reference(kind, state_dtype):
    cls, rule, hyper = CASES[kind]
    params = _params(SIZES)
    ref = _reference(kind, params, state_dtype)
    opt = cls(params, backend="torch", state_dtype=state_dtype, **hyper)
    for step in range(1, 7):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
    _assert_same(opt, params, ref, state_dtype)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_adam_l2_matches_torch_adam(state_dtype):
    """Adam (L2 weight decay in the grad) against torch.optim.Adam's single-tensor update."""
    params = _params((5000, 9))
    hyper = CASES["adam_l2"][2]
    ref = Reference("adam", params, state_dtype, hyper, update=_adam_update)
    opt = offload.Adam(params, backend="torch", state_dtype=state_dtype, **hyper)
    for step in range(1, 5):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        ref.step(grads)
    _assert_same(opt, params, ref, state_dtype)


def _adam_update(rule, hyper, p, g, vals, step):
    opt = torch.optim.Adam([p], foreach=False, **hyper)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), **vals}
    p.grad = g
    opt.step()
    p.grad = None
    for k in vals:
        vals[k].copy_(opt.state[p][k])


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_large_param_matches_reference(state_dtype):
    params = _params((2 ** 20 + 3,))
    hyper = CASES["adamw"][2]
    ref = Reference("adam", params, state_dtype, hyper)
    opt = offload.AdamW(params, backend="torch", state_dtype=state_dtype, **hyper)
    for step in range(1, 4):
        grads = _grads(params, step)
        params[0].grad = grads[0].clone()
        opt.step()
        ref.step(grads)
    _assert_same(opt, params, ref, state_dtype)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_stored_forms_and_small_params_stay_float32(state_dtype):
    params = _params((4095, 4096, 10000))
    opt = offload.AdamW(params, state_dtype=state_dtype)
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    opt.step()
    small, edge, big = (opt.state[p] for p in params)
    assert small["exp_avg"].dtype == torch.float32 and small["exp_avg"].shape == (4095,)
    for p, st in ((params[1], edge), (params[2], big)):
        for f in ADAM.with_state_dtype(state_dtype).fields:
            t = st[f.name]
            if state_dtype == "bfloat16":
                assert t.dtype == torch.bfloat16 and t.shape == p.shape
            else:
                assert t.dtype == torch.uint8 and t.shape == (f.storage_numel(p.numel()),)
    # a float32 optimizer's small param steps exactly as the compressed one's
    ref_params = _params((4095,))
    ref_opt = offload.AdamW(ref_params)
    ref_params[0].grad = _grads(params, 1)[0]
    ref_opt.step()
    assert torch.equal(ref_params[0], params[0]) and torch.equal(ref_opt.state[ref_params[0]]["exp_avg_sq"],
                                                                 small["exp_avg_sq"])


@pytest.mark.parametrize("state_dtype,per_elem", [("float32", 8), ("bfloat16", 4), ("int8", 2 * 260 / 256)])
def test_memory_report_counts_stored_bytes(state_dtype, per_elem):
    params = _params((100, 2 ** 16))
    opt = offload.AdamW(params, state_dtype=state_dtype, offload="cpu")
    for p, g in zip(params, _grads(params, 1)):
        p.grad = g
    opt.step()
    want = 100 * 8 + int(2 ** 16 * per_elem)
    assert opt.memory_report()["tiers"]["pageable"] == want
    assert offload.AdamW(_params((3,)), state_dtype=state_dtype).memory_report()["tiers"]["pageable"] == 0
    opt.close()  # its states went: a report after close() said they were still held
    assert opt.memory_report()["tiers"] == {"device": 0, "pinned": 0, "pageable": 0, "nvme": 0}


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_sgd_momentum_zero_keeps_no_state(state_dtype):
    params = _params((5000,))
    opt = offload.SGD(params, lr=0.1, state_dtype=state_dtype)
    params[0].grad = torch.ones(5000)
    before = params[0].detach().clone()
    opt.step()
    assert torch.equal(params[0].detach(), before - 0.1)
    assert "momentum_buffer" not in opt.state.get(params[0], {})


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_grad_scaler_unscales_and_skips(state_dtype):
    """GradScaler's scale reaches the kernel as the grad multiplier; an inf grad skips the
    step and leaves the compressed states as they were."""
    params = _params((5000, 7))
    hyper = CASES["adamw"][2]
    ref = Reference("adam", params, state_dtype, hyper)
    opt = offload.AdamW(params, backend="torch", state_dtype=state_dtype, **hyper)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(1, 4):
        grads = _grads(params, step)
        loss = sum((p * g).sum() for p, g in zip(params, grads))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ref.step(grads)
    _assert_same(opt, params, ref, state_dtype)
    saved = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    opt.zero_grad()
    scaler.scale(sum((p * float("inf")).sum() for p in params)).backward()
    scaler.step(opt)
    assert opt.last_step_skipped
    for p, st in zip(params, saved):
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_max_grad_norm_clips_inside_the_compressed_step(state_dtype):
    params = _params((5000, 7))
    hyper = CASES["adamw"][2]
    ref = Reference("adam", params, state_dtype, hyper)
    opt = offload.AdamW(params, backend="torch", state_dtype=state_dtype, max_grad_norm=0.5, **hyper)
    for step in range(1, 4):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        # clip.py's coefficient, from the same double sum of squares as the torch backend's
        norm = sum(float(torch.dot(g.reshape(-1).double(), g.reshape(-1).double())) for g in grads) ** 0.5
        assert opt.last_grad_norm == pytest.approx(norm, rel=1e-12)
        ref.step(grads, multiplier=min(1.0, 0.5 / (norm + 1e-6)))
    _assert_same(opt, params, ref, state_dtype)


def test_rounding_seeds_differ_per_param_and_step():
    """Two params with the same values and grads get different bf16 rounding (the seed
    takes the param's index), and a rerun gets the same bits."""
    def run():
        params = [torch.nn.Parameter(torch.full((5000,), 0.5)) for _ in range(2)]
        opt = offload.AdamW(params, backend="torch", state_dtype="bfloat16", lr=1e-3)
        for step in range(1, 3):
            for p in params:
                p.grad = torch.linspace(1e-3, 1.0, 5000) / 3
            opt.step()
        return [opt.state[p]["exp_avg_sq"].view(torch.int16).clone() for p in params]
    a, b = run(), run()
    assert not torch.equal(a[0], a[1])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_second_moment_decays_in_bf16():
    """Rounded to nearest, v * 0.999 in bf16 rounds back to v and never decays; the store
    rounds stochastically, so v decays as in float32 (state_codec.STOCHASTIC_BF16_STATES)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = offload.AdamW([p], state_dtype="bfloat16", weight_decay=0.0)
    p.grad = torch.ones(4096)
    opt.step()
    p.grad = torch.zeros(4096)
    for _ in range(300):
        opt.step()
    v = opt.state_dict()["state"][0]["exp_avg_sq"]
    assert v.mean().item() == pytest.approx(1e-3 * 0.999 ** 300, rel=0.01)  # 0.74e-3 (nearest: 1e-3)
    stuck = quant.round_bf16_nearest(torch.tensor([1e-3]))
    assert quant.round_bf16_nearest(stuck.float() * 0.999).view(torch.int16) == stuck.view(torch.int16)


# ---------------------------------------------------------------- options
@pytest.mark.parametrize("value", ["fp16", "float16", "int4", None, 8, torch.bfloat16])
def test_bad_state_dtype(value):
    with pytest.raises(ValueError, match="state_dtype must be one of"):
        offload.AdamW(_params((3,)), state_dtype=value)


@pytest.mark.parametrize("value", ["fp32", "float16", "int8", torch.bfloat16])
def test_bad_master_dtype(value):
    with pytest.raises(ValueError, match="master_dtype must be None"):
        offload.AdamW(_params((3,)), master_dtype=value)


def test_bf16_master_refuses_fp32_cpu_params():
    with pytest.raises(ValueError, match="makes no sense for fp32 CPU params"):
        offload.AdamW(_params((3, 4)), master_dtype="bfloat16")
    offload.AdamW(_params((3,)), master_dtype="float32")  # the float32 master is what it has


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bf16_master_names_the_first_param_not_bf16(dtype):
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.zeros(4, dtype=dtype))]
    with pytest.raises(ValueError, match=rf"needs bfloat16 params .*parameter 1 has dtype {dtype}"):
        offload.SGD(params, lr=0.1, master_dtype="bfloat16")


def test_bf16_master_checks_added_groups():
    opt = offload.AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], master_dtype="bfloat16")
    extra = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match="parameter 1 has dtype torch.float32"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    opt.close()


def test_rule_step_refuses_compressed_states_without_seeds():
    from offload.optim.functional import RuleHyper, rule_step

    p, g = torch.zeros(300), torch.ones(300)
    rule = SGD_RULE.with_state_dtype("int8")
    hyper = RuleHyper(SGD_RULE, (("lr", 0.1), ("momentum", 0.9)))
    buf = torch.zeros(rule.fields[0].storage_numel(300), dtype=torch.uint8)
    with pytest.raises(ValueError, match="need rounding_seeds"):
        rule_step([p], [g], {"momentum_buffer": [buf]}, [1], hyper, rule=rule)
    with pytest.raises(ValueError, match="takes 520 bytes of packed blocks, got 300"):
        rule_step([p], [g], {"momentum_buffer": [torch.zeros(300, dtype=torch.uint8)]}, [1], hyper, rule=rule,
                  rounding_seeds=[0])
    with pytest.raises(ValueError, match="is not the hyperparameters' rule"):
        rule_step([p], [g], {"exp_avg": [buf]}, [1], hyper, rule=ADAM.with_state_dtype("int8"), rounding_seeds=[0])
    rule_step([p], [g], {"momentum_buffer": [buf]}, [1], hyper, rule=rule, rounding_seeds=[0])
    assert torch.equal(p, torch.full((300,), -0.1))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_non_contiguous_param_steps_as_its_contiguous_copy(state_dtype):
    """A transposed param goes through a contiguous copy: same bits as the copy's own step."""
    base = torch.randn(64, 80)
    strided = torch.nn.Parameter(base.t())  # 80 x 64, not contiguous
    plain = torch.nn.Parameter(base.t().contiguous())
    assert not strided.is_contiguous()
    opts = [offload.AdamW([p], backend="torch", state_dtype=state_dtype, lr=1e-2) for p in (strided, plain)]
    for step in range(1, 4):
        g = _grads([plain], step)[0]
        for p, opt in zip((strided, plain), opts):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(strided.detach(), plain.detach())
    for name in ("exp_avg", "exp_avg_sq"):
        a, b = opts[0].state[strided][name], opts[1].state[plain][name]
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_new_states_encode_one_unit_and_copy_it(state_dtype, monkeypatch):
    """A param's first step makes its compressed states by encoding one block (one element of
    a bf16 state) and copying it, with the bits of encoding the whole float32 fill: sizes
    across block boundaries, zero, Adagrad's fill and values that round. Encoding the whole
    fill made the first step 20-35x slower than the next and left the heap at twice the
    states' bytes."""
    from offload.optim import state_codec

    for rule in (ADAM, offload.kernels.fields.ADAGRAD):
        for field in rule.with_state_dtype(state_dtype).fields:
            for n in (0, 1, 7, 255, 256, 257, 4097, 3 * quant.BLOCK * 17 + 300):
                for value in (0.0, 0.1, 3.0, -1e-30, float("inf")):
                    got = state_codec.filled(field, value, (n,))
                    want = state_codec.from_torch_layout(field, torch.full((n,), value), (n,))
                    assert got.dtype == want.dtype and torch.equal(got, want), (field.name, n, value)
            got = state_codec.filled(field, 0.5, (3, 5, 7))
            want = state_codec.from_torch_layout(field, torch.full((3, 5, 7), 0.5))
            assert torch.equal(got, want) and got.shape == want.shape
    asked = []
    real_full = torch.full
    p = torch.nn.Parameter(torch.randn(70001))
    opt = offload.AdamW([p], lr=0.1, state_dtype=state_dtype)
    p.grad = torch.randn(70001)
    monkeypatch.setattr(state_codec.torch, "full", lambda size, *a, **k: asked.append(size) or real_full(size, *a, **k))
    opt.step()
    monkeypatch.undo()
    assert asked and max(s[0] for s in asked) <= quant.BLOCK, asked
