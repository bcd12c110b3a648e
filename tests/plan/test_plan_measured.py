"""MeasuredCost: seconds from a table, a fit, transfer time, batch calls; a JSON round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from canzona.plan import (
    GroupedCost,
    MatrixSpec,
    MuonCost,
    PlanConfig,
    assign_owners,
    build_plan,
)
from canzona.plan.measured import (
    MeasuredCost,
    batch_line,
    class_fits,
    fit_loglog,
    load_cost_table,
    owner_transfer_share,
    predict_seconds,
    save_cost_table,
    shape_classes,
)


def test_fit_recovers_a_power_law() -> None:
    points = [(x, 3e-9 * x**0.8) for x in (1e6, 1e7, 1e8)]
    a, b = fit_loglog(points)
    assert b == pytest.approx(0.8, rel=1e-12)
    assert math.exp(a) == pytest.approx(3e-9, rel=1e-9)


def test_one_point_fits_time_proportional_to_work() -> None:
    assert fit_loglog([(1e6, 2e-3)])[1] == 1.0


def test_table_then_fit_then_transfer() -> None:
    base = MuonCost()
    cost = MeasuredCost(base=base, table=(((64, 64), 2e-3),), fit=(math.log(1e-9), 1.0))
    spec = MatrixSpec("w", (64, 64))
    assert cost.flops(spec) == 2e-3  # measured
    other = MatrixSpec("v", (32, 64))
    assert cost.flops(other) == pytest.approx(1e-9 * base.flops(other), rel=1e-12)  # fitted
    moving = MeasuredCost(base=base, table=cost.table, bytes_per_s=1e6)
    assert moving.flops(spec) == pytest.approx(2e-3 + spec.nbytes / 1e6, rel=1e-12)


def test_a_held_matrix_moves_nothing_so_costs_no_transfer() -> None:
    """A matrix that a rank holds whole is owned there and moves no bytes. Catches: its
    payload's transfer time counted anyway (rank 0 then looks full with the held matrix
    alone, both free ones go to rank 1 and the busiest rank's true load is 22.2, not 21.1)."""
    base = MuonCost()
    rate = 64 * 64 * 4 / 5.0  # a 64 x 64 fp32 payload takes 5 s
    cost = MeasuredCost(base=base, table=(((64, 64), 10.0), ((64, 65), 6.0)), bytes_per_s=rate)
    held = MatrixSpec("a", (64, 64), holders=(0,))
    free = [MatrixSpec("b", (64, 65)), MatrixSpec("c", (64, 65))]
    assert cost.flops(held) == 10.0
    assert cost.flops(free[0]) == pytest.approx(6.0 + 64 * 65 * 4 / rate, rel=1e-12)
    out = assign_owners([held, *free], 2, optimizer=cost)
    assert out.owner["a"] == 0 and out.owner["b"] != out.owner["c"]
    assert max(out.loads) == pytest.approx(10.0 + 6.0 + 65 / 64 * 5.0, rel=1e-12)


def test_owning_adds_a_share_of_the_transfer_that_grows_with_the_ranks() -> None:
    """Every rank moves ``2 / W`` of a matrix whoever owns it; its owner ``2 (W - 2) / W``
    more. Catches: two ranks charging the owner a transfer that every rank pays alike (the
    owner of a big matrix then takes less math than the other rank)."""
    assert [owner_transfer_share(w) for w in (1, 2, 4, 8)] == [0.0, 0.0, 0.5, 0.75]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"num_ranks must be a positive int, got {bad!r}"):
            owner_transfer_share(bad)  # type: ignore[arg-type]
    spec = MatrixSpec("w", (64, 64))
    table = (((64, 64), 2e-3),)
    half = MeasuredCost(base=MuonCost(), table=table, bytes_per_s=1e6, transfer_share=0.5)
    assert half.flops(spec) == pytest.approx(2e-3 + 0.5 * spec.nbytes / 1e6, rel=1e-12)
    none = MeasuredCost(base=MuonCost(), table=table, bytes_per_s=1e6, transfer_share=0)
    assert none.flops(spec) == 2e-3
    assert none.params() != half.params()  # the digest covers the share
    for bad_share in (-0.1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="transfer_share must be a number in"):
            MeasuredCost(base=MuonCost(), table=table, transfer_share=bad_share)  # type: ignore[arg-type]
    # math 6 s and eight of 1 s on two ranks: 7 s each, the big one with a small one; with
    # its 3 s transfer charged to its owner the big one sits alone
    specs = [MatrixSpec("big", (64, 64))] + [MatrixSpec(f"s{i}", (8, 8)) for i in range(8)]
    seconds = (((64, 64), 6.0), ((8, 8), 1.0))
    slow_link = 64 * 64 * 4 / 3.0
    for share, with_big in ((0.0, 1), (1.0, 0)):
        cost = MeasuredCost(
            base=MuonCost(), table=seconds, bytes_per_s=slow_link, transfer_share=share
        )
        out = assign_owners(specs, 2, optimizer=cost)
        big = out.owner["big"]
        assert sum(out.owner[f"s{i}"] == big for i in range(8)) == with_big, share


def test_measured_seconds_not_flops_drive_the_owners() -> None:
    """Two shapes whose FLOPs say "equal" but whose measured times differ 3x."""
    specs = [MatrixSpec(f"a{i}", (64, 64)) for i in range(3)] + [
        MatrixSpec(f"b{i}", (64, 64 + 1)) for i in range(3)
    ]
    flops = assign_owners(specs, 2, optimizer=MuonCost())
    slow = MeasuredCost(base=MuonCost(), table=(((64, 64), 3.0), ((64, 65), 1.0)))
    timed = assign_owners(specs, 2, optimizer=slow)
    assert sorted(timed.loads) == [6.0, 6.0]  # two slow | one slow and three fast

    def counts(a: object) -> list[int]:
        owners = list(a.owner.values())  # type: ignore[attr-defined]
        return sorted(owners.count(r) for r in (0, 1))

    assert counts(flops) == [3, 3]  # FLOPs see six nearly equal matrices
    assert counts(timed) == [2, 4]


def test_the_digest_covers_the_table() -> None:
    specs = [MatrixSpec("w", (64, 64))]
    one = MeasuredCost(base=MuonCost(), table=(((64, 64), 1e-3),))
    two = MeasuredCost(base=MuonCost(), table=(((64, 64), 2e-3),))
    digest = [build_plan(specs, 2, optimizer=c).digest() for c in (one, two)]
    assert digest[0] != digest[1]


def test_the_digest_covers_the_batch_lines() -> None:
    specs = [MatrixSpec("w", (64, 64))]
    table = (((64, 64), 1e-3),)
    one = MeasuredCost(base=MuonCost(), table=table, batches=(((64, 64), 4e-4, 6e-4),))
    two = MeasuredCost(base=MuonCost(), table=table, batches=(((64, 64), 5e-4, 5e-4),))
    digest = [build_plan(specs, 2, optimizer=c).digest() for c in (one, two)]
    assert digest[0] != digest[1]


def test_a_line_through_two_batch_sizes() -> None:
    assert batch_line((1, 3.0), (4, 6.0)) == (2.0, 1.0)  # fixed 2 s, 1 s per matrix
    assert batch_line((4, 6.0), (1, 3.0)) == (2.0, 1.0)  # in either order
    assert batch_line((1, 3.0), (2, 6.0)) == (0.0, 3.0)  # no fixed cost
    assert batch_line((1, 3.0), (2, 2.9)) is None  # noise: a bigger batch is cheaper
    assert batch_line((2, 3.0), (4, 7.0)) is None  # the line would start below zero
    assert batch_line((2, 3.0), (2, 3.5)) is None  # one batch size
    assert batch_line((0, 0.0), (2, 3.0)) is None  # an empty batch is not a timing


def test_a_call_costs_its_fixed_part_once() -> None:
    cost = MeasuredCost(
        base=MuonCost(), table=(((64, 64), 2.0), ((32, 32), 1.5)), batches=(((64, 64), 1.0, 1.5),)
    )
    assert cost.batch_seconds(64, 64, 1) == 2.5
    assert cost.batch_seconds(64, 64, 4) == 7.0
    assert cost.batch_seconds(64, 64, 0) == 0.0
    assert cost.batch_seconds(32, 32, 4) == 6.0  # no line: k times the table's seconds
    assert cost.flops(MatrixSpec("w", (64, 64))) == 2.0  # the planner's price is unchanged
    with pytest.raises(ValueError, match="batch seconds must be finite"):
        MeasuredCost(base=MuonCost(), table=(), batches=(((8, 8), -1.0, 1.0),))


def test_the_prediction_prices_the_batches_each_round_forms() -> None:
    """Per micro-group and rank, one call per (param group, shape): fixed once per call."""
    line = MeasuredCost(base=MuonCost(), table=(), batches=(((64, 64), 1.0, 2.0),))
    other = MeasuredCost(base=MuonCost(), table=(((64, 64), 10.0),))
    cost = GroupedCost({"0": line, "1": other})
    specs = [
        MatrixSpec("a", (64, 64), cost_key="0"),
        MatrixSpec("b", (64, 64), cost_key="0"),
        MatrixSpec("c", (64, 64), cost_key="0"),
        MatrixSpec("s", (3, 64, 64), cost_key="0"),  # a stack: three matrices, one call
        MatrixSpec("d", (64, 64), cost_key="1"),  # another param group: its own call
    ]
    owner = {"a": 0, "b": 0, "c": 0, "s": 1, "d": 0}
    together = predict_seconds(specs, [["a", "b", "c", "s", "d"]], lambda n: (owner[n],), cost, 2)
    assert together == [1.0 + 3 * 2.0 + 10.0, 1.0 + 3 * 2.0]
    apart = predict_seconds(specs, [["a", "b"], ["c", "s", "d"]], lambda n: (owner[n],), cost, 2)
    assert apart == [(1.0 + 2 * 2.0) + (1.0 + 2.0) + 10.0, 1.0 + 3 * 2.0]
    every = predict_seconds(specs[:2], [["a", "b"]], lambda n: (0, 1), cost, 2)
    assert every == [5.0, 5.0]  # replicated: every computing rank runs the call
    flops = GroupedCost({"0": MuonCost()})
    with pytest.raises(ValueError, match="needs measured costs"):
        predict_seconds(specs[:1], [["a"]], lambda n: (0,), flops, 1)


def test_save_and_load(tmp_path: Path) -> None:
    cost = MeasuredCost(
        base=MuonCost(ns_steps=3),
        table=(((8, 16), 1.5e-4),),
        fit=(-20.0, 0.9),
        bytes_per_s=5e8,
        transfer_share=0.5,
        batches=(((8, 16), 5e-5, 1e-4),),
        class_fits=(("side", 8, -21.0, 0.8),),
    )
    path = tmp_path / "table.json"
    save_cost_table(path, GroupedCost({"0": cost}), {"device": "cpu"})
    loaded = load_cost_table(path)
    assert loaded.params() == cost.params()
    # a table saved before the share existed charged owners the whole transfer: it still does
    body = json.loads(path.read_text())
    del body["models"]["0"]["transfer_share"]
    path.write_text(json.dumps(body))
    assert load_cost_table(path).transfer_share == 1.0
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a canzona cost table"):
        load_cost_table(path)


def test_bad_seconds_are_refused() -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        MeasuredCost(base=MuonCost(), table=(((8, 8), float("nan")),))


@pytest.mark.parametrize("fit", [(math.nan, 1.0), (0.0, math.inf), (1.0,), (1.0, 2.0, 3.0)])
def test_a_fit_that_is_not_two_finite_coefficients_is_refused(fit: tuple[float, ...]) -> None:
    """Catches: a NaN fit accepted (LPT then never ends: NaN loads never equal themselves)."""
    with pytest.raises(ValueError, match="fit must be two finite coefficients"):
        MeasuredCost(base=MuonCost(), table=(), fit=fit)  # type: ignore[arg-type]


def test_a_fit_that_predicts_no_finite_time_is_named() -> None:
    cost = MeasuredCost(base=MuonCost(), table=(), fit=(1000.0, 1.0))
    with pytest.raises(ValueError, match="predicts no finite time for 64x128"):
        build_plan([MatrixSpec("w", (64, 128))], 2, optimizer=cost)


def test_costs_that_are_not_finite_are_refused_before_the_greedy() -> None:
    """Catches: a custom model's NaN or inf cost reaching LPT, which then never ends."""

    class Broken(MuonCost):
        def flops(self, spec: MatrixSpec) -> float:
            return math.nan if spec.name == "b" else super().flops(spec)

    specs = [MatrixSpec("a", (8, 8)), MatrixSpec("b", (8, 16)), MatrixSpec("c", (8, 8))]
    with pytest.raises(ValueError, match=r"prices matrix 'b' \(8, 16\) at nan"):
        assign_owners(specs, 2, optimizer=Broken())


@pytest.mark.parametrize(
    ("where", "value"), [("pieces", 2.5), ("class_fits", 64.9), ("table", 8.5), ("pieces", True)]
)
def test_the_loader_refuses_what_is_not_an_integer(tmp_path: Path, where: str, value: Any) -> None:
    """Catches: ``int()`` truncating a piece size of 2.5 to 2 or a class of 64.9 to 64."""
    cost = MeasuredCost(
        base=MuonCost(),
        table=(((8, 16), 1.5e-4),),
        batches=(((8, 16), 5e-5, 1e-4),),
        pieces=(((8, 16), 2),),
        class_fits=(("side", 8, -21.0, 0.8),),
    )
    path = tmp_path / "table.json"
    save_cost_table(path, GroupedCost({"0": cost}), {})
    body = json.loads(path.read_text())
    row = body["models"]["0"][where][0]
    row[{"pieces": 2, "class_fits": 1, "table": 0}[where]] = value
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=f"cost table: expected an integer, got {value}"):
        load_cost_table(path)


def test_micro_groups_price_held_and_moved_matrices_apart_in_any_order() -> None:
    """A held matrix moves nothing, so its call costs no transfer; one of the same shape
    that moves does. Catches: their prices cached by shape alone, so that whichever came
    first in the input priced both and the micro-groups changed with the input's order."""
    cost = MeasuredCost(
        base=MuonCost(),
        table=(((64, 64), 2e-4), ((64, 128), 4e-4)),
        batches=(((64, 64), 1e-4, 1e-4), ((64, 128), 1e-4, 3e-4)),
        bytes_per_s=1e8,
    )
    held = {"m1": (2,), "m6": (2,)}
    shapes = [(64, 128), (64, 64), (64, 64), (64, 128), (64, 64), (64, 128), (64, 128)]
    specs = [
        MatrixSpec(f"m{i}", shape, holders=held.get(f"m{i}")) for i, shape in enumerate(shapes)
    ]
    config = PlanConfig(capacity_mb=0.06)
    plan = build_plan(specs, 3, config, optimizer=cost)
    again = build_plan(specs[::-1], 3, config, optimizer=cost)
    assert dict(again.assignment.owner) == dict(plan.assignment.owner)
    assert [g.names for g in again.micro_groups] == [g.names for g in plan.micro_groups]
    assert len(plan.micro_groups) > 1


def test_shape_classes_side_then_aspect() -> None:
    assert shape_classes(128, 5120) == (("side", 128), ("aspect", 5))
    assert shape_classes(5120, 128) == shape_classes(128, 5120)  # transposed: one class
    assert shape_classes(64, 64) == (("side", 64), ("aspect", 0))


def test_an_untimed_shape_is_priced_by_its_class_first() -> None:
    """Catches: one fit over every shape where a class has its own (kernel efficiency
    depends on the shape: a fit over square matrices misprices a thin head block)."""
    base = MuonCost()
    work = {s: base.flops(MatrixSpec("s", s)) for s in ((32, 64), (32, 128), (64, 64), (128, 128))}
    # the 32-row shapes run at 1e-9 s/FLOP, the square ones at 4e-9 s/FLOP
    points = [(s, w, (1e-9 if s[0] == 32 else 4e-9) * w) for s, w in work.items()]
    fits = class_fits(points)
    assert {(k, v) for k, v, _, _ in fits} == {("side", 32), ("aspect", 0)}
    cost = MeasuredCost(
        base=base,
        table=tuple((s, t) for s, _, t in points),
        fit=fit_loglog([(w, t) for _, w, t in points]),
        class_fits=fits,
    )
    thin = (32, 4096)  # side 32: the thin class's rate
    assert cost.seconds(*thin) == pytest.approx(1e-9 * base.flops(MatrixSpec("s", thin)))
    square = (256, 256)  # no side-256 class: the square aspect class's rate
    assert cost.seconds(*square) == pytest.approx(4e-9 * base.flops(MatrixSpec("s", square)))
    both = (32, 32)  # side 32 and square: the more specific class, the side, prices it
    assert cost.seconds(*both) == pytest.approx(1e-9 * base.flops(MatrixSpec("s", both)))
    other = (48, 200)  # neither class: the fit over every shape
    a, b = cost.fit
    want = math.exp(a + b * math.log(base.flops(MatrixSpec("s", other))))
    assert cost.seconds(*other) == pytest.approx(want, rel=1e-12)
    # one point in a class gives no slope: no fit for it
    assert class_fits([((16, 16), 1e6, 1e-3)]) == ()
    # nor do two shapes of one work (a matrix and its transpose): two points, no slope
    assert class_fits([((16, 32), 1e6, 1e-3), ((32, 16), 1e6, 2e-3)]) == ()


def test_the_digest_covers_the_class_fits() -> None:
    specs = [MatrixSpec("w", (32, 64))]
    one = MeasuredCost(base=MuonCost(), table=(), class_fits=(("side", 32, -20.0, 1.0),))
    two = MeasuredCost(base=MuonCost(), table=(), class_fits=(("side", 32, -19.0, 1.0),))
    digest = [build_plan(specs, 2, optimizer=c).digest() for c in (one, two)]
    assert digest[0] != digest[1]
    with pytest.raises(ValueError, match="class is"):
        MeasuredCost(base=MuonCost(), table=(), class_fits=(("rows", 32, -20.0, 1.0),))
    with pytest.raises(ValueError, match="must be finite"):
        MeasuredCost(base=MuonCost(), table=(), class_fits=(("side", 32, float("inf"), 1.0),))


def test_prices_that_add_up_past_a_float_fail_with_a_value_error(tmp_path: Path) -> None:
    """Catches: each matrix's price checked finite, but their sum overflowing ``fsum``
    (OverflowError from deep inside the planner), and a table whose numbers do not fit a
    float, or nested past the parser's depth, failing with something else than the table
    error the CLI reports."""
    specs = [MatrixSpec(name, (64, 64)) for name in "abc"]  # 8.2e307 s each, from the fit
    steep = MeasuredCost(base=MuonCost(), table=(((8, 8), 1e-4),), fit=(709.0, 0.0))
    with pytest.raises(ValueError, match=r"the matrices' costs add up past a float's range"):
        build_plan(specs, 2, optimizer=steep)
    good = tmp_path / "good.json"
    save_cost_table(good, steep, {})
    body = json.loads(good.read_text())
    body["models"]["0"]["fit"] = [10**400, 1]
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="is not a canzona cost table: int too large"):
        load_cost_table(huge)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="is not a canzona cost table: nested too deeply"):
        load_cost_table(deep)


def test_equal_tables_have_one_digest() -> None:
    """Catches: ``0``, ``0.0`` and ``-0.0`` in a table's fits or transfer rate written as
    they were given, so that tables that compare equal gave plans of different digests."""
    specs = [MatrixSpec("a", (64, 64)), MatrixSpec("b", (64, 128))]

    def table(zero: float) -> MeasuredCost:
        return MeasuredCost(
            base=MuonCost(),
            table=(((64, 64), 1e-4),),
            fit=(zero, 1),
            class_fits=(("side", 64, zero, 1),),
            bytes_per_s=zero,
        )

    tables = [table(0), table(0.0), table(-0.0)]
    assert tables[0] == tables[1] == tables[2]
    assert len({build_plan(specs, 2, optimizer=t).digest() for t in tables}) == 1
