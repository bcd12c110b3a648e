"""Micro-groups: coverage, capacity, the boundary property, replicated packing."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.plan import STRATEGIES, MatrixSpec, assign_owners, cost_model, micro_groups

from _plan_strategies import instances

FAST = settings(max_examples=60, deadline=None)


def _check_cover_and_capacity(specs: list[MatrixSpec], strategy: str, p: int, cap: int) -> None:
    a = assign_owners(specs, p, strategy=strategy)
    groups = micro_groups(specs, a, capacity_bytes=cap)
    model = cost_model("muon")
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
    a = assign_owners(specs, p, strategy=strategy)
    groups = micro_groups(specs, a, capacity_bytes=cap)
    model = cost_model("muon")
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
