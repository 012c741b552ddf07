"""Whether this process is a child forked since ``import offload``.

Registered by the package's ``__init__`` itself, which imports nothing heavy ([Note: a light
package import] there): the kernels, imported on first use, may load after a fork, and a
child must still know that its parent's OpenMP pool did not come with it (``forked()`` in
offload/kernels/_threads.py). Nothing here imports torch.
"""
import os

__all__ = ["forked"]

_FORKED = []  # not empty in a child forked since this import


def forked() -> bool:
    return bool(_FORKED)


os.register_at_fork(after_in_child=lambda: _FORKED.append(True))
