"""Compressed states (bf16, packed int8 blocks) in NVMe swap files: the swap layout of blocked
fields, and SwappedState's steps equal to a per-param loop of the same scheme, bit for bit,
whatever the sub-group size and the host-byte bound (the streams do not depend on the cuts)."""
from __future__ import annotations

import os

import pytest
import torch

from offload.kernels import get_backend
from offload.kernels.compressed_ref import decode_state
from offload.kernels.fields import ADAGRAD, ADAM, LION, MASTER, StateField
from offload.kernels.quant import encode_blocks, encode_blocks_exact, packed_nbytes, rounding_seed
from offload.optim.functional import RuleHyper
from offload.optim.swapped_state import SwappedState
from offload.swap.layout import SwapLayout, elems_per_page
from offload.swap.pipeline import plan_sub_groups

BIG = 1 << 18  # the unit of sub_group_size with a packed int8 field
SIZES = (1, 7, 15, 16, 17, 4097, BIG + 3, 300000)  # several sub-groups of BIG, a partial last one
HYPER = {
    "adam": (("lr", 1e-2), ("beta1", 0.9), ("beta2", 0.999), ("eps", 1e-8), ("weight_decay", 0.01),
             ("decoupled", True)),
    "lion": (("lr", 1e-3), ("beta1", 0.9), ("beta2", 0.99), ("weight_decay", 0.1)),
    "adagrad": (("lr", 1e-2), ("lr_decay", 0.0), ("weight_decay", 0.0), ("eps", 1e-10)),
}
RULES = {"adam": ADAM, "lion": LION, "adagrad": ADAGRAD}


# ---------------------------------------------------------------------------- the layout
def test_unit_of_a_blocked_layout():
    i8 = StateField("exp_avg", torch.int8, 256)
    u8 = StateField("exp_avg_sq", torch.uint8, 256)
    assert elems_per_page([StateField("a")]) == 1024  # fp32 layouts as before
    assert elems_per_page([StateField("a"), StateField("b", torch.bfloat16)]) == 2048
    assert elems_per_page([i8, u8]) == BIG == elems_per_page([MASTER, i8, u8])
    lay = SwapLayout(2 * BIG + 1000, BIG, [i8, u8])
    assert lay.num_groups == 3 and lay.group_range(2) == (2 * BIG, 2 * BIG + 1000)
    # every sub-group of every field starts on a 4 KiB page: O_DIRECT
    assert lay.region_bytes == 2 * packed_nbytes(BIG) and packed_nbytes(BIG) % 4096 == 0
    spans = lay.state_spans(2)
    assert spans[0] == (0, packed_nbytes(1000), 4096) and spans[1][0] == 4096
    assert lay.file_bytes == 2 * lay.region_bytes + 2 * 4096
    with pytest.raises(ValueError, match="multiple of 262144"):
        SwapLayout(10, 1024, [i8])


def test_plan_counts_packed_bytes():
    fp32 = ADAM.fields
    i8 = ADAM.with_state_dtype("int8").fields
    sg32, n32 = plan_sub_groups(600 * BIG, fp32, 64 << 20, None)
    sg8, n8 = plan_sub_groups(600 * BIG, i8, 64 << 20, None)
    assert sg32 == 1 << 21 and sg8 == 31 * BIG and n32 == n8 == 4  # ~3.9x the elements per host byte
    assert n8 * 2 * packed_nbytes(sg8) <= 64 << 20
    with pytest.raises(ValueError, match="cannot hold 3 pipeline buffers"):
        plan_sub_groups(10 * BIG, i8, 3 * 2 * packed_nbytes(BIG) - 1, BIG)


@pytest.mark.parametrize("sub_group_size", [None, 4096, BIG])
def test_host_budget_error_advises_no_smaller_int8_sub_group(sub_group_size):
    # int8 sub-groups are at least BIG elements (a smaller one is rounded up), so the advice
    # "or lower sub_group_size" failed the same way when followed
    i8 = ADAM.with_state_dtype("int8").fields
    with pytest.raises(ValueError, match=rf"raise max_host_bytes to at least \d+ \(sub_group_size is already "
                                         rf"the smallest, {BIG} elements") as err:
        plan_sub_groups(10 * BIG, i8, 1 << 20, sub_group_size)
    assert "lower sub_group_size" not in str(err.value)
    with pytest.raises(ValueError, match="or lower sub_group_size"):  # where a smaller one exists
        plan_sub_groups(10 * BIG, i8, 1 << 20, 2 * BIG)


# ---------------------------------------------------------------------------- the steps
def _reference_step(kernel, rule, params, states, grads, step, hyper, stochastic=False):
    """The host store's scheme per param: whole params, seed of (step, param index), offset 0."""
    for i, (p, g) in enumerate(zip(params, grads)):
        kernel.rule_step(rule, p, g, states[i], step=step, rounding_seed=rounding_seed(step, i),
                         element_offset=0, stochastic_states=stochastic, **dict(hyper, grad_scale=1.0))


def _zeros(rule, n):
    out = {}
    for f in rule.fields:
        if f.blocked:
            out[f.name] = encode_blocks(torch.zeros(n), f.signed)
        else:
            out[f.name] = torch.zeros(n, dtype=f.dtype)
    return out


def _grads(step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen) * (1 + step) for n in SIZES]


@pytest.mark.parametrize("name,dtype,sub_group_size,max_host_bytes,stochastic", [
    ("adam", "int8", BIG, 3 * 2 * packed_nbytes(BIG), False),   # streamed: 3 buffers, 3 sub-groups
    ("adam", "int8", None, None, False),                         # one sub-group
    ("adam", "bfloat16", 2048, 3 * 2 * 4096, True),              # params cut by sub-groups: offsets
    ("adam", "bfloat16", None, None, False),
    ("lion", "int8", BIG, None, False),
    ("adagrad", "bfloat16", 4096, None, True),
])
def test_swapped_state_equals_per_param_scheme(tmp_path, name, dtype, sub_group_size, max_host_bytes,
                                               stochastic):
    kernel = get_backend(os.environ.get("OFFLOAD_BACKEND", "torch"))
    rule = RULES[name].with_state_dtype(dtype)
    torch.manual_seed(0)
    params = [torch.randn(n) for n in SIZES]
    ref_params = [p.clone() for p in params]
    ref_states = [_zeros(rule, p.numel()) for p in params]
    st = SwappedState(params, swap_dir=str(tmp_path), rule=rule, sub_group_size=sub_group_size,
                      max_host_bytes=max_host_bytes, verify=True, backend=kernel.name,
                      stochastic_states=stochastic)
    hyper = RuleHyper(RULES[name], HYPER[name])
    for step in range(1, 4):
        grads = _grads(step)
        st.step([(hyper, [(p, g, step) for p, g in zip(params, grads)])])
        _reference_step(kernel, rule, ref_params, ref_states, grads, step, HYPER[name], stochastic)
    if max_host_bytes is not None and sub_group_size == BIG:
        assert st.layout.num_groups >= 3 and st.num_buffers == 3
    for i, p in enumerate(params):
        assert torch.equal(p, ref_params[i]), f"param {i}"
        got = st.read_state(p)
        for f, t in zip(rule.fields, got):
            want = decode_state(f, ref_states[i][f.name], p.numel())
            assert t.dtype == torch.float32 and torch.equal(t.reshape(-1), want), f"{f.name} of param {i}"
    st.close()


def test_write_state_round_trip_and_zero_init(tmp_path):
    rule = ADAM.with_state_dtype("int8")
    params = [torch.randn(n) for n in (5, 300, 1000)]
    st = SwappedState(params, swap_dir=str(tmp_path), rule=rule, backend="torch")
    m, v = st.read_state(params[1])
    assert torch.equal(m, torch.zeros(300)) and not torch.signbit(m).any()  # +0, not -0 (zero code)
    vals = torch.randn(300)
    st.write_state(params[1], vals, vals.abs(), step=4)
    m, v = st.read_state(params[1])
    assert torch.equal(m, decode_state(rule.fields[0], encode_blocks(vals, True), 300))
    assert torch.equal(v, decode_state(rule.fields[1], encode_blocks(vals.abs(), False), 300))
    assert st.step_of(params[1]) == 4 and not st.read_state(params[2])[0].any()
    st.close()


# ---------------------------------------------------------------------------- the flat store's shards
def _shard_reference(kernel, rule, masters, states, grads, lowps, step, hyper, stochastic):
    """One kernel call per shard over all of it: the scheme over the shard's flat blocks."""
    for k, (m, g) in enumerate(zip(masters, grads)):
        kernel.rule_step(rule, m, g, states[k], step=step, param_lowp=lowps[k] if lowps else None,
                         rounding_seed=rounding_seed(step, k), element_offset=0, stochastic_states=stochastic,
                         **dict(hyper, grad_scale=1.0))


@pytest.mark.parametrize("dtype,master,cuts,stochastic", [
    ("int8", "float32", "params", False),     # ranges across blocks: decoded, stepped, encoded once
    ("int8", "float32", "whole", False),      # whole shards: the fused kernel on whole blocks
    ("int8", "bfloat16", "params", False),    # master_dtype="bfloat16": the bf16 shard is its own master
    ("bfloat16", "float32", "params", True),
    ("bfloat16", "bfloat16", "whole", True),
])
def test_shards_equal_one_call_per_shard(tmp_path, dtype, master, cuts, stochastic):
    from offload.optim.swapped_shards import SwappedShards, WorkItem

    kernel = get_backend(os.environ.get("OFFLOAD_BACKEND", "torch"))
    rule = ADAM.with_state_dtype(dtype)
    sizes = [BIG + 1000, 4097]  # shard 1 starts on a block in swap space whatever shard 0's size
    cut = {0: [0, 7, 307, 4000, BIG + 1000], 1: [0, 17, 4097]} if cuts == "params" else \
        {0: [0, BIG + 1000], 1: [0, 4097]}
    torch.manual_seed(1)
    p16 = [torch.randn(n).bfloat16() for n in sizes]
    fields = rule.with_master() if master == "float32" else rule.fields
    ref_p = [p.clone() for p in p16]
    ref_m = [p.float() for p in p16] if master == "float32" else ref_p
    ref_s = [_zeros(rule, n) for n in sizes]
    sh = SwappedShards(sizes, swap_dir=str(tmp_path), identity={"t": 1}, extra=dict, fields=fields, rule=rule,
                       sub_group_size=BIG, max_host_bytes=None, verify=True, backend=kernel.name,
                       stochastic_states=stochastic)
    sh.initialise(lambda k, lo, hi, out: out.copy_(p16[k][lo:hi]))
    hyper = dict(HYPER["adam"])
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(n, generator=gen) for n in sizes]
        items = [WorkItem(k, lo, hi, grads[k][lo:hi], dict(hyper, step=step, grad_scale=1.0), p16[k][lo:hi],
                          "lowp" if master == "float32" else "master")
                 for k, c in cut.items() for lo, hi in zip(c, c[1:])]
        sh.step(items)
        _shard_reference(kernel, rule, ref_m, ref_s, grads, ref_p if master == "float32" else None, step,
                         hyper, stochastic)
    assert sh.layout.num_groups == 2
    for k, n in enumerate(sizes):
        assert torch.equal(p16[k], ref_p[k]), f"params of shard {k}"
        got = sh.read(k, 0, n)
        for f in rule.fields:
            assert torch.equal(got[f.name], decode_state(f, ref_s[k][f.name], n)), f"{f.name} of shard {k}"
        if master == "float32":
            assert torch.equal(got["master"], ref_m[k])
    sh.close()


@pytest.mark.parametrize("state_dtype", ["int8", "bfloat16"])
def test_state_dict_both_ways_with_torch(tmp_path, state_dtype):
    import offload

    torch.manual_seed(3)
    ref = [torch.nn.Parameter(torch.randn(n)) for n in (7, 4097, 1000)]
    topt = torch.optim.AdamW(ref, lr=1e-2)
    for _ in range(2):
        for p in ref:
            p.grad = torch.randn_like(p)
        topt.step()
    sd = topt.state_dict()
    params = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), state_dtype=state_dtype,
                        backend=os.environ.get("OFFLOAD_BACKEND", "torch"))
    opt.load_state_dict(sd)  # quantized on the way in
    out = opt.state_dict()
    rule = ADAM.with_state_dtype(state_dtype)
    for i, p in enumerate(params):
        for f in rule.fields:
            want = sd["state"][i][f.name].reshape(-1)
            want = decode_state(f, encode_blocks_exact(want, f.signed), p.numel()) if f.blocked else want.bfloat16().float()
            got = out["state"][i][f.name]
            assert got.dtype == torch.float32 and got.shape == p.shape and torch.equal(got.reshape(-1), want)
        assert int(out["state"][i]["step"]) == 2
    back = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ref], lr=1e-2)
    back.load_state_dict(out)  # torch's own layout: loads into torch as it is
    kept = {i: {k: v.clone() for k, v in s.items()} for i, s in out["state"].items()}
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for i in kept:  # the dict handed out does not change when the optimizer steps
        assert all(torch.equal(kept[i][k], out["state"][i][k]) for k in kept[i])
    opt.close()


def test_corrupt_packed_swap_bytes_are_detected(tmp_path):
    """verify=True: the per-block crc32 of a sub-group covers its packed bytes, absmax included."""
    rule = ADAM.with_state_dtype("int8")
    params = [torch.randn(n) for n in (5000, BIG + 10)]
    st = SwappedState(params, swap_dir=str(tmp_path), rule=rule, sub_group_size=BIG, verify=True, backend="torch")
    hyper = RuleHyper(ADAM, HYPER["adam"])
    st.step([(hyper, [(p, torch.ones_like(p), 1) for p in params])])
    g = 1  # the last, partial sub-group: its second state's only block past the codes
    lay = st.layout
    off, used, _ = lay.state_spans(g)[1]
    where = lay.group_offset(g) + off + used - 2  # a byte of the last block's absmax
    with open(st.store.read_slot_file(g), "r+b") as f:
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(OSError, match="checksum mismatch.*exp_avg_sq of sub-group 1"):
        st.step([(hyper, [(p, torch.ones_like(p), 2) for p in params])])
    st.close()
