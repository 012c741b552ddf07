"""What a user may do to ``opt.state[p]`` and ``param_groups`` when the states live in a store:
refusals that name what to do instead, and no silent divergence from torch when one state of
a param is deleted (the flat store ignored the delete and put its view back at the next step,
so SGD went on with its old momentum where torch's restarts it; a swapped entry raised a bare
KeyError)."""
import pytest
import torch

import offload


def test_nvme_with_only_empty_groups_says_what_to_do(tmp_path):
    torch.optim.AdamW([{"params": []}])  # torch takes it
    with pytest.raises(ValueError) as exc:
        offload.AdamW([{"params": []}], offload="nvme", swap_dir=str(tmp_path))
    msg = str(exc.value)
    assert "SwappedState" not in msg and "offload='nvme'" in msg and "constructor" in msg


def test_nvme_reordered_groups_message_says_reordered(tmp_path):
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(4))
    opt = offload.AdamW([{"params": [a]}, {"params": [b]}], offload="nvme", swap_dir=str(tmp_path))
    try:
        opt.param_groups.reverse()
        a.grad, b.grad = torch.ones(8), torch.ones(4)
        with pytest.raises(RuntimeError, match="another order"):
            opt.step()
        opt.param_groups.reverse()
        opt.step()  # back in order: steps
    finally:
        opt.close()


def _stepped_sgd(store, tmp_path):
    """(dtype, p, SGD with momentum over p, stepped once) for each store-held case: bf16
    params (the flat store in RAM; swap files with "nvme") and fp32 ones with "nvme" (swap
    files); fp32 in RAM is the host store, whose opt.state is torch's own dict."""
    for dtype in (torch.bfloat16, torch.float32):
        if dtype == torch.float32 and store != "nvme":
            continue
        p = torch.nn.Parameter(torch.randn(64).to(dtype))
        d = tmp_path / str(dtype)
        d.mkdir()
        kw = dict(offload=store, swap_dir=str(d)) if store == "nvme" else dict(offload=store)
        opt = offload.SGD([p], lr=0.1, momentum=0.9, **kw)
        p.grad = torch.ones(64, dtype=dtype)
        opt.step()
        yield dtype, p, opt


@pytest.mark.parametrize("store", ["none", "cpu", "nvme"])
def test_del_one_state_of_a_store_param_is_refused_not_ignored(store, tmp_path):
    for dtype, p, opt in _stepped_sgd(store, tmp_path):
        try:
            before = opt.state_dict()["state"][0]["momentum_buffer"].clone()
            with pytest.raises(NotImplementedError, match=r"del opt.state\[p\]"):
                del opt.state[p]["momentum_buffer"]
            with pytest.raises(NotImplementedError, match=r"del opt.state\[p\]"):
                opt.state[p].pop("momentum_buffer")
            assert torch.equal(opt.state[p]["momentum_buffer"].float(), before)  # nothing dropped
            del opt.state[p]  # the whole entry: starts afresh, as torch's
            p.grad = torch.full((64,), 2.0, dtype=dtype)
            opt.step()
            assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], torch.full((64,), 2.0))
        finally:
            opt.close()


@pytest.mark.parametrize("store", ["none", "cpu", "nvme"])
def test_update_of_a_store_held_state_writes_the_store(store, tmp_path):
    # dict's update and |= bypass __setitem__: the flat store's view was replaced in the dict
    # and the store kept its values (the next step put the view back and went on from them)
    for dtype, p, opt in _stepped_sgd(store, tmp_path):
        try:
            opt.state[p].update({"momentum_buffer": torch.zeros(64)})
            assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], torch.zeros(64))
            opt.state[p] |= {"momentum_buffer": torch.full((64,), 0.25)}
            assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], torch.full((64,), 0.25))
            assert torch.equal(opt.state[p].setdefault("momentum_buffer", torch.ones(64)).float().reshape(-1),
                               torch.full((64,), 0.25))
        finally:
            opt.close()


@pytest.mark.parametrize("store", ["none", "cpu"])
def test_popitem_of_a_store_held_view_is_refused(store):
    p = torch.nn.Parameter(torch.randn(64).bfloat16())
    opt = offload.Adam([p], lr=0.1, offload=store)
    try:
        p.grad = torch.ones(64, dtype=torch.bfloat16)
        opt.step()
        last = next(reversed(opt.state[p].keys()))
        assert last == "master"  # (the fp32 master of a bf16 param is the store's too)
        with pytest.raises(NotImplementedError, match=r"popitem"):
            opt.state[p].popitem()
        assert last in opt.state[p]
    finally:
        opt.close()
