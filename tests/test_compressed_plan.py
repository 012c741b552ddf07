"""The planner with compressed states (``state_dtype``) and the bf16 master (``master_dtype``):
its bytes are what the flat store allocates, to the byte (plan-then-run, as in test_plan.py),
and the bytes worked out by hand from the scheme (bf16: 2 B per element; int8: 260 B per
block of 256; params at whole blocks in the flat layout with int8 states)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

import offload
from offload.plan import TIERS, estimate
from test_plan import fake_three_ranks  # noqa: F401  (the fixture: this process as rank 0 of 3)

# bf16 params of 76,800 + 300 + 5,100 + 17 = 82,217 elements: sizes that are not multiples of
# 256, so that the int8 layout's padding between params shows
SIZES = (76_800, 300, 5_100, 17)
N = sum(SIZES)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 300), torch.nn.Linear(300, 17)).to(torch.bfloat16)
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
    assert tuple(p.numel() for p in model.parameters()) == SIZES
    return model


def _run_report(model, **kw):
    return _run_report_params(model.parameters(), **kw)


def _run_report_params(params, **kw):
    opt = offload.AdamW(params, lr=1e-3, backend="torch", **kw)  # (the bytes are any backend's)
    try:
        opt.step()
        return opt.memory_report()
    finally:
        opt.close()


def _blocks(n: int) -> int:
    return -(-n // 256) * 260


def _aligned_total(sizes) -> int:
    acc = 0
    for n in sizes:
        acc = -(-acc // 256) * 256 + n
    return acc


@pytest.mark.parametrize("master", [None, "bfloat16"])
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_plan_then_run_one_rank_bf16_cpu_params(state_dtype, master):
    model = _model()
    kw = dict(offload="cpu", state_dtype=state_dtype, master_dtype=master)
    plan = estimate(model, **kw)
    # by hand: the shard is the whole flat range (int8: each param on a block boundary)
    S = -(-_aligned_total(SIZES) // 256) * 256 if state_dtype == "int8" else N  # (whole blocks)
    moments = {"float32": 8 * S, "bfloat16": 4 * S, "int8": 2 * _blocks(S)}[state_dtype]
    master_bytes = 0 if master == "bfloat16" else 4 * S
    assert plan.inputs["shard_numel"] == S
    assert plan.optimizer_bytes == {"device": 0, "pinned": 0, "pageable": master_bytes + moments, "nvme": 0}
    assert plan.inputs["separate_master"] == (master is None)
    report = _run_report(model, **kw)
    assert report["tiers"] == plan.optimizer_bytes
    assert report["detail"]["state_bytes"] == master_bytes + moments


@pytest.mark.parametrize("state_dtype,master", [("int8", "bfloat16"), ("int8", None), ("bfloat16", "bfloat16")])
def test_plan_then_run_three_ranks_stage2(fake_three_ranks, state_dtype, master, monkeypatch):
    from offload.optim.flat_state import FlatState

    monkeypatch.setattr(FlatState, "bucket_numel", 10_000)  # several buckets; chunk at whole blocks
    model = _model()
    kw = dict(offload="cpu", stage=2, state_dtype=state_dtype, master_dtype=master)
    plan = estimate(model, world_size=fake_three_ranks, **kw)
    total = _aligned_total(SIZES) if state_dtype == "int8" else N
    a = 256 if state_dtype == "int8" else 1
    S = -(-total // (3 * a)) * a
    chunk = max(a, min(S, 10_000 // 3) // a * a)
    moments = 4 * S if state_dtype == "bfloat16" else 2 * _blocks(S)
    master_bytes = 0 if master else 4 * S
    comm = 3 * chunk * 4 + 3 * chunk * 2 + chunk * 4
    # states, the fp32 grad shard, the bf16 shard (the master itself with master_dtype), gloo's buffers
    assert plan.optimizer_bytes["pageable"] == master_bytes + moments + 4 * S + 2 * S + comm
    report = _run_report(model, **kw)
    assert report["detail"]["shard_numel"] == S == plan.inputs["shard_numel"]
    assert report["tiers"] == plan.optimizer_bytes


def test_a_count_plans_one_param_and_says_so():
    plan = estimate("1M", param_device="cpu", offload="cpu", state_dtype="int8", master_dtype="bfloat16",
                    world_size=2, stage=1)
    S = -(-1_000_000 // 512) * 256  # whole blocks per shard
    assert plan.inputs["shard_numel"] == S
    b = plan.breakdown["pageable"]
    assert b["master"] == 0 and b["exp_avg"] == b["exp_avg_sq"] == _blocks(S)
    assert any("255 elements more per param" in n for n in plan.notes)
    assert any("own master" in n for n in plan.notes)


def test_fp32_default_is_unchanged():
    a = estimate("1B", stage=2, world_size=4, offload="cpu")
    b = estimate("1B", stage=2, world_size=4, offload="cpu", state_dtype="float32", master_dtype="float32")
    assert a.breakdown == b.breakdown and a.inputs["shard_numel"] == 250_000_000
    assert a.breakdown["pageable"]["master"] == 4 * 250_000_000


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(state_dtype="int4"), "state_dtype must be one of"),
    (dict(master_dtype="float16"), "master_dtype must be None"),
    (dict(master_dtype="bfloat16", param_dtype="fp32"), "needs bfloat16 params"),
])
def test_bad_values_are_value_errors(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        estimate("1M", **kwargs)


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse refuses a choice
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def test_cli_flags():
    rc, out, err = _cli("plan", "--params", "1B", "--param-dtype", "bf16", "--offload", "cpu",
                        "--state-dtype", "int8", "--master-dtype", "bfloat16", "--kernel-gparams", "1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["inputs"]["state_dtype"] == "int8" and doc["inputs"]["master_dtype"] == "bfloat16"
    host = doc["breakdown"]["pinned"]
    pageable = doc["breakdown"]["pageable"]
    S = doc["inputs"]["shard_numel"]
    assert S == -(-1_000_000_000 // 256) * 256
    assert host["master"] + pageable["master"] == 0
    assert host["exp_avg"] + pageable["exp_avg"] == _blocks(S)
    rc, _, err = _cli("plan", "--params", "1B", "--state-dtype", "int4", "--json")
    assert rc == 2 and "int4" in err
    rc, _, err = _cli("plan", "--params", "1B", "--param-dtype", "fp16", "--master-dtype", "bfloat16", "--json")
    assert rc == 1 and "needs bfloat16 params" in err


# --------------------------------------------------------------------------- small params

# fp32 CPU params of 76,800 + 300 + 24 x 300 + 5,100 + 17 elements: the host store keeps the
# states of those under MIN_COMPRESSED_NUMEL (4096) in float32; the flat and swapped stores
# compress every element (the swapped store starting each param on an int8 block: 24 x 212
# elements of padding, more than a 4 KiB page of packed blocks, so that the swap files show it)
SMALL_SIZES = (76_800, 300) + (300,) * 24 + (5_100, 17)


def _fp32_model_with_small_params():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 300), *[torch.nn.LayerNorm(300) for _ in range(12)],
                                torch.nn.Linear(300, 17))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    assert tuple(p.numel() for p in model.parameters()) == SMALL_SIZES
    return model


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("store,kw", [
    ("host", dict(offload="cpu")),
    ("swapped", dict(offload="nvme", max_host_bytes=8 << 20)),
    ("flat", dict(offload="cpu", stage=1)),
    ("flat-swapped", dict(offload="nvme", stage=1, max_host_bytes=8 << 20)),
])
def test_plan_then_run_fp32_cpu_params_small_params(tmp_path, store, kw, state_dtype):
    model = _fp32_model_with_small_params()
    kw = dict(kw, state_dtype=state_dtype, **({"swap_dir": str(tmp_path)} if kw["offload"] == "nvme" else {}))
    plan = estimate(model, **kw)
    report = _run_report(model, **kw)
    assert report["tiers"] == plan.optimizer_bytes


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_host_store_small_params_by_hand(state_dtype):
    from offload.optim.host_state import MIN_COMPRESSED_NUMEL

    small = [n for n in SMALL_SIZES if n < MIN_COMPRESSED_NUMEL]
    big = [n for n in SMALL_SIZES if n >= MIN_COMPRESSED_NUMEL]
    packed = {"bfloat16": lambda n: 2 * n, "int8": _blocks}[state_dtype]  # each param its own blocks
    plan = estimate(_fp32_model_with_small_params(), offload="cpu", state_dtype=state_dtype)
    b = plan.breakdown["pageable"]
    assert b["exp_avg"] == b["exp_avg_sq"] == sum(packed(n) for n in big) + 4 * sum(small)
    assert any("keep float32 states (counted)" in n for n in plan.notes)
    # a count is one param: compressed whole, and the plan says what it cannot know
    plan = estimate(sum(SMALL_SIZES), param_dtype="fp32", param_device="cpu", offload="cpu", state_dtype=state_dtype)
    assert plan.breakdown["pageable"]["exp_avg"] == packed(sum(SMALL_SIZES))
    assert any("counted only when a module is given" in n for n in plan.notes)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16", "int8"])
def test_plan_then_run_stage3_fp32_shards_under_4096_elements(state_dtype):
    # one rank: offload.shard's units of a tiny GPT are shards of 4,864 and 3 x 3,328
    # elements, one param each in the host store: the three under 4096 keep float32 states
    shard_mod = pytest.importorskip("offload.shard", reason="offload.shard (issue #16) is not in this tree")
    from offload.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=3, d_model=16, n_head=4, block_size=32))
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in set(model.parameters()))
    shard_mod.shard(model)
    shards = [p for p in model.parameters() if p.requires_grad]
    assert sorted(p.numel() for p in shards) == [3_328] * 3 + [4_864]
    for p in shards:
        p.grad = torch.randn_like(p)
    plan = estimate(total, stage=3, param_device="cpu", param_dtype="fp32", offload="cpu", state_dtype=state_dtype,
                    unit_params=[total - sum(sizes)] + sizes)
    report = _run_report_params(shards, offload="cpu", state_dtype=state_dtype)
    assert report["tiers"] == plan.optimizer_bytes


_RULE_OPTIMIZERS = {
    "sgd": (offload.SGD, dict(lr=0.1, momentum=0.9)),
    "sgd_plain": (offload.SGD, dict(lr=0.1)),
    "adagrad": (offload.Adagrad, dict(lr=0.1)),
    "lion": (offload.Lion, dict(lr=1e-4)),
}


@pytest.mark.parametrize("name", list(_RULE_OPTIMIZERS))
@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
@pytest.mark.parametrize("params,kw", [
    ("fp32", dict(offload="cpu")),
    ("fp32", dict(offload="nvme", max_host_bytes=8 << 20)),
    ("bf16", dict(offload="cpu")),
    ("bf16", dict(offload="nvme", max_host_bytes=8 << 20)),
    ("bf16", dict(offload="nvme", max_host_bytes=8 << 20, master_dtype="bfloat16")),
])
def test_plan_then_run_rule_optimizers(tmp_path, name, state_dtype, params, kw):
    """SGD (with and without momentum), Adagrad and Lion are planned with their own states
    (one per element, or none), not refused or billed as Adam's two: the plan is the report."""
    model = _fp32_model_with_small_params() if params == "fp32" else _model()
    cls, hyper = _RULE_OPTIMIZERS[name]
    kw = dict(kw, state_dtype=state_dtype)
    plan = estimate(model, optimizer=name, param_device="cpu", cuda=False, **kw)
    if kw["offload"] == "nvme":
        kw["swap_dir"] = str(tmp_path)
    opt = cls(model.parameters(), **hyper, **kw)
    try:
        opt.step()
        assert opt.memory_report()["tiers"] == plan.optimizer_bytes
    finally:
        opt.close()
