"""torch's own optimizer test database run against ``offload.Adam`` / ``offload.AdamW``.

``torch.testing._internal.common_optimizers.optim_db`` ships in the torch wheel and holds, for
each optimizer, the constructor configurations torch tests (``optim_inputs_func``) and the
bad inputs with the exception type and message torch's tests expect (``optim_error_inputs_func``).
torch's ``test/test_optim.py`` (not shipped) drives them; the few checks of it that matter
for a drop-in replacement are redone here with the optimizer class swapped for ours:

- ``test_errors``: every error input raises (or warns) with torch's type and message;
- the numerics of every configuration we support, on identical grads, against torch's
  own optimizer (foreach=False: the contract of DESIGN.md) at rtol 1e-5 / atol 1e-6: params,
  ``exp_avg``, ``exp_avg_sq`` and ``step``, read both from ``state_dict()`` and ``opt.state[p]``;
- ``state_dict`` round trips both ways (torch -> ours, ours -> torch) that keep training on
  as if nothing happened (torch's ``test_state_dict_*`` load a deepcopy, so do we);
- a few of these also with ``offload="cpu"`` and ``"nvme"``, fp32 and bf16 params.

Every check runs on torch's class too, so a harness that tests nothing fails.
"""
from __future__ import annotations

import copy
import sys
import types
import unittest
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import _torch_compat
import offload
from _lazy import lazy_value


def _common_optimizers():
    # common_utils imports expecttest, a test-only dependency of torch that its wheel does not
    # require, only for a TestCase base class; a stand-in keeps this file runnable without it.
    added = False
    try:
        import expecttest  # noqa: F401
    except ModuleNotFoundError:
        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub
        added = True
    try:
        from torch.testing._internal import common_optimizers
    except ImportError as exc:  # torch < 2.2 has no optim_db
        pytest.skip(f"torch {torch.__version__} has no torch.testing._internal.common_optimizers: {exc}",
                    allow_module_level=True)
    finally:
        if added:
            del sys.modules["expecttest"]
    return common_optimizers


# Imported when a test first needs it (tests/_lazy.py): ~3 s of CPU in every worker otherwise.
CO = lazy_value(_common_optimizers)
INFOS = lazy_value(lambda: {info.name: info for info in CO.optim_db
                            if info.optim_cls in (torch.optim.Adam, torch.optim.AdamW)})
OURS = {"Adam": offload.Adam, "AdamW": offload.AdamW}
TORCH = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}
NAMES = sorted(OURS)

# Configurations torch supports that offload.Adam/AdamW refuse on purpose, with a
# NotImplementedError that names the flag:
# - capturable: a step captured in a CUDA graph cannot do host-side work or swap I/O;
# - differentiable: the kernels update the states in place outside autograd.
REFUSED = ("capturable", "differentiable")

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6


def test_optim_db_has_adam_and_adamw():
    assert set(INFOS) == {"Adam", "AdamW"}
    for info in INFOS.values():
        assert len(_error_inputs(info)) >= 12
        assert len(_configs(info)) >= 8


# ---------------------------------------------------------------- error inputs (test_errors)
def _device_only_error_inputs():
    """The error inputs torch lists only for CUDA devices, rebuilt on a CPU tensor: the
    constructor checks they exercise do not depend on the device."""
    t = torch.empty(())
    return [
        CO.ErrorOptimizerInput(CO.OptimizerInput(params=[t], kwargs={"foreach": True, "fused": True}, desc="fused and foreach"),
                               error_type=RuntimeError, error_regex="`fused` and `foreach` cannot be `True` together"),
        CO.ErrorOptimizerInput(CO.OptimizerInput(params=[t], kwargs={"fused": True, "differentiable": True}, desc="fused, differentiable"),
                               error_type=RuntimeError, error_regex="`fused` does not support `differentiable`"),
    ]


def _error_inputs(info):
    return info.optim_error_inputs_func(device="cpu", dtype=torch.float32) + _device_only_error_inputs()


def _expect_error(cls, error_input) -> None:
    """torch's test_errors, for one error input."""
    oi = error_input.optimizer_error_input
    expect = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
    with expect(error_input.error_type, match=error_input.error_regex):
        opt = cls(oi.params, **oi.kwargs)
        if error_input.error_on == CO.OptimizerErrorEnum.STEP_ERROR:
            opt.step()


@pytest.mark.parametrize("impl", ["torch", "offload"])
@pytest.mark.parametrize("name", NAMES)
def test_error_inputs(name, impl):
    cls = (TORCH if impl == "torch" else OURS)[name]
    for error_input in _error_inputs(INFOS[name]):
        try:
            _expect_error(cls, error_input)
        except BaseException as exc:
            raise AssertionError(f"{impl} {name}: {error_input.optimizer_error_input.desc!r}: {exc}") from exc


# ---------------------------------------------------------------- configurations
def _kwargs_key(kwargs):
    return repr(sorted((k, repr(v)) for k, v in kwargs.items()))


def _configs(info):
    """(desc, kwargs) of every configuration torch tests on any device (those listed for CUDA
    and MPS only construct fine on CPU tensors), each refused one also without its refused
    flags (e.g. "Tensor lr, Tensor betas" without capturable), and the global-cliquey flags
    torch's tests add themselves (foreach, fused, differentiable) on the default one."""
    out, seen = [], set()

    def add(desc, kwargs):
        key = _kwargs_key(kwargs)
        if key not in seen:
            seen.add(key)
            out.append((desc, kwargs))

    for device in ("cpu", "cuda", "mps"):
        for oi in info.optim_inputs_func(device, torch.float32):
            add(oi.desc, dict(oi.kwargs))
            if any(oi.kwargs.get(flag) for flag in REFUSED):
                add(oi.desc + " (without " + ", ".join(REFUSED) + ")",
                    {k: v for k, v in oi.kwargs.items() if k not in REFUSED})
    add("foreach", {"foreach": True})
    add("foreach=False", {"foreach": False, "weight_decay": 0.1})
    add("fused", {"fused": True, "maximize": True})
    add("differentiable", {"differentiable": True})
    return out


def _refused(kwargs):
    return [flag for flag in REFUSED if kwargs.get(flag)]


def _config_ids(name):
    return [desc for desc, _ in _configs(INFOS[name])]


@pytest.mark.parametrize("name", NAMES)
def test_capturable_is_refused_and_differentiable_is_torchs(name):
    configs = [(desc, kw) for desc, kw in _configs(INFOS[name]) if _refused(kw)]
    assert {flag for _, kw in configs for flag in _refused(kw)} == set(REFUSED)
    for desc, kwargs in configs:
        TORCH[name]([torch.zeros(3, requires_grad=True)], **kwargs)  # torch takes it
        if kwargs.get("differentiable"):  # torch's own optimizer ([Note: differentiable steps are torch's])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert type(OURS[name]([torch.zeros(3, requires_grad=True)], **kwargs)) is TORCH[name], desc
            continue
        with pytest.raises(NotImplementedError, match="capturable"):
            OURS[name]([torch.zeros(3, requires_grad=True)], **kwargs)


def _params(dtype=torch.float32, seed=0):
    """Sizes that exercise the kernels' vector bodies and tails, an empty one, and a 2-D one."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1,), (7,), (0,), (33, 31), (4099,)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _groups(params, kwargs):
    """Two groups, the second with its own lr, weight_decay, betas and eps (supports_param_groups)."""
    lr = kwargs.get("lr", 1e-3)
    return [{"params": params[:2]},
            {"params": params[2:], "lr": lr * 2, "weight_decay": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}]


def _grads(params, step, seed=1):
    """Identical grads for both optimizers; param 1 has none at step 1 (torch skips it)."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out = []
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        out.append(None if (i == 1 and step == 1) else g)
    return out


def _step(opt, params, grads, dtype=None):
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.to(dtype or p.dtype)
    opt.step()


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _check_groups(ours, ref) -> None:
    og, rg = ours.state_dict()["param_groups"], ref.state_dict()["param_groups"]
    assert len(og) == len(rg)
    newer = _torch_compat.adam_group_keys_missing()  # keys torch 2.6's Adam has not yet
    for a, b in zip(og, rg):
        assert set(a) - newer == set(b) - newer, set(a) ^ set(b)
        # foreach/fused: ours keeps what the user asked for, the reference runs foreach=False.
        if not _torch_compat.adam_steps_with_tensor_hyperparameters():  # ref built with floats
            a = _torch_compat.plain_hyperparameters(a)
        bad = [k for k in a if k not in ("foreach", "fused", *newer) and not _same(a[k], b[k])]
        assert not bad, [(k, a[k], b[k]) for k in bad]


def _check_state(ours, ref, ours_params, ref_params, *, master=False) -> None:
    """Params, moments and steps of ``ours`` against the reference ``ref`` (fp32 params)."""
    osd, rsd = ours.state_dict(), ref.state_dict()
    assert sorted(osd["state"]) == sorted(rsd["state"])
    for i, (po, pr) in enumerate(zip(ours_params, ref_params)):
        so, sr = osd["state"][i], rsd["state"][i]
        assert set(so) == set(sr) | ({"master"} if master else set()), (i, set(so))
        assert so["step"].dtype == sr["step"].dtype and torch.equal(so["step"], sr["step"]), (i, so["step"], sr["step"])
        for key in sorted(set(sr) - {"step"}):  # the moments, and amsgrad's max_exp_avg_sq
            torch.testing.assert_close(so[key], sr[key], rtol=RTOL, atol=ATOL, msg=lambda m: f"param {i} {key}: {m}")
            torch.testing.assert_close(ours.state[po][key], sr[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"opt.state[param {i}][{key!r}]: {m}")
        if master:
            torch.testing.assert_close(so["master"], pr.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"master {i}: {m}")
            # The low-precision param is the round-to-nearest-even copy of its master.
            assert torch.equal(po.detach(), so["master"].to(po.dtype)), i
        else:
            torch.testing.assert_close(po.detach(), pr.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"param {i}: {m}")


def _reference(name, params, kwargs):
    kw = _torch_compat.plain_hyperparameters({k: v for k, v in kwargs.items() if k not in ("foreach", "fused")})
    return TORCH[name](_groups(params, kw), foreach=False, **kw)


def _run_pair(name, kwargs, *, dtype=torch.float32, extra=None, steps=STEPS):
    ref_params = [p.detach().float().clone().requires_grad_() for p in _params(dtype)]
    ours_params = _params(dtype)
    ours = OURS[name](_groups(ours_params, kwargs), **kwargs, **(extra or {}))
    ref = _reference(name, ref_params, kwargs)
    try:
        for step in range(steps):
            grads = _grads(ref_params, step)
            if dtype != torch.float32:  # the reference sees the very values ours reads
                grads = [None if g is None else g.to(dtype).float() for g in grads]
            _step(ours, ours_params, grads, dtype)
            _step(ref, ref_params, grads)
        _check_groups(ours, ref)
        _check_state(ours, ref, ours_params, ref_params, master=dtype != torch.float32)
    finally:
        ours.close()


@pytest.mark.parametrize("name", NAMES)
def test_every_supported_configuration_matches_torch(name):
    supported = [(desc, kw) for desc, kw in _configs(INFOS[name]) if not _refused(kw)]
    assert len(supported) >= 8
    for desc, kwargs in supported:
        try:
            _run_pair(name, kwargs)
        except BaseException as exc:
            raise AssertionError(f"{name} {desc!r} {kwargs}: {exc}") from exc


# ---------------------------------------------------------------- state_dict round trips
def _train(opt, params, first, last):
    for step in range(first, last):
        _step(opt, params, _grads(params, step))


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adam", "amsgrad"])
@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name, direction, amsgrad):
    """Train 3 steps with one implementation, load its state_dict into the other on copies of
    the params, train 2 more with both on identical grads: the same as 5 with the reference."""
    kwargs = {"lr": 0.01, "weight_decay": 0.1, "maximize": True, "amsgrad": amsgrad}
    ref_params = _params()
    ref = _reference(name, ref_params, kwargs)
    ours_params = _params()
    ours = OURS[name](_groups(ours_params, kwargs), **kwargs)
    first, first_params = (ref, ref_params) if direction == "torch_to_ours" else (ours, ours_params)
    _train(first, first_params, 0, 3)
    later_params = [p.detach().clone().requires_grad_() for p in first_params]
    later = (OURS[name] if first is ref else TORCH[name])(_groups(later_params, kwargs), **kwargs)
    later.load_state_dict(copy.deepcopy(first.state_dict()))
    _train(first, first_params, 3, 5)
    _train(later, later_params, 3, 5)
    ours_side, ours_side_params = (later, later_params) if first is ref else (first, first_params)
    ref_side, ref_side_params = (first, first_params) if first is ref else (later, later_params)
    _check_groups(ours_side, ref_side)
    _check_state(ours_side, ref_side, ours_side_params, ref_side_params)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_layout_is_torchs(name):
    """Saved before and after steps, the dicts have torch's keys, param ids and group fields."""
    params, ref_params = _params(), _params()
    ours, ref = OURS[name](_groups(params, {}), lr=0.01), TORCH[name](_groups(ref_params, {}), lr=0.01)
    for _ in range(2):
        o, r = ours.state_dict(), ref.state_dict()
        assert list(o) == list(r) == ["state", "param_groups"]
        assert [g["params"] for g in o["param_groups"]] == [g["params"] for g in r["param_groups"]]
        _check_groups(ours, ref)
        _train(ours, params, 0, 1)
        _train(ref, ref_params, 0, 1)


# ---------------------------------------------------------------- other stores
STORE_CONFIGS = [("default", {}), ("maximize", {"lr": 0.01, "weight_decay": 0.1, "maximize": True}),
                 ("amsgrad", {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
                 ("Tensor lr, Tensor betas", {"lr": torch.tensor(0.01), "betas": (torch.tensor([0.9]), torch.tensor(0.99))})]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("offload_to", ["cpu", "nvme"])
@pytest.mark.parametrize("name", NAMES)
def test_offloaded_stores_match_torch(name, offload_to, dtype, tmp_path):
    for desc, kwargs in STORE_CONFIGS:
        extra = {"offload": offload_to}
        if offload_to == "nvme":
            swap = tmp_path / desc
            swap.mkdir()
            extra["swap_dir"] = str(swap)
        try:
            _run_pair(name, kwargs, dtype=dtype, extra=extra)
        except BaseException as exc:
            raise AssertionError(f"{name} {desc!r} offload={offload_to} {dtype}: {exc}") from exc


@pytest.mark.parametrize("offload_to", ["cpu", "nvme"])
@pytest.mark.parametrize("name", NAMES)
def test_offloaded_round_trip_through_torch(name, offload_to, tmp_path):
    """fp32 params: ours (offloaded) -> torch -> a new ours (offloaded), on identical grads."""
    kwargs = {"lr": 0.01, "weight_decay": 0.1}
    extra = {"offload": offload_to}
    if offload_to == "nvme":
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
    params, ref_params = _params(), _params()
    ours = OURS[name](_groups(params, kwargs), **kwargs, **extra,
                      **({"swap_dir": str(tmp_path / "a")} if offload_to == "nvme" else {}))
    ref = _reference(name, ref_params, kwargs)
    _train(ours, params, 0, 2)
    _train(ref, ref_params, 0, 2)
    mid_params = [p.detach().clone().requires_grad_() for p in params]
    mid = TORCH[name](_groups(mid_params, kwargs), **kwargs)
    mid.load_state_dict(copy.deepcopy(ours.state_dict()))
    ours.close()
    _train(mid, mid_params, 2, 3)
    _train(ref, ref_params, 2, 3)
    new_params = [p.detach().clone().requires_grad_() for p in mid_params]
    new = OURS[name](_groups(new_params, kwargs), **kwargs, **extra,
                     **({"swap_dir": str(tmp_path / "b")} if offload_to == "nvme" else {}))
    try:
        new.load_state_dict(copy.deepcopy(mid.state_dict()))
        _train(new, new_params, 3, 5)
        _train(ref, ref_params, 3, 5)
        _check_groups(new, ref)
        _check_state(new, ref, new_params, ref_params)
    finally:
        new.close()


# ---------------------------------------------------------------- more of torch's test_optim.py
def _store_kwargs(store, tmp_path):
    """(param dtype, constructor extras) of a store: host (fp32 in place), flat (bf16), nvme (fp32)."""
    if store == "nvme":
        return torch.float32, {"offload": "nvme", "swap_dir": str(tmp_path)}
    return (torch.bfloat16 if store == "flat" else torch.float32), {}


STORES = ["host", "flat", "nvme"]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", NAMES)
def test_can_load_older_state_dict(name, store, tmp_path):
    """test_can_load_older_state_dict and test_load_nontensor_step: a dict of an older torch
    (flags added since missing, float steps) loads, and training goes on as from the full dict."""
    dtype, extra = _store_kwargs(store, tmp_path)
    params = _params(dtype)
    with OURS[name](_groups(params, {}), lr=0.01, **extra) as opt:
        _train(opt, params, 0, 2)
        sd = copy.deepcopy(opt.state_dict())
        old = copy.deepcopy(sd)
        for group in old["param_groups"]:
            for flag in INFOS[name].not_og_supported_flags + ("decoupled_weight_decay",):
                group.pop(flag, None)
        for st in old["state"].values():
            st["step"] = float(st["step"])
        after = []
        for loaded in (sd, old):
            opt.load_state_dict(loaded)
            for p, saved in zip(params, _params(dtype)):
                p.data.copy_(saved)  # the same params for both runs
            _train(opt, params, 2, 4)
            after.append(([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())))
        (p_full, sd_full), (p_old, sd_old) = after
        assert all(torch.equal(a, b) for a, b in zip(p_full, p_old))
        for group in sd_old["param_groups"]:
            assert group["decoupled_weight_decay"] is (name == "AdamW")
            assert group["maximize"] is False and group["capturable"] is False and group["differentiable"] is False
        for i, st in sd_old["state"].items():
            assert torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32
            assert all(torch.equal(st[k], sd_full["state"][i][k]) for k in st), i


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", NAMES)
def test_save_load_equality_with_weights_only(name, store, tmp_path):
    """torch.save(opt.state_dict()) loads with torch.load(weights_only=True) into the same
    structure (only tensors and plain Python values inside)."""
    dtype, extra = _store_kwargs(store, tmp_path)
    params = _params(dtype)
    with OURS[name](_groups(params, {"lr": torch.tensor(0.01)}), lr=torch.tensor(0.01), **extra) as opt:
        _train(opt, params, 0, 2)
        sd = opt.state_dict()
        path = tmp_path / "sd.pt"
        torch.save(sd, path)
        loaded = torch.load(path, weights_only=True)
        assert len(loaded["param_groups"]) == len(sd["param_groups"])
        for a, b in zip(loaded["param_groups"], sd["param_groups"]):
            assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a), (a, b)
        assert sorted(loaded["state"]) == sorted(sd["state"])
        for i, st in sd["state"].items():
            assert set(loaded["state"][i]) == set(st)
            assert all(torch.equal(loaded["state"][i][k], v) for k, v in st.items())
        opt.load_state_dict(loaded)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", NAMES)
def test_named_params(name, store, tmp_path):
    """test_state_dict_with_named_params: (name, param) pairs give "param_names" in the groups,
    as torch's; the steps are torch's."""
    dtype, extra = _store_kwargs(store, tmp_path)
    params, ref_params = _params(dtype), [p.detach().float().clone().requires_grad_() for p in _params(dtype)]
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    ref_named = [(f"p{i}", p) for i, p in enumerate(ref_params)]
    with OURS[name](named, lr=0.01, **extra) as opt:
        ref = TORCH[name](ref_named, lr=0.01, foreach=False)
        for step in range(2):
            grads = [None if g is None else g.to(dtype).float() for g in _grads(ref_params, step)]
            _step(opt, params, grads, dtype)
            _step(ref, ref_params, grads)
        assert opt.state_dict()["param_groups"][0]["param_names"] == [n for n, _ in named]
        _check_groups(opt, ref)
        _check_state(opt, ref, params, ref_params, master=dtype != torch.float32)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", NAMES)
def test_step_is_noop_without_grads_or_with_zero_grads(name, store, tmp_path):
    """test_step_is_noop_when_params_have_no_grad and test_step_is_noop_for_zero_grads."""
    dtype, extra = _store_kwargs(store, tmp_path)
    params = _params(dtype)
    before = [p.detach().clone() for p in params]
    with OURS[name](params, lr=0.01, weight_decay=0.0, **extra) as opt:
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert not opt.state_dict()["state"]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert all(int(st["step"]) == 1 for st in opt.state_dict()["state"].values())


@pytest.mark.parametrize("name", NAMES)
def test_step_hooks_and_repr(name):
    """test_step_all_hooks and test_optimizer_can_be_printed: the global and per-optimizer
    step pre and post hooks run around our step, in torch's order."""
    params = _params()
    opt = OURS[name](params, lr=0.01)
    seen = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append("global pre")),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append("global post")),
               opt.register_step_pre_hook(lambda o, a, k: seen.append("pre")),
               opt.register_step_post_hook(lambda o, a, k: seen.append("post"))]
    try:
        _train(opt, params, 0, 1)
    finally:
        for h in handles:
            h.remove()
    assert seen == ["global pre", "pre", "post", "global post"]
    assert repr(opt).startswith(f"{name} (") and "lr: 0.01" in repr(opt)


@pytest.mark.parametrize("dtype", [torch.complex128])
@pytest.mark.parametrize("name", NAMES)
def test_complex128_params_refused(name, dtype):
    """complex128: refused on purpose (the kernels keep fp32 masters), with
    NotImplementedError naming torch's optimizer. (complex64, torch's test_complex, and
    float64: test_complex_params.py, test_float64_params.py.)"""
    with pytest.raises(NotImplementedError, match=f"{dtype}.*torch.optim"):
        OURS[name]([torch.zeros(3, dtype=dtype, requires_grad=True)])


def _sched_step(scheduler) -> None:
    # ReduceLROnPlateau needs a metric: a constant one, so it cuts the lr once its patience is out.
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(1.0)
    else:
        scheduler.step()


@pytest.mark.parametrize("name", NAMES)
def test_scheduler_inputs(name):
    """The LR schedulers optim_db lists for Adam/AdamW (scheduler_inputs) drive ours as
    torch's: the same lr in every group at every step, the same params and states after 14."""
    for schedulers in INFOS[name].scheduler_inputs:
        params, ref_params = _params(), _params()
        ours = OURS[name](_groups(params, {}), lr=0.01)
        ref = TORCH[name](_groups(ref_params, {}), lr=0.01, foreach=False)
        pairs = [(make(ours), make(ref)) for make in schedulers]
        lrs = {float(ours.param_groups[0]["lr"])}
        for step in range(14):
            _train(ours, params, step, step + 1)
            _train(ref, ref_params, step, step + 1)
            for a, b in pairs:
                _sched_step(a)
                _sched_step(b)
            assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups], step
            lrs.add(float(ours.param_groups[0]["lr"]))
        assert len(lrs) > 1  # the schedulers did act
        _check_state(ours, ref, params, ref_params)


@pytest.mark.parametrize("size", [22, 55, 128, 1024, 1048576 + 3])
def test_deepspeed_cpu_adam_expectations(size):
    """DeepSpeed's tests/unit/ops/adam/test_cpu_adam.py with offload.AdamW in place of
    DeepSpeedCPUAdam: one fp32 CPU param of each size, 10 steps against torch.optim.AdamW on
    cloned grads, params and optimizer.state[param]["exp_avg"/"exp_avg_sq"] compared."""
    gen = torch.Generator().manual_seed(size)
    param = torch.nn.Parameter(torch.randn(size, generator=gen))
    ref_param = torch.nn.Parameter(param.detach().clone())
    opt, ref = offload.AdamW([param]), torch.optim.AdamW([ref_param], foreach=False)
    for _ in range(10):
        param.grad = torch.randn(size, generator=gen)
        ref_param.grad = param.grad.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(param, ref_param, rtol=RTOL, atol=ATOL)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[param][key], ref.state[ref_param][key], rtol=RTOL, atol=ATOL)


def test_torchao_cpu_offload_expectations():
    """torchao's CPUOffloadOptimizer builds ``optimizer_class([p], fused=True, **kwargs)`` for
    each param and steps them one by one: with offload.AdamW as that class, the training is
    torch.optim.AdamW's over all params."""
    params, ref_params = _params(), _params()
    per_param = [offload.AdamW([p], lr=0.01, weight_decay=0.1, fused=True) for p in params]
    ref = torch.optim.AdamW(ref_params, lr=0.01, weight_decay=0.1, foreach=False)
    for step in range(3):
        grads = _grads(params, step)
        for p, g in zip(params, grads):
            p.grad = g
        for opt in per_param:
            opt.step()
        _step(ref, ref_params, grads)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
    for opt, p, r in zip(per_param, params, ref_params):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("name", NAMES)
def test_loading_dicts_of_refused_configurations(name, store, tmp_path):
    """A dict of torch's amsgrad=True optimizer (a third state, max_exp_avg_sq) into an
    optimizer built without amsgrad: the host store keeps each param's states and takes it
    (the groups then step with amsgrad, as torch's would); a flat or swapped store keeps one
    rule's fields for all params and refuses it before anything is loaded. One of a
    capturable or differentiable run holds the usual states: it loads with those flags
    cleared (and a warning), and trains on as torch."""
    dtype, extra = _store_kwargs(store, tmp_path)
    params, ref_params = _params(dtype), [p.detach().float().clone().requires_grad_() for p in _params(dtype)]
    with OURS[name](params, lr=0.01, **extra) as opt:
        ref = TORCH[name](ref_params, lr=0.01, foreach=False)
        ams_params = [p.detach().clone().requires_grad_() for p in ref_params]
        ams = TORCH[name](ams_params, lr=0.01, amsgrad=True)
        _train(ams, ams_params, 0, 1)
        before = copy.deepcopy(opt.state_dict())
        if store == "host":
            opt.load_state_dict(ams.state_dict())
            assert opt.param_groups[0]["amsgrad"] is True
            got, want = opt.state_dict()["state"], ams.state_dict()["state"]
            assert sorted(got) == sorted(want)
            for i in want:
                assert set(got[i]) == set(want[i]) and "max_exp_avg_sq" in got[i], (i, set(got[i]))
                assert all(torch.equal(got[i][k], want[i][k]) for k in want[i]), i
            opt.load_state_dict(before)  # and back: the dict without amsgrad
            assert opt.param_groups[0]["amsgrad"] is False and _same(opt.state_dict(), before)
        else:
            with pytest.raises(ValueError, match=r"param_groups\[0\] needs rule 'adam_amsgrad' .*"
                                                 r"keeps the states of rule 'adam'.*amsgrad="):
                opt.load_state_dict(ams.state_dict())
            assert opt.param_groups[0]["amsgrad"] is False and _same(opt.state_dict(), before)
        _train(ref, ref_params, 0, 1)
        sd = copy.deepcopy(ref.state_dict())
        sd["param_groups"][0].update(capturable=True, differentiable=True)
        for p, r in zip(params, ref_params):
            p.data.copy_(r)
        with pytest.warns(UserWarning, match=r"param_groups\[0\] had capturable=True, differentiable=True"):
            opt.load_state_dict(sd)
        assert opt.param_groups[0]["capturable"] is False and opt.param_groups[0]["differentiable"] is False
        if store == "flat":
            return  # a torch dict has no fp32 master of bf16 params: the rounded param is the master
        for step in range(1, 3):
            _step(opt, params, _grads(ref_params, step))
            _step(ref, ref_params, _grads(ref_params, step))
        _check_state(opt, ref, params, ref_params)


@pytest.mark.parametrize("store", STORES + ["nvme-bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_add_param_group(name, store, tmp_path):
    """add_param_group after some steps trains the new group as torch does (host and flat
    stores); with offload="nvme" it is refused (the swap files are laid out at construction)
    with NotImplementedError that says so, and the optimizer stays as it was."""
    dtype, extra = _store_kwargs(store.replace("-bf16", ""), tmp_path)
    dtype = torch.bfloat16 if store.endswith("bf16") else dtype
    params = _params(dtype)
    ref_params = [p.detach().float().clone().requires_grad_() for p in params]
    with OURS[name](params[:2], lr=0.01, **extra) as opt:
        ref = TORCH[name](ref_params[:2], lr=0.01, foreach=False)
        new_group = {"params": params[2:], "lr": 0.02, "weight_decay": 0.0}
        if store.startswith("nvme"):
            with pytest.raises(NotImplementedError, match="add_param_group .*not supported with offload='nvme'"):
                opt.add_param_group(new_group)
            assert len(opt.param_groups) == 1
            params, ref_params = params[:2], ref_params[:2]
        else:
            opt.add_param_group(new_group)
            ref.add_param_group({**new_group, "params": ref_params[2:]})
        for step in range(3):
            grads = [None if g is None else g.to(dtype).float() for g in _grads(ref_params, step)]
            _step(opt, params, grads, dtype)
            _step(ref, ref_params, grads)
        _check_groups(opt, ref)
        _check_state(opt, ref, params, ref_params, master=dtype != torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_params_replaced_in_param_groups_with_the_host_store(name):
    """As torch, whose states are keyed by the param: new fp32 CPU tensors assigned to
    param_groups[0]["params"] step as torch's; ones the store cannot update in place are
    refused by a clear ValueError before anything changes."""
    opt = OURS[name](_params(), lr=0.01)
    ref = TORCH[name](_params(), lr=0.01, foreach=False)
    _train(opt, opt.param_groups[0]["params"], 0, 1)
    _train(ref, ref.param_groups[0]["params"], 0, 1)
    new, ref_params = _params(seed=3), _params(seed=3)
    opt.param_groups[0]["params"] = new
    ref.param_groups[0]["params"] = ref_params
    for step in range(2):
        _step(opt, new, _grads(new, step))
        _step(ref, ref_params, _grads(ref_params, step))
    # (state_dict() raises KeyError in both: opt.state still holds the replaced params' states)
    for i, (p, r) in enumerate(zip(new, ref_params)):
        torch.testing.assert_close(p, r, rtol=RTOL, atol=ATOL)
        assert torch.equal(opt.state[p]["step"], ref.state[r]["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], ref.state[r][key], rtol=RTOL, atol=ATOL)
    low = [p.detach().bfloat16().requires_grad_() for p in new]
    opt.param_groups[0]["params"] = low
    for p in low:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in low]
    with pytest.raises(ValueError, match="parameter 0 has dtype torch.bfloat16; this optimizer updates fp32 CPU params"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(low, before))


@pytest.mark.parametrize("ours,theirs,kw", [(offload.Adam, torch.optim.Adam, {}), (offload.AdamW, torch.optim.AdamW, {}),
                                            (offload.SGD, torch.optim.SGD, {"lr": 0.1}),
                                            (offload.Adagrad, torch.optim.Adagrad, {})])
def test_fused_error_on_params_on_meta(ours, theirs, kw, tmp_path):
    """torch's test_fused_error_on_params_on_meta ([Note: params on the meta device] in
    step_guard.py): an optimizer over a model built on meta is taken; a step with grads on meta
    raises torch's fused message, changing nothing; after ``to_empty()`` (new params: the old
    ones stay on meta, without grads once zeroed) a step goes through. Without ``fused`` the
    refusal is ours (torch's for-loop steps nothing there). The stores that copy the params
    when built refuse meta ones then, saying to materialize first."""
    for cls in (theirs, ours):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1))
        opt = cls(model.parameters(), fused=True, **kw)
        with torch.device("meta"):
            for p in model.parameters():
                p.grad = torch.rand_like(p)
        with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating point Tensors"):
            opt.step()
        opt.zero_grad(set_to_none=True)
        model.to_empty(device="cpu")
        for p in model.parameters():
            p.grad = torch.rand_like(p)
        opt.step()
    with torch.device("meta"):
        model = torch.nn.Linear(2, 3)
    opt = ours(model.parameters(), **kw)
    for p in model.parameters():
        p.grad = torch.ones(p.shape, device="meta")
    with pytest.raises(RuntimeError, match="param 0 is on the meta device .no values to step.: materialize"):
        opt.step()
    assert all(float(st.get("step", 0)) == 0 for st in opt.state.values())
    for extra in ({"offload": "nvme", "swap_dir": str(tmp_path)}, {"stage": 1}):
        with pytest.raises(ValueError, match="parameter on meta .no values.: this store copies the params"):
            ours(model.parameters(), **kw, **extra)
    with pytest.raises(ValueError, match="parameter on meta"):
        ours(model.to(torch.bfloat16).parameters(), **kw)
