"""An optimizer's collective calls: counted on every rank, and reported when one raises."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from canzona.runtime import MatrixRuntime


@contextmanager
def collective_call(runtime: MatrixRuntime) -> Iterator[None]:
    """One ``step()``, ``state_dict()`` or ``load_state_dict()`` of this rank.

    Every rank makes the same calls in the same order, so the count names the call on
    every rank. A call that raises here files what it raised under that count in the job's
    store: a peer still waiting for this rank in one of the call's collectives (where this
    rank raised alone, outside the failure handling every rank shares) then gives up at its
    next look instead of at ``timeout_s`` (:meth:`~canzona.runtime.watchdog.Watchdog.wait`).
    """
    runtime.watchdog.calls.begun += 1
    try:
        yield
    except BaseException as exc:
        runtime.watchdog.left(exc)  # the current watchdog: the step may have made a new one
        raise
