"""Sparse grads are refused by the optimizers torch refuses them for, in their own words,
before anything changes (SGD and Adagrad step them: tests/test_sparse_grads.py)."""
import pytest
import torch

import offload


@pytest.mark.parametrize("cls,kw", [(offload.Lion, {}), (offload.AdamW, {}), (offload.Adam, {})])
def test_a_sparse_grad_is_refused_naming_the_optimizer(cls, kw):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = cls(emb.parameters(), **kw)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 3])).sum().backward()
    name = "Adam" if cls in (offload.Adam, offload.AdamW) else cls.__name__
    with pytest.raises(RuntimeError, match=f"{name} does not support sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)
