"""What proves that a run directory (``offload-<run>.rank<r>``) is one offload made, before
``offload clean`` removes it.

[Note: a directory clean may remove] The name, mode 0700, this user's uid and file names
from ``fsutil.OWN_FILES`` are what anyone's directory may have (``offload-mydata.rank0``
holding a ``manifest.json`` of notes and a ``slot0.bin``): clean removed such a directory as
"a creation that died". Its contents must say it is offload's, from the order in which
offload writes them:

- the lock file comes first (``fsutil.Lock``; the param tier's ``tier_dir.lock_dir``), before
  any other file, and a removal unlinks it last: a directory holding anything has one, and it
  holds nothing or this process's pid in decimal (a newline after it from ``Lock``);
- the manifest (``manifest.json``), when there is one, is the swap store's JSON object
  ``{"format": "offload-swap", ...}`` (``write_json_atomic``: whole or absent).

An empty directory (its maker died between ``mkdir`` and the lock file) has nothing to prove
and holds nothing to lose: it goes, as before, once older than ``fsutil.CREATION_GRACE_S``.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional

from offload.io.files import NotRegularFile, open_regular
from offload.swap import fsutil

__all__ = ["SWAP_FORMAT", "not_proven_ours"]

SWAP_FORMAT = "offload-swap"
"""The ``"format"`` of the swap store's ``manifest.json`` (``SwapStore._write_manifest``)."""

_LOCK_TEXT = re.compile(rb"^[0-9]{0,20}\n?$")  # nothing yet, or a pid


def not_proven_ours(path: str, names: Optional[List[str]] = None) -> Optional[str]:
    """Why the contents of run directory ``path`` do not prove it offload's ([Note: a
    directory clean may remove]), or None when they do. ``names``: its entries, if listed."""
    names = os.listdir(path) if names is None else names
    if not names:
        return None
    why = _lock_problem(os.path.join(path, fsutil.LOCK_NAME))
    if why is None and "manifest.json" in names:
        why = _manifest_problem(os.path.join(path, "manifest.json"))
    if why is None:
        return None
    return f"{why}: not a directory offload made (it writes its lock file first); removed nothing"


def _lock_problem(lock: str) -> Optional[str]:
    try:
        fd = open_regular(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return "no lock file"
    except NotRegularFile:
        return "its lock is not a regular file"
    except OSError as exc:
        return f"its lock file cannot be read ({exc.strerror})"
    try:
        text = os.read(fd, 64)
    finally:
        os.close(fd)
    if not _LOCK_TEXT.match(text):
        return "its lock file holds something other than a pid"
    return None


def _manifest_problem(manifest: str) -> Optional[str]:
    try:
        doc = fsutil.read_json(manifest)
    except (OSError, ValueError):
        return "its manifest.json is not JSON"
    if not isinstance(doc, dict) or doc.get("format") != SWAP_FORMAT:
        return f"its manifest.json is not an offload swap manifest (no \"format\": \"{SWAP_FORMAT}\")"
    return None
