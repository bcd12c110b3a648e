"""The step's cross-rank check rides the first gather in steady steps, and declines exactly.

A step that repeats the last agreed one (same plan, same parameters with gradients) sends its
header in a slot of the first micro-group's gather instead of a collective of its own. When
the headers disagree or some rank's step differs, every rank undoes the step and runs it again
with the check on its own, which re-plans or raises the usual error. These scenarios change
things *after* steady steps, where the header rides (the error tests of
``test_errors_dist.py`` change them at the first step, where it does not).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist
from test_atomic_step import differences, raised, snapshot
from torch import nn
from torch.distributed.tensor.placement_types import Shard

import canzona

from _cases import SHAPES, full_of, full_tensors, grad_steps, reference_muon, sharded_params
from _dist import mesh

TIMEOUT = 120
#: Two matrices of each shape: on four ranks, a tiny capacity cuts them into micro-groups.
SHAPE_OF = {f"{n}{k}": SHAPES[n] for k in ("", "_b") for n in ("square", "tall", "wide")}
NAMES = tuple(SHAPE_OF)
KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}


def _params() -> list[tuple[str, nn.Parameter]]:
    fulls = full_tensors(SHAPE_OF)
    return sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in NAMES})


def _set(
    params: list[tuple[str, nn.Parameter]], grads: dict[str, torch.Tensor], skip: set[str]
) -> None:
    """Gradients in the parameters' layouts; none for the names in ``skip`` (which may differ
    across ranks: the gradients are made, collectively, for every name first)."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in params:
        grad = distribute_tensor(grads[name].clone(), p.device_mesh, p.placements)
        p.grad = None if name in skip else grad


def _steady(
    strategy: str, steps: int, atomic: bool = True, capacity_mb: float = 512.0
) -> dict[str, Any]:
    params = _params()
    opt = canzona.Muon(
        params,
        **KW,
        plan=canzona.PlanConfig(strategy=strategy, capacity_mb=capacity_mb),
        # one plan throughout (the re-pricing by the steps' calls, which re-plans twice and
        # does not ride, is test_repricing's)
        pipeline=canzona.PipelineConfig(atomic=atomic, reprice_steps=0),
    )
    grads = grad_steps(SHAPE_OF, steps)
    rode, sent, collectives = [], [], []
    for g in grads:
        _set(params, g, set())
        opt.step()
        stats = opt.last_step_stats
        rode.append(stats.header_rode)
        sent.append(stats.bytes_sent)
        collectives.append(stats.collectives)
    # payload bytes (even shards): the gather sends this rank's shard of every matrix owned
    # elsewhere (of every matrix, to every other rank, when every rank computes everything);
    # the scatter sends every other rank its shard of the directions this rank owns; fp32
    # parameters with the default bf16 Newton–Schulz travel cast, both ways: 2 bytes each
    plan = opt._runtime.plan
    assert plan is not None
    world, rank = tdist.get_world_size(), tdist.get_rank()
    bf16 = 2
    expected = 0
    for name, p in params:
        assert p.dtype == torch.float32
        local = p.to_local().numel()
        if plan.assignment.replicated:
            expected += local * (world - 1) * bf16
        elif plan.assignment.owner[name] != rank:
            expected += local * bf16
        else:
            expected += local * (world - 1) * bf16
    (pipeline,) = opt._runtime._pipelines.values()
    first = pipeline.schedule.micro_groups[0]
    return {
        "rode": rode,
        "sent": sent,
        "expected_sent": expected,
        "first_send": [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in first.send],
        "header_slots": len(first.header_slots),
        "micro_groups": opt.last_step_stats.micro_groups,
        "collectives": collectives,
        "params": {n: full_of(p) for n, p in params},
    }


def test_steady_steps_ride_the_first_gather_and_stay_bitwise(dist: Any) -> None:
    """Catches: a header that never rides (or rides from the first step, before any plan was
    agreed), a header slot counted as payload bytes or misread by the owners' assembly (the
    result would differ from ``torch.optim.Muon``), for both strategies that scatter or not,
    and with one matrix per micro-group, whose first gathers travel fused; the slots not laid
    out in the payload buffer (the first gather's send buffer would be a copy), or written
    before the payloads' cast overwrites them (the headers would decline every step), and
    fp32 fragments sent uncast to a bf16 Newton–Schulz (twice the bytes for the same bits)."""
    fulls = full_tensors(SHAPE_OF)
    grads = grad_steps(SHAPE_OF, 5)
    want = reference_muon(fulls, grads, **KW)
    for strategy, capacity, groups in (
        ("canzona", 512.0, 1),
        ("replicated", 512.0, 1),
        ("canzona", 1e-4, 2),
    ):
        out = dist(4).run(_steady, strategy, 5, True, capacity, timeout=TIMEOUT)
        for rank in out:
            assert rank["micro_groups"] == groups, (strategy, capacity, rank["micro_groups"])
            assert rank["rode"] == [False, False, True, True, True], strategy
            # the header's slot is not payload, ridden or not
            assert rank["sent"] == [rank["expected_sent"]] * 5, (strategy, rank)
            assert len(set(rank["collectives"])) == 1, (strategy, rank["collectives"])
            for name in NAMES:
                assert torch.equal(rank["params"][name], want[name]), (strategy, name)
            # the slots lie in the payload buffer, one before each destination's segment
            assert rank["header_slots"] == 4, (strategy, rank["header_slots"])
            if strategy == "canzona" and groups == 1:  # so the send is one range: no copy
                assert len(rank["first_send"]) == 1, rank["first_send"]


def test_a_step_that_is_not_atomic_never_rides(dist: Any) -> None:
    """Catches: riding without the backups that undo a declined step exactly."""
    out = dist(4).run(_steady, "canzona", 4, False, timeout=TIMEOUT)
    assert all(rank["rode"] == [False] * 4 for rank in out)


def _grad_dropped_everywhere() -> dict[str, Any]:
    params = _params()
    opt = canzona.Muon(params, **KW)
    grads = grad_steps(SHAPE_OF, 7)
    rode = []
    for step, g in enumerate(grads):
        _set(params, g, {"tall"} if step == 3 else set())
        opt.step()
        rode.append(opt.last_step_stats.header_rode)
    return {"rode": rode, "params": {n: full_of(p) for n, p in params}}


def _one_device_skipping(skip_step: int, steps: int) -> dict[str, torch.Tensor]:
    """``canzona.Muon`` on plain tensors, ``tall`` without a gradient at ``skip_step``."""
    fulls = full_tensors(SHAPE_OF)
    grads = grad_steps(SHAPE_OF, steps)
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    opt = canzona.Muon(params, **KW)
    for step, g in enumerate(grads):
        for name, p in params:
            p.grad = None if (name == "tall" and step == skip_step) else g[name].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in params}


def test_a_gradient_missing_everywhere_after_steady_steps_reruns_the_step(dist: Any) -> None:
    """Every rank's step differs from the agreed one (``tall`` has no gradient): the ridden
    header declines, the step runs again with the check on its own and skips ``tall``, the
    header rides again two steps after the change. Catches: a declined step that is not run
    again (every parameter would lag a step), one that goes on by the old plan (``tall``
    would be updated without a gradient), and riding right after the change."""
    out = dist(4).run(_grad_dropped_everywhere, timeout=TIMEOUT)
    want = _one_device_skipping(3, 7)
    for rank in out:
        assert rank["rode"] == [False, False, True, False, False, False, True]
        for name in NAMES:
            assert torch.equal(rank["params"][name], want[name]), name


def _mismatch_after_steady(what: str) -> dict[str, Any]:
    params = _params()
    opt = canzona.Muon(params, **KW)
    grads = grad_steps(SHAPE_OF, 4)
    for g in grads[:3]:
        _set(params, g, set())
        opt.step()
    rode = opt.last_step_stats.header_rode
    before = snapshot(params, opt)
    if what == "grad":  # missing on ranks 1 and 3 only
        _set(params, grads[3], {"tall"} if tdist.get_rank() in (1, 3) else set())
    else:  # rank 0 alone changes the learning rate
        _set(params, grads[3], set())
        if tdist.get_rank() == 0:
            opt.param_groups[0]["lr"] = 0.03
    result = raised(opt.step)
    opt.param_groups[0]["lr"] = KW["lr"]
    after = snapshot(params, opt)
    return {"rode": rode, "result": result, "changed": differences(after, before)}


def test_a_mismatch_after_steady_steps_raises_everywhere_and_changes_nothing(dist: Any) -> None:
    """Gradients on some ranks only, or one rank's learning rate, after the header began to
    ride: the same error as at the first step on every rank, and no parameter or state
    changed anywhere. Catches: ranks that prepared by the old plan (their momentum advanced)
    left so by a declined step, and a ridden header that lets the step go on."""
    for what, kind, text in (
        ("grad", "GradientMismatchError", "'tall' has a gradient on 2 of 4 ranks"),
        ("lr", "PlanMismatchError", "hyper-parameters"),
    ):
        out = dist(4).run(_mismatch_after_steady, what, timeout=TIMEOUT)
        for rank in out:
            assert rank["rode"] is True, what
            assert rank["result"]["kind"] == kind, (what, rank["result"])
            assert text in rank["result"]["message"], (what, rank["result"])
            assert rank["changed"] == [], (what, rank["changed"])


def _nan_on_rank0_after_steady() -> dict[str, Any]:
    fulls = full_tensors(SHAPE_OF)
    grads = grad_steps(SHAPE_OF, 7)
    grads[3]["square"][1, 2] = float("nan")  # row 1: rank 0's shard only
    cfg = canzona.PipelineConfig(skip_nonfinite=True, reprice_steps=0)  # one plan throughout
    local = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    out: dict[str, Any] = {}
    for label, params in (("one device", local), ("mesh", _params())):
        opt = canzona.Muon(params, **KW, pipeline=cfg)
        rode = []
        for g in grads:
            if label == "mesh":
                _set(params, g, set())
            else:
                _set_plain(params, g)
            opt.step()
            rode.append(opt.last_step_stats.header_rode)
        out[label] = {
            "params": {n: full_of(p) for n, p in params},
            "skipped": opt.skipped_steps,
            "rode": rode,
        }
    return out


def _set_plain(params: list[tuple[str, nn.Parameter]], grads: dict[str, torch.Tensor]) -> None:
    for name, p in params:
        p.grad = grads[name].clone()


def test_a_nonfinite_gradient_on_one_rank_after_steady_steps_skips_everywhere(dist: Any) -> None:
    """``skip_nonfinite=True``: a NaN in rank 0's rows at a step whose header rides. Rank 0
    is not ready, the others prepared and computed; the declined step is undone and the
    separate check skips it on every rank, as on one device. Catches: a rank that counts
    the skipped step's gradients in its momentum (the later steps would differ), a skip
    missed by the ranks that saw no NaN, and riding right after the skip."""
    for rank in dist(4).run(_nan_on_rank0_after_steady, timeout=TIMEOUT):
        one, mesh_run = rank["one device"], rank["mesh"]
        assert one["skipped"] == mesh_run["skipped"] == 1
        assert mesh_run["rode"] == [False, False, True, False, False, False, True]
        for name in NAMES:
            assert torch.equal(mesh_run["params"][name], one["params"][name]), name
