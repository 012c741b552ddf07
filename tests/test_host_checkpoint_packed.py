"""The host store's checkpoints hold compressed states as stored ([Note: packed host
checkpoints] in offload/zero/ckpt_packed.py): each param's packed int8 blocks, bf16 or (a
param under 4096 elements) float32 bytes, the forms per tensor in the manifest. They load
into the same store bit for bit (no decode/encode), into other state dtypes and the swapped
store as the state_dict route does, and a damaged file fails naming itself."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

import offload
from offload.kernels.quant import BLOCK, packed_nbytes
from offload.swap.layout import ALIGN, round_up

# sizes that break blocks, several shapes; the last two params never get a grad (step 0)
SHAPES = [(1,), (7,), (63, 65), (64, 64), (17, 241), (2 ** 20 + 3,), (3, 5), (4097,)]
KINDS = ["adamw", "sgd", "adagrad"]
DTYPES = ["int8", "bfloat16", "float32"]
STATES = {"adamw": ["exp_avg", "exp_avg_sq"], "sgd": ["momentum_buffer"], "adagrad": ["sum"]}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params[:-2]:
        p.grad = torch.randn(p.shape, generator=g)


def _make(kind, params, state_dtype, *, store="cpu", swap_dir=None):
    kw = dict(state_dtype=state_dtype, offload=store)
    if store == "nvme":
        os.makedirs(swap_dir, exist_ok=True)
        kw["swap_dir"] = str(swap_dir)
    if kind == "sgd":
        return offload.SGD(params, lr=1e-2, momentum=0.9, **kw)
    if kind == "adagrad":
        return offload.Adagrad(params, lr=1e-2, initial_accumulator_value=0.1, **kw)
    return offload.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)


def _trained(kind, state_dtype, steps=2, **kw):
    params = _params()
    opt = _make(kind, params, state_dtype, **kw)
    for s in range(steps):
        _grads(params, s)
        opt.step()
    return params, opt


def _raw(opt, params):
    """opt.state as stored, per param index (the tensors themselves)."""
    return [{k: v for k, v in opt.state[p].items()} if p in opt.state else {} for p in params]


def _assert_raw_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), i
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (i, k)
            assert torch.equal(x[k].view(torch.uint8) if x[k].dim() else x[k],
                               y[k].view(torch.uint8) if y[k].dim() else y[k]), (i, k)  # bits, NaNs too


def _stored_bytes(n, state_dtype):
    if n < 4096 or state_dtype == "float32":
        return 4 * n
    return packed_nbytes(n) if state_dtype == "int8" else 2 * n


def _same_state_dict(a, b):
    """The states of the stepped params equal (step-0 ones: see _route_states)."""
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        if float(sa[i].get("step", 1)) == 0 and float(sb[i].get("step", 1)) == 0:
            continue
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            torch.testing.assert_close(sa[i][k], sb[i][k], rtol=0, atol=0, msg=lambda m: f"param {i} {k}: {m}")


# ------------------------------------------------------------------ the same store, bit for bit
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_same_store_loads_bit_for_bit_and_steps_alike(tmp_path, monkeypatch, kind, state_dtype):
    params, opt = _trained(kind, state_dtype)
    opt.save_checkpoint(str(tmp_path / "ck"))
    loaded = _params(1)
    new = _make(kind, loaded, state_dtype)
    import offload.optim.host_state as hs

    def no_codec(*a, **k):
        raise AssertionError("a load of the store's own forms decoded or encoded a state")

    real = hs.HostState.load_checkpoint

    def guarded(self, directory):  # the store's load only (Adagrad makes fresh sums of step-0 params after it)
        with monkeypatch.context() as mp:
            mp.setattr(hs, "to_torch_layout", no_codec)
            mp.setattr(hs, "from_torch_layout", no_codec)
            return real(self, directory)

    monkeypatch.setattr(hs.HostState, "load_checkpoint", guarded)
    new.load_checkpoint(str(tmp_path / "ck"))
    monkeypatch.undo()
    _assert_raw_equal(_raw(opt, params), _raw(new, loaded))
    for p, q in zip(params, loaded):
        q.data.copy_(p.data)
    for opt_, ps in ((opt, params), (new, loaded)):
        _grads(ps, 5)
        opt_.step()
    _assert_raw_equal(_raw(opt, params), _raw(new, loaded))
    for p, q in zip(params, loaded):
        assert torch.equal(p, q)


@pytest.mark.parametrize("state_dtype", DTYPES)
def test_file_bytes_are_the_stored_form(tmp_path, state_dtype):
    """Each state's file holds every param's stored bytes: packed blocks (260 B per 256
    values) or bf16 for a param of at least 4096 elements, float32 below (and for float32
    states), padded once at the end to 4096."""
    params, opt = _trained("adamw", state_dtype)
    opt.save_checkpoint(str(tmp_path / "ck"))
    rank0 = tmp_path / "ck" / "rank0"
    m = json.loads((rank0 / "offload-ckpt.json").read_text())
    total = sum(_stored_bytes(p.numel(), state_dtype) for p in params)
    files = [k if state_dtype == "float32" else k + "__bytes" for k in STATES["adamw"]]
    for k in files:
        assert os.path.getsize(rank0 / m["files"][k]) == round_up(total, ALIGN)
    if state_dtype == "float32":  # the format every stage-0 store writes, unchanged
        assert m["numel"] == sum(p.numel() for p in params) and "tensors" not in m["meta"]
        return
    assert m["numel"] == total
    assert m["fields"] == [{"name": k, "dtype": "uint8"} for k in files]
    small = ["float32", 0]
    big = {"int8": (["int8", BLOCK, "signed"], ["uint8", BLOCK, "sqrt"]),
           "bfloat16": (["bfloat16", 0], ["bfloat16", 0])}[state_dtype]
    for j, k in enumerate(STATES["adamw"]):
        assert m["meta"]["tensors"][k] == [big[j] if p.numel() >= 4096 else small for p in params]
    if state_dtype == "int8":  # the big param: 4097 blocks' worth, not 4 bytes per value
        n = 2 ** 20 + 3
        assert total == 4 * (1 + 7 + 4095 + 15) + 2 * packed_nbytes(4097) + packed_nbytes(4096) + packed_nbytes(n)
        assert packed_nbytes(n) == -(-n // BLOCK) * 260


# ------------------------------------------------------------------ across state dtypes and stores
def _load_both(kind, src_opt, src_params, dst_dtype, tmp_path, store="cpu"):
    """(loaded by checkpoint, loaded by state_dict) optimizers of ``dst_dtype`` in ``store``."""
    src_opt.save_checkpoint(str(tmp_path / "ck"))
    via_ckpt, via_sd = _params(1), _params(1)
    a = _make(kind, via_ckpt, dst_dtype, store=store, swap_dir=tmp_path / "a")
    b = _make(kind, via_sd, dst_dtype, store=store, swap_dir=tmp_path / "b")
    a.load_checkpoint(str(tmp_path / "ck"))
    sd = src_opt.state_dict()
    for i, p in enumerate(src_params):  # torch's SGD layout has no step; ours counts it (rounding seeds)
        if i in sd["state"]:
            sd["state"][i]["step"] = src_opt.state[p]["step"].clone()
    b.load_state_dict(sd)
    return (a, via_ckpt), (b, via_sd)


def _step_alike(a, pa, b, pb):
    for p, q in zip(pa, pb):
        p.data.copy_(q.data)
    for opt_, ps in ((a, pa), (b, pb)):
        _grads(ps, 7)
        opt_.step()
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
    _same_state_dict(a, b)


HOST_PAIRS = [("int8", "float32"), ("int8", "bfloat16"), ("bfloat16", "int8"), ("bfloat16", "float32"),
              ("float32", "int8")]


@pytest.mark.parametrize("src,dst", HOST_PAIRS, ids=[f"{a}->{b}" for a, b in HOST_PAIRS])
@pytest.mark.parametrize("kind", KINDS)
def test_host_across_state_dtypes_equals_the_state_dict_route(tmp_path, kind, src, dst):
    params, opt = _trained(kind, src)
    (a, pa), (b, pb) = _load_both(kind, opt, params, dst, tmp_path)
    _assert_raw_equal(*_route_states(kind, dst, a, pa, b, pb))  # as stored, not only as state_dict() decodes them
    _step_alike(a, pa, b, pb)


def _route_states(kind, dst, a, pa, b, pb):
    """The raw states of the checkpoint route ``a`` and of what it should equal: the
    state_dict route ``b``'s, for every param: a step-0 one has none in either (as torch's
    load_state_dict keeps none of a param without an entry), but Adagrad's, whose sum both
    carry from the source, rounded as the source stored it (torch's Adagrad has its sum from
    the start: one written before the first step is kept, test_adagrad_unstepped_sum.py)."""
    return _raw(a, pa), _raw(b, pb)


@pytest.mark.parametrize("kind", KINDS)
def test_host_int8_to_nvme_int8_and_back(tmp_path, kind):
    params, opt = _trained(kind, "int8")
    (a, pa), (b, pb) = _load_both(kind, opt, params, "int8", tmp_path / "there", store="nvme")
    _same_state_dict(a, b)
    # back: the swapped store's checkpoint (every param in blocks) into the host store
    (c, pc), (d, pd) = _load_both(kind, a, pa, "int8", tmp_path / "back")
    _assert_raw_equal(*_route_states(kind, "int8", c, pc, d, pd))
    _step_alike(c, pc, d, pd)
    _step_alike(a, pa, b, pb)
    for o in (a, b):
        o.close()


def test_old_float32_host_checkpoint_of_int8_states_loads(tmp_path):
    """What the host store wrote before (decoded float32 states in the stage-0 format)
    still loads, as the state_dict route does."""
    from offload.swap.ckpt_groups import encode_groups
    from offload.zero.ckpt_states import save_states

    params, opt = _trained("adamw", "int8")
    sd = opt.state_dict()
    states = {k: [sd["state"][i][k].reshape(-1) if i in sd["state"] else torch.zeros(p.numel())
                  for i, p in enumerate(params)] for k in STATES["adamw"]}
    steps = [int(opt.state[p]["step"]) if p in opt.state else 0 for p in params]
    save_states(str(tmp_path / "ck"), [p.numel() for p in params], states,
                {"param_groups": encode_groups(opt.param_groups), "steps": steps,
                 "shapes": [list(p.shape) for p in params]})
    assert json.loads((tmp_path / "ck" / "rank0" / "offload-ckpt.json").read_text())["dtype"] == "float32"
    via_ckpt, via_sd = _params(1), _params(1)
    a, b = _make("adamw", via_ckpt, "int8"), _make("adamw", via_sd, "int8")
    a.load_checkpoint(str(tmp_path / "ck"))
    b.load_state_dict(sd)
    _assert_raw_equal(_raw(a, via_ckpt), _raw(b, via_sd))


def test_a_reader_of_typed_fields_refuses_a_packed_checkpoint(tmp_path):
    """Its states are named otherwise (``exp_avg__bytes``): the stage-0 load of typed fields
    (and a release before packed checkpoints, whose converting load asks for the same names)
    refuses it instead of decoding bytes as values."""
    from offload.zero.checkpoint import IN_PLACE_FIELDS
    from offload.zero.ckpt_states import load_states

    params, opt = _trained("adamw", "int8")
    opt.save_checkpoint(str(tmp_path / "ck"))
    numels = [p.numel() for p in params]
    scratch = {f.name: [torch.empty(n) for n in numels] for f in IN_PLACE_FIELDS}
    with pytest.raises(ValueError, match=r"holds exp_avg__bytes \(uint8\), exp_avg_sq__bytes \(uint8\)"):
        load_states(str(tmp_path / "ck"), numels, scratch, IN_PLACE_FIELDS)


def test_flat_store_refuses_a_packed_checkpoint_naming_it(tmp_path):
    params, opt = _trained("adamw", "int8")
    opt.save_checkpoint(str(tmp_path / "ck"))
    bf = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params(1)]
    flat = offload.AdamW(bf, lr=1e-2, state_dtype="int8", offload="cpu")
    with pytest.raises(ValueError, match="uint8.*load it with an optimizer of the kind that saved it"):
        flat.load_checkpoint(str(tmp_path / "ck"))


# ------------------------------------------------------------------ damage
def _saved(tmp_path, state_dtype="int8"):
    params, opt = _trained("adamw", state_dtype)
    opt.save_checkpoint(str(tmp_path / "ck"))
    rank0 = tmp_path / "ck" / "rank0"
    m = json.loads((rank0 / "offload-ckpt.json").read_text())
    return params, opt, rank0, m


def _fresh_trained(tmp_path):
    """A host int8 optimizer with states of its own (what a failed load must leave)."""
    params = _params(2)
    opt = _make("adamw", params, "int8")
    _grads(params, 9)
    opt.step()
    return params, opt, [{k: v.clone() for k, v in st.items()} for st in _raw(opt, params)]


@pytest.mark.parametrize("store", ["cpu", "nvme"])
@pytest.mark.parametrize("where", ["big", "small", "padding_not"])
def test_flipped_byte_fails_naming_the_file(tmp_path, store, where):
    params, opt, rank0, m = _saved(tmp_path)
    path = rank0 / m["files"]["exp_avg_sq__bytes"]
    at = {"big": 4 * (1 + 7 + 4095) + 100, "small": 3, "padding_not": m["numel"] - 1}[where]
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    if store == "cpu":
        ps, new, before = _fresh_trained(tmp_path)
    else:
        ps = _params(2)
        new = _make("adamw", ps, "int8", store="nvme", swap_dir=tmp_path / "sw")
    with pytest.raises(OSError, match="crc32") as exc:
        new.load_checkpoint(str(tmp_path / "ck"))
    assert exc.value.filename == str(path)
    if store == "cpu":
        _assert_raw_equal(_raw(new, ps), before)  # untouched
    else:
        new.close()


def test_truncated_file_fails_naming_the_file(tmp_path):
    params, opt, rank0, m = _saved(tmp_path)
    path = rank0 / m["files"]["exp_avg__bytes"]
    os.truncate(path, m["numel"] // 2)
    ps, new, before = _fresh_trained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {m['numel'] // 2} bytes")):
        new.load_checkpoint(str(tmp_path / "ck"))
    _assert_raw_equal(_raw(new, ps), before)


def test_truncated_manifest_fails_naming_it(tmp_path):
    params, opt, rank0, m = _saved(tmp_path)
    path = rank0 / "offload-ckpt.json"
    path.write_bytes(path.read_bytes()[:-40])
    ps, new, before = _fresh_trained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a valid manifest")):
        new.load_checkpoint(str(tmp_path / "ck"))
    _assert_raw_equal(_raw(new, ps), before)


BAD_FORMS = [("int9", "not a state field"), ("block", "not a state field"), ("count", "lists 7 forms"),
             ("bytes", "take .* bytes, the manifest counts")]


@pytest.mark.parametrize("bad,msg", BAD_FORMS, ids=[b for b, _ in BAD_FORMS])
def test_damaged_forms_in_the_manifest_fail_naming_it(tmp_path, bad, msg):
    params, opt, rank0, m = _saved(tmp_path)
    forms = m["meta"]["tensors"]["exp_avg"]
    if bad == "int9":
        forms[3][0] = "int9"
    elif bad == "block":
        forms[3][1] = 255
    elif bad == "count":
        forms.pop()
    else:  # a well-formed form of the wrong size: a param's bytes would be cut elsewhere
        forms[4] = ["bfloat16", 0]
    del m["manifest_crc32"]  # unsealed (an older release's manifest): else its own checksum fails first
    (rank0 / "offload-ckpt.json").write_text(json.dumps(m))
    ps, new, before = _fresh_trained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{rank0 / 'offload-ckpt.json'}: ") + f".*{msg}"):
        new.load_checkpoint(str(tmp_path / "ck"))
    _assert_raw_equal(_raw(new, ps), before)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Written under temporary names and renamed: a save failing half-way leaves the
    previous checkpoint loadable and no file of its own behind."""
    import offload.swap.checkpoint as ck

    params, opt, rank0, m = _saved(tmp_path)
    first = _raw(opt, params)
    first = [{k: v.clone() for k, v in st.items()} for st in first]
    names = sorted(os.listdir(rank0))
    _grads(params, 3)
    opt.step()
    real, calls = ck._write_tensors, []

    def failing(st, new, field, tensors):
        calls.append(field.name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device (test)")
        return real(st, new, field, tensors)

    monkeypatch.setattr(ck, "_write_tensors", failing)
    with pytest.raises(OSError, match="test"):
        opt.save_checkpoint(str(tmp_path / "ck"))
    monkeypatch.undo()
    assert sorted(os.listdir(rank0)) == names
    ps = _params(1)
    new = _make("adamw", ps, "int8")
    new.load_checkpoint(str(tmp_path / "ck"))
    _assert_raw_equal(_raw(new, ps), first)
