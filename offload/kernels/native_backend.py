"""The native backend: ctypes over liboffload_native.so (built by setup.py from native/).

ctypes releases the GIL for the duration of each call, so I/O threads keep running while a
sub-group is updated. The library holds no state; this wrapper only validates arguments,
resolves the ISA (``OFFLOAD_ISA``), the prefetch switch (``OFFLOAD_PREFETCH``), the thread
pool (``OFFLOAD_POOL``) and the thread count, and hands one step struct (raw pointers,
dtypes and the folded constants: ``_native_abi``) to ``offload_rule_step``, or a param group's structs at once to
``offload_rule_steps`` (``checked_rule_steps``). A library whose ABI version or struct size
differs from this package's is refused at load.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
from typing import Optional, Tuple

import torch

from ._checks import GRAD_DTYPES, LOWP_DTYPES, check_tensor, check_threads, written_overlap
from . import quant
from ._native_abi import (ADAGRAD_CONSTS, ADAM_CONSTS, ADAM_STEP, AMSGRAD_STEP, BLOCK_ELEMS, COMPRESSED_STEP,
                          LION_CONSTS, SGD_CONSTS, STEP_STATES, StepArgs)
from ._rule_step import RULE_CODES, RuleStepFace, batch_plan, batchable, bound_args
from .native_prepared import PreparedBatch
from ._threads import forked, resolve_threads
from .adam_consts import FoldCache
from .fields import ADAGRAD, ADAM, ADAM_AMSGRAD, LION, SGD
from .rule_consts import RuleFoldCache, fold_adagrad, fold_lion, fold_sgd

__all__ = ["NativeBackend", "LIB_PATH", "ISA_CODES", "load_library"]

HERE = os.path.dirname(os.path.abspath(__file__))
LIB_PATH = os.path.join(HERE, "liboffload_native.so")
ERROR_PATH = os.path.join(HERE, "native_build_error.txt")
ABI_VERSION = 7

# avx512vbmi: the avx512 unit with VBMI byte permutes for int8 states (the same bits, faster;
# native/q8_avx512vbmi.cpp); supported only where the CPU has VBMI
ISA_CODES = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512vbmi": 3}
ISA_NAMES = {v: k for k, v in ISA_CODES.items()}
_ADAM_CODE, _AMSGRAD_CODE = RULE_CODES[ADAM], RULE_CODES[ADAM_AMSGRAD]
_F32 = GRAD_DTYPES[torch.float32]
_BF16, _Q8S, _Q8U = GRAD_DTYPES[torch.bfloat16], 3, 4  # OFFLOAD_BF16 / OFFLOAD_Q8S / OFFLOAD_Q8U
_NEAREST, _STOCHASTIC = 0, 1  # OFFLOAD_ROUND_*
_F32_PACKERS = {_ADAM_CODE: ADAM_STEP, _AMSGRAD_CODE: AMSGRAD_STEP}  # the others: STEP_STATES
_PREFETCH_CODES = {"": 0, "auto": 0, "1": 1, "on": 1, "0": 2, "off": 2}  # OFFLOAD_PREFETCH_*
_POOL_CODES = {"": 0, "auto": 0, "own": 1}  # OFFLOAD_POOL_*
_CPUS = os.cpu_count() or 1  # more threads than these never go to libgomp's pool (_pool_for)
# quant.py's tables, the ones every backend encodes with; the library reads them through raw
# pointers, so this module holds them (contiguous float32) for the life of the process
_TABLES = tuple(t.to(torch.float32).contiguous()
                for t in (*quant.code_tables("signed"), *quant.code_tables("sqrt")))  # the Q8U decode table: squares
_TABLE_PTRS = tuple(t.data_ptr() for t in _TABLES)

_c_int, _c_i64, _c_dbl, _vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


def load_library() -> ctypes.CDLL:
    """Open the library; failures carry the build error or the dlopen error."""
    if not os.path.exists(LIB_PATH):
        reason = f"{LIB_PATH} not found"
        if os.path.exists(ERROR_PATH):
            with open(ERROR_PATH, encoding="utf-8", errors="replace") as fh:
                reason += f"; the native build failed:\n{fh.read().strip()}"
        else:
            reason += " (build it with `pip install -e .` or `pip install .`)"
        raise OSError(errno.ENOENT, reason, LIB_PATH)
    try:
        lib = ctypes.CDLL(LIB_PATH)
    except OSError as exc:
        raise OSError(errno.ENOEXEC, f"cannot load {LIB_PATH}: {exc}", LIB_PATH) from exc
    lib.offload_abi_version.restype = _c_int
    lib.offload_abi_version.argtypes = []
    if lib.offload_abi_version() != ABI_VERSION:
        raise OSError(errno.ENOEXEC, f"{LIB_PATH} has ABI {lib.offload_abi_version()}, "
                      f"this package expects {ABI_VERSION}; rebuild it", LIB_PATH)
    lib.offload_block_elems.restype = _c_i64
    lib.offload_block_elems.argtypes = []
    if lib.offload_block_elems() != BLOCK_ELEMS:  # the numba backend's sumsq cuts these ranges too
        raise OSError(errno.ENOEXEC, f"{LIB_PATH} hands threads ranges of {lib.offload_block_elems()} elements "
                      f"(OFFLOAD_BLOCK_ELEMS), this package's backends {BLOCK_ELEMS}; rebuild it without "
                      "-DOFFLOAD_BLOCK_ELEMS", LIB_PATH)
    lib.offload_isa_supported.restype = _c_int
    lib.offload_isa_supported.argtypes = [_c_int]
    lib.offload_isa_best.restype = _c_int
    lib.offload_isa_best.argtypes = []
    lib.offload_step_args_size.restype = _c_i64
    lib.offload_step_args_size.argtypes = []
    if lib.offload_step_args_size() != ctypes.sizeof(StepArgs):
        raise OSError(errno.ENOEXEC, f"{LIB_PATH}: its struct offload_step_args has "
                      f"{lib.offload_step_args_size()} bytes, this package's mirror "
                      f"{ctypes.sizeof(StepArgs)}; rebuild the library", LIB_PATH)
    lib.offload_rule_step.restype = _c_int
    lib.offload_rule_step.argtypes = [ctypes.c_char_p]  # the packed bytes of one StepArgs
    lib.offload_rule_steps.restype = _c_int
    lib.offload_rule_steps.argtypes = [ctypes.c_char_p, _c_i64, _c_int, ctypes.POINTER(_c_i64)]
    lib.offload_grad_sumsq.restype = _c_int
    lib.offload_grad_sumsq.argtypes = [_vp, _c_int, _c_i64, ctypes.POINTER(_c_dbl),
                                       ctypes.POINTER(_c_int), _c_int, _c_int, _c_int]
    lib.offload_omp_pool.restype = _c_int
    lib.offload_omp_pool.argtypes = []
    return lib


@functools.lru_cache(maxsize=64)
def _state_codes(fields, stochastic: bool) -> Tuple[Tuple[int, int], ...]:
    """(OFFLOAD dtype, OFFLOAD_ROUND_*) of each state field (cached: per param per step)."""
    rounding = _STOCHASTIC if stochastic else _NEAREST
    return tuple((_Q8S if f.signed else _Q8U, 0) if f.blocked
                 else (_BF16, rounding) if f.dtype == torch.bfloat16 else (_F32, 0)
                 for f in fields)


def _lowp(param_lowp) -> Tuple[int, int]:
    """(pointer, OFFLOAD dtype) of the low-precision copy; (0, -1) for none."""
    return (0, -1) if param_lowp is None else (param_lowp.data_ptr(), LOWP_DTYPES[param_lowp.dtype])


def _method_args(rule, hyper, step: int) -> Tuple[str, tuple]:
    """(kernel method, bound hyperparameters) of float32 ``rule`` at ``step``, as ``batch_plan`` binds them."""
    k, args = bound_args(rule, hyper, step)
    return k.method, args


class NativeBackend(RuleStepFace):
    name = "native"

    def __init__(self) -> None:
        self._lib = load_library()
        self.supported = [n for n, c in ISA_CODES.items() if self._lib.offload_isa_supported(c)]
        self.best = ISA_NAMES[self._lib.offload_isa_best()]
        self._isa_cache = None  # (raw $OFFLOAD_ISA, resolved name): re-resolved when it changes
        self._prefetch_cache = None  # (raw $OFFLOAD_PREFETCH, OFFLOAD_PREFETCH_* code)
        self._pool_cache = None  # (raw $OFFLOAD_POOL, OFFLOAD_POOL_* code)
        self._fold = FoldCache(lambda c: ADAM_CONSTS.pack(*c))  # the struct's bytes
        self._folds = {  # method name -> (rule code, fold to the consts struct's bytes)
            "sgd": (RULE_CODES[SGD], RuleFoldCache(fold_sgd, 8, lambda c: SGD_CONSTS.pack(*c))),
            "adagrad": (RULE_CODES[ADAGRAD],
                        RuleFoldCache(fold_adagrad, 7, lambda c: ADAGRAD_CONSTS.pack(*c))),
            "lion": (RULE_CODES[LION], RuleFoldCache(fold_lion, 6, lambda c: LION_CONSTS.pack(*c)))}

    def describe(self) -> str:
        return f"ok, ISA {self.isa()} (supported: {', '.join(self.supported)})"

    def isa(self) -> str:
        """The ISA the next call runs: $OFFLOAD_ISA if set, else the best supported."""
        raw = os.environ.get("OFFLOAD_ISA", "")
        cached = self._isa_cache
        if cached is not None and cached[0] == raw:
            return cached[1]
        isa = self._resolve_isa(raw)
        self._isa_cache = (raw, isa)
        return isa

    def _resolve_isa(self, raw: str) -> str:
        want = raw.strip().lower()
        if not want or want in ("auto", "best"):
            return self.best
        if want not in ISA_CODES:
            raise ValueError(f"OFFLOAD_ISA={want!r} is not one of "
                             f"{', '.join(ISA_CODES)} (or auto)")
        if want not in self.supported:
            raise RuntimeError(f"OFFLOAD_ISA={want}: this CPU does not support {want} "
                               f"(supported: {', '.join(self.supported)})")
        return want

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(-rc, f"{what} failed: {os.strerror(-rc)}")

    # [Note: packing a step] Each struct is packed by _pack_f32 or _pack_compressed from
    # the rule's folded constants (_consts: its code and bytes) and the call's tail (isa
    # code, threads, prefetch code); _adam & co. run one, checked_rule_steps a batch, which
    # folds the constants once per distinct step ([Note: batched steps] in
    # native/dispatch.cpp).
    def _consts(self, method: str, hyper: tuple) -> Tuple[int, bytes]:
        """(OFFLOAD_RULE_* code, the consts struct's bytes) of the rule whose float32 method
        is ``method`` ("_adam", "_sgd", ...)."""
        if method == "_adam":
            return _ADAM_CODE, self._fold(hyper)
        if method == "_adam_amsgrad":
            return _AMSGRAD_CODE, self._fold(hyper)
        code, fold = self._folds[method[1:]]
        return code, fold(hyper)

    def _tail(self, num_threads) -> Tuple[int, int, int, int]:
        threads = resolve_threads(num_threads)
        return ISA_CODES[self.isa()], threads, self._prefetch(), self._pool_for(threads)

    refuses_overlap = True  # struct_overlaps_itself in native/batch_alias.h

    def prefetch_setting(self) -> str:
        """OFFLOAD_PREFETCH as the kernels take it (``offload info``); ValueError if bad."""
        return ("auto (on for Intel CPUs only)", "on", "off")[self._prefetch()]

    def pool_setting(self) -> str:
        """OFFLOAD_POOL as the kernels take it, and what auto runs on now (``offload info``)."""
        if self._pool():
            return "own (threads of each call's own)"
        if self._lib.offload_omp_pool():
            return f"auto (the OpenMP pool torch runs on; a call on more threads than the {_CPUS} CPUs: its own)"
        return "auto (threads of each call's own: no OpenMP pool loaded, or forked since)"

    def preflight(self, num_threads=None) -> None:
        check_threads(num_threads)
        self._tail(num_threads)  # OFFLOAD_ISA, OFFLOAD_PREFETCH and OFFLOAD_POOL read and checked

    @staticmethod
    def _pack_f32(code, consts, param, grad, states, param_lowp, tail) -> bytes:
        """A float32 step: Adam's two states, AMSGrad's three, or the one state at most of
        SGD (its buffer), Adagrad (its sum) and Lion (exp_avg), each with its packer."""
        lowp_ptr, lowp_code = _lowp(param_lowp)
        packer = _F32_PACKERS.get(code) or STEP_STATES[len(states)]
        arrays = [x for t in states for x in (t.data_ptr(), _F32)]
        return packer.pack(code, len(states), param.numel(), param.data_ptr(), _F32, grad.data_ptr(),
                           GRAD_DTYPES[grad.dtype], lowp_ptr, lowp_code, *arrays, consts, *tail)

    @staticmethod
    def _pack_compressed(code, consts, fields, param, grad, states, param_lowp, q, tail) -> bytes:
        """A step with bfloat16 / packed int8 states and/or a bfloat16 param, for the fused
        kernel ([Note: fused tiles] in native/compressed_tile.h), the constants folded as the
        float32 steps fold them."""
        codes = _state_codes(fields, q.stochastic_states)
        arrays = [x for t, (dtype, rounding) in zip(states, codes)
                  for x in (t.data_ptr(), dtype, rounding)]
        # a bfloat16 param is its own master: always rounded stochastically
        p_code, p_round = (_BF16, _STOCHASTIC) if param.dtype == torch.bfloat16 else (_F32, 0)
        lowp_ptr, lowp_code = _lowp(param_lowp)
        isa, threads, prefetch, pool = tail
        return COMPRESSED_STEP[len(states)].pack(
            code, len(states), param.numel(), param.data_ptr(), p_code, p_round, grad.data_ptr(),
            GRAD_DTYPES[grad.dtype], 0, lowp_ptr, lowp_code, 0, *arrays, consts,
            isa, threads, *_TABLE_PTRS, q.offset, q.seed, 0, prefetch, pool)

    def _run_one(self, method, param, grad, states, param_lowp, num_threads, hyper) -> None:
        code, consts = self._consts(method, hyper)
        rc = self._lib.offload_rule_step(self._pack_f32(code, consts, param, grad, states, param_lowp,
                                                        self._tail(num_threads)))
        if rc != 0:
            self._check(rc, f"offload_rule_step ({method[1:]})")

    def _adam(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_one("_adam", param, grad, states, param_lowp, num_threads, hyper)

    def _adam_amsgrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_one("_adam_amsgrad", param, grad, states, param_lowp, num_threads, hyper)

    def _sgd(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_one("_sgd", param, grad, states, param_lowp, num_threads, hyper)

    def _adagrad(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_one("_adagrad", param, grad, states, param_lowp, num_threads, hyper)

    def _lion(self, param, grad, states, param_lowp, num_threads, hyper) -> None:
        self._run_one("_lion", param, grad, states, param_lowp, num_threads, hyper)

    def _compressed(self, method, fields, param, grad, states, param_lowp, num_threads, hyper,
                    q) -> None:
        code, consts = self._consts(method, hyper)
        args = self._pack_compressed(code, consts, fields, param, grad, states, param_lowp, q,
                                     self._tail(num_threads))
        rc = self._lib.offload_rule_step(args)
        if rc != 0:
            self._check(rc, "offload_rule_step (compressed states)")

    def checked_rule_steps(self, rule, entries, hyper, num_threads=None) -> None:
        """``RuleStepFace.checked_rule_steps`` in one call of ``offload_rule_steps``: every
        struct packed first, then all the tensors' blocks spread over one set of threads."""
        if not entries:
            return
        tail = self._tail(num_threads)
        packed = self._pack_batch(rule, entries, hyper, tail)
        self._run_batch(rule, b"".join(packed), len(packed), tail, entries)

    def _pack_batch(self, rule, entries, hyper, tail) -> list:
        """The struct of each non-empty entry, in order."""
        packed = self._pack_f32_batch(rule, entries, hyper, tail)
        if packed is not None:
            return packed
        packed, folded = [], {}  # folded: id(bound args) -> (code, consts bytes)
        pack_f32, pack_compressed = self._pack_f32, self._pack_compressed
        for k, stored, (p, g, states, lowp), q, args in batch_plan(rule, entries, hyper):
            c = folded.get(id(args))
            if c is None:  # (args are bound once per step and kept alive by batch_plan)
                c = folded[id(args)] = self._consts(k.method, args)
            if q is None:
                packed.append(pack_f32(c[0], c[1], p, g, states, lowp, tail))
            else:
                packed.append(pack_compressed(c[0], c[1], stored.fields, p, g, states, lowp, q, tail))
        return packed

    def _pack_f32_batch(self, rule, entries, hyper, tail) -> Optional[list]:
        """``_pack_batch`` of float32 entries (``quant`` None) of a float32 rule: the structs
        ``batch_plan`` and ``_pack_f32`` make, in one loop (their generator, nested tuples and
        calls cost 1.6 of 3 ms over 2000 small tensors); None for any other batch."""
        if not batchable(rule):
            return None
        packed, by_step = [], {}  # by_step: step -> (code, consts bytes, packer), bound once per step
        for e in entries:
            if e.quant is not None:
                return None
            p, states, lowp = e.param, e.states, e.param_lowp
            n = p.numel()
            if not n:
                continue
            c = by_step.get(e.step)
            if c is None:
                code, consts = self._consts(*_method_args(rule, hyper, e.step))
                c = by_step[e.step] = (code, consts, _F32_PACKERS.get(code) or STEP_STATES[len(states)])
            lowp_ptr, lowp_code = (0, -1) if lowp is None else _lowp(lowp)
            g = e.grad
            if len(states) == 2:  # Adam's (the arrays' list below costs 0.4 us a tensor)
                arrays = (states[0].data_ptr(), _F32, states[1].data_ptr(), _F32)
            else:
                arrays = [x for t in states for x in (t.data_ptr(), _F32)]
            packed.append(c[2].pack(c[0], len(states), n, p.data_ptr(), _F32, g.data_ptr(), GRAD_DTYPES[g.dtype],
                                    lowp_ptr, lowp_code, *arrays, c[1], *tail))
        return packed

    def _run_batch(self, rule, structs: bytes, count: int, tail, entries) -> None:
        """``offload_rule_steps`` over the ``count`` packed structs of ``entries``' non-empty
        ones; an error names the caller's index."""
        rc, bad = self.run_structs(structs, count, tail[1])
        if rc != 0:  # (every rule is in every library of this ABI: load_library checked it)
            # the struct's index among the non-empty entries batch_plan packed -> the caller's
            packed_at = [i for i, e in enumerate(entries) if e.param.numel()]
            where = packed_at[bad] if 0 <= bad < len(packed_at) else bad
            if 0 <= bad < len(packed_at):  # the one bad input the Python checks leave to C
                e = entries[where]
                why = written_overlap(e.param, e.states, rule.names, e.param_lowp)
                if why:
                    raise ValueError(f"tensor {where}: {why}")
            self._check(rc, f"offload_rule_steps ({rule.name}, tensor {where} of the batch)")

    def run_structs(self, structs, count: int, threads: int) -> Tuple[int, int]:
        """(rc, index of the struct the library refused or -1) of one ``offload_rule_steps``."""
        bad = _c_i64(-1)
        rc = self._lib.offload_rule_steps(structs, count, threads, ctypes.byref(bad))
        return rc, bad.value

    def check_rc(self, rc: int, what: str) -> None:
        self._check(rc, what)

    def prepare_rule_steps(self, rule, entries, hyper, num_threads=None) -> Optional[PreparedBatch]:
        """``entries`` (float32 rule, float32 params, every one non-empty, checked by the
        caller) packed into a ``PreparedBatch`` that steps them again with new grads and a new
        step: [Note: prepared batches] in native_prepared.py. None when they do not qualify."""
        if not entries or any(e.quant is not None or not e.param.numel() for e in entries):
            return None
        tail = self._tail(num_threads)
        return PreparedBatch(self, rule, self._pack_batch(rule, entries, hyper, tail), tail, entries)

    def step_consts(self, rule, hyper, step: int) -> bytes:
        """The consts bytes of a float32 ``rule``'s struct at ``step`` (as ``_pack_f32`` packs them)."""
        k, args = bound_args(rule, hyper, step)
        return self._consts(k.method, args)[1]

    def _prefetch(self) -> int:
        """OFFLOAD_PREFETCH_* from $OFFLOAD_PREFETCH: unset or "auto", the library's choice
        for this CPU ([Note: software prefetch] in native/kernel.h); "1"/"on" or "0"/"off"
        force it (benchmarks, and the test that holds both to the same bits)."""
        raw = os.environ.get("OFFLOAD_PREFETCH", "")
        cached = self._prefetch_cache
        if cached is not None and cached[0] == raw:
            return cached[1]
        want = raw.strip().lower()
        if want not in _PREFETCH_CODES:
            raise ValueError(f"OFFLOAD_PREFETCH={raw!r} is not one of auto, on, off (or 1, 0)")
        self._prefetch_cache = (raw, _PREFETCH_CODES[want])
        return _PREFETCH_CODES[want]

    def _pool(self) -> int:
        """OFFLOAD_POOL_* from $OFFLOAD_POOL: unset or "auto", the OpenMP pool torch runs on
        when the process has one ([Note: torch's OpenMP pool] in native/parallel.h); "own",
        each call's own threads. A child forked since offload's import: always its own."""
        raw = os.environ.get("OFFLOAD_POOL", "")
        cached = self._pool_cache
        if cached is None or cached[0] != raw:
            want = raw.strip().lower()
            if want not in _POOL_CODES:
                raise ValueError(f"OFFLOAD_POOL={raw!r} is not one of auto, own")
            cached = self._pool_cache = (raw, _POOL_CODES[want])
        return 1 if forked() else cached[1]

    def _pool_for(self, threads: int) -> int:
        """``_pool()`` for a call on ``threads`` threads: more than the machine's CPUs run on
        the call's own threads. libgomp ends the process (``gomp_fatal``) when it cannot
        start a pool thread, where the library's own threads go on with fewer: a large
        ``set_num_threads`` under a pids or memory limit killed a step on the pool and not on
        its own threads (thirty-first session)."""
        return 1 if threads > _CPUS else self._pool()

    def grad_sumsq(self, grad, *, num_threads=None) -> Tuple[float, bool]:
        check_tensor("grad", grad, GRAD_DTYPES)
        check_threads(num_threads)
        threads = resolve_threads(num_threads)
        out = _c_dbl(0.0)
        flag = _c_int(0)
        if grad.numel() == 0:
            return 0.0, False
        rc = self._lib.offload_grad_sumsq(
            grad.data_ptr(), GRAD_DTYPES[grad.dtype], grad.numel(), ctypes.byref(out),
            ctypes.byref(flag), ISA_CODES[self.isa()], threads, self._pool_for(threads))
        self._check(rc, "offload_grad_sumsq")
        return out.value, bool(flag.value)
