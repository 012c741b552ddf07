"""Tensors that share memory, within a step and across a batch (an adversarial pass of the
twenty-ninth session found each of these).

- A param listed twice in a group (torch allows it with a warning and steps it twice), or
  params that are overlapping views: the result is that of the steps one after another, on
  every backend and thread count ([Note: aliased entries] in native/batch_alias.h; before,
  two native threads raced over the shared blocks and lost a step in some runs).
- The same through copies (a transposed param twice: [Note: aliased copies] in
  functional.py; before, the second write-back undid the first step).
- Refused before anything is touched: an expand()ed param (its write-back failed after the
  kernel ran, half the group stepped) and a param that is its own state (each backend stored
  a different one of the two last).
- A typo in OFFLOAD_PREFETCH / OFFLOAD_ISA / OFFLOAD_POOL, or a thread count past a C int, is bad input: the
  step refuses it before anything changes and the optimizer is not left failed.
"""
from __future__ import annotations

import pytest
import torch

import offload
import offload.kernels as K
from offload.optim.functional import AdamHyper, adam_step

from test_kernels import _native_or_none

NATIVE = _native_or_none()
H = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)
BACKENDS = ["numba", "torch"] + (["native"] if NATIVE is not None else [])


def _sequential(params, grads, m, v, steps):
    """Each entry alone, in order, on numba: the reference of the batched results."""
    for i in range(len(params)):
        adam_step([params[i]], [grads[i]], [m[i]], [v[i]], [steps[i]], H, backend="numba", num_threads=1)


@pytest.mark.skipif(NATIVE is None, reason="native library not built")
@pytest.mark.parametrize("copies,n,threads", [(16, 16_384, 4), (2, 1_000_003, 2)])
def test_a_param_listed_many_times_steps_as_many_times_whatever_the_threads(copies, n, threads):
    # 16 x 16K: runs of 4 small entries make 4 work items, one per thread, all over the same
    # memory (without [Note: aliased entries] every run differed); 2 x 1M: blocks of both
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    ref = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    steps = list(range(1, copies + 1))
    _sequential([ref] * copies, [g] * copies, [m] * copies, [v] * copies, steps)
    for _ in range(10):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        adam_step([p] * copies, [g] * copies, [m] * copies, [v] * copies, steps, H, backend="native",
                  num_threads=threads)
        assert torch.equal(p, ref)


@pytest.mark.skipif(NATIVE is None, reason="native library not built")
def test_a_param_twice_in_an_optimizer_group_steps_twice():
    p0, g = torch.randn(1000), torch.randn(1000)
    ref = p0.clone()
    _sequential([ref, ref], [g, g], [torch.zeros(1000)] * 2, [torch.zeros(1000)] * 2, [1, 2])
    q = torch.nn.Parameter(p0.clone())
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = offload.AdamW([q, q], lr=1e-2, weight_decay=0.01, num_threads=2)
    q.grad = g
    opt.step()
    assert torch.equal(q.detach(), ref) and float(opt.state[q]["step"]) == 2.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_views_step_as_one_after_the_other(backend):
    base0 = torch.randn(400_000, generator=torch.Generator().manual_seed(1))
    g = torch.randn(300_000, generator=torch.Generator().manual_seed(2))
    ref = base0.clone()
    _sequential([ref[:300_000], ref[100_000:]], [g, g], [torch.zeros(300_000) for _ in range(2)],
                [torch.zeros(300_000) for _ in range(2)], [1, 1])
    base = base0.clone()
    adam_step([base[:300_000], base[100_000:]], [g, g], [torch.zeros(300_000) for _ in range(2)],
              [torch.zeros(300_000) for _ in range(2)], [1, 1], H, backend=backend, num_threads=2)
    if backend == "torch":  # torch's arithmetic: the contract's tolerance, not numba's bits
        torch.testing.assert_close(base, ref, rtol=1e-6, atol=1e-7)
    else:
        assert torch.equal(base, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_transposed_param_twice_steps_twice(backend):
    a0 = torch.randn(40, 30, generator=torch.Generator().manual_seed(3))
    g = torch.randn(30, 40, generator=torch.Generator().manual_seed(4))
    ref = a0.t().contiguous()
    m, v = torch.zeros(30, 40), torch.zeros(30, 40)
    _sequential([ref, ref], [g, g], [m, m], [v, v], [1, 2])
    a = a0.clone()
    b = a.t()  # non-contiguous: stepped through a copy
    m, v = torch.zeros(40, 30).t(), torch.zeros(40, 30).t()
    adam_step([b, b], [g, g], [m, m], [v, v], [1, 2], H, backend=backend)
    tol = dict(rtol=1e-6, atol=1e-7) if backend == "torch" else dict(rtol=0, atol=0)
    torch.testing.assert_close(b, ref, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expanded_param_is_refused_before_anything_is_stepped(backend):
    a, c = torch.randn(30, 40).t(), torch.randn(30, 40).t()
    e = torch.randn(1, 40).expand(30, 40)
    before = [t.clone() for t in (a, c, e)]
    states = [[torch.zeros_like(t) for t in (a, e, c)] for _ in range(2)]
    with pytest.raises(ValueError, match="tensor 1: param has elements that share memory"):
        adam_step([a, e, c], [torch.randn(40, 30).t(), torch.randn(30, 40), torch.randn(40, 30).t()],
                  states[0], states[1], [1, 1, 1], H, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip((a, c, e), before))
    assert all(not s.any() for lst in states for s in lst)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_param_that_is_its_own_state_is_refused(backend):
    ok = torch.randn(50)
    p, g, v = torch.randn(1000), torch.randn(1000), torch.zeros(1000)
    before = (ok.clone(), p.clone())
    with pytest.raises(ValueError, match="tensor 1: exp_avg overlaps param in memory"):
        adam_step([ok, p], [torch.randn(50), g], [torch.zeros(50), p], [torch.zeros(50), v], [1, 1], H,
                  backend=backend)
    with pytest.raises(ValueError, match="exp_avg_sq overlaps param"):
        adam_step([p], [g], [torch.zeros(1000)], [p[:1000]], [1], H, backend=backend)  # a view of it
    with pytest.raises(ValueError, match="exp_avg overlaps param in memory"):
        K.get_backend(backend).adam_step(p, g, p, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                         weight_decay=0.0, decoupled=True)
    assert torch.equal(ok, before[0]) and torch.equal(p, before[1]) and not v.any()


@pytest.mark.skipif(NATIVE is None, reason="native library not built")
@pytest.mark.parametrize("var", ["OFFLOAD_PREFETCH", "OFFLOAD_ISA", "OFFLOAD_POOL"])
def test_a_typo_in_the_environment_is_refused_as_bad_input(monkeypatch, var):
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    p0 = p.detach().clone()
    opt = offload.AdamW([p], lr=0.1, backend="native")
    monkeypatch.setenv(var, {"OFFLOAD_PREFETCH": "on_", "OFFLOAD_ISA": "avx9000", "OFFLOAD_POOL": "owned"}[var])
    with pytest.raises(ValueError, match=var):
        opt.step()
    assert torch.equal(p.detach(), p0) and not opt.state[p]
    monkeypatch.delenv(var)
    opt.step()  # not left in the failed state
    assert float(opt.state[p]["step"]) == 1.0 and not torch.equal(p.detach(), p0)


def test_a_thread_count_past_a_c_int_is_refused_where_it_is_given():
    big = 2**31
    with pytest.raises(ValueError, match="num_threads"):
        offload.set_num_threads(big)
    with pytest.raises(ValueError, match="num_threads"):
        offload.AdamW([torch.nn.Parameter(torch.zeros(3))], num_threads=big)
    p = torch.zeros(10)
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="num_threads"):
            adam_step([p], [p.clone()], [torch.zeros(10)], [torch.zeros(10)], [1], H, backend=backend,
                      num_threads=big)
    offload.set_num_threads(2**31 - 1)  # the largest is taken (the kernels start as many as the work needs)
    offload.set_num_threads(None)
