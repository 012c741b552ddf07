"""``offload demo``: the README's first command, run small, must train, match torch and clean up.

The demo is run in-process (``offload.cli.main``) to keep the suite fast; its JSON summary is
the contract checked here: loss comparison passed, states on disk, host buffers under the
budget, the budget smaller than the swapped states, and nothing left in the swap directory.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from offload.cli import main
from offload.demo.corpus import Batches, decode, encode, generate_text
from offload.demo.model import GPTConfig, TinyGPT, config_for_params
from offload.demo.train import compare_losses, default_max_host_bytes, filesystem_type, swapped_bytes


def test_demo_quick_trains_matches_torch_and_cleans_up(tmp_path, capsys):
    swap_parent = tmp_path / "swap"
    swap_parent.mkdir()
    if filesystem_type(str(swap_parent)) in ("tmpfs", "ramfs"):
        # Still runs (the io layer falls back to buffered I/O), but that is not the demo's point.
        pytest.skip("tmp_path is on tmpfs here")
    out = tmp_path / "summary.json"
    step_log = tmp_path / "steps.jsonl"
    rc = main(["demo", "--quick", "--no-progress", "--swap-dir", str(swap_parent), "--json", str(out),
               "--step-log", str(step_log)])
    text = capsys.readouterr().out
    assert rc == 0, text
    s = json.loads(out.read_text())

    # Same losses as torch.optim.AdamW step for step (numerics contract: rtol 1e-5).
    assert len(s["losses"]) == len(s["torch_losses"]) == s["steps"]
    torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(s["torch_losses"]), rtol=1e-5, atol=0)
    assert s["compare_passed"] is True and s["max_rel_diff"] <= 1e-5
    assert "PASS" in text and "demo: OK" in text
    # It learned something in a few steps.
    assert s["losses"][-1] < s["losses"][0] - 0.1

    # The offload is real: budget below the swapped states, states on disk, buffers in budget.
    tiers = s["memory_report"]["tiers"]
    assert s["max_host_bytes"] < swapped_bytes(s["params"])
    assert tiers["nvme"] >= swapped_bytes(s["params"])
    assert 0 < tiers["pinned"] + tiers["pageable"] <= s["max_host_bytes"]
    assert s["step_stats"]["steps"] == s["steps"]
    # What the demo printed from the planner is what the optimizer holds (issue 6: within 5 %).
    for tier in ("pinned", "pageable", "nvme"):
        assert abs(s["planned_bytes"][tier] - tiers[tier]) <= 0.05 * max(tiers[tier], 1), tier

    # One step-log line per step, readable by `offload report`, with the pipeline's phases.
    from offload.plan import read_step_log

    rows = read_step_log(step_log)
    assert [r["step"] for r in rows] == list(range(1, s["steps"] + 1))
    assert all(r["bytes"]["nvme"] == tiers["nvme"] for r in rows)
    assert all(r["phases"]["swap_write"] > 0 for r in rows)
    assert all(r["phases"]["swap_read"] > 0 for r in rows[1:])  # step 1 has nothing to read yet
    assert [r["loss"] for r in rows] == s["losses"]

    # The temporary swap directory (made inside --swap-dir) is gone and nothing is left.
    assert s["swap_cleaned"] is True
    assert os.path.dirname(s["swap_dir"]) == str(swap_parent)
    assert not os.path.exists(s["swap_dir"])
    assert os.listdir(swap_parent) == []


def test_demo_missing_swap_dir_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    rc = main(["demo", "--quick", "--no-progress", "--swap-dir", str(missing)])
    err = capsys.readouterr().err
    assert rc == 1
    assert "offload demo: error:" in err and str(missing) in err


@pytest.mark.parametrize("option", ["--json", "--plot", "--step-log"])
def test_demo_output_file_in_a_missing_directory_fails_before_training(tmp_path, capsys, option):
    # --json was opened only after training and comparing: minutes lost, then an error.
    target = tmp_path / "nope" / "out"
    rc = main(["demo", "--quick", "--no-progress", "--swap-dir", str(tmp_path), option, str(target)])
    captured = capsys.readouterr()
    assert rc == 1 and f"offload demo: error: [Errno 2] {option}: " in captured.err and str(target) in captured.err
    assert "trained" not in captured.out and os.listdir(tmp_path) == []


def test_compare_losses_detects_drift_and_nan():
    ref = [5.5, 4.0, 3.0]
    assert compare_losses(ref, list(ref)) == (0.0, True)
    worst, ok = compare_losses([5.5, 4.0, 3.0 * (1 + 3e-5)], ref, rtol=1e-5)
    assert not ok and math.isclose(worst, 3e-5, rel_tol=1e-6)
    assert compare_losses([5.5, float("nan"), 3.0], ref) == (float("inf"), False)
    with pytest.raises(ValueError):
        compare_losses([], ref)


@pytest.mark.parametrize("target", [50_000, 1_000_000, 5_000_000, 50_000_000, 1_000_000_000])
def test_config_for_params_is_close_and_counts_exactly(target):
    cfg = config_for_params(target)
    assert abs(cfg.num_params - target) / target < 0.25
    if target <= 5_000_000:  # build it: the formula must equal the real parameter count
        model = TinyGPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params


def test_model_is_causal_and_head_is_tied():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16))
    assert model.tok_emb.weight.data_ptr() not in {p.data_ptr() for n, p in model.named_parameters()
                                                    if n != "tok_emb.weight"}
    x = torch.randint(0, 256, (2, 16))
    logits, _ = model(x)
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future: earlier logits must not move
    logits2, _ = model(y)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10], rtol=0, atol=0)
    assert not torch.equal(logits[:, 10:], logits2[:, 10:])
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_corpus_is_deterministic_and_batches_repeat():
    assert generate_text(2000, seed=3) == generate_text(2000, seed=3)
    assert generate_text(2000, seed=3) != generate_text(2000, seed=4)
    text = generate_text(500, seed=0)
    assert decode(encode(text)) == text
    a, b = Batches(batch_size=3, seq_len=32, seed=1), Batches(batch_size=3, seq_len=32, seed=1)
    for i in (0, 7):
        xa, ya = a[i]
        xb, yb = b[i]
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are the inputs shifted by one
    assert not torch.equal(a[0][0], a[1][0])


def test_default_budget_is_below_the_swapped_states():
    for n in (500_000, 10_000_000, 1_000_000_000):
        budget = default_max_host_bytes(n)
        assert budget < swapped_bytes(n) and budget % (2 << 20) == 0
