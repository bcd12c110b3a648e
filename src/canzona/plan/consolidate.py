"""Owners priced per call: same-class matrices gathered on fewer owners, then rebalanced."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["CallCosts", "consolidate_owners", "rank_loads"]

#: Relative margin under which a change of load counts as no change (guards float noise).
REL_TOL = 1e-12
#: Most options examined over a whole consolidation (bounds its time, deterministically).
TOTAL_BUDGET = 50_000

_Chunk = tuple[int, Hashable]
#: (makespan, ranks at the makespan, calls) after an option: what consolidation lowers
_Potential = tuple[float, int, int]


@dataclass(frozen=True, slots=True)
class CallCosts:
    """What one rank's stacked calls cost, per matrix (aligned sequences).

    Attributes:
        costs: Each matrix's own cost (without the fixed part of its call).
        fixed: The fixed part of one call on the matrix's class (equal within a class).
        classes: Each matrix's class: what the runtime stacks into one call (param group,
            shape, payload size).
        stack: How many matrices of the class fit in one call (at least 1): a micro-group
            holds at most so many of them per rank.
        base: Per rank, a load that comes with none of the matrices (e.g. what held
            matrices owned off their holders cost it to move; empty: none).
    """

    costs: Sequence[float]
    fixed: Sequence[float]
    classes: Sequence[Hashable]
    stack: Sequence[int]
    base: Sequence[float] = ()

    def calls(self, cls_item: int, count: int) -> int:
        """Calls that ``count`` matrices of item ``cls_item``'s class take on one rank."""
        s = self.stack[cls_item]
        return (count + s - 1) // s


def rank_loads(calls: CallCosts, owners: Sequence[int], num_ranks: int) -> list[float]:
    """Per rank, its matrices' own costs plus the fixed parts of the calls they take."""
    loads = list(calls.base) if calls.base else [0.0] * num_ranks
    counts: dict[tuple[int, Hashable], tuple[int, int]] = {}
    for i, (cost, cls, rank) in enumerate(zip(calls.costs, calls.classes, owners, strict=True)):
        loads[rank] += cost
        first, k = counts.get((rank, cls), (i, 0))
        counts[(rank, cls)] = (first, k + 1)
    for (rank, _), (first, k) in counts.items():
        loads[rank] += calls.fixed[first] * calls.calls(first, k)
    return loads


class _State:
    """Loads and chunks (the matrices of one class on one rank) of an assignment."""

    def __init__(
        self,
        calls: CallCosts,
        movable: Sequence[tuple[int, ...] | None],
        owners: list[int],
        num_ranks: int,
    ) -> None:
        self.owners = owners
        self.movable = movable
        self.members: dict[_Chunk, list[int]] = {}
        for i, (cls, rank) in enumerate(zip(calls.classes, owners, strict=True)):
            self.members.setdefault((rank, cls), []).append(i)
        #: chunks in a deterministic order, and per rank; whether a chunk may move at all
        self.keys = sorted(self.members, key=_order)
        self.by_rank: dict[int, list[_Chunk]] = {}
        for key in self.keys:
            self.by_rank.setdefault(key[0], []).append(key)
        self.free = {k: all(movable[i] != () for i in v) for k, v in self.members.items()}
        self.weight = {k: sum(calls.costs[i] for i in v) for k, v in self.members.items()}
        self.loads = rank_loads(calls, owners, num_ranks)
        self.ascending = sorted(self.loads)
        # the three most loaded ranks: an option changes two, so one of them is unchanged
        self.leaders = sorted(range(num_ranks), key=lambda r: (-self.loads[r], r))[:3]
        self.calls = sum(calls.calls(items[0], len(items)) for items in self.members.values())
        top = self.ascending[-1]
        self.potential: _Potential = (top, self._at(top, {}), self.calls)

    def _at(self, top: float, changed: dict[int, float]) -> int:
        """Ranks at ``top`` (within the margin) once ``changed`` ranks take new loads."""
        threshold = top * (1 - REL_TOL)
        count = len(self.ascending) - bisect.bisect_left(self.ascending, threshold)
        for rank, load in changed.items():
            count += (load >= threshold) - (self.loads[rank] >= threshold)
        return count

    def after(self, changed: dict[int, float], calls: int) -> _Potential:
        """The potential once ``changed`` ranks take new loads and ``calls`` calls are left."""
        top = max(changed.values())
        unchanged = [r for r in self.leaders if r not in changed]
        if unchanged:
            top = max(top, self.loads[unchanged[0]])
        return top, self._at(top, changed), calls

    def move(self, key: _Chunk, items: Sequence[int], rank: int) -> None:
        """Give ``items`` (all or part of chunk ``key``) to ``rank``."""
        going = set(items)
        left = [i for i in self.members[key] if i not in going]
        if left:
            self.members[key] = left
        else:
            del self.members[key]
        for i in items:
            self.owners[i] = rank
        self.members.setdefault((rank, key[1]), []).extend(items)


def _better(new: _Potential, old: _Potential) -> bool:
    """Whether ``new`` is strictly lower than ``old`` (makespans equal within the margin)."""
    if new[0] < old[0] * (1 - REL_TOL):
        return True
    if new[0] > old[0] * (1 + REL_TOL):
        return False
    return new[1:] < old[1:]


#: (new loads of the two ranks, change in calls, matrices moved, partner chunk or None)
_Option = tuple[dict[int, float], int, Sequence[int], "_Chunk | None"]


def _options(state: _State, calls: CallCosts, key: _Chunk, r2: int, top: float) -> list[_Option]:
    """Moves of chunk ``key`` (or one of its matrices) to ``r2``, and swaps with its chunks."""
    r1, a = key
    loads, members, costs = state.loads, state.members, calls.costs
    items = members[key]
    first = items[0]
    fa = calls.fixed[first]
    k1 = len(items)
    k2 = len(members.get((r2, a), ()))
    weight = state.weight[key]
    join = calls.calls(first, k1 + k2) - calls.calls(first, k2)  # calls the chunk adds on r2
    leave = calls.calls(first, k1)
    out: list[_Option] = []
    if k2:  # the chunk joins the class already on r2
        out.append(
            ({r1: loads[r1] - weight - fa * leave, r2: loads[r2] + weight + fa * join},
             join - leave, items, None)
        )  # fmt: skip
    for other in state.by_rank.get(r2, ()):
        b = other[1]
        theirs = members[other]
        if b == a or not state.free[other] or not _allowed(state.movable, theirs, r1):
            continue
        fb, kb = calls.fixed[theirs[0]], len(theirs)
        kb1 = len(members.get((r1, b), ()))
        b_join = calls.calls(theirs[0], kb1 + kb) - calls.calls(theirs[0], kb1)
        b_leave = calls.calls(theirs[0], kb)
        wb = state.weight[other]
        new1 = loads[r1] - weight - fa * leave + wb + fb * b_join
        new2 = loads[r2] - wb - fb * b_leave + weight + fa * join
        out.append(({r1: new1, r2: new2}, join - leave + b_join - b_leave, items, other))
    if loads[r1] >= top * (1 - REL_TOL):  # balance: one matrix off the top
        drop = leave - calls.calls(first, k1 - 1)
        add = calls.calls(first, k2 + 1) - calls.calls(first, k2)
        for i in sorted({min(items, key=costs.__getitem__), first}):
            changed = {r1: loads[r1] - costs[i] - fa * drop, r2: loads[r2] + costs[i] + fa * add}
            out.append((changed, add - drop, [i], None))
    return out


def consolidate_owners(
    calls: CallCosts,
    movable: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
) -> list[int]:
    """Lower the makespan of an assignment whose calls have a fixed part, then its calls.

    A rank's load is its matrices' own costs plus one fixed part per call: the runtime
    stacks the matrices of a class into one call per micro-group, at most ``stack`` of them.
    A *chunk* is all the matrices of one class on one rank. Options, for every chunk
    ``(r1, a)`` and every other rank ``r2``:

    * move the chunk to ``r2`` when ``r2`` holds class ``a`` already;
    * swap it with a chunk ``(r2, b)``;
    * move one matrix of a chunk on a rank at the makespan to ``r2`` (balance).

    Each round applies the option with the lowest potential (makespan, ranks at the
    makespan, calls), provided it is strictly lower than the current one (makespans equal
    within ``REL_TOL``): the makespan never rises and the search cannot cycle. It stops
    when no option is lower or after ``TOTAL_BUDGET`` examined options (counted, not timed:
    the result is deterministic).

    Args:
        calls: Own costs, fixed parts, classes and stack sizes of the matrices.
        movable: Per matrix, the ranks it may go to (None: any; ``()``: it stays where it
            is, as a matrix already on a rank that holds it whole does).
        owners: The starting assignment.
        num_ranks: Number of ranks.

    Returns:
        The new owners (a new list; ``owners`` is not modified).
    """
    result = list(owners)
    if not any(f > 0 for f in calls.fixed):
        return result
    budget = TOTAL_BUDGET
    while budget > 0:
        state = _State(calls, movable, result, num_ranks)
        best: tuple[_Potential, _Chunk, Sequence[int], _Chunk | None, int] | None = None
        for key in state.keys:
            if not state.free[key]:
                continue
            for r2 in range(num_ranks):
                if r2 == key[0] or not _allowed(movable, state.members[key], r2):
                    continue
                for changed, delta, moved, other in _options(
                    state, calls, key, r2, state.potential[0]
                ):
                    budget -= 1
                    potential = state.after(changed, state.calls + delta)
                    if _better(potential, state.potential) and (
                        best is None or _better(potential, best[0])
                    ):
                        best = (potential, key, moved, other, r2)
            if budget <= 0:
                break
        if best is None:
            break
        _, key, moved, other, r2 = best
        state.move(key, moved, r2)
        if other is not None:
            state.move(other, list(state.members[other]), key[0])
        result = state.owners
    return result


def _allowed(movable: Sequence[tuple[int, ...] | None], items: Sequence[int], rank: int) -> bool:
    """Whether every one of ``items`` may go to ``rank``."""
    for i in items:
        allowed = movable[i]
        if allowed is not None and rank not in allowed:
            return False
    return True


def _order(key: _Chunk) -> tuple[int, str]:
    """A deterministic order of chunks: rank, then the class's text."""
    return key[0], repr(key[1])
