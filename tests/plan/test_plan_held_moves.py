"""A held matrix owned off its holders costs its move to the owner and to each holder."""

from __future__ import annotations

import random

import pytest

from canzona.plan import MatrixSpec, MuonCost, assign_owners
from canzona.plan.consolidate import CallCosts, rank_loads
from canzona.plan.held import held_loads, move_seconds, settle_held
from canzona.plan.measured import MeasuredCost

PAYLOAD = 64 * 64 * 4  # one 64 x 64 block's fp32 payload


def _cost(move_ms: float) -> MeasuredCost:
    """1 ms of math per 64 x 64 block; its payload takes ``move_ms`` to move (0: not counted)."""
    rate = PAYLOAD / (move_ms * 1e-3) if move_ms else 0.0
    return MeasuredCost(base=MuonCost(), table=(((64, 64), 1e-3),), bytes_per_s=rate)


@pytest.mark.parametrize(("move_ms", "moved"), [(0.0, 1), (0.5, 1), (1.5, 0)])
def test_a_held_block_moves_only_where_its_move_pays(move_ms: float, moved: int) -> None:
    """Rank 0 holds three blocks of 1 ms each, rank 1 none. Moving one leaves 2 ms + the
    move on rank 0 and 1 ms + the move on rank 1: better than 3 ms while the move costs
    under 1 ms. Catches: a move priced at nothing (it moved at 1.5 ms, for a 3.5 ms
    makespan where keeping every block gives 3), or on the new owner alone."""
    specs = [MatrixSpec(f"h{i}", (64, 64), holders=(0,)) for i in range(3)]
    a = assign_owners(specs, 2, strategy="canzona", optimizer=_cost(move_ms))
    assert list(a.owner.values()).count(1) == moved
    assert a.comm_bytes == (0, moved * PAYLOAD)


def test_the_refinement_s_unpaid_move_goes_back_and_a_free_matrix_balances_instead() -> None:
    """m0 (3 ms, held by rank 0), m1 (2 ms, held by rank 1), m2 (4 ms, held by none).

    The greedy puts m2 and m0 on rank 0 (7 ms against 2). Unpriced, the refinement's best
    move takes m1 to rank 0 (5 against 4 ms), whose 64 KiB payload takes 6 ms each way at
    the measured rate: 11 against 10 ms. Given back, rank 0 is at 7 ms again, where moving
    m2 (no holder: its transfer is the same for every owner) gives 3 against 6. Catches: no
    settling (the refinement's result, dear with its move, was dropped for the greedy's 7
    ms), and a move priced at nothing (m1 moved, 65536 bytes each way)."""
    specs = [
        MatrixSpec("m0", (64, 64), holders=(0,)),
        MatrixSpec("m1", (128, 128), holders=(1,)),
        MatrixSpec("m2", (64, 128)),
    ]
    table = (((64, 64), 3e-3), ((64, 128), 4e-3), ((128, 128), 2e-3))
    cost = MeasuredCost(base=MuonCost(), table=table, bytes_per_s=16384 / 1.5e-3).for_world(2)
    assert cost.move_seconds(specs[1]) == pytest.approx(6e-3)
    a = assign_owners(specs, 2, optimizer=cost)
    assert dict(a.owner) == {"m0": 0, "m1": 1, "m2": 1}
    assert a.loads == pytest.approx((3e-3, 6e-3)) and a.comm_bytes == (0, 64 * 128 * 4)


def test_the_move_costs_the_owner_and_every_holder() -> None:
    spec = MatrixSpec("r", (64, 64), holders=(0, 1))
    assert move_seconds(_cost(2.0), spec) == pytest.approx(2e-3)
    assert move_seconds(_cost(2.0), MatrixSpec("f", (64, 64))) == 0.0  # no rank holds it
    assert move_seconds(MuonCost(), spec) == 0.0  # FLOPs: no time to price it in
    holders = [(0, 1), None]
    assert held_loads([5.0, 1.0], [2.0, 0.0], holders, [2, 2], 3) == [2.0, 2.0, 8.0]
    assert held_loads([5.0, 1.0], [2.0, 0.0], holders, [1, 2], 3) == [0.0, 5.0, 1.0]


def test_settling_returns_a_block_to_its_least_loaded_holder_on_ties() -> None:
    """A replicated block (holders 0 and 1) owned on rank 2: back on rank 0 (lowest on the
    tie) the makespan stays 4 with one rank fewer at it; a block whose move pays stays."""
    costs, moves = [1.0, 3.0, 3.0], [1.0, 0.0, 0.0]
    holders = [(0, 1), None, None]
    assert settle_held(costs, moves, holders, [2, 0, 1], 3) == [0, 0, 1]
    # back on its holder, rank 0 would carry 11 where the move leaves it 10: it stays
    assert settle_held([2.0, 9.0], [1.0, 0.0], [(0,), None], [1, 0], 2) == [1, 0]
    # a move that lowers nothing goes back (the holder pays it too)
    assert settle_held([1.0, 9.0], [1.0, 0.0], [(0,), None], [1, 0], 2) == [0, 0]
    assert settle_held(costs, [0.0] * 3, holders, [2, 0, 1], 3) == [2, 0, 1]  # nothing priced


def test_settling_stops_at_its_work_budget() -> None:
    """Catches: a settling with no bound on its work. Two blocks held on rank 0, owned on
    rank 1 where neither move pays; each candidate costs 2 of the budget (its owner and its
    holder): 2 settles the costlier one only, 1 nothing, and the result is deterministic."""
    costs, moves, holders = [2.0, 1.0, 9.0], [1.0, 1.0, 0.0], [(0,), (0,), None]
    owners = [1, 1, 1]
    assert settle_held(costs, moves, holders, owners, 3) == [0, 0, 1]
    assert settle_held(costs, moves, holders, owners, 3, budget=2) == [0, 1, 1]
    assert settle_held(costs, moves, holders, owners, 3, budget=1) == [1, 1, 1]


def test_settling_matches_recomputing_every_rank_s_load() -> None:
    """Catches: the incremental objective (sorted loads, only the changed ranks recounted)
    disagreeing with the objective recomputed from every rank's load after each return."""
    rng = random.Random(0)
    for _ in range(300):
        num_ranks, n = rng.choice([2, 3, 5, 8]), rng.randint(1, 30)
        costs = [rng.choice([1.0, 0.5, rng.random()]) for _ in range(n)]
        holders = [
            tuple(sorted(rng.sample(range(num_ranks), rng.randint(1, 2))))
            if rng.random() < 0.7
            else None
            for _ in range(n)
        ]
        moves = [rng.choice([0.1, 0.3, rng.random()]) if h else 0.0 for h in holders]
        owners = [rng.randrange(num_ranks) for _ in range(n)]
        assert settle_held(costs, moves, holders, owners, num_ranks) == _settle_by_recount(
            costs, moves, holders, owners, num_ranks
        )


def _settle_by_recount(
    costs: list[float],
    moves: list[float],
    holders: list[tuple[int, ...] | None],
    owners: list[int],
    num_ranks: int,
) -> list[int]:
    """The settling's rule, every rank's load recomputed for each candidate."""

    def top(loads: list[float]) -> tuple[float, int]:
        peak = max(loads)
        return peak, sum(1 for x in loads if x >= peak * (1 - 1e-12))

    result = list(owners)
    loads = held_loads(costs, moves, holders, result, num_ranks)
    away = [i for i, h in enumerate(holders) if moves[i] and h and result[i] not in h]
    away.sort(key=lambda i: (-(costs[i] + moves[i]), i))
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
            (t_new, at_new), (t_old, at_old) = top(new), top(loads)
            lower = t_new < t_old * (1 - 1e-12)
            if t_new <= t_old * (1 + 1e-12) and (lower or at_new <= at_old):
                loads, result[i] = new, home
            else:
                kept.append(i)
        if len(kept) == len(away):
            break
        away = kept
    return result


def test_consolidation_counts_a_rank_s_base_load() -> None:
    calls = CallCosts(costs=[1.0, 2.0], fixed=[0.5, 0.5], classes=["a", "a"], stack=[4, 4])
    assert rank_loads(calls, [0, 1], 2) == [1.5, 2.5]
    based = CallCosts(calls.costs, calls.fixed, calls.classes, calls.stack, base=[3.0, 0.0])
    assert rank_loads(based, [0, 1], 2) == [4.5, 2.5]
