"""Calls that run in pieces: priced per piece, recognised from a third timing, planned for."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from canzona.plan import MatrixSpec, PlanConfig, build_plan
from canzona.plan.cost import MuonCost
from canzona.plan.measured import (
    MeasuredCost,
    load_cost_table,
    piece_size,
    predict_seconds,
    reprice,
    save_cost_table,
)
from canzona.plan.micro_groups import _finish_time

HEAD = (128, 512)
BIG = (512, 2048)
#: An H200's 128x5120 head blocks (calibration line: 0.347 ms + 0.010 ms per block).
LINE = (0.347e-3, 0.010e-3)


def _table(pieces: bool, line: tuple[float, float] = LINE) -> MeasuredCost:
    return MeasuredCost(
        base=MuonCost(),
        table=((HEAD, line[0] / 8 + line[1]), (BIG, 10e-3)),
        batches=((HEAD, *line), (BIG, 0.0, 10e-3)),
        pieces=((HEAD, 8),) if pieces else (),
    )


def test_a_third_timing_tells_pieces_from_one_call() -> None:
    """Catches: longer stacks assumed to keep saving fixed parts (or never to)."""
    fixed, per = LINE
    two_pieces = 2 * fixed + 16 * per
    one_call = fixed + 16 * per
    assert piece_size(8, LINE, two_pieces) == 8
    assert piece_size(8, LINE, 0.9 * two_pieces) == 8  # nearer two pieces than one call
    assert piece_size(8, LINE, one_call) is None
    assert piece_size(8, LINE, 1.1 * one_call) is None
    assert piece_size(8, LINE, (one_call + two_pieces) / 2) is None  # a tie: one call
    assert piece_size(8, (0.0, per), 16 * per) is None  # no fixed part: nothing to tell
    assert piece_size(8, LINE, -1.0) is None  # not timed


def test_a_call_in_pieces_pays_the_fixed_part_per_piece() -> None:
    fixed, per = LINE
    cost, plain = _table(True), _table(False)
    for k in (1, 8, 9, 16, 17, 64, 80):
        assert cost.batch_seconds(*HEAD, k) == pytest.approx(fixed * math.ceil(k / 8) + k * per)
        assert plain.batch_seconds(*HEAD, k) == pytest.approx(fixed + k * per)
    assert cost.batch_seconds(*HEAD, 0) == 0.0
    assert cost.piece_size(*HEAD) == 8 and cost.piece_size(*BIG) is None
    assert cost.calls(*HEAD, 80) == 10 and cost.calls(*BIG, 80) == 1
    # the H200's 64 head blocks: 2.73 ms measured; one call priced 0.99 ms, eight pieces 3.4
    assert plain.batch_seconds(*HEAD, 64) == pytest.approx(0.987e-3)
    assert cost.batch_seconds(*HEAD, 64) == pytest.approx(3.416e-3)


@pytest.mark.parametrize("size", [0, -1, True, 2.5])
def test_a_bad_piece_size_names_itself(size: object) -> None:
    with pytest.raises(ValueError, match=repr(size)):
        MeasuredCost(
            base=MuonCost(),
            table=((HEAD, 1e-4),),
            batches=((HEAD, *LINE),),
            pieces=((HEAD, size),),  # type: ignore[arg-type]
        )


def test_pieces_need_the_shapes_batch_line() -> None:
    with pytest.raises(ValueError, match="128x512 need its batch line"):
        MeasuredCost(base=MuonCost(), table=((HEAD, 1e-4),), pieces=((HEAD, 8),))


def test_pieces_round_trip_and_leave_tables_without_them_as_they_were(tmp_path: Path) -> None:
    """Catches: pieces lost on disk, or a key added to every table (which would change the
    plan digest of every measured plan made before pieces existed)."""
    assert "pieces" not in _table(False).params()
    assert _table(True).params()["pieces"] == [[*HEAD, 8]]
    path = tmp_path / "t.json"
    save_cost_table(path, _table(True), {"device": "test"})
    loaded = load_cost_table(path)
    assert loaded.piece_size(*HEAD) == 8
    assert loaded.params() == _table(True).params()


def test_repricing_fits_calls_in_pieces() -> None:
    """Catches: observed calls in pieces fitted with one fixed part per call."""
    fixed, per = 0.5e-3, 0.02e-3
    seen = {k: fixed * math.ceil(k / 8) + k * per for k in (4, 8, 24)}
    new = reprice(_table(True), {HEAD: seen})
    assert new.piece_size(*HEAD) == 8
    for k in (1, 12, 40):
        assert new.batch_seconds(*HEAD, k) == pytest.approx(fixed * math.ceil(k / 8) + k * per)
    # sizes whose pieces are proportional to k cannot split the parts: scaled instead
    scaled = reprice(_table(True), {HEAD: {16: 2e-3, 32: 4e-3}})
    assert scaled.batch_seconds(*HEAD, 32) == pytest.approx(4e-3)
    assert scaled.batch_seconds(*HEAD, 16) == pytest.approx(2e-3)


def test_micro_groups_count_a_fixed_part_per_piece() -> None:
    """Catches: a group's calls priced with one fixed part however many pieces they run."""
    parts = [(1.0, 0.1)] * 10
    classes = [("0", 128, 512, 4)] * 10
    owners = [0] * 10
    assert _finish_time([range(10)], owners, classes, parts) == pytest.approx(2.0)
    assert _finish_time([range(10)], owners, classes, parts, [4] * 10) == pytest.approx(4.0)
    assert _finish_time([range(10)], owners, classes, parts, [None] * 10) == pytest.approx(2.0)


BIG_S = 2e-3


def _specs() -> list[MatrixSpec]:
    """One large matrix and 64 head blocks, none held by a rank: owners are free."""
    return [MatrixSpec("big", BIG)] + [MatrixSpec(f"h{i:02d}", HEAD) for i in range(64)]


def _costs(pieces: bool) -> MeasuredCost:
    """:func:`_table` with a large matrix of ``BIG_S`` seconds."""
    return MeasuredCost(
        base=MuonCost(),
        table=((HEAD, LINE[0] / 8 + LINE[1]), (BIG, BIG_S)),
        batches=((HEAD, *LINE), (BIG, 0.0, BIG_S)),
        pieces=((HEAD, 8),) if pieces else (),
    )


def _makespan(specs: list[MatrixSpec], world: int, plan_cost: MeasuredCost) -> float:
    """The busiest rank's seconds of ``plan_cost``'s plan, priced with calls in pieces."""
    plan = build_plan(specs, world, PlanConfig(strategy="canzona"), optimizer=plan_cost)
    ranks = {s.name: plan.assignment.computing_ranks(s.name) for s in plan.specs}
    rounds = [g.names for g in plan.micro_groups]
    return max(predict_seconds(list(plan.specs), rounds, lambda n: ranks[n], _costs(True), world))


def test_the_planner_stacks_no_more_than_pieces_repay() -> None:
    """Catches: owners chosen as if a call on any number of head blocks paid one fixed part.

    Priced as one call, all 64 blocks fit beside the large matrix (2 ms) on the other rank
    (0.35 + 0.64 ms); they run in 8 pieces there, 3.4 ms. A planner that knows it moves
    blocks to the large matrix's rank until the two ranks are about even.
    """
    fixed, per = LINE

    def blocks(h: int) -> float:
        return math.ceil(h / 8) * fixed + h * per

    best = min(max(BIG_S + blocks(h), blocks(64 - h)) for h in range(65))
    naive = _makespan(_specs(), 2, _costs(False))
    aware = _makespan(_specs(), 2, _costs(True))
    assert naive == pytest.approx(blocks(64))  # every block on one rank: 3.42 ms
    assert best == pytest.approx(BIG_S + blocks(16))  # 2.85 ms
    assert aware <= 1.02 * best


def test_a_longer_stack_than_twice_the_batch_decides_too() -> None:
    """The H200's GPU check: 64 head blocks of 128x5120 in 2.73 ms, of 5120x128 in 3.13 ms,
    against the tables' lines (0.347 + 0.010 ms and 0.139 + 0.041 ms per block)."""
    assert piece_size(8, LINE, 2.73e-3, stack=64) == 8  # 8 pieces: 3.42 ms; one call 0.99
    assert piece_size(8, (0.139e-3, 0.041e-3), 3.13e-3, stack=64) is None  # 2.76 against 3.74
    assert piece_size(8, LINE, 1e-3, stack=8) is None  # not longer than the batch
