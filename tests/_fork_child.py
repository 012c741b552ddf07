"""A body run in a forked child that must exit 0 within a minute: the fork tests' one loop
(a child that waits for a thread or a lock that did not come with the fork hangs, and fails
the test instead of the suite)."""
import os
import signal
import time

import pytest


def run_child(body, hang: str) -> None:
    """``body()`` in a forked child, which passes when it returns true; ``hang`` is the
    failure's text when the child does not exit within 60 s."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 1
        try:
            code = 0 if body() else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, "the child's body failed"
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(hang)
