"""Checkpoints of a rule that keeps no state per element (SGD without momentum): the manifest
holds no files, only the steps and the param_groups, in every store that runs such a rule."""
import os

import pytest
import torch

import offload

# (offload, stage, param dtype): stage 0 host stores, and the flat store (bf16 params: a
# master per param; stage 1 fp32), on the host and swapped to NVMe
STORES = [("none", None, torch.float32), ("cpu", None, torch.float32), ("cpu", None, torch.bfloat16),
          ("cpu", 1, torch.float32), ("nvme", None, torch.bfloat16)]
IDS = ["none", "cpu", "flat-bf16", "flat-stage1", "nvme-flat-bf16"]
SIZES = [1, 7, 4097]


def _kw(offl, stage, tmp_path):
    kw = {"offload": offl}
    if stage is not None:
        kw["stage"] = stage
    if offl == "nvme":
        os.makedirs(tmp_path / "swap", exist_ok=True)
        kw["swap_dir"] = str(tmp_path / "swap")
    return kw


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g).to(dtype) for n in SIZES]


def _train(opt, params, steps, dtype, first=0):
    for s in range(first, first + steps):
        for p, g in zip(params, _grads(s, dtype)):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("offl,stage,dtype", STORES, ids=IDS)
def test_stateless_sgd_saves_and_loads_its_steps_and_groups(tmp_path, offl, stage, dtype):
    ps = _params(dtype)
    opt = offload.SGD(ps, lr=0.05, weight_decay=0.01, **_kw(offl, stage, tmp_path))
    _train(opt, ps, 3, dtype)
    opt.save_checkpoint(str(tmp_path / "ck"))
    # a new optimizer of other hyperparameters, params as they were at the save
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    new = offload.SGD(qs, lr=0.9, weight_decay=0.0, **_kw(offl, stage, tmp_path / "b"))
    new.load_checkpoint(str(tmp_path / "ck"))
    assert new.param_groups[0]["lr"] == 0.05 and new.param_groups[0]["weight_decay"] == 0.01
    # both go on: the loaded one must step exactly as the one that saved
    _train(opt, ps, 3, dtype, first=3)
    _train(new, qs, 3, dtype, first=3)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(q.detach().float(), p.detach().float(), rtol=1e-5, atol=1e-6)
    opt.close()
    new.close()


@pytest.mark.parametrize("offl", ["none", "cpu"])
def test_stateless_manifest_records_the_steps(tmp_path, offl):
    from offload.swap.ckpt_dir import read_manifest

    ps = _params(torch.float32)
    opt = offload.SGD(ps, lr=0.05, offload=offl)
    _train(opt, ps, 2, torch.float32)
    opt.save_checkpoint(str(tmp_path / "ck"))
    m = read_manifest(str(tmp_path / "ck" / "rank0"))
    assert m["states"] == [] and m["files"] == {} and m["meta"]["steps"] == [2, 2, 2]
    assert sorted(os.listdir(tmp_path / "ck" / "rank0")) == ["offload-ckpt.json", "offload-ckpt.lock"]


@pytest.mark.parametrize("offl,stage,dtype", STORES, ids=IDS)
def test_stateless_checkpoint_into_sgd_with_momentum_is_refused_clearly(tmp_path, offl, stage, dtype):
    ps = _params(dtype)
    opt = offload.SGD(ps, lr=0.05, **_kw(offl, stage, tmp_path))
    _train(opt, ps, 1, dtype)
    opt.save_checkpoint(str(tmp_path / "ck"))
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    new = offload.SGD(qs, lr=0.05, momentum=0.9, **_kw(offl, stage, tmp_path / "b"))
    # the host stores save no state at all; the flat store its master, next to which momentum needs more
    theirs = r"master \(float32\): the flat" if dtype != torch.float32 or stage else r"no state \(a rule that keeps none"
    with pytest.raises(ValueError, match=rf"holds {theirs}.*keeps .*momentum_buffer.*load_state_dict\(\)"):
        new.load_checkpoint(str(tmp_path / "ck"))
    opt.close()
    new.close()


def test_the_state_dict_route_starts_momentum_from_the_first_grad_as_torch(tmp_path):
    # what the refusal suggests: a stateless optimizer's state_dict() into one with momentum
    ps = _params(torch.float32)
    opt = offload.SGD(ps, lr=0.05, offload="cpu")
    _train(opt, ps, 2, torch.float32)
    sd = opt.state_dict()
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    rs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    new = offload.SGD(qs, lr=0.05, momentum=0.9, dampening=0.5, offload="cpu")
    ref = torch.optim.SGD(rs, lr=0.05, momentum=0.9, dampening=0.5)
    new.load_state_dict(sd)
    ref.load_state_dict(torch.optim.SGD([torch.nn.Parameter(p.detach().clone()) for p in ps], lr=0.05).state_dict())
    for g in (new.param_groups[0], ref.param_groups[0]):
        g["momentum"], g["dampening"] = 0.9, 0.5
    _train(new, qs, 4, torch.float32, first=2)
    _train(ref, rs, 4, torch.float32, first=2)
    for q, r in zip(qs, rs):
        torch.testing.assert_close(q.detach(), r.detach(), rtol=1e-5, atol=1e-6)


def _stage3(lr, momentum=0.0):
    torch.manual_seed(0)
    model = offload.shard(torch.nn.Sequential(torch.nn.Linear(7, 17), torch.nn.Linear(17, 3)))
    return model, offload.SGD(model.parameters(), lr=lr, momentum=momentum)


def _fwd_bwd(model, opt, seed):
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    opt.zero_grad()


def test_stage3_stateless_sgd_saves_and_loads(tmp_path):
    from offload.shard import load_checkpoint, save_checkpoint

    model, opt = _stage3(0.05)
    for s in range(2):
        _fwd_bwd(model, opt, s)
    save_checkpoint(model, opt, str(tmp_path / "s3"))
    m2, o2 = _stage3(0.9)
    load_checkpoint(m2, o2, str(tmp_path / "s3"))
    assert o2.param_groups[0]["lr"] == 0.05
    for s in range(2, 4):
        _fwd_bwd(model, opt, s)
        _fwd_bwd(m2, o2, s)
    ours, theirs = m2.state_dict(), model.state_dict()  # the flat shard: every param's elements
    assert list(ours) == list(theirs) and sum(t.numel() for t in ours.values()) >= 7 * 17 + 17 + 17 * 3 + 3
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-5, atol=1e-6)
