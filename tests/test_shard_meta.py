"""offload.shard on a model built on the meta device: materialized unit by unit, equal bit for
bit to the same model built normally (same seed, same init order), on 1 and 2 gloo ranks;
buffers, tied and frozen params, partly-meta models, the errors; and peak RSS of a 400 MB
model built on meta and loaded from safetensors on 2 ranks (tests/test_shard_weights.py has
the loading and saving)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import offload
from offload.demo.model import GPTConfig, TinyGPT
from offload.shard import full_state_dict, runtime_of
import _ranks

CFG = GPTConfig(n_layer=3, d_model=32, n_head=2, block_size=16)


class Stack(nn.Module):
    """Blocks in a ModuleList (the units), leftover params around them (the root unit), a
    persistent buffer reset by reset_parameters (BatchNorm) and a frozen layer."""

    def __init__(self, width=40, depth=3, frozen=False):
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
                                    for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 3)
        if frozen:
            self.blocks[1][2].requires_grad_(False)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.norm(x))


def gpt_init(m):
    """A per-module init that draws from the RNG (GPT-2's weights N(0, 0.02), biases 0):
    only ``m``'s own params, so its order is ``model.apply``'s."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.uniform_(m.bias, -0.1, 0.1)
    if isinstance(m, nn.LayerNorm):
        nn.init.normal_(m.weight, 1.0, 0.1)
        nn.init.normal_(m.bias, 0.0, 0.1)


def _equal(got, ref):
    assert list(got) == list(ref)
    got = {k: torch.from_numpy(v) if not isinstance(v, torch.Tensor) else v for k, v in got.items()}
    for k in ref:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, k
        assert torch.equal(got[k], ref[k]), k


def _on_meta(build, seed):
    with torch.device("meta"):
        m = build()
    torch.manual_seed(seed)  # seeds the materialization: every rank the same
    return m


def _stack_ref(seed, **kw):
    torch.manual_seed(seed)
    return Stack(**kw)


def _gpt_ref(seed):
    torch.manual_seed(0)
    m = TinyGPT(CFG)
    torch.manual_seed(seed)
    m.apply(gpt_init)  # the same order as the materialization's walk
    return m


# ---------------------------------------------------------------------- one rank
@pytest.mark.parametrize("frozen", [False, True])
def test_reset_parameters_equals_normal_build(frozen):
    """nn.Linear/BatchNorm built in registration order draw the RNG in the walk's order."""
    ref = _stack_ref(5, frozen=frozen)
    m = offload.shard(_on_meta(lambda: Stack(frozen=frozen), 5))
    _equal(full_state_dict(m), ref.state_dict())
    assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
    assert all(p.requires_grad == (not frozen or n.startswith("blocks.1.2") is False) for n, p in m.named_parameters())
    x = torch.randn(6, 5)
    m.train(), ref.train()
    torch.testing.assert_close(m(x), ref(x), rtol=0, atol=0)
    assert torch.equal(m.norm.running_mean, ref.norm.running_mean)  # the buffer, updated the same


def test_init_fn_equals_apply_on_tinygpt():
    """TinyGPT's own reset_parameters loops over every module (not per unit): an init_fn that
    draws from the RNG, applied in ``model.apply`` order, gives the same bits."""
    ref = _gpt_ref(11)
    m = offload.shard(_on_meta(lambda: TinyGPT(CFG), 11), init_fn=gpt_init)
    _equal(full_state_dict(m), ref.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    with torch.no_grad():  # (a forward with grad keeps the root gathered until its backward)
        torch.testing.assert_close(m(idx, idx)[1], ref(idx, idx)[1], rtol=0, atol=0)
    rt = runtime_of(m)
    assert rt.live_bytes() == 0 and len(rt.units) == 1 + CFG.n_layer


def test_tied_param_stays_one_param():
    with torch.device("meta"):
        m = Stack()
        m.blocks[2][0].weight = m.blocks[0][0].weight  # tied across units: the root's
    torch.manual_seed(1)
    offload.shard(m)
    got = full_state_dict(m)
    assert torch.equal(got["blocks.0.0.weight"], got["blocks.2.0.weight"])
    assert got["blocks.0.0.weight"].abs().sum() > 0  # initialised (by the last module's reset that holds it)
    assert m.blocks[2][0].weight is m.blocks[0][0].weight
    root = runtime_of(m).units[0]
    assert "blocks.0.0.weight" in root.flats[0].names


def test_partly_meta_keeps_the_real_params():
    """Only the meta tensors are materialized and initialised; the real ones keep their values."""
    torch.manual_seed(2)
    m = Stack()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.device("meta"):
        m.blocks[1] = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))
    torch.manual_seed(3)
    offload.shard(m)
    got = full_state_dict(m)
    torch.manual_seed(3)
    fresh = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))
    for k, v in before.items():
        want = fresh.state_dict()[k[len("blocks.1."):]] if k.startswith("blocks.1.") else v
        assert torch.equal(got[k], want), k


class Rotary(nn.Module):
    """A non-persistent buffer computed in __init__ (as rotary caches are): on meta it needs an init."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x):
        return self.proj(x) * self.inv_freq.repeat(2)


def test_buffers_on_meta():
    def init(mod):
        if isinstance(mod, Rotary):
            mod.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
        elif isinstance(mod, nn.Linear):
            mod.reset_parameters()

    torch.manual_seed(4)
    ref = nn.Sequential(Rotary(), nn.ModuleList([Rotary()]))
    with torch.device("meta"):
        m = nn.Sequential(Rotary(), nn.ModuleList([Rotary()]))
    with pytest.raises(ValueError, match=r"no reset_parameters\(\).*0 \(Rotary: inv_freq\); 1.0 \(Rotary: inv_freq\)"):
        offload.shard(m)
    torch.manual_seed(4)
    offload.shard(m, init_fn=init)
    assert torch.equal(m[0].inv_freq, ref[0].inv_freq) and torch.equal(m[1][0].inv_freq, ref[1][0].inv_freq)
    _equal(full_state_dict(m), ref.state_dict())


def test_errors():
    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(3, 3), NoInit())
    with pytest.raises(ValueError, match=r"have no reset_parameters\(\) to initialise them: 1 \(NoInit: w\)"):
        offload.shard(m)
    assert m[0].weight.is_meta  # checked before anything was allocated or sharded
    with pytest.raises(FileNotFoundError, match="no checkpoint at weights="):
        offload.shard(m, weights="/nonexistent/ckpt.safetensors")
    assert m[0].weight.is_meta
    with pytest.raises(ValueError, match="this model has none"):
        offload.shard(nn.Linear(2, 2), init_fn=gpt_init)
    with pytest.raises(TypeError, match="init_fn must be callable"):
        offload.shard(_on_meta(Stack, 0), init_fn=3)
    # TinyGPT's own reset_parameters writes into every block from the root: the blocks are
    # sharded by then, so the write is refused (it would land in freed memory).
    with pytest.raises(RuntimeError, match=r"init_fn of module <root> \(TinyGPT\) wrote .* a unit already sharded"):
        offload.shard(_on_meta(lambda: TinyGPT(CFG), 0), init_fn=lambda mod: mod.reset_parameters()
                      if isinstance(mod, TinyGPT) else gpt_init(mod))


# ---------------------------------------------------------------------- two ranks
def _rank_job(rank, world):
    """On the session's two gloo ranks (tests/_ranks.py ``group``)."""
    m = offload.shard(_on_meta(lambda: TinyGPT(CFG), 11), init_fn=gpt_init)
    s = offload.shard(_on_meta(Stack, 5))
    shards = [p.numel() for p in m.parameters() if hasattr(p, "_offload_shard")]
    res = [{k: v.numpy() for k, v in full_state_dict(x, rank0_only=r0).items()} for x, r0 in ((m, False), (s, True))]
    return (*res, shards)  # numpy: torch tensors would be shared through this process's fds


def test_two_ranks_materialize_the_same_model():
    got = _ranks.group(2).run(_rank_job, timeout=180)  # a spawn of its own cost ~3 s
    ref_gpt, ref_stack = _gpt_ref(11).state_dict(), _stack_ref(5).state_dict()
    for r in (0, 1):
        _equal(got[r][0], ref_gpt)
    _equal(got[0][1], ref_stack)
    assert got[1][1] == {}  # rank0_only
    whole = sum(v.numel() for v in ref_gpt.values())
    assert sum(got[0][2]) < 0.6 * whole  # each rank keeps its half (+ the 256-element padding)


# ---------------------------------------------------------------------- peak RSS
_RSS_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.nn as nn, torch.distributed as dist
    rank, port, path, depth, width = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    import offload
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    with torch.device("meta"):
        model = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on
    base = status("VmRSS")
    torch.manual_seed(0)
    offload.shard(model, weights=path)
    peak, now = status("VmHWM"), status("VmRSS")
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    i = depth - 1 - rank  # a unit's values where this rank's chunk lies
    flat = offload.shard.runtime_of(model).units[i + 1].flats[0]
    lo = rank * flat.chunk
    want = torch.cat([torch.full((width * width,), float(i)), torch.full((width,), -float(i))])
    ok = torch.equal(flat.shard_values()[:max(0, min(flat.chunk, want.numel() - lo))], want[lo:lo + flat.chunk])
    print("RESULT", peak - base, now - base, shard, ok, flush=True)
    dist.barrier()
    os._exit(0)
""")


def test_meta_build_and_streamed_load_peak_rss(tmp_path):
    """A 24 x Linear(2048, 2048) model (W = 403 MB fp32, units of W/24) built on meta, sharded
    on 2 gloo ranks and loaded from a safetensors file (``shard(weights=)``), each rank in a
    fresh process, its VmHWM reset to VmRSS (clear_refs 5) right before ``shard()``.

    What each rank must hold at the end: its shard, W/2. What it may hold on top at the peak:
    the unit being built (its params, its flat buffer, the chunk clone: 2.5 units), the chunk
    being loaded (a copy and the rows read: ~1.5 units); measured: 2 units. The check: peak
    growth - shard bytes < 4 units + 64 MB (= 131 MB), i.e. peak < 0.67 W + 64 MB. A rank that
    materialized the whole model at once (W more), kept the file's pages mapped (W/2 more) or
    left the units' freed temporaries in the heap (about W/2 more, the trims in materialize.py)
    exceeds it. (W is 403 MB, not more, to keep the test near 10 s of CPU time.)"""
    from safetensors.torch import save_file
    depth, width = 24, 2048
    path = str(tmp_path / "big.safetensors")
    weights = {}
    for i in range(depth):  # unit i: weight all i, bias all -i (cheap to make and to check)
        weights[f"{i}.weight"] = torch.full((width, width), float(i))
        weights[f"{i}.bias"] = torch.full((width,), -float(i))
    save_file(weights, path)
    whole = sum(t.numel() * 4 for t in weights.values())
    del weights
    script = tmp_path / "rss_rank.py"
    script.write_text(_RSS_SCRIPT)
    port = str(_ranks.free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, path, str(depth), str(width)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    unit = whole // depth
    for (so, se), p in zip(outs, procs):
        assert p.returncode == 0, se[-3000:]
        line = [ln for ln in so.splitlines() if ln.startswith("RESULT")][0].split()
        peak, now, shard, ok = int(line[1]), int(line[2]), int(line[3]), line[4] == "True"
        assert ok, "the loaded shard differs from the file"
        assert abs(shard - whole / 2) < 0.01 * whole
        assert peak - shard < 4 * unit + (64 << 20), (peak >> 20, shard >> 20, unit >> 20)


def test_transformers_gpt2_on_meta(tmp_path):
    """HF GPT-2 (tied head) built on meta: with its own ``_init_weights`` as init_fn, and with
    ``weights=`` a checkpoint of a normal build, whose state dict and loss it then equals."""
    from test_shard_models import GPT2, _gpt2, _takes_attn
    transformers = pytest.importorskip("transformers")
    kw = {"attn_implementation": "eager"} if _takes_attn() else {}  # as _gpt2 builds it
    ref = _gpt2()
    sd = ref.state_dict()
    torch.save(sd, tmp_path / "gpt2.pt")
    ids = torch.randint(0, 256, (2, 16))
    for how in ("init_fn", "weights"):
        with torch.device("meta"):
            m = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2), **kw)
        torch.manual_seed(0)
        if how == "init_fn":
            offload.shard(m, init_fn=m._init_weights)
        else:
            offload.shard(m, weights=tmp_path / "gpt2.pt")
            _equal(full_state_dict(m), sd)
        assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))
        with torch.no_grad():
            loss, want = m(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
        if how == "weights":
            torch.testing.assert_close(loss, want, rtol=0, atol=0)
        else:
            assert abs(loss.item() - want.item()) < 0.2  # another draw of the same init: about log(256)
