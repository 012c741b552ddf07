"""PEP 678 exception notes on every Python the package installs on.

``BaseException.add_note`` is Python 3.11+; on 3.10 calling it raised AttributeError in place of
the error it was to annotate (seen in ``from_deepspeed_config``). There the note goes to
``__notes__`` as 3.11 keeps it (code that reads notes finds it) and, since 3.10's traceback does
not print ``__notes__``, to the end of the message of an exception whose only argument is its
message; other exceptions (an OSError's errno, strerror) keep their arguments.
"""
from __future__ import annotations

__all__ = ["add_note"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it; its equivalent where it does not."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
    notes.append(note)
    exc.__notes__ = notes
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",)
