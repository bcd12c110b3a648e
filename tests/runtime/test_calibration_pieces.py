"""A calibration's third timing: full batches timed again at twice their size (pieces)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import canzona
from canzona.plan.cost import MuonCost
from canzona.plan.measured import MeasuredCost
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import timing
from canzona.runtime.calibrate import MAX_BATCH, Shape, calibrate
from canzona.runtime.calibration_cache import DiskCache
from canzona.runtime.watchdog import Watchdog

CPU = torch.device("cpu")
#: A shape whose calls run in pieces of MAX_BATCH (as CUDA-graph replays do), one whose
#: calls pay one fixed part however long, and one that owners stack only four of.
PIECES, ONE_CALL, SHORT = (16, 16), (24, 8), (8, 24)
FIXED_S, PER_S = 2e-3, 0.1e-3


def _fake_once(self: timing.Call) -> float:
    """Deterministic seconds of a call: the fixed part once, or once per piece."""
    _, m, n = self.full.shape
    calls = math.ceil(self.k / MAX_BATCH) if (m, n) == PIECES else 1
    return FIXED_S * calls + PER_S * self.k


def _shapes() -> list[Shape]:
    full = [Shape(0, *s, MAX_BATCH, torch.float32, 8 * MAX_BATCH) for s in (PIECES, ONE_CALL)]
    return [*full, Shape(0, *SHORT, 4, torch.float32, 8)]


def _calibrate(monkeypatch: Any, **kw: Any) -> tuple[MeasuredCost, list[tuple[int, ...]]]:
    """One rank's calibration of :func:`_shapes` with fake call times; the sizes it ran."""
    opt = canzona.Muon([nn.Parameter(torch.zeros(8, 8))], lr=0.02, ns_dtype=torch.float32)
    params, _, gids = opt._flat()
    table = opt._step_table(params, gids)
    sizes: list[tuple[int, ...]] = []

    def compute(batch: Any, full: torch.Tensor) -> torch.Tensor:
        sizes.append(tuple(full.shape))
        return torch.zeros_like(full)

    monkeypatch.setattr(timing.Call, "once", _fake_once)
    monkeypatch.setattr(calibrate_module, "_eviction_seconds", lambda device: 0.0)
    calibrate_module._CACHE.clear()
    try:
        cost = calibrate(
            _shapes(),
            table,
            compute,
            {0: MuonCost()},
            watchdog=Watchdog(None, 0, 1, 600.0),
            device=CPU,
            budget_s=10.0,
            **kw,
        )
    finally:
        calibrate_module._CACHE.clear()
    model = cost.models["0"]
    assert isinstance(model, MeasuredCost)
    return model, sizes


def test_twice_a_full_batch_shows_calls_in_pieces(monkeypatch: Any) -> None:
    """Catches: a third timing never taken, taken for stacks owners never fill, or read the
    wrong way round (pieces where one call keeps saving, or none where it does not)."""
    model, sizes = _calibrate(monkeypatch, pieces=True)
    doubled = {s for s in sizes if s[0] == 2 * MAX_BATCH}
    assert doubled == {(2 * MAX_BATCH, *PIECES), (2 * MAX_BATCH, *ONE_CALL)}
    assert model.piece_size(*PIECES) == MAX_BATCH
    assert model.piece_size(*ONE_CALL) is None and model.piece_size(*SHORT) is None
    for k in (1, 8, 9, 40):
        want = FIXED_S * math.ceil(k / MAX_BATCH) + PER_S * k
        assert model.batch_seconds(*PIECES, k) == pytest.approx(want)
        assert model.batch_seconds(*ONE_CALL, k) == pytest.approx(FIXED_S + PER_S * k)


def test_a_cpu_calibration_times_no_third_size_by_default(monkeypatch: Any) -> None:
    """The CPU's batched kernels keep their economy of scale: no pieces, no extra timing."""
    model, sizes = _calibrate(monkeypatch)
    assert max(s[0] for s in sizes) == MAX_BATCH
    assert "pieces" not in model.params()


def test_the_third_timing_is_cached(monkeypatch: Any, tmp_path: Path) -> None:
    """Catches: a cache hit that drops the third timing (its pieces lost on the next job)."""
    cache = DiskCache(tmp_path, "cpu:test")
    first, _ = _calibrate(monkeypatch, pieces=True, cache=cache)
    entries = cache.load()
    assert sorted(e[2] > 0 for e in entries.values()) == [False, True, True]
    again, sizes = _calibrate(monkeypatch, pieces=True, cache=cache)
    assert sizes == []  # every shape from the cache
    assert again.params() == first.params() and again.piece_size(*PIECES) == MAX_BATCH
