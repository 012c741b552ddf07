"""``opt.state[p]`` of ``offload="nvme"`` read by another thread while the main thread steps
(a monitoring thread logging the moments): the read loads a sub-group into the swap cache's
buffer, which the step streams through. Unserialized, the step computed on and committed
the states the read had put there (params off by 0.1 after ten steps); torch's reads never
change the training. Now the reads wait for the step (swap/cache.py ``serialized``): the run
is bit for bit the run without the reader."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import offload


def _run(tmp_path, dtype, read):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4096).to(dtype)) for _ in range(32)]
    opt = offload.Adam(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), sub_group_size=16384)
    stop, errors = threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                for p in ps:
                    st = opt.state.get(p)
                    if st is not None:
                        read(st)
            except Exception as exc:  # (a failed read must fail the test, not vanish in the thread)
                errors.append(exc)
                return

    thread = threading.Thread(target=reader) if read is not None else None
    for i in range(8):
        if i == 1 and thread is not None:
            thread.start()  # (after the first step: the entries exist)
        for p in ps:
            p.grad = torch.sin(p.detach().float() * (i + 1)).to(dtype)
        opt.step()
    stop.set()
    if thread is not None:
        thread.join()
    out = [p.detach().clone() for p in ps], opt.state_dict()["state"]
    opt.close()
    assert not errors, errors
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-swapped", "bf16-flat"])
@pytest.mark.parametrize("how", ["get", "dict"])
def test_a_thread_reading_the_states_does_not_change_the_steps(tmp_path, dtype, how):
    read = (lambda st: st.get("exp_avg")) if how == "get" else dict  # a read; a copy of the whole entry
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want_params, want_states = _run(tmp_path / "a", dtype, None)
    got_params, got_states = _run(tmp_path / "b", dtype, read)
    for a, b in zip(got_params, want_params):
        assert torch.equal(a, b)
    for i, st in want_states.items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(got_states[i][k]), torch.as_tensor(v)), (i, k)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_thread_holds_the_lock_gets_its_own(tmp_path):
    """Another thread holds a cache's lock (its step, its read) when the main thread forks:
    the child's own use of the lock must not wait for a thread it does not have."""
    from offload.swap import cache as cache_mod

    held, go = threading.Event(), threading.Event()
    caches = list(cache_mod._CACHES)
    params = [torch.nn.Parameter(torch.randn(5000))]
    opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    caches = [c for c in cache_mod._CACHES if c not in caches]
    assert caches, "the nvme store made no GroupCache"

    def hold():
        with caches[0].lock:
            held.set()
            go.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: the lock must be free (acquire without waiting)
        os._exit(0 if caches[0].lock.acquire(timeout=5) else 3)
    go.set()
    t.join(30)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    opt.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("cached", [False, True])
def test_a_forked_child_reading_a_swapped_state_gets_an_error_not_a_crash(tmp_path, cached):
    """The cache buffer is registered with io_uring, so not mapped in a forked child: a child
    reading a sub-group the parent had cached (``cached``) died of SIGSEGV."""
    params = [torch.nn.Parameter(torch.randn(5000))]
    opt = offload.AdamW(params, lr=1e-2, offload="nvme", swap_dir=str(tmp_path))
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    if cached:
        opt.state[params[0]]["exp_avg"]
    pid = os.fork()
    if pid == 0:
        try:
            opt.state[params[0]]["exp_avg"]
            os._exit(3)
        except RuntimeError as exc:
            os._exit(0 if "a child forked from it" in str(exc) else 4)
        finally:
            os._exit(5)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    params[0].grad = torch.ones_like(params[0])
    opt.step()  # the parent's store is untouched
    opt.close()
