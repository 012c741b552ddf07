"""A signal that arrives while numba compiles is not lost ([Note: signals in llvmlite's
callbacks] in offload/kernels/_numba_signals.py). llvmlite calls back into Python from C
during a compile; a handler's exception raised inside such a ctypes callback is printed and
dropped. libc's qsort, calling a Python comparison, stands in for llvmlite's callbacks here,
run under llvmlite's own lock (whose events the hold listens to): the signal is raised inside
the callback, where its handler runs."""
from __future__ import annotations

import ctypes
import signal
import sys
import threading

import pytest
import torch

from offload.kernels import numba_rules
from offload.kernels._numba_signals import signals_held
from offload.kernels.fields import SGD

numba_backend = pytest.importorskip("offload.kernels.numba_backend")  # installs the hold
ffi = pytest.importorskip("llvmlite.binding.ffi")

_CMP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


def _signal_in_a_callback(*sigs) -> None:
    """Raise ``sigs`` inside a ctypes callback (qsort's comparison), and run a few
    bytecodes there: the handlers run inside the callback."""
    arr = (ctypes.c_int * 2)(2, 1)

    def cmp(a, b):
        for s in sigs:
            signal.raise_signal(s)
        total = 0
        for i in range(1000):
            total += i
        return 0

    ctypes.CDLL(None).qsort(arr, 2, ctypes.sizeof(ctypes.c_int), _CMP(cmp))


class Terminated(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    def raise_terminated(signum, frame):
        raise Terminated()

    before = signal.signal(signal.SIGTERM, raise_terminated)
    yield
    signal.signal(signal.SIGTERM, before)


def test_without_the_hold_a_callbacks_exception_is_lost(sigterm_raises, monkeypatch):
    """Why the hold exists: the handler ran, and its exception went to sys.unraisablehook."""
    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    _signal_in_a_callback(signal.SIGTERM)  # no Terminated here
    assert lost == [Terminated]


def _in_llvmlites_lock(*sigs) -> None:
    with ffi.lib._lock:
        assert signal.getsignal(signal.SIGINT).__name__ == "_note"  # held while the lock is
        _signal_in_a_callback(*sigs)


def test_held_signals_are_raised_when_the_call_returns(sigterm_raises):
    with pytest.raises(Terminated):
        with signals_held():
            _in_llvmlites_lock(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM).__name__ == "raise_terminated"
    with pytest.raises(KeyboardInterrupt):
        with signals_held():
            _in_llvmlites_lock(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_every_noted_signal_is_delivered():
    got = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_held():
            _in_llvmlites_lock(signal.SIGTERM, signal.SIGINT, signal.SIGTERM)
            assert got == []
        assert sorted(got) == [signal.SIGINT, signal.SIGTERM]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def test_outside_our_calls_a_compiles_end_delivers(sigterm_raises):
    """A signal noted under the lock outside any kernel call of ours waits for the next
    compile's end (another library's kernel, here a new one)."""
    import numba

    _in_llvmlites_lock(signal.SIGTERM)
    with pytest.raises(Terminated):
        numba.njit(lambda x: x + 1)(1)


def test_a_numba_kernel_call_holds_them(sigterm_raises, monkeypatch):
    """The backend's rule call runs its kernel inside the hold: a SIGTERM from a callback in
    the kernel call (the compile's place) ends the call with the handler's exception."""
    ran = []

    def kernel(*args):
        ran.append(True)
        _in_llvmlites_lock(signal.SIGTERM)

    monkeypatch.setattr(numba_rules, "sgd_serial", kernel)
    be = numba_backend.NumbaBackend()
    p, g = torch.zeros(8), torch.ones(8)
    with pytest.raises(Terminated):
        be.rule_step(SGD, p, g, {"momentum_buffer": torch.zeros(8)}, step=1, lr=0.1, momentum=0.9)
    assert ran


def test_another_thread_is_left_alone(sigterm_raises):
    seen = []

    def body():
        with ffi.lib._lock:
            seen.append(signal.getsignal(signal.SIGTERM).__name__)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == ["raise_terminated"]


def test_a_child_forked_inside_a_hold_has_its_handlers_back():
    from _fork_child import run_child
    from offload.kernels import _numba_signals

    _numba_signals.hold()  # as llvmlite's lock does
    try:
        assert signal.getsignal(signal.SIGINT).__name__ == "_note"
        run_child(lambda: signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "the forked child hung")
    finally:
        _numba_signals.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
