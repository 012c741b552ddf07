"""The optimizer's front: constructor arguments, torch parity of validation and old formats,
torch.compile, pickling, the step pre-hooks (issue 13, sections 3 and 4)."""
from __future__ import annotations

import copy
import io
import os
import pathlib
import pickle
import socket
import textwrap

import pytest
import torch
from torch import nn

import _torch_compat
import offload
from offload.config import IOConfig, parse_bytes
from offload.io.tuning import load_tuning, save_tuning
from offload.optim.functional import AdamHyper, adam_step
import _internals as internals

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = ("maximize", "foreach", "fused", "differentiable", "capturable", "decoupled_weight_decay")
TORCH_FLAGS = tuple(k for k in FLAGS if k not in _torch_compat.adam_group_keys_missing())  # torch's Adam's


def _params(n=2, numel=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(numel, generator=g).to(dtype)) for _ in range(n)]


def _clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _step_both(opts_params, seed):
    """One step of each (optimizer, params) on the same grads."""
    for opt, params in opts_params:
        for p, g in zip(params, _grads(params, seed)):
            p.grad = g
        opt.step()


def _assert_same(a, b, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), rtol=0, atol=atol)


# ---------------------------------------------------------------- arguments (section 3)
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_threads=1.5), TypeError, "num_threads must be an int"),
    (dict(num_threads="2"), TypeError, "num_threads must be an int"),
    (dict(num_threads=True), TypeError, "num_threads"),
    (dict(max_grad_norm="1.0"), TypeError, "max_grad_norm must be a float"),
    (dict(betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    (dict(betas=0.9), ValueError, "betas must be a pair"),
    (dict(lr="0.1"), TypeError, "lr must be a float or a 1-element Tensor, got str"),
    (dict(eps="1e-8"), TypeError, "eps must be a float"),
    (dict(weight_decay=None), TypeError, "weight_decay must be a float"),
    (dict(bias_correction="no"), TypeError, "bias_correction must be True or False"),
    (dict(stage=3), ValueError, "Invalid stage: 3 for these params"),
    (dict(stage=4), ValueError, r"Invalid stage: 4 \(0, 1, 2, or 3 over the params of offload.shard"),
    (dict(offload=1), TypeError, "offload must be"),
    (dict(offload="nvme", swap_dir="/var/tmp", verify="no"), TypeError, "verify must be True or False, got str 'no'"),
    (dict(offload="nvme", swap_dir="/var/tmp", resume=1), TypeError, "resume must be True or False"),
    (dict(offload="nvme", swap_dir=5), TypeError, "swap_dir must be a path"),
    (dict(offload="nvme", swap_dir="/var/tmp", sub_group_size=2.5), TypeError, "sub_group_size must be an int"),
    (dict(offload="nvme", swap_dir="/var/tmp", max_host_bytes="1e400"), ValueError,
     r"max_host_bytes: invalid byte size: '1e400' \(not a finite number: too large, nan or inf\)"),
    (dict(offload="nvme", swap_dir="/var/tmp", io_engine="fast"), ValueError, "unknown io engine 'fast'"),
    (dict(offload="nvme", swap_dir="/var/tmp", io_engine=3), TypeError, "io_engine must be"),
])
def test_bad_arguments_are_refused_at_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        offload.AdamW(_params(), **kwargs)


def test_parse_bytes_refuses_non_finite():
    with pytest.raises(ValueError, match="not a finite number"):
        parse_bytes("1e400")
    assert parse_bytes("1.5K") == 1536
    assert parse_bytes("1e3") == 1000 and parse_bytes("4096.0B") == 4096
    for fractional in ("4096.5", "0.5b", "1.25"):  # bytes are whole: not truncated to fewer
        with pytest.raises(ValueError, match="not a whole number of bytes"):
            parse_bytes(fractional)


def test_load_tuning_names_a_binary_file(tmp_path):
    path = tmp_path / "tune.json"
    path.write_bytes(b"\xa1\xff\x00binary")
    with pytest.raises(ValueError, match=f"{path}: not a JSON tuning file: not UTF-8 text"):
        load_tuning(path)


def test_parse_bytes_is_exact_and_bounded():
    # float() would round 2**62 - 1 up to 2**62 and 2**63 - 1 up to 2**63
    assert parse_bytes(str((1 << 62) - 1)) == (1 << 62) - 1
    assert parse_bytes("4194304T") == 1 << 62
    for too_large in ("1e30", str((1 << 63) - 1), "4194305T", (1 << 62) + 1):
        with pytest.raises(ValueError, match=r"more than 2\*\*62 bytes"):
            parse_bytes(too_large)


@pytest.mark.parametrize("kind", ["bytes", "pathlib"])
def test_swap_dir_accepts_bytes_and_pathlike(tmp_path, kind):
    swap = os.fsencode(str(tmp_path)) if kind == "bytes" else tmp_path
    params = _params()
    ref_params = _clone(params)
    ref = torch.optim.AdamW(ref_params, lr=0.01)
    with offload.AdamW(params, lr=0.01, offload="nvme", swap_dir=swap) as opt:
        assert opt.config.swap_dir == str(tmp_path)
        for s in range(2):
            _step_both([(opt, params), (ref, ref_params)], s)
        _assert_same(params, ref_params)


def test_swap_dir_expands_the_home_directory(tmp_path, monkeypatch):
    """"~/swap" (as written in a config file, where no shell expands it) is the home
    directory's, not a directory named "~" under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "swap").mkdir()
    with offload.AdamW(_params(), lr=0.01, offload="nvme", swap_dir="~/swap") as opt:
        assert opt.config.swap_dir == str(tmp_path / "swap")
        assert os.listdir(tmp_path / "swap")
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("target", ["none", "cpu"])
@pytest.mark.parametrize("option, value", [
    ("swap_dir", "/var/tmp"), ("resume", True), ("verify", True), ("max_host_bytes", "1GiB"),
    ("max_host_bytes", 0), ("io_engine", "threads"), ("io_engine", "auto"),
])
def test_swap_options_without_nvme_are_refused(target, option, value):
    # They act only on swap files: ignoring them silently would let a user believe they
    # resumed, or verified, when nothing happened.
    with pytest.raises(ValueError, match=f"{option} acts only on swap files and needs offload='nvme'"):
        offload.AdamW(_params(), offload=target, **{option: value})


@pytest.mark.parametrize("target", ["none", "cpu"])
def test_defaults_of_swap_options_are_accepted_without_nvme(target):
    offload.AdamW(_params(), offload=target, verify=False, resume=False, swap_dir=None, io_engine=None)


def test_sub_group_size_refused_where_it_would_do_nothing():
    with pytest.raises(ValueError, match="sub_group_size=1024 would be ignored: fp32 CPU params"):
        offload.AdamW(_params(), offload="cpu", sub_group_size=1024)
    # bf16 params get a flat fp32 master, cut into sub-groups: there it acts.
    offload.AdamW(_params(dtype=torch.bfloat16), offload="cpu", sub_group_size=1024)


# ---------------------------------------------------------------- torch parity of validation
def _t(*v):
    return torch.tensor(v[0]) if len(v) == 1 else torch.tensor(list(v))


PARITY = [  # (id, params or None for the default, kwargs)
    ("lr<0", None, dict(lr=-1.0)),
    ("lr 2 elements", None, dict(lr=_t(0.1, 0.2))),
    ("tensor lr foreach", None, dict(lr=_t(0.01), foreach=True)),
    ("eps<0", None, dict(eps=-1.0)),
    ("beta0=1", None, dict(betas=(1.0, 0.9))),
    ("beta1<0", None, dict(betas=(0.9, -0.1))),
    ("int betas", None, dict(betas=(0, 0))),
    ("mixed betas", None, dict(betas=(_t(0.9), 0.999))),
    ("mixed betas 2", None, dict(betas=(0.9, _t(0.999)))),
    ("tensor betas foreach", None, dict(betas=(_t(0.9), _t(0.999)), foreach=True)),
    ("weight_decay<0", None, dict(weight_decay=-0.1)),
    ("fused and foreach", None, dict(fused=True, foreach=True)),
    ("params None", "none", {}),
    ("params None lr<0", "none", dict(lr=-1.0)),
    ("params None betas", "none", dict(betas=(0.9, 1.5))),
    ("params empty", "empty", {}),
    ("params a tensor", "tensor", {}),
]


def _parity_params(kind):
    return {None: _params(), "none": None, "empty": [], "tensor": torch.zeros(3)}[kind]


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the point is to compare whatever is raised
        return type(exc), str(exc)
    return None, None


@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
@pytest.mark.parametrize("case", PARITY, ids=[c[0] for c in PARITY])
def test_constructor_errors_match_torch(cls, case):
    _, kind, kwargs = case
    theirs = _raised(lambda: getattr(torch.optim, cls)(_parity_params(kind), **kwargs))
    ours = _raised(lambda: getattr(offload, cls)(_parity_params(kind), **kwargs))
    assert theirs[0] is not None, "the case must be one torch refuses"
    assert ours[0] is theirs[0], (ours, theirs)
    if kind != "none" or kwargs:  # params=None: torch's message is Python's ("not iterable")
        assert ours[1] == theirs[1]


def test_params_none_says_what_params_must_be():
    with pytest.raises(TypeError, match="iterable of Tensors or dicts, but got None"):
        offload.AdamW(None)


def test_tensor_betas_are_squeezed_and_step_as_torch():
    betas = (torch.tensor([0.9]), torch.tensor([[0.99]]))
    params = _params()
    ref_params = _clone(params)
    opt = offload.AdamW(params, lr=0.01, betas=betas)
    ref = torch.optim.AdamW(ref_params, lr=0.01, betas=betas, foreach=False)
    for ours, theirs in zip(opt.defaults["betas"], ref.defaults["betas"]):
        # (torch after 2.6 squeezes them as we do; 2.6 keeps the shapes given and cannot step
        # with them, so its reference below steps with their floats)
        assert ours.dim() == 0 and torch.equal(ours, theirs.reshape(()))
    ref = torch.optim.AdamW(ref_params, foreach=False, **_torch_compat.plain_hyperparameters(dict(lr=0.01, betas=betas)))
    for s in range(3):
        _step_both([(opt, params), (ref, ref_params)], s)
    _assert_same(params, ref_params)


@pytest.mark.parametrize("cls", [offload.Adam, offload.AdamW])
def test_tensor_eps_and_weight_decay_step_as_torch(cls):
    # torch's constructor and step take them (a 1-element Tensor, as lr); ours said
    # "eps must be a float"
    hyper = dict(lr=0.01, eps=torch.tensor(1e-6), weight_decay=torch.tensor(0.1))
    params = _params()
    ref_params = _clone(params)
    opt = cls(params, **hyper)
    ref = getattr(torch.optim, cls.__name__)(ref_params, foreach=False, **hyper)
    for s in range(3):
        _step_both([(opt, params), (ref, ref_params)], s)
    _assert_same(params, ref_params)
    with pytest.raises(ValueError, match="Tensor eps must be 1-element"):
        cls(_params(), eps=torch.tensor([1e-8, 1e-8]))
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        cls(_params(), weight_decay=torch.tensor(-0.1))


def test_step_dtype_follows_torch_default_dtype():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        params = _params()  # still float32: only the step counter follows the default dtype
        ref_params = _clone(params)
        opt = offload.AdamW(params, lr=0.01)
        ref = torch.optim.AdamW(ref_params, lr=0.01)
        _step_both([(opt, params), (ref, ref_params)], 0)
    finally:
        torch.set_default_dtype(before)
    assert ref.state[ref_params[0]]["step"].dtype == torch.float64
    assert opt.state[params[0]]["step"].dtype == torch.float64
    _assert_same(params, ref_params)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex128])  # float64, complex64: test_float64_params.py, ...
def test_unsupported_param_dtypes_name_the_alternative(dtype):
    p = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_complex)
    with pytest.raises(NotImplementedError, match=f"parameter 0 has dtype {dtype}.*use torch.optim.AdamW"):
        offload.AdamW([p])
    opt = offload.AdamW(_params())
    with pytest.raises(NotImplementedError, match=f"parameter 2 has dtype {dtype}"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- old checkpoints
def _old_format(sd):
    """A state dict as torch < 1.12 wrote it: float steps, none of the later flags."""
    for st in sd["state"].values():
        st["step"] = float(st["step"])
    for g in sd["param_groups"]:
        for k in FLAGS:
            g.pop(k, None)
    return sd


@pytest.mark.parametrize("store", ["host", "flat", "nvme"])
def test_old_format_state_dict_loads_and_steps_as_torch(tmp_path, store):
    dtype = torch.bfloat16 if store == "flat" else torch.float32
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "nvme" else {}
    params = _params(dtype=dtype)
    first = offload.Adam(params, lr=0.01, weight_decay=0.1, **kw)
    _step_both([(first, params)], 0)
    sd = _old_format(first.state_dict())
    first.close()
    ref_sd = copy.deepcopy(sd)
    ref_params = [nn.Parameter(p.detach().float().clone()) for p in params] if store == "flat" else _clone(params)
    ref = torch.optim.Adam(ref_params, lr=0.01, weight_decay=0.1)
    ref.load_state_dict(ref_sd)
    with offload.Adam(params, lr=0.01, weight_decay=0.1, **kw) as opt:
        opt.load_state_dict(sd)
        for g in opt.param_groups:
            assert {k: g[k] for k in TORCH_FLAGS} == {k: ref.param_groups[0][k] for k in TORCH_FLAGS}
        if store == "host":
            assert opt.state[params[0]]["step"].dtype == torch.float32
        _step_both([(opt, params), (ref, ref_params)], 1)
        assert opt.state[params[0]]["step"] == 2
        # bf16 params: torch steps from the rounded bf16 values, the flat store from its fp32
        # master, so they agree to bf16 resolution only.
        _assert_same(params, ref_params, atol=1e-6 if store != "flat" else 2e-2)


def test_adamw_old_format_gets_decoupled_weight_decay():
    params = _params()
    opt = offload.AdamW(params, lr=0.01)
    _step_both([(opt, params)], 0)
    sd = _old_format(opt.state_dict())
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True


# ---------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("store", ["host", "nvme"])
def test_compiled_step_runs_eagerly_and_matches(tmp_path, store):
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "nvme" else {}
    params = _params()
    ref_params = _clone(params)
    ref = offload.AdamW(ref_params, lr=0.01, max_grad_norm=1.0)
    from torch._dynamo.utils import counters  # here, not at collection: dynamo's import is ~1.4 s

    torch._dynamo.reset()
    counters.clear()
    with offload.AdamW(params, lr=0.01, max_grad_norm=1.0, **kw) as opt:
        compiled = torch.compile(opt.step)
        for s in range(3):
            for p, g in zip(params, _grads(params, s)):
                p.grad = g
            compiled()
            _step_both([(ref, ref_params)], s)
        # The step is not traced: no graph breaks at its locks, timers and .item() calls.
        assert not sum(counters["graph_break"].values()), dict(counters["graph_break"])
        # Eager and compiled run the same kernel on the same grads: bit for bit.
        for a, b in zip(params, ref_params):
            assert torch.equal(a, b)


# ---------------------------------------------------------------- io_engine from a tuning file
@pytest.mark.parametrize("form", ["IOConfig", "path", "str"])
def test_tuning_file_reaches_the_swap_pipeline(tmp_path, form):
    tuned = IOConfig(engine="threads", queue_depth=3, block_size=8192, direct=False)
    path = tmp_path / "tuning.json"
    save_tuning(path, tuned)
    io_engine = {"IOConfig": load_tuning(path), "path": path, "str": str(path)}[form]
    params = _params(numel=8192)
    ref_params = _clone(params)
    ref = torch.optim.AdamW(ref_params, lr=0.01)
    (tmp_path / "swap").mkdir()
    with offload.AdamW(params, lr=0.01, offload="nvme", swap_dir=str(tmp_path / "swap"),
                       io_engine=io_engine) as opt:
        engine = internals.swap(opt).store.engine
        assert (engine.name, engine.queue_depth, engine.block_size, engine.direct) == ("threads", 3, 8192, False)
        for s in range(2):
            _step_both([(opt, params), (ref, ref_params)], s)
        stats = engine.stats()
        # Every request was cut at the tuned block size: 64 KiB of states per param and slot.
        assert stats["pieces"] >= (stats["bytes_written"] + stats["bytes_read"]) // 8192 > 0
        assert stats["pieces"] > stats["requests"]
    _assert_same(params, ref_params)


# ---------------------------------------------------------------- functional adam_step
@pytest.mark.parametrize("bad", ["grad dtype", "grad numel", "exp_avg dtype", "scale nan", "scale inf",
                                 "scale negative", "step 0"])
def test_adam_step_validates_every_tensor_before_updating_any(bad):
    params = [torch.ones(4), torch.ones(4)]
    grads = [torch.ones(4), torch.ones(4)]
    ms = [torch.zeros(4), torch.zeros(4)]
    vs = [torch.zeros(4), torch.zeros(4)]
    steps = [1, 1]
    scale = 1.0
    if bad == "grad dtype":
        grads[1] = torch.ones(4, dtype=torch.float64)
    elif bad == "grad numel":
        grads[1] = torch.ones(5)
    elif bad == "exp_avg dtype":
        ms[1] = torch.zeros(4, dtype=torch.float16)
    elif bad == "step 0":
        steps[1] = 0
    else:
        scale = {"scale nan": float("nan"), "scale inf": float("inf"), "scale negative": -1.0}[bad]
    hyper = AdamHyper(lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True,
                      grad_scale=scale)
    with pytest.raises((TypeError, ValueError), match="grad_scale|tensor 1"):
        adam_step(params, grads, ms, vs, steps, hyper)
    assert torch.equal(params[0], torch.ones(4))
    assert torch.equal(ms[0], torch.zeros(4)) and torch.equal(vs[0], torch.zeros(4))


# ---------------------------------------------------------------- copy, pickle, torch.save
def _torch_save_load(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_host_store_copies_keep_everything(how):
    params = _params()
    opt = offload.AdamW(params, lr=0.01, max_grad_norm=1.0)
    for s in range(2):
        _step_both([(opt, params)], s)
    dup = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o)),
           "torch.save": _torch_save_load}[how](opt)
    dup_params = [p for g in dup.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(params, dup_params))
    # the copy's store works on the copy's torch state (through the copy's step context)
    assert internals.store(dup).ctx is dup._ctx and dup._ctx.torch_state.state is dup.state
    for s in range(2, 4):
        _step_both([(opt, params), (dup, dup_params)], s)
    for a, b in zip(params, dup_params):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], dup.state[b]["exp_avg_sq"])
    assert dup.state[dup_params[0]]["step"] == 4


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("cls", [offload.AdamW, offload.SGD])
def test_a_copy_leaves_the_schedulers_step_and_the_hooks_behind(how, cls):
    """As torch's: an LR scheduler wraps ``opt.step`` in an instance attribute holding the
    original; copied along, the copy's step() stepped the original. Hooks stay behind too
    (a lambda hook made pickling fail)."""
    params = _params()
    init = [p.detach().clone().requires_grad_() for p in params]
    opt = cls(params, lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append(o))
    _step_both([(opt, params)], 0)
    sched.step()
    dup = {"deepcopy": copy.deepcopy, "pickle": lambda o: pickle.loads(pickle.dumps(o)),
           "torch.save": _torch_save_load}[how](opt)
    dup_params = [p for g in dup.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in params]
    calls.clear()
    _step_both([(dup, dup_params)], 1)
    assert all(torch.equal(a, b) for a, b in zip(params, before)), "the copy's step moved the original's params"
    assert not all(torch.equal(a, b) for a, b in zip(dup_params, before))
    assert calls == [] and dup.param_groups[0]["lr"] == 0.005
    ref = init
    ref_opt = torch.optim.SGD(ref, lr=0.01) if cls is offload.SGD else torch.optim.AdamW(ref, lr=0.01)
    _step_both([(ref_opt, ref)], 0)  # the original's first step, then the copy's second one
    ref_opt.param_groups[0]["lr"] = 0.005
    _step_both([(ref_opt, ref)], 1)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(dup_params, ref))


@pytest.mark.parametrize("store", ["host", "nvme"])
def test_a_step_running_in_another_thread_is_refused(tmp_path, store, monkeypatch):
    """Two threads in one optimizer's step both read the same committed states: 11 calls
    from two threads left an nvme store's step count at 9 or 10, silently."""
    import threading

    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "nvme" else {}
    params = _params()
    with offload.AdamW(params, lr=0.01, **kw) as opt:
        inside, release = threading.Event(), threading.Event()
        real = type(opt)._store_step

        def slow(self, *a, **k):
            inside.set()
            release.wait(10)
            return real(self, *a, **k)

        monkeypatch.setattr(type(opt), "_store_step", slow)
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        t = threading.Thread(target=opt.step)
        t.start()
        assert inside.wait(10)
        with pytest.raises(RuntimeError, match=r"AdamW.step\(\) is already running in thread \d+: one optimizer steps "
                                               r"in one thread at a time"):
            opt.step()
        release.set()
        t.join(10)
        monkeypatch.undo()
        opt.step()  # the guard let go of the step that ran
        assert int(opt.state[params[0]]["step"]) == 2
        opt.register_step_pre_hook(lambda o, a, k: None)
        with pytest.raises(RuntimeError, match=r"already running in this thread \(a closure that calls step"):
            opt.step(lambda: opt.step())
        assert int(opt.state[params[0]]["step"]) == 2


@pytest.mark.parametrize("store", ["flat", "nvme"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_other_stores_refuse_to_be_copied(tmp_path, store, how):
    dtype = torch.bfloat16 if store == "flat" else torch.float32
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "nvme" else {}
    with offload.AdamW(_params(dtype=dtype), **kw) as opt:
        fn = {"deepcopy": copy.deepcopy, "pickle": pickle.dumps, "torch.save": lambda o: torch.save(o, io.BytesIO())}
        with pytest.raises(TypeError, match=r"cannot pickle or copy AdamW .*save opt.state_dict\(\) or "
                                            r"opt.save_checkpoint\(DIR\) instead"):
            fn[how](opt)


# ---------------------------------------------------------------- params replaced after construction
@pytest.mark.parametrize("store", ["flat", "nvme"])
def test_replaced_params_are_refused_at_step(tmp_path, store):
    dtype = torch.bfloat16 if store == "flat" else torch.float32
    kw = dict(offload="nvme", swap_dir=str(tmp_path)) if store == "nvme" else {}
    with offload.AdamW(_params(dtype=dtype), **kw) as opt:
        new = _params(dtype=dtype, seed=1)
        opt.param_groups[0]["params"] = new
        for p, g in zip(new, _grads(new, 0)):
            p.grad = g
        before = [p.detach().clone() for p in new]
        with pytest.raises(RuntimeError, match=r"no longer holds the params .*add_param_group\(\)"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(new, before))


def test_replaced_params_still_work_with_the_host_store():
    # As torch: states are keyed by the param in opt.state, so any fp32 CPU param steps.
    opt = offload.AdamW(_params(), lr=0.01)
    new = _params(seed=1)
    ref_params = _clone(new)
    ref = torch.optim.AdamW(ref_params, lr=0.01)
    opt.param_groups[0]["params"] = new
    _step_both([(opt, new), (ref, ref_params)], 0)
    _assert_same(new, ref_params)


def test_add_param_group_is_not_a_replacement():
    params = _params(dtype=torch.bfloat16)
    opt = offload.AdamW(params)
    opt.add_param_group({"params": _params(dtype=torch.bfloat16, seed=2)})
    allp = [p for g in opt.param_groups for p in g["params"]]
    before = [p.detach().clone() for p in allp]
    _step_both([(opt, allp)], 0)  # the params registered by add_param_group pass the pre-hook
    assert all(not torch.equal(a, b) for a, b in zip(allp, before))


# ---------------------------------------------------------------- a job that gains ranks
_RANK_SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    import offload

    p_auto, p_zero = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.ones(8))
    auto = offload.AdamW([p_auto], lr=0.1)          # built alone: stage 0 chosen
    explicit = offload.AdamW([p_zero], lr=0.1, stage=0)
    # (rank and port as arguments: both ranks fork from one warm interpreter, whose key is the env)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=int(sys.argv[1]),
                            world_size=2)
    for name, opt, p in (("auto", auto, p_auto), ("explicit", explicit, p_zero)):
        p.grad = torch.ones(8)
        try:
            opt.step()
            print(name, "STEPPED", flush=True)
        except RuntimeError as exc:
            print(name, "REFUSED", exc, flush=True)
    dist.destroy_process_group()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_optimizer_built_before_init_process_group_refuses_to_step():
    from _forkserver import spawn  # forked from a warm interpreter: ~2 s of importing torch less per rank

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    port = str(_free_port())
    procs = [spawn(_RANK_SCRIPT, str(r), port, env=env) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-2000:]
        lines = dict(line.split(" ", 1) for line in out.splitlines())
        assert lines["auto"].startswith("REFUSED AdamW was built before torch.distributed was initialised"), out
        assert "build the optimizer after init_process_group()" in lines["auto"] and "stage=0" in lines["auto"]
        assert lines["explicit"] == "STEPPED", out


@pytest.mark.parametrize("cls", [offload.AdamW, offload.SGD, offload.Adagrad, offload.Lion])
def test_optimizer_options_in_a_param_group_are_refused(cls, tmp_path):
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="'state_dtype' is an option of the whole optimizer"):
        cls([{"params": [p], "state_dtype": "int8"}, {"params": [q]}], lr=0.1)
    opt = cls([p], lr=0.1)
    with pytest.raises(ValueError, match="'offload', 'max_grad_norm' are options of the whole optimizer"):
        opt.add_param_group({"params": [q], "max_grad_norm": 1.0, "offload": "cpu"})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "lr": 0.5})  # a group's own hyperparameters are fine
    assert opt.param_groups[1]["lr"] == 0.5
    # a group that repeats the constructor's value is taken (torch's ZeroRedundancyOptimizer
    # puts its keywords into every group of the optimizer it builds)
    r = torch.nn.Parameter(torch.randn(3))
    again = cls([{"params": [r], "offload": "cpu", "max_grad_norm": 1.0}], lr=0.1, offload="cpu", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="'max_grad_norm' is an option of the whole optimizer"):
        again.add_param_group({"params": [p], "offload": "cpu", "max_grad_norm": 2.0})
    with pytest.raises(ValueError, match="'max_host_bytes' is an option"):  # the same bytes, another type
        cls([{"params": [r], "max_host_bytes": 1 << 20}], lr=0.1, offload="nvme", swap_dir=str(tmp_path),
            max_host_bytes="1MiB")
    # equal values of other types are the same option (1 and 1.0, a str and a Path); the value
    # compared is the optimizer's now (max_grad_norm may be set since), and a refusal says both
    s = torch.nn.Parameter(torch.randn(3))
    swap = cls([{"params": [s], "max_grad_norm": 1, "swap_dir": tmp_path}], lr=0.1, offload="nvme",
               swap_dir=str(tmp_path), max_grad_norm=1.0)
    swap.close()
    again.max_grad_norm = 5.0
    with pytest.raises(ValueError, match="the group's max_grad_norm=1.0, the optimizer's 5.0"):
        again.add_param_group({"params": [q], "max_grad_norm": 1.0})
    again.add_param_group({"params": [q], "max_grad_norm": 5})
