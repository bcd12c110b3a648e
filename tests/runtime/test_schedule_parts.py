"""Merging a delivery's targets and a send list's buffer ranges: only what is adjacent."""

from __future__ import annotations

from canzona.runtime.payload_layout import add_part
from canzona.runtime.schedule_parts import Target, merge_targets


def test_targets_of_two_parameters_never_merge() -> None:
    """Catches: two row blocks that follow each other in a delivery but belong to two
    parameters (block 0 of one, rows 0-4, then block 1 of the next, rows 4-8) merged into
    one target on the first: the second's direction written into the first's rows."""
    assert merge_targets(Target(0, 0, 1, (0, 4)), Target(1, 0, 1, (4, 8))) is None
    assert merge_targets(Target(0, 0, 1), Target(1, 1, 1)) is None  # two stacks' matrices
    assert merge_targets(Target(0, 0, 1, (0, 4)), Target(0, 0, 1, (4, 8))) == Target(
        0, 0, 2, (0, 8)
    )
    assert merge_targets(Target(0, 2, 1), Target(0, 3, 1)) == Target(0, 2, 2)
    assert merge_targets(Target(0, 0, 1, (0, 4)), Target(0, 0, 1, (5, 9))) is None  # a gap


def test_send_ranges_of_two_buffers_never_merge() -> None:
    """Catches: a range of one buffer class extended by the next class's range that starts
    at the same offset (its own buffer): the receiver got the first buffer's bytes."""
    parts: list = [[0, 0, 4]]
    classes: list[int | None] = [0]
    add_part(parts, (1, 4, 4), classes, 1)
    assert parts == [[0, 0, 4], [1, 4, 4]]
    add_part(parts, (1, 8, 2), classes, 1)  # follows the last range of its own class: extended
    assert parts == [[0, 0, 4], [1, 4, 6]]
    assert classes == [0, 1]
