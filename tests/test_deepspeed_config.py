"""offload.from_deepspeed_config: DeepSpeed ZeRO-Offload JSON -> offload.Adam/AdamW."""
import copy
import errno
import json

import pytest
import torch

import offload
from offload.config import IOConfig
from offload.integrations.deepspeed import IGNORED, MAPPED, deepspeed_kwargs, deepspeed_shard_kwargs, from_deepspeed_config


def _cfg(**zero):
    return {"zero_optimization": {"stage": 2, **zero},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}


# The ZeRO-2 offload template of the HF docs, "auto" values written out as numbers.
HF_ZERO2 = {
    "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.98], "eps": 1e-7,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                 "warmup_num_steps": 10}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True,
                          "round_robin_gradients": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "wall_clock_breakdown": False,
}


def test_hf_template_maps_every_key():
    cls, kw = deepspeed_kwargs(HF_ZERO2)
    assert cls is offload.AdamW
    assert kw == {"stage": 2, "offload": "cpu", "lr": 3e-5, "betas": (0.9, 0.98), "eps": 1e-7,
                  "weight_decay": 0.01, "max_grad_norm": 1.0}


def test_nvme_aio_and_sub_groups(tmp_path):
    cfg = _cfg(sub_group_size=1e6, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path),
                                                      "buffer_count": 5, "pipeline_read": True,
                                                      "pipeline_write": True, "fast_init": False})
    cfg["aio"] = {"block_size": 262144, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                  "overlap_events": True, "use_gds": False}
    _, kw = deepspeed_kwargs(cfg)
    assert kw["offload"] == "nvme" and kw["swap_dir"] == str(tmp_path)
    assert kw["sub_group_size"] == 1_000_000 and isinstance(kw["sub_group_size"], int)
    assert kw["max_host_bytes"] == 5 * 1_000_000 * 4  # DeepSpeed's pool: buffer_count x sub_group_size fp32
    assert kw["io_engine"] == IOConfig(block_size=262144, queue_depth=8)


def test_aio_defaults_and_cpu_offload_pass_no_io_engine():
    cfg = _cfg(offload_optimizer={"device": "cpu"})
    cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8}
    assert "io_engine" not in deepspeed_kwargs(cfg)[1]  # aio is read only for nvme, as in DeepSpeed


def test_io_config_reaches_the_optimizer(tmp_path):
    cfg = _cfg(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)})
    cfg["aio"] = {"block_size": 262144, "queue_depth": 4}
    try:
        opt = from_deepspeed_config(cfg, torch.nn.Linear(8, 8).parameters())
    except ValueError as e:
        if "unknown io engine IOConfig" in str(e):
            pytest.skip("this offload.AdamW takes io_engine as a name only (issue 13 makes it take an IOConfig)")
        raise
    with opt:
        assert opt.config.io == IOConfig(block_size=262144, queue_depth=4)


@pytest.mark.parametrize("optimizer,cls,wd", [
    ({"type": "AdamW", "params": {}}, offload.AdamW, 0.0),
    ({"type": "adam", "params": {}}, offload.AdamW, 0.0),                     # DeepSpeed: adam_w_mode defaults to true
    ({"type": "Adam", "params": {"adam_w_mode": False}}, offload.Adam, 0.0),
    ({"type": "AdamW", "params": {"adam_w_mode": False}}, offload.AdamW, 0.0),  # AdamW wins, as in DeepSpeed
    ({"type": "AdamW", "params": {"torch_adam": True}}, offload.AdamW, 0.01),  # torch.optim.AdamW's default
    ({"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False}}, offload.Adam, 0.0),
])
def test_optimizer_type_as_deepspeed(optimizer, cls, wd):
    got_cls, kw = deepspeed_kwargs({"optimizer": optimizer})
    assert got_cls is cls and kw["weight_decay"] == wd and kw["stage"] == 0 and kw["offload"] == "none"
    assert "amsgrad" not in kw


@pytest.mark.parametrize("device", ["none", "cpu"])
def test_amsgrad_config_trains_as_torch_amsgrad(device):
    """optimizer.params.amsgrad: true builds torch's AMSGrad (max_exp_avg_sq kept per param)."""
    cfg = _cfg(offload_optimizer={"device": device})
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01}}
    torch.manual_seed(0)
    model, ref_model = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    ref_model.load_state_dict(model.state_dict())
    with _torch_run(model, lambda ps: from_deepspeed_config(cfg, ps), 0) as opt:
        assert opt.param_groups[0]["amsgrad"] is True
        ref = _torch_run(ref_model, lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=False), 0)
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.state[p]["max_exp_avg_sq"], ref.state[r]["max_exp_avg_sq"],
                                       rtol=1e-5, atol=1e-6)


def _torch_run(model, opt_fn, clip, steps=6):
    torch.manual_seed(1)
    opt = opt_fn(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16)).pow(2).mean().backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return opt


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_steps_match_torch(device, tmp_path):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3))
    ref = copy.deepcopy(ours)
    off = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    cfg = {"zero_optimization": {"stage": 1, "offload_optimizer": off}, "gradient_clipping": 0.05,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6,
                                                    "weight_decay": 0.1}}}
    opt = _torch_run(ours, lambda p: from_deepspeed_config(cfg, p), clip=None)
    _torch_run(ref, lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                                foreach=False), clip=0.05)
    assert opt.last_grad_norm is not None  # the clip happened inside the step
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    opt.close()


def test_bf16_enabled_with_bf16_params():
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    cfg = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with from_deepspeed_config(cfg, model.parameters()) as opt:
        model(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_precision_follows_the_params(dtype):
    model = torch.nn.Linear(8, 4).to(dtype)
    cfg = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}, "optimizer": _opt(),
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    from_deepspeed_config(cfg, model.parameters()).close()
    cfg["fp16"]["enabled"] = True  # one set: the params must be that
    if dtype != torch.float16:
        with pytest.raises(ValueError, match="but fp16.enabled is true"):
            from_deepspeed_config(cfg, model.parameters())


def test_path_and_overrides(tmp_path):
    path = tmp_path / "ds.json"
    cfg = _cfg(offload_optimizer={"device": "cpu"})
    cfg["optimizer"]["params"]["lr"] = "auto"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"optimizer\.params\.lr: \"auto\" .*pass lr="):
        from_deepspeed_config(path, torch.nn.Linear(2, 2).parameters())
    cls, kw = deepspeed_kwargs(str(path), lr=5e-4, max_grad_norm=2.0)
    assert kw["lr"] == 5e-4 and kw["max_grad_norm"] == 2.0
    opt = from_deepspeed_config(path, torch.nn.Linear(2, 2).parameters(), lr=5e-4)
    assert opt.param_groups[0]["lr"] == 5e-4
    opt.close()


def test_auto_stage_and_device_take_the_overrides_values():
    cfg = {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}}, "optimizer": _opt()}
    opt = from_deepspeed_config(cfg, torch.nn.Linear(4, 4).parameters(), stage=2, offload="cpu")
    assert opt.stage == 2 and opt.config.offload == "cpu"
    opt.close()
    with pytest.raises(ValueError, match=r"zero_optimization\.stage: \"auto\""):
        from_deepspeed_config(cfg, torch.nn.Linear(4, 4).parameters(), offload="cpu")


def test_a_key_given_twice_in_a_file_is_refused(tmp_path):
    # json.load kept the last of two equal keys: the second "lr" (or a second "optimizer"
    # block) replaced the first without a word; DeepSpeed's own loader refuses it.
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},\n'
                    ' "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "lr": 1e-4}}}')
    with pytest.raises(ValueError, match=r"^lr: given twice in one JSON object"):
        from_deepspeed_config(path, torch.nn.Linear(2, 2).parameters())
    path.write_text('{"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0}')
    opt = from_deepspeed_config(path, torch.nn.Linear(2, 2).parameters())  # nested objects, no duplicate
    assert opt.defaults["lr"] == 1e-3 and opt.max_grad_norm == 1.0
    opt.close()


def test_bad_files(tmp_path):
    with pytest.raises(OSError) as info:
        from_deepspeed_config(tmp_path / "missing.json", [])
    assert info.value.errno == errno.ENOENT and info.value.filename == str(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"zero_optimization\": ")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        from_deepspeed_config(bad, [])
    with pytest.raises(TypeError, match="dict or a path"):
        from_deepspeed_config(42, [])


def _opt(**params):
    return {"type": "AdamW", "params": {"lr": 1e-3, **params}}


REFUSED = [
    ({"optimizer": _opt(), "train_batch_sise": 8}, r"^train_batch_sise: unknown top-level key"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "overlap_com": True}},
     r"^zero_optimization\.overlap_com: unknown key"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3}}, r"^zero_optimization\.stage: 3 partitions the params: pass the model"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 4}}, r"^zero_optimization\.stage: expected 0, 1, 2 or 3"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"^zero_optimization\.offload_param: parameter offload is ZeRO stage 3's, and the stage is 2"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     r"^zero_optimization\.offload_param\.nvme_path: required"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/x"}}},
     r"^zero_optimization\.offload_param\.nvme_path: only read with device \"nvme\""),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     r"^zero_optimization\.offload_param\.device: expected none, cpu or nvme"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": 1}}},
     r"^zero_optimization\.offload_param\.ratio: unknown key"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}},
     r"^zero_optimization\.stage3_max_live_parameters: must be >= 1"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "stage3_max_live_parameter": 1e9}},
     r"^zero_optimization\.stage3_max_live_parameter: unknown key"),  # a misspelling is not DeepSpeed's tuning
    ({"optimizer": _opt(), "zero_optimization": {"stage": 3, "cpu_offload_param": True}},
     r"^zero_optimization\.cpu_offload_param: the deprecated spelling"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "cpu_offload": True}},
     r"^zero_optimization\.cpu_offload: the deprecated"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     r"^zero_optimization\.offload_optimizer\.nvme_path: required"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                  "nvme_path": "/x"}}},
     r"^zero_optimization\.offload_optimizer\.nvme_path: only read with device \"nvme\""),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     r"^zero_optimization\.offload_optimizer needs zero_optimization\.stage 1, 2 or 3"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}},
     r"^zero_optimization\.offload_optimizer\.device: expected none, cpu or nvme"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                  "ratio": 0.3}}},
     r"^zero_optimization\.offload_optimizer\.ratio: 0\.3: partial offload"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": "auto"}}, r"^zero_optimization\.stage: \"auto\""),
    ({"optimizer": _opt(), "zero_optimization": {"stage": True}}, r"^zero_optimization\.stage: expected an integer"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "sub_group_size": 0}},
     r"^zero_optimization\.sub_group_size: must be > 0"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
      "nvme_path": "/x"}}, "aio": {"use_gds": True}}, r"^aio\.use_gds: GPUDirect"),
    ({"optimizer": _opt(), "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
      "nvme_path": "/x"}}, "aio": {"block_size": 1000}}, r"^aio: block_size must be a positive multiple of 4096"),
    ({"optimizer": _opt(), "aio": {"queue_dept": 8}}, r"^aio\.queue_dept: unknown key"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, r"^optimizer\.type: 'Lamb' is not supported"),
    ({"optimizer": {"params": {}}}, r"^optimizer\.type: None is not supported"),
    ({}, r"^optimizer: missing"),
    ({"optimizer": _opt(amsgrad=1)}, r"^optimizer\.params\.amsgrad: expected true or false"),
    ({"optimizer": _opt(max_grad_norm=1.0)}, r"^optimizer\.params\.max_grad_norm: .*gradient_clipping"),
    ({"optimizer": _opt(momentum=0.9)}, r"^optimizer\.params\.momentum: unknown key"),
    ({"optimizer": _opt(betas=[0.9])}, r"^optimizer\.params\.betas: expected two numbers"),
    ({"optimizer": _opt(lr="0.001")}, r"^optimizer\.params\.lr: expected a number"),
    ({"optimizer": _opt(adam_w_mode=1)}, r"^optimizer\.params\.adam_w_mode: expected true or false"),
    ({"optimizer": _opt(), "gradient_clipping": "auto"}, r"^gradient_clipping: \"auto\" .*pass max_grad_norm="),
    ({"optimizer": _opt(), "gradient_clipping": -1}, r"^gradient_clipping: must be >= 0"),
    ({"optimizer": _opt(), "bf16": {"enabled": True}, "fp16": {"enabled": True}}, r"^bf16\.enabled and fp16\.enabled"),
    ({"optimizer": _opt(), "fp16": {"enabled": False, "auto_cast": True}}, r"^fp16\.auto_cast: true"),
    ({"optimizer": _opt(), "fp16": {"enabled": False, "loss_scael": 0}}, r"^fp16\.loss_scael: unknown key"),
    ({"optimizer": _opt(), "amp": {"enabled": True}}, r"^amp: apex AMP"),
    ({"optimizer": _opt(), "zero_optimization": []}, r"^zero_optimization: expected a JSON object"),
]


@pytest.mark.parametrize("cfg,match", REFUSED, ids=[m.split(":")[0].strip("^\\") for _, m in REFUSED])
def test_refused_with_the_key_path(cfg, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed_config(cfg, torch.nn.Linear(2, 2).parameters())


@pytest.mark.parametrize("section,dtype,match", [
    ({"bf16": {"enabled": True}}, torch.float32, r"param 0 is torch\.float32 but bf16\.enabled is true"),
    ({"fp16": {"enabled": True}}, torch.bfloat16, r"param 0 is torch\.bfloat16 but fp16\.enabled is true"),
    ({}, torch.float16, r"param 0 is torch\.float16 but neither bf16\.enabled nor fp16\.enabled"),
])
def test_precision_must_match_the_params(section, dtype, match):
    model = torch.nn.Linear(2, 2).to(dtype)
    with pytest.raises(ValueError, match=match):
        from_deepspeed_config({"optimizer": _opt(), **section}, [{"params": list(model.parameters())}])


def test_off_switches_are_accepted():
    cfg = {"optimizer": _opt(), "amp": {"enabled": False},
           "zero_optimization": {"stage": 1, "offload_param": {"device": "none"}, "cpu_offload": False,
                                 "zero_hpz_partition_size": 1, "mics_shard_size": -1,
                                 "stage3_max_live_parameters": 1e9}}
    assert deepspeed_kwargs(cfg)[1]["offload"] == "none"


def test_too_small_pool_names_the_deepspeed_keys(tmp_path):
    cfg = _cfg(sub_group_size=4096, offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path),
                                                       "buffer_count": 1})
    with pytest.raises(ValueError, match=r"zero_optimization\.sub_group_size x offload_optimizer\.buffer_count"):
        from_deepspeed_config(cfg, torch.nn.Linear(128, 128).parameters())


def test_tables_name_keys_once():
    assert not set(MAPPED) & set(IGNORED)
    assert all(reason for reason in IGNORED.values())


# ---------------------------------------------------------------- stage 3: offload.shard
class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return x


def _zero3(offload_param, **extra):
    """The HF docs' ZeRO-3 template (its "auto" tuning values kept: stage 3's own knobs)."""
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": offload_param, "overlap_comm": True, "contiguous_gradients": True,
                                  "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                                  "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                  "stage3_gather_16bit_weights_on_model_save": True, **extra},
            "gradient_clipping": 1.0, "gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 1}


def test_zero3_shard_kwargs(tmp_path):
    from offload.integrations.deepspeed import deepspeed_shard_kwargs

    assert deepspeed_shard_kwargs(HF_ZERO2) is None
    assert deepspeed_shard_kwargs(_zero3({"device": "cpu", "pin_memory": True, "buffer_count": 5})) == {
        "offload_params": "cpu", "max_live_params": 10 ** 9}
    nvme = _zero3({"device": "nvme", "nvme_path": str(tmp_path)}, stage3_max_live_parameters="auto")
    assert deepspeed_shard_kwargs(nvme) == {"offload_params": "nvme", "swap_dir": str(tmp_path)}
    # aio is read when the params alone go to NVMe too: their files use the states' engine settings
    tuned = dict(nvme, aio={"block_size": 262144, "queue_depth": 4})
    io = deepspeed_shard_kwargs(tuned)["io"]
    assert (io.block_size, io.queue_depth) == (262144, 4) and "io_engine" not in deepspeed_kwargs(tuned)[1]
    cpu_params = _zero3({"device": "cpu"}, stage3_max_live_parameters="auto")
    assert "io" not in deepspeed_shard_kwargs(dict(cpu_params, aio={"block_size": 262144}))
    cls, kw = deepspeed_kwargs(nvme)
    assert cls is offload.AdamW and kw["stage"] == 3 and kw["offload"] == "cpu"
    with pytest.raises(ValueError, match=r"Invalid stage: 3 for these params: .*offload\.shard\(model\)"):
        cls(torch.nn.Linear(4, 4).parameters(), **kw)  # not a sharded model's: never an unsharded run


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_zero3_config_shards_the_model_and_trains_as_torch(device, tmp_path):
    """Given the model, a stage-3 config shards it (offload_param -> offload.shard) and builds
    the optimizer over the shards: three clipped AdamW steps as torch's on the whole model."""
    param = {"device": device, "pin_memory": True, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    torch.manual_seed(0)
    model = _Blocks()
    ref = copy.deepcopy(model)
    opt = from_deepspeed_config(_zero3(param), model)
    rt = offload.shard.runtime_of(model)
    assert rt is not None and opt.stage == 3
    assert all("_shard_" in n for n, _ in model.named_parameters())
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                             foreach=False)
    for _ in range(3):
        x = torch.randn(4, 8)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ropt.step()
        ropt.zero_grad()
    full = offload.shard.gathered_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-5, atol=1e-6)
    opt.close()


def test_zero3_config_over_params_of_a_sharded_model():
    torch.manual_seed(0)
    model = _Blocks()
    with pytest.raises(ValueError, match=r"stage: 3 partitions the params: pass the model"):
        from_deepspeed_config(_zero3({"device": "none"}), model.parameters())  # not sharded: refused
    offload.shard(model)
    opt = from_deepspeed_config(_zero3({"device": "none"}), model.parameters())
    assert opt.stage == 3
    opt.close()


@pytest.mark.parametrize("override,error", [({"lr": -1.0}, ValueError), ({"state_dtype": "int4"}, ValueError),
                                            ({"foo": 1}, TypeError)])
def test_zero3_bad_options_fail_before_the_model_is_sharded(override, error):
    model = _Blocks()
    with pytest.raises(error):
        from_deepspeed_config(_zero3({"device": "none"}), model, **override)
    assert offload.shard.runtime_of(model) is None and "blocks.0.weight" in dict(model.named_parameters())


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_a_missing_nvme_path_fails_by_its_key_before_the_model_is_sharded(tmp_path, section):
    # The optimizer's own swap_dir check came after offload.shard had changed the model in
    # place, and named swap_dir rather than the config's key.
    model = _Blocks()
    cfg = _zero3({"device": "cpu"})
    cfg["zero_optimization"][section] = {"device": "nvme", "nvme_path": str(tmp_path / "missing")}
    with pytest.raises(FileNotFoundError, match=rf"^\[Errno 2\] zero_optimization\.{section}\.nvme_path: no such "
                                                r"directory") as info:
        from_deepspeed_config(cfg, model)
    assert info.value.filename == str(tmp_path / "missing")
    assert offload.shard.runtime_of(model) is None and "blocks.0.weight" in dict(model.named_parameters())
    with pytest.raises(FileNotFoundError, match=r"^\[Errno 2\] swap_dir=: no such directory"):
        from_deepspeed_config(_cfg(offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path)}),
                              torch.nn.Linear(2, 2).parameters(), swap_dir=str(tmp_path / "missing"))


def test_nvme_path_under_the_home_directory(tmp_path, monkeypatch):
    """"~/nvme" in a config file (no shell expands it) is the home directory's, in the
    config's own check as in the optimizer's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "nvme").mkdir()
    opt = from_deepspeed_config(_cfg(offload_optimizer={"device": "nvme", "nvme_path": "~/nvme"}),
                                torch.nn.Linear(2, 2).parameters())
    assert opt.config.swap_dir == str(tmp_path / "nvme")
    opt.close()


def test_zero3_a_failure_after_sharding_says_so_and_a_retry_must_match(tmp_path):
    model = _Blocks()
    bad = _zero3({"device": "nvme", "nvme_path": str(tmp_path / "p")}, sub_group_size=1)
    bad["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "o"),
                                                     "buffer_count": 1}
    (tmp_path / "p").mkdir()
    (tmp_path / "o").mkdir()
    with pytest.raises(ValueError, match="buffer_count x 4 B") as info:  # the pool depends on the shards
        from_deepspeed_config(bad, model)
    assert any("the model stays sharded" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(ValueError, match=r"offload_param: the model was sharded already, .*in a file"):
        from_deepspeed_config(_zero3({"device": "cpu"}), model)  # would need a model sharded otherwise
    opt = from_deepspeed_config(_zero3({"device": "nvme", "nvme_path": str(tmp_path / "p")}), model)
    assert opt.stage == 3
    opt.close()


def test_auto_clipping_resolved_to_zero_is_no_clipping():
    # TrainingArguments(max_grad_norm=0) resolving "gradient_clipping": "auto": refused as
    # "Invalid max_grad_norm: 0.0" where a literal 0 in the config meant no clipping
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": "auto"}
    for zero in (0, 0.0):
        opt = offload.from_deepspeed_config(cfg, [torch.nn.Parameter(torch.randn(8))], max_grad_norm=zero)
        assert opt.max_grad_norm is None
        opt.close()
        cls, kw = deepspeed_kwargs(cfg, max_grad_norm=zero)
        assert "max_grad_norm" not in kw
    opt = offload.from_deepspeed_config(cfg, [torch.nn.Parameter(torch.randn(8))], max_grad_norm=1.5)
    assert opt.max_grad_norm == 1.5
    opt.close()


def test_stage3_kwargs_with_states_in_ram_build_over_fp32_shards():
    # HF's ZeRO-3 template (sub_group_size 1e9, offload_optimizer cpu): deepspeed_kwargs gave
    # sub_group_size, which cls(params, **kwargs) refused for fp32 CPU shards
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                                 "sub_group_size": 1e9},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    offload.shard(model, **deepspeed_shard_kwargs(cfg))
    cls, kw = deepspeed_kwargs(cfg)
    assert "sub_group_size" not in kw
    opt = cls(model.parameters(), **kw)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    opt.close()
    assert deepspeed_kwargs(cfg, sub_group_size=1000)[1]["sub_group_size"] == 1000  # an override stands
