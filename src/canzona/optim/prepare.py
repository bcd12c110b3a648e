"""The per-step lists of a step's element-wise work, built once and reused while nothing changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
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
    """Every active parameter's step counter, and the work of each param group, in order.

    The counters live in one tensor, ``steps``: each parameter's ``state["step"]`` is a
    0-dim view of it (see :func:`link_steps`), so a step advances them all with one op.
    """

    steps: Tensor
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
    steps: list[Any] = []
    works: dict[int, GroupWork] = {}
    for i in active:
        p, gid = params[i], gids[i]
        steps.append(state[p])
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
    return StepWork(link_steps(steps), [works[g] for g in sorted(works)])


def link_steps(states: list[Any]) -> Tensor:
    """One float32 tensor of the states' step counters.

    Each ``state["step"]`` becomes a 0-dim view of it: the same value, still a tensor (as
    torch.optim keeps it), and one ``add_`` advances every counter.
    """
    if not states:
        return torch.zeros(0)
    flat = torch.stack([s["step"].detach().to(torch.float32).reshape(()) for s in states])
    for k, s in enumerate(states):
        s["step"] = flat[k]
    return flat
