"""offload._notes.add_note: PEP 678 notes on Python 3.10 too (from_deepspeed_config's note on
3.10 raised AttributeError in place of the config's ValueError)."""
from __future__ import annotations

import errno

import pytest

from offload._notes import add_note


class _NoAddNote(ValueError):
    """A ValueError as Python 3.10 has it: no add_note."""

    def __getattribute__(self, name):
        if name == "add_note":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_a_note_on_this_python_is_python_s_own():
    e = ValueError("bad config")
    add_note(e, "the model stays sharded")
    assert e.__notes__ == ["the model stays sharded"]
    assert e.args == ("bad config",) or not hasattr(ValueError, "add_note")


def test_without_add_note_the_note_is_kept_and_shown_in_the_message():
    e = _NoAddNote("bad config")
    assert not hasattr(e, "add_note")
    add_note(e, "first")
    add_note(e, "second")
    assert e.__notes__ == ["first", "second"]
    assert str(e) == "bad config\nfirst\nsecond"
    with pytest.raises(ValueError, match="bad config"):
        raise e


def test_without_add_note_an_oserror_keeps_its_errno():
    class _OSNoNote(OSError):
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    e = _OSNoNote(errno.ENOENT, "no such directory", "/x")
    add_note(e, "note")
    assert e.errno == errno.ENOENT and e.filename == "/x" and e.__notes__ == ["note"]
