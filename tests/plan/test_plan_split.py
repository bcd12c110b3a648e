"""Split: the blocks' spans and shapes along either dimension, and sizes that do not tile."""

from __future__ import annotations

import pytest

from canzona.plan import Split


def test_spans_tile_the_dimension_in_order() -> None:
    """Catches: a stop off by one (blocks that skip or repeat a row) and equal blocks
    counted from the wrong end."""
    assert Split(0, sizes=(4, 2, 2)).spans(8) == ((0, 4), (4, 6), (6, 8))
    assert Split(1, size=3).spans(9) == ((0, 3), (3, 6), (6, 9))


def test_shapes_keep_the_other_dimension_whole() -> None:
    """Catches: a column split (``dim=1``) giving ``(block, n)`` instead of ``(m, block)``."""
    assert Split(0, sizes=(12, 4, 4)).shapes(20, 8) == ((12, 8), (4, 8), (4, 8))
    assert Split(1, sizes=(6, 4, 4)).shapes(8, 14) == ((8, 6), (8, 4), (8, 4))


@pytest.mark.parametrize(
    ("split", "extent", "message"),
    [
        (Split(0, sizes=(4, 2)), 8, r"\(4, 2\) sum to 6, but dimension 0 .* has 8"),
        (Split(0, sizes=(4, 6)), 8, r"\(4, 6\) sum to 10, but dimension 0 .* has 8"),
        (Split(1, size=3), 8, "not a multiple of Split size 3"),
    ],
)
def test_blocks_that_do_not_tile_name_the_parameter(
    split: Split, extent: int, message: str
) -> None:
    """Catches: sizes that cover less (or more) than the dimension accepted, the rest of
    the matrix silently left out of every block."""
    with pytest.raises(ValueError, match=f"parameter 'w'.*{message}"):
        split.spans(extent, name="parameter 'w'")
