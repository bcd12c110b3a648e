"""Consolidation: owners priced per call gather same-class matrices without raising the makespan."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.plan import MatrixSpec, MuonCost, assign_owners, build_plan
from canzona.plan.consolidate import CallCosts, consolidate_owners, rank_loads
from canzona.plan.measured import MeasuredCost, predict_seconds


def _calls(
    costs: Sequence[float], fixed: Sequence[float], classes: Sequence[str], stack: int = 99
) -> CallCosts:
    return CallCosts(costs=costs, fixed=fixed, classes=classes, stack=[stack] * len(costs))


def _chunks(calls: CallCosts, owners: Sequence[int]) -> set[tuple[int, object]]:
    return set(zip(owners, calls.classes, strict=True))


def test_two_split_classes_are_gathered_one_per_rank() -> None:
    """Catches: a consolidation that keeps each class split over both ranks."""
    calls = _calls([1.0] * 4, [2.0] * 4, ["a", "a", "b", "b"])
    start = [0, 1, 0, 1]
    assert rank_loads(calls, start, 2) == [6.0, 6.0]
    owners = consolidate_owners(calls, [None] * 4, start, 2)
    assert owners[0] == owners[1] and owners[2] == owners[3] and owners[0] != owners[2]
    assert rank_loads(calls, owners, 2) == [4.0, 4.0]


def test_a_class_joins_its_class_when_the_makespan_allows() -> None:
    # rank 0: a, a (1 + 1 + 2 = 4); rank 1: a, b (1 + 2 + 0.5 + 2 = 5.5): the a's gather
    calls = _calls([1.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0], ["a", "a", "a", "b"])
    owners = consolidate_owners(calls, [None] * 4, [0, 0, 1, 1], 2)
    assert owners[0] == owners[1] == owners[2] != owners[3]
    assert sorted(rank_loads(calls, owners, 2)) == [2.5, 5.0]


def test_without_fixed_parts_nothing_moves() -> None:
    calls = _calls([1.0, 2.0, 3.0], [0.0] * 3, ["a", "a", "a"])
    assert consolidate_owners(calls, [None] * 3, [0, 1, 2], 3) == [0, 1, 2]


def test_one_matrix_per_call_gives_nothing_to_gather() -> None:
    """With room for one matrix per call (stack 1) every matrix is a call wherever it runs."""
    calls = _calls([1.0] * 4, [2.0] * 4, ["a", "a", "b", "b"], stack=1)
    assert consolidate_owners(calls, [None] * 4, [0, 1, 0, 1], 2) == [0, 1, 0, 1]


def test_matrices_in_place_and_restricted_ones_stay_eligible() -> None:
    calls = _calls([1.0] * 4, [2.0] * 4, ["a", "a", "b", "b"])
    # the first a stays on rank 0 and the second b may only run on rank 1: nothing to gain
    movable: list[tuple[int, ...] | None] = [(), None, None, (1,)]
    owners = consolidate_owners(calls, movable, [0, 1, 0, 1], 2)
    assert owners[0] == 0 and owners[3] == 1
    assert owners == [0, 0, 1, 1]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 10.0), st.sampled_from("abcd"), st.integers(0, 3), st.integers(0, 3)
        ),
        min_size=1,
        max_size=24,
    ),
    st.lists(st.floats(0.0, 5.0), min_size=4, max_size=4),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_the_makespan_never_rises_and_eligibility_holds(
    items: list[tuple[float, str, int, int]],
    fixed_by_class: list[float],
    num_ranks: int,
    stack: int,
) -> None:
    """Catches: an option applied without lowering the potential, or a move off the
    allowed ranks (restricted matrices, matrices in place)."""
    costs = [c for c, _, _, _ in items]
    classes = [k for _, k, _, _ in items]
    fixed = [fixed_by_class["abcd".index(k)] for k in classes]
    calls = CallCosts(costs=costs, fixed=fixed, classes=classes, stack=[stack] * len(items))
    start = [r % num_ranks for _, _, r, _ in items]
    movable: list[tuple[int, ...] | None] = []
    for (_, _, r, kind), home in zip(items, start, strict=True):
        if kind == 0:
            movable.append(())  # stays
        elif kind == 1:
            movable.append(tuple(sorted({home, (r + 1) % num_ranks})))
        else:
            movable.append(None)
    owners = consolidate_owners(calls, movable, start, num_ranks)
    before, after = rank_loads(calls, start, num_ranks), rank_loads(calls, owners, num_ranks)
    assert max(after) <= max(before) * (1 + 1e-9)
    for i, (rank, allowed) in enumerate(zip(owners, movable, strict=True)):
        if allowed == ():
            assert rank == start[i]
        elif allowed is not None:
            assert rank in allowed
    assert consolidate_owners(calls, movable, start, num_ranks) == owners  # deterministic


def _measured() -> MeasuredCost:
    """Calls with a fixed part of 0.3 ms and 0.2 ms per matrix, for every shape below."""
    shapes = [(128, 128), (256, 128), (128, 256), (384, 128), (128, 384)]
    return MeasuredCost(
        base=MuonCost(),
        table=tuple((s, 0.35e-3) for s in shapes),
        batches=tuple((s, 0.3e-3, 0.2e-3) for s in shapes),
    )


def _width_128() -> list[MatrixSpec]:
    h = 128
    shapes = {"q": (2 * h, h), "k": (h, h), "v": (h, h), "o": (h, 2 * h)}
    shapes |= {"gate": (3 * h, h), "up": (3 * h, h), "down": (h, 3 * h)}
    return [MatrixSpec(f"{i}.{n}", s) for i in range(2) for n, s in shapes.items()]


def test_measured_calls_plan_fewer_calls_and_a_shorter_step() -> None:
    """Catches: the runtime's plan ignoring the fixed part of its calls (the owner splits
    most classes of the two layers over both ranks: eight calls where five do)."""
    specs, cost = _width_128(), _measured()
    plain = assign_owners(specs, 2, optimizer=cost, refine=False)
    assert len({(plain.owner[s.name], s.shape) for s in specs}) == 8  # what LPT alone gives
    plan = build_plan(specs, 2, optimizer=cost)
    owner = plan.assignment.owner
    assert len({(owner[s.name], s.shape) for s in specs}) <= 6
    groups = [g.names for g in plan.micro_groups]
    predicted = predict_seconds(specs, groups, plan.assignment.computing_ranks, cost, 2)
    lpt = predict_seconds(specs, [[s.name for s in specs]], lambda n: (plain.owner[n],), cost, 2)
    assert max(predicted) < 0.9 * max(lpt)


def test_a_tight_capacity_keeps_the_plain_assignment() -> None:
    """A capacity that fits one matrix per rank and group stacks nothing: nothing to gather."""
    specs, cost = _width_128(), _measured()
    plain = assign_owners(specs, 2, optimizer=cost, refine=False)
    tight = assign_owners(specs, 2, optimizer=cost, capacity_bytes=2 * 128 * 128 * 4)
    assert tight.owner == plain.owner


def test_a_stack_holds_what_a_micro_group_can_hold_not_one_more() -> None:
    """Catches: the pass assuming one more matrix per call than a micro-group's capacity
    holds: it gathered three 128x128 matrices on one rank, which then cost two calls
    anyway (1.05 ms on the busiest rank instead of 0.7)."""
    shapes = ((128, 128), (256, 128))
    cost = MeasuredCost(
        base=MuonCost(),
        table=tuple((s, 0.35e-3) for s in shapes),
        batches=((shapes[0], 0.3e-3, 0.2e-3), (shapes[1], 0.3e-3, 0.4e-3)),
    )
    specs = [MatrixSpec(f"a{i}", (128, 128)) for i in range(3)] + [MatrixSpec("b0", (256, 128))]
    a = assign_owners(specs, 2, optimizer=cost, capacity_bytes=2 * 128 * 128 * 4)
    assert [a.owner[s.name] for s in specs] == [1, 0, 1, 0]
    assert max(a.loads) == pytest.approx(0.7e-3)


def test_gathering_that_keeps_the_makespan_still_saves_calls() -> None:
    """Catches: options compared on the makespan alone, not then on the calls: two
    matrices of one class on two idle ranks were left apart (3 calls, not 2)."""
    calls = CallCosts(
        costs=[10.0, 1.0, 1.0], fixed=[2.0] * 3, classes=["x", "a", "a"], stack=[99] * 3
    )
    owners = consolidate_owners(calls, [None] * 3, [0, 1, 2], 3)
    assert owners[1] == owners[2] and owners[0] == 0
    assert rank_loads(calls, owners, 3)[0] == 12.0


def test_the_potential_takes_the_first_unchanged_leader() -> None:
    """Catches: the potential of an option read from the wrong one of the ranks it leaves
    unchanged (four ranks or more): options that did not lower the makespan were taken and
    the result kept a call more (4 calls instead of 3)."""
    fixed = {"a": 2.0, "b": 1.0, "c": 3.0}
    classes = ["c", "a", "a", "b"]
    calls = CallCosts(
        costs=[5.0, 2.0, 2.0, 3.0],
        fixed=[fixed[k] for k in classes],
        classes=classes,
        stack=[99] * 4,
    )
    owners = consolidate_owners(calls, [None] * 4, [1, 0, 3, 2], 4)
    loads = rank_loads(calls, owners, 4)
    assert (max(loads), loads.count(max(loads)), len(set(zip(owners, classes, strict=True)))) == (
        8.0,
        1,
        3,
    )
