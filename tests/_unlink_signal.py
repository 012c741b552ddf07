"""An ``os.unlink`` that removes its file and then sends this process a signal, once: the
moment a removal is interrupted, made exact instead of left to timing.

Only an unlink by name in a directory under ``under`` (the removal's ``dir_fd`` form), and only
from the main thread: another test's store that the garbage collector finalizes on another
thread meanwhile (its directory elsewhere) must not fire it at some other point of the test.
"""
from __future__ import annotations

import os
import threading
from typing import List


def signal_after_first_unlink(monkeypatch, signum: int, under: str) -> List[str]:
    """Patch ``os.unlink`` (undone by ``monkeypatch``); returns the list of the path it fired on."""
    real, sent = os.unlink, []
    under = os.path.realpath(under) + os.sep

    def unlink(path, *args, **kwargs):
        real(path, *args, **kwargs)
        dir_fd = kwargs.get("dir_fd")
        if dir_fd is None or sent or threading.current_thread() is not threading.main_thread():
            return
        if (os.readlink(f"/proc/self/fd/{dir_fd}") + os.sep).startswith(under):
            sent.append(path)
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(os, "unlink", unlink)
    return sent
