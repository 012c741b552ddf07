"""Adagrad's filled ``sum`` at construction is made one param at a time: where the store
keeps it in another form (compressed states, the flat master's store, swap files), no more
than one param's float32 sum is alive at once. Made for every param before the store took
them, a 24M-param model built with int8 states on NVMe peaked 196 MiB for 14 MiB of states,
and a model too large for RAM could not be built."""
import sys
import weakref

import pytest
import torch

import offload

# every one compressed where states are (tensors under 4096 elements keep float32 states,
# which are then the states themselves)
SIZES = (4097, 8193, 4096, 5003)
CASES = [  # (param dtype, offload, state_dtype)
    (torch.float32, "cpu", "bfloat16"),
    (torch.float32, "cpu", "int8"),
    (torch.float32, "nvme", "float32"),
    (torch.float32, "nvme", "int8"),
    (torch.bfloat16, "cpu", "float32"),
    (torch.bfloat16, "nvme", "int8"),
]


@pytest.mark.parametrize("dtype,where,state_dtype", CASES)
def test_one_float32_sum_alive_at_a_time(tmp_path, monkeypatch, dtype, where, state_dtype):
    made = []
    full_like = torch.full_like

    def tracked(*args, **kwargs):  # every float32 tensor Adagrad makes full of its value
        t = full_like(*args, **kwargs)
        if t.dtype == torch.float32 and sys._getframe(1).f_globals["__name__"] == "offload.optim.adagrad":
            alive = [r for r in made if r() is not None]
            assert not alive, f"{len(alive)} float32 sums still alive when the next is made"
            made.append(weakref.ref(t))
        return t

    monkeypatch.setattr(torch, "full_like", tracked)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in SIZES]
    kw = dict(swap_dir=str(tmp_path)) if where == "nvme" else {}
    opt = offload.Adagrad(params, lr=0.1, initial_accumulator_value=0.25, offload=where,
                          state_dtype=state_dtype, **kw)
    # the host store (fp32 CPU params) encodes its compressed sums from one block, the
    # others import a float32 sum per param
    assert len(made) == (0 if dtype == torch.float32 and where == "cpu" else len(params))
    monkeypatch.undo()
    # and the sums are the fill, as torch's constructor makes them
    ref = torch.optim.Adagrad([torch.nn.Parameter(p.detach().float()) for p in params], lr=0.1,
                              initial_accumulator_value=0.25)
    sd = opt.state_dict()["state"]
    for i, q in enumerate(ref.param_groups[0]["params"]):
        got = sd[i]["sum"]
        want = ref.state[q]["sum"]
        assert torch.equal(got.float(), want), (p.numel(), got.flatten()[:4])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.close()
