"""The cross-rank agreement (offload/swap/agreement.py): one prepare / vote / commit / undo
state machine, every rank voting the same number of times whatever fails where."""
from __future__ import annotations

import pytest

from offload.swap.agreement import Agreement, Phase, all_or_none, idle_votes, on_every_rank


class Ballot:
    """A vote that records this rank's flags and answers with the failed ranks of each round."""

    def __init__(self, *answers):
        self.cast, self.answers = [], list(answers)

    def __call__(self, ok):
        self.cast.append(ok)
        return self.answers.pop(0) if self.answers else []


def _boom():
    raise OSError(28, "No space left on device")


def test_all_or_none_votes_twice_when_every_rank_commits():
    vote, done = Ballot(), []
    assert all_or_none(lambda: 7, done.append, lambda: "undone", "save", vote) == 7
    assert vote.cast == [True, True] and done == [7]


def test_a_local_prepare_failure_votes_false_once_and_raises_the_local_error():
    vote, done = Ballot(), []
    with pytest.raises(OSError, match="No space left"):
        all_or_none(_boom, done.append, lambda: "undone", "save", vote)
    assert vote.cast == [False] and done == []


def test_a_peer_failing_to_prepare_stops_every_rank_before_its_commit():
    vote, done = Ballot([3]), []
    with pytest.raises(RuntimeError, match=r"^save failed on rank 3 \(see its error there\); it was applied on no rank$"):
        all_or_none(lambda: 1, done.append, lambda: "undone", "save", vote)
    assert vote.cast == [True] and done == []


def test_a_local_commit_failure_is_the_second_vote():
    vote = Ballot()
    with pytest.raises(OSError, match="No space left"):
        all_or_none(lambda: 1, lambda _: _boom(), lambda: "undone", "save", vote)
    assert vote.cast == [True, False]


def test_a_peer_failing_to_commit_makes_this_rank_undo():
    vote, undone = Ballot([], [0, 2]), []
    with pytest.raises(RuntimeError, match=r"save failed on rank 0, 2 \(see its error there\) as it committed; "
                                           r"it put its previous checkpoint back"):
        all_or_none(lambda: 1, lambda _: None, lambda: undone.append(1) or "it put its previous checkpoint back",
                    "save", vote)
    assert vote.cast == [True, True] and undone == [1]


def test_a_single_rank_never_votes():
    done = []
    assert all_or_none(lambda: 5, done.append, lambda: "x", "save", None) == 5 and done == [5]
    assert on_every_rank(lambda: 3, "open", None) == 3


def test_on_every_rank_is_one_vote_and_a_barrier():
    vote = Ballot()
    assert on_every_rank(lambda: 3, "open", vote) == 3 and vote.cast == [True]
    vote = Ballot([1])
    with pytest.raises(RuntimeError, match=r"^open failed on rank 1 \(see its error there\)$"):
        on_every_rank(lambda: 3, "open", vote)
    vote = Ballot()
    with pytest.raises(OSError):
        on_every_rank(_boom, "open", vote)
    assert vote.cast == [False]


def test_idle_rank_votes_as_the_others():
    vote = Ballot()
    idle_votes(vote, lambda failed: AssertionError(failed), "step")
    assert vote.cast == [True, True]
    vote = Ballot([1])  # the first vote fails: no second one
    with pytest.raises(ValueError, match=r"\[1\]"):
        idle_votes(vote, lambda failed: ValueError(failed), "step")
    assert vote.cast == [True]
    vote = Ballot([], [2])
    with pytest.raises(ValueError, match=r"\[2\]"):
        idle_votes(vote, lambda failed: ValueError(failed), "step")
    assert vote.cast == [True, True]


def test_a_vote_is_never_cast_twice_nor_out_of_order():
    vote = Ballot()
    ag = Agreement(vote, "step")
    with pytest.raises(RuntimeError, match="a vote in phase preparing, expected prepared"):
        ag.committed()
    ag.fail()
    ag.fail()  # already failed: not cast again
    assert vote.cast == [False] and ag.phase is Phase.FAILED
    with pytest.raises(RuntimeError, match="a vote in phase failed, expected preparing"):
        ag.prepared()
    ag = Agreement(vote, "step")
    assert ag.prepared() == [] and ag.committed() == [] and ag.phase is Phase.AGREED
    ag.fail()  # after the agreement there is nothing left to vote on
    assert vote.cast == [False, True, True]


def test_a_broken_process_group_leaves_the_local_error(caplog):
    def broken(ok):
        raise RuntimeError("connection reset")

    with pytest.raises(OSError, match="No space left"):
        all_or_none(_boom, lambda _: None, lambda: "", "save", broken)
    assert "could not tell the other ranks that save failed: connection reset" in caplog.text
