"""Local-search refinement of an owner assignment: moves and swaps off the most-loaded rank."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["objective", "refine_owners"]

#: Relative margin under which a change of load counts as no change (guards float noise).
REL_TOL = 1e-12
#: Most (class of the heavy rank, partner rank) pairs examined in one iteration.
ITERATION_BUDGET = 4096
#: Most such pairs examined over a whole refinement (bounds its running time).
TOTAL_BUDGET = 1_000_000
#: Most classes examined on each side of the ideal swap cost before giving up on eligibility.
NEIGHBOURS = 8


def objective(costs: Sequence[float], owners: Sequence[int], num_ranks: int) -> tuple[float, int]:
    """The quantity refinement lowers: (max load, number of ranks at that load).

    Loads are summed in item order, so the value is reproducible bit for bit.
    """
    loads = [0.0] * num_ranks
    for cost, rank in zip(costs, owners, strict=True):
        loads[rank] += cost
    return top_of(loads)


def top_of(loads: Sequence[float]) -> tuple[float, int]:
    """(max load, number of ranks at that load) of per-rank ``loads``."""
    top = max(loads)
    return top, sum(1 for load in loads if load == top)


def refine_owners(
    costs: Sequence[float],
    eligible: Sequence[tuple[int, ...] | None],
    owners: Sequence[int],
    num_ranks: int,
    *,
    max_iterations: int | None = None,
    holders: Sequence[tuple[int, ...] | None] = (),
) -> list[int]:
    """Improve an assignment by moving or swapping matrices off the most-loaded rank.

    Each iteration looks at the most-loaded rank ``M`` (lowest index on ties) and considers,
    for partner ranks ``r`` in increasing load,

    * moving one of ``M``'s matrices to ``r``, and
    * swapping one of ``M``'s matrices with a cheaper matrix of ``r``,

    keeping only changes after which both ``M`` and ``r`` sit strictly below the old maximum
    (so the pair (max load, ranks at the max) strictly decreases) and that respect
    eligibility. It applies the change with the lowest resulting ``max(load[M], load[r])``;
    as that value is at least ``(load[M] + load[r]) / 2``, the scan over partners stops as
    soon as no later partner can do better. It stops when ``M`` has no improving change or
    after ``max_iterations`` changes.

    Matrices with the same cost and eligibility are interchangeable, so each rank's matrices
    are grouped into such classes, kept sorted by cost: a swap partner for a class of ``M`` is
    found by bisection around the cost difference that would even out the two ranks. The scan
    and the whole refinement are bounded by work budgets (``ITERATION_BUDGET``,
    ``TOTAL_BUDGET``) counted in examined pairs, not in time, so the result stays
    deterministic.

    Args:
        costs: Per-matrix cost, in the canonical processing order.
        eligible: Per-matrix eligible ranks (``None`` for all), aligned with ``costs``.
        owners: The starting owner of each matrix.
        num_ranks: Number of ranks.
        max_iterations: Bound on applied changes; defaults to ``2 * (len(costs) + num_ranks)``.
        holders: Per matrix, the ranks that already hold it whole (``None``: none), aligned
            with ``costs``. Of a class, a rank gives away a matrix it does not hold first,
            so that one left where it lies stays there (it moves no bytes there).

    Returns:
        The refined owners, aligned with ``costs``.
    """
    owners = list(owners)
    if not costs or num_ranks == 1:
        return owners
    limit = 2 * (len(costs) + num_ranks) if max_iterations is None else max_iterations
    state = _State(costs, eligible, owners, num_ranks, holders)
    for _ in range(limit):
        if state.work >= TOTAL_BUDGET:
            break
        change = state.best_change()
        if change is None:
            break
        state.apply(*change)
    return state.owners


def _first(entry: tuple[float, int]) -> float:
    return entry[0]


class _State:
    """Loads, per-rank classes and the sorted (load, rank) list of a refinement in progress."""

    def __init__(
        self,
        costs: Sequence[float],
        eligible: Sequence[tuple[int, ...] | None],
        owners: list[int],
        num_ranks: int,
        holders: Sequence[tuple[int, ...] | None] = (),
    ) -> None:
        class_of: dict[tuple[float, tuple[int, ...] | None], int] = {}
        self.holders = holders if any(h is not None for h in holders) else ()
        self.cost: list[float] = []
        self.elig: list[frozenset[int] | None] = []
        self.owners = owners
        self.loads = [0.0] * num_ranks
        self.items: list[dict[int, list[int]]] = [{} for _ in range(num_ranks)]
        for i, (cost, elig) in enumerate(zip(costs, eligible, strict=True)):
            cid = class_of.setdefault((cost, elig), len(self.cost))
            if cid == len(self.cost):
                self.cost.append(cost)
                self.elig.append(None if elig is None else frozenset(elig))
            self.loads[owners[i]] += cost
            self.items[owners[i]].setdefault(cid, []).append(i)
        if holders:  # a rank's own matrices first: the last ones are given away first
            for rank, held in enumerate(self.items):
                for members in held.values():
                    own = [i for i in members if self._holds(rank, i)]
                    members[:] = own + [i for i in members if not self._holds(rank, i)]
        # per rank: (cost, class) of every class it holds, sorted
        self.classes = [sorted((self.cost[c], c) for c in held) for held in self.items]
        self.keys = sorted((load, rank) for rank, load in enumerate(self.loads))
        self.work = 0

    def best_change(self) -> tuple[int, int, int, int] | None:
        """The best improving (heavy rank, class a, class b or -1, partner rank), if any."""
        keys = self.keys
        top = keys[-1][0]
        heavy = keys[bisect.bisect_left(keys, (top, -1))][1]
        tol = top * REL_TOL
        mine = self.classes[heavy]
        best: tuple[float, int, int, int] | None = None
        budget = ITERATION_BUDGET
        for load, rank in keys:
            if rank == heavy:
                continue
            gap = top - load
            if gap <= 2 * tol or budget <= 0:
                break
            if best is not None and (top + load) / 2 >= best[0]:
                break
            budget -= len(mine)
            self.work += len(mine)
            theirs = self.classes[rank]
            for cost_a, a in mine:
                elig_a = self.elig[a]
                if elig_a is not None and rank not in elig_a:
                    continue
                if tol < cost_a < gap - tol:
                    cand = (max(top - cost_a, load + cost_a), a, -1, rank)
                    best = cand if best is None or cand < best else best
                for b in self._partners(theirs, cost_a, gap, tol, heavy):
                    delta = cost_a - self.cost[b]
                    cand = (max(top - delta, load + delta), a, b, rank)
                    best = cand if best is None or cand < best else best
        if best is None or best[0] >= top - tol:
            return None
        return heavy, best[1], best[2], best[3]

    def _partners(
        self, theirs: list[tuple[float, int]], cost_a: float, gap: float, tol: float, heavy: int
    ) -> list[int]:
        """Classes b with ``tol < cost_a - cost_b < gap - tol`` nearest to an even split.

        Returns the nearest eligible class on each side of ``cost_a - gap / 2``.
        """
        lo, hi = cost_a - gap + tol, cost_a - tol
        pos = bisect.bisect_left(theirs, cost_a - gap / 2, key=_first)
        found = []
        for step, stop in ((-1, -1), (1, len(theirs))):
            j = pos - 1 if step < 0 else pos
            for _ in range(NEIGHBOURS):
                if j == stop or not lo < theirs[j][0] < hi:
                    break
                elig_b = self.elig[theirs[j][1]]
                if elig_b is None or heavy in elig_b:
                    found.append(theirs[j][1])
                    break
                j += step
        return found

    def apply(self, heavy: int, a: int, b: int, rank: int) -> None:
        """Move one matrix of class ``a`` from ``heavy`` to ``rank`` (and one of ``b`` back)."""
        delta = self._move(a, heavy, rank)
        if b >= 0:
            delta -= self._move(b, rank, heavy)
        self._set_load(heavy, self.loads[heavy] - delta)
        self._set_load(rank, self.loads[rank] + delta)

    def _move(self, cid: int, src: int, dst: int) -> float:
        held = self.items[src][cid]
        item = held.pop()
        if not held:
            del self.items[src][cid]
            self.classes[src].remove((self.cost[cid], cid))
        if cid not in self.items[dst]:
            self.items[dst][cid] = []
            bisect.insort(self.classes[dst], (self.cost[cid], cid))
        if self._holds(dst, item):
            self.items[dst][cid].insert(0, item)
        else:
            self.items[dst][cid].append(item)
        self.owners[item] = dst
        return self.cost[cid]

    def _holds(self, rank: int, item: int) -> bool:
        """Whether ``rank`` already holds matrix ``item`` whole."""
        held = self.holders[item] if self.holders else None
        return held is not None and rank in held

    def _set_load(self, rank: int, value: float) -> None:
        del self.keys[bisect.bisect_left(self.keys, (self.loads[rank], rank))]
        self.loads[rank] = value
        bisect.insort(self.keys, (value, rank))
