"""`offload plan`'s table shows the swap slots itself (issue #17, section 5): the NVMe bytes
of each swapped state are one slot x the slots kept, in a column of their own, without
--explain; the planner's numbers do not change."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

from offload.plan import SWAP_SLOTS, estimate

GiB = 1 << 30


def _table(*argv: str) -> str:
    from offload.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--no-probe", *argv]) == 0
    return out.getvalue()


def _row(text: str, name: str) -> list:
    return next(l.split() for l in text.splitlines() if l.split()[:1] == [name])


def test_fp32_states_on_nvme_show_one_slot_times_two():
    n = 1_000_000_000
    text = _table("--params", "1B", "--offload", "nvme", "--param-dtype", "fp32", "--param-device", "cpu")
    plan = estimate(n, offload="nvme", param_dtype=torch.float32, param_device="cpu")
    swap = plan.inputs["swap"]
    assert swap["slots"] == SWAP_SLOTS == 2 and swap["nstates"] == 2
    head = next(l for l in text.splitlines() if "nvme = slot x slots" in l)
    assert head.split()[:4] == ["device", "pinned", "pageable", "nvme"]
    per_slot = swap["file_bytes"] // swap["nstates"]
    for state in ("exp_avg", "exp_avg_sq"):
        # unchanged: the nvme column holds both slots, 8 B per param (+ 4 KiB padding per sub-group)
        assert plan.breakdown["nvme"][state] == swap["disk_bytes"] // 2 == 2 * per_slot
        assert 8 * n <= plan.breakdown["nvme"][state] < 8 * n + 2 * 4096 * swap["num_groups"]
        row = _row(text, state)
        assert row[4] == f"{plan.breakdown['nvme'][state] / GiB:.2f}" == "7.45"
        assert row[5:] == [f"{per_slot / GiB:.2f}", "x", "2"] == ["3.73", "x", "2"]
    total = _row(text, "total")
    assert total[4] == "14.90" and total[5:] == ["7.45", "x", "2"]
    # rows that are not on disk have no slot cell
    assert len(_row(text, "params")) == 5 and len(_row(text, "io_buffers")) == 5
    assert "kept in 2 slots" in text and "a crash leaves one complete step" in text
    assert "How these numbers are computed" not in text  # no --explain needed


def test_flat_store_on_nvme_splits_master_and_moments():
    text = _table("--params", "1B", "--offload", "nvme", "--world-size", "4", "--stage", "2")
    for state in ("master", "exp_avg", "exp_avg_sq"):
        row = _row(text, state)
        assert row[4] == "1.86" and row[5:] == ["0.93", "x", "2"]


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_no_slot_column_without_swap_files(offload):
    text = _table("--params", "1B", "--offload", offload)
    assert "slot" not in text
    assert all(len(_row(text, c)) == 5 for c in ("params", "exp_avg", "total"))


# --------------------------------------------------------------------------- sub-groups in closed form

def _state_disk_bytes_by_loop(numel, states, sub_group_size):
    """The per-state disk bytes as swap_model summed them before, one sub-group at a time."""
    from offload.swap import SwapLayout

    layout = SwapLayout(numel, sub_group_size, states)
    spans = [layout.group_range(g) for g in range(layout.num_groups)]
    return [SWAP_SLOTS * sum(layout.padded_bytes(k, e - s) for s, e in spans) for k in range(layout.nstates)]


def _int8_adam():
    from offload.kernels.fields import ADAM

    return tuple(ADAM.with_state_dtype("int8").with_master())


@pytest.mark.parametrize("numel,states,sub_group_size", [
    (1, 2, 1024),                        # one sub-group of one element
    (1024, 2, 1024),                     # exactly one full sub-group
    (1025, 3, 1024),                     # a last sub-group of one element
    (3_000_001, 3, 262_144),             # several sub-groups, a short last one
    (5 * 262_144, 2, 262_144),           # all sub-groups full
    (123_457, ("exp_avg", "exp_avg_sq"), 2048),
    (1_000_003, "int8", 262_144),        # packed int8 moments beside an fp32 master
    (600_000, "int8", 1 << 20),          # a sub-group larger than the states
])
def test_swap_model_disk_bytes_equal_the_sub_group_loop(numel, states, sub_group_size):
    from offload.plan.placement import swap_model

    states = _int8_adam() if states == "int8" else states
    got = swap_model(numel, states, 1 << 30, sub_group_size)
    assert got["state_disk_bytes"] == _state_disk_bytes_by_loop(numel, states, got["sub_group_size"])
    assert sum(got["state_disk_bytes"]) == got["disk_bytes"]


def test_a_tiny_sub_group_size_plans_a_large_model_quickly():
    import time

    t0 = time.perf_counter()
    plan = estimate("175B", offload="nvme", sub_group_size=1)  # rounded up to 1024: ~171M sub-groups
    assert time.perf_counter() - t0 < 2.0
    assert plan.inputs["swap"]["num_groups"] == -(-175 * 10**9 // 1024)
    # fp32: full sub-groups of 1024 x 4 B are whole pages, the last padded to one
    assert plan.breakdown["nvme"]["exp_avg"] == SWAP_SLOTS * -(-4 * 175 * 10**9 // 4096) * 4096


def test_table_columns_stay_apart_and_the_slot_note_names_compressed_states():
    """At 10^15 params the totals ran together ("3725290.3011175870.90"); with int8 states
    the NVMe note said each swapped state was fp32, 4 B per element."""
    from offload.plan import estimate

    rows = estimate(10**15, param_dtype="bf16").table().splitlines()
    total = next(r for r in rows if r.strip().startswith("total")).split()
    assert len(total) == 5 and float(total[3]) == pytest.approx(10**15 * 12 / 2**30, rel=1e-9)
    text = estimate(125_000_000, offload="nvme", param_dtype="bf16", param_device="cpu", state_dtype="int8",
                    master_dtype="bfloat16").table()
    note = next(r for r in text.splitlines() if r.strip().startswith("nvme: each swapped"))
    assert "fp32" not in note and "4 B per element" not in note and "int8 1" in note
    fp32 = estimate(125_000_000, offload="nvme", param_dtype="fp32", param_device="cpu").table()
    assert "each swapped fp32 state is kept in 2 slots (4 B per element each" in fp32
