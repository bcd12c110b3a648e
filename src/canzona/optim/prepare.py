"""The per-step lists of a step's element-wise work, built once and reused while nothing changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

ADAMW = "adamw"


@dataclass(slots=True)
class GroupWork:
    """One param group's active parameters in a step, and the lists its phases use.

    Attributes:
        gid: Index of the param group.
        adamw: Whether the group uses the AdamW route.
        idxs: Active parameters with a gradient to read, in optimizer order (every rank
            reads them in the same order: a gradient in other placements is
            redistributed, collectively).
        params: The parameters of ``idxs``.
        prepared: Positions in ``idxs`` of the matrices with local data (they get payloads).
        payloads: Where those matrices' payloads go.
        cache: The optimizer's own lists for this group (state tensors, backups), kept as
            long as the work is.
    """

    gid: int
    adamw: bool
    idxs: list[int]
    params: list[Tensor]
    prepared: list[int] = field(default_factory=list)
    payloads: list[Tensor] = field(default_factory=list)
    cache: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepWork:
    """Every active parameter's step counter, and the work of each param group, in order."""

    steps: list[Tensor]
    groups: list[GroupWork]


def build_work(
    *,
    active: list[int],
    params: list[Tensor],
    gids: list[int],
    groups: list[dict[str, Any]],
    matrix: set[int],
    payload: dict[int, Tensor],
    state: Any,
) -> StepWork:
    """The lists of a step (every active parameter already has its state).

    Args:
        active: Active parameters, sorted.
        params: Every parameter.
        gids: Every parameter's param group.
        groups: The param groups.
        matrix: Parameters updated by the matrix algorithm (non-empty ones).
        payload: Per matrix parameter with local data, its payload view.
        state: The optimizer's state mapping.
    """
    steps: list[Tensor] = []
    works: dict[int, GroupWork] = {}
    for i in active:
        p, gid = params[i], gids[i]
        steps.append(state[p]["step"])
        is_adamw = groups[gid]["algorithm"] == ADAMW
        if not is_adamw and i not in matrix:
            continue  # an empty matrix: only its step counter moves
        work = works.get(gid)
        if work is None:
            work = works[gid] = GroupWork(gid, is_adamw, [], [])
        if i in payload:
            work.prepared.append(len(work.idxs))
            work.payloads.append(payload[i])
        work.idxs.append(i)
        work.params.append(p)
    return StepWork(steps, [works[g] for g in sorted(works)])
