"""A param group's packed step structs, kept from one step to the next.

[Note: prepared batches] The host store steps the same tensors every step: the params and
their states in ``opt.state`` stay, only the grads (often new tensors) and the step count
change. Packing each param's struct and checking its tensors again cost about 9 us of Python
per param per step, more than torch's whole fused step spends per tensor (twenty-eighth
session, ``bench/model_step.py`` "small": 2000 tensors). A ``PreparedBatch`` keeps the
structs one step packed (``NativeBackend._pack_batch``: the very bytes), and each later step
writes only what changes: each grad's pointer, and the folded constants of the step count
(once per distinct count; a learning-rate schedule changes them too). The call is the same
``offload_rule_steps``, so the bits are those of the batch packed afresh.

Whether the kept structs still describe the tensors is the caller's to know: the host store
checks, each step, that every param and state is at the same address, of the same size and
still contiguous, and that each grad is a contiguous float32 tensor of its param's size
(``_signature`` and ``_grad_pointers`` in offload/optim/host_prepared.py). The library still checks every struct before it runs any: a
struct it refuses has changed nothing, and ``run`` returns False so that the caller steps
the group the general way (which raises the error with its full text).
"""
from __future__ import annotations

import ctypes
from typing import Any, List, Sequence

import numpy as np

from ._native_abi import StepArgs

__all__ = ["PreparedBatch"]

_SIZE = ctypes.sizeof(StepArgs)
_GRAD_PTR = StepArgs.grad.offset // 8  # in 8-byte words (Array's first field is its pointer)
_CONSTS = StepArgs.consts.offset


class PreparedBatch:
    """The structs of a batch of float32 steps (every tensor non-empty), in entry order."""

    def __init__(self, backend: Any, rule: Any, structs: List[bytes], tail: tuple, entries: Sequence[Any]):
        if len(structs) != len(entries) or any(len(s) != _SIZE for s in structs):
            raise ValueError("a prepared batch takes one struct per (non-empty) entry")
        self.rule = rule
        self.count = len(structs)
        self.tail = tail  # (isa code, threads, prefetch code, pool code) it was packed with
        self.numels = [e.param.numel() for e in entries]
        self._backend = backend
        self._buf = np.frombuffer(bytearray(b"".join(structs)), dtype=np.uint8)
        self._rows = self._buf.reshape(self.count, _SIZE)
        self._grad_ptrs = self._buf.view(np.uint64).reshape(self.count, _SIZE // 8)[:, _GRAD_PTR]
        self._structs = (ctypes.c_char * self._buf.nbytes).from_buffer(self._buf)
        self._consts: Any = None  # the consts bytes every struct holds now (None: mixed counts)

    def run(self, grad_ptrs: Sequence[int], steps: Sequence[int], hyper: Any, tail: tuple) -> bool:
        """Step the batch with these grads (their pointers, in order) at these step counts;
        False, having changed nothing, when it cannot (another tail, a struct the library
        refuses): the caller then steps the general way."""
        if tail != self.tail or len(grad_ptrs) != self.count or len(steps) != self.count:
            return False
        self._grad_ptrs[:] = grad_ptrs
        self._set_consts(steps, hyper)
        rc, bad = self._backend.run_structs(self._structs, self.count, tail[1])
        if rc == 0:
            return True
        if bad >= 0:  # refused before anything ran
            return False
        self._backend.check_rc(rc, f"offload_rule_steps ({self.rule.name}, a prepared batch of {self.count})")
        return False

    def _set_consts(self, steps: Sequence[int], hyper: Any) -> None:
        first = steps[0]
        fold = self._backend.step_consts
        if steps.count(first) == len(steps):  # the usual case: one count for the whole group
            c = fold(self.rule, hyper, first)
            if c != self._consts:
                self._rows[:, _CONSTS:_CONSTS + len(c)] = np.frombuffer(c, dtype=np.uint8)
                self._consts = c
            return
        counts = np.asarray(steps, dtype=np.int64)
        for step in np.unique(counts).tolist():
            c = fold(self.rule, hyper, step)
            self._rows[counts == step, _CONSTS:_CONSTS + len(c)] = np.frombuffer(c, dtype=np.uint8)
        self._consts = None
