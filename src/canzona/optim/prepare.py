"""The per-step lists of a step's element-wise work, built once and reused while nothing changes."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
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


class SeenState:
    """The ``optimizer.state`` entries of a step's active parameters, as its lists hold them.

    A step reuses its lists (which hold the state tensors) while the entries are these
    very dicts holding these very values; a user who replaces or clears an entry, or a
    tensor in it, between steps (as torch.optim allows) makes the next step build them
    again from ``optimizer.state``.

    Args:
        params: The step's active parameters.
        state: The optimizer's state mapping.
    """

    __slots__ = ("dicts", "entries", "params", "values")

    def __init__(self, params: list[Tensor], state: Mapping[Tensor, dict[str, Any]]) -> None:
        self.params = params
        self.dicts = [state[p] for p in params]
        self.entries = [dict(d) for d in self.dicts]  # what each entry held
        self.values = list(chain.from_iterable(map(dict.values, self.dicts)))

    def unchanged(self, state: Mapping[Tensor, dict[str, Any]]) -> bool:
        """Whether every entry and every value in it is still the one seen (by identity)."""
        dicts = list(map(state.get, self.params))
        if not all(map(operator.is_, dicts, self.dicts)):
            return False
        values = list(chain.from_iterable(map(dict.values, dicts)))  # type: ignore[arg-type]
        return len(values) == len(self.values) and all(map(operator.is_, values, self.values))

    def check_edits(self, state: Mapping[Tensor, dict[str, Any]], labels: Sequence[str]) -> None:
        """Raise ``ValueError`` for an entry edited into one the step cannot use.

        A cleared entry (no ``"step"``) starts afresh; otherwise every key must stay, and
        a replaced tensor must match the one it replaces (type, shape, dtype, device and,
        for a DTensor, mesh and placements). ``labels``: each active parameter's name.
        """
        for p, old, label in zip(self.params, self.entries, labels, strict=True):
            new = state.get(p)
            if new is None or "step" not in new:
                continue
            if new.keys() != old.keys():
                missing = sorted(old.keys() - new.keys())
                what = (
                    f"lost key {missing[0]!r}"
                    if missing
                    else (f"gained key {sorted(new.keys() - old.keys())[0]!r}")
                )
                raise ValueError(
                    f"the optimizer.state entry of parameter {label!r} {what} since the last "
                    "step: replace its tensors, or clear the whole entry to start afresh"
                )
            for key, value in new.items():
                if value is not old[key]:
                    _check_like(value, old[key], key, label)


def _describe(t: Tensor) -> str:
    kind = type(t).__name__
    placements = getattr(t, "placements", None)
    extra = f", {placements} on {getattr(t, 'device_mesh', None)}" if placements else ""
    return f"{kind} {tuple(t.shape)} {t.dtype} on {t.device}{extra}"


def _check_like(value: Any, old: Tensor, key: str, label: str) -> None:
    """``value`` may replace the state tensor ``old``: same kind, shape, dtype, device, layout."""
    same = (
        isinstance(value, Tensor)
        and type(value) is type(old)
        and value.shape == old.shape
        and value.dtype == old.dtype
        and value.device == old.device
        and getattr(value, "placements", None) == getattr(old, "placements", None)
        and getattr(value, "device_mesh", None) == getattr(old, "device_mesh", None)
    )
    if same:
        return
    got = _describe(value) if isinstance(value, Tensor) else f"a {type(value).__name__}"
    hint = (
        " (owner-held state lives on its owner rank: load_state_dict sets it)"
        if old.numel() == 0 and key != "step"
        else ""
    )
    raise ValueError(
        f"state {key!r} of parameter {label!r} was replaced by {got}; a replacement must "
        f"match the tensor it replaces, a {_describe(old)}{hint}"
    )


@dataclass(slots=True)
class StepWork:
    """Every active parameter's step counter, and the work of each param group, in order.

    The counters live in one tensor, ``steps``: each parameter's ``state["step"]`` is a
    0-dim view of it (see :func:`link_steps`), so a step advances them all with one op.
    ``seen`` holds the state entries the lists were built from; ``covered``, gradient
    codes of a step whose parameters with a gradient are all among them.
    """

    steps: Tensor
    groups: list[GroupWork]
    seen: SeenState | None = None
    covered: list[int] | None = None


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
    """One float32 tensor on the host of the states' step counters.

    Each ``state["step"]`` becomes a 0-dim view of it: the same value, still a tensor (as
    torch.optim keeps it), and one ``add_`` advances every counter. A counter loaded onto a
    device (``torch.load(..., map_location="cuda")``) comes back to the host with the others.
    """
    if not states:
        return torch.zeros(0)
    flat = torch.stack([s["step"].detach().to("cpu", torch.float32).reshape(()) for s in states])
    for k, s in enumerate(states):
        s["step"] = flat[k]
    return flat
