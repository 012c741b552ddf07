"""A Ctrl-C or a SIGTERM between two unlinks of a directory's removal (thirty-fifth session's
second adversarial pass over signals): ``offload clean``, the param tier's clean-up, and a
close() under a framework's SIGTERM handler left a directory missing some of its files,
neither resumable nor removed. [Note: a removal is whole] in offload/swap/sigint.py.

The moment is exact, not left to timing: the test's own ``os.unlink`` removes a file of the
directory, then sends this process the signal, which Python handles at the next bytecode,
inside the removal's loop.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.cli import main as offload_main
from offload.swap import cleanup
from _unlink_signal import signal_after_first_unlink


@pytest.fixture
def handlers():
    """Python's own SIGINT handler (a suite started in the background inherits SIGINT
    ignored); both handlers put back after the test."""
    before = {s: signal.signal(s, signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    for s, h in before.items():
        signal.signal(s, h)


def _dead_run(swap_dir):
    """A swap directory a killed run would leave: whole, resumable, its lock free."""
    p = torch.nn.Parameter(torch.ones(3000))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=str(swap_dir))
    p.grad = torch.ones_like(p)
    opt.step()
    opt.close(keep_swap=True)
    (run,) = os.listdir(swap_dir)
    assert len(os.listdir(swap_dir / run)) > 2


@pytest.mark.usefixtures("handlers")
@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_offload_clean_stopped_mid_removal_leaves_no_half_directory(tmp_path, monkeypatch, signum, status):
    # It left the run's directory without slot0.bin but with its manifest: not resumable
    # (a slot missing) and not removed.
    _dead_run(tmp_path)
    sent = signal_after_first_unlink(monkeypatch, signum, str(tmp_path))
    assert offload_main(["clean", str(tmp_path)]) == status
    monkeypatch.undo()
    assert sent, "the removal unlinked nothing"
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("handlers")
def test_ctrl_c_in_the_param_tier_cleanup_removes_it_whole_and_lets_go_of_its_lock(tmp_path, monkeypatch):
    # It left offload-params.<pid>.rank0/ with its lock file, and the lock held by this process.
    model = offload.shard(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                          offload_params="nvme", swap_dir=str(tmp_path), unit={torch.nn.Linear})
    model(torch.randn(2, 64)).sum().backward()
    tier = offload.shard.runtime_of(model).tier
    lock = os.path.join(tier.path, "lock")
    sent = signal_after_first_unlink(monkeypatch, signal.SIGINT, str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        tier.close()
    monkeypatch.undo()
    assert sent, "the removal unlinked nothing"
    assert os.listdir(tmp_path) == []
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert not [t for t in held if t.startswith(lock)]


@pytest.mark.usefixtures("handlers")
def test_a_sigterm_handler_that_exits_during_close_leaves_the_swap_dir_gone(tmp_path, monkeypatch):
    # A framework's graceful shutdown (sys.exit in its SIGTERM handler) landing in close()'s
    # removal left the directory without slot0.bin: neither removed nor resumable.
    # (the SIGTERM marks this process as terminating, and offload wraps the handler: both undone after)
    monkeypatch.setattr(cleanup, "_terminating", False)
    monkeypatch.setattr(cleanup, "_wrapped", list(cleanup._wrapped))
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    p = torch.nn.Parameter(torch.ones(3000, dtype=torch.bfloat16))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.ones_like(p)
    opt.step()
    sent = signal_after_first_unlink(monkeypatch, signal.SIGTERM, str(tmp_path))
    with pytest.raises(SystemExit):
        opt.close()
    monkeypatch.undo()  # (the directory went before the handler ran: not kept)
    assert sent, "the removal unlinked nothing"
    assert os.listdir(tmp_path) == []


_DEFAULT_SIGTERM = textwrap.dedent("""
    import os, signal, sys
    import torch, offload
    p = torch.nn.Parameter(torch.ones(3000))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=sys.argv[1])
    p.grad = torch.ones_like(p)
    opt.step()
    real, sent = os.unlink, []
    def unlink(path, *args, **kwargs):
        real(path, *args, **kwargs)
        if kwargs.get("dir_fd") is not None and not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
    os.unlink = unlink
    opt.close()
    print("survived")
""")


def test_sigterm_default_action_during_close_ends_the_process_after_the_removal(tmp_path):
    # SIG_DFL (no handler: offload installs none) killed the process between two unlinks.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", _DEFAULT_SIGTERM, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == -signal.SIGTERM, p.stderr[-2000:]
    assert "survived" not in p.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.usefixtures("handlers")
def test_a_sigterm_held_through_a_removal_that_fails_is_still_delivered(tmp_path, monkeypatch):
    # The hold delivered the SIGTERM only when the block ended normally: a removal whose next
    # unlink failed (EIO) raised its OSError and the SIGTERM was dropped, so a process whose
    # caller went on past that error outlived it (with SIG_DFL: never ended).
    monkeypatch.setattr(cleanup, "_terminating", False)
    monkeypatch.setattr(cleanup, "_wrapped", list(cleanup._wrapped))
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    p = torch.nn.Parameter(torch.ones(3000))
    opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.ones_like(p)
    opt.step()
    real, calls = os.unlink, []

    def unlink(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None:
            return real(path, *args, **kwargs)
        calls.append(path)
        if len(calls) == 2:
            raise OSError(5, "Input/output error", path)
        real(path, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match="Input/output error"):
        opt.close()
    monkeypatch.undo()
    assert len(calls) == 2
    assert got == [signal.SIGTERM]
