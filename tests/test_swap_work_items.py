"""The nvme store's work items (optim/swapped_params.py): a contiguous 1-D param or grad,
detached, is its own flat view (a view(-1) per tensor cost ~0.9 us each, twice per param per
step); n-D and non-contiguous ones are flattened as before. Each item reads and writes the
param's own memory."""
from __future__ import annotations

import torch

import offload


def _opt(tmp_path, ps):
    for k, p in enumerate(ps):
        p.grad = torch.full(p.shape, 0.01 * (k + 1))
    return offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path))


def _items(opt):
    st = opt._store
    return st._work([(opt._hyper(g, 1.0), [(p, p.grad, 1) for p in g["params"]]) for g in opt.param_groups])


def test_one_dimensional_params_and_grads_need_no_view(tmp_path, monkeypatch):
    ps = [torch.randn(64).requires_grad_() for _ in range(20)]
    opt = _opt(tmp_path, ps)
    views = []
    real = torch.Tensor.view
    monkeypatch.setattr(torch.Tensor, "view", lambda self, *a: views.append(a) or real(self, *a))
    items = _items(opt)
    monkeypatch.undo()
    assert views == []
    for i, p in enumerate(ps):
        it = items[i]
        assert it.out.dim() == 1 and it.out.data_ptr() == p.data_ptr() and it.out.numel() == 64
        assert it.grad.dim() == 1 and it.grad.data_ptr() == p.grad.data_ptr()
        assert not it.out.requires_grad
    opt.close()


def test_other_params_are_flattened_as_before(tmp_path):
    ps = [torch.randn(4, 8).requires_grad_(), torch.randn(6, 5).t().requires_grad_(), torch.randn(()).requires_grad_()]
    opt = _opt(tmp_path, ps)
    items = _items(opt)
    assert items[0].out.shape == (32,) and items[0].out.data_ptr() == ps[0].data_ptr()
    assert items[1].out.shape == (30,) and torch.equal(items[1].out, ps[1].detach().reshape(-1))
    assert items[1].out.data_ptr() != ps[1].data_ptr()  # a contiguous copy, written back after the step
    assert items[2].out.shape == (1,) and items[2].out.data_ptr() == ps[2].data_ptr()
    opt.close()


def test_a_range_inside_one_sub_group_is_split_without_spans(tmp_path, monkeypatch):
    from offload.optim.swapped_shards import SwappedShards

    ps = [torch.randn(64).requires_grad_() for _ in range(10)] + [torch.randn(3000).requires_grad_()]
    twin = [p.detach().clone().requires_grad_() for p in ps]
    opt = offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024)
    ref = offload.AdamW(twin, lr=1e-2)
    spans = []
    real = SwappedShards._spans
    monkeypatch.setattr(SwappedShards, "_spans", lambda self, *a: spans.append(a) or real(self, *a))
    for step in range(2):
        for k, (p, q) in enumerate(zip(ps, twin)):
            p.grad = torch.full(p.shape, 0.01 * (k + step + 1))
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
    assert spans == [(0, 640, 3640)] * 2  # the one param across sub-groups, once a step
    for p, q in zip(ps, twin):
        assert torch.equal(p, q)
    opt.close()
