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
