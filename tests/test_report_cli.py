"""Step log (StepLogger), its reader, `offload report` and the text forms of the runtime reports."""
from __future__ import annotations

import contextlib
import io
import json
import math
import statistics

import pytest

from offload.plan import (
    StepLogger,
    format_memory_report,
    format_step_stats,
    read_step_log,
    summarize_step_log,
)
from offload.plan.report import STEPLOG_SCHEMA, format_log_summary

ROW_KEYS = {"schema", "step", "time", "step_s", "phases", "overlap_efficiency", "bytes", "rss"}


def _cli(*argv: str):
    from offload.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def _synthetic_log(path, steps=6):
    """A log whose phase times are known: kernel 10+s ms, swap_read 20 ms, swap_write 5 ms."""
    with StepLogger(path) as lg:
        for s in range(1, steps + 1):
            lg.log(
                s,
                phases={"kernel": 0.010 + s * 1e-3, "swap_read": 0.020, "swap_write": 0.005, "wait_swap_read": 0.002},
                step_s=0.030 + s * 1e-3,
                overlap_efficiency=0.8 + s * 0.01,
                bytes={"pageable_host": 1000 * s, "nvme": 1 << 30},   # memory-layer tier name accepted
                rss=(1 << 28) + s,
            )


def test_step_logger_writes_one_json_line_per_step(tmp_path):
    path = tmp_path / "steps.jsonl"
    _synthetic_log(path)
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    row = json.loads(lines[2])
    assert set(row) == ROW_KEYS
    assert row["schema"] == STEPLOG_SCHEMA and row["step"] == 3
    assert row["bytes"] == {"device": 0, "pinned": 0, "pageable": 3000, "nvme": 1 << 30}
    assert row["phases"]["kernel"] == pytest.approx(0.013)
    assert row["rss"] == (1 << 28) + 3


def test_step_logger_rejects_bad_values(tmp_path):
    with StepLogger(tmp_path / "s.jsonl") as lg:
        with pytest.raises(ValueError, match="-1"):
            lg.log(-1)
        with pytest.raises(ValueError, match="kernel"):
            lg.log(1, phases={"kernel": float("nan")})
    with pytest.raises(ValueError, match="closed"):
        lg.log(2)
    with pytest.raises(FileNotFoundError, match="no-such-dir"):
        StepLogger(tmp_path / "no-such-dir" / "s.jsonl")


def test_summary_by_hand(tmp_path):
    path = tmp_path / "steps.jsonl"
    _synthetic_log(path)
    s = summarize_step_log(read_step_log(path))
    assert s["rows"] == 6 and (s["first_step"], s["last_step"]) == (1, 6)
    # step_s = 31..36 ms: mean 33.5 ms, median 33.5 ms; kernel = 11..16 ms: mean 13.5 ms
    assert s["step_s_mean"] == pytest.approx(0.0335)
    assert s["step_s_median"] == pytest.approx(0.0335)
    assert s["phase_s_mean"]["kernel"] == pytest.approx(0.0135)
    assert s["phase_s_mean"]["swap_read"] == pytest.approx(0.020)
    assert list(s["phase_s_mean"]) == ["kernel", "swap_read", "swap_write", "wait_swap_read"]
    assert s["overlap_efficiency_mean"] == pytest.approx(statistics.fmean(0.8 + k * 0.01 for k in range(1, 7)))
    assert s["peak_bytes"] == {"device": 0, "pinned": 0, "pageable": 6000, "nvme": 1 << 30}
    assert s["peak_rss"] == (1 << 28) + 6


def test_report_cli_summary_and_plot(tmp_path):
    path = tmp_path / "steps.jsonl"
    _synthetic_log(path)
    png = tmp_path / "out.png"
    rc, out, err = _cli("report", str(path), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["step_s_mean"] == pytest.approx(0.0335)
    rc, out, err = _cli("report", str(path))
    assert rc == 0
    assert "6 steps logged" in out and "33.50 ms" in out and "kernel" in out and "1.00 GiB" in out
    pytest.importorskip("matplotlib")
    rc, out, err = _cli("report", str(path), "--plot", str(png))
    assert rc == 0, err
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_plot_of_a_long_log(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "long.jsonl"
    _synthetic_log(path, steps=500)
    rc, _, err = _cli("report", str(path), "--plot", str(tmp_path / "long.png"))
    assert rc == 0, err
    assert (tmp_path / "long.png").read_bytes()[:4] == b"\x89PNG"


def test_report_plot_goes_to_the_path_it_names(tmp_path):
    # matplotlib adds ".png" to a name without a suffix: `--plot DIR` wrote DIR.png beside the
    # directory, and `--plot out` wrote out.png, each while saying "plot written to" the path given.
    pytest.importorskip("matplotlib")
    path = tmp_path / "steps.jsonl"
    _synthetic_log(path)
    rc, out, err = _cli("report", str(path), "--plot", str(tmp_path / "out"))
    assert rc == 0, err
    assert (tmp_path / "out").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "out.png").exists()
    folder = tmp_path / "plots"
    folder.mkdir()
    rc, out, err = _cli("report", str(path), "--plot", str(folder))
    assert rc == 1 and "Is a directory" in err and str(folder) in err
    assert not (tmp_path / "plots.png").exists()


def test_report_cli_errors(tmp_path):
    rc, _, err = _cli("report", str(tmp_path / "missing.jsonl"))
    assert rc == 1 and "missing.jsonl" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "phases": {}}\nnot json\n')
    rc, _, err = _cli("report", str(bad))
    assert rc == 1 and "bad.jsonl:2" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    rc, _, err = _cli("report", str(empty))
    assert rc == 1 and "no rows" in err


class _FakeOpt:
    """What offload.AdamW's reports return (the shapes of offload/optim/stats.py and adam.py)."""

    def step_stats(self):
        last = {"kernel": 0.05, "swap_read": 0.04, "swap_write": 0.03, "unscale_clip": 0.001,
                "step": 0.08, "overlap_efficiency": 0.875}
        return {"steps": 3, "skipped": 1, "last": last, "mean": dict(last, kernel=0.06)}

    def memory_report(self):
        return {"offload": "nvme", "store": "swapped", "tiers": {"device": 0, "pinned": 0,
                "pageable": 3 << 20, "nvme": 800 << 20}, "detail": {"sub_group_size": 1234}, "rss": 5 << 30}


def test_log_optimizer_and_formatters(tmp_path):
    opt = _FakeOpt()
    with StepLogger(tmp_path / "s.jsonl") as lg:
        row = lg.log_optimizer(7, opt)
    assert row["step"] == 7 and row["step_s"] == 0.08 and row["overlap_efficiency"] == 0.875
    assert row["phases"] == {"kernel": 0.05, "swap_read": 0.04, "swap_write": 0.03, "unscale_clip": 0.001}
    assert row["bytes"]["nvme"] == 800 << 20 and row["rss"] == 5 << 30

    text = format_memory_report(opt.memory_report())
    assert "offload=nvme" in text and "800.00 MiB" in text and "3.00 MiB" in text and "5.00 GiB" in text
    text = format_step_stats(opt.step_stats())
    assert "optimizer steps: 3 (skipped 1)" in text
    kernel = next(l for l in text.splitlines() if l.strip().startswith("kernel"))
    assert kernel.split()[1:] == ["50.00", "60.00"]
    assert "overlap efficiency: last 0.875" in text
    assert "no step yet" in format_step_stats({"steps": 0, "skipped": 0, "last": {}, "mean": None})


def test_log_real_optimizer_if_available(tmp_path):
    import torch

    import offload

    p = torch.nn.Parameter(torch.randn(4096))
    opt = offload.AdamW([p], lr=1e-3)
    with StepLogger(tmp_path / "s.jsonl") as lg:
        for s in range(1, 4):
            p.grad = torch.randn(4096)
            opt.step()
            lg.log_optimizer(s, opt)
    rows = read_step_log(tmp_path / "s.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["phases"].get("kernel", 0) > 0 for r in rows)
    assert rows[-1]["bytes"]["pageable"] == 2 * 4096 * 4       # exp_avg + exp_avg_sq
    assert math.isfinite(rows[-1]["step_s"])


def test_memory_report_text_shows_counts_as_counts_and_bytes_as_bytes():
    """The flat store's details hold counts beside byte sizes: world, rank and stage read
    "world: 1 B", and a shard of 3,000,000 elements "shard_numel: 2.86 MiB"."""
    import torch

    import offload

    p = torch.nn.Parameter(torch.zeros(3_000_000, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    opt = offload.AdamW([p], lr=1e-3, offload="cpu")
    try:
        opt.step()
        lines = format_memory_report(opt.memory_report()).splitlines()
    finally:
        opt.close()
    detail = dict(line.strip().split(": ", 1) for line in lines if ": " in line)
    assert detail["world"] == "1" and detail["rank"] == "0" and detail["stage"] == "0"
    assert detail["shard_numel"] == "3,000,000" and detail["grad_peak_numel"] == "0"
    assert detail["state_bytes"] == "34.33 MiB"  # fp32 master + two moments: 12 B x 3,000,000
    assert detail["release_grads"] == "False"


def test_steps_with_no_grads_and_skipped_steps_stay_out_of_the_means(tmp_path):
    """A step before any backward (no grads: nothing stepped) took a few microseconds at an
    overlap efficiency of 0.02-0.15, counted as a step in ``step_stats()``'s means; and
    ``offload report`` averaged skipped (inf/NaN) rows into its times. Both are counted
    apart now, in the optimizer and in the log ``attach`` writes."""
    import torch

    import offload
    from offload.plan import attach

    p = torch.nn.Parameter(torch.randn(50_000))
    opt = offload.AdamW([p], lr=1e-3)
    path = tmp_path / "s.jsonl"
    handle = attach(opt, every=0, path=path)
    opt.step()                                  # no grad yet
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    handle.remove()
    stats = opt.step_stats()
    assert (stats["steps"], stats["empty"], stats["skipped"]) == (2, 1, 0)
    rows = read_step_log(path)
    assert [bool(r.get("empty")) for r in rows] == [True, False, False]
    summary = summarize_step_log(rows)
    assert summary["empty_rows"] == 1 and summary["skipped_rows"] == 0
    timed = rows[1:]
    assert summary["step_s_mean"] == pytest.approx(statistics.fmean(r["step_s"] for r in timed))
    assert summary["overlap_efficiency_mean"] == pytest.approx(
        statistics.fmean(r["overlap_efficiency"] for r in timed))
    assert "1 with no grads: not in the times" in format_log_summary(summary)
    assert "1 with no grads" in format_step_stats(stats)

    # a skipped row (GradScaler's inf) is left out the same way
    rows.append(dict(rows[-1], step=4, step_s=100.0, overlap_efficiency=0.0, skipped=True))
    again = summarize_step_log(rows)
    assert again["skipped_rows"] == 1 and again["step_s_mean"] == summary["step_s_mean"]
    assert "1 skipped (inf/NaN grads)" in format_log_summary(again)
