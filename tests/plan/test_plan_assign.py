"""Owner assignment: properties of every strategy, LPT guarantees, refinement, edge cases."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.plan import (
    STRATEGIES,
    Assignment,
    MatrixSpec,
    assign_owners,
    cost_model,
    lower_bound,
)
from canzona.plan.refine import objective, refine_owners

from _plan_strategies import brute_force_opt, cost_specs, instances

FAST = settings(max_examples=60, deadline=None)


def _flops(specs: list[MatrixSpec], optimizer: str = "muon") -> dict[str, float]:
    model = cost_model(optimizer)
    return {s.name: model.flops(s) for s in specs}


@FAST
@given(instances(), st.sampled_from(STRATEGIES), st.sampled_from(["muon", "soap", "shampoo"]))
def test_every_matrix_has_one_eligible_owner_and_loads_add_up(
    inst: tuple[list[MatrixSpec], int], strategy: str, optimizer: str
) -> None:
    specs, p = inst
    a = assign_owners(specs, p, strategy=strategy, optimizer=optimizer)
    flops = _flops(specs, optimizer)
    model = cost_model(optimizer)
    assert set(a.owner) == {s.name for s in specs}
    assert len(a.loads) == len(a.comm_bytes) == p
    for s in specs:
        assert 0 <= a.owner[s.name] < p
        assert a.owner[s.name] in s.eligible(p)
        computing = a.computing_ranks(s.name)
        assert computing == (s.eligible(p) if strategy == "replicated" else (a.owner[s.name],))
    if strategy == "replicated":
        assert a.replicated
        for r in range(p):
            mine = [s for s in specs if r in s.eligible(p)]
            assert a.loads[r] == pytest.approx(math.fsum(flops[s.name] for s in mine))
            assert a.comm_bytes[r] == sum(model.comm_bytes(s) for s in mine)
    else:
        assert not a.replicated
        assert math.fsum(a.loads) == pytest.approx(math.fsum(flops.values()))
        assert sum(a.comm_bytes) == sum(model.comm_bytes(s) for s in specs)
        for r in range(p):
            mine = [flops[s.name] for s in specs if a.owner[s.name] == r]
            assert a.loads[r] == math.fsum(mine)
    assert a.total == pytest.approx(math.fsum(flops.values()))
    assert a.makespan == max(a.loads)
    assert a.lower_bound <= a.makespan * (1 + 1e-9)  # LB ignores eligibility: still valid
    assert a.balance_ratio >= 1.0 - 1e-12


@FAST
@given(instances(), st.sampled_from(["canzona", "numel"]), st.floats(0, 1), st.randoms())
def test_plan_is_invariant_to_input_order(
    inst: tuple[list[MatrixSpec], int], strategy: str, alpha: float, rnd: object
) -> None:
    specs, p = inst
    shuffled = list(specs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    a = assign_owners(specs, p, strategy=strategy, alpha=alpha)
    b = assign_owners(shuffled, p, strategy=strategy, alpha=alpha)
    assert dict(a.owner) == dict(b.owner)
    assert a.loads == b.loads and a.comm_bytes == b.comm_bytes
    assert a.lower_bound == b.lower_bound


@FAST
@given(instances(restricted=False), st.booleans())
def test_greedy_bound_mean_plus_largest_item(
    inst: tuple[list[MatrixSpec], int], refine: bool
) -> None:
    specs, p = inst
    a = assign_owners(specs, p, refine=refine)
    largest = max(_flops(specs).values(), default=0.0)
    assert a.makespan <= a.total / p + largest + 1e-9 * a.total


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=9), st.integers(1, 3))
def test_against_brute_force_optimum(costs: list[int], p: int) -> None:
    specs = cost_specs(costs)
    opt = brute_force_opt([12.0 * c for c in costs], p)
    lpt = assign_owners(specs, p, optimizer="adamw", refine=False)
    refined = assign_owners(specs, p, optimizer="adamw")
    assert lpt.lower_bound <= opt
    assert lpt.makespan <= (4 / 3 - 1 / (3 * p)) * opt + 1e-9
    assert refined.makespan <= lpt.makespan
    assert refined.makespan >= opt
    assert lower_bound([12.0 * c for c in costs], p) == lpt.lower_bound


@FAST
@given(instances())
def test_refinement_never_worse_than_plain_lpt(inst: tuple[list[MatrixSpec], int]) -> None:
    specs, p = inst
    lpt = assign_owners(specs, p, refine=False)
    refined = assign_owners(specs, p)
    assert refined.makespan <= lpt.makespan * (1 + 1e-12)


def test_refinement_strictly_improves_a_known_instance() -> None:
    # LPT on (3, 3, 2, 2, 2) over 2 ranks gives 3+2+2 = 7; the optimum is 3+3 | 2+2+2 = 6.
    specs = cost_specs([3, 3, 2, 2, 2])
    lpt = assign_owners(specs, 2, optimizer="adamw", refine=False)
    refined = assign_owners(specs, 2, optimizer="adamw")
    assert lpt.makespan == 12 * 7
    assert refined.makespan == 12 * 6 == refined.lower_bound
    assert refined.balance_ratio == 1.0


def test_refine_owners_directly_respects_eligibility() -> None:
    costs = [3.0, 3.0, 2.0, 2.0, 2.0]
    owners = refine_owners(costs, [None] * 5, [0, 1, 0, 1, 0], 2)
    assert objective(costs, owners, 2) == (6.0, 2)
    # the two 3s may only live on rank 0: nothing can move, the start is kept
    pinned = refine_owners(costs, [(0,), (0,), None, None, None], [0, 0, 1, 1, 1], 2)
    assert pinned == [0, 0, 1, 1, 1]
    assert refine_owners(costs, [None] * 5, [0] * 5, 2, max_iterations=0) == [0] * 5


def test_refine_owners_never_swaps_in_a_matrix_the_heavy_rank_may_not_own() -> None:
    # Rank 0 holds 4 + 4, rank 1 holds 2 + 2 that only rank 1 may own. Moving a 4 over gives
    # (4, 8): no better. Swapping a 4 for a 2 would give (6, 6), but the 2 may not live on rank 0.
    costs = [4.0, 4.0, 2.0, 2.0]
    eligible: list[tuple[int, ...] | None] = [None, None, (1,), (1,)]
    assert refine_owners(costs, eligible, [0, 0, 1, 1], 2) == [0, 0, 1, 1]
    # the same swap is taken when the 2s may live anywhere
    assert objective(costs, refine_owners(costs, [None] * 4, [0, 0, 1, 1], 2), 2) == (6.0, 2)


@FAST
@given(st.data())
def test_refine_owners_keeps_eligibility_and_never_worsens(data: st.DataObject) -> None:
    p = data.draw(st.integers(2, 4))
    n = data.draw(st.integers(1, 12))
    costs = data.draw(st.lists(st.integers(1, 20).map(float), min_size=n, max_size=n))
    subsets = st.lists(st.integers(0, p - 1), min_size=1, max_size=p, unique=True)
    eligible = data.draw(
        st.lists(
            st.one_of(st.none(), subsets.map(lambda r: tuple(sorted(r)))), min_size=n, max_size=n
        )
    )
    start = [data.draw(st.sampled_from(e if e is not None else range(p))) for e in eligible]
    owners = refine_owners(costs, eligible, start, p)
    assert all(e is None or o in e for o, e in zip(owners, eligible, strict=True))
    assert objective(costs, owners, p) <= objective(costs, start, p)


def test_lower_bound_terms() -> None:
    assert lower_bound([], 4) == 0.0
    assert lower_bound([5.0], 4) == 5.0  # the costliest item
    assert lower_bound([1.0] * 8, 4) == 2.0  # the mean
    assert lower_bound([10.0, 10.0, 10.0], 2) == 20.0  # k = 1: two of three on one rank
    assert lower_bound([5.0, 4.0, 3.0, 3.0, 3.0], 2) == 9.0


def test_lower_bound_counts_what_is_pinned() -> None:
    """Catches: pinned items treated as free (the bound then sits below what any assignment
    reaches: 20 here, where one rank must carry two 10s on top of its pinned 4)."""
    pinned = [None, None, None, 0, 1]
    assert lower_bound([10.0, 10.0, 10.0, 4.0, 4.0], 2) == 20.0
    assert lower_bound([10.0, 10.0, 10.0, 4.0, 4.0], 2, pinned) == 24.0
    assert lower_bound([5.0, 1.0, 1.0], 2, [0, 0, None]) == 6.0  # all pinned to one rank
    assert lower_bound([3.0, 3.0], 2, [0, 1]) == 3.0  # nothing free


@FAST
@given(
    st.lists(st.floats(0.5, 10.0), min_size=1, max_size=7),
    st.integers(2, 3),
    st.data(),
)
def test_lower_bound_with_pins_never_exceeds_the_optimum(
    costs: list[float], ranks: int, data: st.DataObject
) -> None:
    """Catches: a bound that adds the largest pinned load (or pinned loads twice): it must
    stay at or below the best assignment that keeps every pinned item on its rank."""
    pinned = data.draw(
        st.lists(
            st.one_of(st.none(), st.integers(0, ranks - 1)),
            min_size=len(costs),
            max_size=len(costs),
        )
    )
    choices = [range(ranks) if r is None else (r,) for r in pinned]
    best = math.inf
    for owners in itertools.product(*choices):
        loads = [0.0] * ranks
        for c, r in zip(costs, owners, strict=True):
            loads[r] += c
        best = min(best, max(loads))
    assert lower_bound(costs, ranks, pinned) <= best * (1 + 1e-12)


def test_alpha_trades_communication_for_compute() -> None:
    # Two 1024x1024 squares (4 MiB, ~3.2e10 FLOPs each) and one 8192x256 tall-skinny matrix
    # (8 MiB, ~1.1e10 FLOPs) on two ranks.
    specs = [
        MatrixSpec("square.0", (1024, 1024)),
        MatrixSpec("square.1", (1024, 1024)),
        MatrixSpec("tall", (8192, 256)),
    ]
    by_bytes = assign_owners(specs, 2, alpha=0.0)
    by_flops = assign_owners(specs, 2, alpha=1.0)
    # alpha = 0: 8 MiB each (the tall matrix alone), compute 2:1 off
    assert dict(by_bytes.owner) == {"tall": 0, "square.0": 1, "square.1": 1}
    assert by_bytes.comm_bytes == (8 << 20, 8 << 20)
    assert by_bytes.comm_balance_ratio == 1.0
    # alpha = 1: one square per rank, the tall matrix beside the first (ties -> lowest rank)
    assert dict(by_flops.owner) == {"square.0": 0, "square.1": 1, "tall": 0}
    assert by_flops.comm_bytes == (12 << 20, 4 << 20)
    assert by_flops.comm_balance_ratio == 1.5
    assert by_bytes.balance_ratio == pytest.approx(1.710, abs=1e-3)
    assert by_flops.balance_ratio == pytest.approx(1.145, abs=1e-3)
    assert by_flops.makespan < by_bytes.makespan


def test_round_robin_and_count_follow_model_order() -> None:
    specs = [MatrixSpec(f"a{i}", (4, 4)) for i in range(5)] + [MatrixSpec("b0", (8, 4))]
    rr = assign_owners(specs, 3, strategy="round_robin")
    assert [rr.owner[s.name] for s in specs] == [0, 1, 2, 0, 1, 2]
    count = assign_owners(specs, 3, strategy="count")
    # every same-shape batch is dealt from rank 0
    assert [count.owner[s.name] for s in specs] == [0, 1, 2, 0, 1, 0]
    restricted = [MatrixSpec(f"r{i}", (4, 4), ranks=(1, 3)) for i in range(3)]
    assert [
        assign_owners(restricted, 4, strategy="round_robin").owner[f"r{i}"] for i in range(3)
    ] == [1, 3, 1]
    assert [assign_owners(restricted, 4, strategy="count").owner[f"r{i}"] for i in range(3)] == [
        1,
        3,
        1,
    ]


def test_replicated_nominal_owner_and_loads() -> None:
    specs = [MatrixSpec("a", (4, 4)), MatrixSpec("b", (4, 8), ranks=(2, 3))]
    a = assign_owners(specs, 4, strategy="replicated")
    assert dict(a.owner) == {"a": 0, "b": 2}
    assert a.computing_ranks("a") == (0, 1, 2, 3) and a.computing_ranks("b") == (2, 3)
    f = _flops(specs)
    assert a.loads == (f["a"], f["a"], f["a"] + f["b"], f["a"] + f["b"])
    assert a.lower_bound == max(f.values())


def test_more_ranks_than_matrices() -> None:
    specs = [MatrixSpec(f"w{i}", (8 * (i + 1), 16)) for i in range(5)]
    a = assign_owners(specs, 16)
    assert len(set(a.owner.values())) == 5
    assert a.makespan == a.lower_bound == max(_flops(specs).values())
    assert a.loads.count(0.0) == 11


def test_one_rank_and_empty() -> None:
    specs = [MatrixSpec(f"w{i}", (8, 8)) for i in range(4)]
    for strategy in STRATEGIES:
        a = assign_owners(specs, 1, strategy=strategy)
        assert set(a.owner.values()) == {0}
        assert a.balance_ratio == 1.0 and a.makespan == a.total == a.lower_bound
    empty = assign_owners([], 3)
    assert empty.loads == (0.0, 0.0, 0.0) and empty.balance_ratio == 1.0
    assert empty.makespan == empty.lower_bound == 0.0 and empty.makespan_ratio == 1.0


def test_single_huge_matrix() -> None:
    specs = [MatrixSpec("huge", (8192, 8192))] + [MatrixSpec(f"s{i}", (64, 64)) for i in range(50)]
    a = assign_owners(specs, 4)
    assert a.makespan == a.lower_bound == _flops(specs)["huge"]
    # the huge matrix sits alone; the small ones spread over the other ranks
    assert [n for n, r in a.owner.items() if r == a.owner["huge"]] == ["huge"]


def test_thousands_of_tiny_matrices_balance() -> None:
    specs = [MatrixSpec(f"t{i:04d}", (4, 4)) for i in range(3000)]
    a = assign_owners(specs, 7)
    counts = [list(a.owner.values()).count(r) for r in range(7)]
    assert max(counts) - min(counts) <= 1
    assert a.makespan == a.lower_bound


def test_eligibility_restrictions_are_respected() -> None:
    specs = [MatrixSpec(f"w{i}", (16, 16 + i), ranks=(1, 3)) for i in range(10)]
    specs += [MatrixSpec(f"free{i}", (16, 16)) for i in range(4)]
    a = assign_owners(specs, 4)
    assert all(a.owner[f"w{i}"] in (1, 3) for i in range(10))
    assert a.loads[1] > 0 and a.loads[3] > 0


def test_three_d_spec_costs_the_batch() -> None:
    stacked = MatrixSpec("experts", (8, 64, 32))
    single = MatrixSpec("one", (64, 32))
    a = assign_owners([stacked], 2)
    assert a.total == 8 * cost_model("muon").flops(single)
    assert a.comm_bytes == (8 * 64 * 32 * 4, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_ranks": 0}, "num_ranks"),
        ({"num_ranks": True}, "num_ranks"),
        ({"strategy": "random"}, "strategy"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"optimizer": "lion"}, "unknown optimizer"),
        ({"optimizer": 3}, "optimizer"),
    ],
)
def test_assign_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"num_ranks": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        assign_owners([MatrixSpec("w", (2, 2))], **args)  # type: ignore[arg-type]


def test_assign_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="duplicate matrix name"):
        assign_owners([MatrixSpec("w", (2, 2)), MatrixSpec("w", (3, 3))], 2)
    with pytest.raises(ValueError, match="eligible ranks must be < num_ranks"):
        assign_owners([MatrixSpec("w", (2, 2), ranks=(0, 4))], 4)
    with pytest.raises(ValueError, match="expected MatrixSpec"):
        assign_owners([("w", (2, 2))], 2)  # type: ignore[list-item]


def test_assignment_validation() -> None:
    with pytest.raises(ValueError, match="one entry per rank"):
        Assignment(
            strategy="canzona",
            num_ranks=2,
            owner={},
            loads=(0.0,),
            comm_bytes=(0, 0),
            lower_bound=0.0,
            total=0.0,
        )
    with pytest.raises(ValueError, match="outside"):
        Assignment(
            strategy="canzona",
            num_ranks=1,
            owner={"w": 1},
            loads=(0.0,),
            comm_bytes=(0,),
            lower_bound=0.0,
            total=0.0,
        )
    a = assign_owners([MatrixSpec("w", (2, 2))], 2)
    with pytest.raises(TypeError):
        a.owner["w"] = 1  # type: ignore[index]


def _naive_lpt(specs: list[MatrixSpec], num_ranks: int) -> dict[str, int]:
    """``numel`` LPT written plainly: each matrix, costliest first, to the least loaded of
    its eligible ranks (ties to the lowest), scanning the loads afresh every time."""
    loads = [0] * num_ranks
    owners = {}
    for s in sorted(specs, key=lambda s: (-s.numel, -s.nbytes, s.name)):
        eligible = s.ranks if s.ranks is not None else range(num_ranks)
        rank = min(eligible, key=lambda r: (loads[r], r))
        loads[rank] += s.numel
        owners[s.name] = rank
    return owners


@FAST
@given(instances(max_ranks=6))
def test_lpt_with_eligibility_sets_matches_a_plain_scan(inst: tuple[list[MatrixSpec], int]) -> None:
    """Catches: the greedy's per-eligibility-set heaps trusted while stale (a rank that took
    work through another set's heap looks as light as before), which sends a matrix to a
    loaded rank while an eligible one sits idle."""
    specs, p = inst
    assert assign_owners(specs, p, strategy="numel").owner == _naive_lpt(specs, p)


def test_lpt_refreshes_a_heap_that_another_eligibility_set_made_stale() -> None:
    """The smallest instance: ``b`` (ranks 0-1 only) lands on rank 1 after the all-rank heap
    was built; ``c`` must then go to idle rank 2, not to rank 1 as the stale heap says."""
    specs = [
        MatrixSpec("a", (10, 10)),
        MatrixSpec("b", (9, 10), ranks=(0, 1)),
        MatrixSpec("c", (8, 10)),
    ]
    a = assign_owners(specs, 4, strategy="numel")
    assert a.owner == {"a": 0, "b": 1, "c": 2}


def test_round_robin_deals_restricted_matrices_from_the_first_eligible_rank() -> None:
    """Catches: the deal skipping the rank it starts at when that rank is eligible: four
    matrices restricted to ranks 0 and 1 of four went 1, 0, 0, 0."""
    specs = [MatrixSpec(f"w{i}", (8, 8), ranks=(0, 1)) for i in range(4)]
    a = assign_owners(specs, 4, strategy="round_robin")
    assert [a.owner[s.name] for s in specs] == [0, 1, 0, 1]


def test_round_robin_keeps_every_rank_of_alternating_disjoint_sets_busy() -> None:
    """Catches: one cursor for every set of eligible ranks. Matrices alternating between the
    replicas (0, 1) and (2, 3) of an HSDP mesh without deduplication each restarted at the
    first rank of their set: ranks 1 and 3 got none ([4, 0, 4, 0] matrices per rank)."""
    specs = [MatrixSpec(f"w{i}", (8, 8), ranks=(0, 1) if i % 2 == 0 else (2, 3)) for i in range(8)]
    a = assign_owners(specs, 4, strategy="round_robin")
    assert [a.owner[s.name] for s in specs] == [0, 2, 1, 3, 0, 2, 1, 3]


def test_refinement_swaps_toward_half_the_gap() -> None:
    """Catches: the swap search aiming at a partner that closes the whole gap between the
    two ranks instead of half of it (a worse swap is found: makespan 17, not 16)."""
    costs = [9.0, 5.0, 3.0, 8.0, 6.0]
    owners = refine_owners(costs, [None] * 5, [0, 1, 1, 0, 1], 2)
    assert objective(costs, owners, 2) == (16.0, 1)


def test_equal_costs_go_by_bytes_then_name() -> None:
    """Catches: the greedy order's tie-break on bytes reversed (``(-cost, -bytes, name)``
    is the documented order): the larger payload is placed first, on rank 0."""
    specs = [MatrixSpec("x", (8, 8), itemsize=2), MatrixSpec("y", (8, 8), itemsize=4)]
    for refine in (False, True):
        assert dict(assign_owners(specs, 2, refine=refine).owner) == {"x": 1, "y": 0}
