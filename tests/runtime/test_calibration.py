"""Calibration on real ranks: one agreed table, per-group costs, a cache, flops on request."""

from __future__ import annotations

import platform
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona.plan.measured import MeasuredCost
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import calibration_keys, timing

from _cases import (
    CALIBRATION_SHAPES,
    compare,
    full_tensors,
    grad_steps,
    plan,
    reference_muon,
    set_grads,
    sharded_params,
)
from _dist import mesh

SHAPES = CALIBRATION_SHAPES


def _calibrated(cost: str) -> dict[str, Any]:
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    calls: list[str | None] = []
    sizes: set[tuple[int, int, int]] = set()
    original = canzona.Muon._directions

    def spy(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        calls.append(batch.calibrate)
        if batch.calibrate is not None:
            sizes.add(tuple(full.shape))
        return original(self, batch, full)

    canzona.Muon._directions = spy  # type: ignore[method-assign]
    try:
        opt = canzona.Muon(params, lr=0.02, ns_dtype=torch.float32, plan=plan(cost=cost))
        set_grads(params, grad_steps(SHAPES, 1)[0])
        opt.step()
        first = sum(c is not None for c in calls)
        again = canzona.Muon(params, lr=0.02, ns_dtype=torch.float32, plan=plan(cost=cost))
        again.step()
        second = sum(c is not None for c in calls) - first
    finally:
        canzona.Muon._directions = original  # type: ignore[method-assign]
    model = opt._runtime.plan.optimizer
    measured = [m for m in model.models.values() if isinstance(m, MeasuredCost)]
    return {
        "kind": type(next(iter(model.models.values()))).__name__,
        "params": model.params(),
        "timed_calls": first,
        "calls_after_cache": second,
        "shapes": sorted(tuple(k) for m in measured for k, _ in m.table),
        "timed_sizes": sorted(sizes),
        "lines": sorted(tuple(k) for m in measured for k, _, _ in m.batches),
        "shares": sorted({m.transfer_share for m in measured}),
        "rates": [m.bytes_per_s > 0 for m in measured],
    }


def test_measured_costs_are_agreed_and_cached(dist: Any) -> None:
    out = dist(2).run(_calibrated, "measured")
    assert out[0]["params"] == out[1]["params"]  # one table on every rank
    for o in out:
        assert o["kind"] == "MeasuredCost"
        assert o["shapes"] == [(8, 24), (16, 16), (24, 8)]  # every distinct shape timed
        assert o["timed_calls"] > 0
        assert o["calls_after_cache"] == 0  # the same settings and shapes: no timing again
        # two ranks, one matrix of each shape per rank: timed alone, then two at a time,
        # which splits a call into a fixed part and a part per matrix
        assert o["timed_sizes"] == [(k, m, n) for k in (1, 2) for m, n in o["shapes"]]
        assert set(o["lines"]) <= set(o["shapes"])
        # the transfer rate is measured, and on two ranks owning moves no more bytes
        assert o["shares"] == [0.0] and all(o["rates"])


def test_flops_on_request(dist: Any) -> None:
    for o in dist(2).run(_calibrated, "flops"):
        assert o["kind"] == "MuonCost"
        assert o["timed_calls"] == 0


def _group_costs() -> dict[str, Any]:
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    groups = [
        {"params": params[:2], "precondition_frequency": 1},
        {"params": params[2:], "precondition_frequency": 7, "max_precond_dim": 16},
    ]
    opt = canzona.Shampoo(groups, lr=0.01, plan=plan(cost="flops"))
    set_grads(params, grad_steps(SHAPES, 1)[0])
    opt.step()
    return opt._runtime.plan.canonical()["optimizer"]


def test_the_plan_costs_each_groups_own_hyper_parameters(dist: Any) -> None:
    """A user's precondition_frequency=1 is planned as 1 (not the class default 20)."""
    for o in dist(2).run(_group_costs):
        models = o["params"]
        assert models["0"]["params"]["precondition_frequency"] == 1
        assert models["1"]["params"] == {"precondition_frequency": 7, "max_precond_dim": 16}


def _ns_dtype_changed() -> dict[str, Any]:
    values = full_tensors(SHAPES)
    layout = {n: (Shard(0),) for n in SHAPES}
    out: dict[str, Any] = {}
    for name, first in (("changed", torch.bfloat16), ("fresh", torch.float32)):
        params = sharded_params(values, mesh((2,)), layout)
        opt = canzona.Muon(params, lr=0.02, ns_dtype=first, plan=plan(cost="flops"))
        for i, grads in enumerate(grad_steps(SHAPES, 2)):
            if name == "changed" and i == 1:
                out["before"] = opt._runtime.digest
                opt.param_groups[0]["ns_dtype"] = torch.float32
            set_grads(params, grads)
            opt.step()
        out[name] = (opt._runtime.digest, sorted({s.itemsize for s in opt._runtime.plan.specs}))
    return out


def test_a_new_payload_dtype_plans_again(dist: Any) -> None:
    """Catches: ``ns_dtype`` set between steps kept the plan made for the old payload (its
    bytes and timings, and its digest): the table took the new dtype, the structure did not."""
    for o in dist(2).run(_ns_dtype_changed):
        assert o["changed"] == o["fresh"]
        assert o["changed"][1] == [4]
        assert o["before"] != o["fresh"][0]


def test_calibration_cache_key_names_the_device() -> None:
    assert calibration_keys.device_name(torch.device("cpu")).startswith("cpu:")


def test_the_cache_key_follows_the_kernels_settings(monkeypatch: Any) -> None:
    """Catches: a table timed with other kernels reused from the cache: the float32 matmul
    precision (TF32 on a GPU: Shampoo's and SOAP's fp32 matmuls) and the switch of CUDA
    graphs (head blocks about 6x apart) were not in the key."""
    before = calibration_keys.kernel_settings()
    monkeypatch.setenv("CANZONA_CUDA_GRAPHS", "0")
    graphs_off = calibration_keys.kernel_settings()
    assert graphs_off != before
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision != "high" else "highest")
    try:
        assert calibration_keys.kernel_settings() not in (before, graphs_off)
    finally:
        torch.set_float32_matmul_precision(precision)


def test_a_group_without_a_timed_shape_is_priced_in_seconds() -> None:
    """Catches: a param group none of whose shapes was timed (all past the cap, out of the
    budget, or raising) priced by the fit of no points, which gives its FLOPs as seconds:
    the plan then balanced that group alone and took the others for free."""
    from canzona.plan import MatrixSpec, MuonCost
    from canzona.runtime.watchdog import Watchdog

    small, large = torch.nn.Parameter(torch.randn(16, 16)), torch.nn.Parameter(torch.randn(64, 64))
    opt = canzona.Muon([{"params": [small]}, {"params": [large], "lr": 0.01}], lr=0.02)
    params, _, gids = opt._flat()
    table = opt._step_table(params, gids)
    shapes = [
        calibrate_module.Shape(0, 16, 16, 1, torch.bfloat16),
        calibrate_module.Shape(1, 64, 64, 1, torch.bfloat16),
    ]
    cpu = torch.device("cpu")
    cost = calibrate_module.calibrate(
        shapes,
        table,
        opt._directions,
        {0: MuonCost(), 1: MuonCost()},
        watchdog=Watchdog(None, 0, 1, 60.0, device=cpu),
        device=cpu,
        shape_cap_s=1e-12,  # only the first shape timed: nothing predicts it
    )
    timed, untimed = cost.models["0"], cost.models["1"]
    assert isinstance(timed, MeasuredCost) and timed.table  # group 0's shape was timed
    assert isinstance(untimed, MeasuredCost) and not untimed.table
    flops = MuonCost().flops(MatrixSpec("s", (64, 64)))
    seconds = untimed.seconds(64, 64)
    assert 0 < seconds < 1.0 < flops  # predicted from group 0's timing, in seconds
    assert seconds == timed.seconds(64, 64)  # the same fit: the same kernels


def test_the_agreed_timing_is_the_true_median() -> None:
    """Catches: the upper of the two middle timings taken for the median of an even count
    (with two ranks that is the slower rank's, a bias toward the noisier one)."""
    assert timing.median([1.0, 3.0]) == 2.0
    assert timing.median([1.0, 2.0, 9.0]) == 2.0
    assert timing.median([1.0, 2.0, 4.0, 9.0]) == 3.0


#: Two layers' worth of small matrices in three classes (every side >= 32: batched kernels).
CLASSES = {
    "q0": (64, 32), "q1": (64, 32), "o0": (32, 64), "o1": (32, 64),
    "k0": (32, 32), "k1": (32, 32), "v0": (32, 32), "v1": (32, 32),
}  # fmt: skip
MUON_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}


def _fixed_calls(shapes: Any, table: Any, compute: Any, bases: Any, **_: Any) -> Any:
    """A deterministic measured table: every call 0.3 ms plus 0.2 ms per matrix."""
    from canzona.plan import GroupedCost

    sizes = sorted({(s.m, s.n) for s in shapes})
    return GroupedCost(
        models={
            str(k): MeasuredCost(
                base=base,
                table=tuple((mn, 0.35e-3) for mn in sizes),
                batches=tuple((mn, 0.3e-3, 0.2e-3) for mn in sizes),
            )
            for k, base in bases.items()
        }
    )


def _consolidated_plan() -> dict[str, Any]:
    from canzona.runtime import plan_inputs

    fulls = full_tensors(CLASSES)
    grads = grad_steps(CLASSES, 2)
    want = reference_muon(fulls, grads, **MUON_KW)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in CLASSES})
    original = plan_inputs.calibrate
    plan_inputs.calibrate = _fixed_calls  # type: ignore[assignment]
    try:
        opt = canzona.Muon(params, **MUON_KW)
        for g in grads:
            set_grads(params, g)
            opt.step()
    finally:
        plan_inputs.calibrate = original  # type: ignore[assignment]
    planned = opt._runtime.plan
    owner = planned.assignment.owner
    got = {n: p.full_tensor() for n, p in params}
    return {
        "chunks": len({(owner[s.name], s.shape) for s in planned.specs}),
        "owners": dict(owner),
        "compare": compare(got, want),
    }


def test_owners_priced_per_call_gather_classes_and_stay_exact(dist: Any) -> None:
    """Catches: a runtime plan that splits every class over both ranks when each call has
    a fixed part (six calls where three do), and any change of the math from it."""
    out = dist(2).run(_consolidated_plan)
    assert out[0]["owners"] == out[1]["owners"]
    for o in out:
        assert o["chunks"] == 3
        assert all(eq for eq, _ in o["compare"].values()), o["compare"]


def test_the_ranks_agree_on_a_median_that_outvotes_a_stall(monkeypatch: Any) -> None:
    """Catches: the plain mean of the two middle timings of an even count (with two ranks a
    stall on one of them, which only adds time, then moves the agreed price), and the lower
    one taken always (with two ranks the faster rank's timing: a price biased low)."""
    from canzona.runtime.watchdog import Watchdog

    class Done:
        def wait(self, timeout: Any = None) -> bool:
            return True

    def gather(rows: torch.Tensor, mine: torch.Tensor, group: Any = None, **_: Any) -> Done:
        rows.copy_(
            torch.tensor(
                [1.0, 5.0, 4.0, 7.0, -1.0, 4.4, 3.0, 8.0, -1.0, 2.0, -1.0, -1.0],
                dtype=rows.dtype,
            )
        )
        return Done()

    monkeypatch.setattr(calibrate_module.dist, "all_gather_single", gather)
    watchdog = Watchdog(None, 0, 4, 60.0)
    agreed = calibrate_module.median_over_ranks([1.0, 5.0, 4.0], watchdog, torch.device("cpu"))
    # of (1, 7, 3, 2): 2 and 3 are further apart than STALL_RATIO -> 2; of (5, 8): 5;
    # of (4, 4.4): within the ratio -> their mean
    assert agreed == [2.0, 5.0, 4.2]
    assert calibrate_module._robust_median([]) == -1.0
    assert calibrate_module._robust_median([3.0, 1.0, 2.0]) == 2.0
    # catches: the mean of two finite timings overflowing to inf (the step then failed)
    assert calibrate_module._robust_median([1e308, 1.1e308]) == 1.05e308


def test_the_ranks_agree_without_a_rank_that_timed_inf(monkeypatch: Any) -> None:
    """Catches: a rank's infinite timing (a clock gone wrong) taken as a valid one, which
    priced the shape at inf and failed every rank's step."""
    from canzona.runtime.watchdog import Watchdog

    class Done:
        def wait(self, timeout: Any = None) -> bool:
            return True

    def gather(rows: torch.Tensor, mine: torch.Tensor, group: Any = None, **_: Any) -> Done:
        inf = float("inf")  # ranks 1 and 2 timed the first shape at inf
        rows.copy_(torch.tensor([2.0, 3.0, inf, 3.0, inf, 3.0], dtype=rows.dtype))
        return Done()

    monkeypatch.setattr(calibrate_module.dist, "all_gather_single", gather)
    watchdog = Watchdog(None, 0, 3, 60.0)
    agreed = calibrate_module.median_over_ranks([2.0, 3.0], watchdog, torch.device("cpu"))
    assert agreed == [2.0, 3.0]


def _calibrated_long() -> dict[str, Any]:
    """:func:`_calibrated` with every call counted as long and nothing timed before."""
    calibrate_module._CACHE.clear()
    saved = timing.SHORT_CALL_S
    timing.SHORT_CALL_S = 0.0
    try:
        return _calibrated("measured")
    finally:
        timing.SHORT_CALL_S = saved


def test_long_calls_are_timed_at_a_second_batch_size(dist: Any) -> None:
    """Catches: the second batch size timed for short calls only (a single matrix runs the
    per-matrix kernels, not the batched ones: a long shape's batch line is needed too)."""
    for o in dist(2).run(_calibrated_long):
        assert o["timed_sizes"] == [(k, m, n) for k in (1, 2) for m, n in o["shapes"]]


SETTLE_CHECK = """
import ctypes, sys, torch
from canzona.runtime.timing import settle_heap
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
if sys.argv[1] == "settle":
    settle_heap()
block = torch.empty(16 << 20, dtype=torch.uint8)  # a large product of a timed call
print(int(block.data_ptr() < libc.sbrk(0)))  # 1: from the heap; 0: mapped afresh
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
def test_settle_heap_lets_later_calls_reuse_freed_memory() -> None:
    """In a fresh process glibc maps a 16 MiB block afresh (and unmaps it when freed: the
    next such block faults in fresh pages again); after :func:`timing.settle_heap` it comes
    from the heap, whose freed memory the process keeps. Catches: a settle block above
    glibc's 32 MiB ceiling, or none (the calibration's timed calls then pay page faults
    that a step's calls do not: 500 to 3,800 per call of the Qwen3-like model's largest
    shapes)."""
    from_heap = {}
    for mode in ("plain", "settle"):
        done = subprocess.run(
            [sys.executable, "-c", SETTLE_CHECK, mode], capture_output=True, text=True, check=True
        )
        from_heap[mode] = done.stdout.split()[-1]
    assert from_heap == {"plain": "0", "settle": "1"}


def _settle_order() -> list[str]:
    """What a first step does, in order: the heap settled (``settle``) and timed calls."""
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    events: list[str] = []
    original, settle = canzona.Muon._directions, timing.settle_heap

    def spy(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        if batch.calibrate is not None:
            events.append("call")
        return original(self, batch, full)

    canzona.Muon._directions = spy  # type: ignore[method-assign]
    timing.settle_heap = lambda: events.append("settle")  # type: ignore[assignment]
    calibrate_module._CACHE.clear()
    try:
        opt = canzona.Muon(params, lr=0.02, ns_dtype=torch.float32, plan=plan())
        set_grads(params, grad_steps(SHAPES, 1)[0])
        opt.step()
    finally:
        canzona.Muon._directions = original  # type: ignore[method-assign]
        timing.settle_heap = settle
    return events


def test_a_cpu_calibration_settles_the_heap_before_timing(dist: Any) -> None:
    """Catches: the calibration timing its calls before settling the heap (or not at all)."""
    for events in dist(2).run(_settle_order):
        assert events[0] == "settle" and events.count("settle") == 1 and "call" in events, events


def _measured_muon_on_own_group(timeout_s: float) -> tuple[Any, Any, Any, Any, Any]:
    """``SHAPES`` sharded on a (2,) mesh, two gradient sets, and a Muon priced in measured
    seconds on a gloo process group of its own: (fulls, grads, params, group, optimizer)."""
    from datetime import timedelta

    import torch.distributed as tdist

    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 2)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=6))
    config = canzona.PipelineConfig(process_group=group, timeout_s=timeout_s)
    opt = canzona.Muon(params, **MUON_KW, plan=plan(cost="measured"), pipeline=config)
    return fulls, grads, params, group, opt


def _step_each(opt: Any, params: Any, grads: list[dict[str, torch.Tensor]]) -> list[str]:
    """One step per gradient set: ``"ok"`` or the error, up to the first error."""
    outcomes = []
    for g in grads:
        set_grads(params, g)
        try:
            opt.step()
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
            break
    return outcomes


def _calibration_fails_on_rank_1(stall: bool) -> dict[str, Any]:
    """The first step's calibration raises on rank 1 allocating its inputs (out of memory),
    or (``stall``) rank 1 never reaches the calibration's agreement."""
    import time
    import warnings

    import torch.distributed as tdist

    # a group of its own: a stalled rank leaves nothing pending in the pool's
    fulls, grads, params, group, opt = _measured_muon_on_own_group(2.0)
    rank = tdist.get_rank()
    calibrate_module._CACHE.clear()  # time every shape again, inputs allocated
    randn, agree = torch.randn, calibrate_module.median_over_ranks

    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("out of memory (simulated)")

    def late(*args: Any, **kwargs: Any) -> list[float]:
        time.sleep(4.0)  # past the 2 s deadline of the others
        raise RuntimeError("late (simulated)")

    if rank == 1:
        if stall:
            calibrate_module.median_over_ranks = late  # type: ignore[assignment]
        else:
            torch.randn = refuse  # type: ignore[assignment]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            outcomes = _step_each(opt, params, grads)
        finally:
            torch.randn, calibrate_module.median_over_ranks = randn, agree  # type: ignore[assignment]
    out: dict[str, Any] = {
        "outcomes": outcomes,
        "warned": [str(w.message) for w in caught if "calibration raised" in str(w.message)],
    }
    if not stall:
        out["table"] = opt._runtime.plan.optimizer.params()
        got = {n: p.full_tensor() for n, p in params}
        out["compare"] = compare(got, reference_muon(fulls, grads, **MUON_KW))
    tdist.destroy_process_group(group)
    return out


def test_a_calibration_that_raises_on_one_rank_prices_the_plan_by_the_others(dist: Any) -> None:
    """Catches: the calibration's inputs allocated outside its failure capture (rank 1 raised
    alone and rank 0 waited in the agreement until the process group's own timeout)."""
    out = dist(2).run(_calibration_fails_on_rank_1, False)
    assert [o["outcomes"] for o in out] == [["ok", "ok"], ["ok", "ok"]]
    assert out[0]["warned"] == []
    assert len(out[1]["warned"]) == 1 and "out of memory (simulated)" in out[1]["warned"][0]
    assert out[0]["table"] == out[1]["table"]  # one table on every rank
    for o in out:
        assert all(eq for eq, _ in o["compare"].values()), o["compare"]


def _rate_known_on_rank_0() -> dict[str, Any]:
    """Rank 0 alone holds a transfer rate for the process group (measured before under the
    same key, as after a process group re-created where an earlier one lived): two steps
    priced in measured seconds."""
    import torch.distributed as tdist

    fulls, grads, params, group, opt = _measured_muon_on_own_group(5.0)
    rank = tdist.get_rank()
    key = (id(group), 2, "cpu")
    if rank == 0:
        calibrate_module._RATES[key] = 1e9
    try:
        outcomes = _step_each(opt, params, grads)
    finally:
        calibrate_module._RATES.pop(key, None)
    models = opt._runtime.plan.optimizer.models.values()  # type: ignore[attr-defined]
    got = {n: p.full_tensor() for n, p in params}
    tdist.destroy_process_group(group)
    return {
        "outcomes": outcomes,
        "rates": sorted({m.bytes_per_s for m in models}),
        "compare": compare(got, reference_muon(fulls, grads, **MUON_KW)),
    }


def test_a_transfer_rate_known_on_some_ranks_only_is_agreed(dist: Any) -> None:
    """The transfer-rate probe is a collective that a rank skips when it measured the rate
    before. Catches: that decision taken by each rank alone (rank 1 probed while rank 0 went
    on to the next collective, whose sizes differ); every rank plans with rank 0's rate."""
    out = dist(2).run(_rate_known_on_rank_0)
    for o in out:
        assert o["outcomes"] == ["ok", "ok"], o["outcomes"]
        assert o["rates"] == [1e9]
        assert all(eq for eq, _ in o["compare"].values()), o["compare"]


def test_the_calibrations_agreement_waits_with_the_deadline(dist: Any) -> None:
    """Catches: the agreement's all-gather waited without a deadline (the process group's own
    timeout, minutes on a real job, instead of ``timeout_s``)."""
    out = dist(2).run(_calibration_fails_on_rank_1, True)
    assert out[1]["outcomes"] == ["RuntimeError: late (simulated)"]
    (outcome,) = out[0]["outcomes"]
    assert outcome.startswith("CollectiveTimeoutError: rank 0: the calibration's agreement")
    assert "did not complete within 2s" in outcome
