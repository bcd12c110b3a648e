"""The calibration's caches: settings in the key, and timings on disk for a later job."""

from __future__ import annotations

import itertools
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import calibration_cache as cache_module
from canzona.runtime import calibration_keys
from canzona.runtime.calibrate import Shape, entry_key, time_shape
from canzona.runtime.calibration_cache import FORMAT, DiskCache

from _cases import CALIBRATION_SHAPES, full_tensors, grad_steps, plan, set_grads, sharded_params
from _dist import mesh

SHAPES = CALIBRATION_SHAPES
CPU = torch.device("cpu")


def _table(cls: type, **kw: Any) -> Any:
    """The step table of a one-matrix optimizer of ``cls`` with ``kw``."""
    opt = cls([nn.Parameter(torch.zeros(8, 8))], **kw)
    params, _, gids = opt._flat()
    return opt._step_table(params, gids)


def test_entry_keys_cover_a_groups_settings_but_not_its_learning_rate() -> None:
    """Catches: timings keyed without the param group's settings (Shampoo's root dtype is
    in no cost model, so a table of float64 roots would reuse float32 timings)."""
    shape = Shape(0, 8, 8, 1, torch.float32)
    base = entry_key(shape, _table(canzona.Shampoo, lr=0.01), CPU)
    assert entry_key(shape, _table(canzona.Shampoo, lr=0.02), CPU) == base
    assert entry_key(shape, _table(canzona.Shampoo, lr=0.01, root_dtype=torch.float64), CPU) != base
    assert entry_key(shape, _table(canzona.Shampoo, lr=0.01, grafting="none"), CPU) != base
    assert entry_key(Shape(0, 8, 8, 2, torch.float32), _table(canzona.Shampoo), CPU) != base


def test_entry_keys_count_a_scaling_number_by_its_range_not_its_value() -> None:
    """Catches: timings keyed by every number of the group, so a momentum, weight decay or
    ``betas`` that a scheduler moves (OneCycleLR's cycled momentum) timed every shape again
    at each re-plan and missed the disk cache on resume; and a key that lost the branches
    the math takes on such a number (``momentum`` 0, Shampoo's ``beta2 == 1``)."""
    shape = Shape(0, 8, 8, 1, torch.float32)

    def key(cls: type, **kw: Any) -> str:
        return entry_key(shape, _table(cls, **kw), CPU)

    muon = key(canzona.Muon, momentum=0.95, weight_decay=0.1, eps=1e-7)
    assert key(canzona.Muon, momentum=0.85, weight_decay=0.2, eps=1e-6) == muon
    assert key(canzona.Muon, momentum=torch.tensor(0.9), weight_decay=0.1, eps=1e-7) == muon
    assert key(canzona.Muon, momentum=0.0, weight_decay=0.1, eps=1e-7) != muon
    assert key(canzona.Muon, momentum=0.95, weight_decay=0.0, eps=1e-7) != muon
    assert key(canzona.Muon, momentum=0.95, weight_decay=0.1, eps=1e-7, ns_steps=3) != muon
    shampoo = key(canzona.Shampoo, betas=(0.9, 0.999))
    assert key(canzona.Shampoo, betas=(0.85, 0.99)) == shampoo
    assert key(canzona.Shampoo, betas=(0.9, 1.0)) != shampoo
    assert key(canzona.Shampoo, betas=(0.0, 0.999)) != shampoo
    assert key(canzona.SOAP, shampoo_beta=0.5) != key(canzona.SOAP, shampoo_beta=-1.0)


def test_entry_keys_tell_optimizer_classes_apart() -> None:
    """Catches: timings keyed without the optimizer's configuration: a subclass with its own
    math and the same settings would reuse its parent's timings."""

    class OtherMuon(canzona.Muon):
        pass

    shape = Shape(0, 8, 8, 1, torch.float32)
    muon, other = _table(canzona.Muon), _table(OtherMuon)
    assert calibration_keys.group_settings(muon.hparams[0]) == (
        calibration_keys.group_settings(other.hparams[0])
    )
    assert entry_key(shape, other, CPU) != entry_key(shape, muon, CPU)


def test_the_process_cache_times_again_when_a_setting_changes() -> None:
    """Catches: the in-process cache keyed without the group's settings."""
    calls: list[tuple[int, ...]] = []

    def compute(batch: Any, full: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(full.shape))
        return torch.zeros_like(full)

    shape = Shape(0, 8, 8, 1, torch.float32)
    calibrate_module._CACHE.clear()
    time_shape(shape, _table(canzona.Shampoo, lr=0.01), compute, CPU, 0)
    first = len(calls)
    time_shape(shape, _table(canzona.Shampoo, lr=0.05), compute, CPU, 0)
    assert len(calls) == first  # another learning rate: the same math, cached
    time_shape(shape, _table(canzona.Shampoo, lr=0.01, root_dtype=torch.float64), compute, CPU, 0)
    assert len(calls) > first


def test_disk_cache_round_trip_and_bad_files(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "sub", "cpu:test")
    assert cache.load() == {}  # no file yet
    cache.store({"k1": (0.5, -1.0, -1.0), "k2": (0.25, 0.125, 0.3)})
    assert cache.load() == {"k1": (0.5, -1.0, -1.0), "k2": (0.25, 0.125, 0.3)}
    cache.store({"k2": (0.75, 0.5, -1.0)})  # merged, the newer entry wins
    assert cache.load() == {"k1": (0.5, -1.0, -1.0), "k2": (0.75, 0.5, -1.0)}
    assert [p.name for p in cache.path.parent.iterdir()] == [cache.path.name]  # no temp file
    data = json.loads(cache.path.read_text())
    assert data["format"] == FORMAT == 2 and data["device"] == "cpu:test"
    data["entries"].update(
        {
            "nan": [float("nan"), 0.0, 0.0],
            "inf": [1.0, 0.0, float("inf")],
            "neg": [-1.0, 0.0, 0.0],
            "two": [1.0, 0.5],  # a format-1 entry: no third timing
            "one": [1.0],
            "huge": [10**400, -1, -1],  # an int past a float: float() raised OverflowError
            "huge_third": [1.0, -1, -(10**400)],
        }
    )
    cache.path.write_text(json.dumps(data))
    assert set(cache.load()) == {"k1", "k2"}  # malformed entries are dropped
    old = {"format": 1, "entries": {"k": [1.0, 0.5]}}  # written before the third timing
    for text in (
        "{not json",
        json.dumps({"format": FORMAT + 1, "entries": {}}),
        "[1, 2]",
        json.dumps(old),
        '{"format": 2, "entries": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}",  # too deep
    ):
        cache.path.write_text(text)
        with pytest.warns(RuntimeWarning, match="is not a cache file"):
            assert cache.load() == {}
    cache.path.write_bytes(b"\xff\xfe not utf-8")  # e.g. a file clobbered by another tool
    with pytest.warns(RuntimeWarning, match="is not readable"):
        assert cache.load() == {}
    assert DiskCache(tmp_path, "a").path != DiskCache(tmp_path, "b").path  # one per device


def test_disk_cache_write_failure_only_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = DiskCache(blocker / "dir", "cpu:test")  # a directory under a regular file
    with pytest.warns(RuntimeWarning, match="could not write the calibration cache"):
        cache.store({"k": (1.0, -1.0, -1.0)})


def test_disk_cache_keeps_the_files_permissions_and_finite_json(tmp_path: Path) -> None:
    """Catches: each write leaving the file readable by its writer alone (the temporary
    file's 0600 replaced it, so a cache shared by a team stopped serving the others), a
    bad file warned about twice per write, and a non-finite timing written as ``NaN``
    (not JSON)."""
    cache = DiskCache(tmp_path, "cpu:test")
    umask = os.umask(0o022)
    try:
        cache.store({"k": (1.0, -1.0, -1.0)})
    finally:
        os.umask(umask)
    assert cache.path.stat().st_mode & 0o777 == 0o644  # a new file: 0666 under the umask
    cache.path.chmod(0o664)
    cache.store({"inf": (float("inf"), -1.0, -1.0), "k2": (2.0, -1.0, -1.0)})
    assert cache.path.stat().st_mode & 0o777 == 0o664  # the file's own, kept
    assert json.loads(cache.path.read_text(), parse_constant=pytest.fail)["entries"] == {
        "k": [1.0, -1.0, -1.0],
        "k2": [2.0, -1.0, -1.0],
    }
    cache.path.write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.store({"k": (1.0, -1.0, -1.0)})
    assert caught == []  # the reader warned when it read the file
    assert set(cache.load()) == {"k"}


def _jobs_with_a_disk_cache(directory: str) -> dict[str, Any]:
    """Three optimizers as three jobs would make them (the process cache cleared between)."""
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    calls: list[str | None] = []
    stores: list[int] = []
    original, original_store = canzona.Muon._directions, cache_module.DiskCache.store

    def spy(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        calls.append(batch.calibrate)
        return original(self, batch, full)

    def store_spy(self: Any, entries: Any) -> None:
        stores.append(len(entries))
        original_store(self, entries)

    canzona.Muon._directions = spy  # type: ignore[method-assign]
    cache_module.DiskCache.store = store_spy  # type: ignore[method-assign]
    timed, tables = [], []
    try:
        for kw in ({}, {}, {"ns_steps": 3}):
            calibrate_module._CACHE.clear()  # a new process
            before = sum(c is not None for c in calls)
            opt = canzona.Muon(
                params,
                lr=0.02,
                ns_dtype=torch.float32,
                plan=plan(),
                pipeline=canzona.PipelineConfig(calibration_cache=directory),
                **kw,
            )
            set_grads(params, grad_steps(SHAPES, 1)[0])
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no warning about the cache file
                opt.step()
            timed.append(sum(c is not None for c in calls) - before)
            model = opt._runtime.plan.optimizer.models["0"]
            tables.append([model.table, model.batches])
    finally:
        canzona.Muon._directions = original  # type: ignore[method-assign]
        cache_module.DiskCache.store = original_store  # type: ignore[method-assign]
    return {"timed": timed, "tables": tables, "stores": stores}


def test_a_later_job_reuses_the_agreed_timings(dist: Any, tmp_path: Path) -> None:
    """Catches: a disk cache that is not read (the second job times again), that is written
    by every rank, that returns other numbers than the agreed ones, or whose key ignores a
    group's settings (the third job, with another ``ns_steps``, would time nothing)."""
    out = dist(2).run(_jobs_with_a_disk_cache, str(tmp_path))
    for rank, o in enumerate(out):
        first, second, third = o["timed"]
        assert first > 0 and third > 0
        assert second == 0  # every shape found on disk: nothing timed
        assert o["tables"][1] == o["tables"][0]  # the first job's agreed table, exactly
        # rank 0 writes after the first and the third job (three shapes each), no one else
        assert o["stores"] == ([3, 3] if rank == 0 else [])
    assert out[0]["tables"] == out[1]["tables"]
    (written,) = tmp_path.iterdir()
    assert len(json.loads(written.read_text())["entries"]) == 6


def test_calibration_cache_setting_is_checked() -> None:
    assert canzona.PipelineConfig(calibration_cache=Path("x")).calibration_cache == Path("x")
    for bad in ("", 3, True, "/tmp/a\0b"):
        with pytest.raises(ValueError, match="calibration_cache must be a directory path"):
            canzona.PipelineConfig(calibration_cache=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="process_group must be a ProcessGroup or None, got 42"):
        canzona.PipelineConfig(process_group=42)  # type: ignore[arg-type]


class _FakeClock:
    """A clock that only the fake owner math advances: ``seconds(m, n)`` per matrix."""

    def __init__(self, seconds: Any) -> None:
        self.now = 0.0
        self.seconds = seconds
        self.calls: list[tuple[int, int, int]] = []

    def compute(self, batch: Any, full: torch.Tensor) -> torch.Tensor:
        k, m, n = full.shape
        self.calls.append((k, m, n))
        self.now += k * self.seconds(m, n)
        return full


def _calibrate_muon(
    monkeypatch: pytest.MonkeyPatch, fake: _FakeClock, shapes: list[Shape], **limits: float
) -> Any:
    """One rank's calibration of a Muon table over ``shapes``, timed by ``fake``."""
    from canzona.plan import MuonCost
    from canzona.runtime import timing
    from canzona.runtime.watchdog import Watchdog

    monkeypatch.setattr(timing, "clock", lambda: lambda: fake.now)
    calibrate_module._CACHE.clear()
    return calibrate_module.calibrate(
        shapes,
        _table(canzona.Muon, lr=0.02),
        fake.compute,
        {0: MuonCost()},
        watchdog=Watchdog(None, 0, 1, 60.0),
        device=CPU,
        **limits,
    )


def _muon_seconds(rate: Any) -> Any:
    """Seconds per matrix: ``rate(m, n)`` seconds per closed-form Muon FLOP."""
    from canzona.plan import MuonCost

    return lambda m, n: rate(m, n) * MuonCost().flops(canzona.plan.MatrixSpec("s", (m, n)))


def test_calibration_fits_each_shape_class(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a calibration whose table has no class fits (untimed shapes priced by one
    fit over every shape)."""
    rate = {32: 1e-9, 64: 4e-9}  # seconds per FLOP by the smaller side
    fake = _FakeClock(_muon_seconds(lambda m, n: rate[min(m, n)]))
    shapes = [Shape(0, m, n, 1, torch.float32) for m, n in ((32, 64), (32, 128), (64, 64))]
    cost = _calibrate_muon(monkeypatch, fake, shapes)
    model = cost.models["0"]
    assert [(k, v) for k, v, _, _ in model.class_fits] == [("side", 32)]
    thin = (32, 1024)
    assert model.seconds(*thin) == pytest.approx(fake.seconds(*thin), rel=1e-9)


def test_calibration_ends_within_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a calibration that starts timing a shape whose timing ends past the budget
    (the first step then pays more than the budget says)."""
    fake = _FakeClock(_muon_seconds(lambda m, n: 1e-9))
    sides = (64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    shapes = [Shape(0, m, m, 1, torch.float32) for m in sides]
    cost = _calibrate_muon(monkeypatch, fake, shapes, budget_s=1.0, shape_cap_s=10.0)
    timed_shapes = [shape for shape, _ in cost.models["0"].table]
    assert fake.now <= 1.0  # warm-ups, timed calls at both batch sizes
    assert 2 <= len(timed_shapes) < len(sides)  # the budget, not the cap, stopped it


def test_calibration_times_the_shapes_that_carry_the_work_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a calibration that spends its budget on the cheapest shapes and fits the
    ones most of the model's owner time goes to (the prediction then misses where it
    matters)."""
    fake = _FakeClock(lambda m, n: 1e-3)
    # (side, matrices of that shape): the 192s carry more work than the one 256
    counts = {64: 1, 128: 3, 192: 20, 256: 1}
    shapes = [Shape(0, m, m, 1, torch.float32, c) for m, c in counts.items()]
    _calibrate_muon(monkeypatch, fake, shapes)
    warmed = list(dict.fromkeys((m, n) for _, m, n in fake.calls))
    assert warmed == [(64, 64), (192, 192), (256, 256), (128, 128)]


def test_calls_are_timed_in_rounds_over_the_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a shape's calls timed back to back (in a step a call follows other shapes'
    calls, and repeated back to back a call runs faster: the prediction is then low)."""
    fake = _FakeClock(lambda m, n: 1e-3)
    shapes = [Shape(0, m, m, 1, torch.float32) for m in (64, 96)]
    _calibrate_muon(monkeypatch, fake, shapes)
    # each call warmed up and timed once right after (alone, then in pairs) ...
    started = [(k, m, m) for k in (1, 2) for m in (64, 96) for _ in range(2)]
    assert fake.calls[:8] == started
    # ... then the other four timed calls of each, round by round
    timed = fake.calls[8:]
    assert timed[:4] == [(1, 64, 64), (1, 96, 96), (2, 64, 64), (2, 96, 96)]
    assert len(timed) == 4 * 4
    assert all(a != b for a, b in itertools.pairwise(timed))  # never one call twice in a row
