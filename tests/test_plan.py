"""The memory planner: numbers worked out by hand, config param counts, bad input, CLI schema."""
from __future__ import annotations

import contextlib
import io
import json
import math
import re

import pytest
import torch

from offload.plan import (
    COMPONENTS,
    TIERS,
    cheapest_fitting,
    count_params,
    disk_rate_from_tune,
    estimate,
    kernel_rate_from_bench,
    params_from_hf_config,
    probe_kernel_rate,
    zero_paper_bytes,
)

GiB = 1 << 30


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


# --------------------------------------------------------------------------- ZeRO paper

# ZeRO paper, section 3 / figure 1: Ψ = 7.5B, N_d = 64, K = 12, fp16 params and grads,
# GB = 10^9 bytes. Worked out by hand:
#   baseline  (2 + 2 + K)Ψ        = 16 x 7.5e9                     = 120e9        -> 120 GB
#   P_os      4Ψ + KΨ/N_d         = 30e9 + 12 x 7.5e9 / 64 = 30e9 + 1.40625e9      -> 31.4 GB
#   P_os+g    2Ψ + (2 + K)Ψ/N_d   = 15e9 + 14 x 7.5e9 / 64 = 15e9 + 1.640625e9     -> 16.6 GB
PAPER = {0: (120_000_000_000, 120.0), 1: (31_406_250_000, 31.4), 2: (16_640_625_000, 16.6)}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_paper_7_5b_on_64_ranks(stage):
    exact, printed = PAPER[stage]
    assert zero_paper_bytes(7_500_000_000, 64, stage) == exact
    assert round(exact / 1e9, 1) == printed
    plan = estimate(7_500_000_000, world_size=64, stage=stage, offload="cpu", param_dtype=torch.float16)
    assert plan.to_dict()["zero_paper_bytes"] == exact
    # The same model states, wherever this engine puts them (params, grads, fp32 master and
    # moments summed over the tiers), are the paper's figure - except that stage 2 keeps
    # p.grad whole on the device (2Ψ instead of 2Ψ/N_d: + 2 x 7.5e9 x 63/64 = 14,765,625,000).
    states = sum(plan.breakdown[t][c] for t in TIERS for c in ("params", "grads", "master", "exp_avg", "exp_avg_sq"))
    assert states == exact + (14_765_625_000 if stage == 2 else 0)


def test_engine_placement_7_5b_on_64_ranks_stage1():
    # fp16 params on 64 GPUs, stage 1, worked by hand:
    #   shard S = 7.5e9 / 64 = 117,187,500 elements
    #   device: params 2Ψ = 15e9, grads 2Ψ = 15e9; collective buffers per bucket of
    #     chunk = min(S, 2^22 / 64) = 65,536 elements: send 64 x 65,536 x 4 = 16,777,216,
    #     gather 64 x 65,536 x 2 = 8,388,608, reduce-scatter out 65,536 x 4 = 262,144
    #   pageable host (nothing of it is a DMA source or target: the master of fp16 params is
    #     not copied to the device, the shards go through the collective's buffers):
    #     master + exp_avg + exp_avg_sq 12 S = 1,406,250,000; fp32 grad shard
    #     4 S = 468,750,000; fp16 shard for the all-gather 2 S = 234,375,000
    plan = estimate("7.5B", world_size=64, stage=1, offload="cpu", param_dtype="fp16")
    S = 117_187_500
    assert plan.inputs["shard_numel"] == S
    d, h = plan.breakdown["device"], plan.breakdown["pageable"]
    assert (d["params"], d["grads"], d["comm_buffers"]) == (15_000_000_000, 15_000_000_000, 25_427_968)
    assert (h["master"], h["exp_avg"], h["exp_avg_sq"]) == (4 * S, 4 * S, 4 * S)
    assert (h["grad_buffers"], h["lowp_buffers"]) == (468_750_000, 234_375_000)
    assert plan.per_rank == {"device": 30_025_427_968, "pinned": 0, "pageable": 2_109_375_000, "nvme": 0}


def test_stage3_is_planned():
    # stage 3's own rows are checked in tests/test_plan_stage3.py
    plan = estimate(7_500_000_000, world_size=64, stage=3)
    assert plan.supported is True and plan.fits_all is True
    # the paper's P_os+g+p figure: 16 x 7.5e9 / 64 = 1.875e9
    assert plan.to_dict()["zero_paper_bytes"] == 1_875_000_000
    rc, out, _ = _cli("plan", "--params", "7.5B", "--world-size", "64", "--stage", "3", "--no-probe")
    assert rc == 0 and "not yet" not in out and "live window" in out


# --------------------------------------------------------------------------- offload by hand

def test_device_bf16_offload_cpu_one_rank():
    n = 1_000_000_000
    plan = estimate(n, offload="cpu")                 # bf16 params on the accelerator
    b = plan.breakdown
    assert plan.per_rank["device"] == 2 * n + 2 * n   # params + grads
    # flat fp32 master + moments in pageable pool buffers (no DMA reads the master of bf16
    # params; the moments never leave the host)
    assert b["pageable"]["master"] == b["pageable"]["exp_avg"] == b["pageable"]["exp_avg_sq"] == 4 * n
    # pinned because CUDA is there and the copy engine reads or writes them
    assert b["pinned"]["grad_buffers"] == 2 * n        # grads copied to the host in bf16
    assert b["pinned"]["lowp_buffers"] == 2 * n        # bf16 staging of the updated params
    assert plan.per_rank == {"device": 4 * n, "pinned": 4 * n, "pageable": 12 * n, "nvme": 0}
    assert plan.optimizer_bytes == {"device": 0, "pinned": 4 * n, "pageable": 12 * n, "nvme": 0}
    # offload="none" is the same in this engine (states of device params stay on the host)
    assert estimate(n, offload="none").per_rank == plan.per_rank
    # without CUDA (planning for a CPU-only host) the same buffers are pageable
    assert estimate(n, offload="cpu", cuda=False).per_rank["pageable"] == 16 * n


def test_device_bf16_offload_cpu_stage2_four_ranks():
    n, N = 1_000_000_000, 4
    S = n // N                                        # 250,000,000
    plan = estimate(n, world_size=N, stage=2, offload="cpu")
    # chunk = min(S, 2^22 / 4) = 1,048,576: send 4 x chunk x 4 B + gather 4 x chunk x 2 B + out chunk x 4 B
    comm = 4 * 1_048_576 * 4 + 4 * 1_048_576 * 2 + 1_048_576 * 4
    assert plan.per_rank["device"] == 2 * n + 2 * n + comm
    # 12 S of states + 4 S fp32 grad shard + 2 S bf16 shard, all pageable (no DMA touches them)
    assert plan.per_rank["pageable"] == 18 * S and plan.per_rank["pinned"] == 0
    # stage 1 holds the same bytes (it differs in the collective only)
    assert estimate(n, world_size=N, stage=1, offload="cpu").per_rank == plan.per_rank


def test_cpu_fp32_params_several_ranks_use_the_flat_store():
    n, N = 1_000_000, 2
    plan = estimate(n, world_size=N, stage=2, offload="cpu", param_dtype="fp32", param_device="cpu")
    S = n // N
    b = plan.breakdown["pageable"]
    assert (b["params"], b["grads"]) == (4 * n, 4 * n)
    assert (b["master"], b["exp_avg"], b["exp_avg_sq"], b["grad_buffers"]) == (4 * S, 4 * S, 4 * S, 4 * S)
    assert b["lowp_buffers"] == 0
    # gloo: collective buffers on the CPU; chunk = min(S, 2^21) = S
    assert b["comm_buffers"] == 2 * S * 4 + 2 * S * 4 + S * 4


def test_device_bf16_offload_nvme():
    n = 1000 << 20                                    # 1,048,576,000: every state 4 KiB-aligned
    plan = estimate(n, offload="nvme", max_host_bytes=GiB)
    # The flat store swaps master and moments (3 fp32 states = 12 B per element); the swap
    # layer's rules (offload/swap/pipeline.py plan_sub_groups), worked by hand within 1 GiB:
    #   sub-group = floor(2^30 / (4 buffers x 12 B) / 1024) x 1024        = 22,369,280 elements
    #     (under the cap of ceil(n / 16 groups) = 65,536,000)
    #   groups    = ceil(1,048,576,000 / 22,369,280)                      = 47 (last: 19,589,120)
    #   region    = 3 states x 4 B x 22,369,280                           = 268,431,360 B
    #   buffers   = min(floor(2^30 / region) = 4, 8, 47 groups)           = 4
    #   mapped    = 4 x region = 1,073,725,440, rounded up to 2 MiB       = 2^30 B
    sw = plan.inputs["swap"]
    assert (sw["sub_group_size"], sw["region_bytes"], sw["buffers"], sw["num_groups"], sw["nstates"]) == \
        (22_369_280, 268_431_360, 4, 47, 3)
    assert plan.breakdown["pageable"]["io_buffers"] == 1 << 30   # pipeline buffers are never pinned
    # disk: 12 B per element (no padding: every piece is a multiple of 4 KiB) in 2 slots
    for c in ("master", "exp_avg", "exp_avg_sq"):
        assert plan.breakdown["nvme"][c] == 2 * 4 * n
    assert plan.per_rank["nvme"] == 2 * 12 * n
    # no fp32 state in host memory: only the pipeline buffers
    assert plan.breakdown["pageable"]["master"] == 0
    assert plan.per_rank["pageable"] == 1 << 30
    # grads and the bf16 copy in pinned host buffers, as with offload="cpu"
    assert plan.breakdown["pinned"]["grad_buffers"] == plan.breakdown["pinned"]["lowp_buffers"] == 2 * n
    assert plan.per_rank["pinned"] == 4 * n
    assert plan.per_rank["device"] == 4 * n
    # the engine offers it now; its limits are notes, not problems
    assert not plan.problems and plan.fits_all is True
    assert any("master, exp_avg and exp_avg_sq" in t for t in plan.notes)
    # one step reads and writes master and moments once
    assert plan.step["read_bytes"] == plan.step["write_bytes"] == 12 * n


def test_flat_store_nvme_stage2_three_ranks_by_hand():
    # bf16 device params, 3 ranks, stage 2: shard S = ceil(3,000,001 / 3) = 1,000,001
    n, S = 3_000_001, 1_000_001
    plan = estimate(n, world_size=3, stage=2, offload="nvme", max_host_bytes="64MiB")
    #   sub-group = min(floor(2^26 / 48 / 1024) x 1024 = 1,397,760,
    #                   max(roundup(ceil(S / 16), 1024) = 63,488, 262,144))  = 262,144
    #   groups = ceil(1,000,001 / 262,144) = 4 (last: 213,569 elements = 854,276 B -> 856,064 B)
    #   region = 3 x 4 x 262,144 = 3,145,728; buffers = min(21, 8, 4) = 4 -> 12 MiB mapped
    #   one slot = 3 x 3,145,728 + 3 x 856,064 = 12,005,376 B
    sw = plan.inputs["swap"]
    assert (sw["sub_group_size"], sw["num_groups"], sw["buffers"]) == (262_144, 4, 4)
    assert plan.per_rank["nvme"] == 2 * 12_005_376
    b = plan.breakdown
    # several ranks: fp32 grad shard, bf16 shard and pipeline buffers, all pageable
    assert (b["pageable"]["master"], b["pageable"]["grad_buffers"], b["pageable"]["lowp_buffers"]) == \
        (0, 4 * S, 2 * S)
    assert plan.per_rank["pageable"] == 6 * S + (12 << 20)
    assert plan.per_rank["pinned"] == 0
    # collective buffers on the GPU: chunk = min(S, 2^22 // 3) = 1,000,001
    assert b["device"]["comm_buffers"] == 3 * S * 4 + 3 * S * 2 + S * 4
    assert not plan.problems


def test_nvme_bound_too_small_is_a_problem_not_a_crash():
    plan = estimate(100_000_000, offload="nvme", param_dtype="fp32", param_device="cpu", max_host_bytes="16KiB")
    # one sub-group of 1024 elements x 2 states = 8 KiB per buffer: 16 KiB holds 2 < 3 buffers
    assert plan.problems and "max_host_bytes" in plan.problems[0]
    assert plan.fits_all is False


def test_cpu_fp32_params_are_their_own_master():
    n = 10_000_000
    plan = estimate(n, offload="cpu", param_dtype=torch.float32, param_device="cpu")
    b = plan.breakdown["pageable"]
    assert b["params"] == 4 * n and b["grads"] == 4 * n
    assert b["master"] == 0
    assert b["exp_avg"] == b["exp_avg_sq"] == 4 * n
    assert plan.per_rank == {"device": 0, "pinned": 0, "pageable": 16 * n, "nvme": 0}
    assert plan.optimizer_bytes["pageable"] == 8 * n
    # the same model with offload="none" holds the same bytes (the CPU is the device)
    assert estimate(n, param_dtype="fp32", param_device="cpu").per_rank == plan.per_rank


def test_cpu_fp32_params_nvme_small_and_large():
    # small: 1000 elements, 2 states (exp_avg, exp_avg_sq; the fp32 param is its own master).
    # One sub-group of 1024 elements (whole 4 KiB pages), one buffer of 2 x 4096 B, mapped as
    # one 2 MiB huge page; on disk each state takes 4096 B (4000 padded) in each of 2 slots.
    n = 1000
    plan = estimate(n, offload="nvme", param_dtype="fp32", param_device="cpu")
    assert plan.breakdown["nvme"]["exp_avg"] == plan.breakdown["nvme"]["exp_avg_sq"] == 2 * 4096
    assert plan.breakdown["nvme"]["master"] == 0
    assert plan.breakdown["pageable"]["io_buffers"] == 2 << 20
    assert plan.per_rank["pinned"] == 0                      # no CUDA: nothing to pin
    # large: 100M elements within 256 MiB:
    #   sub-group = min(floor(2^28 / (4 x 8) / 1024) x 1024 = 8,388,608,
    #                   roundup(ceil(1e8 / 16), 1024) = 6,250,496)  = 6,250,496 elements (16 groups)
    #   region = 2 x 4 x 6,250,496 = 50,003,968 B; buffers = min(floor(2^28 / region) = 5, 8, 16) = 5
    #   mapped = 5 x region = 250,019,840 B, rounded up to 2 MiB = 120 x 2 MiB = 251,658,240 B
    plan = estimate(100_000_000, offload="nvme", param_dtype="fp32", param_device="cpu", max_host_bytes="256MiB")
    assert plan.breakdown["pageable"]["io_buffers"] == 251_658_240
    assert plan.inputs["swap"]["num_groups"] == 16
    # the last group holds 1e8 - 15 x 6,250,496 = 6,242,560 elements: 24,970,240 B per state,
    # padded to 24,973,312 (6,097 pages). One slot = 15 x 50,003,968 + 2 x 24,973,312 = 800,006,144 B.
    assert plan.per_rank["nvme"] == 2 * 800_006_144
    assert plan.step["read_bytes"] == plan.step["write_bytes"] == 800_006_144
    # even with CUDA present the pipeline buffers stay pageable (disk <-> CPU kernel only)
    plan = estimate(n, offload="nvme", param_dtype="fp32", param_device="cpu", cuda=True)
    assert plan.breakdown["pageable"]["io_buffers"] == 2 << 20
    assert plan.per_rank["pinned"] == 0


def test_shard_rounds_up_for_uneven_world_sizes():
    plan = estimate(10, world_size=3, stage=1, offload="cpu", param_dtype="fp32", param_device="cpu")
    assert plan.inputs["shard_numel"] == 4
    assert plan.breakdown["pageable"]["exp_avg"] == 16


def test_fits_per_tier_and_host_shared_by_node():
    n = 1_000_000_000
    plan = estimate(n, offload="cpu", device_memory="3GiB", host_memory="64GiB")
    assert plan.fits["device"] is False                 # needs 4e9 B > 3 GiB
    assert plan.fits["host"] is True                    # needs 16e9 B
    assert plan.fits["nvme"] is None
    assert plan.fits_all is False
    # eight ranks on one node share its host memory: 64 GiB / 8 = 8 GiB each
    plan8 = estimate(n, world_size=8, stage=1, offload="cpu", host_memory="64GiB")
    assert plan8.capacity["host"] == 8 * GiB
    assert plan8.host_bytes == 18 * n // 8 and plan8.fits["host"] is True   # 12 S states + 4 S + 2 S
    plan8 = estimate(n, world_size=8, stage=0, offload="cpu", host_memory="64GiB")
    assert plan8.fits["host"] is False                  # 16e9 B each > 8 GiB


def test_step_time_nvme_is_max_of_io_and_kernel():
    n = 100_000_000
    plan = estimate(n, offload="nvme", param_dtype="fp32", param_device="cpu",
                    kernel_gparams=2.0, disk_read_gbps=2.0, disk_write_gbps=4.0)
    # kernel: 1e8 / 2e9 = 0.05 s; I/O: both moments (8e8 B + 6,144 B of padding, see above)
    # read at 2 GB/s and written at 4 GB/s
    assert plan.step["read_bytes"] == plan.step["write_bytes"] == 800_006_144
    assert math.isclose(plan.step["kernel_s"], 0.05)
    assert math.isclose(plan.step["io_s"], 800_006_144 / 2e9 + 800_006_144 / 4e9)
    assert math.isclose(plan.step_time_s, plan.step["io_s"])
    # bf16 device params (flat store): master and moments (12 bytes per element each way)
    plan = estimate(n, offload="nvme", kernel_gparams=2.0, disk_gbps=3.0)
    assert math.isclose(plan.step["read_bytes"], 12 * n, rel_tol=1e-4)   # + last group's padding
    assert math.isclose(plan.step_time_s, 2 * plan.step["read_bytes"] / 3e9)
    # offload=cpu: the kernel alone
    plan = estimate(n, world_size=4, stage=2, offload="cpu", kernel_gparams=2.0)
    assert math.isclose(plan.step_time_s, (n // 4) / 2e9)
    # no rate, no prediction
    assert estimate(n, offload="cpu").step_time_s is None


def test_cheapest_fitting_order():
    n = 1_000_000_000
    # bf16 device params, 8 ranks of a node with 64 GiB (8 GiB each). cpu/stage 0 needs 16e9 B
    # of host per rank (> 8 GiB); stages 1 and 2 need 18 x 1.25e8 = 2.25e9 B and update an
    # eighth of the params each: same bytes, stage 2 preferred (less traffic). nvme is last
    # (it streams the moments from disk at every step).
    kw = dict(world_size=8, device_memory="14GiB", host_memory="64GiB", nvme_capacity="10TiB")
    best, tried = cheapest_fitting(n, **kw)
    assert (best.inputs["offload"], best.inputs["stage"]) == ("cpu", 2)
    assert [(p.inputs["offload"], p.inputs["stage"]) for p in tried] == [
        ("cpu", 2), ("cpu", 1), ("cpu", 0), ("nvme", 2), ("nvme", 1), ("nvme", 0)]
    # with rates, the step time orders them: stage 0 updates all 1e9 params on every rank
    best, tried = cheapest_fitting(n, kernel_gparams=2.0, **kw)
    assert tried[-4].inputs["stage"] == 0 and math.isclose(tried[-4].step_time_s, 0.5)
    best, _ = cheapest_fitting(n, world_size=1, device_memory="8GiB", host_memory="64GiB")
    assert (best.inputs["offload"], best.inputs["stage"]) == ("cpu", 0)
    # fp32 CPU params, one rank, 12 GiB of host: cpu needs 16e9 B (14.9 GiB); nvme needs
    # params + grads 8e9 B + 1 GiB of pipeline buffers = 8.45 GiB
    cpu = dict(param_dtype="fp32", param_device="cpu", world_size=1)
    best, tried = cheapest_fitting(n, host_memory="12GiB", nvme_capacity="1TiB", **cpu)
    assert best.inputs["offload"] == "nvme"
    assert [p.inputs["offload"] for p in tried] == ["cpu", "nvme"]
    best, tried = cheapest_fitting(n, host_memory="8GiB", **cpu)
    assert best is None and len(tried) == 2


# --------------------------------------------------------------------------- inputs

def test_module_input_counts_tied_weights_once_and_takes_dtype():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight                           # tied
    frozen = torch.nn.Linear(16, 16)
    frozen.requires_grad_(False)
    model = torch.nn.ModuleList([emb, head, frozen])
    assert count_params(model) == 1600
    assert count_params(model, trainable_only=False) == 1600 + 16 * 16 + 16
    plan = estimate(model, offload="cpu")
    assert plan.inputs["num_params"] == 1600
    assert plan.inputs["param_dtype"] == "float32" and plan.inputs["param_device"] == "cpu"
    assert plan.breakdown["pageable"]["master"] == 0


def test_module_on_meta_device_is_counted_without_memory():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])
    plan = estimate(model, offload="cpu")
    assert plan.inputs["num_params"] == 8 * (4096 * 4096 + 4096)
    assert plan.inputs["param_device"] == "cuda" and plan.inputs["param_dtype"] == "float32"


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False)
MISTRAL_7B = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
GPT2 = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)


def test_hf_config_published_totals(tmp_path):
    # Llama-2-7B by hand: embed + lm_head 2 x 32000 x 4096 = 262,144,000; per layer 4 x 4096^2
    # (q,k,v,o) + 3 x 4096 x 11008 (gate, up, down) + 2 x 4096 (norms) = 202,383,360; x 32 =
    # 6,476,267,520; + final norm 4096 -> 6,738,415,616 (the published count).
    assert params_from_hf_config(_write(tmp_path, LLAMA2_7B)) == 6_738_415_616
    # Mistral-7B: k,v project to 8 x 128 = 1024: per layer 2 x 4096^2 + 2 x 4096 x 1024 +
    # 3 x 4096 x 14336 + 8192 = 218,112,000; x 32 + 262,144,000 + 4096 = 7,241,732,096.
    assert params_from_hf_config(_write(tmp_path, MISTRAL_7B, "m.json")) == 7_241_732_096
    # GPT-2 small, tied LM head: 124,439,808.
    assert params_from_hf_config(_write(tmp_path, GPT2, "g.json")) == 124_439_808
    # a directory holding config.json works too
    assert params_from_hf_config(tmp_path) == 6_738_415_616


class _TinyLlama(torch.nn.Module):
    """The shapes of a llama decoder built directly, to count against the config formula."""

    def __init__(self, h, inter, layers, heads, kv_heads, vocab, tie):
        super().__init__()
        hd = h // heads
        self.embed = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            blk = torch.nn.Module()
            blk.q = torch.nn.Linear(h, heads * hd, bias=False)
            blk.k = torch.nn.Linear(h, kv_heads * hd, bias=False)
            blk.v = torch.nn.Linear(h, kv_heads * hd, bias=False)
            blk.o = torch.nn.Linear(heads * hd, h, bias=False)
            blk.gate = torch.nn.Linear(h, inter, bias=False)
            blk.up = torch.nn.Linear(h, inter, bias=False)
            blk.down = torch.nn.Linear(inter, h, bias=False)
            blk.norm1 = torch.nn.Parameter(torch.ones(h))
            blk.norm2 = torch.nn.Parameter(torch.ones(h))
            self.layers.append(blk)
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.lm_head = torch.nn.Linear(h, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


@pytest.mark.parametrize("tie", [False, True])
def test_hf_config_against_directly_built_llama(tmp_path, tie):
    cfg = dict(model_type="llama", hidden_size=48, intermediate_size=80, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, vocab_size=97, tie_word_embeddings=tie)
    model = _TinyLlama(48, 80, 3, 6, 2, 97, tie)
    assert params_from_hf_config(_write(tmp_path, cfg)) == count_params(model)
    assert estimate(_write(tmp_path, cfg)).inputs["num_params"] == count_params(model)


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}), ("mistral", {}), ("qwen2", {}), ("mixtral", {"num_local_experts": 3}),
    ("gemma", {"head_dim": 24}), ("qwen3", {"head_dim": 24}),
])
def test_hf_config_against_transformers(tmp_path, model_type, extra):
    transformers = pytest.importorskip("transformers")
    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=101, **extra)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string(use_diff=False))
    assert params_from_hf_config(path) == count_params(model)


def test_hf_config_errors(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(FileNotFoundError, match="nope"):
        params_from_hf_config(missing)
    with pytest.raises(ValueError, match="bert"):
        params_from_hf_config(_write(tmp_path, {"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        params_from_hf_config(_write(tmp_path, {"model_type": "llama", "hidden_size": 8}))
    rc, _, err = _cli("plan", "--model-config", str(missing), "--no-probe")
    assert rc == 1 and "nope" in err


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(num_params=-5), "-5"),
    (dict(num_params="-1B"), "-1B"),
    (dict(num_params="lots"), "lots"),
    (dict(world_size=0), "0"),
    (dict(stage=4), "4"),
    (dict(offload="disk"), "disk"),
    (dict(param_dtype="fp8"), "fp8"),
    (dict(grad_dtype=torch.int8), "int8"),
    (dict(optimizer="rmsprop"), "rmsprop"),
    (dict(device_memory=-1), "-1"),
    (dict(host_memory="-2GiB"), "-2GiB"),
    (dict(max_host_bytes=0), "0"),
    (dict(kernel_gparams=0), "0"),
    (dict(disk_gbps=-3), "-3"),
    (dict(sub_group_size=-7), "-7"),
    (dict(param_device="tpu"), "tpu"),
    (dict(ranks_per_node=0), "0"),
    (dict(nvme_capacity=-4), "-4"),
])
def test_bad_input_is_a_value_error_with_the_value(kwargs, fragment):
    args = dict(num_params=1000)
    args.update(kwargs)
    n = args.pop("num_params")
    with pytest.raises(ValueError, match=fragment):
        estimate(n, **args)


def test_cli_bad_input_exits_2_naming_the_option():
    # A value no parse accepts is a usage error, as a numeric option out of range
    # (--world-size 0, tests/test_cli_numeric.py) and --state-dtype's choices are: exit
    # status 2 naming the option (it was exit 1 after parsing for --param-dtype, --optimizer,
    # --offload, --param-device).
    with pytest.raises(SystemExit) as e:  # (_cli's own redirect takes argparse's message)
        _cli("plan", "--params", "1B", "--param-dtype", "fp7", "--no-probe")
    assert e.value.code == 2


# --------------------------------------------------------------------------- CLI

JSON_KEYS = {"schema", "inputs", "supported", "per_rank", "breakdown", "optimizer_bytes", "capacity", "fits",
             "fits_all", "step", "zero_paper_bytes", "notes", "problems", "rates", "cheapest", "sharding"}
INPUT_KEYS = {"source", "num_params", "world_size", "stage", "offload", "optimizer", "k", "param_dtype",
              "grad_dtype", "param_device", "cuda", "ranks_per_node", "max_host_bytes", "sub_group_size",
              "swap_dir", "shard_numel", "separate_master", "lowp_buffers", "state_dtype", "master_dtype", "swap", "amsgrad"}
STEP_KEYS = {"kernel_gparams", "disk_read_gbps", "disk_write_gbps", "kernel_s", "io_s", "read_bytes",
             "write_bytes", "step_time_s"}


def test_cli_json_schema_is_stable():
    rc, out, _ = _cli("plan", "--params", "1B", "--offload", "nvme", "--kernel-gparams", "2",
                      "--disk-gbps", "2.5", "--device-memory", "80GiB", "--host-memory", "256GiB", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert set(doc) == JSON_KEYS
    assert doc["schema"] == "offload.plan/1"
    assert set(doc["inputs"]) == INPUT_KEYS
    assert set(doc["inputs"]["swap"]) == {"sub_group_size", "num_groups", "buffers", "region_bytes", "host_bytes",
                                          "file_bytes", "slots", "disk_bytes", "state_disk_bytes", "nstates"}
    assert set(doc["per_rank"]) == set(TIERS)
    assert set(doc["breakdown"]) == set(TIERS)
    for t in TIERS:
        assert set(doc["breakdown"][t]) == set(COMPONENTS)
        assert sum(doc["breakdown"][t].values()) == doc["per_rank"][t]
    assert set(doc["fits"]) == {"device", "host", "nvme"}
    assert set(doc["capacity"]) == {"device", "host", "nvme"}
    assert set(doc["step"]) == STEP_KEYS
    assert set(doc["rates"]) == {"kernel", "disk_read", "disk_write"}
    assert doc["rates"]["kernel"] == {"value": 2.0, "unit": "Gparam/s", "source": "--kernel-gparams"}
    assert doc["cheapest"] is None
    assert doc["per_rank"]["device"] == 4_000_000_000       # bytes, not GiB
    # master and moments, 12 B per param, read and written at 2.5 GB/s (+ the last sub-group's padding)
    assert math.isclose(doc["step"]["step_time_s"], 2 * 12e9 / 2.5e9, rel_tol=1e-5)


def test_cli_host_memory_auto_reads_this_machine():
    with open("/proc/meminfo") as fh:
        total = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("MemTotal:"))
    rc, out, _ = _cli("plan", "--params", "1M", "--host-memory", "auto", "--kernel-gparams", "1", "--json")
    assert rc == 0 and json.loads(out)["capacity"]["host"] == total
    if not torch.cuda.is_available():
        rc, _, err = _cli("plan", "--params", "1M", "--device-memory", "auto", "--kernel-gparams", "1")
        assert rc == 1 and "no CUDA device" in err


def test_cli_json_cheapest():
    rc, out, _ = _cli("plan", "--params", "1B", "--device-memory", "8GiB", "--host-memory", "64GiB",
                      "--kernel-gparams", "2", "--disk-gbps", "2", "--cheapest", "--json")
    assert rc == 0
    c = json.loads(out)["cheapest"]
    assert set(c) == {"found", "stage", "offload", "per_rank", "step_time_s", "candidates"}
    assert (c["found"], c["offload"], c["stage"]) == (True, "cpu", 0)
    assert set(c["candidates"][0]) == {"stage", "offload", "fits", "fits_all", "per_rank", "step_time_s"}


def test_cli_table_says_gib_and_explains(tmp_path):
    cfg = _write(tmp_path, LLAMA2_7B)
    rc, out, _ = _cli("plan", "--model-config", str(cfg), "--offload", "cpu", "--kernel-gparams", "1.8",
                      "--explain")
    assert rc == 0
    assert "6,738,415,616 params" in out
    assert "GiB (2^30 bytes)" in out
    assert "2Ψ + (2 + K)Ψ/N_d" in out and "K = 12" in out
    # pinned host (CUDA assumed): 2 B of grads + 2 B of bf16 staging per param:
    # 4 x 6,738,415,616 = 26,953,662,464 B = 25.10 GiB; pageable: 12 B of fp32 master and
    # moments per param = 80,860,987,392 B = 75.31 GiB
    total_line = next(l for l in out.splitlines() if l.strip().startswith("total"))
    assert total_line.split()[2] == f"{4 * 6_738_415_616 / GiB:.2f}" == "25.10"
    assert total_line.split()[3] == f"{12 * 6_738_415_616 / GiB:.2f}" == "75.31"
    assert "predicted optimizer step: 3743.6 ms" in out      # 6,738,415,616 / 1.8e9 s


# --------------------------------------------------------------------------- rates

def test_kernel_rate_from_bench_adam_json_line(tmp_path):
    # the shape bench/adam.py prints last: rows with n, threads and seconds per contender
    rows = [
        {"n": 10_000_000, "threads": 2, "kind": "adamw_fp32",
         "seconds": {"ours_native": 0.004, "torch_fused": 0.005, "copy_probe": 0.001}},
        {"n": 100_000_000, "threads": 1, "kind": "adamw_fp32", "seconds": {"ours_native": 0.0625, "ours_numba": 0.06}},
        {"n": 100_000_000, "threads": 2, "kind": "adamw_fp32", "seconds": {"ours_native": 0.05, "torch_fused": 0.055}},
    ]
    p = tmp_path / "adam.out"
    p.write_text("# table\n" + json.dumps({"bench": "adam", "env": {}, "steps": 7, "results": rows}) + "\n")
    r = kernel_rate_from_bench(str(p))
    assert r.value == pytest.approx(2.0)                # 1e8 / 0.05 s, native at 2 threads
    assert "ours_native threads=2" in r.source and "N=100,000,000" in r.source


def test_kernel_rate_from_bench_output(tmp_path):
    p = tmp_path / "adam.txt"
    rows = [
        {"impl": "torch_fused", "n": 100_000_000, "threads": 2, "gparams": 1.8},
        {"impl": "native", "n": 10_000_000, "threads": 2, "gparams": 2.5},
        {"impl": "native", "n": 100_000_000, "threads": 1, "gparams": 1.7},
        {"impl": "native", "n": 100_000_000, "threads": 2, "gparams": 1.95},
        {"impl": "numba", "n": 100_000_000, "threads": 2, "gparams": 1.9},
    ]
    p.write_text("a table\n| x | y |\n" + json.dumps({"bench": "adam", "results": rows}) + "\n")
    r = kernel_rate_from_bench(str(p))
    assert r.value == 1.95 and r.unit == "Gparam/s" and "native" in r.source
    with pytest.raises(ValueError, match="Gparam"):
        (tmp_path / "empty.json").write_text("{}")
        kernel_rate_from_bench(str(tmp_path / "empty.json"))


@pytest.mark.parametrize("doc", [
    {"read": {"engine": "uring", "block_size": 1048576, "gbps": 2.4}, "write": {"gbps": 5.9}},
    {"best": {"read": {"gbps": 2.4}, "write": {"gbps": 5.9}}},
    {"read_gbps": 2.4, "write_gbps": 5.9},
    [{"tool": "offload", "rw": "read", "gbps": 2.1}, {"tool": "offload", "rw": "read", "gbps": 2.4},
     {"tool": "fio", "rw": "read", "gbps": 9.0}, {"tool": "offload", "rw": "write", "gbps": 5.9}],
])
def test_disk_rate_from_tune_shapes(tmp_path, doc):
    p = tmp_path / "tune.json"
    p.write_text(json.dumps(doc))
    r, w = disk_rate_from_tune(str(p))
    assert (r.value, w.value) == (2.4, 5.9)


def test_disk_rate_from_tune_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        disk_rate_from_tune(str(tmp_path / "missing.json"))
    (tmp_path / "x.json").write_text(json.dumps({"engine": "uring"}))
    with pytest.raises(ValueError, match="x.json"):
        disk_rate_from_tune(str(tmp_path / "x.json"))


def test_probe_kernel_rate_small():
    r = probe_kernel_rate(200_000, repeats=3)
    assert r.unit == "Gparam/s" and 0.001 < r.value < 100
    assert "200,000" in r.source
    # the spread of the samples goes with the median (a shared machine's plans varied 3x)
    lo, hi = map(float, re.search(r"median of 3 \(([\d.]+)-([\d.]+)\)", r.source).groups())
    assert lo - 0.01 <= r.value <= hi + 0.01


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_probe_kernel_rate_times_the_compressed_kernel_the_plan_is_for(state_dtype, monkeypatch):
    # the plan of int8 states predicted the fp32 kernel's time: int8's runs at 0.2-0.6x its rate
    steps = []
    real = __import__("offload").AdamW.step
    monkeypatch.setattr(__import__("offload").AdamW, "step", lambda self, *a: steps.append(self.state_dtype)
                        or real(self, *a))
    r = probe_kernel_rate(70_000, repeats=3, state_dtype=state_dtype)
    assert r.unit == "Gparam/s" and 0.0001 < r.value < 100 and f"{state_dtype} states" in r.source
    assert steps == [state_dtype] * 4  # the warm-up and three timed steps, over compressed states
    import offload.plan
    monkeypatch.setattr(offload.plan, "probe_kernel_rate", lambda **kw: probe_kernel_rate(70_000, repeats=1, **kw))
    rc, out, _ = _cli("plan", "--params", "10M", "--state-dtype", state_dtype, "--param-dtype", "fp32",
                      "--param-device", "cpu", "--json")
    assert rc == 0 and f"{state_dtype} states" in json.loads(out)["rates"]["kernel"]["source"]


# --------------------------------------------------------------------------- plan, then run

def _model_with_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 1024))
    model(torch.randn(8, 1024)).square().mean().backward()
    return model                                       # 4,197,376 fp32 params on the CPU


def _make_optimizer(params, **kw):
    import offload

    return offload.AdamW(params, lr=1e-3, **kw)


def _plan_and_run(tmp_path, target, amsgrad=False):
    """(plan, memory_report(), RSS change over construction + first step) for a 4.2M-param MLP."""
    from offload.optim.stats import process_rss_bytes

    model = _model_with_grads()
    kw = dict(offload=target)
    if target == "nvme":
        kw.update(swap_dir=str(tmp_path), max_host_bytes=64 << 20)
    if amsgrad:
        kw.update(amsgrad=True)
    plan = estimate(model, **kw)
    assert plan.inputs["param_dtype"] == "float32" and plan.inputs["param_device"] == "cpu"
    # Warm up: load the kernel library, thread pool and io engine so that the RSS change
    # below is the optimizer's states and buffers only.
    w = torch.nn.Parameter(torch.randn(16))
    w.grad = torch.randn(16)
    warm_kw = dict(kw)
    if target == "nvme":
        (tmp_path / "warm").mkdir()
        warm_kw.update(swap_dir=str(tmp_path / "warm"), max_host_bytes=1 << 20)
    warm = _make_optimizer([w], **warm_kw)
    warm.step()
    # Earlier tests in this process left garbage (optimizers in reference cycles, whose
    # finalizers unmap their buffers when the collector runs, maybe in the middle of the
    # measurement below) and freed memory that glibc keeps mapped and would hand out again
    # without a page fault (RSS would not grow): collect, then give it back first.
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss0 = process_rss_bytes()
    opt = _make_optimizer(model.parameters(), **kw)
    try:
        opt.step()
        rss1 = process_rss_bytes()
        report = opt.memory_report()
    finally:
        for o in (opt, warm):
            if hasattr(o, "close"):
                o.close()
    return plan, report, rss1 - rss0


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_plan_then_run_bytes_match_memory_report(tmp_path, target, amsgrad):
    plan, report, _ = _plan_and_run(tmp_path, target, amsgrad)
    assert plan.inputs["amsgrad"] is amsgrad and plan.inputs["k"] == (16 if amsgrad else 12)
    if amsgrad:  # the third state is billed where the engine keeps it
        assert sum(plan.breakdown[t]["max_exp_avg_sq"] for t in TIERS) > 0
    got, want = report["tiers"], plan.optimizer_bytes
    for tier in TIERS:
        assert abs(got[tier] - want[tier]) <= 0.05 * want[tier], (tier, got, want)


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_memory_report_agrees_with_rss(tmp_path, target):
    _, report, rss_delta = _plan_and_run(tmp_path, target)
    host = report["tiers"]["pinned"] + report["tiers"]["pageable"]
    assert abs(rss_delta - host) <= 0.10 * host, (rss_delta, host)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
def test_plan_then_run_bf16_cpu_params_flat_store(amsgrad):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
    n = count_params(model)                            # 262,912
    plan = estimate(model, offload="cpu", amsgrad=amsgrad)
    # bf16 CPU params: flat fp32 master + moments (12 B x Ψ; amsgrad's third state: 16), pageable
    # (no CUDA); grads read where they lie and the bf16 copy written straight into the params:
    # no other buffers.
    k = 16 if amsgrad else 12
    assert plan.optimizer_bytes == {"device": 0, "pinned": 0, "pageable": k * n, "nvme": 0}
    opt = _make_optimizer(model.parameters(), offload="cpu", amsgrad=amsgrad)
    try:
        opt.step()
        got = opt.memory_report()["tiers"]
    finally:
        opt.close()
    for tier in TIERS:
        assert abs(got[tier] - plan.optimizer_bytes[tier]) <= 0.05 * plan.optimizer_bytes[tier], (tier, got)


def test_cli_amsgrad_bills_the_third_state():
    rc, out, err = _cli("plan", "--params", "1B", "--amsgrad", "--kernel-gparams", "1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["inputs"]["amsgrad"] is True and doc["inputs"]["k"] == 16
    assert doc["breakdown"]["pageable"]["max_exp_avg_sq"] == 4 * 10**9
    # Adam's rate, scaled by the bytes AMSGrad moves (36 per element against 28)
    assert doc["step"]["kernel_s"] == pytest.approx(36 / 28)
    assert any(n.startswith("amsgrad: the kernel time") for n in doc["notes"])
    rc, out, _ = _cli("plan", "--params", "1B", "--kernel-gparams", "1", "--json")
    plain = json.loads(out)
    assert plain["inputs"]["amsgrad"] is False and plain["step"]["kernel_s"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="amsgrad must be True or False"):
        estimate("1B", amsgrad="yes")
    with pytest.raises(ValueError, match="amsgrad is Adam's option .* optimizer 'sgd' has none"):
        estimate("1B", amsgrad=True, optimizer="sgd")


def test_cli_swap_dir_probes_the_disk_and_takes_its_free_space(tmp_path):
    rc, out, err = _cli("plan", "--params", "10M", "--param-device", "cpu", "--param-dtype", "fp32",
                        "--offload", "nvme", "--swap-dir", str(tmp_path), "--kernel-gparams", "1", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["rates"]["disk_read"]["source"].startswith("probe:") and doc["rates"]["disk_read"]["value"] > 0
    assert doc["step"]["step_time_s"] is not None
    assert doc["capacity"]["nvme"] > 0 and doc["fits"]["nvme"] is True
    assert list(tmp_path.iterdir()) == []              # the probe file is gone


def _bf16_model_with_grads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)).to(torch.bfloat16)
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().square().mean().backward()
    return model                                       # 262,912 bf16 params on the CPU


def _run_report(model, **kw):
    opt = _make_optimizer(model.parameters(), **kw)
    try:
        opt.step()
        return opt.memory_report()
    finally:
        opt.close()


def _close_per_tier(got, want):
    for tier in TIERS:
        assert abs(got[tier] - want[tier]) <= 0.05 * want[tier], (tier, got, want)


def test_plan_then_run_bf16_cpu_params_flat_store_nvme(tmp_path):
    model = _bf16_model_with_grads()
    kw = dict(offload="nvme", swap_dir=str(tmp_path), max_host_bytes=4 << 20)
    plan = estimate(model, **kw)
    # By hand: master and moments (3 states) of 262,912 elements within 4 MiB: sub-groups of
    # floor(2^22 / 48 / 1024) x 1024 = 87,040 elements (4 groups, the last of 1,792), buffers
    # of 3 x 4 x 87,040 = 1,044,480 B, min(4, 8, 4) = 4 of them mapped as 4 MiB (2 MiB pages).
    # Disk: one slot = 3 x 1,044,480 + 3 x 8,192 (1,792 x 4 B padded to pages) = 3,158,016 B,
    # in 2 slots. Host: the pipeline buffers only.
    assert plan.optimizer_bytes == {"device": 0, "pinned": 0, "pageable": 4 << 20, "nvme": 2 * 3_158_016}
    assert not plan.problems
    report = _run_report(model, **kw)
    assert report["store"] == "flat"
    _close_per_tier(report["tiers"], plan.optimizer_bytes)


@pytest.fixture
def fake_three_ranks():
    """This process as rank 0 of a world of 3 (torch's fake backend: collectives do nothing),
    so that the flat store allocates what it allocates on 3 gloo ranks, without spawning."""
    import torch.distributed as dist

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover - torch without its testing helpers
        pytest.skip(f"torch's fake process group is unavailable: {exc}")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        yield 3
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("target", ["cpu", "nvme"])
def test_plan_then_run_bf16_cpu_params_three_ranks(tmp_path, fake_three_ranks, target):
    # stage 2 on 3 ranks: shard S = ceil(262,912 / 3) = 87,638. Host, all pageable: master
    # and moments 4 B x S each (unless nvme), fp32 grad shard 4 S, bf16 shard 2 S, and the
    # collective buffers of gloo: send 3 x S x 4, gather 3 x S x 2, rs_out S x 4 (allocated
    # and counted by memory_report() although gloo reduce-scatters into the grad shard).
    model = _bf16_model_with_grads()
    S = 87_638
    kw = dict(offload=target, stage=2)
    if target == "nvme":
        kw.update(swap_dir=str(tmp_path), max_host_bytes=8 << 20)
    plan = estimate(model, world_size=fake_three_ranks, **kw)
    comm = 3 * S * 4 + 3 * S * 2 + S * 4
    states = 12 * S if target == "cpu" else 0
    io = 0 if target == "cpu" else plan.inputs["swap"]["host_bytes"]
    assert plan.optimizer_bytes["pageable"] == states + 4 * S + 2 * S + comm + io
    report = _run_report(model, **kw)
    assert report["detail"]["shard_numel"] == S and report["detail"]["world"] == 3
    _close_per_tier(report["tiers"], plan.optimizer_bytes)
    # not just within 5 %: the plan models every buffer the flat store allocates
    assert report["tiers"] == plan.optimizer_bytes


def test_fp32_cpu_params_at_stage0_on_several_ranks_are_updated_in_place(fake_three_ranks):
    # offload/optim/adam.py picks HostState for fp32 CPU params at stage 0 whatever the
    # world size (stage 0 partitions nothing): no master, moments of all Ψ params.
    model = _model_with_grads()
    n = count_params(model)
    plan = estimate(model, world_size=fake_three_ranks, stage=0, offload="cpu")
    assert plan.inputs["separate_master"] is False
    assert plan.optimizer_bytes == {"device": 0, "pinned": 0, "pageable": 8 * n, "nvme": 0}
    report = _run_report(model, offload="cpu", stage=0)
    assert report["store"] != "flat"
    _close_per_tier(report["tiers"], plan.optimizer_bytes)


# The pinned/pageable split, decided by buffer_tiers (offload/zero/flat_group.py pins only
# what a DMA engine touches, and only when CUDA is present; the swap pipeline's own pool
# never pins). Columns: in_place, device params, low precision, ranks.
P, U, D = "pinned", "pageable", "device"
_TIER_CASES = [
    # fp32 CPU params, stage 0 (HostState / SwappedState): moments and io buffers pageable
    ((True, False, False, 1), dict(exp_avg=U, exp_avg_sq=U, io_buffers=U)),
    # bf16 device params, one rank: grad copies and bf16 staging pinned; master, moments not
    ((False, True, True, 1), dict(master=U, exp_avg=U, exp_avg_sq=U, grad_buffers=P, lowp_buffers=P,
                                  io_buffers=U, comm_buffers=D)),
    # fp32 device params, one rank: the master itself is copied to the device: pinned
    ((False, True, False, 1), dict(master=P, exp_avg=U, exp_avg_sq=U, grad_buffers=P, io_buffers=U)),
    # fp32 device params, 4 ranks: the master still goes to the device (all-gather source);
    # the fp32 grad shard is filled by the collective, on the host side: pageable
    ((False, True, False, 4), dict(master=P, exp_avg=U, grad_buffers=U, lowp_buffers=U, comm_buffers=D)),
    # bf16 device params, 4 ranks: nothing of the flat store pinned
    ((False, True, True, 4), dict(master=U, exp_avg=U, grad_buffers=U, lowp_buffers=U, io_buffers=U)),
    # bf16 CPU params: no DMA at all, nothing pinned
    ((False, False, True, 1), dict(master=U, exp_avg=U, grad_buffers=U, lowp_buffers=U, io_buffers=U,
                                   comm_buffers=U)),
]


@pytest.mark.parametrize("args,expect", _TIER_CASES)
def test_buffer_tiers_with_and_without_cuda(args, expect):
    from offload.plan.estimate import OPTIMIZER_COMPONENTS, buffer_tiers

    in_place, dev, lowp, ranks = args
    with_cuda = buffer_tiers(in_place=in_place, device_params=dev, lowp=lowp, ranks=ranks, cuda=True)
    assert set(with_cuda) == set(OPTIMIZER_COMPONENTS)
    for comp, tier in expect.items():
        assert with_cuda[comp] == tier, (comp, with_cuda)
    # without CUDA nothing can be pinned: every pinned buffer becomes pageable, the rest stays
    without = buffer_tiers(in_place=in_place, device_params=dev, lowp=lowp, ranks=ranks, cuda=False)
    assert without == {c: (U if t == P else t) for c, t in with_cuda.items()}


def test_pinned_split_in_the_plan_follows_buffer_tiers():
    n = 1_000_000
    # fp32 device params, one rank, CUDA: master 4n and fp32 grad copies 4n pinned
    plan = estimate(n, offload="cpu", param_dtype="fp32")
    assert plan.optimizer_bytes == {"device": 0, "pinned": 8 * n, "pageable": 8 * n, "nvme": 0}
    # bf16: master no longer pinned; grad copies and staging 2n each
    plan = estimate(n, offload="cpu", param_dtype="bf16")
    assert plan.optimizer_bytes == {"device": 0, "pinned": 4 * n, "pageable": 12 * n, "nvme": 0}
    # planning a CPU-only host: the same bytes, all pageable
    plan = estimate(n, offload="cpu", param_dtype="bf16", cuda=False)
    assert plan.optimizer_bytes == {"device": 0, "pinned": 0, "pageable": 16 * n, "nvme": 0}


@pytest.mark.parametrize("option,expected", [
    ("--model-config", "not a JSON text file"),
    ("--adam-bench", "not a text file"),
    ("--io-tune", "not a text file"),
])
def test_plan_names_an_input_file_that_is_not_text(tmp_path, option, expected):
    # A UnicodeDecodeError alone: "error: 'utf-8' codec can't decode byte 0xa1 ...", no file named.
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\xa1\xff\x00binary")
    params = [] if option == "--model-config" else ["--params", "1B"]
    rc, _, err = _cli("plan", "--no-probe", "--offload", "nvme", *params, option, str(path))
    assert rc == 1 and f"{path}: {expected}" in err, err


_FILE_CASES = [["--no-probe"], ["--kernel-gparams", "1"], ["--no-probe", "--nvme-capacity", "1GiB"]]


@pytest.mark.parametrize("probe", _FILE_CASES,
                         ids=["no-probe", "disk-probe", "capacity-given"])
def test_cli_swap_dir_that_is_a_file_is_refused(tmp_path, probe):
    # --no-probe took the free space of the file's file system; the probe said "does not exist"
    f = tmp_path / "swap"
    f.write_text("")
    rc, out, err = _cli("plan", "--params", "10M", "--offload", "nvme", "--swap-dir", str(f), *probe)
    assert rc == 1 and "swap directory is a file, not a directory" in err and str(f) in err, (rc, out, err)
    assert f.read_text() == ""


def test_estimate_refuses_a_swap_dir_that_is_a_file(tmp_path):
    f = tmp_path / "swap"
    f.write_text("")
    for kw in ({}, {"nvme_capacity": "1GiB"}):
        with pytest.raises(NotADirectoryError, match="swap directory is a file, not a directory"):
            estimate("10M", offload="nvme", swap_dir=str(f), **kw)
    with pytest.raises(FileNotFoundError, match="swap directory does not exist"):
        estimate("10M", offload="nvme", swap_dir=str(tmp_path / "nope"))
    from offload.plan import probe_disk_rate

    with pytest.raises(NotADirectoryError, match="disk probe directory is a file"):
        probe_disk_rate(str(f))
