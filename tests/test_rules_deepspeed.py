"""from_deepspeed_config maps DeepSpeed's optimizer types Adagrad, Lion and SGD to
offload.Adagrad / Lion / SGD, with the defaults of the class DeepSpeed would build."""
import pytest
import torch

import offload
from offload.integrations.deepspeed import deepspeed_kwargs


@pytest.mark.parametrize("kind, params, cls, want", [
    ("Adagrad", {"lr": 0.05, "eps": 1e-8}, offload.Adagrad, {"lr": 0.05, "eps": 1e-8}),
    ("adagrad", {"initial_accumulator_value": 0.1, "lr_decay": 0.01}, offload.Adagrad,
     {"initial_accumulator_value": 0.1, "lr_decay": 0.01}),
    ("Lion", {}, offload.Lion, {"lr": 1e-3, "betas": (0.9, 0.999)}),  # DeepSpeedCPULion's defaults
    ("LION", {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}, offload.Lion,
     {"lr": 3e-4, "betas": (0.95, 0.98), "weight_decay": 0.1}),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, offload.SGD,
     {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
])
def test_other_types_map_to_their_classes(kind, params, cls, want):
    config = {"optimizer": {"type": kind, "params": params}, "gradient_clipping": 1.0}
    got_cls, kwargs = deepspeed_kwargs(config)
    assert got_cls is cls
    assert {k: kwargs[k] for k in want} == want
    assert kwargs["max_grad_norm"] == 1.0
    p = torch.nn.Parameter(torch.zeros(4))
    opt = offload.from_deepspeed_config(config, [p])
    assert type(opt) is cls
    for k, v in want.items():
        assert opt.param_groups[0][k] == v


def test_other_types_refuse_adam_keys():
    with pytest.raises(ValueError, match=r"optimizer\.params\.eps: unknown key"):
        deepspeed_kwargs({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "eps": 1e-8}}})
