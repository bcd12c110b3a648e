"""Re-pricing a measured cost model by observed calls (``plan.measured.reprice``)."""

from __future__ import annotations

import math

import pytest

from canzona.plan import cost_model
from canzona.plan.measured import MeasuredCost, reprice


def _model() -> MeasuredCost:
    return MeasuredCost(
        base=cost_model("muon"),
        table=(((16, 16), 1e-3), ((24, 8), 2e-3), ((8, 24), 3e-3)),
        fit=(-20.0, 1.0),
        batches=(((16, 16), 5e-4, 1e-3), ((8, 24), 1e-3, 2e-3)),
    )


def test_two_batch_sizes_give_the_line_through_them() -> None:
    """Catches: the calibrated line kept (or only scaled) when the steps ran a shape at two
    batch sizes."""
    got = reprice(_model(), {(16, 16): {1: 3e-3, 3: 7e-3}})
    assert got.batch_seconds(16, 16, 1) == pytest.approx(3e-3, rel=1e-12)
    assert got.batch_seconds(16, 16, 2) == pytest.approx(5e-3, rel=1e-12)
    assert got.batch_seconds(16, 16, 3) == pytest.approx(7e-3, rel=1e-12)
    # the price per matrix at the largest batch seen (what a planned item costs without a line)
    assert got.seconds(16, 16) == pytest.approx(7e-3 / 3, rel=1e-12)


def test_three_batch_sizes_give_the_least_squares_line() -> None:
    got = reprice(_model(), {(16, 16): {1: 2e-3, 2: 5e-3, 4: 9e-3}})
    # the least-squares line through (1, 2), (2, 5) and (4, 9) ms, written out
    mk, mt = 7 / 3, 16e-3 / 3
    per = ((1 - mk) * (2e-3 - mt) + (2 - mk) * (5e-3 - mt) + (4 - mk) * (9e-3 - mt)) / (
        (1 - mk) ** 2 + (2 - mk) ** 2 + (4 - mk) ** 2
    )
    fixed = mt - per * mk
    assert got._lines[(16, 16)] == pytest.approx((fixed, per), rel=1e-12)


def test_one_batch_size_scales_the_line_through_the_observed_call() -> None:
    """Catches: the scale applied to the table only (the line, which prices the batches,
    unchanged), or the scale taken against the wrong batch size."""
    got = reprice(_model(), {(8, 24): {2: 10e-3}})  # calibrated 1 + 2 x 2 = 5 ms: scale 2
    assert got._lines[(8, 24)] == pytest.approx((2e-3, 4e-3), rel=1e-12)
    assert got.batch_seconds(8, 24, 2) == pytest.approx(10e-3, rel=1e-12)
    assert got.seconds(8, 24) == pytest.approx(6e-3, rel=1e-12)


def test_one_batch_size_without_a_line_scales_the_price_per_matrix() -> None:
    got = reprice(_model(), {(24, 8): {3: 9e-3}})  # calibrated 3 x 2 ms: scale 1.5
    assert got.seconds(24, 8) == pytest.approx(3e-3, rel=1e-12)
    assert got.batch_seconds(24, 8, 1) == pytest.approx(3e-3, rel=1e-12)
    assert (24, 8) not in got._lines


def test_a_negative_fixed_part_falls_back_to_scaling() -> None:
    """(1, 1 ms) and (3, 7 ms) give a line with fixed part -2 ms: not a call's cost. The
    largest batch then scales the calibrated price."""
    got = reprice(_model(), {(24, 8): {1: 1e-3, 3: 7e-3}})
    assert (24, 8) not in got._lines
    assert got.batch_seconds(24, 8, 3) == pytest.approx(7e-3, rel=1e-12)


def test_a_fitted_shape_gets_a_table_entry_and_the_rest_stays() -> None:
    model = _model()
    fitted = model.seconds(32, 32)
    got = reprice(model, {(32, 32): {1: 4 * fitted}})
    assert got.seconds(32, 32) == pytest.approx(4 * fitted, rel=1e-12)
    assert got.seconds(24, 8) == model.seconds(24, 8)
    assert got._lines[(16, 16)] == model._lines[(16, 16)]
    assert (got.fit, got.class_fits, got.bytes_per_s) == (
        model.fit,
        model.class_fits,
        model.bytes_per_s,
    )
    assert math.isclose(got.seconds(64, 64), model.seconds(64, 64))


def test_nothing_observed_changes_nothing() -> None:
    model = _model()
    assert reprice(model, {}).params() == model.params()
    assert reprice(model, {(16, 16): {}}).params() == model.params()


def test_calls_timed_at_zero_or_empty_batches_are_ignored() -> None:
    """Catches: a zero-second call (a timer's resolution) re-pricing a shape to nothing."""
    model = _model()
    assert reprice(model, {(16, 16): {4: 0.0}, (24, 8): {0: 1e-3}}).params() == model.params()
