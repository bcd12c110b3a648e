"""Hypothesis strategies and small helpers shared by the plan tests."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from hypothesis import strategies as st

from canzona.plan import MatrixSpec

NAME_ALPHABET = "abcdefgh._0123"


@st.composite
def instances(
    draw: st.DrawFn,
    *,
    max_matrices: int = 24,
    max_ranks: int = 8,
    restricted: bool = True,
    three_d: bool = True,
) -> tuple[list[MatrixSpec], int]:
    """A list of specs with unique names and a number of ranks."""
    num_ranks = draw(st.integers(1, max_ranks))
    names = draw(
        st.lists(
            st.text(NAME_ALPHABET, min_size=1, max_size=5),
            min_size=0,
            max_size=max_matrices,
            unique=True,
        )
    )
    specs = []
    for name in names:
        dims = st.integers(1, 48)
        shape: tuple[int, ...] = (draw(dims), draw(dims))
        if three_d and draw(st.integers(0, 5)) == 0:
            shape = (draw(st.integers(1, 4)), *shape)
        ranks = None
        if restricted and draw(st.integers(0, 3)) == 0:
            subset = draw(st.sets(st.integers(0, num_ranks - 1), min_size=1))
            ranks = tuple(sorted(subset))
        specs.append(MatrixSpec(name, shape, draw(st.sampled_from([2, 4])), ranks))
    return specs, num_ranks


def cost_specs(costs: Sequence[int]) -> list[MatrixSpec]:
    """Specs whose AdamW cost is ``12 * cost`` (shape ``(1, cost)``): exact integer instances."""
    return [MatrixSpec(f"m{i:02d}", (1, c)) for i, c in enumerate(costs)]


def brute_force_opt(costs: Sequence[float], num_ranks: int) -> float:
    """The optimal makespan by exhaustive search (first item pinned to rank 0)."""
    if not costs:
        return 0.0
    best = math.inf
    head, tail = costs[0], costs[1:]
    for rest in itertools.product(range(num_ranks), repeat=len(tail)):
        loads = [0.0] * num_ranks
        loads[0] = head
        for c, r in zip(tail, rest, strict=True):
            loads[r] += c
        best = min(best, max(loads))
    return best
