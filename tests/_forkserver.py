"""Python children for the tests without a fresh interpreter each: ``spawn(code, args)``
forks them from a warm one (a "zygote" that has imported torch and offload, ~2 s of CPU
that every ``python -c`` child used to pay again) and gives back a ``subprocess.Popen``-like
handle: ``pid``, text ``stdout``/``stderr`` pipes, ``poll``, ``wait``, ``communicate``,
``send_signal``, ``kill``, ``returncode`` (``-N`` when killed by signal N).

The child runs ``code`` as ``python -c code *args`` would (or a script, ``run_script``):
``sys.argv == ["-c", *args]``, ``__name__ == "__main__"`` in a module of its own, the
caller's working directory, stdin from /dev/null (or a pipe), and a normal interpreter exit (atexit handlers, SystemExit codes, a
traceback and 1 for an uncaught exception; signals kill it as they kill any process). The
zygote started with the caller's environment: one zygote per environment (but for
PYTEST_CURRENT_TEST), so a child never sees another environment's import-time settings
(OMP_NUM_THREADS, OFFLOAD_BACKEND ...); the child's os.environ is the caller's exactly.

The zygote runs no torch op before it forks (no thread pools, nothing locked); its only other
thread is OpenBLAS's, which handles fork itself. Each child is forked by an intermediate
process that waits for it and reports its pid and exit status through a pipe of the caller's.
"""
from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time

_ZYGOTE = r'''
import builtins, json, os, socket, sys, types
import torch, offload  # what every child would import again
import torch._dynamo  # imported by torch.optim.Optimizer.add_param_group at a child's first optimizer (~1.7 s)

def serve(sock):
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, 4)
        if not msg:
            os._exit(0)
        if os.fork() == 0:  # the intermediate: forks the child, waits, reports
            sock.close()
            pid = os.fork()
            if pid == 0:
                for i in range(3):
                    os.dup2(fds[i], i)
                for f in fds:
                    os.close(f)
                return json.loads(msg)
            for f in fds[:3]:
                os.close(f)
            os.write(fds[3], b"%d\n" % pid)
            _, status = os.waitpid(pid, 0)
            os.write(fds[3], b"%d\n" % os.waitstatus_to_exitcode(status))
            os._exit(0)
        for f in fds:
            os.close(f)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass

req = serve(socket.socket(fileno=int(sys.argv[1])))
os.environ.clear()
os.environ.update(req["env"])  # the caller's, to the variable (PYTEST_CURRENT_TEST is not in the key)
os.chdir(req["cwd"])
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
if req["path"] is None:  # python -c code args
    sys.argv, where = ["-c"] + req["args"], "<string>"
else:  # python path args
    sys.argv, where = [req["path"]] + req["args"], req["path"]
    sys.path[0] = os.path.dirname(os.path.abspath(req["path"]))
    main.__file__ = req["path"]
    with open(req["path"]) as fh:
        req["code"] = fh.read()
del builtins, json, os, socket, sys, types, serve
exec(compile(req["code"], where, "exec"), main.__dict__)
'''

_ZYGOTES: dict = {}
_LOCK = threading.Lock()


# Set by pytest for each test: a zygote for each would be no saving. Nothing reads it at import.
_NOT_IN_KEY = ("PYTEST_CURRENT_TEST",)


def _zygote(env: dict) -> socket.socket:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _NOT_IN_KEY))
    with _LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= 3:  # ~300 MB each: let the oldest go (its children live on)
                _ZYGOTES.pop(next(iter(_ZYGOTES)))[0].close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(theirs.fileno())], env=env,
                                    pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
            theirs.close()
            _ZYGOTES[key] = (ours, proc)
        return _ZYGOTES[key][0]


@atexit.register
def _close_all() -> None:
    for sock, proc in _ZYGOTES.values():
        sock.close()  # the zygote leaves when it reads the end of its socket
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


class Forked:
    """The handle of a forked child, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, code, path, args, env: dict, cwd=None, stdin: bool = False) -> None:
        self.args = (["-c", code] if path is None else [path]) + list(args)
        self.returncode = None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._status, stat_w = os.pipe()
        if stdin:
            in_r, in_w = os.pipe()
        else:
            in_r, in_w = os.open(os.devnull, os.O_RDONLY), None
        msg = json.dumps({"code": code, "path": path, "args": list(args), "cwd": cwd or os.getcwd(),
                          "env": dict(env)}).encode()
        try:
            socket.send_fds(_zygote(env), [msg], [in_r, out_w, err_w, stat_w])
        finally:
            for f in (in_r, out_w, err_w, stat_w):
                os.close(f)
        self.stdin = None if in_w is None else open(in_w, "w")
        self.stdout = open(out_r, "r")
        self.stderr = open(err_r, "r")
        self._buf = b""
        self.pid = int(self._line(60))

    def _line(self, timeout):
        """The next line from the status pipe, within ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._status], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = os.read(self._status, 64)
            if not chunk:
                raise RuntimeError("the fork server lost this child (its intermediate process died)")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait(self, timeout=None) -> int:
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
            os.close(self._status)
        return self.returncode

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, input=None, timeout=None):
        if self.stdin is not None:  # as Popen: write the input, then close
            if input:
                self.stdin.write(input)
            self.stdin.close()
        elif input:
            raise ValueError("this child's stdin is /dev/null (spawn(..., stdin=True) for a pipe)")
        got = {}
        readers = [threading.Thread(target=lambda k=k, f=f: got.__setitem__(k, f.read()), daemon=True)
                   for k, f in (("out", self.stdout), ("err", self.stderr))]
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.start()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got["out"], got["err"]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __del__(self):  # (stdout and stderr close themselves)
        if getattr(self, "returncode", 0) is None and getattr(self, "_status", None) is not None:
            os.close(self._status)


def spawn(code: str, *args: str, env: dict, stdin: bool = False) -> Forked:
    """``python -c code *args`` with ``env``, forked from a warm interpreter; ``stdin``: a
    text pipe as ``.stdin`` (else /dev/null)."""
    return Forked(code, None, args, env, stdin=stdin)


def run_script(path: str, *args: str, env: dict, cwd: str) -> Forked:
    """``python path *args`` in ``cwd`` with ``env``, forked from a warm interpreter
    (``sys.argv[0]``, ``__file__`` and ``sys.path[0]`` as the script's own)."""
    return Forked(None, str(path), args, env, cwd=str(cwd))


def run(path: str, *args: str, env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, path, *args], capture_output=True, text=True, timeout=...)``
    with the child forked from a warm interpreter (killed, and TimeoutExpired, past
    ``timeout``)."""
    child = run_script(path, *args, env=env, cwd=cwd)
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return subprocess.CompletedProcess(child.args, child.returncode, out, err)
