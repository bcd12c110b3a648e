"""Holders: a matrix some ranks hold whole starts there and moves only to lower the makespan."""

from __future__ import annotations

import pytest

from canzona.plan import MatrixSpec, assign_owners


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
