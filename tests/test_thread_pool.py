"""The threads a native call runs on ([Note: torch's OpenMP pool] in native/parallel.h).

``OFFLOAD_POOL=auto`` (the default) runs a parallel call on the OpenMP pool torch loaded,
``own`` on threads of the call's own. Which threads run a block never changes its bits.
libgomp's pool does not survive fork(): a child must step on its own threads, not wait
forever for the parent's (torch's own parallel ops hang there).
"""
from __future__ import annotations

import os

import pytest
import torch

from _fork_child import run_child
from offload.kernels import get_backend
from offload.kernels import _threads
from offload.kernels.fields import ADAM, SGD
from offload.kernels.native_backend import NativeBackend

pytestmark = pytest.mark.skipif(not isinstance(get_backend(None), NativeBackend),
                                reason="the pool switch is the native library's")

N = 3 * (1 << 16) + 77  # three blocks and a tail: several work items for two threads
ADAM_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def _inputs(seed, n=N, rule=ADAM):
    gen = torch.Generator().manual_seed(seed)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return p, g, {f.name: torch.rand(n, generator=gen) for f in rule.fields}


def _run(nb, inputs, rule=ADAM, **hp):
    """Three steps in place (no torch op: a forked child must not start torch's pool)."""
    p, g, states = inputs
    for step in (1, 2, 3):
        nb.rule_step(rule, p, g, states, step=step, num_threads=2, **(hp or ADAM_HP))
    return [p, *states.values()]


def _step(nb, seed, rule=ADAM, **hp):
    return _run(nb, _inputs(seed, rule=rule), rule, **hp)


def _same(a, b) -> bool:
    return a.numpy().tobytes() == b.numpy().tobytes()


def test_the_pools_give_the_same_bits(monkeypatch):
    nb = get_backend("native")
    torch.randn(1 << 22).mul_(2.0)  # torch's pool up
    out = {}
    for pool in ("auto", "own"):
        monkeypatch.setenv("OFFLOAD_POOL", pool)
        out[pool] = (_step(nb, 0) + _step(nb, 1, rule=SGD, lr=0.1, momentum=0.9)
                     + [torch.tensor(nb.grad_sumsq(torch.arange(N, dtype=torch.float32), num_threads=2))])
    for a, b in zip(out["auto"], out["own"]):
        assert torch.equal(a, b)
    assert nb._lib.offload_omp_pool() == 1, "torch's pool was not found: auto compared own with own"


@pytest.mark.parametrize("who", ["python", "library"])
def test_a_forked_child_steps_on_its_own_threads(monkeypatch, who):
    """The parent ran torch's pool and a two-thread step on it; the child's two-thread step
    must not wait for threads it does not have. ``library``: only the library's own
    pthread_atfork knows (a fork the Python hook did not see)."""
    monkeypatch.delenv("OFFLOAD_POOL", raising=False)
    nb = get_backend("native")
    torch.randn(1 << 22).mul_(2.0)
    want = _step(nb, 5)  # on the pool
    assert nb._lib.offload_omp_pool() == 1
    inputs = _inputs(5)  # made here: the child runs no torch op of its own

    def child():
        if who == "library":
            _threads._FORKED.clear()
        got = _run(nb, inputs)
        seen = nb._lib.offload_omp_pool() == 0 if who == "library" else nb.pool_setting().startswith("own")
        return seen and all(_same(a, b) for a, b in zip(got, want))

    run_child(child, "a forked child's two-thread step hung (it waited for the parent's OpenMP threads)")


def test_more_threads_than_cpus_never_go_to_libgomp(monkeypatch):
    """libgomp ends the process when it cannot start a pool thread (a pids or memory limit);
    the library's own threads go on with fewer. A call on more threads than the machine has
    CPUs runs on its own threads, with the same bits."""
    nb = get_backend("native")
    monkeypatch.delenv("OFFLOAD_POOL", raising=False)
    cpus = os.cpu_count() or 1
    assert nb._tail(cpus + 1)[3] == 1  # OFFLOAD_POOL_OWN
    assert nb._tail(cpus)[3] == nb._pool()
    inputs = _inputs(5)
    many = [t.clone() for t in inputs[:2]], {k: v.clone() for k, v in inputs[2].items()}
    p, g, states = many[0][0], many[0][1], many[1]
    for step in (1, 2, 3):
        nb.rule_step(ADAM, p, g, states, step=step, num_threads=cpus + 3, **ADAM_HP)
    assert all(torch.equal(a, b) for a, b in zip([p, *states.values()], _run(nb, inputs)))


def test_a_fork_after_the_light_package_import_is_seen():
    """``import offload`` no longer imports the kernels ([Note: a light package import] in
    offload/__init__.py): a child forked after it that loads them first must still know it
    is a forked child (the parent's OpenMP pool did not come with it)."""
    import subprocess
    import sys

    code = ("import os, offload\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    from offload.kernels import _threads\n"
            "    os._exit(0 if _threads.forked() else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "from offload.kernels import _threads\n"
            "raise SystemExit(os.waitstatus_to_exitcode(status) or (4 if _threads.forked() else 0))\n")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
