"""The planner's stage 3 and parameter offload rows (issue #16, item 5 and the device-bytes
targets), the ZeRO paper's table, and ZeRO-Offload's device footprint for stages 0-2
(``release_grads``). Numbers worked out by hand from [Note: stage 3 bytes] in
offload/plan/stage3.py; CLI output is parsed, not compared as a snapshot."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
import torch

from offload.plan import TIERS, estimate, format_zero_table, unit_sizes_from_hf_config, zero_table

GiB = 1 << 30
PSI, ND, K = 7_500_000_000, 64, 12


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- the paper's table

# ZeRO paper, figure 1: Ψ = 7.5B, N_d = 64, K = 12 (GB = 10^9 B):
#   baseline (2 + 2 + K)Ψ = 120e9; P_os 4Ψ + KΨ/N_d = 30e9 + 1.40625e9;
#   P_os+g 2Ψ + (2 + K)Ψ/N_d = 15e9 + 1.640625e9; P_os+g+p (2 + 2 + K)Ψ/N_d = 1.875e9
PAPER = [("baseline", 120_000_000_000, 120.0), ("P_os", 31_406_250_000, 31.4),
         ("P_os+g", 16_640_625_000, 16.6), ("P_os+g+p", 1_875_000_000, 1.9)]


def test_zero_table_is_the_papers():
    rows = zero_table(PSI, ND, K)
    assert [(r["stage"], r["name"], r["bytes"], r["gb"]) for r in rows] == \
        [(st, name, exact, gb) for st, (name, exact, gb) in enumerate(PAPER)]
    # K and N_d enter as the formulas say: Adam without a master (K = 8), one rank
    assert [r["bytes"] for r in zero_table(1000, 1, 8)] == [12_000, 12_000, 12_000, 12_000]


def test_zero_table_text_and_cli():
    text = format_zero_table(PSI, ND, K)
    rc, out, _ = _cli("plan", "--params", "7.5B", "--world-size", "64", "--zero-table")
    assert rc == 0 and out.strip() == text
    got = {}
    for line in text.splitlines()[2:]:
        cells = line.split()
        got[cells[1]] = float(cells[-2])
    assert got == {name: round(exact / 1e9, 2) for name, exact, _ in PAPER}
    rc, out, _ = _cli("plan", "--params", "7.5B", "--world-size", "64", "--k", "8", "--zero-table", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["k"] == 8 and doc["rows"][3]["bytes"] == 12 * PSI / ND


@pytest.mark.parametrize("args", [(-1, 64, 12), (10, 0, 12), (10, 2, -1), (10, True, 12), (1.5, 2, 12)])
def test_zero_table_bad_values(args):
    with pytest.raises(ValueError, match="must be an integer"):
        zero_table(*args)


# --------------------------------------------------------------------------- device targets

def test_device_target_stage2_offload_keeps_params_only():
    # ZeRO-Offload: fp16 params on the device (2Ψ = 15e9 B), grads leave once copied to the host
    for off in ("cpu", "nvme"):
        plan = estimate(PSI, world_size=ND, stage=2, offload=off, param_dtype="fp16", release_grads=True,
                        max_host_bytes="4GiB")
        dev = plan.per_rank["device"]
        assert 2 * PSI <= dev <= 1.05 * 2 * PSI, dev
        assert plan.breakdown["device"]["params"] == 2 * PSI
        assert plan.sharding == {"offload_params": "none", "release_grads": True, "device_grad_numel": 2 * (1 << 22)}
    # without it p.grad stays whole on the device: 4Ψ
    assert estimate(PSI, world_size=ND, stage=2, offload="cpu", param_dtype="fp16").per_rank["device"] > 4 * PSI


@pytest.mark.parametrize("offload_params", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_device_target_stage3_within_the_papers_figure(offload, offload_params):
    plan = estimate(PSI, world_size=ND, stage=3, offload=offload, offload_params=offload_params,
                    param_dtype="fp16", max_host_bytes="4GiB")
    assert plan.per_rank["device"] <= (2 + 2 + K) * PSI / ND
    assert plan.fits_all and not plan.problems
    # nothing of the optimizer's states on the device
    assert all(plan.breakdown["device"][c] == 0 for c in ("master", "exp_avg", "exp_avg_sq", "grads"))


# --------------------------------------------------------------------------- by hand

def _small(**kw):
    # 10,000 params: a root unit of 1,000 and units of 4,000, 3,000 and 2,000 on 3 ranks.
    # chunk = ceil(u / 3) rounded up to 256: 334 -> 512, 1334 -> 1536, 1000 -> 1024,
    # 667 -> 768; S = 512 + 1536 + 1024 + 768 = 3,840; gathered: root 1,536, units 4,608,
    # 3,072, 2,304; live window (prefetch 1) = the root and the two largest = 9,216
    args = dict(world_size=3, stage=3, offload="cpu", unit_params=[1000, 4000, 3000, 2000])
    args.update(kw)
    return estimate(10_000, **args)


def test_by_hand_bf16_cpu_params():
    plan = _small(param_device="cpu", param_dtype="bf16")
    sh, b = plan.sharding, plan.breakdown["pageable"]
    assert (sh["units"], sh["chunk_max"], sh["shard_numel"], sh["gathered_max"]) == (3, 1536, 3840, 4608)
    assert (sh["root_numel"], sh["root_gathered"]) == (1000, 1536)
    assert (sh["window_numel"], sh["window_units"]) == (9216, 2)
    assert plan.inputs["shard_numel"] == 3840 and plan.inputs["separate_master"] is True
    # the grads of the root and of the largest unit, bf16
    assert b["live_params"] == 9216 * 2 and b["live_grads"] == (1000 + 4000) * 2
    # the bucketed float32 reduce-scatter, 2 buckets in flight of c = min(1536, 4 Mi / 3) = 1536:
    # send 3 x c + output c, 4 B each
    assert b["comm_buffers"] == 2 * (3 * 1536 + 1536) * 4 == 49_152
    assert b["params"] == b["grads"] == 3840 * 2         # this rank's shards
    assert b["master"] == b["exp_avg"] == b["exp_avg_sq"] == 3840 * 4
    assert plan.per_rank == {"device": 0, "pinned": 0, "pageable": 18_432 + 10_000 + 49_152 + 15_360 + 46_080,
                             "nvme": 0}
    assert plan.optimizer_bytes["pageable"] == 3 * 3840 * 4 + 49_152


def test_by_hand_fp32_cpu_params_are_their_own_master():
    plan = _small(param_device="cpu", param_dtype="fp32")
    b = plan.breakdown["pageable"]
    assert b["master"] == 0 and b["exp_avg"] == b["exp_avg_sq"] == 3840 * 4
    assert b["params"] == b["grads"] == 3840 * 4 and b["live_params"] == 9216 * 4
    assert plan.inputs["separate_master"] is False and plan.sharding["own_master"] is True


def test_by_hand_device_params_offloaded_to_host():
    plan = _small(param_dtype="bf16", offload_params="cpu")   # CUDA assumed for device params
    d, p = plan.breakdown["device"], plan.breakdown["pinned"]
    # window + unit grads + reduce-scatter output + (1 + prefetch) host-to-device staging chunks
    assert d["live_params"] == 18_432 and d["live_grads"] == 10_000
    assert d["comm_buffers"] == 49_152 + 2 * 1536 * 2
    assert plan.per_rank["device"] == 18_432 + 10_000 + 49_152 + 6_144
    # the copy engine reads the param shards and writes the grad shards: pinned
    assert p["params"] == p["grads"] == 3840 * 2 and plan.per_rank["pinned"] == 15_360
    assert plan.per_rank["pageable"] == 3 * 3840 * 4
    # without CUDA nothing is pinned
    assert _small(param_dtype="bf16", offload_params="cpu", cuda=False).per_rank["pinned"] == 0


def test_by_hand_device_params_on_the_device():
    plan = _small(param_dtype="bf16", offload_params="none")
    d = plan.breakdown["device"]
    assert d["params"] == 3840 * 2 and d["comm_buffers"] == 49_152        # no staging: the shard is there
    assert plan.breakdown["pinned"]["lowp_buffers"] == 3840 * 2         # the update's way to the device
    assert plan.breakdown["pinned"]["grads"] == 3840 * 2


def test_one_rank_has_no_collective_buffers():
    plan = estimate(1000, stage=3, param_device="cpu", unit_params=300)
    # units 300 x 3 + 100: chunks 512, 512, 512, 256 -> S = 1,792
    assert plan.sharding["shard_numel"] == 1792
    assert plan.breakdown["pageable"]["comm_buffers"] == 0


@pytest.mark.parametrize("kw, window, units", [
    (dict(max_live_params=7000), 6144, 1),                 # root 1,536 + 4,608; + 3,072 does not fit
    (dict(max_live_params=7000, prefetch=2), 6144, 1),     # + 2,304 does not either
    (dict(max_live_params=9000, prefetch=2), 8448, 2),     # the root, the largest and the smallest
    (dict(max_live_bytes=18_000, prefetch=2), 8448, 2),    # 18,000 B of bf16 = 9,000 elements
    (dict(prefetch=0), 6144, 1),
    (dict(prefetch=5), 11_520, 3),                         # every unit
])
def test_live_window(kw, window, units):
    plan = _small(param_device="cpu", param_dtype="bf16", **kw)
    assert (plan.sharding["window_numel"], plan.sharding["window_units"]) == (window, units)
    assert plan.breakdown["pageable"]["live_params"] == window * 2


def test_a_unit_larger_than_the_bound_is_gathered_alone():
    plan = _small(param_device="cpu", param_dtype="bf16", max_live_params=100)
    assert plan.sharding["window_numel"] == 1536 + 4608
    assert any("exceed the live-window bound" in n for n in plan.notes)
    assert not any("live-window" in n for n in _small(param_device="cpu", max_live_params=6144).notes)


def test_exact_unit_sizes_and_the_default():
    # the root first; a unit of 0 params is none
    plan = estimate(10_000, world_size=3, stage=3, param_device="cpu", unit_params=[4000, 0, 4000, 2000])
    assert plan.sharding["shard_numel"] == 3840 and plan.sharding["units_assumed"] is False
    assert (plan.sharding["units"], plan.sharding["root_numel"]) == (2, 4000)
    # one size: the leftover is the root (10,000 = 1,000 + 3 x 3,000)
    plan = estimate(10_000, world_size=3, stage=3, param_device="cpu", unit_params=3000)
    assert (plan.sharding["units"], plan.sharding["root_numel"]) == (3, 1000)
    plan = estimate(3200, stage=3, param_device="cpu")     # 32 equal units of 100 -> chunks of 256
    assert (plan.sharding["units"], plan.sharding["shard_numel"]) == (32, 32 * 256)
    assert plan.sharding["units_assumed"] and any("assumed 32 equal units of 100 params" in n for n in plan.notes)
    assert plan.sharding["root_numel"] == 0 and plan.sharding["window_numel"] == 2 * 256


# --------------------------------------------------------------------------- NVMe and the step

def test_nvme_params_and_states_io_split():
    n, N = 1_000_000, 2
    plan = estimate(n, world_size=N, stage=3, offload="nvme", offload_params="nvme", param_dtype="bf16",
                    param_device="cpu", unit_params=250_000, kernel_gparams=1.0, disk_read_gbps=2.0,
                    disk_write_gbps=1.0)
    # chunk = 125,000 -> 125,184; S = 4 x 125,184 = 500,736
    S = 500_736
    sh, io_, st = plan.sharding, plan.sharding["io"], plan.step
    assert sh["shard_numel"] == S
    nv = plan.breakdown["nvme"]
    assert nv["params"] == S * 2 and nv["grads"] == S * 2              # one copy each
    sw = plan.inputs["swap"]
    assert sw["nstates"] == 3 and nv["master"] == nv["exp_avg"] == nv["exp_avg_sq"] == sw["disk_bytes"] // 3
    # io buffers: the swap pipeline's + (1 + prefetch) param chunks + 2 grad chunks
    assert plan.breakdown["pageable"]["io_buffers"] == sw["host_bytes"] + 2 * 125_184 * 2 + 2 * 125_184 * 2
    assert io_["param_read_bytes"] == 2 * S * 2 and io_["param_write_bytes"] == S * 2
    assert io_["grad_write_bytes"] == io_["grad_read_bytes"] == S * 2
    assert io_["state_read_bytes"] == io_["state_write_bytes"] == sw["file_bytes"]
    assert st["read_bytes"] == sw["file_bytes"] + S * 2 and st["write_bytes"] == sw["file_bytes"] + S * 2
    io_s = st["read_bytes"] / 2e9 + st["write_bytes"] / 1e9
    assert math.isclose(st["io_s"], io_s) and math.isclose(st["kernel_s"], S / 1e9)
    assert math.isclose(st["step_time_s"], max(io_s, S / 1e9))
    fb = 2 * S * 2 / 2e9 + S * 2 / 1e9
    assert math.isclose(io_["fwd_bwd_io_s"], fb) and math.isclose(io_["train_step_io_s"], fb + io_s)


def test_fp32_cpu_params_on_nvme_keep_one_copy_and_a_master_in_the_states():
    # the param file is not crash-safe: the flat store keeps an fp32 master (the truth) in its
    # swap files, as the runtime does (offload/shard/tier.py [Note: the param tier])
    plan = estimate(100_000, stage=3, offload="nvme", offload_params="nvme", param_dtype="fp32",
                    param_device="cpu", unit_params=50_000)
    S = plan.sharding["shard_numel"]
    assert plan.breakdown["nvme"]["params"] == S * 4 and plan.inputs["swap"]["nstates"] == 3
    assert plan.breakdown["nvme"]["grads"] == S * 4


def test_a_bf16_master_with_params_on_nvme_is_refused():
    plan = estimate(100_000, stage=3, offload="nvme", offload_params="nvme", param_dtype="bf16",
                    param_device="cpu", unit_params=50_000, master_dtype="bfloat16")
    assert any("not crash-safe" in p for p in plan.problems)


def test_without_disk_rates_the_io_is_unknown_not_zero():
    plan = estimate(10_000, stage=3, offload_params="nvme", param_device="cpu", unit_params=5000, kernel_gparams=1)
    assert plan.sharding["io"]["fwd_bwd_io_s"] is None and plan.step_time_s is None
    plan = estimate(10_000, stage=3, offload_params="cpu", param_device="cpu", unit_params=5000, kernel_gparams=1)
    assert plan.step["io_s"] == 0.0 and plan.step_time_s == plan.step["kernel_s"]


# --------------------------------------------------------------------------- sanity

@pytest.mark.parametrize("offload, offload_params", [("cpu", "cpu"), ("nvme", "nvme"), ("cpu", "none")])
def test_more_ranks_fewer_bytes_per_rank(offload, offload_params):
    prev = None
    for N in (1, 2, 4, 8, 16, 64):
        plan = estimate(PSI, world_size=N, stage=3, offload=offload, offload_params=offload_params,
                        param_dtype="fp16", max_host_bytes="4GiB")
        total = sum(plan.per_rank.values())
        if prev is not None:
            assert total < prev[0] and plan.host_bytes <= prev[1]
            # the live window depends on the unit, not on N_d: only the padding to 256 x N_d moves it
            assert abs(plan.breakdown["device"]["live_params"] - prev[2]) <= 2 * N * 256 * 2 * 2
        prev = (total, plan.host_bytes, plan.breakdown["device"]["live_params"])
        # and stage 3 holds fewer bytes per rank than stage 2 (N_d > 1)
        if N > 1:
            st2 = estimate(PSI, world_size=N, stage=2, offload=offload, param_dtype="fp16", max_host_bytes="4GiB")
            assert total < sum(st2.per_rank.values())


def test_hf_config_units_are_the_layers(tmp_path):
    llama = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(llama))
    units = unit_sizes_from_hf_config(cfg)
    # root: embed + lm_head 2 x 32000 x 4096 + final norm 4096; then 32 layers of 202,383,360
    assert units == [262_148_096] + [202_383_360] * 32 and sum(units) == 6_738_415_616
    rc, out, _ = _cli("plan", "--model-config", str(cfg), "--stage", "3", "--world-size", "8", "--no-probe",
                      "--json")
    sh = json.loads(out)["sharding"]
    assert rc == 0 and (sh["units"], sh["unit_numel_max"], sh["units_assumed"]) == (32, 202_383_360, False)
    assert sh["root_numel"] == 262_148_096


def test_hf_units_match_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() for p in model.parameters())
    d = cfg.to_dict()
    d["model_type"] = "llama"
    assert unit_sizes_from_hf_config(d) == [total - sum(layers)] + layers


# --------------------------------------------------------------------------- release_grads, stages 0-2

def test_release_grads_one_and_several_ranks():
    n = 1_000_000_000
    one = estimate(n, offload="cpu", release_grads=True)
    assert one.breakdown["device"]["grads"] == 2 * (1 << 22) * 2          # two 4 Mi buckets of bf16 in flight
    assert one.per_rank["pinned"] == estimate(n, offload="cpu").per_rank["pinned"]   # host side unchanged
    assert one.per_rank["device"] == 2 * n + 2 * (1 << 22) * 2
    assert estimate(1000, offload="cpu", release_grads=True).breakdown["device"]["grads"] == 1000 * 2
    # four ranks: the in-backward reduction's slots are added (send 4 x chunk x 4 B per slot, the sum
    # landing in it, chunk = 2^22 / 4), and its "not counted" remark goes away
    four = estimate(n, world_size=4, stage=2, offload="cpu", release_grads=True)
    base = estimate(n, world_size=4, stage=2, offload="cpu")
    chunk = 1 << 20
    assert four.breakdown["device"]["comm_buffers"] - base.breakdown["device"]["comm_buffers"] == \
        2 * 4 * chunk * 4
    assert any("reduce_in_backward" in m for m in base.notes)
    assert not any("reduce_in_backward" in m for m in four.notes)
    assert any("p.grad is not readable" in m for m in four.notes)
    assert not any("keeps p.grad whole" in m for m in four.notes)


# --------------------------------------------------------------------------- CLI

def test_cli_stage3_table_numbers(tmp_path):
    argv = ["plan", "--params", "2B", "--world-size", "4", "--stage", "3", "--offload", "nvme",
            "--offload-params", "nvme", "--param-device", "cpu", "--unit-params", "100M", "--prefetch", "2",
            "--max-live-params", "250M", "--max-host-bytes", "2GiB", "--kernel-gparams", "1", "--disk-gbps", "2"]
    rc, out, _ = _cli(*argv)
    assert rc == 0
    plan = estimate("2B", world_size=4, stage=3, offload="nvme", offload_params="nvme", param_device="cpu",
                    unit_params="100M", prefetch=2, max_live_params="250M", max_host_bytes="2GiB",
                    kernel_gparams=1, disk_gbps=2)
    total = next(l.split() for l in out.splitlines() if l.split()[:1] == ["total"])
    assert [float(x) for x in total[1:5]] == [round(plan.per_rank[t] / GiB, 2) for t in TIERS]
    # 100M-param units gathered: 4 x 25,000,192 = 100,000,768 elements; two fit in 250M
    m = re.search(r"live window: the root and (\d+) gathered unit\(s\) = ([\d,]+) elements \(prefetch 2, "
                  r"bounded by ([\d,]+)", out)
    assert m and (int(m[1]), int(m[2].replace(",", "")), m[3]) == (2, 200_001_536, "250,000,000")
    m = re.search(r"forward \+ backward on NVMe: param reads ([\d.]+) GiB .* grad writes ([\d.]+) GiB: at least "
                  r"([\d.]+) ms", out)
    io_ = plan.sharding["io"]
    assert m and float(m[1]) == round(io_["param_read_bytes"] / GiB, 2)
    assert float(m[3]) == round(io_["fwd_bwd_io_s"] * 1e3, 1)
    rc, out, _ = _cli(*argv, "--json")
    doc = json.loads(out)
    assert doc["sharding"] == json.loads(json.dumps(plan.to_dict()["sharding"]))
    rc, out, _ = _cli(*argv, "--explain")
    assert "P_os+g+p" in out and "live window (host memory)" in out
    assert f"S = sum chunk_i = {plan.sharding['shard_numel']:,} elements" in out


@pytest.mark.parametrize("kwargs, exc, fragment", [
    (dict(stage=3, offload_params="disk"), ValueError, "disk"),
    (dict(stage=2, offload_params="cpu"), ValueError, "stage 3 only"),
    (dict(stage=2, unit_params=100), ValueError, "stage 3 only"),
    (dict(stage=1, prefetch=1), ValueError, "stage 3 only"),
    (dict(stage=3, unit_params=0), ValueError, "unit_params"),
    (dict(stage=3, unit_params="many"), ValueError, "many"),
    (dict(stage=3, unit_params=[1, 2]), ValueError, "sum to 3"),
    (dict(stage=3, unit_params=[500, -1, 501]), ValueError, "-1"),
    (dict(stage=3, unit_params=[]), ValueError, "at least one unit"),
    (dict(stage=3, max_live_params=0), ValueError, "max_live_params"),
    (dict(stage=3, max_live_bytes=0), ValueError, "max_live_bytes"),
    (dict(stage=3, max_live_bytes="-1GiB"), ValueError, "-1GiB"),
    (dict(stage=3, max_live_params=10, max_live_bytes=10), ValueError, "not both"),
    (dict(stage=3, prefetch=-1), ValueError, "-1"),
    (dict(stage=3, prefetch=True), ValueError, "True"),
    (dict(stage=2, release_grads="yes"), TypeError, "bool"),
    (dict(stage=2, release_grads=True, param_device="cpu"), ValueError, "param_device='cpu'"),
    (dict(stage=3, release_grads=True), ValueError, "release_grads is for stages 0-2"),  # as the optimizer says
])
def test_bad_values_are_clear_errors(kwargs, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        estimate(1000, world_size=2, **kwargs)


def test_cli_bad_values():
    with pytest.raises(SystemExit) as e:  # a usage error now, as --stage 4 is
        _cli("plan", "--params", "1B", "--stage", "3", "--offload-params", "disk", "--no-probe")
    assert e.value.code == 2
    rc, _, err = _cli("plan", "--params", "1B", "--world-size", "2", "--stage", "3", "--release-grads", "--no-probe")
    assert rc == 1 and "release_grads is for stages 0-2" in err
    rc, _, err = _cli("plan", "--params", "1B", "--offload-params", "cpu", "--no-probe")
    assert rc == 1 and "stage 3 only" in err
    with contextlib.redirect_stderr(io.StringIO()) as err:
        with pytest.raises(SystemExit) as e:
            _cli("plan", "--params", "1B", "--stage", "3", "--prefetch", "-1")
    assert e.value.code == 2


def test_host_memory_flat_as_the_model_grows():
    # params and states on NVMe, max_host_bytes 2 GiB, 25M-param units: from 1B params on, the
    # swap pipeline fills its bound and nothing else on the host depends on the model's size
    host = []
    for n in ("1B", "2B", "8B"):
        plan = estimate(n, stage=3, offload="nvme", offload_params="nvme", param_device="cpu", param_dtype="bf16",
                        max_host_bytes="2GiB", unit_params="25M")
        b = plan.breakdown["pageable"]
        assert plan.inputs["swap"]["host_bytes"] <= 2 * GiB
        chunk = 25_000_192                                          # 25M rounded up to 256
        staging = 2 * chunk * 2 + 2 * chunk * 2                     # 2 param chunks + 2 grad chunks, bf16
        assert b["live_grads"] == 25_000_000 * 2
        assert plan.host_bytes == plan.inputs["swap"]["host_bytes"] + staging + b["live_params"] + b["live_grads"]
        host.append(plan.host_bytes)
    assert host[0] == host[1] == host[2]


# --------------------------------------------------------------------------- plan == runtime

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_layout_equals_the_runtime(dtype):
    # offload.shard's own layout (one rank, no process group): what model.parameters() yields
    # after shard() is this rank's shard, and the plan's S must be its size. Units: the
    # TinyGPT blocks (shard's default policy: the elements of a ModuleList), the root the rest.
    shard_mod = pytest.importorskip("offload.shard", reason="offload.shard (issue #16) is not in this tree")
    from offload.demo.model import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=3, d_model=64, n_head=4, block_size=32)).to(dtype)
    blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    total = sum(p.numel() for p in set(model.parameters()))
    shard_mod.shard(model)
    shards = [p for p in model.parameters() if p.requires_grad]
    plan = estimate(total, stage=3, param_device="cpu", param_dtype=dtype, unit_params=[total - sum(sizes)] + sizes)
    assert plan.sharding["shard_numel"] == sum(p.numel() for p in shards)
    assert plan.breakdown["pageable"]["params"] == sum(p.numel() * p.element_size() for p in shards)


def test_cheapest_fitting_tries_stage3_when_asked():
    from offload.plan import cheapest_fitting

    # 7.5B fp16 on 64 ranks with 8 GiB devices: stages 0-2 keep 2 bytes of params per param
    # on the device (15 GB) and cannot fit; stage 3 does
    kw = dict(world_size=64, param_dtype="fp16", device_memory="8GiB", host_memory="512GiB", kernel_gparams=1.0)
    best, tried = cheapest_fitting(PSI, **kw)
    assert best is None and {p.inputs["stage"] for p in tried} == {0, 1, 2}
    best, tried = cheapest_fitting(PSI, stages=(0, 1, 2, 3), **kw)
    assert best is not None and best.inputs["stage"] == 3 and best.fits["device"] is True
    # release_grads is for stages 0-2; stage 3 frees its grads itself and is planned without it
    best, tried = cheapest_fitting(PSI, stages=(0, 1, 2, 3), release_grads=True, **kw)
    assert best is not None and best.inputs["stage"] == 3
    assert [p.sharding["release_grads"] for p in tried if p.inputs["stage"] < 3] == [True] * 3 * 2
    # one rank: nothing to partition, stage 3 skipped as stages 1 and 2 are
    _, tried = cheapest_fitting(1000, stages=(0, 3), kernel_gparams=1.0)
    assert {p.inputs["stage"] for p in tried} == {0}


def test_stage3_json_keys_are_stable():
    keys = {"offload_params", "release_grads", "prefetch", "max_live_params", "units_assumed", "own_master",
            "nvme_slots", "units", "root_numel", "root_gathered", "unit_numel_max", "chunk_max", "shard_numel",
            "gathered_max", "window_numel", "window_units", "io"}
    rc, out, _ = _cli("plan", "--params", "1B", "--world-size", "2", "--stage", "3", "--no-probe", "--json")
    doc = json.loads(out)
    assert rc == 0 and set(doc["sharding"]) == keys
    assert set(doc["sharding"]["io"]) == {"param_read_bytes", "param_write_bytes", "grad_write_bytes",
                                          "grad_read_bytes", "state_read_bytes", "state_write_bytes",
                                          "fwd_bwd_io_s", "train_step_io_s"}
    rc, out, _ = _cli("plan", "--params", "1B", "--no-probe", "--json")
    assert json.loads(out)["sharding"] == {"offload_params": "none", "release_grads": False}


def test_stage3_states_follow_the_setups_rule():
    # once the setup carries the compressed-state options (its ``rule`` and ``master_lowp``),
    # stage 3 counts those fields; without them, Adam's float32 states and master
    from types import SimpleNamespace

    from offload.kernels.fields import ADAM
    from offload.plan.stage3 import _fields

    assert [f.name for f in _fields(SimpleNamespace(), False)] == ["master", "exp_avg", "exp_avg_sq"]
    assert [f.name for f in _fields(SimpleNamespace(), True)] == ["exp_avg", "exp_avg_sq"]
    int8 = ADAM.with_state_dtype("int8")
    got = _fields(SimpleNamespace(rule=int8, master_lowp=False), False)
    assert [f.name for f in got] == ["master", "exp_avg", "exp_avg_sq"] and tuple(got[1:]) == tuple(int8.fields)
    assert tuple(_fields(SimpleNamespace(rule=int8, master_lowp=True), False)) == tuple(int8.fields)


class _Blocks(torch.nn.Module):
    """A root param (the embedding) and three blocks in a ModuleList: offload.shard's
    default units."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
                                          for _ in range(3))

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return x


def test_a_module_is_planned_with_the_units_offload_shard_makes():
    """A module given to estimate(stage=3) was planned as 32 equal units: its live window,
    the unit's grads and the shard (each unit padded to 256 elements) were another model's."""
    import offload

    model = _Blocks()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    plan = estimate(model, stage=3, offload="cpu", param_device="cpu", cuda=False)
    sh = plan.sharding
    assert (sh["units"], sh["units_assumed"], sh["unit_numel_max"]) == (3, False, block)
    assert sh["root_numel"] == sum(p.numel() for p in model.emb.parameters())
    assert not any("assumed" in n for n in plan.notes)
    assert plan.breakdown["pageable"]["live_grads"] == 4 * (sh["root_numel"] + block)
    offload.shard(model)
    assert sh["shard_numel"] == sum(p.numel() for p in model.parameters())  # the shards shard() made
    # a model already sharded has lost its units: assumed, and said so
    assert estimate(model, stage=3, param_device="cpu", cuda=False).sharding["units_assumed"]
