"""Cross-rank agreement: one prepare / vote / commit / undo state machine for every change
that several ranks must apply all together or not at all (a swap step, a checkpoint save or
load, opening the swap files).

[Note: ranks vote before commit] With several data-parallel ranks, each rank's swap step
covers only its shard, and the params are all-gathered after it: a rank whose step failed
(disk full, EIO) and raised would leave the others waiting in that all-gather, and ranks
that committed a step the failed rank did not would disagree from then on. So a
multi-rank change is prepare / vote / commit: every rank prepares it (a step writes its new
states into the other slots and makes them durable, ``store.sync``), then all ranks
exchange one flag (``vote(ok) -> failed ranks``, a collective each rank calls at the same
points whatever happens), and only if no rank failed does each commit (a step: its
manifest). Otherwise every rank keeps what it had (a step: its manifest was never flipped)
and raises, naming the ranks that failed. The commit itself can still fail on one rank
after that vote - on a full disk it is the likeliest failure, as the slot files are
preallocated and the manifest is a new file - so a second vote follows the commit: if a
rank could not commit, the others undo theirs (a step: ``store.undo_commit``, the previous
data is still in the other slots). Every rank votes the same number of times: once when the
first vote fails, twice otherwise, and a rank with nothing to do votes the same way
(:func:`idle_votes`).

[Note: a rank one step ahead] The votes make a step all-or-none against failures that raise;
a ``kill -9`` (or a power loss) between two ranks' commits still leaves one rank's manifest at
step N+1 and another's at N. The rank ahead cannot have written anything since: it waits in
the second vote (stages 1-2), or in the next forward's all-gather (stage 3), for the rank that
died. So its free slots still hold step N, and each manifest also records the commit before
its last (``previous``: slots, valid, checksums, step, extra) for as long as nothing has been
written into the free slots (``SwapStore.write_requests`` forgets it). At resume the ranks
compare their steps (``offload.zero.comm.agree_on_step``): when they differ by one and every
rank ahead still holds the others' step, those ranks go back to it (``SwapStore.undo_commit``,
with a warning) and every rank resumes at N; any other difference is refused on every rank.

The collective itself (``offload.zero.comm.failed_ranks`` bound to a process group) stays
with the layer that owns ``torch.distributed``; this layer takes it as a ``Vote`` callable,
``None`` for a single rank (then every vote trivially passes and nothing is exchanged).
"""
from __future__ import annotations

import contextlib
import enum
import logging
from typing import Callable, Iterator, List, Optional, TypeVar

__all__ = ["Vote", "Phase", "Agreement", "vote_failed", "all_or_none", "on_every_rank", "idle_votes"]

log = logging.getLogger(__name__)

T = TypeVar("T")

Vote = Callable[[bool], List[int]]
"""``vote(ok) -> ranks that failed`` (on every rank); a collective every rank calls."""


class Phase(enum.Enum):
    PREPARING = "preparing"  # nothing voted yet: a failure here is cast as the first vote
    PREPARED = "prepared"    # every rank prepared: commit, and a failure is cast as the second vote
    AGREED = "agreed"        # every rank committed (or, with one vote only, prepared)
    FAILED = "failed"        # some rank failed: no more votes


def vote_failed(vote: Optional[Vote], what: str) -> None:
    """Tell the other ranks that ``what`` failed here; the local error stays the one raised."""
    if vote is None:
        return
    try:
        vote(False)
    except Exception as exc:  # the process group itself is broken: nothing more to do here
        log.warning("could not tell the other ranks that %s failed: %s", what, exc)


class Agreement:
    """The votes of one change on this rank, in order: ``failing()`` around each local half
    (it casts a failed vote for the current phase and re-raises), ``prepared()`` after the
    prepare half, ``committed()`` after the commit half. Each returns the ranks that failed
    (``[]``: go on). A vote is never cast twice, and none after a failed one."""

    def __init__(self, vote: Optional[Vote], what: str) -> None:
        self.vote = vote
        self.what = what
        self.phase = Phase.PREPARING
        self.failed: List[int] = []

    @property
    def several(self) -> bool:
        """Whether other ranks take part (a vote was given)."""
        return self.vote is not None

    def fail(self) -> None:
        """This rank's half failed: cast its vote (once), and stop voting."""
        if self.phase in (Phase.PREPARING, Phase.PREPARED):
            self.phase = Phase.FAILED
            vote_failed(self.vote, self.what)

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Run a local half; on any exception cast the failed vote, then re-raise."""
        try:
            yield
        except BaseException:
            self.fail()
            raise

    def _cast(self, expect: Phase, then: Phase) -> List[int]:
        if self.phase is not expect:
            raise RuntimeError(f"internal error: {self.what}: a vote in phase {self.phase.value}, "
                               f"expected {expect.value}")
        failed = self.vote(True) if self.vote is not None else []
        self.phase = Phase.FAILED if failed else then
        self.failed = list(failed)
        return self.failed

    def prepared(self) -> List[int]:
        """The first vote: this rank prepared; the ranks that did not."""
        return self._cast(Phase.PREPARING, Phase.PREPARED)

    def committed(self) -> List[int]:
        """The second vote: this rank committed; the ranks that could not."""
        return self._cast(Phase.PREPARED, Phase.AGREED)

    def ranks(self) -> str:
        return ", ".join(map(str, self.failed))


def all_or_none(prepare: Callable[[], T], commit: Callable[[T], None], undo: Callable[[], str], what: str,
                vote: Optional[Vote]) -> T:
    """``prepare()`` (nothing visible yet), agree, ``commit(prepared)``, agree again; a rank
    whose commit went through while another's failed calls ``undo()`` (which returns what
    it now holds, for the error). So every rank applies the change or none does (see
    [Note: ranks vote before commit])."""
    ag = Agreement(vote, what)
    with ag.failing():
        prepared = prepare()
    if ag.prepared():
        raise RuntimeError(f"{what} failed on rank {ag.ranks()} (see its error there); it was applied on no rank")
    with ag.failing():
        commit(prepared)
    if ag.committed():
        raise RuntimeError(f"{what} failed on rank {ag.ranks()} (see its error there) as it committed; {undo()}")
    return prepared


def on_every_rank(fn: Callable[[], T], what: str, vote: Optional[Vote]) -> T:
    """Run ``fn`` here, then agree with the other ranks (one vote, and so a barrier): if it
    failed on any rank, raise on every rank - the local error where it happened, a
    RuntimeError naming the failed ranks elsewhere - so that no rank goes on to a
    collective the failed one will never join. ``vote`` None: just run ``fn``."""
    if vote is None:
        return fn()
    ag = Agreement(vote, what)
    with ag.failing():
        out = fn()
    if ag.prepared():
        raise RuntimeError(f"{what} failed on rank {ag.ranks()} (see its error there)")
    return out


def idle_votes(vote: Optional[Vote], on_failed: Callable[[List[int]], BaseException], what: str) -> None:
    """A rank with nothing to change takes part in both votes, and raises ``on_failed(ranks)``
    as the others do when some rank failed."""
    ag = Agreement(vote, what)
    if not ag.prepared():
        ag.committed()
    if ag.failed:
        raise on_failed(ag.failed)
