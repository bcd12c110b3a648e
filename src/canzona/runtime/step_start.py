"""What :meth:`~canzona.runtime.engine.MatrixRuntime.begin_step` tells the optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from canzona.runtime.pipeline import Failure
    from canzona.runtime.statecomm import Snapshot

__all__ = ["StepStart"]


@dataclass(frozen=True, slots=True)
class StepStart:
    """What :meth:`~canzona.runtime.engine.MatrixRuntime.begin_step` tells the optimizer.

    Attributes:
        active: Parameters with a gradient on every rank (the others are skipped).
        skip: Every rank skips the step (a non-finite gradient with ``skip_nonfinite``).
        payload: Per active matrix parameter with local data, where the optimizer writes
            its prepared payload (a view shaped like the parameter's local shard; valid
            until the runtime's ``run`` returns).
        previous: After a re-plan, the old plan's snapshot (owner-held state moves from it).
        declined: The header rides the first gather and this rank's step does not match
            the last agreed one: prepare nothing (the runtime's ``run`` then raises
            :class:`~canzona.runtime.pipeline.StepDeclined` on every rank).
        failure: The step's buffers could not be allocated on this rank (a distributed
            job; nothing of them is held): prepare nothing and pass it to
            the runtime's ``run``, which raises it on every rank.
    """

    active: frozenset[int]
    skip: bool
    payload: dict[int, torch.Tensor]
    previous: Snapshot | None
    declined: bool = False
    failure: Failure | None = None
