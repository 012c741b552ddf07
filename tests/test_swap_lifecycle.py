"""Who may remove a swap directory: forked children, a directory replaced under us, SIGTERM."""
from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from offload.swap import SwapLayout, SwapStore
from test_swap_util import run_python

NAMES = ["exp_avg", "exp_avg_sq"]


def _store(d, **kw):
    return SwapStore(str(d), SwapLayout(5000, 2048, 2), state_names=NAMES, **kw)


# The parent steps an fp32 nvme AdamW and torch's AdamW on the same grads, forks (os.fork +
# sys.exit in the child, then a fork Pool terminated), and steps both again.
_FORK = """
import multiprocessing as mp, os, sys, torch
import offload
torch.manual_seed(0)
dtype = getattr(torch, sys.argv[2])
p = torch.randn(5000).to(dtype).requires_grad_(True)
q = p.detach().clone().requires_grad_(True)
opt = offload.AdamW([p], lr=1e-2, offload="nvme", swap_dir=sys.argv[1])
# fp32: torch's AdamW; bf16 (the flat store): the same optimizer with its states in RAM
ref = (torch.optim.AdamW([q], lr=1e-2, foreach=False) if dtype == torch.float32
       else offload.AdamW([q], lr=1e-2, offload="cpu"))
def step(k):
    g = torch.randn(5000, generator=torch.Generator().manual_seed(k)).to(dtype)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step(); ref.step()
step(1)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # runs the inherited atexit hooks in the child
os.waitpid(pid, 0)
step(2)
pool = mp.get_context("fork").Pool(2)
pool.map(abs, [1, 2])
pool.terminate()  # SIGTERM to the workers
pool.join()
step(3)
names = os.listdir(sys.argv[1])
print("ok", len(names), float((p.detach().float() - q.detach().float()).abs().max()), flush=True)
opt.close()
print("closed", os.listdir(sys.argv[1]), flush=True)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forked_children_leave_the_parents_swap_dir_alone(tmp_path, dtype):
    proc = run_python(_FORK, str(tmp_path), dtype)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = out.split("\n")
    ok = lines[0].split()
    assert ok[0] == "ok" and ok[1] == "1", out + err
    assert float(ok[2]) <= (1e-6 if dtype == "float32" else 0.0), out
    assert lines[1] == "closed []", out + err


# A child forked from a process whose nvme optimizer is open tries to use it: each call fails
# at once with a RuntimeError (the engine's completion threads are the parent's: it used to
# hang for ever), and the parent's next step still equals a reference that no child touched.
_FORK_USE = """
import os, sys, torch
import offload
torch.set_num_threads(1)
p = torch.nn.Parameter(torch.randn(300000, generator=torch.Generator().manual_seed(0)))
q = torch.nn.Parameter(p.detach().clone())
kw = dict(lr=1e-2, offload="nvme", state_dtype=sys.argv[2])
os.makedirs(os.path.join(sys.argv[1], "a")); os.makedirs(os.path.join(sys.argv[1], "b"))
opt = offload.AdamW([p], swap_dir=os.path.join(sys.argv[1], "a"), **kw)
ref = offload.AdamW([q], swap_dir=os.path.join(sys.argv[1], "b"), **kw)
def step(k):
    g = torch.randn(300000, generator=torch.Generator().manual_seed(k))
    p.grad, q.grad = g.clone(), g.clone()
    opt.step(); ref.step()
step(1)
for action in ("step", "state_dict", "save"):
    pid = os.fork()
    if pid == 0:
        import signal
        signal.alarm(30)  # a hang kills the child: the parent then sees the signal
        try:
            if action == "step":
                p.grad = torch.ones_like(p); opt.step()
            elif action == "state_dict":
                opt.state_dict()
            else:
                opt.save_checkpoint(os.path.join(sys.argv[1], "ck"))
            os._exit(3)
        except RuntimeError as e:
            os._exit(0 if "forked" in str(e) and str(os.getppid()) in str(e) else 4)
        except BaseException:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    print(action, status, flush=True)
step(2)
print("diff", float((p.detach() - q.detach()).abs().max()), flush=True)
opt.close(); ref.close()
"""


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_a_forked_child_cannot_use_the_parents_nvme_optimizer(tmp_path, state_dtype):
    proc = run_python(_FORK_USE, str(tmp_path), state_dtype)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert out.split("\n")[:4] == ["step 0", "state_dict 0", "save 0", "diff 0.0"], out + err


def _fork_holder(swap_dir):
    """A child that opens its own store on ``swap_dir`` and waits (leaves by SIGKILL)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _store(swap_dir)
            os.write(w, b"ready")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 5) == b"ready"
    os.close(r)
    return pid


def test_close_leaves_a_directory_made_again_by_another_process(tmp_path):
    mine = _store(tmp_path)
    path = mine.path
    shutil.rmtree(path)  # e.g. a cron job cleaning /var/tmp
    other = _fork_holder(tmp_path)  # makes and locks its own offload-run.rank0
    try:
        before = sorted(os.listdir(path))
        mine.close()  # must not raise, must not touch the other's directory
        assert sorted(os.listdir(path)) == before and "lock" in before
    finally:
        os.kill(other, signal.SIGKILL)
        os.waitpid(other, 0)
    shutil.rmtree(path)


def test_close_after_the_directory_vanished_does_not_raise(tmp_path):
    st = _store(tmp_path)
    shutil.rmtree(st.path)
    st.close()
    assert os.listdir(tmp_path) == []


def test_same_inode_but_not_our_lock_is_left(tmp_path):
    """The directory is ours but its lock file was replaced (removed and made again): the
    lock is no longer ours, so the directory is not removed."""
    st = _store(tmp_path)
    lock = os.path.join(st.path, "lock")
    os.unlink(lock)
    open(lock, "w").write("1\n")
    st.close()
    assert os.path.exists(lock)
    shutil.rmtree(st.path)


_TERM = """
import sys, time
from offload.swap import SwapLayout, SwapStore
st = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
st.commit({0: None})
print("ready", flush=True)
time.sleep(60)
"""


def test_sigterm_keeps_the_swap_dir_for_resume(tmp_path):
    proc = run_python(_TERM, str(tmp_path))
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the default action still happens
    st = _store(tmp_path, resume=True)  # a preempted job resumes from the last finished step
    assert st.step == 1 and st.valid == [True, False, False]
    st.close()
    assert os.listdir(tmp_path) == []


_TERM_HANDLER = """
import signal, sys, time
def graceful(s, f):  # a framework's handler that exits
    sys.exit(3)
signal.signal(signal.SIGTERM, graceful)
from offload.swap import SwapLayout, SwapStore
st = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
print("ready", flush=True)
for _ in range(6000):  # short sleeps: a Python handler runs between them
    time.sleep(0.01)
"""


def _terminate_gracefully(code, tmp_path):
    """Run ``code`` (its handler exits 3 on SIGTERM) until "ready", SIGTERM it; its stderr."""
    proc = run_python(code, str(tmp_path))
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 3
    return proc.stderr.read()


def test_sigterm_through_a_python_handler_keeps_the_swap_dir(tmp_path):
    assert "kept after SIGTERM" in _terminate_gracefully(_TERM_HANDLER, tmp_path)
    assert os.listdir(tmp_path) == ["offload-run.rank0"]
    _store(tmp_path, resume=True).close()


_LATE_HANDLER = """
import signal, sys, time
from offload.swap import SwapLayout, SwapStore
first = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 1), state_names=["exp_avg"], run_name="a")
assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the default action keeps files itself
def graceful(s, f):  # a framework's handler, set after the first store opened
    sys.exit(3)
signal.signal(signal.SIGTERM, graceful)
second = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 1), state_names=["exp_avg"], run_name="b")
assert signal.getsignal(signal.SIGTERM) is not graceful  # wrapped when the next store registered
print("ready", flush=True)
for _ in range(6000):
    time.sleep(0.01)
"""


_HANDLER_AFTER_THE_OPTIMIZER = """
import signal, sys, time
import torch, offload
p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
opt = offload.AdamW([p], offload="nvme", swap_dir=sys.argv[1])
def graceful(s, f):  # a framework's handler, set after the optimizer was built
    sys.exit(3)
signal.signal(signal.SIGTERM, graceful)
p.grad = torch.ones_like(p)
opt.step()
assert signal.getsignal(signal.SIGTERM) is not graceful  # wrapped by the step
print("ready", flush=True)
for _ in range(6000):
    time.sleep(0.01)
"""


def test_a_handler_set_after_the_optimizer_is_wrapped_by_the_next_step(tmp_path):
    # No store registers after it: the handler went unwrapped, exited through atexit, and that
    # removed the directory the preempted job would resume from.
    assert "kept after SIGTERM" in _terminate_gracefully(_HANDLER_AFTER_THE_OPTIMIZER, tmp_path)
    assert len(os.listdir(tmp_path)) == 1


def test_a_handler_set_later_is_wrapped_by_the_next_store(tmp_path):
    _terminate_gracefully(_LATE_HANDLER, tmp_path)
    # graceful exited through atexit, yet both directories stay for resume
    assert sorted(os.listdir(tmp_path)) == ["offload-a.rank0", "offload-b.rank0"]
    for run in ("a", "b"):
        SwapStore(str(tmp_path), SwapLayout(5000, 2048, 1), state_names=["exp_avg"], run_name=run,
                  resume=True).close()
    assert os.listdir(tmp_path) == []


_CHAINED_LATER = """
import signal, sys, time
from offload.swap import SwapLayout, SwapStore
def h1(s, f):  # set first: exits
    print("h1", file=sys.stderr, flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, h1)
first = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 1), state_names=["exp_avg"], run_name="a")
prev = signal.getsignal(signal.SIGTERM)  # ours, wrapping h1
def h2(s, f):  # a framework's handler set later, chaining to the one it replaced
    print("h2", file=sys.stderr, flush=True)
    prev(s, f)
signal.signal(signal.SIGTERM, h2)
second = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 1), state_names=["exp_avg"], run_name="b")
print("ready", flush=True)
for _ in range(6000):
    time.sleep(0.01)
"""


def test_a_later_handler_that_chains_back_to_ours_runs_each_handler_once(tmp_path):
    # ours wraps h2, h2 calls ours (its previous), ours goes on to h1: no endless recursion
    err = _terminate_gracefully(_CHAINED_LATER, tmp_path)
    assert [ln for ln in err.splitlines() if ln in ("h1", "h2")] == ["h2", "h1"], err
    assert sorted(os.listdir(tmp_path)) == ["offload-a.rank0", "offload-b.rank0"]


_CRASH = """
import sys
from offload.swap import SwapLayout, SwapStore
st = SwapStore(sys.argv[1], SwapLayout(5000, 2048, 2), state_names=["exp_avg", "exp_avg_sq"])
st.commit({0: None})
if sys.argv[2] == "crash":
    raise RuntimeError("a peer rank died")  # e.g. a collective's error, nobody catches it
"""


_CRASH = _CRASH.replace("import sys\n", "import sys, threading, traceback\n", 1) + """
if sys.argv[2] == "late_hook":  # a logging or traceback library's hook, set after the store opened
    sys.excepthook = lambda t, v, tb: traceback.print_exception(t, v, tb)
    raise RuntimeError("a peer rank died")
if sys.argv[2] == "thread":  # the training loop in a worker thread dies; the main thread exits
    def train():
        raise RuntimeError("a peer rank died")
    t = threading.Thread(target=train, name="trainer")
    t.start()
    t.join()
    sys.exit(1)
"""


@pytest.mark.parametrize("how", ["crash", "normal", "late_hook", "thread"])
def test_an_uncaught_exception_keeps_the_swap_dir_normal_exit_removes_it(tmp_path, how):
    proc = run_python(_CRASH, str(tmp_path), how)
    rc, err = proc.wait(timeout=60), proc.stderr.read()
    if how == "normal":
        assert rc == 0 and os.listdir(tmp_path) == [], err
        return
    assert rc == 1 and "RuntimeError: a peer rank died" in err  # the traceback as before
    where = " in thread trainer" if how == "thread" else ""
    assert f"kept after an uncaught RuntimeError{where} (step 1" in err
    st = _store(tmp_path, resume=True)  # the survivors' states are there for the restart
    assert st.step == 1
    st.close()


@pytest.mark.parametrize("unwinding", [KeyboardInterrupt, ValueError, None])
def test_a_close_while_ctrl_c_propagates_keeps_the_swap_dir(tmp_path, unwinding, caplog):
    # `try: train() finally: opt.close()` (or `with opt:`) hit by Ctrl-C: the states stay for
    # resume=True, as after SIGTERM; any other exception, or none, removes them as asked
    import torch

    import offload

    p = torch.zeros(3000, requires_grad=True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.ones(3000)
    opt.step()
    try:
        with opt:
            if unwinding is not None:
                raise unwinding()
    except (KeyboardInterrupt, ValueError):
        pass
    if unwinding is not KeyboardInterrupt:
        assert os.listdir(tmp_path) == []
        return
    assert "kept after Ctrl-C (closed while its KeyboardInterrupt propagated) (step 1" in caplog.text
    q = p.detach().clone().requires_grad_()  # fp32 CPU params are their own master: the same values
    again = offload.AdamW([q], offload="nvme", swap_dir=str(tmp_path), resume=True)
    assert int(again.state_dict()["state"][0]["step"]) == 1
    again.close()
    assert os.listdir(tmp_path) == []


def test_inside_removing_a_close_while_ctrl_c_propagates_removes(tmp_path):
    # for a caller that removes its temporary swap_dir next (the demo): no "kept" warning
    import torch

    import offload
    from offload.swap import cleanup

    p = torch.zeros(3000, requires_grad=True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            with cleanup.removing():
                opt.close()
    assert os.listdir(tmp_path) == [] and not cleanup.terminating()


def test_an_error_shown_at_an_interactive_prompt_does_not_keep_the_swap_dir(tmp_path):
    # sys.last_value keeps a crash's directory at exit even when a library replaced
    # sys.excepthook; a REPL or IPython records every error shown at its prompt there, and the
    # session went on: a normal exit still removes the directory.
    code = _CRASH.replace('if sys.argv[2] == "crash":', 'if sys.argv[2] == "never":', 1) + """
sys.last_value = ValueError("shown at the prompt an hour ago")
sys.ps1 = ">>> "
"""
    proc = run_python(code, str(tmp_path), "normal")
    rc, err = proc.wait(timeout=60), proc.stderr.read()
    assert rc == 0 and os.listdir(tmp_path) == [], err
