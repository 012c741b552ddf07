"""save_checkpoint / load_checkpoint and the directory they write: only the checkpoint's own
files are touched, a save or load holds the directory's lock, param_groups travel with the
checkpoint, and checkpoints written by the previous release still load."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import offload
from offload.io import NotRegularFile
from offload.swap import fsutil
from offload.swap.checkpoint import CheckpointBusy

from _forkserver import spawn
from _no_hang import within

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 5, generator=g)).square().mean().backward()
        opt.step()


def _opt(model, kind, tmp_path, **kw):
    if kind == "nvme":
        swap = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        swap.mkdir()
        kw.update(offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB", sub_group_size=16)
    elif kind == "cpu":
        kw.update(offload="cpu")
    elif kind == "flat":
        kw.update(stage=2)
    elif kind == "flat-nvme":
        swap = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        swap.mkdir()
        kw.update(stage=2, offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB")
    return offload.AdamW(model.parameters(), lr=kw.pop("lr", 1e-2), **kw)


# ------------------------------------------------------------------ the previous release's format
@pytest.mark.parametrize("fixture,kind", [("ckpt_v1_single", "cpu"), ("ckpt_v1_single", "nvme"),
                                          ("ckpt_v1_shards", "flat"), ("ckpt_v1_shards", "flat-nvme")])
def test_checkpoints_of_the_previous_release_still_load(tmp_path, fixture, kind):
    # Written by tests/fixtures/make_ckpt_v1.py before the format changed; copied, as a load
    # takes the directory's lock (a file in it).
    src = tmp_path / "ckpt"
    shutil.copytree(os.path.join(FIXTURES, fixture), src)
    want = torch.load(src / "expected.pt")
    model = _model()
    opt = _opt(model, kind, tmp_path, lr=5e-3)
    opt.load_checkpoint(str(src))
    assert opt.param_groups[0]["lr"] == 5e-3  # it saved no param_groups: the constructor's stay
    sd = opt.state_dict()["state"]
    assert sorted(sd) == sorted(want["state"])
    for i, st in want["state"].items():
        assert float(sd[i]["step"]) == float(st["step"]) == 3.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd[i][k], st[k])
    if kind.startswith("flat"):  # the masters travel in the shards: the params follow them
        for p, w in zip(model.parameters(), want["params"]):
            assert torch.equal(p.detach(), w)
    opt.close()


# ------------------------------------------------------------------ the user's files in DIR
USER_FILES = ["model.1.bin", "pytorch_model.3.bin", "embeddings.0.bin", "rng_state.7.bin", "exp_avg.1.bin",
              ".optimizer.2.bin.tmp", "master.4.bin"]


def _plant(directory):
    os.makedirs(directory, exist_ok=True)
    for name in USER_FILES:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(name.encode() * 3)


def _planted_intact(directory):
    for name in USER_FILES:
        with open(os.path.join(directory, name), "rb") as f:
            assert f.read() == name.encode() * 3, name
    return True


def _ours(directory):
    return sorted(n for n in os.listdir(directory) if n not in USER_FILES)


@pytest.mark.parametrize("kind", ["cpu", "nvme", "flat", "flat-nvme"])
def test_save_leaves_the_users_own_files_alone(tmp_path, kind):
    # An HF checkpoint-N/ holds the model's *.bin: names like a leftover of ours are not ours.
    # Every store saves the one format: its files in rank<r>/ ([Note: one checkpoint format]).
    ck = tmp_path / "ck"
    where = ck / "rank0"
    _plant(ck)
    _plant(where)
    model = _model()
    opt = _opt(model, kind, tmp_path)
    for _ in range(3):  # each save replaces the previous generation
        _train(model, opt, 1)
        opt.save_checkpoint(str(ck))
    assert _planted_intact(ck) and _planted_intact(where)
    assert _ours(where) == ["offload-ckpt.exp_avg.3.bin", "offload-ckpt.exp_avg_sq.3.bin", "offload-ckpt.json",
                            "offload-ckpt.lock"] + (["offload-ckpt.master.3.bin"] if kind.startswith("flat") else [])
    opt.load_checkpoint(str(ck))
    assert float(opt.state[next(model.parameters())]["step"]) == 3
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_what_a_killed_save_left_is_removed_by_its_record_and_nothing_else(tmp_path, kind, monkeypatch):
    from offload.swap import ckpt_dir

    ck = tmp_path / "ck"
    _plant(ck)
    model = _model()
    opt = _opt(model, kind, tmp_path)
    _train(model, opt, 1)
    opt.save_checkpoint(str(ck))
    _train(model, opt, 1)
    with monkeypatch.context() as m:  # a kill -9 after the data files, before the manifest
        m.setattr(ckpt_dir.NewGeneration, "commit", lambda self, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
        m.setattr(ckpt_dir.NewGeneration, "abort", lambda self: self.release())
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(str(ck))
    assert "offload-ckpt.exp_avg.2.bin" in os.listdir(ck / "rank0")  # left behind, named in the pending record
    fresh = _opt(_model(), kind, tmp_path)
    fresh.load_checkpoint(str(ck))  # the previous checkpoint is what DIR holds
    assert float(fresh.state[next(iter(fresh.state))]["step"]) == 1
    opt.save_checkpoint(str(ck))
    assert _planted_intact(ck) and _ours(ck) == ["rank0"]
    assert _ours(ck / "rank0") == ["offload-ckpt.exp_avg.2.bin", "offload-ckpt.exp_avg_sq.2.bin", "offload-ckpt.json",
                         "offload-ckpt.lock"]
    opt.close()
    fresh.close()


@pytest.mark.parametrize("name", ["offload-ckpt.exp_avg.1.bin", ".offload-ckpt.exp_avg_sq.1.bin.tmp"])
def test_a_file_of_ours_by_name_but_not_by_record_is_refused_not_overwritten(tmp_path, name):
    where = tmp_path / "ck" / "rank0"
    where.mkdir(parents=True)
    (where / name).write_bytes(b"mine")
    model = _model()
    opt = _opt(model, "cpu", tmp_path)
    _train(model, opt, 1)
    with pytest.raises(FileExistsError, match="in the way of the checkpoint"):
        opt.save_checkpoint(str(tmp_path / "ck"))
    assert (where / name).read_bytes() == b"mine"
    assert sorted(os.listdir(where)) == sorted([name, "offload-ckpt.lock"])


# ------------------------------------------------------------------ two processes, one DIR
_HOLDER = r"""
import sys, torch, offload
import offload.swap.checkpoint as ck

class Pause:
    first = True
    def __getattr__(self, name):
        import zlib
        return getattr(zlib, name)
    def crc32(self, *a):
        import zlib
        if Pause.first:
            Pause.first = False
            print("inside", flush=True)
            sys.stdin.readline()
        return zlib.crc32(*a)

ck.zlib = Pause()
torch.manual_seed(0)
p = torch.nn.Parameter(torch.randn(10))
opt = offload.AdamW([p], lr=1e-2, offload="cpu")
p.grad = torch.ones(10)
opt.step()
opt.save_checkpoint(sys.argv[1])
print("saved", flush=True)
"""


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_save_meets_another_process_saving_into_the_directory(tmp_path, kind):
    ck = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    child = spawn(_HOLDER, str(ck), env=env, stdin=True)  # forked from a warm interpreter
    try:
        assert child.stdout.readline().strip() == "inside"  # its save is half-way
        p = torch.nn.Parameter(torch.randn(10))
        swap = tmp_path / "swap"
        swap.mkdir()
        kw = dict(offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB") if kind == "nvme" else dict(offload="cpu")
        opt = offload.AdamW([p], lr=1e-2, **kw)
        p.grad = torch.ones(10)
        opt.step()
        for call in (opt.save_checkpoint, opt.load_checkpoint):
            with pytest.raises(CheckpointBusy, match=rf"in use by process {child.pid} \(a save\)") as info:
                call(str(ck))
            assert info.value.pid == child.pid and info.value.filename == str(ck / "rank0")
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "saved"
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    opt.load_checkpoint(str(ck))  # the other's checkpoint, whole
    assert float(opt.state[p]["step"]) == 1
    opt.save_checkpoint(str(ck))  # and the lock is free again
    opt.close()


# ------------------------------------------------------------------ param_groups
def _two_groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("kind", ["cpu", "nvme", "flat", "flat-nvme"])
def test_load_checkpoint_restores_param_groups_as_load_state_dict(tmp_path, kind):
    # A Trainer resume: the scheduler's state comes back through its own state_dict, the
    # groups' lr, betas, ... through the optimizer's checkpoint; the run continues as if
    # never interrupted (same kernel on both sides: bit for bit).
    def build(model, lr):
        swap = tmp_path / f"swap{len(os.listdir(tmp_path))}"
        swap.mkdir()
        kw = {"cpu": dict(offload="cpu"), "nvme": dict(offload="nvme", swap_dir=str(swap), max_host_bytes="8MiB"),
              "flat": dict(stage=2), "flat-nvme": dict(stage=2, offload="nvme", swap_dir=str(swap))}[kind]
        opt = offload.AdamW(_two_groups(model), lr=lr, betas=(0.8, 0.9), **kw)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    model = _model()
    opt, sched = build(model, 6e-3)
    for _ in range(3):
        _train(model, opt, 1)
        sched.step()
    opt.param_groups[1]["betas"] = (0.7, 0.95)  # a user's change, kept as load_state_dict would
    opt.param_groups[0]["eps"] = 1e-6
    opt.save_checkpoint(str(tmp_path / "ck"))
    sched_state = sched.state_dict()

    resumed = _model()
    resumed.load_state_dict(model.state_dict())
    opt2, sched2 = build(resumed, 1e-4)
    opt2.load_checkpoint(str(tmp_path / "ck"))
    sched2.load_state_dict(sched_state)
    for g, h in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
    assert opt2.param_groups[1]["betas"] == (0.7, 0.95) and isinstance(opt2.param_groups[1]["betas"], tuple)
    assert opt2.param_groups[0]["lr"] == 6e-3 / 4
    for _ in range(2):
        _train(model, opt, 1, seed=2)
        sched.step()
        _train(resumed, opt2, 1, seed=2)
        sched2.step()
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    opt.close()
    opt2.close()


def test_a_tensor_lr_comes_back_a_tensor_of_its_value(tmp_path):
    model = _model()
    opt = offload.AdamW(model.parameters(), lr=torch.tensor(5e-3, dtype=torch.float64), offload="cpu")
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    opt2 = offload.AdamW(_model().parameters(), lr=torch.tensor(1e-2), offload="cpu")
    opt2.load_checkpoint(str(tmp_path / "ck"))
    lr = opt2.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float64 and lr.dim() == 0 and float(lr) == 5e-3


@pytest.mark.parametrize("kind", ["cpu", "flat"])
def test_a_checkpoint_of_other_param_groups_is_refused_before_anything_loads(tmp_path, kind):
    model = _model()
    opt = offload.AdamW(_two_groups(model), lr=1e-2, **({"stage": 2} if kind == "flat" else {}))
    _train(model, opt, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    other = _model()
    opt2 = offload.AdamW(other.parameters(), lr=1e-3, **({"stage": 2} if kind == "flat" else {}))
    _train(other, opt2, 1)
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt2.state_dict()["state"].items()}
    with pytest.raises(ValueError, match="the checkpoint has 2 param groups, this optimizer 1; nothing was loaded"):
        opt2.load_checkpoint(str(tmp_path / "ck"))
    after = opt2.state_dict()["state"]
    assert all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    assert opt2.param_groups[0]["lr"] == 1e-3
    params = list(other.parameters())  # same count, split otherwise
    opt3 = offload.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3,
                         **({"stage": 2} if kind == "flat" else {}))
    with pytest.raises(ValueError, match="param group 0 has 2 params in the checkpoint, 1 in this optimizer"):
        opt3.load_checkpoint(str(tmp_path / "ck"))
    for o in (opt, opt2, opt3):
        o.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_a_directory_in_the_manifests_place_is_named(tmp_path, kind):
    # os.read's EISDIR carried no file name: "[Errno 21] Is a directory", nothing else
    model = _model()
    opt = _opt(model, kind, tmp_path)
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    manifest = tmp_path / "ck" / "rank0" / "offload-ckpt.json"
    manifest.unlink()
    manifest.mkdir()
    with pytest.raises(IsADirectoryError) as info:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert info.value.filename == str(manifest)
    opt.close()


def _edit_manifest(path, fn, seal=True):
    """A manifest its writer got wrong: sealed again, or without a seal (an older release's)."""
    m = json.load(open(path))
    m.pop("manifest_crc32")
    fn(m)
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m) if seal else m, f)


@pytest.mark.parametrize("kind", ["cpu", "nvme", "flat"])
@pytest.mark.parametrize("edit, field, seal", [
    (lambda s: s.__setitem__(1, "x"), r"'meta.steps\[1\]': expected an integer in \[0, 2147483647\], got 'x'", False),
    (lambda s: s.__setitem__(1, -1), r"'meta.steps\[1\]': expected an integer in", True),
    (lambda s: s.__setitem__(0, -2**63), r"'meta.steps\[0\]': expected an integer in", True),
    (lambda s: s.__setitem__(0, 2**40), r"'meta.steps\[0\]': expected an integer in", True),
    (lambda s: s.pop(), r"'meta.steps': expected 4 step counts, one per param, got \[", True),
], ids=["x-unsealed", "-1", "-2**63", "2**40", "short"])
def test_bad_step_counts_are_refused_before_any_state_changes(tmp_path, kind, edit, field, seal):
    # A count "x" failed in int() after param 0 had taken the checkpoint's state and param 1's
    # was dropped (a bare ValueError naming no file); a short list left the last params' old
    # state; -1, -2**63 and 2**40 loaded.
    model = _model()
    opt = _opt(model, kind, tmp_path)
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    _train(model, opt, 1, seed=2)
    before = opt.state_dict()["state"]
    manifest = str(tmp_path / "ck" / "rank0" / "offload-ckpt.json")
    _edit_manifest(manifest, lambda m: edit(m["meta"]["steps"]), seal)
    with pytest.raises(ValueError, match=field) as info:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert str(info.value).startswith(manifest)
    after = opt.state_dict()["state"]
    assert sorted(after) == sorted(before)
    for i, st in before.items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), (i, k)
    opt.close()


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.pop("numel"), "'numel': expected an integer >= 0"),
    (lambda m: m.__setitem__("numel", {}), "'numel': expected an integer >= 0"),
    (lambda m: m.__setitem__("crc32", True), "'crc32': expected a crc32 per state"),
    (lambda m: m["fields"].__setitem__(0, 0), r"'fields\[0\]': expected a state field"),
    (lambda m: m["fields"][0].__setitem__("dtype", "float7"), r"'fields\[0\]': expected a state field .*unknown state dtype"),
    (lambda m: m["states"].__setitem__(1, float("nan")), "'states': expected a list of state names"),
    (lambda m: m["dtypes"].__setitem__("exp_avg", 3), r"'dtypes\['exp_avg'\]': expected a dtype name"),
    (lambda m: m.__setitem__("meta", 0), "'meta': expected an object"),
], ids=["no-numel", "numel-obj", "crc32-bool", "field-int", "field-dtype", "state-nan", "dtypes-int", "meta-int"])
def test_a_damaged_manifest_field_is_named(tmp_path, edit, field):
    # KeyError 'numel', TypeError "'bool' object is not subscriptable", AttributeError "'int'
    # object has no attribute 'get'", ... named neither the file nor the field
    model = _model()
    opt = _opt(model, "cpu", tmp_path)
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    manifest = str(tmp_path / "ck" / "rank0" / "offload-ckpt.json")
    _edit_manifest(manifest, edit)
    with pytest.raises(ValueError, match=f"field {field}") as e:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert str(e.value).startswith(manifest)
    opt.close()


@pytest.mark.parametrize("file_bytes", [0, "just-below"])
def test_a_file_size_below_the_data_is_refused_not_read_forever(tmp_path, file_bytes):
    # A resealed manifest whose file_bytes is below the state's bytes: the streaming read stopped
    # at file_bytes and looped forever (the cpu store's load_checkpoint spun at 100 % CPU).
    model = _model()
    opt = _opt(model, "cpu", tmp_path)  # (the swap stores check the files whole first: unaffected)
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    manifest = str(tmp_path / "ck" / "rank0" / "offload-ckpt.json")
    _edit_manifest(manifest, lambda m: m.__setitem__("file_bytes", 0 if file_bytes == 0 else m["numel"] * 4 - 4))
    before = opt.state_dict()["state"]
    with within(20), pytest.raises(ValueError, match=r"the manifest says \d+ bytes for \d+ of data"):
        opt.load_checkpoint(str(tmp_path / "ck"))
    after = opt.state_dict()["state"]
    for i, st in before.items():
        for k, v in st.items():
            assert torch.equal(after[i][k], v), (i, k)
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "flat"])
@pytest.mark.parametrize("world", [2**40, 0, None])
def test_a_damaged_world_size_is_refused_at_once(tmp_path, kind, world):
    # world 2**40 spun at 100 % CPU looking for each rank's directory before any check
    model = _model()
    opt = _opt(model, kind, tmp_path, state_dtype="int8")
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    manifest = str(tmp_path / "ck" / "rank0" / "offload-ckpt.json")
    _edit_manifest(manifest, lambda m: m["meta"].__setitem__("world", world))
    with within(5), pytest.raises(ValueError, match=r"field 'meta.world': expected an integer in \[1, 1048576\]") as e:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert str(e.value).startswith(manifest)
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme", "flat"])
@pytest.mark.parametrize("name", ["offload-ckpt.json", "offload-ckpt.exp_avg.1.bin", "offload-ckpt.lock"])
def test_a_fifo_in_a_files_place_is_refused_at_once_naming_it(tmp_path, kind, name):
    # The open blocked until a writer came: forever ([Note: a FIFO where a file was] in
    # offload/io/files.py); a FIFO lock said a bare "[Errno 22] Invalid argument".
    model = _model()
    opt = _opt(model, kind, tmp_path)
    _train(model, opt, 1)
    opt.save_checkpoint(str(tmp_path / "ck"))
    path = tmp_path / "ck" / "rank0" / name
    path.unlink()
    os.mkfifo(path)
    with within(5), pytest.raises(NotRegularFile, match=r"not a regular file \(a FIFO\)") as info:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert info.value.filename == str(path)
    opt.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme", "flat", "flat-nvme"])
@pytest.mark.parametrize("under", [False, True], ids=["the-file", "under-the-file"])
def test_a_checkpoint_path_that_is_a_file_is_refused_by_name(tmp_path, kind, under):
    # a bare "[Errno 17] File exists" (or "Not a directory: .../rank0"): a checkpoint is a directory
    model = _model()
    opt = _opt(model, kind, tmp_path)
    _train(model, opt, 1)
    f = tmp_path / "ckpt"
    f.write_text("the user's")
    path = str(f / "sub" if under else f)
    for call in (opt.save_checkpoint, opt.load_checkpoint):
        with pytest.raises(NotADirectoryError, match="this path is a file, and a checkpoint is a directory") as info:
            call(path)
        assert info.value.filename == str(f)
    assert f.read_text() == "the user's"
    opt.close()


# ------------------------------------------------------------------ several ranks, one DIR
def _rank_job(rank, world, ck, swap, out):
    """On the session's two gloo ranks (tests/_ranks.py group)."""
    import torch.distributed as dist

    from offload.swap import fsutil

    try:
        model = _model()
        kw = dict(offload="nvme", swap_dir=os.path.join(swap, str(rank))) if swap else {}
        if swap:
            os.makedirs(kw["swap_dir"])
        opt = offload.AdamW(_two_groups(model), lr=6e-3, stage=2, **kw)
        _plant(os.path.join(ck, f"rank{rank}"))
        _train(model, opt, 2, seed=rank)
        opt.param_groups[0]["lr"] = 3e-3
        opt.save_checkpoint(ck)  # generation 1, at step 2
        shutil.copytree(os.path.join(ck, f"rank{rank}"), os.path.join(out, f"gen1-rank{rank}"))
        _train(model, opt, 1, seed=rank)
        real = fsutil.write_json_atomic

        def full(directory, name, obj):
            if name == "offload-ckpt.json":
                raise OSError(28, "injected ENOSPC")
            return real(directory, name, obj)

        if rank == 1:  # its manifest cannot be written: rank 0's commit must be undone
            fsutil.write_json_atomic = full
        try:
            opt.save_checkpoint(ck)
            err = ""
        except (OSError, RuntimeError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        finally:
            fsutil.write_json_atomic = real
        opt3 = offload.AdamW(_two_groups(_model()), lr=1e-4, stage=2)
        opt3.load_checkpoint(ck)  # both ranks still hold the previous save
        after_fail = sorted({float(s["step"]) for s in opt3.state.values()})
        opt3.close()
        opt.save_checkpoint(ck)  # generation 2, at step 3
        opt2 = offload.AdamW(_two_groups(_model()), lr=1e-4, stage=2)
        opt2.load_checkpoint(ck)
        torch.save({"err": err, "after_fail": after_fail, "lr": opt2.param_groups[0]["lr"],
                    "intact": _planted_intact(os.path.join(ck, f"rank{rank}")),
                    "steps": sorted({float(s["step"]) for s in opt2.state.values()})}, os.path.join(out, f"{rank}.pt"))
        opt.close()
        opt2.close()
    finally:
        dist.barrier()


@pytest.mark.parametrize("nvme", [False, True], ids=["host", "nvme"])
def test_two_ranks_save_into_one_directory_all_or_none(tmp_path, nvme):
    from _ranks import group

    ck, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    swap = str(tmp_path / "swap") if nvme else ""
    group(2).run(_rank_job, str(ck), swap, str(out))  # a spawn of its own cost ~3 s
    res = [torch.load(out / f"{r}.pt") for r in range(2)]
    assert res[1]["err"].startswith("OSError") and "injected ENOSPC" in res[1]["err"]
    assert "failed on rank 1" in res[0]["err"] and "it put its previous checkpoint back" in res[0]["err"]
    for r in res:  # the per-rank locks let both ranks save; the user's files are intact
        assert r["after_fail"] == [2.0]
        assert r["intact"] and r["lr"] == 3e-3 and r["steps"] == [3.0]
    # A rank killed between the ranks' commits: rank 1's shard of the previous save with
    # rank 0's of this one. The load refuses the mix instead of loading it.
    shutil.rmtree(ck / "rank1")
    shutil.copytree(out / "gen1-rank1", ck / "rank1")
    opt = offload.AdamW(_two_groups(_model()), lr=1e-4, stage=2)
    with pytest.raises(ValueError, match="written by another save than rank 0's"):
        opt.load_checkpoint(str(ck))
    opt.close()


@pytest.mark.parametrize("fixture,kind", [("ckpt_v1_single", "nvme"), ("ckpt_v1_shards", "flat")])
def test_a_save_over_the_previous_releases_checkpoint_replaces_its_files_only(tmp_path, fixture, kind):
    # Its manifest names its files (exp_avg.1.bin ...): they go with the new save, and what
    # the manifest does not name (expected.pt here) stays. The single-directory format of
    # stage 0 is retired by the first save in the one format, into rank0/ (a new directory:
    # generation 1 there).
    ck = tmp_path / "ck"
    shutil.copytree(os.path.join(FIXTURES, fixture), ck)
    model = _model()
    opt = _opt(model, kind, tmp_path)
    opt.load_checkpoint(str(ck))
    _train(model, opt, 1)
    opt.save_checkpoint(str(ck))
    gen = 2 if kind == "flat" else 1
    names = [f"offload-ckpt.exp_avg.{gen}.bin", f"offload-ckpt.exp_avg_sq.{gen}.bin", "offload-ckpt.json",
             "offload-ckpt.lock"]
    assert sorted(os.listdir(ck / "rank0")) == sorted(names + (["offload-ckpt.master.2.bin"] if kind == "flat" else []))
    assert sorted(os.listdir(ck)) == ["expected.pt", "rank0"] if kind == "flat" else \
        ["expected.pt", "offload-ckpt.lock", "rank0"]
    opt.load_checkpoint(str(ck))
    assert float(opt.state[next(model.parameters())]["step"]) == 4
    opt.close()
