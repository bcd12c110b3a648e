"""Held matrices owned off their holders: what the move costs, and moves back that pay."""

from __future__ import annotations

from collections.abc import Sequence

from canzona.plan.cost import CostModel, GroupedCost
from canzona.plan.measured import MeasuredCost
from canzona.plan.spec import MatrixSpec

__all__ = ["held_loads", "held_objective", "move_seconds", "settle_held"]

#: Relative margin under which a change of load counts as no change (guards float noise).
REL_TOL = 1e-12


def move_seconds(model: CostModel, spec: MatrixSpec) -> float:
    """Seconds that owning a held matrix off its holders adds to its owner and to each holder.

    The owner receives the whole payload and sends the whole direction back, and a holder
    sends and receives as much: at a measured transfer rate (bytes each way per second, sent
    and received at once) the payload's transfer time on each. 0 for a model that measured
    no rate, and for a matrix no rank holds whole.
    """
    if isinstance(model, GroupedCost):
        model = model.model_of(spec)
    if not isinstance(model, MeasuredCost) or spec.holders is None:
        return 0.0
    return model.move_seconds(spec)


def held_loads(
    costs: Sequence[float],
    moves: Sequence[float],
    holders: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
) -> list[float]:
    """Per rank, its matrices' costs plus ``moves[i]`` for every held matrix ``i`` off its holders.

    The move's cost falls on the owner and on each holder. Summed in item order, so the
    value is reproducible bit for bit.
    """
    loads = [0.0] * num_ranks
    for cost, move, held, rank in zip(costs, moves, holders, owners, strict=True):
        loads[rank] += cost
        if move and held is not None and rank not in held:
            loads[rank] += move
            for h in held:
                loads[h] += move
    return loads


def held_objective(
    costs: Sequence[float],
    moves: Sequence[float],
    holders: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
) -> tuple[float, int]:
    """(max load, ranks at that load) of :func:`held_loads`: what the planner lowers."""
    loads = held_loads(costs, moves, holders, owners, num_ranks)
    top = max(loads)
    return top, sum(1 for load in loads if load == top)


def settle_held(
    costs: Sequence[float],
    moves: Sequence[float],
    holders: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
) -> list[int]:
    """Give held matrices back to their holders where their moves do not pay.

    The refinement balances costs without the moves' price: it may own a held matrix off
    its holders for a gain smaller than what moving it costs both ranks. In rounds, every
    held matrix off its holders (costliest first, then by position) goes back to its least
    loaded holder (lowest rank on ties) when that leaves the objective of
    :func:`held_objective` no higher (ties prefer the holder), until a round returns none.

    Returns:
        The new owners (a new list; ``owners`` is not modified).
    """
    result = list(owners)
    if not any(moves):
        return result
    loads = held_loads(costs, moves, holders, result, num_ranks)
    away = sorted(
        (
            i
            for i, (move, held, rank) in enumerate(zip(moves, holders, result, strict=True))
            if move and held is not None and rank not in held
        ),
        key=lambda i: (-(costs[i] + moves[i]), i),
    )
    while away:
        kept = []
        for i in away:
            held = holders[i]
            assert held is not None
            home = min(held, key=lambda r: (loads[r], r))
            new = list(loads)
            new[result[i]] -= costs[i] + moves[i]
            for h in held:
                new[h] -= moves[i]
            new[home] += costs[i]
            if _no_higher(new, loads):
                loads, result[i] = new, home
            else:
                kept.append(i)
        if len(kept) == len(away):
            break
        away = kept
    return result


def _no_higher(new: Sequence[float], old: Sequence[float]) -> bool:
    """Whether ``new``'s (max, ranks at the max) is no higher than ``old``'s (within margin)."""
    top_new, top_old = max(new), max(old)
    if top_new > top_old * (1 + REL_TOL):
        return False
    if top_new < top_old * (1 - REL_TOL):
        return True
    at_new = sum(1 for x in new if x >= top_new * (1 - REL_TOL))
    at_old = sum(1 for x in old if x >= top_old * (1 - REL_TOL))
    return at_new <= at_old
