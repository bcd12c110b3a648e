"""A measured plan re-priced by its own steps: in two rounds, on every rank alike, owners moved,
exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona.plan.measured import MeasuredCost
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import timing
from canzona.runtime.repricing import ROUNDS, SKIPPED_STEPS

from _cases import (
    CALIBRATION_SHAPES,
    OWNER_KW,
    compare,
    first_step_mismatch,
    full_of,
    full_tensors,
    grad_steps,
    local_optimizer,
    plan,
    reference_muon,
    set_grads,
    sharded_params,
)
from _dist import mesh

SHAPES = CALIBRATION_SHAPES
#: Seconds per matrix of each shape's calls in the calibration (a fake clock)...
CALIBRATED_S = {(16, 16): 1e-3, (24, 8): 10e-3, (8, 24): 3e-3}
#: ... and in the steps, as a multiple of the calibrated price: the plan on the calibrated
#: table puts (24, 8) alone on one rank and the rest on the other; on the observed prices
#: the two (16, 16) matrices are the costliest items and go to different ranks.
STEP_SCALE = {(16, 16): 10.0, (24, 8): 0.1, (8, 24): 1.0}
RECORDED_STEPS = 2
#: The step before which the table is re-priced (1-based), and two more after it.
DUE = SKIPPED_STEPS + RECORDED_STEPS + 1
STEPS = DUE + 2
#: The step before which the second round re-prices, and a round's length after it.
DUE_2 = DUE + SKIPPED_STEPS + RECORDED_STEPS
STEPS_2 = DUE_2 + SKIPPED_STEPS + RECORDED_STEPS + 1
#: A fixed part of every step's owner call (seconds) in the first round's steps and in the
#: later ones, in :func:`test_the_second_round_reprices_on_both_rounds_calls`.
FIXED_S = (5e-3, 4e-3)

_NOW = [0.0]


def _fake_clock() -> float:
    return _NOW[0]


def _timed(
    real: Any,
    fixed_s: Callable[[], float] = lambda: 0.0,
    scale: Callable[[], dict[tuple[int, int], float]] = lambda: STEP_SCALE,
) -> Any:
    """``real`` (an optimizer's owner math) advancing the fake clock by the shape's price
    (in a step: times ``scale()``'s factor, plus ``fixed_s()`` per call)."""

    def compute(batch: Any, full: torch.Tensor) -> torch.Tensor:
        out = real(batch, full)
        k, m, n = full.shape
        calibrating = str(batch.items[0].name).startswith("calibration")
        step = 0.0 if calibrating else fixed_s()
        _NOW[0] += step + k * CALIBRATED_S[(m, n)] * (1.0 if calibrating else scale()[(m, n)])
        return out

    return compute


def _owners(opt: Any) -> dict[str, int]:
    plan_ = opt._runtime.plan
    return {n: o for g in plan_.micro_groups for n, o in zip(g.names, g.owners, strict=True)}


def _run(
    cls: Any,
    kw: dict[str, Any],
    reprice_steps: int,
    fail_at: int | None = None,
    state_dict_at: int | None = None,
    steps: int = STEPS,
    fixed_s: tuple[float, float] = (0.0, 0.0),
    late_scale: dict[tuple[int, int], float] = STEP_SCALE,
) -> dict[str, Any]:
    """Run ``steps`` steps with the fake clock; with ``fail_at`` (1-based), rank 1's
    owner math raises in that step (every rank must raise, and the step change nothing);
    with ``state_dict_at``, ``state_dict()`` is taken (and dropped) before that step; each
    step's owner call takes ``fixed_s[0]`` more before :data:`DUE`, ``fixed_s[1]`` from it,
    and its matrices cost :data:`STEP_SCALE` times their calibrated price before
    :data:`DUE`, ``late_scale`` times from it."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, steps)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    clock, evict = timing.clock, calibrate_module._eviction_seconds
    calibrate_module._CACHE.clear()
    timing.clock = lambda: _fake_clock  # type: ignore[assignment]
    calibrate_module._eviction_seconds = lambda device: 0.0  # type: ignore[assignment]
    out: dict[str, Any] = {"repricings": [], "owners": [], "digests": [], "rode": [], "failed": []}
    try:
        opt = cls(
            params, **kw, plan=plan(), pipeline=canzona.PipelineConfig(reprice_steps=reprice_steps)
        )
        step = [0]
        timed = _timed(
            opt._directions,
            lambda: fixed_s[0] if step[0] < DUE else fixed_s[1],
            lambda: STEP_SCALE if step[0] < DUE else late_scale,
        )

        def directions(batch: Any, full: torch.Tensor) -> torch.Tensor:
            calibrating = str(batch.items[0].name).startswith("calibration")
            if step[0] == fail_at and not calibrating and torch.distributed.get_rank() == 1:
                raise RuntimeError("owner math failed on purpose")
            return timed(batch, full)

        opt._directions = directions
        for i, g in enumerate(grads, start=1):
            step[0] = i
            if i == state_dict_at:
                opt.state_dict()  # a periodic checkpoint: it must change nothing
            set_grads(params, g)
            try:
                opt.step()
            except canzona.UpdateFailedError as exc:
                out["failed"].append((i, "owner math failed on purpose" in str(exc)))
            opt.zero_grad(set_to_none=True)
            out["repricings"].append(opt._runtime.repricings)
            out["owners"].append(_owners(opt))
            out["digests"].append(opt._runtime.digest)
            out["rode"].append(opt.last_step_stats.header_rode)
    finally:
        timing.clock = clock  # type: ignore[assignment]
        calibrate_module._eviction_seconds = evict  # type: ignore[assignment]
        calibrate_module._CACHE.clear()
    models = [m for m in opt._runtime.plan.optimizer.models.values()]
    assert all(isinstance(m, MeasuredCost) for m in models)
    for key, k in (("prices", 1), ("prices_2", 2)):
        out[key] = {shape: [m.batch_seconds(*shape, k) for m in models] for shape in CALIBRATED_S}
    out["got"] = {n: full_of(p) for n, p in params}
    out["fulls"], out["grads"] = fulls, grads
    return out


def _muon() -> dict[str, Any]:
    out = _run(canzona.Muon, {"lr": 0.02, "weight_decay": 0.1}, RECORDED_STEPS)
    want = reference_muon(out["fulls"], out["grads"], lr=0.02, weight_decay=0.1)
    out["exact"] = compare(out.pop("got"), want)
    return out


def test_the_steps_reprice_the_table_once_and_move_owners(dist: Any) -> None:
    """Catches: no re-pricing, a re-pricing a step early or late (the count of recorded
    steps), prices from the calibration or from another shape's calls (the universe the
    ranks agree on misaligned), a re-plan on one rank only (the digests), and a re-plan
    that changes the math (bitwise against ``torch.optim.Muon``)."""
    for rank, out in enumerate(dist(2).run(_muon)):
        want = [0] * (DUE - 1) + [1] * (STEPS - DUE + 1)
        assert out["repricings"] == want, f"rank {rank}"
        for (m, n), prices in out["prices"].items():
            observed = CALIBRATED_S[(m, n)] * STEP_SCALE[(m, n)]
            assert prices == [pytest.approx(observed, rel=1e-9)], f"rank {rank}: {(m, n)}"
        before, after = out["owners"][DUE - 2], out["owners"][DUE - 1]
        assert before["a"] == before["b"] != before["c"], f"rank {rank}: {before}"
        assert after["a"] != after["b"], f"rank {rank}: {after}"
        assert out["digests"][DUE - 2] != out["digests"][DUE - 1]
        # the re-pricing's step checks on its own; the header rides again once the new
        # plan has run a step (as after any re-plan)
        assert out["rode"][DUE - 2 :] == [True, False, False, True], f"rank {rank}"
        bad = {n: rel for n, (eq, rel) in out["exact"].items() if not eq}
        assert not bad, f"rank {rank}: not bitwise equal to torch.optim.Muon: {bad}"
    digests = [out["digests"] for out in dist(2).run(_muon)]
    assert digests[0] == digests[1]


def _two_rounds() -> dict[str, Any]:
    out = _run(
        canzona.Muon, {"lr": 0.02, "weight_decay": 0.1}, RECORDED_STEPS, steps=STEPS_2,
        fixed_s=FIXED_S,
    )  # fmt: skip
    want = reference_muon(out["fulls"], out["grads"], lr=0.02, weight_decay=0.1)
    out["exact"] = compare(out.pop("got"), want)
    return out


def test_the_second_round_reprices_on_both_rounds_calls(dist: Any) -> None:
    """Steps' calls cost a fixed part (another in each round) plus a part per matrix. The
    first round sees the two 16 x 16 matrices stacked on one owner (k = 2), the second,
    after the re-plan put them on different ranks, one per call (k = 1): only the calls of
    both rounds give the line through both. The others run alone in both rounds. Catches:
    a second round that forgets the first (k = 2 priced at twice k = 1), the first round's
    call kept where both rounds made it, no second round, a third one (the counts), a
    re-plan on one rank only, and a re-plan that changes the math."""
    assert ROUNDS == 2
    runs = dist(2).run(_two_rounds)
    for rank, out in enumerate(runs):
        want = [0] * (DUE - 1) + [1] * (DUE_2 - DUE) + [2] * (STEPS_2 - DUE_2 + 1)
        assert out["repricings"] == want, f"rank {rank}"
        before, first, second = (out["owners"][i] for i in (DUE - 2, DUE - 1, DUE_2 - 1))
        assert before["a"] == before["b"] and first["a"] != first["b"], f"rank {rank}"
        assert second == first, f"rank {rank}: {first} -> {second}"
        fixed_1, fixed_2 = FIXED_S
        per = CALIBRATED_S[(16, 16)] * STEP_SCALE[(16, 16)]
        assert out["prices"][(16, 16)] == [pytest.approx(fixed_2 + per, rel=1e-9)]
        assert out["prices_2"][(16, 16)] == [pytest.approx(fixed_1 + 2 * per, rel=1e-9)]
        for shape in ((24, 8), (8, 24)):
            alone = fixed_2 + CALIBRATED_S[shape] * STEP_SCALE[shape]
            assert out["prices"][shape] == [pytest.approx(alone, rel=1e-9)], shape
        bad = {n: rel for n, (eq, rel) in out["exact"].items() if not eq}
        assert not bad, f"rank {rank}: not bitwise equal to torch.optim.Muon: {bad}"
    assert runs[0]["digests"] == runs[1]["digests"]


def _off() -> dict[str, Any]:
    out = _run(canzona.Muon, {"lr": 0.02}, 0)
    return {"repricings": out["repricings"], "owners": out["owners"]}


def test_reprice_steps_zero_keeps_the_calibrated_plan(dist: Any) -> None:
    for out in dist(2).run(_off):
        assert out["repricings"] == [0] * STEPS
        assert all(o == out["owners"][0] for o in out["owners"])


def _owner_state(name: str) -> dict[str, Any]:
    cls = getattr(canzona, name)
    out = _run(cls, OWNER_KW[name], RECORDED_STEPS)
    want = local_optimizer(cls, out["fulls"], out["grads"], **OWNER_KW[name])
    return {"repricings": out["repricings"], "exact": compare(out["got"], want)}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_owner_state_moves_with_the_repriced_plan(dist: Any, name: str) -> None:
    """Owner-held preconditioners move to the new owners at the re-plan. Catches: the
    re-plan's snapshot not handed to the optimizer (state left at the old owners: the new
    ones start from scratch and the parameters differ from one device's)."""
    for rank, out in enumerate(dist(2).run(_owner_state, name)):
        assert out["repricings"][-1] == 1
        bad = {n: rel for n, (eq, rel) in out["exact"].items() if not eq}
        assert not bad, f"rank {rank}: {name} not bitwise equal to one device: {bad}"


def _checkpoint_before_the_replan(name: str) -> dict[str, Any]:
    cls = getattr(canzona, name)
    out = _run(cls, OWNER_KW[name], RECORDED_STEPS, state_dict_at=DUE)
    want = local_optimizer(cls, out["fulls"], out["grads"], **OWNER_KW[name])
    return {
        "repricings": out["repricings"],
        "moved": out["owners"][DUE - 2] != out["owners"][DUE - 1],
        "rode": out["rode"],
        "exact": compare(out["got"], want),
    }


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_a_state_dict_that_reprices_leaves_no_stale_step_behind(dist: Any, name: str) -> None:
    """``state_dict()`` agrees on the plan first, so one taken when the re-pricing is due
    re-plans there. Catches: the next step riding the pipeline of the plan before it (the
    header that rides the first gather compared the table, not the plan): the matrices
    whose owner moved found no state on their old owner and started afresh, silently."""
    for rank, out in enumerate(dist(2).run(_checkpoint_before_the_replan, name)):
        assert out["repricings"] == [0] * (DUE - 1) + [1] * (STEPS - DUE + 1), f"rank {rank}"
        assert out["moved"], f"rank {rank}: the re-plan did not move owners"
        assert out["rode"][DUE - 1] is False, f"rank {rank}: the step after the re-plan rode"
        bad = {n: rel for n, (eq, rel) in out["exact"].items() if not eq}
        assert not bad, f"rank {rank}: {name} not bitwise equal to one device: {bad}"


#: From the first re-plan on, the 24 x 8 matrix costs 30 times its calibrated price: the
#: second round's re-plan puts it alone on a rank and the two 16 x 16 together again.
LATE_SCALE = {(16, 16): 10.0, (24, 8): 3.0, (8, 24): 1.0}


def _fails_at_the_replan(name: str, due: int) -> dict[str, Any]:
    cls = getattr(canzona, name)
    second = due == DUE_2
    out = _run(
        cls, OWNER_KW[name], RECORDED_STEPS, fail_at=due, steps=STEPS_2 if second else STEPS,
        late_scale=LATE_SCALE if second else STEP_SCALE,
    )  # fmt: skip
    # the failed step changed nothing: one device never saw its gradients
    kept = [g for i, g in enumerate(out["grads"], start=1) if i != due]
    want = local_optimizer(cls, out["fulls"], kept, **OWNER_KW[name])
    return {
        "failed": out["failed"],
        "repricings": out["repricings"],
        "moved": out["owners"][due - 2] != out["owners"][due - 1],
        "digest": out["digests"][-1],
        "exact": compare(out["got"], want),
    }


@pytest.mark.parametrize("due", [DUE, DUE_2], ids=["first-round", "second-round"])
@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_a_failure_in_the_replanning_step_changes_nothing(dist: Any, name: str, due: int) -> None:
    """The step that re-plans on the re-priced table (the first round's or the second's)
    moves the owner-held state, then fails on one rank. Catches: the error on one rank
    only (the other hangs or goes on), another re-pricing after the failure, state moved
    and then half rolled back (the next steps start from the wrong preconditioners: not
    equal to one device without that step)."""
    runs = dist(2).run(_fails_at_the_replan, name, due)
    steps = STEPS_2 if due == DUE_2 else STEPS
    counts = [0] * (DUE - 1) + [1] * (DUE_2 - DUE) + [2] * (STEPS_2 - DUE_2 + 1)
    for rank, out in enumerate(runs):
        assert out["failed"] == [(due, True)], f"rank {rank}"
        assert out["repricings"] == counts[:steps], f"rank {rank}"
        assert out["moved"], f"rank {rank}: the re-plan did not move owners"
        bad = {n: rel for n, (eq, rel) in out["exact"].items() if not eq}
        assert not bad, f"rank {rank}: {name} not bitwise equal to one device: {bad}"
    assert runs[0]["digest"] == runs[1]["digest"]


def _mismatch() -> str:
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    steps = 3 if torch.distributed.get_rank() == 0 else 0
    opt = canzona.Muon(params, lr=0.02, pipeline=canzona.PipelineConfig(reprice_steps=steps))
    return first_step_mismatch(opt, params, SHAPES)


def test_ranks_that_reprice_differently_fail_before_any_collective(dist: Any) -> None:
    """Catches: ``reprice_steps`` left out of the configuration the ranks compare: one rank
    would enter the re-pricing's all-gather at step 5 and the other a step's all-to-all."""
    assert dist(2).run(_mismatch) == ["PlanMismatchError"] * 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_reprice_steps_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match=f"reprice_steps must be an int >= 0, got {bad!r}"):
        canzona.PipelineConfig(reprice_steps=bad)
