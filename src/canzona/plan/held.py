"""Held matrices owned off their holders: what the move costs, and moves back that pay."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from canzona.plan.cost import CostModel, GroupedCost
from canzona.plan.measured import MeasuredCost
from canzona.plan.refine import REL_TOL, top_of
from canzona.plan.spec import MatrixSpec

__all__ = ["held_loads", "held_objective", "move_seconds", "settle_held"]

#: Most rank loads examined over a whole settling (bounds its time, deterministically).
TOTAL_BUDGET = 1_000_000


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
    return top_of(held_loads(costs, moves, holders, owners, num_ranks))


def settle_held(
    costs: Sequence[float],
    moves: Sequence[float],
    holders: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
    *,
    budget: int = TOTAL_BUDGET,
) -> list[int]:
    """Give held matrices back to their holders where their moves do not pay.

    The refinement balances costs without the moves' price: it may own a held matrix off
    its holders for a gain smaller than what moving it costs both ranks. In rounds, every
    held matrix off its holders (costliest first, then by position) goes back to its least
    loaded holder (lowest rank on ties) when that leaves the objective of
    :func:`held_objective` no higher (ties prefer the holder), until a round returns none
    or ``budget`` rank loads were examined (each candidate its owner and holders: counted,
    not timed, so the result is deterministic).

    Returns:
        The new owners (a new list; ``owners`` is not modified).
    """
    result = list(owners)
    if not any(moves):
        return result
    board = _Board(held_loads(costs, moves, holders, result, num_ranks))
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
            budget -= 1 + len(held)
            if budget < 0:
                return result
            loads = board.loads
            home = min(held, key=lambda r: (loads[r], r))
            # the same operations, in the same order, as held_loads' sums would change
            changed = {result[i]: loads[result[i]] - (costs[i] + moves[i])}
            for h in held:
                changed[h] = loads[h] - moves[i]
            changed[home] += costs[i]
            if board.no_higher(changed):
                board.take(changed)
                result[i] = home
            else:
                kept.append(i)
        if len(kept) == len(away):
            break
        away = kept
    return result


class _Board:
    """Per-rank loads, also kept sorted: the objective after a few ranks change, in O(changes)."""

    def __init__(self, loads: list[float]) -> None:
        self.loads = loads
        self.ordered = sorted((load, rank) for rank, load in enumerate(loads))

    def _after(self, changed: dict[int, float]) -> tuple[float, int]:
        """(max, ranks within the margin of it) once ``changed`` ranks take new loads."""
        top = max(changed.values(), default=float("-inf"))
        for load, rank in reversed(self.ordered):  # the most loaded unchanged rank
            if rank not in changed:
                top = max(top, load)
                break
        threshold = top * (1 - REL_TOL)
        count = len(self.ordered) - bisect.bisect_left(self.ordered, (threshold, -1))
        for rank, load in changed.items():
            count += (load >= threshold) - (self.loads[rank] >= threshold)
        return top, count

    def no_higher(self, changed: dict[int, float]) -> bool:
        """Whether the objective with ``changed`` is no higher than now (within the margin)."""
        top_new, at_new = self._after(changed)
        top_old, at_old = self._after({})
        if top_new > top_old * (1 + REL_TOL):
            return False
        if top_new < top_old * (1 - REL_TOL):
            return True
        return at_new <= at_old

    def take(self, changed: dict[int, float]) -> None:
        """Let ``changed`` ranks take their new loads."""
        for rank, load in changed.items():
            del self.ordered[bisect.bisect_left(self.ordered, (self.loads[rank], rank))]
            bisect.insort(self.ordered, (load, rank))
            self.loads[rank] = load
