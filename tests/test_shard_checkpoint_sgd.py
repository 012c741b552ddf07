"""Stage 3 checkpoints of offload.SGD with momentum (fuzzer seed 135): the checkpoint holds
SGD's torch layout, whose entries have a ``momentum_buffer`` and no ``"step"`` (float32 and
int8 states; bf16 states keep theirs), which ``SGD.load_state_dict`` takes as one step
taken; ``load_checkpoint`` checked the dict before that translation and refused every such
checkpoint ("state[0] has moments but no 'step'"). Now it loads, and the run goes on bit for
bit as the uninterrupted one. One process (a world of 1), as offload.shard runs without
torch.distributed."""
from __future__ import annotations

import pytest
import torch

import offload
from offload.shard import load_checkpoint, runtime_of, save_checkpoint


class Unit(torch.nn.Module):
    def __init__(self, v):
        super().__init__()
        self.w = torch.nn.Parameter(v)

    def forward(self, c):
        return (self.w.float() * c).sum()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.units = torch.nn.ModuleList(Unit(torch.randn(n, generator=g)) for n in (17, 4097))

    def forward(self, step):
        g = torch.Generator().manual_seed(100 + step)
        return sum(u(torch.randn(u.w.shape, generator=g)) for u in self.units)


def _build(state_dtype, store, tmp_path, tag):
    model = offload.shard(Net(), unit={Unit})
    kw = {}
    if store == "nvme":
        (tmp_path / f"swap-{tag}").mkdir()
        kw["swap_dir"] = str(tmp_path / f"swap-{tag}")
    opt = offload.SGD(model.parameters(), lr=0.1, momentum=0.5, dampening=0.1, weight_decay=0.01, offload=store,
                      state_dtype=state_dtype, **kw)
    return model, opt


def _train(model, opt, start, stop):
    for step in range(start, stop):
        model(step).backward()
        opt.step()
        opt.zero_grad()


def _values(model, opt):
    shards = [f.shard for u in runtime_of(model).units for f in u.flats]
    return [f.detach().clone() for f in shards] + [opt.state[p]["momentum_buffer"].detach().clone() for p in shards]


@pytest.mark.parametrize("state_dtype,store", [("float32", "none"), ("int8", "nvme"), ("int8", "cpu")])
def test_sgd_momentum_checkpoint_loads_and_goes_on_as_uninterrupted(tmp_path, state_dtype, store):
    d = str(tmp_path / "ckpt")
    model, opt = _build(state_dtype, store, tmp_path, "a")
    _train(model, opt, 0, 2)
    save_checkpoint(model, opt, d)
    _train(model, opt, 2, 4)
    want = _values(model, opt)
    opt.close()
    model, opt = _build(state_dtype, store, tmp_path, "b")
    load_checkpoint(model, opt, d)
    assert all("momentum_buffer" in e for e in opt.state_dict()["state"].values())
    _train(model, opt, 2, 4)
    got = _values(model, opt)
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
