"""An optimizer's collective calls: counted on every rank, and reported when one raises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from canzona.runtime import MatrixRuntime
from canzona.runtime.config import (
    CollectiveTimeoutError,
    GradientMismatchError,
    PartialUpdateError,
    PlanMismatchError,
    UpdateFailedError,
)

#: The errors whose messages name ranks (``load_state_dict``'s are ``ValueError``s).
_NAMING_RANKS = (
    CollectiveTimeoutError,
    GradientMismatchError,
    PartialUpdateError,
    PlanMismatchError,
    UpdateFailedError,
    ValueError,
)


@contextmanager
def collective_call(runtime: MatrixRuntime) -> Iterator[None]:
    """One ``step()``, ``state_dict()`` or ``load_state_dict()`` of this rank.

    Every rank makes the same calls in the same order, so the count names the call on
    every rank. A call that raises here files what it raised under that count in the job's
    store: a peer still waiting for this rank in one of the call's collectives (where this
    rank raised alone, outside the failure handling every rank shares) then gives up at its
    next look instead of at ``timeout_s`` (:meth:`~canzona.runtime.watchdog.Watchdog.wait`).
    On a process group other than the default one (a pipeline stage's), an error that
    names ranks says which global ranks those are.
    """
    runtime.watchdog.calls.begun += 1
    try:
        yield
    except BaseException as exc:
        watchdog = runtime.watchdog  # the current one: the step may have made a new one
        watchdog.left(exc)
        note = watchdog.rank_note()
        if note and isinstance(exc, _NAMING_RANKS) and _names_ranks(exc):
            exc.args = (f"{exc.args[0]} {note}", *exc.args[1:])
        raise


def _names_ranks(exc: BaseException) -> bool:
    """Whether ``exc``'s message names a rank (and is a string the note can extend)."""
    return bool(exc.args) and isinstance(exc.args[0], str) and "rank" in exc.args[0]
