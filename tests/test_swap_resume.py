"""resume=True: damaged manifests, which directory is whose, the layout kept across budgets,
truncated slot files, and models whose params have no elements."""
from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from offload.swap import SwapLayout, SwapStore
from offload.swap.cleanup import clean_dir
from test_swap_util import run_python
from _no_hang import within
from offload.io import NotRegularFile
import _internals as internals
from offload.swap import fsutil

NAMES = ["exp_avg", "exp_avg_sq"]
HP = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


def _store(d, **kw):
    return SwapStore(str(d), SwapLayout(5000, 2048, 2), state_names=NAMES, **kw)


def _left_store(d, verify=True):
    """A directory with a committed step (two sub-groups written), left unlocked."""
    st = _store(d, verify=verify)
    st.commit({0: [[0], [0]], 1: [[1], [1]]}, {"steps": [1]})
    path = st.path
    st.close(remove=False)
    return os.path.join(path, "manifest.json")


def _edit(path, fn):
    """A manifest damaged by its writer, not after it: sealed again (a change after the seal
    fails the seal first: test_swap_manifest_seal.py)."""
    m = json.load(open(path))
    fn(m)
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m), f)


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.pop("slots"), "slots is missing"),
    (lambda m: m.pop("step"), "step is missing"),
    (lambda m: m.pop("extra"), "extra is missing"),
    (lambda m: m.__setitem__("slots", [0, 1]), "slots has 2 entries for 3 sub-groups"),
    (lambda m: m["slots"].__setitem__(1, 7), r"slots\[1\] must be 0 or 1, got 7"),
    (lambda m: m["valid"].__setitem__(0, "yes"), r"valid\[0\] must be true or false"),
    (lambda m: m.__setitem__("step", -1), r"step must be in \[0, 2147483647\], got -1"),
    (lambda m: m.__setitem__("step", "3"), "step must be an integer"),
    (lambda m: m.__setitem__("ranges", [[0, 2048], [2048, 4096], 5]), r"ranges\[2\] must be"),
    (lambda m: m["checksums"].__setitem__("9", [[0], [0]]), "names no sub-group"),
    (lambda m: m["checksums"]["0"].__setitem__(1, [1, 2]), r"checksums\['0'\]\[1\] must be 1 crc32"),
    (lambda m: m.__setitem__("identity", 5), "identity must be an object"),
])
def test_damaged_manifest_is_refused_naming_the_field(tmp_path, edit, field):
    path = _left_store(tmp_path)
    _edit(path, edit)
    with pytest.raises(ValueError, match=field) as e:
        _store(tmp_path, resume=True, verify=True)
    assert path in str(e.value) and "damaged swap manifest" in str(e.value)
    assert os.path.exists(path)  # a refused resume deletes nothing
    clean_dir(str(tmp_path))


def _fp32_left(tmp_path, steps=2):
    torch.manual_seed(0)
    p = torch.randn(3000, requires_grad=True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **HP)
    for k in range(steps):
        p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(k))
        opt.step()
    swap_dir = internals.leave_swap_as_killed(opt)  # as if killed after the last step
    return p.detach().clone(), os.path.join(swap_dir, "manifest.json")


@pytest.mark.parametrize("steps, msg", [([1], "has 1 step counts for 2 params"),
                                        ([1, "x"], r"extra.steps\[1\] must be an integer"),
                                        ([1, 2**40], r"extra.steps\[1\] must be an integer in \[0, 2147483647\]"),
                                        (None, "extra.steps is missing")])
def test_damaged_step_counts_are_refused(tmp_path, steps, msg):
    torch.manual_seed(0)
    a, b = torch.randn(3000, requires_grad=True), torch.randn(10, requires_grad=True)
    opt = offload.AdamW([a, b], offload="nvme", swap_dir=str(tmp_path), **HP)
    a.grad, b.grad = torch.ones(3000), torch.ones(10)
    opt.step()
    path = os.path.join(internals.leave_swap_as_killed(opt), "manifest.json")
    _edit(path, lambda m: m["extra"].__setitem__("steps", steps) if steps else m["extra"].pop("steps"))
    with pytest.raises(ValueError, match=msg):
        offload.AdamW([a, b], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    clean_dir(str(tmp_path))


# Two models of the same size, other shapes, one optimizer each on one swap_dir; killed
# after two steps. The resumed process builds them in the other order.
_TWO = """
import os, signal, sys, torch, offload
dtype = getattr(torch, sys.argv[2])
a = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)
b = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_(True)
oa = offload.AdamW([a], offload="nvme", swap_dir=sys.argv[1], lr=1e-2)
ob = offload.AdamW([b], offload="nvme", swap_dir=sys.argv[1], lr=1e-2)
for k in range(2):
    for p, o, s in ((a, oa, 10), (b, ob, 20)):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s + k)).to(dtype)
        o.step()
torch.save({"a": a.detach(), "b": b.detach()}, os.path.join(sys.argv[1], "params.pt"))
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_optimizers_resumed_in_the_other_order_find_their_own_states(tmp_path, dtype):
    proc = run_python(_TWO, str(tmp_path), dtype)
    out, err = proc.communicate(timeout=120)
    assert out.strip() == "saved", err
    saved = torch.load(tmp_path / "params.pt")
    os.unlink(tmp_path / "params.pt")
    dt = getattr(torch, dtype)
    a = saved["a"].clone().requires_grad_(True)
    b = saved["b"].clone().requires_grad_(True)
    ob = offload.AdamW([b], offload="nvme", swap_dir=str(tmp_path), lr=1e-2, resume=True)  # b first now
    oa = offload.AdamW([a], offload="nvme", swap_dir=str(tmp_path), lr=1e-2, resume=True)
    # reference: uninterrupted runs, states in RAM
    ra = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).to(dt).requires_grad_(True)
    rb = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)).to(dt).requires_grad_(True)
    ora, orb = offload.AdamW([ra], offload="cpu", lr=1e-2), offload.AdamW([rb], offload="cpu", lr=1e-2)
    for k in range(3):
        for p, o, s, resumed in ((ra, ora, 10, False), (rb, orb, 20, False), (a, oa, 10, True), (b, ob, 20, True)):
            if resumed and k < 2:
                continue
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(s + k)).to(dt)
            o.step()
    for p, q, o, oref in ((a, ra, oa, ora), (b, rb, ob, orb)):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
        sa, sr = o.state_dict()["state"][0], oref.state_dict()["state"][0]
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sa[key], sr[key], rtol=1e-5, atol=1e-6)
        assert int(sa["step"]) == 3
    for o in (oa, ob, ora, orb):
        o.close()
    assert os.listdir(tmp_path) == []


def test_resume_with_params_of_no_directory_is_refused_naming_both(tmp_path):
    _fp32_left(tmp_path)
    q = torch.randn(50, 60, requires_grad=True)
    with pytest.raises(ValueError, match=r"holds the states of other params \(1 fp32 params, 3000 elements\)"):
        offload.AdamW([q], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    clean_dir(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_keeps_the_layout_whatever_the_budget(tmp_path, dtype):
    """Written with sub_group_size=1024 (from a small budget); resumed with the default budget
    (which would pick another size) it uses the manifest's layout."""
    torch.manual_seed(0)
    init = torch.randn(300_000).to(dtype)
    p = init.clone().requires_grad_(True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), max_host_bytes=48 << 10, **HP)
    p.grad = torch.ones_like(p)
    opt.step()
    assert internals.swap(opt).layout.sub_group_size == 1024
    internals.leave_swap_as_killed(opt)
    q = p.detach().clone().requires_grad_(True)
    if dtype == torch.bfloat16:
        q = init.clone().requires_grad_(True)  # the flat store rewrites the params from the swap files
    opt2 = offload.AdamW([q], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    assert internals.swap(opt2).layout.sub_group_size == 1024
    assert torch.equal(q.detach(), p.detach())
    assert int(opt2.state_dict()["state"][0]["step"]) == 1
    nstates = 2 if dtype == torch.float32 else 3
    need = 3 * nstates * 4096  # three buffers of one sub-group of 1024 elements
    with pytest.raises(ValueError, match=f"written with sub_group_size=1024: pass max_host_bytes >= {need} "):
        offload.AdamW([q], offload="nvme", swap_dir=str(tmp_path), resume=True, max_host_bytes=need - 1, **HP)
    opt2.close()
    assert os.listdir(tmp_path) == []


def test_truncated_slot_files_say_their_data_is_lost(tmp_path):
    _, manifest = _fp32_left(tmp_path)
    d = os.path.dirname(manifest)
    for name in ("slot0.bin", "slot1.bin"):
        os.truncate(os.path.join(d, name), 0)
    p = torch.randn(3000, requires_grad=True)
    with pytest.raises(ValueError, match="truncated to 0 of .* bytes: the states of step 2 it held are lost") as e:
        offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    assert "still hold" not in str(e.value)
    clean_dir(str(tmp_path))


def test_a_larger_slot_file_is_refused(tmp_path):
    # Another run's larger slot0.bin (a bigger layout, or float32 states where bfloat16 were)
    # resumed silently with verify=False, its bytes taken for the moments; a smaller one was
    # refused. The slots are preallocated to exactly the layout's size.
    _, manifest = _fp32_left(tmp_path)
    slot = os.path.join(os.path.dirname(manifest), "slot0.bin")
    size = os.path.getsize(slot)
    os.truncate(slot, size + 4096)
    p = torch.randn(3000, requires_grad=True)
    with pytest.raises(ValueError, match=f"swap file of {size + 4096} bytes, expected {size}") as e:
        offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    assert str(e.value).startswith(slot)
    clean_dir(str(tmp_path))


def test_deleted_slot_file_says_its_data_is_lost(tmp_path):
    _, manifest = _fp32_left(tmp_path)
    d = os.path.dirname(manifest)
    os.unlink(os.path.join(d, "slot1.bin"))
    p = torch.randn(3000, requires_grad=True)
    with pytest.raises(FileNotFoundError, match="swap file missing: the states of step 2 it held are lost") as e:
        offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), resume=True, **HP)
    assert e.value.filename == os.path.join(d, "slot1.bin")
    assert os.path.exists(manifest)  # the failed resume removed nothing: `offload clean` decides
    clean_dir(str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_truncated_while_running_says_the_data_is_lost(tmp_path, dtype):
    p = torch.randn(3000).to(dtype).requires_grad_(True)
    opt = offload.AdamW([p], offload="nvme", swap_dir=str(tmp_path), **HP)
    p.grad = torch.ones_like(p)
    opt.step()
    d = os.path.join(tmp_path, os.listdir(tmp_path)[0])
    for name in ("slot0.bin", "slot1.bin"):
        os.truncate(os.path.join(d, name), 0)
    with pytest.raises(OSError, match="truncated to 0 of .* the states of step 1 in it are lost") as e:
        opt.step()
    assert "still hold" not in str(e.value)
    opt.close()


def test_close_keep_swap_of_a_stateless_nvme_sgd(tmp_path):
    """SGD without momentum over fp32 params with offload="nvme" steps in place and writes no
    swap file (the host store): close(keep_swap=True), as for every nvme optimizer, must not
    raise TypeError."""
    import offload as _offload
    p = torch.nn.Parameter(torch.randn(8192))
    opt = _offload.SGD([p], lr=1e-2, state_dtype="bfloat16", offload="nvme", swap_dir=str(tmp_path))
    p.grad = torch.randn(8192)
    opt.step()
    opt.close(keep_swap=True)


@pytest.mark.parametrize("name", ["manifest.json", "reserve.bin", "slot0.bin", "lock"])
def test_a_fifo_in_a_swap_files_place_is_refused_at_once_naming_it(tmp_path, name):
    """A FIFO manifest.json or reserve.bin blocked resume=True forever ([Note: a FIFO where a
    file was] in offload/io/files.py); the reserve's warning swallowed the alarm that ended it."""
    path = os.path.join(os.path.dirname(_left_store(tmp_path)), name)
    os.unlink(path)
    os.mkfifo(path)
    with within(5), pytest.raises(NotRegularFile, match=r"not a regular file \(a FIFO\)") as e:
        _store(tmp_path, resume=True, verify=True)
    assert e.value.filename == path
    os.unlink(path)  # (clean_dir keeps a directory holding what is no file of ours)
    clean_dir(str(tmp_path))


def test_a_fifo_reserve_while_running_is_said_and_the_step_commits(tmp_path, caplog):
    """At a commit, past the manifest's rename, the reserve only warns: raising there undid in
    memory a step that was on disk."""
    st = _store(tmp_path)
    os.unlink(os.path.join(st.path, "reserve.bin"))
    os.mkfifo(os.path.join(st.path, "reserve.bin"))
    st._reserve.bytes = 0  # (as after a full disk took the room)
    with within(5):
        st.commit({0: None}, {"steps": [1]})
    assert st.step == 1 and "not a regular file (a FIFO)" in caplog.text
    os.unlink(os.path.join(st.path, "reserve.bin"))
    st.close()
