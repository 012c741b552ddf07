"""transformers over a model ``offload.shard`` changed.

- ``save_pretrained`` writes the whole model, which ``from_pretrained`` loads bit for bit
  (offload/shard/save_pretrained.py). Before, it wrote this rank's flat shards, and
  ``from_pretrained`` reported every weight missing and initialised them afresh: the trained
  weights were lost without an error.
- ``offload.shard(model, split=...)``: a unit's params in separate flats by key, so that they
  can take different hyperparameters (offload/shard/splits.py [Note: split flats]). With one
  flat per unit and dtype, the Trainer's no-decay group (biases, norm weights) was empty and
  they decayed with the rest, silently.

One module, so that a worker and its ranks import transformers once."""
from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch

import _shard_rank_jobs
import offload
from _ranks import group
from _lazy import lazy_import

transformers = lazy_import("transformers")  # on first use: tests/_lazy.py


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _batches(n=4):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(n)]


def _trainer_run(model, tmp):
    data = [{"input_ids": x, "labels": x} for b in _batches() for x in b]
    args = transformers.TrainingArguments(
        output_dir=tmp, max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True, max_grad_norm=0,
        lr_scheduler_type="constant", weight_decay=0.5, learning_rate=1e-2, seed=0, data_seed=0, save_strategy="no")
    t = transformers.Trainer(model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=(offload.AdamW, {}))
    t.train()
    return t


def _max_diff(model, plain):
    whole = offload.shard.full_state_dict(model)
    return max(float((whole[k] - v).abs().max()) for k, v in plain.state_dict().items())


_LOST = "weight_decay=0 is empty"  # splits.py [Note: an empty no-decay group]


def test_the_trainers_no_decay_group_takes_the_split_flats(tmp_path):
    plain = _gpt2()
    _trainer_run(plain, str(tmp_path / "plain"))
    whole_flats = offload.shard(_gpt2())
    with pytest.warns(UserWarning, match=_LOST) as said:
        _trainer_run(whole_flats, str(tmp_path / "one"))
    assert "transformer.h.0.ln_1.weight" in str(said[0].message)  # a LayerNorm's, by module type
    assert _max_diff(whole_flats, plain) > 1e-4  # biases and norms decayed: why split exists
    split = offload.shard(_gpt2(), split=offload.shard.split_no_decay)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = _trainer_run(split, str(tmp_path / "split"))
    assert not [w for w in seen if _LOST in str(w.message)]
    assert [(len(g["params"]), g["weight_decay"]) for g in t.optimizer.param_groups] == [(3, 0.5), (3, 0.0)]
    assert _max_diff(split, plain) == 0.0


def _by_name(model, decay):
    named = dict(model.named_parameters())
    return [{"params": [p for n, p in named.items() if decay(n)], "weight_decay": 0.1},
            {"params": [p for n, p in named.items() if not decay(n)], "weight_decay": 0.0}]


@pytest.mark.parametrize("split,groups,warned", [
    (None, "by_name", True),  # the shards' names: the no-decay group comes out empty
    (None, "one", False),  # one group decaying everything: torch's own meaning, nothing lost
    (offload.shard.split_no_decay, "by_name", False),
    (None, "by_name_no_decay_off", False),  # an empty group that decays is no no-decay group
])
def test_groups_made_by_name_over_whole_flats_warn(split, groups, warned):
    model = offload.shard(_gpt2(), split=split)
    decay = lambda n: "bias" not in n and "norm" not in n  # noqa: E731
    params = {"one": lambda: [{"params": list(model.parameters()), "weight_decay": 0.1}],
              "by_name": lambda: _by_name(model, decay),
              "by_name_no_decay_off": lambda: [dict(g, weight_decay=0.1) for g in _by_name(model, decay)]}[groups]()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        offload.AdamW(params, lr=1e-3).close()
    assert bool([w for w in seen if _LOST in str(w.message)]) == warned


def test_flat_names_and_the_whole_model_are_kept(tmp_path):
    model = offload.shard(_gpt2(), split=lambda name, p, m: "vectors" if p.dim() == 1 else None)
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.h.0._shard_float32" in names and "transformer.h.0._shard_float32_vectors" in names
    plain = _gpt2()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in offload.shard.full_state_dict(model).items())
    path = str(tmp_path / "w.safetensors")
    offload.shard.full_state_dict(model, path)
    again = offload.shard(_gpt2(), split=offload.shard.split_no_decay, weights=path)
    assert _max_diff(again, plain) == 0.0


def test_a_checkpoint_resumes_with_the_same_split_only(tmp_path):
    def build(split):
        model = offload.shard(_gpt2(), split=split)
        return model, offload.AdamW(_groups(model), lr=1e-2)

    model, opt = build(offload.shard.split_no_decay)
    for x in _batches(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    offload.shard.save_checkpoint(model, opt, str(tmp_path))
    again, opt2 = build(offload.shard.split_no_decay)
    offload.shard.load_checkpoint(again, opt2, str(tmp_path))
    x = _batches(3)[2]
    for m, o in ((model, opt), (again, opt2)):
        m(input_ids=x, labels=x).loss.backward()
        o.step()
    assert _max_diff(again, _plain_of(model)) == 0.0
    with pytest.warns(UserWarning, match=_LOST):  # groups by name over whole flats
        other, opt3 = build(None)
    with pytest.raises(ValueError, match="split="):
        offload.shard.load_checkpoint(other, opt3, str(tmp_path))


def _plain_of(model):
    """An unsharded GPT-2 holding ``model``'s whole weights."""
    plain = _gpt2()
    plain.load_state_dict(offload.shard.full_state_dict(model))
    return plain


@pytest.mark.parametrize("split,error", [
    ("bias", TypeError),
    (lambda name, p, m: "a-b", ValueError),
    (lambda name, p, m: 3, ValueError),
    (lambda name, p, m: "", ValueError),
])
def test_bad_splits_are_refused_before_anything_changes(split, error):
    model = _gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match="split"):
        offload.shard(model, split=split)
    assert not hasattr(model, "_offload_shard_runtime")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _groups(model):
    """AdamW groups as the Trainer makes them: a no-decay group by the Trainer's name rule."""
    decay = transformers.trainer_pt_utils.get_parameter_names(
        model, [torch.nn.LayerNorm], [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"])
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.5},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def _steps(model):
    opt = offload.AdamW(_groups(model), lr=1e-2)
    for x in _batches(3):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def test_two_ranks_with_split_flats_equal_the_unsharded_model():
    assert group(2).run(_shard_rank_jobs.split_rank, timeout=240) == {0: [], 1: []}


# -- save_pretrained
def _model():
    """The GPT-2 (its lm_head tied to the token embedding), sharded and trained 2 steps
    with offload.AdamW."""
    model = offload.shard(_gpt2())
    opt = offload.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, ids


def _loaded(path):
    model = transformers.GPT2LMHeadModel.from_pretrained(path)
    return {k: v.clone() for k, v in model.state_dict().items()}, model


def _assert_whole(path, whole):
    got, model = _loaded(path)
    assert set(got) == set(whole)
    for k, v in whole.items():
        assert torch.equal(got[k], v), k
    return model


@pytest.mark.parametrize("given", ["none", "the shards", "the whole dict"])
def test_save_pretrained_writes_the_whole_model(tmp_path, given):
    model, ids = _model()
    whole = offload.shard.full_state_dict(model)
    assert any(float(v.abs().sum()) > 0 for v in whole.values())
    kw = {"none": {}, "the shards": {"state_dict": model.state_dict()},
          "the whole dict": {"state_dict": dict(whole)}}[given]
    model.save_pretrained(tmp_path, **kw)
    loaded = _assert_whole(tmp_path, whole)
    model.eval()  # as from_pretrained leaves the loaded one: no dropout
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_dict_without_shards_is_written_as_given(tmp_path):
    """A state dict the caller made (here one weight changed) is transformers' business."""
    model, _ = _model()
    whole = offload.shard.full_state_dict(model)
    mine = dict(whole)
    changed = torch.full_like(whole["transformer.ln_f.bias"], 0.5)
    mine["transformer.ln_f.bias"] = changed
    model.save_pretrained(tmp_path, state_dict=mine)  # transformers empties the dict it writes
    got, _ = _loaded(tmp_path)
    assert torch.equal(got["transformer.ln_f.bias"], changed)
    assert torch.equal(got["transformer.ln_f.weight"], whole["transformer.ln_f.weight"])


def test_the_trainers_save_model_is_loadable(tmp_path):
    model, _ = _model()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args).save_model(str(tmp_path / "final"))
    _assert_whole(tmp_path / "final", offload.shard.full_state_dict(model))


def test_two_ranks_write_one_whole_model():
    """Rank 0 writes the whole model; rank 1 takes part in the gathers and writes nothing."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as path:
        got = group(2).run(_shard_rank_jobs.save_on_ranks, path, timeout=240)
        (whole, written), (whole1, nothing) = got[0], got[1]
        assert nothing is None and set(written) == set(whole)
        assert all(torch.equal(written[k], v) and torch.equal(whole1[k], v) for k, v in whole.items())


def test_accelerates_save_model_refuses_the_shards(tmp_path):
    """[Note: accelerate's get_state_dict on shards]: accelerate takes model.state_dict() of any
    model it did not shard itself, which wrote this rank's shards under the units' names; it
    raises, naming what saves the whole weights, and writes nothing. Those still save."""
    accelerate = pytest.importorskip("accelerate")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    offload.shard(model, unit={torch.nn.Linear})
    acc = accelerate.Accelerator(cpu=True)
    with pytest.raises(RuntimeError, match=r"offload\.shard\.full_state_dict\(model, path\)"):
        acc.save_model(model, str(tmp_path / "acc"))
    with pytest.raises(RuntimeError, match="accelerate's get_state_dict / save_model"):
        acc.get_state_dict(model)
    assert not os.path.exists(tmp_path / "acc") or not os.listdir(tmp_path / "acc")
    whole = offload.shard.full_state_dict(model)
    assert sorted(whole) == sorted(plain) and all(torch.equal(whole[k], plain[k]) for k in plain)
    assert sorted(model.state_dict()) != sorted(plain)  # a plain state_dict() stays the shards
