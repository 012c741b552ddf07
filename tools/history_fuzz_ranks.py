"""A stateful differential fuzz over training histories at 2 ranks (the counterpart of
tools/history_fuzz.py, which runs one process).

Each seed starts the same history on two gloo ranks (one random stream, the same on both:
every rank draws every rank's grads and uses its own). A small module holds params of odd
sizes (fp32, or bf16 for some seeds); grads come from backward passes of a linear loss
``sum(p * c)`` (so ``p.grad`` accumulates as in any training loop). Three optimizers run in
lockstep on every rank:

- A: the offload optimizer under test, at stage 1 or 2 (stage 3 through ``offload.shard`` for
  some seeds), offload none/cpu/nvme; the one replaced (state_dict, checkpoints at the same
  world size, DCP's get/set_optimizer_state_dict, close(keep_swap=True) + resume=True);
- B: an offload twin of A's configuration that is never replaced: A == B bit for bit
  ("interrupted == uninterrupted");
- C: the reference, DDP's: each rank's local grads averaged (a param without a grad on a rank
  counts as zeros there, None where no rank has one), stepped by torch.optim over float32
  copies on every rank (GradScaler and clip_grad_norm as a DDP loop does them); compared with
  tolerances while A keeps float32 states.

After every operation: A's params equal on both ranks bit for bit, A == B bit for bit (params
and the gathered state_dict), A ~ C. A checkpoint is also loaded into a 1-process (stage 0)
optimizer, whose state_dict must equal A's.

Usage:  PYTHONPATH=. python tools/history_fuzz_ranks.py --seeds 0:50 [--ops N] [--verbose]
A failing seed prints its reproducer (the command with --seeds S:S+1 --verbose).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import queue
import random
import shutil
import sys
import traceback
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from history_fuzz import TORCH_CLASS, Mismatch, _bits_equal, _close, _diff, _same_dicts, close_twins, rand_hyper, step_twins, torch_step  # noqa: E402

SIZES = [1, 7, 17, 300, 4097]
SHAPES = {1: (1,), 7: (7,), 17: (17,), 300: (20, 15), 4097: (4097,)}
# swap dirs and checkpoints: a disk file system (O_DIRECT), made if missing
SCRATCH = os.environ.get("FUZZ_SCRATCH", "/var/tmp/offload-history-fuzz")
os.makedirs(SCRATCH, exist_ok=True)
WORLD = 2
LION_FLIPS = 3  # sign flips allowed per element for Lion with compressed states (Run._check_compressed)


def rand_config(rng: random.Random) -> dict:
    name = rng.choice(["Adam", "AdamW", "SGD", "Adagrad", "Lion"])
    hp = rand_hyper(rng, name, wide=False)
    stage = 3 if rng.random() < 0.15 else rng.choice([1, 2])
    pdtype = torch.bfloat16 if rng.random() < 0.3 else torch.float32
    store = rng.choice(["none", "cpu", "nvme"])
    sd = "float32" if rng.random() < 0.8 else rng.choice(["bfloat16", "int8"])
    clip = rng.choice([None, None, 1.0, 0.05])
    # (README, stage 3: grads on disk are a stand-in GradScaler cannot unscale: not supported)
    scaler = rng.random() < 0.25 and not (stage == 3 and store == "nvme")
    return dict(name=name, hp=hp, stage=stage, pdtype=pdtype, store=store, state_dtype=sd,
                max_grad_norm=clip, scaler=scaler,
                sizes=rng.sample(SIZES, rng.randint(2, 4)))


class Unit(torch.nn.Module):
    """One param; its forward is the linear loss whose grad is the coefficients given."""

    def __init__(self, v):
        super().__init__()
        self.w = torch.nn.Parameter(v)

    def forward(self, c):
        return (self.w.float() * c).sum()


class Model(torch.nn.Module):
    def __init__(self, values):
        super().__init__()
        self.units = torch.nn.ModuleList(Unit(v.clone()) for v in values)

    def forward(self, coefs):  # coefs: {unit index: coefficient tensor}
        return sum(self.units[i](c) for i, c in coefs.items())


class Run:
    def __init__(self, rank: int, seed: int, n_ops: int):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.seed, self.n_ops = rank, seed, n_ops
        self.rng = random.Random(seed)
        self.cfg = cfg = rand_config(self.rng)
        self.log = []
        self.counter = 0
        gen = torch.Generator().manual_seed(seed)
        self.values = [torch.randn(SHAPES[n], generator=gen).to(cfg["pdtype"]) for n in cfg["sizes"]]
        self.n = len(self.values)
        self.exact = cfg["state_dtype"] == "float32"
        self.mA, self.mB = Model(self.values), Model(self.values)
        if cfg["stage"] == 3:
            import offload
            offload.shard(self.mA, unit={Unit})
            offload.shard(self.mB, unit={Unit})
        self.cparams = [torch.nn.Parameter(v.float().clone()) for v in self.values]
        self.lrs = []  # the lr of each step C took
        self.local = [[None] * self.n for _ in range(WORLD)]  # each rank's p.grad, as DDP-less ranks hold it
        self.a_store = cfg["store"]
        self.A = self._make("A", self.a_store)
        self.B = self._make("B", cfg["store"])
        self.C = TORCH_CLASS[cfg["name"]](self.cparams, **cfg["hp"])
        self.sched = None
        self.scalers = None
        if cfg["scaler"]:
            init = 2.0 ** self.rng.randint(0, 16)
            gi = self.rng.choice([1, 2, 2000])
            self.scalers = [torch.amp.GradScaler("cpu", init_scale=init, growth_interval=gi) for _ in range(3)]

    # --- building -----------------------------------------------------------------
    def _dir(self, tag):
        self.counter += 1
        d = os.path.join(SCRATCH, f"s{self.seed}", f"{tag}{self.counter}")
        os.makedirs(d, exist_ok=True)
        return d

    def _make(self, who, store, hp_from=None, resume=False, swap_dir=None, stage=None, params=None, pg=None):
        import offload
        cfg = self.cfg
        kw = dict(cfg["hp"], offload=store, max_grad_norm=cfg["max_grad_norm"])
        if cfg["stage"] != 3:
            kw["stage"] = cfg["stage"] if stage is None else stage
        if pg is not None:
            kw["process_group"] = pg
        if cfg["state_dtype"] != "float32":
            kw["state_dtype"] = cfg["state_dtype"]
        if store == "nvme":
            kw["swap_dir"] = swap_dir or self._dir("swap" + who)
            if resume:
                kw["resume"] = True
        if params is None:
            params = list((self.mA if who == "A" else self.mB).parameters())
        groups = [{"params": params}]
        if hp_from is not None:
            groups[0].update({k: v for k, v in hp_from.param_groups[0].items() if k != "params"})
        opt = getattr(offload, cfg["name"])(groups, **kw)
        opt._fuzz_swap = kw.get("swap_dir")
        return opt

    # --- comparing ----------------------------------------------------------------
    def pA(self):
        return list(self.mA.parameters())

    def pB(self):
        return list(self.mB.parameters())

    def whole(self, model):
        """The whole params (stage 3: gathered, a collective)."""
        if self.cfg["stage"] == 3:
            import offload
            g = offload.shard.gathered_params(model)
            return [g[f"units.{i}.w"].detach().clone() for i in range(self.n)]
        return [p.detach().clone() for p in model.parameters()]

    def check(self, what):
        dist = self.dist
        wa, wb = self.whole(self.mA), self.whole(self.mB)
        flat = torch.cat([w.float().reshape(-1) for w in wa])
        both = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(both, flat)
        if not _bits_equal(both[0], both[1]):
            raise Mismatch(f"after {what}: A's params differ between ranks: {_diff(both[0], both[1])}")
        for i, (a, b) in enumerate(zip(wa, wb)):
            if not _bits_equal(a, b):
                raise Mismatch(f"after {what}: param {i} A != B bitwise: {_diff(a, b)}")
        sa, sb = self.A.state_dict(), self.B.state_dict()
        optional = ("master", "max_exp_avg_sq")
        _same_dicts(sa, sb, exact=True, where=f"after {what}: state_dict A vs B", optional=optional)
        if not self.exact:
            self._check_compressed(what, wa)
            return
        tol = dict(rtol=2e-5, atol=2e-6) if self.cfg["max_grad_norm"] is None else dict(rtol=1e-4, atol=1e-5)
        lowp = self.cfg["pdtype"] != torch.float32
        if self.cfg["stage"] != 3:
            _same_dicts(sa, self.C.state_dict(), exact=False, where=f"after {what}: state_dict A vs torch", tol=tol,
                        drop=("master",) if lowp else (), lazy_init=self.cfg["name"] == "Adagrad",
                        optional=("max_exp_avg_sq",))
        for i, (a, c) in enumerate(zip(wa, self.cparams)):
            if lowp:
                if not _close(a.float(), c.detach().to(a.dtype).float(), rtol=1e-2, atol=1e-2):
                    raise Mismatch(f"after {what}: bf16 param {i} vs torch: {_diff(a, c)}")
            elif not _close(a, c.detach(), **tol):
                raise Mismatch(f"after {what}: param {i} vs torch: {_diff(a, c)}")

    def _check_compressed(self, what, wa):
        """A ~ C with compressed states: loose tolerances (README: compressed states). Lion's
        update is lr * sign(beta1 * m + (1 - beta1) * g): where that is near zero, the rounding
        of a bf16/int8 ``exp_avg`` flips the sign, a step of 2 * lr against torch's (seed 155:
        lr 0.05, torch's +0.0002 against bf16 m's -0.0001, the torch backend's reference
        compressed step the same). Allowed per element: a few flips at the largest lrs
        stepped; the elements beyond the plain tolerance stay few (a wrong sign or lr is in
        most of them)."""
        flips = 2 * sum(sorted(self.lrs)[-LION_FLIPS:]) if self.cfg["name"] == "Lion" else 0.0
        for i, (a, c) in enumerate(zip(wa, self.cparams)):
            a, c = a.float(), c.detach()
            far = int(((a - c).abs() > 0.05 + 0.05 * c.abs()).sum()) if flips else 0
            if not _close(a, c, rtol=0.05, atol=0.05 + flips) or far > max(2, c.numel() // 20):
                raise Mismatch(f"after {what}: param {i} (compressed states) vs torch: {_diff(a, c)}"
                               + (f"; {far} of {c.numel()} elements beyond the tolerance without sign flips"
                                  if flips else ""))

    # --- operations ---------------------------------------------------------------
    def _coefs(self, scale):
        """Every rank's coefficients for one backward: {rank: {param: c}}; some params none on one rank."""
        rng = self.rng
        nonfinite = self.scalers is not None or self.cfg["max_grad_norm"] is not None
        out = {r: {} for r in range(WORLD)}
        for i in range(self.n):
            r = rng.random()
            ranks = [] if r < 0.1 else [rng.randrange(WORLD)] if r < 0.3 else list(range(WORLD))
            for k in ranks:
                c = torch.randn(self.values[i].shape, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
                c = c * rng.choice([1.0, 1e-3, 10.0])
                if nonfinite and rng.random() < 0.05:
                    c.view(-1)[rng.randrange(c.numel())] = rng.choice([math.inf, -math.inf, math.nan])
                out[k][i] = c * scale
        return out

    def _backward(self, coefs):
        mine = coefs[self.rank]
        for m in (self.mA, self.mB):
            if mine:
                m(mine).backward()
            elif self.cfg["stage"] == 3:
                # stage 3: every rank runs the forward and backward of the same units (a unit
                # skipped on one rank is agreed on): a zero loss through one unit
                m({0: torch.zeros(self.values[0].shape)}).backward()
        for r in range(WORLD):
            if not coefs[r] and self.cfg["stage"] == 3:
                coefs = dict(coefs)
                coefs[r] = {0: torch.zeros(self.values[0].shape)}
            for i, c in coefs[r].items():
                g = c.to(self.cfg["pdtype"])
                self.local[r][i] = g if self.local[r][i] is None else self.local[r][i] + g

    def op_step(self):
        rng = self.rng
        micro = rng.choice([1, 1, 1, 2, 3])
        scale = self.scalers[0].get_scale() if self.scalers else 1.0
        if self.scalers:
            for sc in self.scalers:
                sc.scale(torch.ones(()))  # as scaler.scale(loss) would, before the first step
        for k in range(micro):
            coefs = self._coefs(scale)
            if k < micro - 1:
                with self.A.no_sync(), self.B.no_sync():
                    self._backward(coefs)
            else:
                self._backward(coefs)
        self.log.append(f"step micro={micro} grads={[[i in self._last_has(r) for i in range(self.n)] for r in range(WORLD)]}")
        if self.scalers and not any(g is not None for r in range(WORLD) for g in self.local[r]):
            self.log.append("  (no grads: scaler step skipped)")
            return
        skipped = step_twins((self.A, self.B), self.scalers)
        skip_c = self._torch_step()
        if skipped[0] != skipped[1]:
            raise Mismatch(f"last_step_skipped A {skipped[0]} B {skipped[1]}")
        if self.scalers:
            if self.scalers[0].get_scale() != self.scalers[2].get_scale():
                raise Mismatch(f"scaler scale A {self.scalers[0].get_scale()} torch {self.scalers[2].get_scale()}")
            if self.scalers[0].get_scale() != self.scalers[1].get_scale():
                raise Mismatch(f"scaler scale A {self.scalers[0].get_scale()} B {self.scalers[1].get_scale()}")
        elif self.cfg["max_grad_norm"] is not None and skipped[0] != skip_c:
            raise Mismatch(f"skipped: A {skipped[0]} torch {skip_c}")
        if self.sched is not None:
            for s in self.sched[1:]:
                s.step()

    def _last_has(self, r):
        return {i for i in range(self.n) if self.local[r][i] is not None}

    def _torch_step(self):
        """DDP's average of the ranks' local grads, stepped by torch.optim (GradScaler's
        unscale_, clip_grad_norm_); the grads restored after it, as the ranks' p.grad stay."""
        for i, p in enumerate(self.cparams):
            gs = [self.local[r][i] for r in range(WORLD)]
            if all(g is None for g in gs):
                p.grad = None
            else:
                p.grad = sum(g.float() for g in gs if g is not None) / WORLD
        C, sc = self.C, (self.scalers[2] if self.scalers else None)

        def before_step():  # on a step taken only
            self.lrs.append(float(C.param_groups[0]["lr"]))  # (Lion's sign flips: _check_compressed)
            for p in self.cparams:  # amsgrad turned on later: torch's step needs the entry
                st = C.state.get(p)
                if C.param_groups[0].get("amsgrad") and st and "exp_avg" in st and "max_exp_avg_sq" not in st:
                    st["max_exp_avg_sq"] = torch.zeros_like(p)
        try:
            return torch_step(C, sc, self.cparams, self.cfg["max_grad_norm"], before_step)
        finally:
            for p in self.cparams:
                p.grad = None

    def op_zero_grad(self):
        none = self.rng.random() < 0.5
        self.log.append(f"zero_grad(set_to_none={none})")
        for opt in (self.A, self.B):
            opt.zero_grad(set_to_none=none)
        for r in range(WORLD):
            for i in range(self.n):
                if self.local[r][i] is not None:
                    self.local[r][i] = None if none else torch.zeros_like(self.local[r][i])

    def op_hparam(self):
        name = self.cfg["name"]
        choices = [("lr", self.rng.choice([1e-3, 0.05, 0.0])), ("weight_decay", self.rng.choice([0.0, 0.05]))]
        if name in ("Adam", "AdamW", "Lion"):
            choices.append(("betas", self.rng.choice([(0.8, 0.99), (0.9, 0.999)])))
        if name in ("Adam", "AdamW", "SGD", "Adagrad"):
            choices.append(("maximize", self.rng.random() < 0.5))
        if name == "Adagrad":
            choices.append(("lr_decay", self.rng.choice([0.0, 0.1])))
        if name in ("Adam", "AdamW") and self.cfg["hp"]["amsgrad"]:
            choices.append(("amsgrad", self.rng.random() < 0.5))
        k, v = self.rng.choice(choices)
        self.log.append(f"group[0][{k!r}] = {v!r}")
        for opt in (self.A, self.B, self.C):
            opt.param_groups[0][k] = v

    def op_sched(self):
        if self.sched is not None:
            return self.op_hparam()
        kind = self.rng.choice(["step", "lambda", "exp"])
        self.log.append(f"sched {kind}")
        self.sched = (kind,) + tuple(self._make_sched(kind, o) for o in (self.A, self.B, self.C))

    def _make_sched(self, kind, opt):
        L = torch.optim.lr_scheduler
        if kind == "step":
            return L.StepLR(opt, step_size=2, gamma=0.5)
        if kind == "lambda":
            return L.LambdaLR(opt, lambda e: 1.0 / (1.0 + e))
        return L.ExponentialLR(opt, gamma=0.9)

    def _remake_sched(self):
        if self.sched is None:
            return
        kind = self.sched[0]
        new = []
        for opt, old in zip((self.A, self.B, self.C), self.sched[1:]):
            s = self._make_sched(kind, opt)
            s.load_state_dict(old.state_dict())
            new.append(s)
        self.sched = (kind,) + tuple(new)

    # replacements of A ------------------------------------------------------------
    def _other_store(self):
        store = self.rng.choice(["none", "cpu", "nvme"])
        if self.cfg["stage"] == 3 and (store == "nvme") != (self.cfg["store"] == "nvme"):
            # (documented: grad shards an optimizer placed in swap files stay there, and a
            # model whose grads are in RAM takes no swapping optimizer: shard a new model)
            store = self.cfg["store"]
        return store

    def _replace(self, how, store, make):
        self.log.append(f"replace A by {how} -> store={store}")
        old = self.A
        self.A = make()
        if not getattr(old, "_fuzz_closed", False):
            old.close()
        self.a_store = store
        sd = copy.deepcopy(self.C.state_dict())  # torch's twin moves through its state_dict too
        self.C = TORCH_CLASS[self.cfg["name"]](self.cparams, **self.cfg["hp"])
        self.C.load_state_dict(sd)
        self._remake_sched()

    def op_state_dict(self):
        store = self._other_store()

        def make():
            sd = copy.deepcopy(self.A.state_dict())
            new = self._make("A", store)
            new.load_state_dict(sd)
            return new
        self._replace("state_dict", store, make)

    def op_load_own(self):
        self.log.append("A.load_state_dict(A.state_dict())")
        self.A.load_state_dict(copy.deepcopy(self.A.state_dict()))

    def op_checkpoint(self):
        store = self._other_store()
        d = self._dir("ck")

        def make():
            if self.cfg["stage"] == 3:  # (opt.save_checkpoint holds one rank's shards: refused on several)
                import offload
                offload.shard.save_checkpoint(self.mA, self.A, d)
                new = self._make("A", store)
                offload.shard.load_checkpoint(self.mA, new, d)
                return new
            self.A.save_checkpoint(d)
            if self.rng.random() < 0.5:
                self._one_process_load(d)
            new = self._make("A", store)
            new.load_checkpoint(d)
            return new
        self._replace("checkpoint", store, make)

    def _one_process_load(self, d):
        """The checkpoint of 2 ranks into an optimizer of one process (stage 1 over a group of
        this rank alone: the README's way for fp32 CPU params): its state_dict is A's."""
        self.log.append("  (and into a 1-process optimizer)")
        if not hasattr(self, "solo"):
            solo = [self.dist.new_group([r]) for r in range(WORLD)]  # (a collective: every rank makes both)
            self.solo = solo[self.rank]
        ps = [torch.nn.Parameter(p.detach().clone()) for p in self.pA()]
        one = self._make("one" + str(self.rank), self.rng.choice(["none", "cpu", "nvme"]), stage=1, params=ps, pg=self.solo)
        try:
            one.load_checkpoint(d)
            s1, sa = one.state_dict(), self.A.state_dict()
            _same_dicts(s1, sa, exact=True, where="stage-0 load of the checkpoint vs A", optional=("master", "max_exp_avg_sq"))
        finally:
            one.close()

    def op_resume(self):
        if self.a_store != "nvme":
            return self.op_state_dict()
        swap = self.A._fuzz_swap

        def make():
            self.A.close(keep_swap=True)
            self.A._fuzz_closed = True
            return self._make("A", "nvme", hp_from=self.A, resume=True, swap_dir=swap)
        self._replace("resume", "nvme", make)

    def op_dcp(self):
        from torch.distributed.checkpoint import state_dict as dcp_sd
        store = self._other_store()
        flatten = self.rng.random() < 0.5
        states = self.B.state_dict()["state"]
        if not any(states.values()):
            # (not triaged: DCP's fake step on the new optimizer lists entries (step 0, masters)
            # for params that never stepped, where the uninterrupted twin lists none)
            return self.op_state_dict()
        if not all(states.get(i) for i in range(self.n)):
            # a param that never had a grad has no state: DCP's set_optimizer_state_dict (strict)
            # raises "Missing optimizer state for parameter", for torch.optim's too (torch 2.13)
            return self.op_state_dict()
        if any(p.grad is not None for p in self.pA()):
            # DCP's unflatten rebuilds each entry from the keys the new optimizer's opt.state[p]
            # lists after its fake step, which it skips where a param has a grad: every state
            # is dropped then, torch.optim's too (torch/distributed/checkpoint/state_dict.py)
            flatten = False
        options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=flatten)

        def make():
            osd = copy.deepcopy(dcp_sd.get_optimizer_state_dict(self.mA, self.A, options=options))
            new = self._make("A", store)
            # (the flattened form's unflatten takes the group keys the new optimizer's groups
            # list: a key an LR scheduler added (initial_lr) comes back only where the new
            # optimizer has it, as when its scheduler is made before the load; torch.optim's
            # optimizer too (torch 2.13): the placeholder is overwritten from the dict)
            for mine, saved in zip(new.param_groups, self.A.param_groups):
                for k in saved:
                    mine.setdefault(k, None)
            dcp_sd.set_optimizer_state_dict(self.mA, new, osd, options=options)
            return new
        self._replace(f"dcp flatten={flatten}", store, make)

    OPS = [("op_step", 10), ("op_hparam", 2), ("op_sched", 1), ("op_zero_grad", 3), ("op_state_dict", 2),
           ("op_load_own", 1), ("op_checkpoint", 2), ("op_resume", 1), ("op_dcp", 1)]

    def run(self):
        names = [n for n, w in self.OPS for _ in range(w)]
        self._together(lambda: (self.op_step(), self.check("first step")))
        for _ in range(self.n_ops):
            name = self.rng.choice(names)
            self._together(lambda: (getattr(self, name)(), self.check(self.log[-1])))

    def _together(self, fn):
        """``fn`` on every rank; a failure on one rank (a local check) stops every rank here,
        not in the next collective."""
        err = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            err = e
        flag = torch.tensor([0 if err is None else 1])
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
        if err is not None:
            raise err
        if int(flag):
            raise Mismatch(f"the other rank failed (at {self.log[-1] if self.log else 'the start'})")

    def close(self):
        close_twins((self.A, self.B))


def describe(cfg):
    return (f"{cfg['name']} {cfg['hp']} stage={cfg['stage']} {cfg['pdtype']} store={cfg['store']} "
            f"sd={cfg['state_dtype']} clip={cfg['max_grad_norm']} scaler={cfg['scaler']} sizes={cfg['sizes']}")


def seed_job(rank, seed, n_ops):
    """One seed on this rank: (ok, message, log)."""
    import torch.distributed as dist
    if rank == 0:
        shutil.rmtree(os.path.join(SCRATCH, f"s{seed}"), ignore_errors=True)
    dist.barrier()
    run = None
    try:
        run = Run(rank, seed, n_ops)
        run.run()
        res = (True, "", run.log, describe(run.cfg))
    except Exception as e:  # noqa: BLE001: every failure is reported with its reproducer
        kind = "MISMATCH" if isinstance(e, Mismatch) else f"ERROR {type(e).__name__}"
        res = (False, f"{kind}: {str(e)[:400]}\n{traceback.format_exc()[-1500:]}", run.log if run else [],
               describe(run.cfg) if run else rand_config(random.Random(seed)))
    finally:
        if run is not None:
            run.close()
    # a rank that failed alone: the other may wait in a collective until the group's timeout
    try:
        dist.barrier()
    except Exception as e:  # noqa: BLE001
        return (False, res[1] + f"\n(the closing barrier failed: {str(e)[:200]})", res[2], res[3])
    if rank == 0:
        shutil.rmtree(os.path.join(SCRATCH, f"s{seed}"), ignore_errors=True)
    return res


def serve(rank, port, inq, outq, timeout):
    import logging
    import torch.distributed as dist
    torch.set_num_threads(1)
    import faulthandler
    faulthandler.enable()  # (gloo aborts a rank on a collective mismatch: its Python stack)
    if os.environ.get("FUZZ_DUMP"):  # seconds: every rank's stacks, repeatedly (a hang)
        faulthandler.dump_traceback_later(float(os.environ["FUZZ_DUMP"]), repeat=True)
    warnings.simplefilter("ignore")
    logging.getLogger("offload").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=timeout))
    while True:
        job = inq.get()
        if job is None:
            break
        try:
            outq.put((rank, seed_job(rank, *job)))
        except BaseException:
            outq.put((rank, (False, "ERROR (job): " + traceback.format_exc()[-1500:], [], "")))
            break
    outq.close()
    outq.join_thread()
    os._exit(0)


class Ranks:
    def __init__(self, timeout):
        import socket
        import torch.multiprocessing as mp
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "offload", "history_fuzz"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.inq = [ctx.Queue() for _ in range(WORLD)]
        self.outq = ctx.Queue()
        self.procs = [ctx.Process(target=serve, args=(r, port, self.inq[r], self.outq, timeout), daemon=True)
                      for r in range(WORLD)]
        for p in self.procs:
            p.start()

    def run(self, job, timeout):
        """Each rank's answer; a rank that died (gloo aborts a process on a collective
        mismatch) answers with its exit code at once, not after ``timeout``."""
        import time
        for q in self.inq:
            q.put(job)
        got, end, dead_since = {}, time.monotonic() + timeout, None
        while len(got) < WORLD:
            try:
                rank, value = self.outq.get(timeout=1)
                got[rank] = value
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if r not in got and p.exitcode is not None]
            dead_since = dead_since or (time.monotonic() if dead else None)
            if dead and time.monotonic() - dead_since > 5:  # (what it put before dying has arrived)
                for r in dead:
                    got[r] = (False, f"DIED: rank {r} exited with code {self.procs[r].exitcode} (its stderr "
                                     "has the stack)", [], "")
                if len(got) < WORLD:
                    raise queue.Empty
            if time.monotonic() > end:
                raise queue.Empty
        return got

    def close(self):
        for q in self.inq:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0:20")
    ap.add_argument("--ops", type=int, default=None, help="operations per seed (default 5-15, drawn)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--timeout", type=float, default=60, help="the process group's timeout (s)")
    args = ap.parse_args(argv)
    a, b = (int(x) for x in args.seeds.split(":"))
    os.makedirs(SCRATCH, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH", "")]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = None
    fails = 0
    for seed in range(a, b):
        n_ops = args.ops if args.ops is not None else random.Random(~seed).randint(5, 15)
        if ranks is None:
            ranks = Ranks(args.timeout)
        try:
            got = ranks.run((seed, n_ops), timeout=args.timeout * 3 + 60)
        except queue.Empty:
            got = {0: (False, "HANG: no answer from a rank", [], ""), 1: (False, "HANG", [], "")}
        bad = [r for r in sorted(got) if not got[r][0]]
        if bad or len(got) < WORLD:
            fails += 1
            ranks.close()
            ranks = None
            # the rank whose own error it is, not the one that saw the other fail
            own = [r for r in bad if not got[r][1].startswith("MISMATCH: the other rank")]
            first = got.get((own or bad)[0]) if bad else (False, "a rank gave no answer", [], "")
            print(f"seed {seed}: rank(s) {bad}: {first[1].splitlines()[0] if first[1] else ''}")
            info = next((got[r] for r in sorted(got) if got[r][3]), first)  # (a rank that died has no log)
            print(f"  cfg {info[3]}")
            print("  ops: " + " | ".join(info[2] if args.verbose else info[2][-8:]))
            if args.verbose:
                for r in bad:
                    print(f"  --- rank {r}:\n{got[r][1]}")
            print(f"  reproduce: python tools/history_fuzz_ranks.py --seeds {seed}:{seed + 1} --ops {n_ops} --verbose")
        elif args.verbose:
            print(f"seed {seed}: ok: {got[0][3]}\n  " + " | ".join(got[0][2]))
        sys.stdout.flush()
    if ranks is not None:
        ranks.close()
    print(f"{b - a} seeds, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
