"""A forked child that closes the parent's nvme optimizer with ``keep_swap=True`` (a
``finally: opt.close(keep_swap=True)`` in code a worker runs, then sys.exit): the parent's
run must go on untouched (thirty-fifth session's fork pass).

close(keep_swap=True) closed the swap pipeline itself, which unregistered the io_uring
buffers on the ring the child shares with its parent: the parent's next read failed with
EFAULT ("Bad address", a SwapStepError) and its run was over. close() without keep_swap went
through close_quietly, which does nothing in a child.
"""
from __future__ import annotations

import pytest

from offload.io import engine_unavailable_reason
from test_swap_util import run_python

_KEEP_IN_CHILD = """
import os, sys, torch
import offload
torch.set_num_threads(1)
dtype = getattr(torch, sys.argv[2])
p = torch.nn.Parameter(torch.randn(70000, generator=torch.Generator().manual_seed(0)).to(dtype))
q = torch.nn.Parameter(p.detach().clone())
kw = dict(lr=1e-2, offload="nvme", io_engine="uring", sub_group_size=16384)
os.makedirs(os.path.join(sys.argv[1], "a")); os.makedirs(os.path.join(sys.argv[1], "b"))
opt = offload.AdamW([p], swap_dir=os.path.join(sys.argv[1], "a"), **kw)
ref = offload.AdamW([q], swap_dir=os.path.join(sys.argv[1], "b"), **kw)
def step(k):
    g = torch.randn(70000, generator=torch.Generator().manual_seed(k)).to(dtype)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step(); ref.step()
step(1)
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(30)
    try:
        opt.close(keep_swap=True)
    finally:
        os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
step(2); step(3)
print("diff", float((p.detach().float() - q.detach().float()).abs().max()), flush=True)
opt.close(); ref.close()
print("left", os.listdir(os.path.join(sys.argv[1], "a")), flush=True)
"""


@pytest.mark.skipif(engine_unavailable_reason("uring") is not None, reason="uring engine unavailable here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_child_closing_with_keep_swap_leaves_the_parents_ring_alone(tmp_path, dtype):
    proc = run_python(_KEEP_IN_CHILD, str(tmp_path), dtype)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert out.split("\n")[:4] == ["child 0", "diff 0.0", "left []", ""], out + err
