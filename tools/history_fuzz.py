"""A stateful differential fuzz over training histories.

Each seed builds a few params of odd sizes and runs three optimizers in lockstep through a
random history of legitimate operations (steps with some grads None, hyperparameter changes,
LR schedulers, add_param_group, freezing, zero_grad, GradScaler with inf/NaN grads,
max_grad_norm, opt.state writes and clears, state_dict moves through torch, checkpoints into
another store or state_dtype, close(keep_swap=True) + resume=True):

- A: the offload optimizer under test; it is the one replaced (state_dict, checkpoint, resume);
- B: an offload shadow of the same configuration that is never replaced while A's bits class
  stays the same (so "interrupted == uninterrupted", bit for bit, as the README promises);
  when A changes state_dtype, B follows through state_dict() -> load_state_dict(), which the
  README says a checkpoint conversion equals bit for bit;
- C: torch.optim (a plain-torch Lion for Lion) over float32 copies: compared with tolerances
  while A keeps float32 states and masters.

Usage:  PYTHONPATH=. python tools/history_fuzz.py --seeds 0:200 [--ops 12] [--verbose]
A failing seed prints its reproducer: the command with --seeds S:S+1 --verbose.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import random
import shutil
import sys
import tempfile
import traceback
import warnings

import torch

import offload

SIZES = [1, 7, 17, 300, 4097]
SHAPES = {1: (1,), 7: (7,), 17: (17,), 300: (20, 15), 4097: (4097,)}
# swap dirs and checkpoints: a disk file system (O_DIRECT), made if missing
SCRATCH = os.environ.get("FUZZ_SCRATCH", "/var/tmp/offload-history-fuzz")
os.makedirs(SCRATCH, exist_ok=True)


class LionRef(torch.optim.Optimizer):
    """lion-pytorch's update in plain torch (its lerp form), with offload's "step" entry."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize=False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, (b1, b2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["step"] = torch.tensor(0.0)
                st["step"] = st["step"] + 1
                p.mul_(1 - lr * wd)
                update = st["exp_avg"].clone().lerp_(g, 1 - b1).sign_()
                p.add_(update, alpha=-lr)
                st["exp_avg"].lerp_(g, 1 - b2)


TORCH_CLASS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD,
               "Adagrad": torch.optim.Adagrad, "Lion": LionRef}


class Mismatch(AssertionError):
    pass


def rand_hyper(rng: random.Random, name: str, *, wide: bool = True) -> dict:
    """Hyperparameters of ``name`` (torch's keywords, lion-pytorch's for Lion). ``wide=False``:
    the two-rank fuzz's narrower draws (no lr 0.1 or betas (0, 0.99) for Adam, no maximize for
    Adagrad and Lion), the same draws in the same order, so its seeds keep their meaning."""
    if name in ("Adam", "AdamW"):
        lrs, betas = ([1e-3, 1e-2, 0.1], [(0.9, 0.999), (0.5, 0.9), (0.0, 0.99)]) if wide else \
            ([1e-3, 1e-2], [(0.9, 0.999), (0.5, 0.9)])
        return dict(lr=rng.choice(lrs), betas=rng.choice(betas), eps=rng.choice([1e-8, 1e-6]),
                    weight_decay=rng.choice([0.0, 0.01, 0.1]), amsgrad=rng.random() < 0.3,
                    maximize=rng.random() < 0.2)
    if name == "SGD":
        mom = rng.choice([0.0, 0.9, 0.5])
        nest = mom > 0 and rng.random() < 0.4
        return dict(lr=rng.choice([1e-2, 0.1]), momentum=mom, dampening=0.0 if nest else rng.choice([0.0, 0.1]),
                    weight_decay=rng.choice([0.0, 0.01]), nesterov=nest, maximize=rng.random() < 0.2)
    if name == "Adagrad":
        hp = dict(lr=rng.choice([1e-2, 0.1]), lr_decay=rng.choice([0.0, 0.01]), weight_decay=rng.choice([0.0, 0.01]),
                  initial_accumulator_value=rng.choice([0.0, 0.1]), eps=rng.choice([1e-10, 1e-6]))
    else:
        hp = dict(lr=rng.choice([1e-4, 1e-3]), betas=rng.choice([(0.9, 0.99), (0.95, 0.98)]),
                  weight_decay=rng.choice([0.0, 0.1]))
    if wide:
        hp["maximize"] = rng.random() < 0.2
    return hp


def rand_config(rng: random.Random) -> dict:
    name = rng.choice(["Adam", "AdamW", "SGD", "Adagrad", "Lion"])
    hp = rand_hyper(rng, name)
    if name != "Lion" and rng.random() < 0.3:
        hp[rng.choice(["foreach", "fused"])] = rng.choice([True, False])
    r = rng.random()
    pdtype = torch.float32 if r < 0.7 else (torch.bfloat16 if r < 0.9 else torch.float16)
    store = rng.choice(["none", "cpu", "nvme"])
    sd = "float32"
    if rng.random() < 0.25:
        sd = rng.choice(["bfloat16", "int8"])
    master = "float32"
    if pdtype == torch.bfloat16 and rng.random() < 0.3:
        master = "bfloat16"
    scaler = rng.random() < 0.25
    if scaler and hp.get("fused"):  # torch's fused step makes its states even on a step GradScaler skips
        hp["fused"] = False
    return dict(name=name, hp=hp, pdtype=pdtype, store=store, state_dtype=sd, master_dtype=master,
                max_grad_norm=rng.choice([None, None, 1.0, 0.05]), scaler=scaler,
                sizes=rng.sample(SIZES, rng.randint(2, 4)))


def exact_ref(cfg) -> bool:
    return cfg["state_dtype"] == "float32" and cfg["master_dtype"] == "float32"


class Run:
    """The three twins and the history's bookkeeping."""

    def __init__(self, seed: int, n_ops: int, verbose: bool):
        self.rng = random.Random(seed)
        self.seed, self.n_ops, self.verbose = seed, n_ops, verbose
        self.cfg = rand_config(self.rng)
        self.dirs = []
        self.log = []
        torch.manual_seed(seed)
        self.groups = [[]]  # per group: list of (pa, pb, pc)
        for n in self.cfg["sizes"]:
            self.groups[0].append(self._new_param(n))
        self.a_cfg = dict(self.cfg)  # A's current store / state_dtype
        self.b_cfg = dict(self.cfg)  # B's
        self.host_only = False  # a state turned on mid-run: only the host store takes it
        self.uncommitted = False  # A's states written since its last step taken
        self.A = self._make_offload(self.a_cfg, "A")
        self.B = self._make_offload(self.a_cfg, "B")
        self.C = self._make_torch()
        self.c_valid = exact_ref(self.cfg)
        self.sched = None  # (kind, args, sched_a, sched_b, sched_c)
        self.scalers = None
        if self.cfg["scaler"]:
            init = 2.0 ** self.rng.randint(0, 16)
            gi = self.rng.choice([1, 2, 2000])
            self.scalers = [torch.amp.GradScaler("cpu", init_scale=init, growth_interval=gi) for _ in range(3)]

    # --- building -------------------------------------------------------------------
    def _new_param(self, n):
        v = torch.randn(SHAPES.get(n, (n,)))
        dt = self.cfg["pdtype"]
        pa = torch.nn.Parameter(v.to(dt).clone())
        pb = torch.nn.Parameter(v.to(dt).clone())
        pc = torch.nn.Parameter(v.to(dt).float().clone())
        return pa, pb, pc

    def _swap_dir(self):
        d = tempfile.mkdtemp(dir=SCRATCH, prefix=f"s{self.seed}-")
        self.dirs.append(d)
        return d

    def _group_dicts(self, which, hp_from=None):
        out = []
        for gi, g in enumerate(self.groups):
            d = {"params": [t[which] for t in g]}
            if hp_from is not None:
                d.update({k: v for k, v in hp_from.param_groups[gi].items() if k != "params"})
            out.append(d)
        return out

    def _make_offload(self, cfg, who, hp_from=None, resume=False, swap_dir=None):
        which = 0 if who == "A" else 1
        kw = dict(self.cfg["hp"])
        kw.update(offload=cfg["store"], max_grad_norm=self.cfg["max_grad_norm"])
        if cfg["state_dtype"] != "float32":
            kw["state_dtype"] = cfg["state_dtype"]
        if cfg["master_dtype"] != "float32":
            kw["master_dtype"] = cfg["master_dtype"]
        if cfg["store"] == "nvme":
            kw["swap_dir"] = swap_dir or self._swap_dir()
            if resume:
                kw["resume"] = True
        groups = self._group_dicts(which, hp_from)
        if hp_from is not None:  # the groups carry every value: the constructor's flags too
            for k in ("foreach", "fused"):
                kw.pop(k, None)
        later = {}
        if resume and "amsgrad" in self.cfg["hp"]:
            # the swap files keep the layout the run was built with (a max_exp_avg_sq for every
            # param when a group had amsgrad): build it as then, turn amsgrad as now after
            later = {gi: g.pop("amsgrad", None) for gi, g in enumerate(groups)}
            kw["amsgrad"] = self.cfg["hp"]["amsgrad"]
        cls = getattr(offload, self.cfg["name"])
        opt = cls(groups, **kw)
        for gi, v in later.items():
            if v is not None:
                opt.param_groups[gi]["amsgrad"] = v
        opt._fuzz_swap = kw.get("swap_dir")
        return opt

    def _make_torch(self, hp_from=None):
        cls = TORCH_CLASS[self.cfg["name"]]
        kw = dict(self.cfg["hp"])
        return cls(self._group_dicts(2, hp_from), **kw)

    # --- comparing ------------------------------------------------------------------
    def params(self, which):
        return [t[which] for g in self.groups for t in g]

    def check(self, what):
        A, B = self.A, self.B
        for i, (pa, pb) in enumerate(zip(self.params(0), self.params(1))):
            if not _bits_equal(pa.detach(), pb.detach()):
                raise Mismatch(f"after {what}: param {i} A != B bitwise: {_diff(pa, pb)}")
        sa, sb = A.state_dict(), B.state_dict()
        optional = ("master",) + (("max_exp_avg_sq",) if any(not g.get("amsgrad", True) for g in A.param_groups) else ())
        _same_dicts(sa, sb, exact=True, where=f"after {what}: state_dict A vs B", optional=optional)
        if not self.c_valid:
            return
        sc = self.C.state_dict()
        lowp = self.cfg["pdtype"] != torch.float32
        tol = dict(rtol=2e-5, atol=2e-6) if self.cfg["max_grad_norm"] is None else dict(rtol=1e-4, atol=1e-5)
        _same_dicts(sa, sc, exact=False, where=f"after {what}: state_dict A vs torch", tol=tol, drop=("master",) if lowp else (),
                    lazy_init=self.cfg["name"] == "Adagrad")
        for i, (pa, pc) in enumerate(zip(self.params(0), self.params(2))):
            if lowp:
                master = A.state.get(pa, {}).get("master")
                if master is not None and not _close(master.reshape(pc.shape), pc.detach(), **tol):
                    raise Mismatch(f"after {what}: master {i} vs torch: {_diff(master.reshape(pc.shape), pc)}")
                if not _close(pa.detach().float(), pc.detach().to(pa.dtype).float(), rtol=1e-2, atol=1e-2):
                    raise Mismatch(f"after {what}: lowp param {i} vs torch: {_diff(pa.float(), pc)}")
            elif not _close(pa.detach(), pc.detach(), **tol):
                raise Mismatch(f"after {what}: param {i} vs torch: {_diff(pa, pc)}")
        # opt.state[p] lists torch's keys (and the master)
        for i, (pa, pc) in enumerate(zip(self.params(0), self.params(2))):
            # (SGD's count lives in opt.state[p]["step"], which its state_dict leaves out: sgd.py's docstring)
            extra = {"master", "step"} if self.cfg["name"] == "SGD" else {"master"}
            ka, kc = set(A.state.get(pa, {}).keys()) - extra, set(self.C.state.get(pc, {}).keys())
            if not kc and self.cfg["name"] == "Adagrad" and float(A.state[pa].get("step", 1)) == 0:
                continue  # torch's Adagrad starts an added group's states at its first step
            if ka != kc:
                raise Mismatch(f"after {what}: opt.state keys of param {i}: {sorted(ka)} vs torch {sorted(kc)}")

    # --- operations -------------------------------------------------------------------
    def op_step(self):
        rng = self.rng
        grads = []
        nonfinite = self.scalers is not None or self.cfg["max_grad_norm"] is not None
        for t in [t for g in self.groups for t in g]:
            if not t[0].requires_grad:
                grads.append("keep")
                continue
            r = rng.random()
            if r < 0.15:
                grads.append("keep")  # whatever it holds: None, zeros, last step's
                continue
            if r < 0.25:
                grads.append(None)
                continue
            g = torch.randn(t[0].shape) * rng.choice([1.0, 1e-3, 10.0])
            if nonfinite and rng.random() < 0.1:
                g.view(-1)[rng.randrange(g.numel())] = rng.choice([math.inf, -math.inf, math.nan])
            grads.append(g)
        if self.scalers and not any(g is not None and not isinstance(g, str) for g in grads):
            return self.op_zero_grad()  # GradScaler.update() asserts when no grad was unscaled (torch too)
        if self.scalers:
            for sc in self.scalers:  # as scaler.scale(loss) would, before the first step
                sc.scale(torch.ones(()))
        scale = self.scalers[0].get_scale() if self.scalers else 1.0
        for t, g in zip([t for g in self.groups for t in g], grads):
            if isinstance(g, str):
                continue
            for k in range(3):
                if g is None:
                    t[k].grad = None
                else:
                    gl = (g * scale).to(self.cfg["pdtype"])
                    t[k].grad = gl.clone() if k < 2 else gl.float()
        self.log.append(f"step grads={[('keep' if isinstance(g, str) else None if g is None else 'g') for g in grads]}")
        skipped_a = step_twins((self.A, self.B), self.scalers)
        skip_c = self._torch_step()
        if not skipped_a[0]:
            self.uncommitted = False
        if skipped_a[0] != skipped_a[1]:
            raise Mismatch(f"last_step_skipped A {skipped_a[0]} B {skipped_a[1]}")
        if self.c_valid and self.cfg["max_grad_norm"] is not None and skipped_a[0] != skip_c:
            raise Mismatch(f"skipped: A {skipped_a[0]} torch {skip_c}")
        if self.scalers and self.scalers[0].get_scale() != self.scalers[2].get_scale():
            raise Mismatch(f"scaler scale A {self.scalers[0].get_scale()} torch {self.scalers[2].get_scale()}")
        if self.sched is not None:
            self._sched_step()

    def _torch_step(self):
        """torch's loop: unscale_, clip_grad_norm_, step; the grads as they were after it
        (offload's step leaves them unscaled and unclipped, and a grad kept for the next step
        must be the same on every twin)."""
        saved = [(p, p.grad.clone()) for p in self.params(2) if p.grad is not None]
        try:
            return self._torch_step_inner()
        finally:
            for p, g in saved:
                p.grad = g

    def _torch_step_inner(self):
        sc = self.scalers[2] if self.scalers else None
        return torch_step(self.C, sc, self.params(2), self.cfg["max_grad_norm"], self._torch_amsgrad_zeros)

    def _torch_amsgrad_zeros(self):
        """amsgrad turned on: torch's step fails (KeyError) on a param that stepped without it;
        ours starts it at 0. (GradScaler's step over found infs does not reach here.)"""
        for g in self.C.param_groups:
            for p in g["params"] if g.get("amsgrad") else ():
                st = self.C.state.get(p)
                if st and p.grad is not None and "exp_avg" in st and "max_exp_avg_sq" not in st:
                    st["max_exp_avg_sq"] = torch.zeros_like(p)

    def _sched_step(self):
        kind = self.sched[0]
        for s in self.sched[2:]:
            if kind == "plateau":
                s.step(self.rng_metric)
            else:
                s.step()

    def op_sched(self):
        if self.sched is not None or len(self.groups) > 1:
            return self.op_hparam()
        kinds = ["step", "lambda", "plateau"]
        if self.cfg["name"] != "Adagrad":
            kinds.append("onecycle")
        kind = self.rng.choice(kinds)
        gamma = self.rng.choice([0.5, 0.1])
        self.rng_metric = 1.0
        self.log.append(f"sched {kind}")
        self.sched = (kind, gamma) + tuple(self._make_sched(kind, gamma, o) for o in (self.A, self.B, self.C))

    def _make_sched(self, kind, gamma, opt):
        L = torch.optim.lr_scheduler
        if kind == "step":
            return L.StepLR(opt, step_size=2, gamma=gamma)
        if kind == "lambda":
            return L.LambdaLR(opt, lambda e: 1.0 / (1.0 + e))
        if kind == "plateau":
            return L.ReduceLROnPlateau(opt, patience=0, factor=gamma)
        cycle = not (self.cfg["name"] == "SGD" and not self.cfg["hp"]["momentum"]
                     and (self.cfg["pdtype"] != torch.float32 or "nvme" in (self.a_cfg["store"], self.b_cfg["store"])))
        if cycle and self.cfg["name"] == "SGD" and not self.cfg["hp"]["momentum"]:
            self.host_only = True
        return L.OneCycleLR(opt, max_lr=0.05, total_steps=200, cycle_momentum=cycle)

    def _remake_scheds(self):
        if self.sched is None:
            return
        kind, gamma = self.sched[:2]
        states = [s.state_dict() for s in self.sched[2:]]
        new = []
        for opt, st in zip((self.A, self.B, self.C), states):
            s = self._make_sched(kind, gamma, opt)
            s.load_state_dict(st)
            new.append(s)
        self.sched = (kind, gamma) + tuple(new)

    def op_hparam(self):
        gi = self.rng.randrange(len(self.groups))
        name = self.cfg["name"]
        choices = [("lr", self.rng.choice([1e-3, 0.05, 0.0]))]
        if name in ("Adam", "AdamW", "Lion"):
            choices.append(("betas", self.rng.choice([(0.8, 0.99), (0.9, 0.999)])))
        choices.append(("weight_decay", self.rng.choice([0.0, 0.05])))
        choices.append(("maximize", self.rng.random() < 0.5))
        if name == "SGD" and not self.cfg["hp"].get("nesterov"):
            choices.append(("dampening", self.rng.choice([0.0, 0.3])))
            if "nvme" not in (self.a_cfg["store"], self.b_cfg["store"]) and self.cfg["pdtype"] == torch.float32:
                choices.append(("momentum", self.rng.choice([0.0, 0.9])))
        if name in ("Adam", "AdamW") and (self.cfg["hp"].get("amsgrad") or
                                           (self.cfg["pdtype"] == torch.float32 and
                                            "nvme" not in (self.a_cfg["store"], self.b_cfg["store"]))):
            choices.append(("amsgrad", self.rng.random() < 0.5))
        if name == "Adagrad":
            choices.append(("lr_decay", self.rng.choice([0.0, 0.1])))
        if name in ("Adam", "AdamW") and not self.cfg["hp"].get("foreach"):
            choices.append(("lr", torch.tensor(self.rng.choice([1e-3, 0.02]))))
        k, v = self.rng.choice(choices)
        if k in ("amsgrad", "momentum") and v and not self.cfg["hp"].get(k):
            self.host_only = True  # the other stores keep a state only a constructor's group asks for
        self.log.append(f"group[{gi}][{k!r}] = {v!r}")
        for opt in (self.A, self.B, self.C):
            opt.param_groups[gi][k] = v.clone() if isinstance(v, torch.Tensor) else v


    def op_add_group(self):
        if "nvme" in (self.a_cfg["store"], self.b_cfg["store"]) or self.sched is not None or len(self.groups) > 2:
            return self.op_zero_grad()
        n = self.rng.choice(SIZES)
        t = self._new_param(n)
        lr = self.rng.choice([1e-3, 0.02])
        self.log.append(f"add_param_group numel={n} lr={lr}")
        self.groups.append([t])
        for k, opt in enumerate((self.A, self.B, self.C)):
            opt.add_param_group({"params": [t[k]], "lr": lr})

    def op_freeze(self):
        ts = [t for g in self.groups for t in g]
        i = self.rng.randrange(len(ts))
        flag = not ts[i][0].requires_grad
        self.log.append(f"param {i}.requires_grad_({flag})")
        for p in ts[i]:
            p.requires_grad_(flag)

    def op_zero_grad(self):
        none = self.rng.random() < 0.5
        self.log.append(f"zero_grad(set_to_none={none})")
        for opt in (self.A, self.B, self.C):
            opt.zero_grad(set_to_none=none)

    def op_state_write(self):
        ts = [t for g in self.groups for t in g]
        i = self.rng.randrange(len(ts))
        pa, pb, pc = ts[i]
        keys = [k for k in self.A.state.get(pa, {}).keys() if k not in ("step", "master")]
        if not keys:
            return self.op_zero_grad()
        k = self.rng.choice(sorted(keys))
        c = self.rng.choice([0.5, 0.0, 2.0])
        how = self.rng.choice(["mul_", "assign", "clear"])
        if how == "clear" and self.cfg["name"] == "Adagrad":
            how = "mul_"
        if how != "clear" and not self.A.state[pa][k].is_floating_point():
            return self.op_zero_grad()
        if how == "clear" and self.cfg["pdtype"] != torch.float32:
            how = "mul_"  # a master of its own: torch's twin has no master to clear
        if self.c_valid and k not in self.C.state.get(pc, {}):
            # torch has no such state yet (its Adagrad makes an added group's sums at their
            # first step, ours at add_param_group): a write torch's user cannot make (seed 272)
            return self.op_zero_grad()
        self.log.append(f"state[{i}][{k!r}] {how} {c}" if how != "clear" else f"state[{i}].clear()")
        self.uncommitted = True
        for opt, p in ((self.A, pa), (self.B, pb), (self.C, pc)):
            if opt is self.C and (not self.c_valid or k not in opt.state[p]):
                continue
            st = opt.state[p]
            if how == "mul_":
                st[k].mul_(c)
            elif how == "assign":
                st[k] = st[k] * c
            else:
                st.clear()

    # replacements of A ----------------------------------------------------------------
    def _other_store(self):
        store = self.rng.choice(["none", "cpu", "nvme"])
        if (len(self.groups) > 1 or self.host_only) and store == "nvme":
            store = "cpu"
        return store

    def _replace(self, how, new_cfg, make, ck_dir=None):
        old = self.A
        self.log.append(f"replace A by {how} -> store={new_cfg['store']} state_dtype={new_cfg['state_dtype']}")
        self.A = make()
        if old is not self.A and not getattr(old, "_fuzz_closed", False):
            old.close()
        bits_changed = _bits_class(new_cfg) != _bits_class(self.a_cfg)
        # SGD's torch layout has no "step" unless states or master are bf16 (README; int8 states
        # too: seed 96): A's counts restart there, and B's follow, as they seed the rounding of a
        # later bf16 conversion
        sgd_counts = self.cfg["name"] == "SGD" and how.startswith("state_dict") and \
            "bfloat16" not in (new_cfg["state_dtype"], new_cfg["master_dtype"])
        self.a_cfg = new_cfg
        if bits_changed or sgd_counts:  # B follows through state_dict (what the README says a conversion equals)
            sd = copy.deepcopy(self.B.state_dict())
            oldb = self.B
            self.B = self._make_offload(new_cfg, "B")
            self.b_cfg = new_cfg
            if self.cfg["name"] == "SGD" and ck_dir is not None:
                # SGD's torch layout has no "step", which seeds bf16 rounding: a checkpoint keeps it
                oldb.save_checkpoint(ck_dir + "-b")
                self.dirs.append(ck_dir + "-b")
                self.B.load_checkpoint(ck_dir + "-b")
            else:
                self.B.load_state_dict(sd)
            oldb.close()
            if not exact_ref(new_cfg):
                self.c_valid = False
        # torch's twin moves through its own state_dict, as a resumed torch run would
        sd = copy.deepcopy(self.C.state_dict())
        self.C = self._make_torch()
        self.C.load_state_dict(sd)
        self._remake_scheds()

    def op_state_dict(self):
        cfg = dict(self.a_cfg, store=self._other_store())
        via_torch = self.rng.random() < 0.4 and self.cfg["pdtype"] == torch.float32

        def make():
            sd = copy.deepcopy(self.A.state_dict())
            if via_torch:
                t = TORCH_CLASS[self.cfg["name"]](self._group_dicts(0), **self.cfg["hp"])
                t.load_state_dict(sd)
                sd = copy.deepcopy(t.state_dict())
            new = self._make_offload(cfg, "A")
            new.load_state_dict(sd)
            return new
        self._replace("state_dict" + (" via torch" if via_torch else ""), cfg, make)

    def op_checkpoint(self):
        cfg = dict(self.a_cfg, store=self._other_store())
        if self.cfg["pdtype"] == torch.float32 and self.rng.random() < 0.3 \
                and cfg["store"] in ("cpu", "nvme") and self.a_cfg["store"] in ("cpu", "nvme"):
            cfg["state_dtype"] = self.rng.choice(["float32", "bfloat16", "int8"])
        d = tempfile.mkdtemp(dir=SCRATCH, prefix=f"ck{self.seed}-")
        self.dirs.append(d)

        def make():
            self.A.save_checkpoint(d)
            new = self._make_offload(cfg, "A")
            new.load_checkpoint(d)
            return new
        self._replace("checkpoint", cfg, make, ck_dir=d)

    def op_resume(self):
        if self.a_cfg["store"] != "nvme" or self._no_swap_files():
            # (a state written or cleared since the last step taken is committed by
            # close(keep_swap=True): the resume goes on from it)
            return self.op_state_dict()
        swap = self.A._fuzz_swap

        def make():
            self.A.close(keep_swap=True)
            self.A._fuzz_closed = True
            return self._make_offload(self.a_cfg, "A", hp_from=self.A, resume=True, swap_dir=swap)
        self._replace("resume", dict(self.a_cfg), make)

    def _no_swap_files(self):
        """SGD without momentum over params that are their own master writes no swap files
        (README): a resume has nothing to go on from, not even the counts that seed bf16 rounding."""
        return (self.cfg["name"] == "SGD" and not self.cfg["hp"]["momentum"]
                and (self.cfg["pdtype"] == torch.float32 or self.a_cfg["master_dtype"] == "bfloat16"))

    def op_plateau_metric(self):
        self.rng_metric = self.rng.choice([1.0, 2.0, 0.5])
        return self.op_step()

    OPS = [("op_step", 10), ("op_hparam", 3), ("op_sched", 1), ("op_add_group", 1), ("op_freeze", 1),
           ("op_zero_grad", 2), ("op_state_write", 2), ("op_state_dict", 2), ("op_checkpoint", 2),
           ("op_resume", 1), ("op_plateau_metric", 1)]

    def run(self):
        names = [n for n, w in self.OPS for _ in range(w)]
        self.op_step()
        self.check("first step")
        for _ in range(self.n_ops):
            name = self.rng.choice(names)
            getattr(self, name)()
            self.check(self.log[-1])
        if self.verbose:
            print("\n".join(self.log))

    def close(self):
        close_twins((self.A, self.B))
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _unfused_where_torch_fails(C):
    """torch's fused SGD with momentum fails (TypeError "expected Tensor as element 0 in
    argument 2, but got NoneType", torch/optim/sgd.py _fused_sgd) when some of a group's params
    have a momentum buffer and others, stepping for the first time, have none: it starts the
    buffers only when none exists. Such a group steps as torch's for-loop SGD does (a new
    buffer is the grad), what offload's SGD gives whatever ``fused`` says (seed 473)."""
    off = []
    for g in C.param_groups if isinstance(C, torch.optim.SGD) else ():
        if g.get("fused") and g["momentum"] != 0:
            bufs = [C.state.get(p, {}).get("momentum_buffer") is None for p in g["params"] if p.grad is not None]
            if any(bufs) and not all(bufs):
                g["fused"] = False
                off.append(g)
    try:
        yield
    finally:
        for g in off:
            g["fused"] = True


def torch_step(C, sc, params, max_grad_norm, before_step) -> bool:
    """torch's loop over ``C``: GradScaler's ``unscale_`` (``sc``), ``clip_grad_norm_`` by hand
    (a non-finite norm skips the step, as offload's ``max_grad_norm`` does), ``before_step()``
    on a step taken only (a skipped one starts no state), the step; whether it was skipped."""
    if sc is not None:
        sc.unscale_(C)
        found = sum(float(v) for v in sc._per_optimizer_states[id(C)]["found_inf_per_device"].values())
        if found:
            sc.step(C)
            sc.update()
            return True
    skip = False
    if max_grad_norm is not None:
        gs = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in gs))
        if not math.isfinite(norm):
            skip = True
        else:
            coef = min(1.0, max_grad_norm / (norm + 1e-6))
            for g in gs:
                g.mul_(coef)
    if not skip:
        before_step()
    if sc is not None:
        if not skip:
            sc.step(C)
        sc.update()
    elif not skip:
        with _unfused_where_torch_fails(C):
            C.step()
    return skip


def step_twins(opts, scalers):
    """Step each offload optimizer (through its GradScaler, ``scalers[k]``, where there are
    some); whether each skipped its step."""
    skipped = []
    for k, opt in enumerate(opts):
        if scalers:
            scalers[k].step(opt)
            scalers[k].update()
        else:
            opt.step()
        skipped.append(opt.last_step_skipped)
    return skipped


def close_twins(opts) -> None:
    """Close the offload optimizers the fuzz has not closed itself; errors are not its subject."""
    for o in opts:
        try:
            if not getattr(o, "_fuzz_closed", False):
                o.close()
        except Exception:
            pass


def _bits_class(cfg):
    return (cfg["state_dtype"], cfg["master_dtype"], cfg["store"] == "nvme" if cfg["state_dtype"] != "float32" else None)


def _bits_equal(a, b):
    a, b = a.detach(), b.detach()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        an, bn = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(an, bn)) and bool(torch.equal(a[~an], b[~bn]))
    return bool(torch.equal(a, b))


def _close(a, b, rtol, atol):
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return False
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))


def _diff(a, b):
    a, b = a.detach().float().reshape(-1), b.detach().float().reshape(-1)
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    d = (a - b).abs()
    d[torch.isnan(a) & torch.isnan(b)] = 0
    i = int(torch.nan_to_num(d, nan=math.inf).argmax())
    return f"max |diff| {float(d[i])} at {i}: {float(a[i])} vs {float(b[i])}"


def _same_dicts(sa, sb, *, exact, where, tol=None, drop=(), lazy_init=False, optional=()):
    ga, gb = sa["param_groups"], sb["param_groups"]
    if len(ga) != len(gb):
        raise Mismatch(f"{where}: {len(ga)} vs {len(gb)} groups")
    for i, (x, y) in enumerate(zip(ga, gb)):
        x, y = {k: v for k, v in x.items() if k != "differentiable"}, {k: v for k, v in y.items() if k != "differentiable"}
        # (torch's Optimizer.__setstate__, which its load_state_dict calls, adds "differentiable"
        # to defaults where the optimizer has none, Lion's: later add_param_group groups get it)
        if set(x) != set(y):
            raise Mismatch(f"{where}: group {i} keys {sorted(set(x) ^ set(y))} differ")
        for k in x:
            vx, vy = x[k], y[k]
            if isinstance(vx, torch.Tensor) or isinstance(vy, torch.Tensor):
                if type(vx) is not type(vy) or float(vx) != float(vy):
                    raise Mismatch(f"{where}: group {i} {k} {vx!r} vs {vy!r}")
            elif vx != vy and not (k == "betas" and tuple(vx) == tuple(vy)):
                raise Mismatch(f"{where}: group {i} {k} {vx!r} vs {vy!r}")
    # an entry empty of everything compared is none: torch keeps {} after opt.state[p].clear(),
    # the offload stores drop it where the entry is rebuilt (a load): the same to every loader
    sta = {i: e for i, e in sa["state"].items() if set(e) - set(drop)}
    stb = {i: e for i, e in sb["state"].items() if set(e) - set(drop)}
    if lazy_init:  # torch's Adagrad starts an added group's states at its first step, ours at once
        sta = {i: e for i, e in sta.items() if i in stb or float(e.get("step", 1)) != 0}
    if set(sta) != set(stb):
        raise Mismatch(f"{where}: state entries {sorted(sta)} vs {sorted(stb)}")
    for i in sta:
        ka, kb = set(sta[i]) - set(drop), set(stb[i]) - set(drop)
        # listed by one store and not the other, as documented: the master of a param that never
        # stepped after a load; a max_exp_avg_sq of a group with amsgrad off (kept_states)
        ka, kb = ka - (set(optional) - kb), kb - (set(optional) - ka)
        if ka != kb:
            raise Mismatch(f"{where}: state {i} keys {sorted(ka)} vs {sorted(kb)}")
        for k in ka:
            x, y = sta[i][k], stb[i][k]
            if k == "step":
                if float(x) != float(y):
                    raise Mismatch(f"{where}: state {i} step {float(x)} vs {float(y)}")
                continue
            if exact:
                if not _bits_equal(x, y):
                    raise Mismatch(f"{where}: state {i} {k} differs: {_diff(x, y)}")
            elif x.shape != y.shape or x.dtype != y.dtype or not _close(x, y, **tol):
                raise Mismatch(f"{where}: state {i} {k} {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}: {_diff(x, y)}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0:50")
    ap.add_argument("--ops", type=int, default=None, help="operations per seed (default 5-20, drawn)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    a, b = (int(x) for x in args.seeds.split(":"))
    os.makedirs(SCRATCH, exist_ok=True)
    warnings.simplefilter("ignore")
    import logging
    logging.getLogger("offload").setLevel(logging.ERROR)
    fails = 0
    for seed in range(a, b):
        n_ops = args.ops if args.ops is not None else random.Random(~seed).randint(5, 20)
        run = None
        try:
            run = Run(seed, n_ops, args.verbose)
            run.run()
        except Exception as e:  # noqa: BLE001: every failure is reported with its reproducer
            fails += 1
            cfg = run.cfg if run else None
            kind = "MISMATCH" if isinstance(e, Mismatch) else f"ERROR {type(e).__name__}"
            print(f"seed {seed}: {kind}: {str(e)[:300]}")
            if cfg:
                print(f"  cfg {cfg['name']} {cfg['hp']} {cfg['pdtype']} store={cfg['store']} sd={cfg['state_dtype']} "
                      f"master={cfg['master_dtype']} clip={cfg['max_grad_norm']} scaler={cfg['scaler']} sizes={cfg['sizes']}")
                print("  ops: " + " | ".join(run.log if args.verbose else run.log[-8:]))
            if args.verbose:
                traceback.print_exc()
            isa = f"OFFLOAD_ISA={os.environ['OFFLOAD_ISA']} " if os.environ.get("OFFLOAD_ISA") else ""
            print(f"  reproduce: {isa}OFFLOAD_BACKEND={os.environ.get('OFFLOAD_BACKEND', 'native')} "
                  f"python tools/history_fuzz.py --seeds {seed}:{seed + 1} --ops {n_ops} --verbose")
        finally:
            if run is not None:
                run.close()
    print(f"{b - a} seeds, {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
