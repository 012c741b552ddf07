"""rule_step takes a rule by name ("sgd") as by object, on the float32 path of every backend
(a name once fell through to the compressed path: NotImplementedError on native and numba)."""
from __future__ import annotations

import pytest
import torch

from offload.kernels import get_backend
from offload.kernels.fields import RULES

HYPER = {"adam": dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True),
         "sgd": dict(lr=1e-2, momentum=0.9, weight_decay=1e-4),
         "adagrad": dict(lr=1e-2, weight_decay=1e-4),
         "lion": dict(lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01)}


def available():
    out = []
    for name in ("native", "numba", "torch"):
        try:
            get_backend(name)
        except RuntimeError:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("backend", available())
@pytest.mark.parametrize("rule", sorted(HYPER))
def test_rule_by_name_equals_rule_by_object(backend, rule):
    be = get_backend(backend)
    r = RULES[rule]
    torch.manual_seed(0)
    p0, g = torch.randn(4097), torch.randn(4097)
    s0 = {f.name: torch.rand(4097) * 1e-2 for f in r.fields}  # >= 0: valid for Adagrad's sum
    outs = []
    for which in (rule, r):
        p, st = p0.clone(), {k: v.clone() for k, v in s0.items()}
        be.rule_step(which, p, g, st, step=2, **HYPER[rule])
        outs.append((p, st))
    (pa, sa), (pb, sb) = outs
    assert torch.equal(pa, pb) and not torch.equal(pa, p0)
    for k in sa:
        assert torch.equal(sa[k], sb[k])


def test_unknown_name_is_a_value_error():
    with pytest.raises(ValueError, match="unknown optimizer rule 'adamx'"):
        get_backend("torch").rule_step("adamx", torch.zeros(3), torch.zeros(3), {}, step=1, lr=1.0)
