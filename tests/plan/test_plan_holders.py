"""Holders: a matrix some ranks hold whole starts there and moves only to lower the makespan."""

from __future__ import annotations

import pytest

from canzona.plan import MatrixSpec, MuonCost, assign_owners
from canzona.plan.measured import MeasuredCost


def _experts(per_rank: int, ranks: int) -> list[MatrixSpec]:
    return [
        MatrixSpec(f"e{e}", (64, 32), holders=(e // per_rank,)) for e in range(per_rank * ranks)
    ]


@pytest.mark.parametrize("strategy", ["canzona", "numel"])
def test_balanced_experts_stay_where_they_are(strategy: str) -> None:
    a = assign_owners(_experts(4, 2), 2, strategy=strategy)
    assert all(a.owner[f"e{e}"] == e // 4 for e in range(8))
    assert a.comm_bytes == (0, 0)  # nothing travels


def test_a_held_matrix_moves_when_that_strictly_lowers_the_makespan() -> None:
    """Rank 0 holds three equal blocks, rank 1 holds nothing: one block must move."""
    specs = [MatrixSpec(f"h{i}", (64, 64), holders=(0,)) for i in range(3)]
    moved = assign_owners(specs, 2, strategy="canzona")
    assert sorted(list(moved.owner.values()).count(r) for r in (0, 1)) == [1, 2]
    assert sum(moved.comm_bytes) == 64 * 64 * 4  # the moved block's payload only
    kept = assign_owners(specs, 2, strategy="numel")  # no refinement: all stay
    assert set(kept.owner.values()) == {0} and kept.comm_bytes == (0, 0)


@pytest.mark.parametrize("names", [("a", "h1", "h2"), ("h1", "h2", "z")])
def test_a_rank_gives_away_a_matrix_it_does_not_hold_first(names: tuple[str, str, str]) -> None:
    """Catches: the refinement moving a held matrix off its holder where moving an equal
    one that rank does not hold lowered the makespan as much: its payload travelled there
    and back every step (twice the bytes), depending on the names' order alone."""
    plain, *held = names if names[0] == "a" else (names[2], *names[:2])
    specs = [MatrixSpec(plain, (8, 8)), *(MatrixSpec(n, (8, 8), holders=(0,)) for n in held)]
    a = assign_owners(specs, 2, strategy="canzona")
    assert [a.owner[n] for n in held] == [0, 0] and a.owner[plain] == 1
    assert a.comm_bytes == (0, 8 * 8 * 4)  # the plain matrix's payload only


def test_owning_a_held_matrix_on_its_holder_costs_no_bytes() -> None:
    """With the blend on bytes alone (alpha=0), owning on the holder is free: nothing moves.

    Were a held matrix priced at its payload, rank 0's three blocks would be a load that
    moving one to rank 1 strictly lowers; priced at zero there is nothing to lower.
    """
    specs = [MatrixSpec(f"h{i}", (64, 64), holders=(0,)) for i in range(3)]
    a = assign_owners(specs, 2, strategy="canzona", alpha=0.0)
    assert set(a.owner.values()) == {0} and a.comm_bytes == (0, 0)


def test_holders_must_be_eligible() -> None:
    with pytest.raises(ValueError, match="holders must be eligible"):
        MatrixSpec("w", (4, 4), ranks=(0, 1), holders=(2,))
    with pytest.raises(ValueError, match="holders must be sorted"):
        MatrixSpec("w", (4, 4), holders=(1, 0))
    with pytest.raises(ValueError, match="holders must be < num_ranks"):
        assign_owners([MatrixSpec("w", (4, 4), holders=(3,))], 2)


def test_a_pinned_matrix_never_leaves_its_holders() -> None:
    specs = [MatrixSpec(f"h{i}", (64, 64), holders=(0,), pinned=True) for i in range(3)]
    a = assign_owners(specs, 2, strategy="canzona")
    assert set(a.owner.values()) == {0} and a.comm_bytes == (0, 0)
    with pytest.raises(ValueError, match="pinned needs holders"):
        MatrixSpec("w", (4, 4), pinned=True)


def _stacked_cost() -> MeasuredCost:
    """A measured cost whose calls have a fixed part: the consolidation pass runs."""
    shapes = ((128, 128), (256, 128))
    return MeasuredCost(
        base=MuonCost(),
        table=tuple((s, 0.35e-3) for s in shapes),
        batches=tuple((s, 0.3e-3, 0.2e-3) for s in shapes),
    )


@pytest.mark.parametrize("pinned", [True, False])
def test_held_matrices_stay_on_their_holders_when_calls_are_priced(pinned: bool) -> None:
    """Catches: the pass that gathers same-shape matrices on fewer owners (it runs with
    measured costs only) moving a matrix off its holder: pinned experts left their ranks,
    and held ones moved bytes where staying costs nothing and finishes no later."""
    specs = [
        MatrixSpec("e0", (128, 128), holders=(0,), pinned=pinned),
        MatrixSpec("e1", (128, 128), holders=(1,), pinned=pinned),
        MatrixSpec("f0", (256, 128)),
        MatrixSpec("f1", (256, 128)),
    ]
    a = assign_owners(specs, 2, optimizer=_stacked_cost())
    assert (a.owner["e0"], a.owner["e1"]) == (0, 1)
    assert a.comm_bytes == (131072, 131072)  # one f each, nothing for the experts
