"""Sparse grads are refused by every optimizer in its own words, before anything changes."""
import pytest
import torch

import offload


@pytest.mark.parametrize("cls,kw", [(offload.SGD, dict(lr=0.1, momentum=0.9)), (offload.Adagrad, {}),
                                    (offload.Lion, {}), (offload.AdamW, {})])
def test_a_sparse_grad_is_refused_naming_the_optimizer(cls, kw):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = cls(emb.parameters(), **kw)
    before = emb.weight.detach().clone()
    emb(torch.tensor([1, 3])).sum().backward()
    name = "Adam" if cls is offload.AdamW else cls.__name__
    with pytest.raises(RuntimeError, match=f"{name} does not support sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before)
