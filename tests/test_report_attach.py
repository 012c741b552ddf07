"""``offload.plan.attach``: a JSON line per step and periodic log lines, from the optimizer's own reports."""
from __future__ import annotations

import logging

import pytest
import torch

import offload
from offload.plan import attach, read_step_log


def _train(opt, params, steps):
    for i in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        opt.step()


def test_attach_writes_one_line_per_step_and_logs_every_k(tmp_path, caplog):
    params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(17))]
    opt = offload.AdamW(params, lr=1e-3)
    path = tmp_path / "steps.jsonl"
    with caplog.at_level(logging.INFO, logger="offload.report"):
        handle = attach(opt, every=2, path=path)
        _train(opt, params, 5)
        handle.remove()
        _train(opt, params, 2)  # detached: no more lines
    rows = read_step_log(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["phases"]["kernel"] > 0 for r in rows)
    assert all(r["bytes"]["pageable"] == 8 * 1017 for r in rows)
    assert all(r["rss"] > 0 for r in rows)
    assert sum("step 2" in m or "step 4" in m for m in caplog.messages) == 2


def test_attach_rejects_bad_arguments():
    opt = offload.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="every must be"):
        attach(opt, every=-1)
    with pytest.raises(TypeError, match="offload.Adam"):
        attach(object())
