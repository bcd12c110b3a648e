"""Micro-groups: coverage, capacity, the boundary property, replicated packing."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.plan import (
    STRATEGIES,
    Assignment,
    MatrixSpec,
    MicroGroup,
    assign_owners,
    cost_model,
    micro_groups,
)
from canzona.plan.cost import CostModel
from canzona.plan.measured import MeasuredCost

from _plan_strategies import instances

FAST = settings(max_examples=60, deadline=None)


def _check_cover_and_capacity(
    specs: list[MatrixSpec], strategy: str, p: int, cap: int, model: CostModel | None = None
) -> None:
    model = model or cost_model("muon")
    a = assign_owners(specs, p, strategy=strategy, optimizer=model)
    groups = micro_groups(specs, a, capacity_bytes=cap, optimizer=model)
    flops = {s.name: model.flops(s) for s in specs}
    memory = {s.name: model.memory_bytes(s) for s in specs}
    names = [n for g in groups for n in g.names]
    assert Counter(names) == Counter(s.name for s in specs)  # union = all, no duplicates
    for index, g in enumerate(groups):
        assert g.index == index and g.names
        assert list(g.names) == sorted(g.names, key=lambda n: (-flops[n], n))
        assert g.owners == tuple(a.owner[n] for n in g.names)
        assert len(g.rank_bytes) == len(g.rank_loads) == p
        per_rank: dict[int, list[str]] = {r: [] for r in range(p)}
        for n in g.names:
            for r in a.computing_ranks(n):
                per_rank[r].append(n)
        for r, mine in per_rank.items():
            assert g.rank_bytes[r] == sum(memory[n] for n in mine)
            assert g.rank_loads[r] == pytest.approx(math.fsum(flops[n] for n in mine))
            if g.rank_bytes[r] > cap:
                # only a single oversized matrix may exceed the capacity
                assert len(mine) == 1 if not a.replicated else len(g.names) == 1
        assert g.balance_ratio >= 1.0 - 1e-12
    for r in range(p):
        assert math.fsum(g.rank_loads[r] for g in groups) == pytest.approx(a.loads[r])


@FAST
@given(instances(), st.sampled_from(STRATEGIES), st.integers(1, 40_000))
def test_groups_cover_everything_and_respect_capacity(
    inst: tuple[list[MatrixSpec], int], strategy: str, cap: int
) -> None:
    specs, p = inst
    _check_cover_and_capacity(specs, strategy, p, cap)


@FAST
@given(instances(), st.sampled_from(["canzona", "round_robin", "count"]), st.integers(1, 40_000))
def test_cumulative_loads_stay_within_one_matrix_at_every_boundary(
    inst: tuple[list[MatrixSpec], int], strategy: str, cap: int
) -> None:
    specs, p = inst
    _check_boundaries(specs, strategy, p, cap, cost_model("muon"))


def _check_boundaries(
    specs: list[MatrixSpec], strategy: str, p: int, cap: int, model: CostModel
) -> None:
    a = assign_owners(specs, p, strategy=strategy, optimizer=model)
    groups = micro_groups(specs, a, capacity_bytes=cap, optimizer=model)
    flops = {s.name: model.flops(s) for s in specs}
    memory = {s.name: model.memory_bytes(s) for s in specs}
    largest = max(flops.values(), default=0.0)
    done = [0.0] * p
    last = [0.0] * p
    for g_index, g in enumerate(groups[:-1]):
        for r in range(p):
            mine = [n for n in g.names if a.owner[n] == r]
            done[r] += g.rank_loads[r]
            if mine:  # each rank takes its matrices costliest first: the last is the cheapest
                last[r] = flops[max(mine, key=lambda n: (-flops[n], -memory[n], n))]
        later = {a.owner[n] for h in groups[g_index + 1 :] for n in h.names}
        floor = min(done[s] for s in later)
        tol = 1e-9 * max(done)
        for r in range(p):
            assert done[r] - last[r] <= floor + tol
        assert max(done[s] for s in later) - floor <= largest + tol


def _priced(specs: list[MatrixSpec], fixed: float) -> MeasuredCost:
    """Measured seconds for ``specs``' shapes: ``fixed`` per call plus the FLOPs at 1 GFLOP/s."""
    base = cost_model("muon")
    per = {(s.m, s.n): 1e-9 * base.flops(MatrixSpec("s", (s.m, s.n))) for s in specs}
    return MeasuredCost(
        base=base,
        table=tuple((mn, fixed + t) for mn, t in sorted(per.items())),
        batches=tuple((mn, fixed, t) for mn, t in sorted(per.items())),
    )


@FAST
@given(
    instances(),
    st.sampled_from(["canzona", "round_robin", "count"]),
    st.integers(1, 40_000),
    st.sampled_from([1e-7, 1e-5, 1e-3]),
)
def test_groups_with_priced_calls_keep_every_guarantee(
    inst: tuple[list[MatrixSpec], int], strategy: str, cap: int, fixed: float
) -> None:
    # where calls have a fixed part the plan may keep call classes together instead
    specs, p = inst
    _check_cover_and_capacity(specs, strategy, p, cap, _priced(specs, fixed))
    _check_boundaries(specs, strategy, p, cap, _priced(specs, fixed))


@FAST
@given(instances(), st.randoms())
def test_groups_are_invariant_to_input_order(
    inst: tuple[list[MatrixSpec], int], rnd: object
) -> None:
    specs, p = inst
    shuffled = list(specs)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    first = micro_groups(specs, assign_owners(specs, p), capacity_bytes=5000)
    second = micro_groups(shuffled, assign_owners(shuffled, p), capacity_bytes=5000)
    assert first == second


def test_boundary_holds_when_capacity_binds_unevenly() -> None:
    # rank 0 owns compute-dense squares (4 KiB, ~1e6 FLOPs), rank 1 byte-heavy tall-skinny
    # matrices (16 KiB, ~3.7e5 FLOPs): with 32 KiB in flight rank 1 is full after two, and
    # rank 0 must not run ahead of it (it would fit eight squares per group).
    squares = [MatrixSpec(f"sq{i:02d}", (32, 32), ranks=(0,)) for i in range(24)]
    talls = [MatrixSpec(f"tall{i:02d}", (1024, 4), ranks=(1,)) for i in range(48)]
    specs = squares + talls
    a = assign_owners(specs, 2)
    groups = micro_groups(specs, a, capacity_bytes=32 * 1024)
    model = cost_model("muon")
    square, tall = model.flops(squares[0]), model.flops(talls[0])
    done = [0.0, 0.0]
    for g in groups:
        done = [done[r] + g.rank_loads[r] for r in range(2)]
        if any(n.startswith("sq") for h in groups[g.index + 1 :] for n in h.names):
            assert abs(done[0] - done[1]) <= max(square, tall)
    # while rank 1 has work, rank 0 keeps pace with one square per group at most
    mixed = [g for g in groups if any(n.startswith("tall") for n in g.names)]
    assert max(sum(n.startswith("sq") for n in g.names) for g in mixed[:-1]) == 1


def test_oversized_matrix_sits_alone_on_its_owner() -> None:
    specs = [MatrixSpec("big", (64, 64))] + [MatrixSpec(f"s{i}", (8, 8)) for i in range(6)]
    a = assign_owners(specs, 2)
    groups = micro_groups(specs, a, capacity_bytes=1024)  # big is 16 KiB, small 256 B
    owner = a.owner["big"]
    (home,) = [g for g in groups if "big" in g.names]
    assert [n for n in home.names if a.owner[n] == owner] == ["big"]
    assert home.rank_bytes[owner] == 64 * 64 * 4


def test_capacity_extremes() -> None:
    specs = [MatrixSpec(f"w{i}", (8, 8 + i)) for i in range(9)]
    a = assign_owners(specs, 3)
    assert len(micro_groups(specs, a, capacity_bytes=1 << 40)) == 1
    tiny = micro_groups(specs, a, capacity_bytes=1)
    per_rank = Counter(a.owner.values())
    assert len(tiny) == max(per_rank.values())
    assert all(len(set(g.owners)) == len(g.owners) for g in tiny)  # one matrix per rank


def test_replicated_packs_in_cost_order() -> None:
    specs = [MatrixSpec(f"w{i}", (16, 16)) for i in range(5)]  # 1 KiB each
    a = assign_owners(specs, 4, strategy="replicated")
    groups = micro_groups(specs, a, capacity_bytes=2048)
    assert [len(g.names) for g in groups] == [2, 2, 1]
    assert all(g.rank_bytes == (2048,) * 4 for g in groups[:2])
    assert groups[0].balance_ratio == 1.0


def test_replicated_oversized_matrix_forms_its_own_group() -> None:
    """Catches: a matrix restricted to other ranks packed next to one that alone exceeds the
    capacity on its ranks (the group must then hold the oversized matrix only)."""
    specs = [
        MatrixSpec("big", (8, 8), ranks=(1,)),  # 256 B, only on rank 1
        MatrixSpec("small", (2, 8), ranks=(0,)),  # 64 B, only on rank 0
        MatrixSpec("tiny", (2, 8), ranks=(0,)),
    ]
    a = assign_owners(specs, 2, strategy="replicated")
    groups = micro_groups(specs, a, capacity_bytes=128)
    assert [g.names for g in groups] == [("big",), ("small", "tiny")]


def test_replicated_groups_count_restricted_bytes_per_rank() -> None:
    """Catches: a matrix restricted to some ranks checked against the bytes every rank holds
    only, so two of them overfill their rank's group."""
    specs = [MatrixSpec("a", (2, 8), ranks=(0,)), MatrixSpec("b", (2, 8), ranks=(0,))]  # 64 B
    a = assign_owners(specs, 2, strategy="replicated")
    groups = micro_groups(specs, a, capacity_bytes=100)
    assert [g.names for g in groups] == [("a",), ("b",)]
    assert [g.rank_bytes for g in groups] == [(64, 0), (64, 0)]


def test_micro_groups_validation() -> None:
    specs = [MatrixSpec("w", (2, 2))]
    a = assign_owners(specs, 2)
    with pytest.raises(ValueError, match="positive"):
        micro_groups(specs, a, capacity_bytes=0)
    with pytest.raises(ValueError, match="integer"):
        micro_groups(specs, a, capacity_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="different matrices"):
        micro_groups([MatrixSpec("v", (2, 2))], a, capacity_bytes=10)
    with pytest.raises(ValueError, match="duplicate"):
        micro_groups(specs * 2, a, capacity_bytes=10)
    assert micro_groups([], assign_owners([], 2), capacity_bytes=10) == []


def _calls(groups: list[MicroGroup], specs: list[MatrixSpec], a: Assignment) -> int:
    """Calls the owners make: distinct (group, rank, shape, payload size)."""
    by_name = {s.name: s for s in specs}
    return len(
        {
            (g.index, a.owner[n], by_name[n].m, by_name[n].n, by_name[n].itemsize)
            for g in groups
            for n in g.names
        }
    )


def _w128_rank() -> list[MatrixSpec]:
    # one owner's share of a width-128 model: bf16 payloads of 96, 64 and 96 KiB
    shapes = {"down": (128, 384), "o": (128, 256), "up": (384, 128)}
    return [MatrixSpec(f"{k}{i}", s, 2) for k, s in shapes.items() for i in range(2)]


def _timed(seconds: dict[tuple[int, int], float], share: float) -> MeasuredCost:
    """Measured seconds per shape, ``share`` of each a stacked call's fixed part."""
    return MeasuredCost(
        base=cost_model("muon"),
        table=tuple(seconds.items()),
        batches=tuple((mn, share * t, (1 - share) * t) for mn, t in seconds.items()),
    )


def test_an_owner_keeps_its_call_classes_together() -> None:
    # 240 KiB in flight: cost order alone sends (o0, o1, up0) and then up1 alone, four
    # calls; kept together, each class is one call in three groups all the same
    seconds = {(128, 384): 0.65e-3, (128, 256): 0.60e-3, (384, 128): 0.54e-3}
    specs, cost = _w128_rank(), _timed(seconds, 0.5)
    a = assign_owners(specs, 1, optimizer=cost)
    groups = micro_groups(specs, a, capacity_bytes=240 * 1024, optimizer=cost)
    assert [set(g.names) for g in groups] == [{"down0", "down1"}, {"o0", "o1"}, {"up0", "up1"}]
    assert _calls(groups, specs, a) == 3


def test_keeping_classes_together_never_adds_a_group() -> None:
    # 2 KiB in flight, costs x > y > w, half of each a call's fixed part: cost order fills
    # two groups exactly ({x, y0}, {y1, w}); keeping the y pair together would make one
    # call fewer but need three groups ({x}, {y0, y1}, {w})
    specs = [
        MatrixSpec("x", (16, 16)),
        MatrixSpec("y0", (8, 32)),
        MatrixSpec("y1", (8, 32)),
        MatrixSpec("w", (4, 64)),
    ]
    cost = _timed({(16, 16): 3e-3, (8, 32): 2e-3, (4, 64): 1e-3}, 0.5)
    groups = micro_groups(
        specs, assign_owners(specs, 1, optimizer=cost), capacity_bytes=2048, optimizer=cost
    )
    assert [set(g.names) for g in groups] == [{"x", "y0"}, {"y1", "w"}]


def test_classes_are_kept_together_only_where_groups_finish_no_later() -> None:
    # rank 1 holds an 8x32 and two 32x8 matrices, rank 0 one 16x32 (2 KiB in flight).
    # With a small fixed part per call the cost-order groups finish first ({m1 | m0, m2},
    # {m3}: rank 1's second call hides under rank 0's); with a large one the class-kept
    # groups do ({m1 | m0}, {m2, m3}: one call fewer). Without fixed parts (FLOPs) the
    # cost-order groups stand.
    specs = [
        MatrixSpec("m0", (8, 32), ranks=(1,)),
        MatrixSpec("m1", (16, 32), ranks=(0,)),
        MatrixSpec("m2", (32, 8), ranks=(1,)),
        MatrixSpec("m3", (32, 8), ranks=(1,)),
    ]
    seconds = {(8, 32): 1e-3, (16, 32): 1.5e-3, (32, 8): 1e-3}
    found = {}
    for share in (0.0, 0.01, 0.9):
        cost = _timed(seconds, share)
        a = assign_owners(specs, 2, optimizer=cost)
        groups = micro_groups(specs, a, capacity_bytes=2048, optimizer=cost)
        found[share] = [set(g.names) for g in groups]
    flops = micro_groups(specs, assign_owners(specs, 2), capacity_bytes=2048)
    assert [set(g.names) for g in flops] == found[0.0] == found[0.01]
    assert found[0.01] == [{"m1", "m0", "m2"}, {"m3"}]
    assert found[0.9] == [{"m1", "m0"}, {"m2", "m3"}]


def test_a_rank_that_saves_a_class_for_the_next_group_holds_the_others_back() -> None:
    # rank 0: a (1 KiB), then the pair y0, y1 (1 KiB each) that 2 KiB in flight can only
    # hold together in a group of their own; rank 1: sixteen 256-byte squares. After a,
    # rank 0 is full for the first group, and rank 1 must stop one matrix past it.
    specs = [MatrixSpec("a", (16, 16), ranks=(0,))]
    specs += [MatrixSpec(f"y{i}", (8, 32), ranks=(0,)) for i in range(2)]
    specs += [MatrixSpec(f"s{i:02d}", (8, 8), ranks=(1,)) for i in range(16)]
    cost = _timed({(16, 16): 2e-3, (8, 32): 1e-3, (8, 8): 1e-3}, 0.5)
    groups = micro_groups(
        specs, assign_owners(specs, 2, optimizer=cost), capacity_bytes=2048, optimizer=cost
    )
    assert {"y0", "y1"} <= set(groups[1].names)  # the pair is kept together
    assert groups[0].names == ("a", "s00", "s01", "s02")
    _check_boundaries(specs, "canzona", 2, 2048, cost)


def _cut(specs: list[MatrixSpec], cap: int) -> list[set[str]]:
    groups = micro_groups(specs, assign_owners(specs, 2), capacity_bytes=cap)
    return [set(g.names) for g in groups]


def test_a_full_rank_takes_a_smaller_matrix_where_groups_finish_earlier() -> None:
    # 3 KiB in flight. Rank 0: a 32x16 and a 16x32 (2 KiB each) and a 16x16 (1 KiB);
    # rank 1: one 24x24. Cost order sends {32x16 | 24x24}, {16x32, 16x16}; the 16x16 fits
    # beside the 32x16, under the 24x24's shadow, and the second group shrinks to one matrix.
    specs = [
        MatrixSpec("m0", (16, 16), ranks=(0,)),
        MatrixSpec("m1", (24, 24), ranks=(1,)),
        MatrixSpec("m2", (32, 16), ranks=(0,)),
        MatrixSpec("m3", (16, 32), ranks=(0,)),
    ]
    assert _cut(specs, 3072) == [{"m2", "m0", "m1"}, {"m3"}]


def test_a_smaller_matrix_is_not_taken_where_groups_would_finish_later() -> None:
    # rank 1's 8x8 fits beside its 24x24 in the first group, but the first group is rank
    # 1's anyway and the second would then be rank 0's 16x32 against a lone 16x16
    specs = [
        MatrixSpec("m0", (16, 32), ranks=(0,)),
        MatrixSpec("m1", (24, 24), ranks=(1,)),
        MatrixSpec("m2", (8, 8), ranks=(1,)),
        MatrixSpec("m3", (16, 16), ranks=(1,)),
        MatrixSpec("m4", (24, 24), ranks=(0,)),
    ]
    assert _cut(specs, 3072) == [{"m4", "m1"}, {"m0", "m3", "m2"}]


def test_on_a_tie_the_grouping_with_fewer_calls_is_taken() -> None:
    """Catches: the cost-order grouping kept where the class-kept one finishes as early with
    fewer calls (rank 0's 32x8 hides rank 1's extra call, so the finish times tie)."""
    specs = [
        MatrixSpec("m0", (4, 64), ranks=(1,)),
        MatrixSpec("m1", (8, 32), ranks=(1,)),
        MatrixSpec("m2", (4, 64), ranks=(1,)),
        MatrixSpec("m3", (16, 16), ranks=(1,)),
        MatrixSpec("m4", (32, 8), ranks=(0,)),
    ]
    cost = _timed({(4, 64): 1e-3, (8, 32): 1e-3, (16, 16): 1e-3, (32, 8): 2e-3}, 0.5)
    a = assign_owners(specs, 2, optimizer=cost)
    groups = micro_groups(specs, a, capacity_bytes=2048, optimizer=cost)
    assert [set(g.names) for g in groups] == [{"m4", "m0", "m2"}, {"m1", "m3"}]
    assert _calls(groups, specs, a) == 4  # cost order: {m4, m0, m1}, {m2, m3}, five calls


def test_a_class_too_big_for_any_group_does_not_wait_for_an_empty_one() -> None:
    """Catches: a rank deferring a class whose queued run (three 1 KiB matrices) exceeds the
    capacity (2 KiB) even in an empty group; the class then starts beside what the rank holds."""
    specs = [MatrixSpec(name, (8, 32)) for name in ("m0", "m1", "m3")]
    specs.append(MatrixSpec("m2", (4, 64)))
    cost = _timed({(8, 32): 1.5e-3, (4, 64): 1.5e-3}, 0.5)
    groups = micro_groups(
        specs, assign_owners(specs, 1, optimizer=cost), capacity_bytes=2048, optimizer=cost
    )
    # deferred, the 8x32s would leave m2 alone in the first group: three groups, so the
    # cost-order grouping {m0, m1}, {m2, m3} would be used instead
    assert [set(g.names) for g in groups] == [{"m0", "m2"}, {"m1", "m3"}]


def test_replicated_groups_count_a_restricted_matrix_next_to_the_others() -> None:
    """Catches: a replicated group's capacity check leaving out what a restricted matrix
    adds on its ranks when an unrestricted one joins: rank 0 held 880 B under an 800 B cap."""
    specs = [MatrixSpec("r0", (12, 10), ranks=(0,)), MatrixSpec("c", (10, 10))]
    a = assign_owners(specs, 2, strategy="replicated")
    groups = micro_groups(specs, a, capacity_bytes=800)
    assert [g.names for g in groups] == [("r0",), ("c",)]
    assert all(max(g.rank_bytes) <= 800 for g in groups)
