"""Ctrl-C around the end of a run: a close() that removes the swap directory (thirty-fifth
session's adversarial pass over signals and forks, /var/tmp driver runs).

The moment is made exact instead of left to timing: the test's own ``os.unlink`` removes a
file of the directory and then sends this process SIGINT, which Python raises at the next
bytecode, inside the removal's loop.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

import offload
from _unlink_signal import signal_after_first_unlink


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler (a suite started in the background inherits SIGINT
    ignored, and the hold leaves an ignored SIGINT alone: no KeyboardInterrupt there)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ctrl_c_during_close_is_held_until_the_swap_dir_is_gone(tmp_path, monkeypatch, dtype):
    # It landed between two unlinks: the run ended with a directory missing some of its files
    # (the manifest, say), which resume=True refused and only `offload clean` removed.
    p = torch.nn.Parameter(torch.ones(3000, dtype=dtype))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.ones_like(p)
    opt.step()
    sent = signal_after_first_unlink(monkeypatch, signal.SIGINT, str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        opt.close()
    monkeypatch.undo()
    assert sent, "the removal unlinked nothing"
    assert os.listdir(tmp_path) == []  # all of it, then the KeyboardInterrupt
