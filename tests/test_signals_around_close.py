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


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler (a suite started in the background inherits SIGINT
    ignored, and the hold leaves an ignored SIGINT alone: no KeyboardInterrupt there)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _ctrl_c_after_first_unlink(monkeypatch):
    """os.unlink that removes its file, then Ctrl-C once (a second would raise at once)."""
    real, sent = os.unlink, []

    def unlink(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if kwargs.get("dir_fd") is not None and not sent:  # the removal's unlinks, by name in a dir
            sent.append(path)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "unlink", unlink)
    return sent


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ctrl_c_during_close_is_held_until_the_swap_dir_is_gone(tmp_path, monkeypatch, dtype):
    # It landed between two unlinks: the run ended with a directory missing some of its files
    # (the manifest, say), which resume=True refused and only `offload clean` removed.
    p = torch.nn.Parameter(torch.ones(3000, dtype=dtype))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.ones_like(p)
    opt.step()
    sent = _ctrl_c_after_first_unlink(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        opt.close()
    monkeypatch.undo()
    assert sent, "the removal unlinked nothing"
    assert os.listdir(tmp_path) == []  # all of it, then the KeyboardInterrupt
