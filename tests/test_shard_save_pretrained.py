"""transformers' ``save_pretrained`` of a model ``offload.shard`` changed writes the whole
model, which ``from_pretrained`` loads bit for bit (offload/shard/save_pretrained.py). Before,
it wrote this rank's flat shards, and ``from_pretrained`` reported every weight missing and
initialised them afresh: the trained weights were lost without an error."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import offload
from _ranks import group

transformers = pytest.importorskip("transformers")


def _model():
    """A 2-layer GPT-2 (its lm_head tied to the token embedding), sharded and trained 2
    steps with offload.AdamW."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = offload.shard(transformers.GPT2LMHeadModel(cfg))
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


def save_on_ranks(rank, world, path):
    """Every rank calls save_pretrained (transformers' convention: is_main_process on rank
    0); rank 0's gathered dict is what the file must hold."""
    model, _ = _model()
    whole = offload.shard.full_state_dict(model)
    model.save_pretrained(path, is_main_process=rank == 0)
    return {k: v.clone() for k, v in whole.items()} if rank == 0 else sorted(os.listdir(path))


def test_two_ranks_write_one_whole_model():
    with tempfile.TemporaryDirectory(dir="/var/tmp") as path:
        got = group(2).run(save_on_ranks, path, timeout=240)
        _assert_whole(path, got[0])
