"""A checkpoint manifest whose values are damaged but whose structure still reads (sealed
again after the damage, or an unsealed older-release manifest): each is refused at
``load_checkpoint`` naming the manifest, before anything changes; none loads and then fails
every later step, and none makes the next save remove a file that is not the checkpoint's."""
from __future__ import annotations

import json
import os

import pytest
import torch

import offload
from offload.swap import fsutil

SIZES = [5000, 33 * 7]  # one int8 param (>= 4096 elements: packed blocks), one kept in float32


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _train(opt, params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


OPTS = {
    "adamw-cpu": lambda ps, d: offload.AdamW(ps, lr=1e-2, offload="cpu"),
    "adamw-int8": lambda ps, d: offload.AdamW(ps, lr=1e-2, offload="cpu", state_dtype="int8"),
    "adamw-nvme": lambda ps, d: offload.AdamW(ps, lr=1e-2, offload="nvme", swap_dir=d, max_host_bytes="8MiB"),
    "sgd-cpu": lambda ps, d: offload.SGD(ps, lr=1e-2, momentum=0.9, offload="cpu"),
    "adagrad-nvme": lambda ps, d: offload.Adagrad(ps, lr=1e-2, offload="nvme", swap_dir=d, max_host_bytes="8MiB"),
    "lion-cpu": lambda ps, d: offload.Lion(ps, lr=1e-3, offload="cpu"),
}


def _make(kind, tmp_path, seed=0):
    d = tmp_path / f"swap{len(os.listdir(tmp_path))}"
    d.mkdir()
    ps = _params(seed)
    return ps, OPTS[kind](ps, str(d))


def _edit(path, fn, seal=True):
    m = json.load(open(path))
    m.pop(fsutil.SEAL, None)
    fn(m)
    with open(path, "w") as f:
        json.dump(fsutil.sealed(m) if seal else m, f)


def _saved(kind, tmp_path):
    ps, opt = _make(kind, tmp_path)
    _train(opt, ps, 2)
    opt.save_checkpoint(str(tmp_path / "ck"))
    opt.close()
    return str(tmp_path / "ck" / "rank0" / "offload-ckpt.json")


def _snapshot(opt, params):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in params],
            {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for i, st in sd["state"].items()},
            [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])


def _same(a, b):
    (pa, sa, ga), (pb, sb, gb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sorted(sa) == sorted(sb)
    for i in sa:
        for k in sa[i]:
            assert torch.equal(sa[i][k], sb[i][k]) if torch.is_tensor(sa[i][k]) else sa[i][k] == sb[i][k], (i, k)
    assert ga == gb


def _refused_unchanged(kind, tmp_path, manifest, match):
    ps, opt = _make(kind, tmp_path, seed=3)
    _train(opt, ps, 1, seed=7)
    before = _snapshot(opt, ps)
    with pytest.raises(ValueError, match=match) as e:
        opt.load_checkpoint(str(tmp_path / "ck"))
    assert str(e.value).startswith(manifest), e.value
    _same(before, _snapshot(opt, ps))
    _train(opt, ps, 1, seed=8)  # and it still steps
    opt.close()


def _set_hyper(key, value):
    return lambda m: m["meta"]["param_groups"][0]["hyper"].__setitem__(key, value)


@pytest.mark.parametrize("kind, key, value, match", [
    ("adamw-cpu", "lr", "x", "lr must be"),
    ("adamw-cpu", "lr", None, "lr must be"),
    ("adamw-cpu", "eps", -1, "Invalid epsilon value"),
    ("adamw-int8", "betas", {"tuple": ["x"]}, "betas must be a pair"),
    ("adamw-nvme", "betas", {"tuple": [0.9, None]}, r"betas\[1\] must be"),
    ("adamw-nvme", "amsgrad", [[-1]], "amsgrad must be True or False"),
    ("adamw-cpu", "maximize", "no", "maximize must be True or False"),
    ("adamw-cpu", "foreach", 1, "foreach must be True or False or None"),
    ("sgd-cpu", "momentum", [], "momentum must be"),
    ("sgd-cpu", "weight_decay", -2**63, "Invalid weight_decay value"),
    ("sgd-cpu", "dampening", "x", "dampening must be"),
    ("sgd-cpu", "nesterov", True, "Nesterov momentum requires"),  # dampening 0 but ... momentum 0.9: see below
    ("adagrad-nvme", "lr_decay", None, "lr_decay must be"),
    ("adagrad-nvme", "initial_accumulator_value", -1.0, "Invalid initial_accumulator_value value"),
    ("lion-cpu", "betas", 1.5, "betas must be a pair"),
    ("lion-cpu", "betas", {"tuple": [0.9, 2.0]}, r"Invalid beta parameter at index 1"),
])
@pytest.mark.parametrize("seal", [True, False], ids=["resealed", "unsealed"])
def test_damaged_hyperparameters_are_refused_before_anything_loads(tmp_path, kind, key, value, match, seal):
    # Each loaded, then every step failed (TypeError: float() argument must be ..., "not enough
    # values to unpack", "a group now needs rule 'adam_amsgrad'"), the states already replaced.
    manifest = _saved(kind, tmp_path)
    if key == "nesterov":  # nesterov with a nonzero dampening: what the constructor refuses
        _edit(manifest, lambda m: (_set_hyper("nesterov", True)(m), _set_hyper("dampening", 0.5)(m)), seal)
    else:
        _edit(manifest, _set_hyper(key, value), seal)
    _refused_unchanged(kind, tmp_path, manifest, f"param group 0: {match}")


def test_sound_hyperparameters_still_load(tmp_path):
    # (the check is the constructor's: values it takes load, a Tensor lr included)
    manifest = _saved("adamw-cpu", tmp_path)
    _edit(manifest, lambda m: (_set_hyper("lr", {"tensor": 0.5, "dtype": "float64", "dim": 0})(m),
                               _set_hyper("betas", {"tuple": [0.5, 0.25]})(m), _set_hyper("maximize", True)(m)))
    ps, opt = _make("adamw-cpu", tmp_path, seed=3)
    opt.load_checkpoint(str(tmp_path / "ck"))
    g = opt.param_groups[0]
    assert torch.is_tensor(g["lr"]) and float(g["lr"]) == 0.5 and g["betas"] == (0.5, 0.25) and g["maximize"] is True
    _train(opt, ps, 1)
    opt.close()


@pytest.mark.parametrize("kind", ["adamw-cpu", "adamw-nvme", "sgd-cpu"])
@pytest.mark.parametrize("name", ["model.bin", "../offload-ckpt.exp_avg.1.bin", "offload-ckpt.other.bin"])
def test_a_manifest_naming_a_file_not_its_own_is_refused_and_the_next_save_keeps_it(tmp_path, kind, name):
    # A save removes the files the manifest it replaces names: with 'files' resealed to name
    # the user's model.bin beside the checkpoint (an HF checkpoint-N/ holds both), the next
    # save would have deleted it.
    manifest = _saved(kind, tmp_path)
    user_file = tmp_path / "ck" / "rank0" / "model.bin"
    user_file.write_bytes(b"weights")
    _edit(manifest, lambda m: m["files"].__setitem__(m["states"][0], name))
    _refused_unchanged(kind, tmp_path, manifest, "the manifest's 'files' is not a map of each state to a file name of ours")
    ps, opt = _make(kind, tmp_path, seed=4)
    _train(opt, ps, 1)
    with pytest.raises(ValueError, match="'files' is not a map"):
        opt.save_checkpoint(str(tmp_path / "ck"))  # a save reads the manifest it replaces: refused too
    assert user_file.read_bytes() == b"weights"
    opt.close()


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.__setitem__("files", {}), "'files' is not a map of each state"),
    (lambda m: m["files"].__setitem__("extra", "offload-ckpt.extra.1.bin"), "'files' is not a map of each state"),
    (lambda m: m.__setitem__("gen", None), "field 'gen': expected an integer >= 0, got None"),
    (lambda m: m.__setitem__("gen", "1"), "field 'gen': expected an integer >= 0"),
    (lambda m: m["meta"]["param_groups"][0].__setitem__("n_params", -2**63), r"meta.param_groups counts \[-9223372036854775808\]"),
], ids=["files-empty", "files-extra", "gen-none", "gen-str", "n_params"])
@pytest.mark.parametrize("seal", [True, False], ids=["resealed", "unsealed"])
def test_damaged_manifest_values_are_refused(tmp_path, edit, match, seal):
    # files {} leaked a KeyError; gen None loaded and then failed the next save with a TypeError;
    # a group's n_params that no longer summed to the params loaded the states and silently
    # skipped every hyperparameter.
    manifest = _saved("adamw-nvme", tmp_path)
    _edit(manifest, edit, seal)
    _refused_unchanged("adamw-nvme", tmp_path, manifest, match)


@pytest.mark.parametrize("tensors", [-1, 2**40, "x", None, []])
def test_a_packed_checkpoint_whose_forms_are_damaged_is_refused(tmp_path, tensors):
    # meta.tensors -1 in an int8 host checkpoint: TypeError "'int' object is not iterable"
    manifest = _saved("adamw-int8", tmp_path)
    _edit(manifest, lambda m: m["meta"].__setitem__("tensors", tensors))
    _refused_unchanged("adamw-int8", tmp_path, manifest, "the meta's 'tensors' names the states")


def test_a_checkpoint_of_groups_loaded_from_torch_with_foreach_and_a_tensor_lr_loads(tmp_path):
    # load_state_dict takes torch's foreach=True with a Tensor lr (foreach only picks torch's
    # code path); the checkpoint saved after it was refused by its own load ("lr as a Tensor
    # is not supported for capturable=False and foreach=True"): both loads check alike now
    src = _params()
    torch_opt = torch.optim.AdamW(src, lr=torch.tensor(0.01), foreach=False)
    _train(torch_opt, src, 1)
    sd = torch_opt.state_dict()
    sd["param_groups"][0]["foreach"] = True
    ps, opt = _make("adamw-cpu", tmp_path)
    opt.load_state_dict(sd)
    opt.save_checkpoint(str(tmp_path / "ck"))
    ps2, opt2 = _make("adamw-cpu", tmp_path, seed=1)
    opt2.load_checkpoint(str(tmp_path / "ck"))
    assert opt2.param_groups[0]["foreach"] is True and torch.is_tensor(opt2.param_groups[0]["lr"])
    _train(opt2, ps2, 1)
    opt.close()
    opt2.close()
