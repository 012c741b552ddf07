"""Sparse COO grads with offload.SGD and offload.Adagrad, against torch.optim given the same
sparse grads ([Note: sparse grads] in offload/optim/sparse_grads.py): params and states element
by element (the arithmetic orders of torch's sparse ops and of the kernels differ by rounding:
rtol 1e-5, atol 1e-6), and bit for bit where the grads named nothing (-0.0 included)."""
import copy

import pytest
import torch

import _torch_compat
import offload
from offload.optim.sparse_grads import dense_grad

pytestmark = pytest.mark.filterwarnings("ignore:Sparse invariant checks")

STORES = ["none", "cpu", "nvme"]
RTOL, ATOL = 1e-5, 1e-6


def _store_kw(store, workdir):
    return {"offload": store, "swap_dir": str(workdir)} if store == "nvme" else {"offload": store}


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


def _sparse_grads(n, steps, seed):
    """Sparse grads of a 1-D param of ``n`` elements with duplicate indices, naming only the
    second half (for n > 1): the first half is never touched."""
    gen = torch.Generator().manual_seed(seed)
    lo = n // 2
    out = []
    for _ in range(steps):
        k = max(1, (n - lo) // 3)
        idx = torch.randint(lo, n, (k,), generator=gen)
        idx = torch.cat([idx, idx[:1]])  # a duplicate: coalesced as its sum
        out.append(torch.sparse_coo_tensor(idx[None], torch.randn(k + 1, generator=gen), (n,)))
    return out


def _p0(shape, seed=0):
    p = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    flat = p.view(-1)
    if flat.numel() >= 2:
        flat[0], flat[1] = -0.0, 0.0  # untouched zeros of both signs keep their bits
    return p


def _run_pair(cls_t, cls_o, kw, okw, p0, grads):
    pt, po = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    ot, oo = cls_t([pt], **kw), cls_o([po], **kw, **okw)
    for g in grads:
        pt.grad, po.grad = g.clone(), g.clone()
        ot.step()
        oo.step()
    return pt, po, ot, oo


CONFIGS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.3)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True, foreach=True)),
    ("Adagrad", dict(lr=0.1)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.05, maximize=True, initial_accumulator_value=0.2, eps=1e-3)),
]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("n", [1, 7, 17, 4097])
@pytest.mark.parametrize("name,kw", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_sparse_grads_step_as_torch(store, n, name, kw, workdir):
    cls_t, cls_o = getattr(torch.optim, name), getattr(offload, name)
    pt, po, ot, oo = _run_pair(cls_t, cls_o, kw, _store_kw(store, workdir), _p0(n), _sparse_grads(n, 4, n))
    torch.testing.assert_close(po.detach(), pt.detach(), rtol=RTOL, atol=ATOL)
    state_t, state_o = ot.state[pt], oo.state_dict()["state"].get(0, {})
    key = "sum" if name == "Adagrad" else "momentum_buffer"
    if key in state_t:
        ref = state_t[key].to_dense() if state_t[key].is_sparse else state_t[key]
        torch.testing.assert_close(state_o[key], ref, rtol=RTOL, atol=ATOL)
    untouched = slice(0, n // 2)  # named by no grad: param (and sum) bit for bit as torch left them
    assert torch.equal(_bits(po)[untouched], _bits(pt)[untouched])
    if name == "Adagrad":
        assert torch.equal(_bits(state_o["sum"])[untouched], _bits(state_t["sum"])[untouched])
    oo.close()


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("maximize", [False, True])
def test_adagrad_leaves_what_the_grad_does_not_name_bit_for_bit(store, maximize, workdir):
    """A sparse grad with no entry (and one naming element 2 only): torch's sparse path
    touches nothing else; the dense step's zeros must not either (-0.0 params, lr_decay,
    initial_accumulator_value and eps all in play)."""
    kw = dict(lr=0.5, lr_decay=0.1, initial_accumulator_value=0.0, eps=1e-10, maximize=maximize)
    p0 = torch.tensor([-0.0, 0.0, 1.5, -2.0, float("inf"), 3.0, -0.0])
    grads = [torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), torch.zeros(0), (7,)),
             torch.sparse_coo_tensor([[2, 2]], [0.25, 0.5], (7,))]
    pt, po, ot, oo = _run_pair(torch.optim.Adagrad, offload.Adagrad, kw, _store_kw(store, workdir), p0, grads)
    others = [0, 1, 3, 4, 5, 6]
    assert torch.equal(_bits(po)[others], _bits(p0)[others])
    assert torch.equal(_bits(oo.state_dict()["state"][0]["sum"])[others], _bits(ot.state[pt]["sum"])[others])
    torch.testing.assert_close(po.detach(), pt.detach(), rtol=RTOL, atol=ATOL)
    assert float(oo.state_dict()["state"][0]["step"]) == float(ot.state[pt]["step"]) == 2.0
    oo.close()


def _embedding_run(opt_of, steps=4):
    torch.manual_seed(7)
    emb = torch.nn.Embedding(1000, 33, sparse=True)
    opt = opt_of(emb.parameters())
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        idx = torch.randint(0, 500, (64,), generator=gen)
        idx[1::8] = idx[0::8]  # duplicate lookups: their grads add up
        opt.zero_grad()
        (emb(idx) * torch.linspace(-1, 1, 33)).pow(2).sum().backward()
        assert emb.weight.grad.is_sparse and emb.weight.grad.sparse_dim() == 1  # hybrid: values nnz x 33
        opt.step()
    return emb, opt


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9)), ("Adagrad", dict(lr=0.1))])
def test_an_embedding_with_sparse_grads_trains_as_with_torch(store, name, kw, workdir):
    emb_t, opt_t = _embedding_run(lambda ps: getattr(torch.optim, name)(ps, **kw))
    emb_o, opt_o = _embedding_run(lambda ps: getattr(offload, name)(ps, **kw, **_store_kw(store, workdir)))
    torch.testing.assert_close(emb_o.weight.detach(), emb_t.weight.detach(), rtol=RTOL, atol=ATOL)
    assert torch.equal(_bits(emb_o.weight)[500:], _bits(emb_t.weight)[500:])  # rows never looked up
    key = "sum" if name == "Adagrad" else "momentum_buffer"
    ref = opt_t.state[emb_t.weight][key]
    ref = ref.to_dense() if ref.is_sparse else ref
    torch.testing.assert_close(opt_o.state_dict()["state"][0][key], ref, rtol=RTOL, atol=ATOL)
    opt_o.close()


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9)), ("Adagrad", dict(lr=0.1, lr_decay=0.01))])
def test_state_dict_moves_both_ways_with_torch_after_sparse_grads(name, kw):
    """Ours (a dense buffer) into torch and torch's (a sparse momentum buffer) into ours: both
    go on as one that never moved."""
    n, grads = 17, _sparse_grads(17, 6, 1)
    p0 = _p0(n)
    ref, _, ref_opt, _ = _run_pair(getattr(torch.optim, name), getattr(offload, name), kw, {}, p0, grads)
    cls_t, cls_o = getattr(torch.optim, name), getattr(offload, name)
    for first, second in ((cls_o, cls_t), (cls_t, cls_o)):
        p = torch.nn.Parameter(p0.clone())
        opt = first([p], **kw)
        for g in grads[:3]:
            p.grad = g.clone()
            opt.step()
        nxt = second([p], **kw)
        nxt.load_state_dict(copy.deepcopy(opt.state_dict()))
        for g in grads[3:]:
            p.grad = g.clone()
            nxt.step()
        torch.testing.assert_close(p.detach(), ref.detach(), rtol=RTOL, atol=ATOL)


def _refusal(cls, kw, grad=None):
    p = torch.nn.Parameter(_p0(7))
    before = p.detach().clone()
    opt = cls([p], **kw)
    p.grad = grad if grad is not None else torch.sparse_coo_tensor([[3, 3]], [1.0, 2.0], (7,))
    with pytest.raises(Exception) as info:
        opt.step()
    assert torch.equal(_bits(p), _bits(before))  # refused before anything changed
    return info.value


@pytest.mark.parametrize("name,kw", [("Adagrad", dict(weight_decay=0.1)), ("Adagrad", dict(weight_decay=0.1, foreach=True)),
                                     ("Adagrad", dict(fused=True)), ("SGD", dict(lr=0.1, weight_decay=0.01)),
                                     ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                                     ("SGD", dict(lr=0.1, fused=True)), ("Adam", {}), ("AdamW", {})])
def test_refusals_are_torchs_own(name, kw):
    theirs = _refusal(getattr(torch.optim, name), kw)
    ours = _refusal(getattr(offload, name), kw)
    if name == "AdamW" and not _torch_compat.adamw_is_adam():  # torch 2.6's AdamW: its own words
        theirs = _refusal(torch.optim.Adam, kw)
    assert type(ours) is type(theirs) and str(ours) == str(theirs)


def test_lion_refuses_and_adagrad_refuses_a_zero_eps_over_a_zero_sum():
    assert "offload.Lion does not support sparse gradients" in str(_refusal(offload.Lion, {}))
    assert "eps=0" in str(_refusal(offload.Adagrad, dict(eps=0.0)))
    p = torch.nn.Parameter(_p0(7))  # a positive sum never gives 0/0: stepped
    opt = offload.Adagrad([p], eps=0.0, initial_accumulator_value=0.1)
    p.grad = torch.sparse_coo_tensor([[3]], [1.0], (7,))
    opt.step()
    assert torch.isfinite(p).all()


def test_stages_above_zero_are_refused_clearly():
    err = _refusal(offload.SGD, dict(lr=0.1, stage=1))
    assert isinstance(err, RuntimeError) and "stage 0 only" in str(err)


def test_a_sparse_grad_that_does_not_fit_its_param_is_a_type_error():
    opt = offload.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    p = opt.param_groups[0]["params"][0]
    for g in (torch.sparse_coo_tensor([[1]], [1.0], (5,)), torch.sparse_coo_tensor([[1]], [1.0], (4,), dtype=torch.float64)):
        with pytest.raises(TypeError, match="must match its param"):
            dense_grad(opt, opt.param_groups[0], p, g)


@pytest.mark.parametrize("name", ["SGD", "Adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_sparse_grad_steps_as_its_dense_equivalent_with_clipping(name, dtype):
    """max_grad_norm sees the coalesced grad (duplicates summed), and fp16/bf16 CPU params (the
    flat store) step too: bit for bit as the dense grad torch's to_dense() gives."""
    kw = dict(lr=0.1, max_grad_norm=0.5, **(dict(momentum=0.9) if name == "SGD" else {}))
    grads = [g.to(dtype) for g in _sparse_grads(33, 3, 5)]
    out, norms = [], []
    for dense in (False, True):
        p = torch.nn.Parameter(_p0(33).to(dtype))
        opt = getattr(offload, name)([p], **kw)
        for g in grads:
            p.grad = g.to_dense() if dense else g.clone()
            opt.step()
            norms.append(opt.last_grad_norm)
        out.append(p.detach().clone())
    assert torch.equal(_bits(out[0].float()), _bits(out[1].float()))
    assert norms[:3] == norms[3:]
    assert norms[0] == pytest.approx(float(grads[0].coalesce().to_dense().float().norm()), rel=1e-6)


@pytest.mark.parametrize("name,kw", [("SGD", dict(lr=0.05, momentum=0.9)), ("Adagrad", dict(lr=0.1))])
def test_grad_scaler_with_sparse_grads_as_torch(name, kw):
    """GradScaler checks the sparse grads' values for inf (torch's _unscale_grads_); the
    kernel unscales the dense equivalent. An inf in a sparse grad skips the step."""
    res = []
    for cls in (getattr(torch.optim, name), getattr(offload, name)):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(50, 9, sparse=True)
        opt, scaler = cls(emb.parameters(), **kw), torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i in range(4):
            opt.zero_grad()
            loss = emb(torch.tensor([1, 1, 4, 30])).pow(2).sum() * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        res.append((emb.weight.detach().clone(), scaler.get_scale()))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=RTOL, atol=ATOL)
    assert res[0][1] == res[1][1]


def test_the_grad_hook_path_leaves_a_sparse_grad_to_the_step(monkeypatch):
    """The flat store's post-accumulate-grad hook (CUDA params; here CPU ones through
    ``copy_cpu_grads``) copies no sparse grad: the step densifies it, as without the hook."""
    from offload.optim.flat.store import FlatState

    out = []
    for hooked in (False, True):
        monkeypatch.setattr(FlatState, "copy_cpu_grads", hooked)
        torch.manual_seed(2)
        emb = torch.nn.Embedding(40, 9, sparse=True).to(torch.bfloat16)
        opt = offload.Adagrad(emb.parameters(), lr=0.1, offload="cpu")
        for _ in range(3):
            opt.zero_grad()
            emb(torch.tensor([3, 3, 17])).float().pow(2).sum().backward()
            opt.step()
        out.append(emb.weight.detach().clone())
    assert torch.equal(_bits(out[0].float()), _bits(out[1].float()))
