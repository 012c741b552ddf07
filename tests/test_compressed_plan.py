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
    opt = offload.AdamW(model.parameters(), lr=1e-3, backend="torch", **kw)  # (the bytes are any backend's)
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
