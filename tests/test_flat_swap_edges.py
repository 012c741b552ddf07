"""Edge cases of the flat store with ``offload="nvme"`` (fp32 master + moments in swap files).

Reference: the same optimizer with ``offload="cpu"`` (same kernel, same order of operations),
so params, masters, moments and steps must be equal bit for bit; where torch's own semantics
are the reference (a state_dict without state for a param), a fresh optimizer loaded from
the same dict. Odd sizes (0, 1, params spanning several sub-groups, a sub_group_size that
divides nothing), non-contiguous params, fp16 with GradScaler and an overflow, checkpoints
and state_dicts both ways, bad swap directories, a file system without O_DIRECT, ENOSPC,
and clean-up.
"""
from __future__ import annotations

import errno
import gc
import json
import os
import subprocess

import pytest
import torch
import torch.nn as nn

import offload
from offload.optim.flat_state import FlatState
from offload.swap import SwapStepError
from test_flat_swap import HP, _batch, _model, _nvme, assert_same, train
from test_swap_util import run_python
import _internals as internals

# Sizes that break SIMD tails and sub-groups: empty params, one-element params, a param larger
# than several sub-groups of 1024, non-contiguous ones (a transposed weight).
SIZES = [(1,), (0,), (5000,), (5, 7), (0, 4), (1,), (2049,), (3,)]
SUB = 1000  # rounded up to 1024 by the swap layer: divides none of the sizes or offsets


def _params(seed: int = 0, dtype=torch.bfloat16, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in sizes]


def _grads(params, step: int, without=()):
    """Deterministic grads for ``step``; params whose index is in ``without`` get none."""
    g = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad = None if i in without else grad


def _steps(opt):
    return {k: float(v["step"]) for k, v in opt.state_dict()["state"].items()}


def _assert_same(pa, oa, pb, ob):
    """Params, fp32 masters, moments and steps equal bit for bit."""
    for i, (p, q) in enumerate(zip(pa, pb)):
        assert torch.equal(p, q), i
        assert torch.equal(internals.master(oa, p), internals.master(ob, q)), i
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sorted(sa[k]) == sorted(sb[k]), k
        for key in sa[k]:
            assert torch.equal(sa[k][key], sb[k][key]), (k, key)


def _snapshot(params, opt):
    return ([p.detach().clone() for p in params], [internals.master(opt, p) for p in params], _steps(opt))


def _assert_snapshot(params, opt, snap):
    ps, ms, steps = snap
    assert all(torch.equal(p, q) for p, q in zip(params, ps))
    assert all(torch.equal(internals.master(opt, p), m) for p, m in zip(params, ms))
    assert _steps(opt) == steps


# ---------------------------------------------------------------------- odd sizes and options
def test_empty_one_element_and_multi_subgroup_params_equal_cpu(tmp_path):
    a, b = _params(), _params()
    oa = offload.AdamW(a, offload="cpu", sub_group_size=SUB, **HP)
    ob = offload.AdamW(b, offload="nvme", swap_dir=str(tmp_path), sub_group_size=SUB, **HP)
    assert internals.swap(ob).layout.num_groups == 7  # 7089 elements in sub-groups of 1024
    for s in range(4):
        without = (0, 6) if s % 2 else ()  # one-element and tail params skip some steps
        for ps, o in ((a, oa), (b, ob)):
            _grads(ps, s, without)
            o.step()
    _assert_same(a, oa, b, ob)
    assert _steps(ob)[0] == 2.0 and _steps(ob)[2] == 4.0
    ob.close()
    assert os.listdir(tmp_path) == []


def test_non_contiguous_params_bf16_and_fp32_equal_cpu(tmp_path):
    # Transposed weights: the store writes the updated values back through a copy.
    def build():
        g = torch.Generator().manual_seed(3)
        return [nn.Parameter(torch.randn(7, 300, generator=g).bfloat16().t()),
                nn.Parameter(torch.randn(40, generator=g).bfloat16()),
                nn.Parameter(torch.randn(9, 130, generator=g).t())]  # fp32: a second flat group
    a, b = build(), build()
    assert [p.is_contiguous() for p in b] == [False, True, False]
    oa = offload.AdamW(a, offload="cpu", **HP)
    ob = offload.AdamW(b, offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **HP)
    for s in range(3):
        for ps, o in ((a, oa), (b, ob)):
            _grads(ps, s)
            o.step()
    _assert_same(a, oa, b, ob)
    ob.close()


@pytest.mark.parametrize("cls,kw", [(offload.Adam, dict(weight_decay=0.05)),
                                    (offload.AdamW, dict(maximize=True, weight_decay=0.1))],
                         ids=["adam_coupled_wd", "adamw_maximize"])
def test_adam_coupled_weight_decay_and_maximize_equal_cpu(tmp_path, cls, kw):
    a, b = _model(), _model()

    def groups(m):  # two param groups with their own betas and eps
        second = list(m.out.parameters()) + list(m.norm.parameters())
        return [{"params": [p for p in m.parameters() if all(p is not q for q in second)]},
                {"params": second, "betas": (0.5, 0.9), "eps": 1e-3}]
    hp = dict(lr=2e-2, betas=(0.8, 0.95), eps=1e-7, **kw)
    oa = cls(groups(a), offload="cpu", **hp)
    ob = cls(groups(b), offload="nvme", swap_dir=str(tmp_path), sub_group_size=1024, **hp)
    train(a, oa, 0, 4)
    train(b, ob, 0, 4)
    assert_same(a, oa, b, ob)
    ob.close()


def test_fp16_grad_scaler_overflow_clip_and_scheduler(tmp_path):
    dt = torch.float16
    a, b = _model(dtype=dt), _model(dtype=dt)
    oa = offload.AdamW(a.parameters(), offload="cpu", max_grad_norm=0.05, **HP)
    ob = _nvme(b, tmp_path, sub_group_size=1024, max_grad_norm=0.05)
    runs = []
    for m, o in ((a, oa), (b, ob)):
        runs.append((m, o, torch.amp.GradScaler("cpu", init_scale=2.0 ** 12),
                     torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.5 * s))))
    for s in range(5):
        for m, o, scaler, sched in runs:
            loss = m(_batch(s, dt), use_side=s % 2 == 0).float().pow(2).mean()
            if s == 2:
                loss = loss * float("inf")  # overflow: the step must be skipped
                snap = _snapshot(list(m.parameters()), o)
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
            sched.step()
            o.zero_grad()
            if s == 2:
                assert o.last_step_skipped and o.skipped_steps == 1
                _assert_snapshot(list(m.parameters()), o, snap)
    assert runs[0][2].get_scale() == runs[1][2].get_scale()
    assert ob.param_groups[0]["lr"] == oa.param_groups[0]["lr"] == HP["lr"] * (1.0 / 3.5)
    assert_same(a, oa, b, ob)
    ob.close()


def test_hook_and_staging_path_with_grads_changed_in_place(tmp_path, monkeypatch):
    # The CUDA params' path run on the CPU (grad copies made by hooks, updated values through
    # the staging buffer): GradScaler.unscale_ and clip_grad_norm_ change the grads in place
    # after the hooks copied them. Reference: the plain cpu path, which reads p.grad itself.
    # (bf16: torch's unscale_ refuses fp16 grads.)
    dt = torch.bfloat16
    ref, m = _model(dtype=dt), _model(dtype=dt)
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    monkeypatch.setattr(FlatState, "copy_cpu_grads", True)
    monkeypatch.setattr(FlatState, "stage_cpu_params", True)
    opt = _nvme(m, tmp_path, sub_group_size=1024)
    assert internals.flat_groups(opt)[0].stage is not None and internals.flat_groups(opt)[0].host_grad is not None
    for model, o in ((ref, opt_ref), (m, opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for s in range(4):
            scaler.scale(model(_batch(s, dt), use_side=s % 2 == 0).float().pow(2).mean()).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.02)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
    assert_same(ref, opt_ref, m, opt)
    opt.close()


def test_zero_grad_keeping_zeros_and_frozen_params_equal_cpu(tmp_path):
    # set_to_none=False: params unused in a step have zero grads and are stepped (as torch).
    a, b = _model(), _model()
    assert not a.frozen.weight.requires_grad
    oa = offload.AdamW(a.parameters(), offload="cpu", **HP)
    ob = _nvme(b, tmp_path, sub_group_size=1024)
    for s in range(4):
        for m, o in ((a, oa), (b, ob)):
            m(_batch(s), use_side=s == 0).float().pow(2).mean().backward()
            o.step()
            o.zero_grad(set_to_none=False)
    assert_same(a, oa, b, ob)
    sd = ob.state_dict()["state"]
    names = [n for n, _ in b.named_parameters()]
    assert float(sd[names.index("side.weight")]["step"]) == 4.0  # a grad at step 0, zeros after: all count
    assert names.index("frozen.weight") not in sd
    ob.close()


# ---------------------------------------------------------------------- state_dict and checkpoints
def test_state_dict_moves_between_nvme_cpu_and_torch(tmp_path):
    full = _model()
    opt_full = offload.AdamW(full.parameters(), offload="cpu", **HP)
    train(full, opt_full, 0, 5)
    src = _model()
    opt_src = _nvme(src, tmp_path / "src", sub_group_size=1024)
    train(src, opt_src, 0, 3)
    sd = opt_src.state_dict()
    # torch.optim.AdamW on fp32 copies of the masters takes it as it is.
    masters = [nn.Parameter(internals.master(opt_src, p)) for p in src.parameters()]
    ref = torch.optim.AdamW(masters, foreach=False, **HP)
    ref.load_state_dict(sd)
    for i, p in enumerate(masters):
        if i in sd["state"]:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(ref.state[p][key], sd["state"][i][key]), (i, key)
    # nvme -> cpu and nvme -> nvme (other initial values, other sub-group size): continue.
    c, n = _model(seed=7), _model(seed=8)
    opt_c = offload.AdamW(c.parameters(), offload="cpu", **HP)
    opt_n = _nvme(n, tmp_path / "n", sub_group_size=2048)
    for m, o in ((c, opt_c), (n, opt_n)):
        m.load_state_dict(src.state_dict())
        o.load_state_dict(sd)
    for m, o in ((src, opt_src), (c, opt_c), (n, opt_n)):
        train(m, o, 3, 5)
        assert_same(full, opt_full, m, o)
    # torch -> nvme and torch -> cpu: no fp32 master in the dict, masters come from the params.
    tsd = ref.state_dict()
    x, y = _model(seed=1), _model(seed=1)
    opt_x = offload.AdamW(x.parameters(), offload="cpu", **HP)
    opt_y = _nvme(y, tmp_path / "y", sub_group_size=1024)
    opt_x.load_state_dict(tsd)
    opt_y.load_state_dict(tsd)
    train(x, opt_x, 3, 5)
    train(y, opt_y, 3, 5)
    assert_same(x, opt_x, y, opt_y)
    for o in (opt_src, opt_n, opt_y):
        o.close()


def test_load_state_dict_without_state_for_a_param_starts_it_fresh(tmp_path):
    # Roll back to a state_dict taken before `side` ever had a grad: as torch, `side` must
    # then have no state at all (step 0, zero moments), not the moments of the abandoned run.
    a = _model()
    opt_a = _nvme(a, tmp_path / "a", sub_group_size=1024)
    for s in range(2):
        a(_batch(s), use_side=False).float().pow(2).mean().backward()
        opt_a.step()
        opt_a.zero_grad()
    sd, params = opt_a.state_dict(), a.state_dict()
    sd = {"state": {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in sd["state"].items()},
          "param_groups": sd["param_groups"]}
    params = {k: v.clone() for k, v in params.items()}
    train(a, opt_a, 2, 4)  # side gets moments here
    b = _model()
    opt_b = _nvme(b, tmp_path / "b", sub_group_size=1024)
    for m, o in ((a, opt_a), (b, opt_b)):
        m.load_state_dict(params)
        o.load_state_dict(sd)
        train(m, o, 2, 4)
    assert_same(b, opt_b, a, opt_a)
    opt_a.close()
    opt_b.close()


def test_checkpoint_saved_twice_into_one_directory_then_rewound(tmp_path):
    ref = _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    train(ref, opt_ref, 0, 6)
    m = _model()
    opt = _nvme(m, tmp_path / "swap", sub_group_size=1024)
    ck = tmp_path / "ck"
    train(m, opt, 0, 2)
    opt.save_checkpoint(str(ck))
    train(m, opt, 2, 4)
    opt.save_checkpoint(str(ck))  # replaces the first
    man = json.load(open(ck / "rank0" / "offload-ckpt.json"))
    assert man["gen"] == 2 and man["meta"]["steps"][0] == 4
    assert sorted(os.listdir(ck / "rank0")) == sorted(["offload-ckpt.json", "offload-ckpt.lock"] + list(man["files"].values()))
    train(m, opt, 4, 5)
    opt.load_checkpoint(str(ck))  # back to step 4, after one more step
    assert max(float(st["step"]) for st in opt.state.values()) == 4
    train(m, opt, 4, 6)
    assert_same(ref, opt_ref, m, opt)
    opt.close()


def test_bad_checkpoints_are_refused_and_nothing_is_loaded(tmp_path):
    ref, m = _model(), _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    opt = _nvme(m, tmp_path / "swap", sub_group_size=1024)
    train(ref, opt_ref, 0, 4)
    train(m, opt, 0, 2)
    # A checkpoint of other params.
    other = nn.Linear(5, 3).bfloat16()
    opt_other = offload.AdamW(other.parameters(), offload="nvme", swap_dir=str(tmp_path / "swap"), **HP)
    other.weight.grad = torch.ones_like(other.weight)
    opt_other.step()
    opt_other.save_checkpoint(str(tmp_path / "other"))
    opt_other.close()
    snap = _snapshot(list(m.parameters()), opt)
    with pytest.raises(ValueError, match="not a flat-store checkpoint of these params"):
        opt.load_checkpoint(str(tmp_path / "other"))
    _assert_snapshot(list(m.parameters()), opt, snap)
    # A checkpoint of these params whose exp_avg_sq data was corrupted after saving.
    twin = _model(seed=4)
    opt_twin = offload.AdamW(twin.parameters(), offload="cpu", **HP)
    train(twin, opt_twin, 0, 3)
    opt_twin.save_checkpoint(str(tmp_path / "bad"))
    man = json.load(open(tmp_path / "bad" / "rank0" / "offload-ckpt.json"))
    path = tmp_path / "bad" / "rank0" / man["files"]["exp_avg_sq"]
    data = bytearray(path.read_bytes())
    data[4 * 2000 + 1] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(OSError, match="fails its crc32") as e:
        opt.load_checkpoint(str(tmp_path / "bad"))
    assert e.value.errno == errno.EIO and "exp_avg_sq" in e.value.filename
    _assert_snapshot(list(m.parameters()), opt, snap)
    train(m, opt, 2, 4)  # still works, from its own step 2
    assert_same(ref, opt_ref, m, opt)
    opt.close()


def test_checkpoint_of_params_without_elements(tmp_path):
    ps = [nn.Parameter(torch.zeros(0, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(3, 0, dtype=torch.bfloat16))]
    opt = offload.AdamW(ps, offload="nvme", swap_dir=str(tmp_path / "swap"), **HP)
    for p in ps:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ck"))
    opt.load_checkpoint(str(tmp_path / "ck"))
    assert _steps(opt) == {0: 1.0, 1: 1.0}
    opt.close()


# ---------------------------------------------------------------------- resume
_CHILD = r"""
import os, sys, torch, offload
from test_flat_swap import HP, _model, train
torch.set_num_threads(int(sys.argv[2]))
m = _model()
opt = offload.AdamW(m.parameters(), offload="nvme", swap_dir=sys.argv[1], sub_group_size=1024, verify=True, **HP)
train(m, opt, 0, 2)
os._exit(0)  # the directory stays, as after a crash between steps
"""


def _crashed_run(swap):
    swap.mkdir()
    p = run_python(_CHILD, str(swap), str(torch.get_num_threads()))
    assert p.wait() == 0, p.stderr.read()
    return swap / "offload-flat.rank0"


def test_verify_and_resume_continue_bit_exact(tmp_path):
    _crashed_run(tmp_path / "swap")
    ref = _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    train(ref, opt_ref, 0, 4)
    m = _model(seed=6)
    opt = _nvme(m, tmp_path / "swap", sub_group_size=1024, verify=True, resume=True)
    assert internals.swap(opt).store.verify and internals.swap(opt).store.checksums
    train(m, opt, 2, 4)
    assert_same(ref, opt_ref, m, opt)
    opt.close()
    assert os.listdir(tmp_path / "swap") == []


def test_failed_resume_keeps_the_swap_directory(tmp_path):
    d = _crashed_run(tmp_path / "swap")
    man = json.load(open(d / "manifest.json"))
    path = d / f"slot{man['slots'][1]}.bin"
    off = man["region_bytes"] + 100  # master of sub-group 1
    fd = os.open(path, os.O_RDWR)
    b = os.pread(fd, 1, off)
    os.pwrite(fd, bytes([b[0] ^ 0x04]), off)
    os.close(fd)
    with pytest.raises(OSError, match="checksum mismatch") as e:
        _nvme(_model(seed=6), tmp_path / "swap", sub_group_size=1024, verify=True, resume=True)
    del e
    gc.collect()
    assert sorted(os.listdir(d)) == ["lock", "manifest.json", "reserve.bin", "slot0.bin", "slot1.bin"]


# ---------------------------------------------------------------------- swap directories
def test_max_host_bytes_too_small_names_the_bytes(tmp_path):
    # 3142 elements in 4 sub-groups of 1024: 3 buffers of 3 x 4096 bytes are needed.
    with pytest.raises(ValueError, match=r"max_host_bytes=30000 cannot hold 3 pipeline buffers .* 12288 bytes "
                                         r"each, 36864 in all\); raise max_host_bytes to at least 36864"):
        _nvme(_model(), tmp_path, sub_group_size=1024, max_host_bytes="30000")
    assert os.listdir(tmp_path) == []


def test_max_host_bytes_at_the_minimum_equals_cpu(tmp_path):
    ref, m = _model(), _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    opt = _nvme(m, tmp_path, sub_group_size=1024, max_host_bytes=36864)
    assert len(internals.swap(opt).pipeline.buffers) == 3
    train(ref, opt_ref, 0, 3)
    train(m, opt, 0, 3)
    assert_same(ref, opt_ref, m, opt)
    opt.close()


def test_resume_without_a_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no swap directory to resume from") as e:
        _nvme(_model(), tmp_path, sub_group_size=1024, resume=True)
    assert e.value.filename == str(tmp_path / "offload-flat.rank0")
    assert os.listdir(tmp_path) == []


def test_bad_swap_dirs_are_clear_oserrors(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError, match="swap_dir does not exist") as e:
        offload.AdamW(_model().parameters(), offload="nvme", swap_dir=str(missing), **HP)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory") as e:
        offload.AdamW(_model().parameters(), offload="nvme", swap_dir=str(afile), **HP)
    assert e.value.filename == str(afile)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_unwritable_swap_dir_is_a_permission_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: a 0500 directory is writable")
        with pytest.raises(PermissionError, match="not writable") as e:
            offload.AdamW(_model().parameters(), offload="nvme", swap_dir=str(ro), **HP)
        assert e.value.errno == errno.EACCES and e.value.filename == str(ro)
    finally:
        os.chmod(ro, 0o700)


def _mount(tmp_path, name, *args):
    mnt = tmp_path / name
    mnt.mkdir()
    r = subprocess.run(["mount", *args, str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {args} here: {r.stderr.decode()[:200]}")
    return mnt


def test_read_only_file_system_is_a_clear_oserror(tmp_path):
    mnt = _mount(tmp_path, "ro", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs")
    try:
        with pytest.raises(OSError, match="read-only") as e:
            offload.AdamW(_model().parameters(), offload="nvme", swap_dir=str(mnt), **HP)
        assert e.value.errno == errno.EROFS and e.value.filename == str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)])


def test_swap_dir_without_o_direct_warns_and_equals_cpu(tmp_path):
    mnt = _mount(tmp_path, "ramfs", "-t", "ramfs", "ramfs")  # ramfs refuses O_DIRECT (tmpfs >= 6.6 takes it)
    try:
        ref, m = _model(), _model()
        opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
            opt = _nvme(m, mnt, sub_group_size=1024)
        assert not any(f.direct for f in internals.swap(opt).store.files)
        train(ref, opt_ref, 0, 3)
        train(m, opt, 0, 3)
        assert_same(ref, opt_ref, m, opt)
        opt.close()
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)])


def _fill(directory, name="filler"):
    """Write a file until the file system is full."""
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (1 << 20, 4096, 1):
            while True:
                try:
                    os.write(fd, bytes(chunk))
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)


def test_a_full_disk_keeps_training_and_refuses_checkpoints(tmp_path, caplog):
    # The swap files are preallocated; each commit's manifest finds room in reserve.bin (one
    # warning), so steps go on on a full disk. A checkpoint there needs new space: refused,
    # the swap intact. Once space is freed the reserve is whole again.
    img = tmp_path / "img"
    with open(img, "wb") as f:
        f.truncate(16 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.decode()[:200]}")
    mnt = _mount(tmp_path, "mnt", "-o", "loop", str(img))
    try:
        ref, m = _model(), _model()
        opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
        opt = _nvme(m, mnt / "swap", sub_group_size=1024)
        path = internals.swap(opt).swap_path
        reserve = os.path.join(path, "reserve.bin")
        train(ref, opt_ref, 0, 7)
        train(m, opt, 0, 2)
        assert os.path.getsize(reserve) >= 1 << 20
        _fill(mnt)
        with caplog.at_level("WARNING", logger="offload.swap.store"):
            train(m, opt, 2, 5)
        assert caplog.text.count("the file system is full: the manifest of step 3 went into the room kept in "
                                 "reserve.bin") == 1
        assert json.load(open(os.path.join(path, "manifest.json")))["step"] == 5
        snap = _snapshot(list(m.parameters()), opt)
        # Full again before the checkpoint: ext4 frees the blocks of the reserve dropped at step
        # 3 only at its next journal commit, so the commits that took back room may have found
        # less than came free later, and a small checkpoint could then fit (seen in CI).
        os.sync()
        _fill(mnt, "filler2")
        with pytest.raises(OSError) as e:
            opt.save_checkpoint(str(mnt / "ck"))
        assert e.value.errno == errno.ENOSPC and e.value.filename.startswith(str(mnt))
        _assert_snapshot(list(m.parameters()), opt, snap)
        os.unlink(mnt / "filler")
        os.unlink(mnt / "filler2")
        train(m, opt, 5, 7)
        assert os.path.getsize(reserve) >= 1 << 20 and os.stat(reserve).st_blocks * 512 >= 1 << 20
        assert_same(ref, opt_ref, m, opt)
        opt.close()
        assert os.listdir(mnt / "swap") == []
    finally:
        if "opt" in locals():
            opt.close()
        subprocess.run(["umount", str(mnt)])


def test_enospc_without_a_reserve_names_the_directory_and_changes_nothing(tmp_path, monkeypatch):
    # No reserve (another process took the room before this store could keep it): the
    # manifest write fails, the step is undone and can be retried.
    import offload.swap.store as store_mod

    ref, m = _model(), _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    opt = _nvme(m, tmp_path / "swap", sub_group_size=1024)
    path = internals.swap(opt).swap_path
    train(ref, opt_ref, 0, 4)
    train(m, opt, 0, 2)
    os.unlink(os.path.join(path, "reserve.bin"))
    real = store_mod.fsutil.write_json_atomic

    def full(directory, name, obj):
        raise OSError(errno.ENOSPC, "No space left on device (injected)", os.path.join(directory, name))

    monkeypatch.setattr(store_mod.fsutil, "write_json_atomic", full)
    snap = _snapshot(list(m.parameters()), opt)
    m(_batch(2), use_side=True).float().pow(2).mean().backward()
    with pytest.raises(OSError) as e:
        opt.step()
    assert isinstance(e.value, SwapStepError) and e.value.errno == errno.ENOSPC
    assert e.value.filename.startswith(path) and "still hold step 2" in str(e.value)
    _assert_snapshot(list(m.parameters()), opt, snap)
    monkeypatch.setattr(store_mod.fsutil, "write_json_atomic", real)
    opt.step()  # the same grads again
    opt.zero_grad()
    train(m, opt, 3, 4)
    assert_same(ref, opt_ref, m, opt)
    opt.close()


# ---------------------------------------------------------------------- clean-up
def test_close_second_optimizer_on_one_dir_and_garbage_collection(tmp_path):
    ref, a, b = _model(), _model(), _model()
    opt_ref = offload.AdamW(ref.parameters(), offload="cpu", **HP)
    opt_a = _nvme(a, tmp_path, sub_group_size=1024)
    opt_b = _nvme(b, tmp_path, sub_group_size=1024)
    pa, pb = internals.swap(opt_a).swap_path, internals.swap(opt_b).swap_path
    assert sorted(os.listdir(tmp_path)) == ["offload-flat-2.rank0", "offload-flat.rank0"] and pa != pb
    train(ref, opt_ref, 0, 3)
    train(a, opt_a, 0, 3)
    train(b, opt_b, 0, 2)
    opt_a.close()
    assert not os.path.exists(pa) and os.path.exists(pb)
    opt_a.close()  # twice is fine
    train(b, opt_b, 2, 3)
    assert_same(ref, opt_ref, b, opt_b)
    del opt_b  # no close(): the garbage collector removes the files
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_garbage_collection_with_grad_hooks_removes_the_files(tmp_path, monkeypatch):
    monkeypatch.setattr(FlatState, "copy_cpu_grads", True)  # the CUDA params' path, on the CPU
    m = _model()
    opt = _nvme(m, tmp_path, sub_group_size=1024)
    train(m, opt, 0, 1)
    del opt
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_refused_add_param_group_leaves_the_optimizer_as_it_was(tmp_path):
    m = _model()
    opt = _nvme(m, tmp_path, sub_group_size=1024)
    extra = nn.Parameter(torch.randn(10).bfloat16())
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    extra.grad = torch.ones_like(extra)
    train(m, opt, 0, 1)
    opt.close()


def test_use_after_close_is_a_clear_error(tmp_path):
    m = _model()
    opt = _nvme(m, tmp_path, sub_group_size=1024)
    train(m, opt, 0, 1)
    opt.close()
    with pytest.raises(RuntimeError, match="closed"):
        opt.state_dict()
    with pytest.raises(RuntimeError, match="closed"):
        train(m, opt, 1, 2)
