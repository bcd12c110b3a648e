"""Edge cases of the distributed step, checkpoints and failures, on real gloo ranks."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import canzona
from canzona.runtime import ComputeBatch

from _cases import (
    OWNER_KW,
    SHAPES,
    compare,
    full_of,
    full_tensors,
    grad_steps,
    reference_muon,
    set_grads,
    sharded_params,
)
from _dist import mesh

TIMEOUT = 60


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # report the exception type and message to the test
        return type(exc).__name__, str(exc)
    return "ok", ""


def _fresh_group() -> Any:
    """A group of its own, so that a collective left pending cannot meet a later scenario's."""
    return tdist.new_group(backend="gloo", timeout=timedelta(seconds=30))


class FailingMuon(canzona.Muon):
    """Muon whose full-matrix computation raises on one rank (an OOM or a driver error)."""

    fail_rank = 1

    def _directions(self, batch: ComputeBatch, full: torch.Tensor) -> torch.Tensor:
        if tdist.get_rank() == self.fail_rank:
            raise RuntimeError("injected failure")
        return super()._directions(batch, full)


class FailingShampoo(canzona.Shampoo):
    """Shampoo whose full-matrix computation raises on one rank at one step."""

    fail_rank = 0
    fail_step = 1

    def _directions(self, batch: ComputeBatch, full: torch.Tensor) -> torch.Tensor:
        out = super()._directions(batch, full)  # the owner-held state has advanced
        if tdist.get_rank() == self.fail_rank and self._item_step(batch.items[0]) == self.fail_step:
            raise RuntimeError("injected failure")
        return out


def _state_fulls(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dict()`` with full tensors (collective), and its param groups."""
    sd = opt.state_dict()
    out: dict[str, Any] = {"param_groups": repr(sd["param_groups"])}
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            out[f"{pid}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same keys, every tensor bitwise equal."""
    if a.keys() != b.keys():
        return False
    return all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# --------------------------------------------------------------------------- failures


def _replicated_failure_on_one_rank() -> dict[str, Any]:
    group = _fresh_group()
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"]}
    fulls = full_tensors(shapes)
    params = sharded_params(fulls, mesh((2,)), {n: (Replicate(),) for n in shapes})
    opt = FailingMuon(
        params,
        lr=0.02,
        plan=canzona.PlanConfig(strategy="replicated", capacity_mb=1e-4),
        pipeline=canzona.PipelineConfig(process_group=group, timeout_s=5.0),
    )
    set_grads(params, grad_steps(shapes, 1)[0])
    kind, msg = _outcome(opt.step)
    return {
        "kind": kind,
        "msg": msg,
        "unchanged": {n: bool(torch.equal(p.to_local(), fulls[n])) for n, p in params},
    }


def test_replicated_strategy_failure_raises_on_every_rank(dist: Any) -> None:
    """No scatter carries a status with `replicated`: the failure must still reach every rank.

    Catches: a vote skipped when there is nothing to scatter (rank 0 would apply its own
    copy and return normally while rank 1 raises).
    """
    out = dist(2).run(_replicated_failure_on_one_rank, timeout=TIMEOUT)
    assert [o["kind"] for o in out] == ["UpdateFailedError"] * 2, out
    for o in out:  # every copy of every parameter stays as it was
        assert o["msg"].startswith("the step failed on ranks [1] (rank 1: computing"), o["msg"]
        assert o["unchanged"] == {"square": True, "tall": True}, out


def _state_dict_after_failed_step() -> dict[str, Any]:
    group = _fresh_group()
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"], "wide": SHAPES["wide"]}
    grads = grad_steps(shapes, 2)
    out: dict[str, Any] = {}
    for fail_step in (1, 2):  # the first step (no state yet), a later one (state exists)
        params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
        opt = FailingShampoo(
            params,
            lr=0.01,
            precondition_frequency=1,
            start_preconditioning_step=1,
            pipeline=canzona.PipelineConfig(process_group=group, timeout_s=3.0),
        )
        opt.fail_step = fail_step
        for g in grads[: fail_step - 1]:
            set_grads(params, g)
            opt.step()
        before = _state_fulls(opt)
        set_grads(params, grads[fail_step - 1])
        kind, _ = _outcome(opt.step)
        holder: dict[str, Any] = {}
        second, msg = _outcome(lambda: holder.update(sd=_state_fulls(opt)))  # noqa: B023
        after = holder.get("sd", {})
        out[f"step {fail_step}"] = {
            "step": kind,
            "state_dict": second,
            "msg": msg[:200],
            "entries": sorted(k for k in after if k != "param_groups"),
            "same_as_before": _same(after, before),
        }
    return out


def test_state_dict_after_a_failed_step_is_collective_safe(dist: Any) -> None:
    """``state_dict()`` after an UpdateFailedError runs on every rank and returns the state of
    before the failed step, bit for bit: nothing at all after a failed first step, every
    owner-held tensor after a failed later one.

    Catches: owner-held state or step counters left advanced by the failed step, state
    created by a failed first step, a state_dict that hangs or raises after a failure.
    """
    shampoo = ["exp_avg", "factor_left", "factor_right", "graft_exp_avg_sq", "inv_root_left"]
    shampoo += ["inv_root_right", "step"]
    for o in dist(2).run(_state_dict_after_failed_step, timeout=TIMEOUT):
        first, later = o["step 1"], o["step 2"]
        for case in (first, later):
            assert case["step"] == "UpdateFailedError", o
            assert case["state_dict"] == "ok", o
            assert case["same_as_before"], o
        assert first["entries"] == []
        assert later["entries"] == sorted(f"{pid}.{key}" for pid in range(3) for key in shampoo)


# --------------------------------------------------------------------------- names


def test_duplicate_parameter_names_are_refused() -> None:
    """Names key the plan and the routes: a repeated name is an error, never a lost update.

    Catches: a check by name within one group only, and an ``add_param_group`` that keeps
    the refused group."""
    params = [nn.Parameter(torch.randn(8, 8)) for _ in range(2)]
    # names repeat across groups, e.g. two sub-modules' named_parameters()
    with pytest.raises(ValueError, match=r"unique.*'0.weight'"):
        canzona.Muon([{"params": [("0.weight", params[0])]}, {"params": [("0.weight", params[1])]}])
    opt = canzona.Muon([("0.weight", params[0])])
    with pytest.raises(ValueError, match="unique"):
        opt.add_param_group({"params": [("0.weight", params[1])]})
    assert len(opt.param_groups) == 1


#: a stack ``w`` beside parameters named like its matrices, and like the names that
#: disambiguate them
LOOKALIKES = {"w": (2, 8, 8), "w[0]": (8, 8), "w[1]": (16, 8), "w[0]~0": (8, 16)}


def _lookalike_names(world: int) -> dict[str, tuple[bool, float]]:
    fulls = full_tensors(LOOKALIKES)
    grads = grad_steps(LOOKALIKES, 2)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    if world == 1:
        params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    else:
        rows = {n: (Shard(1) if len(s) == 3 else Shard(0),) for n, s in LOOKALIKES.items()}
        params = sharded_params(fulls, mesh((world,)), rows)
    opt = canzona.Muon(params, **kw)
    for g in grads:
        set_grads(params, g)
        opt.step()
    return compare({n: full_of(p) for n, p in params}, reference_muon(fulls, grads, **kw))


@pytest.mark.parametrize("world", [1, 2])
def test_parameter_names_like_a_stacks_matrices_are_updated_exactly(dist: Any, world: int) -> None:
    """Catches: matrices named by their parameter's name plus ``[lead]`` (a stack ``w``'s
    ``w[0]``) colliding with a parameter named ``w[0]``: routes keyed by name overwrote each
    other (every step failed on one device; the plan refused it on two ranks)."""
    out = [_lookalike_names(1)] if world == 1 else dist(world).run(_lookalike_names, world)
    for per_rank in out:
        assert per_rank == {n: (True, 0.0) for n in LOOKALIKES}, per_rank


# --------------------------------------------------------------------------- watchdog


def _late_rank(delay: float) -> dict[str, Any]:
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 2)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, **kw, pipeline=canzona.PipelineConfig(timeout_s=30.0))
    kinds = []
    for g in grads:
        set_grads(params, g)
        if tdist.get_rank() == 1:
            time.sleep(delay)  # e.g. a slower data loader: well past the watchdog's grace
        kinds.append(_outcome(opt.step)[0])
        opt.zero_grad(set_to_none=True)
    want = reference_muon(fulls, grads, **kw)
    got = {n: full_of(p) for n, p in params}
    return {"kinds": kinds, "same": {n: eq for n, (eq, _) in compare(got, want).items()}}


def test_a_rank_arriving_after_the_grace_still_completes_the_step(dist: Any) -> None:
    """gloo: a wait that outlives the 1 s grace publishes a marker and keeps waiting."""
    for out in dist(2).run(_late_rank, 1.5, timeout=TIMEOUT):
        assert out == {"kinds": ["ok", "ok"], "same": {"square": True, "tall": True}}


# --------------------------------------------------------------------------- gradients


def _grads_in_other_placements() -> dict[str, bool]:
    """Gradients stored Replicate / column-sharded while the parameters are row-sharded."""
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"], "stack": SHAPES["stack"]}
    shapes["tall"] = SHAPES["tall"]
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 2)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    want = reference_muon(fulls, grads, **kw)
    dm = mesh((4,))
    params = sharded_params(fulls, dm, {n: (Shard(0),) for n in shapes})
    grad_placements = {"square": (Replicate(),), "odd": (Shard(1),), "stack": (Shard(2),)}
    opt = canzona.Muon(params, **kw)
    for g in grads:
        for name, p in params:
            if name == "tall":  # a pending sum: rank 0 holds it all, exact after reduction
                part = g[name].clone() if tdist.get_rank() == 0 else torch.zeros_like(g[name])
                p.grad = DTensor.from_local(part, dm, [Partial()], run_check=False)
                continue
            p.grad = distribute_tensor(g[name].clone(), dm, grad_placements[name])
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = {n: full_of(p) for n, p in params}
    return {n: eq for n, (eq, _) in compare(got, want).items()}


def test_gradients_in_other_placements_are_redistributed(dist: Any) -> None:
    for out in dist(4).run(_grads_in_other_placements, timeout=TIMEOUT):
        assert out == {"square": True, "odd": True, "stack": True, "tall": True}


def _zero_grads_kept() -> dict[str, Any]:
    """zero_grad(set_to_none=False): zero gradients are gradients; equal to one device."""
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    kw = {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2}

    def run(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        opt = canzona.Shampoo(params, **kw)
        for step, g in enumerate(grads):
            if step != 1:  # step 1 runs on the zeros left by zero_grad(set_to_none=False)
                set_grads(params, g)
            opt.step()
            opt.zero_grad(set_to_none=False)
        return {n: full_of(p) for n, p in params}

    want = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()])
    got = run(sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes}))
    return {n: eq for n, (eq, _) in compare(got, want).items()}


def test_zero_gradients_kept_by_zero_grad_match_one_device(dist: Any) -> None:
    for out in dist(4).run(_zero_grads_kept, timeout=TIMEOUT):
        assert all(out.values()), out


# --------------------------------------------------------------------------- dtypes


def _half_muon(dtype: torch.dtype) -> dict[str, bool]:
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"], "wide": SHAPES["wide"]}
    shapes["odd"] = SHAPES["odd"]
    shapes["stack"] = SHAPES["stack"]
    fulls = {n: t.to(dtype) for n, t in full_tensors(shapes).items()}
    grads = [{n: t.to(dtype) for n, t in g.items()} for g in grad_steps(shapes, 3)]
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    want = reference_muon(fulls, grads, **kw)
    placements = {n: (Shard(0), Shard(len(s) - 1)) for n, s in shapes.items()}
    params = sharded_params(fulls, mesh((2, 2)), placements)
    opt = canzona.Muon(params, **kw)
    for g in grads:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = {n: full_of(p) for n, p in params}
    # within one rounding of torch per step: CPU half-precision add_(alpha=...) rounds an
    # element differently in the vectorised body and in the scalar tail, so shard sizes
    # matter; the directions depend on the gradients alone (equal on both sides), so a
    # parameter's differences only carry from step to step, one rounding at most each
    ulp = len(grads) * (2.0**-7 if dtype == torch.bfloat16 else 2.0**-10)
    return {
        n: got[n].dtype == dtype
        and bool(((got[n].float() - want[n].float()).abs() <= want[n].float().abs() * ulp).all())
        for n in shapes
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_on_a_2d_mesh_match_torch_muon(
    dist: Any, dtype: torch.dtype
) -> None:
    for out in dist(4).run(_half_muon, dtype, timeout=TIMEOUT):
        assert all(out.values()), out


def _bf16_owner_state(name: str) -> dict[str, Any]:
    cls = getattr(canzona, name)
    kw: dict[str, Any] = {"lr": 0.01, "precondition_frequency": 2}
    if name == "Shampoo":
        kw["start_preconditioning_step"] = 2
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"], "stack": SHAPES["stack"]}
    fulls = {n: t.bfloat16() for n, t in full_tensors(shapes).items()}
    grads = [{n: t.bfloat16() for n, t in g.items()} for g in grad_steps(shapes, 4)]

    def run(params: list[tuple[str, nn.Parameter]]) -> tuple[dict[str, torch.Tensor], Any]:
        opt = cls(params, **kw)
        for g in grads:
            set_grads(params, g)
            opt.step()
            opt.zero_grad(set_to_none=True)
        sd = opt.state_dict()
        dtypes = sorted({str(v.dtype) for e in sd["state"].values() for k, v in e.items()})
        return {n: full_of(p) for n, p in params}, dtypes

    want, _ = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()])
    got, dtypes = run(sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes}))
    return {"same": {n: eq for n, (eq, _) in compare(got, want).items()}, "dtypes": dtypes}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP"])
def test_bfloat16_parameters_keep_fp32_owner_state(dist: Any, name: str) -> None:
    for out in dist(4).run(_bf16_owner_state, name, timeout=TIMEOUT):
        assert all(out["same"].values()), out
        assert "torch.float32" in out["dtypes"] and "torch.bfloat16" not in out["dtypes"]


# --------------------------------------------------------------------------- the step


def _training_features(name: str, check_every_step: bool) -> dict[str, bool]:
    """AdamW group + matrix groups, an lr scheduler, a closure, add_param_group mid-run."""
    cls = getattr(canzona, name)
    kw = dict(OWNER_KW.get(name, {"lr": 0.02, "momentum": 0.9}))
    shapes = {"square": SHAPES["square"], "tall": SHAPES["tall"], "odd": SHAPES["odd"]}
    shapes["stack"] = SHAPES["stack"]
    shapes["bias"] = (16,)
    shapes["empty"] = (0, 8)
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 5)
    pipeline = canzona.PipelineConfig(check_every_step=check_every_step, depth=2)

    def run(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        by = dict(params)
        opt = cls(
            [
                {"params": [(n, by[n]) for n in ("square", "empty")]},
                {"params": [("bias", by["bias"])], "algorithm": "adamw", "lr": 3e-3},
            ],
            **kw,
            plan=canzona.PlanConfig(capacity_mb=1e-3),
            pipeline=pipeline,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for step, g in enumerate(grads):
            if step == 2:
                opt.add_param_group({"params": [(n, by[n]) for n in ("tall", "odd", "stack")]})
                sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 / (1 + s))
            live = [(n, p) for n, p in params if step >= 2 or n not in ("tall", "odd", "stack")]

            def closure(live: Any = live, g: Any = g) -> torch.Tensor:
                set_grads(live, g)
                return torch.tensor(float(len(live)))

            loss = opt.step(closure)
            assert float(loss) == float(len(live))
            sched.step()
            opt.zero_grad(set_to_none=True)
        return {n: full_of(p) for n, p in params}

    want = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()])
    placements = {n: (Shard(0),) for n in shapes}
    placements["odd"] = (Shard(1),)
    got = run(sharded_params(fulls, mesh((4,)), placements))
    return {n: eq for n, (eq, _) in compare(got, want).items()}


@pytest.mark.parametrize("check_every_step", [True, False])
@pytest.mark.parametrize("name", ["Muon", "NorMuon", "Shampoo", "SOAP"])
def test_groups_scheduler_closure_and_late_groups_match_one_device(
    dist: Any, name: str, check_every_step: bool
) -> None:
    for out in dist(4).run(_training_features, name, check_every_step, timeout=TIMEOUT):
        assert all(out.values()), out


def _failure_with_groups_in_flight(overlap: bool, depth: int) -> dict[str, Any]:
    group = _fresh_group()
    shapes = {f"w{i}": (8 + i, 8) for i in range(6)}
    fulls = full_tensors(shapes)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = FailingMuon(
        params,
        lr=0.02,
        plan=canzona.PlanConfig(capacity_mb=1e-4),  # one matrix per owner per micro-group
        pipeline=canzona.PipelineConfig(
            process_group=group, timeout_s=10.0, overlap=overlap, depth=depth
        ),
    )
    set_grads(params, grad_steps(shapes, 1)[0])
    kind, msg = _outcome(opt.step)
    assert opt._runtime.plan is not None
    return {
        "kind": kind,
        "msg": msg,
        "groups": len(opt._runtime.plan.micro_groups),
        "changed": sorted(n for n, p in params if not torch.equal(p.full_tensor(), fulls[n])),
        "state": len(opt.state),
    }


@pytest.mark.parametrize(("overlap", "depth"), [(False, 1), (True, 1), (True, 3)])
def test_a_failure_with_micro_groups_in_flight_stops_every_rank_alike(
    dist: Any, overlap: bool, depth: int
) -> None:
    """Rank 1's computation raises in its first micro-group while later ones are in flight.

    Every rank raises the same error naming rank 1, and no parameter changed anywhere: not
    the micro-groups before the failure, not the failing one, not the later ones (rank 0's
    computations all succeeded). Catches: applying a micro-group's directions before the
    step's vote, and skipping only the failing micro-group.
    """
    out = dist(2).run(_failure_with_groups_in_flight, overlap, depth, timeout=TIMEOUT)
    assert out[0]["msg"] == out[1]["msg"]
    for o in out:
        assert o["groups"] >= 3, o  # several micro-groups, so that some are in flight
        assert o["kind"] == "UpdateFailedError", o
        assert o["msg"].startswith("the step failed on ranks [1] (rank 1: computing micro-group 0")
        assert o["changed"] == [], o
        assert o["state"] == 0, o  # the state created by the failed first step is gone


class _Tag:
    """A value kept in a param group next to the hyper-parameters (default repr: an address)."""


def _object_in_param_group() -> tuple[str, str]:
    tag, kept = _Tag(), []
    seen: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(seen, id(tag))
    while tdist.get_rank() == 1 and id(tag) == seen[0]:  # as in separate processes (ASLR)
        kept.append(tag)
        tag = _Tag()
    shapes = {"square": SHAPES["square"]}
    params = sharded_params(full_tensors(shapes), mesh((2,)), {"square": (Shard(0),)})
    opt = canzona.Muon([{"params": params, "tag": tag}], lr=0.02)
    set_grads(params, grad_steps(shapes, 1)[0])
    return _outcome(opt.step)


def test_objects_in_param_groups_do_not_fail_the_hyper_parameter_check(dist: Any) -> None:
    assert dist(2).run(_object_in_param_group, timeout=TIMEOUT) == [("ok", "")] * 2


def _replicated_results_alive() -> int:
    """How many earlier micro-groups' full results are still alive when the last one computes."""
    import weakref

    from canzona.runtime import pipeline as pipeline_module

    original = pipeline_module._Run._compute_group
    refs: list[Any] = []
    alive_at_last: list[int] = []

    def spy(self: Any, g: Any, recv: Any) -> Any:
        alive_at_last.append(sum(r() is not None for r in refs))
        results = original(self, g, recv)
        refs.extend(weakref.ref(out.untyped_storage()) for out in results)
        return results

    shapes = {f"w{i}": (32, 32) for i in range(8)}
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(
        params,
        lr=0.02,
        plan=canzona.PlanConfig(strategy="replicated", capacity_mb=32 * 32 * 2 / 2**20),
        pipeline=canzona.PipelineConfig(overlap=False),
    )
    set_grads(params, grad_steps(shapes, 1)[0])
    pipeline_module._Run._compute_group = spy  # type: ignore[method-assign]
    try:
        opt.step()
    finally:
        pipeline_module._Run._compute_group = original  # type: ignore[method-assign]
    assert len(alive_at_last) == len(shapes)  # one matrix per micro-group
    return alive_at_last[-1]


def test_replicated_strategy_frees_each_micro_groups_results(dist: Any) -> None:
    for alive in dist(2).run(_replicated_results_alive, timeout=TIMEOUT):
        assert alive <= 1, f"{alive} earlier micro-groups' full results still held"


# --------------------------------------------------------------------------- copies


def _deepcopy_on_a_mesh(name: str) -> dict[str, Any]:
    """deepcopy((params, optimizer)) after 2 steps; both step on with the same gradients."""
    import copy

    cls = getattr(canzona, name)
    kw = dict(OWNER_KW.get(name, {"lr": 0.02, "momentum": 0.9, "ns_dtype": torch.float32}))
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"], "stack": SHAPES["stack"]}
    shapes["bias"] = (6,)
    grads = grad_steps(shapes, 4)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    groups = [
        {"params": params[:3]},
        {"params": params[3:], "algorithm": "adamw", "lr": 3e-3},
    ]
    opt = cls(groups, **kw)
    for g in grads[:2]:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    params2, opt2 = copy.deepcopy((params, opt))
    planned_before = opt2._runtime.plan is not None
    for g in grads[2:]:
        for ps in (params, params2):
            set_grads(ps, g)
        opt.step()
        opt2.step()
    grouped = opt2.param_groups[0]["params"][0] is params2[0][1]
    piped = cls(params[:3], **kw, pipeline=canzona.PipelineConfig(process_group=_fresh_group()))
    refused, msg = _outcome(lambda: copy.deepcopy(piped))
    return {
        "planned_before": planned_before,
        "planned_after": opt2._runtime.plan is not None,
        "own_params": grouped
        and all(p is not q for (_, p), (_, q) in zip(params, params2, strict=True)),
        "params": all(
            torch.equal(full_of(p), full_of(q))
            for (_, p), (_, q) in zip(params, params2, strict=True)
        ),
        "state": _same(_state_fulls(opt2), _state_fulls(opt)),
        "refused": (refused, "PipelineConfig holds a process group" in msg),
    }


FIRST = {f"a{i}": s for i, s in enumerate([(16, 16), (24, 8), (8, 24), (7, 13)])}
LATER = {f"b{i}": s for i, s in enumerate([(12, 12), (20, 6), (6, 20)])}


def _deepcopy_after_add_param_group(name: str, strategy: str) -> dict[str, Any]:
    """Copy after ``add_param_group`` and before the next step: the owner-held state still
    lives where the old plan put it, and the copy's first plan (for every parameter) moves
    some matrices to other owners (``numel``), or none while rank 1 holds no state at all
    (``count``)."""
    import copy

    shapes = {**FIRST, **LATER}
    grads = grad_steps(shapes, 4)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = getattr(canzona, name)(
        params[: len(FIRST)], **OWNER_KW[name], plan=canzona.PlanConfig(strategy=strategy)
    )

    def owners(o: Any) -> dict[str, tuple[int, ...]]:
        rt = o._runtime
        return {it.name: rt.routes[it.name].computing for it in rt.items if it.name in FIRST}

    for g in grads[:2]:
        set_grads(params[: len(FIRST)], g)
        opt.step()
    before = owners(opt)
    opt.add_param_group({"params": params[len(FIRST) :]})
    params2, opt2 = copy.deepcopy((params, opt))
    for g in grads[2:]:
        for ps in (params, params2):
            set_grads(ps, g)
        opt.step()
        opt2.step()
    return {
        "moved": sorted(n for n, o in owners(opt2).items() if o != before[n]),
        "params": all(
            torch.equal(full_of(p), full_of(q))
            for (_, p), (_, q) in zip(params, params2, strict=True)
        ),
        "state": _same(_state_fulls(opt2), _state_fulls(opt)),
    }


def _replan_then_fail(name: str, where: str) -> dict[str, Any]:
    """``add_param_group``, then a step that raises on every rank after its re-plan (in
    ``where``: building the new plan's pipeline, or moving the owner-held state, on its
    old owners or its new ones; "": nothing raises); the step is taken again and training
    goes on."""
    import canzona.optim.owner_state as owner_state
    import canzona.runtime.engine as engine

    shapes = {**FIRST, **LATER}
    grads = grad_steps(shapes, 4)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = getattr(canzona, name)(
        params[: len(FIRST)], **OWNER_KW[name], plan=canzona.PlanConfig(strategy="numel")
    )
    for g in grads[:2]:
        set_grads(params[: len(FIRST)], g)
        opt.step()
    opt.add_param_group({"params": params[len(FIRST) :]})
    outcome = "no error"
    if where:
        module = engine if where == "build_pipeline" else owner_state
        original = getattr(module, where)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("out of memory (simulated)")

        setattr(module, where, refuse)
        set_grads(params, grads[2])
        try:
            outcome = _outcome(opt.step)[1]
        finally:
            setattr(module, where, original)
    for g in grads[2:]:
        set_grads(params, g)
        opt.step()
    return {"outcome": outcome, "params": {n: full_of(p) for n, p in params}, **_state_fulls(opt)}


@pytest.mark.parametrize("name", ["Shampoo", "NorMuon"])
@pytest.mark.parametrize("where", ["build_pipeline", "export_state", "import_state"])
def test_a_step_that_raises_after_its_replan_loses_no_owner_state(
    dist: Any, name: str, where: str
) -> None:
    """Catches: a step that re-planned (owners moved after ``add_param_group``) and raised
    before the owner-held state moved: the plan was kept, the move forgotten, and the moved
    matrices went on from fresh state. Likewise a move that raised on its way: the state
    already taken from its old owners was lost (the next steps raised, or restarted it).
    Taken again, the step must continue exactly."""
    failed = dist(2).run(_replan_then_fail, name, where, timeout=TIMEOUT)
    straight = dist(2).run(_replan_then_fail, name, "", timeout=TIMEOUT)
    for got, want in zip(failed, straight, strict=True):
        assert got["outcome"] == "out of memory (simulated)"
        assert got.keys() == want.keys()
        for key in got:
            if key == "params":
                assert all(torch.equal(got[key][n], v) for n, v in want[key].items()), name
            elif key != "outcome":
                assert _same({key: got[key]}, {key: want[key]}), key


@pytest.mark.parametrize(("strategy", "moved"), [("numel", ["a3"]), ("count", [])])
@pytest.mark.parametrize("name", ["Shampoo", "SOAP", "NorMuon"])
def test_a_deepcopy_moves_owner_state_its_own_plan_puts_elsewhere(
    dist: Any, name: str, strategy: str, moved: list[str]
) -> None:
    """Catches: a copy that plans afresh and looks for the copied owner-held state (Shampoo's
    factors, SOAP's and NorMuon's) on its new plan's owners, while it lives on the owners
    of the plan it was recorded under (here: before ``add_param_group``; likewise after a
    re-pricing): those matrices silently restarted from fresh state. And a copy that
    records where the state lives only on ranks holding some: the others skipped the
    (collective) move and gloo aborted."""
    for out in dist(2).run(_deepcopy_after_add_param_group, name, strategy, timeout=TIMEOUT):
        assert out == {"moved": moved, "params": True, "state": True}, out


@pytest.mark.parametrize("name", ["Muon", "Shampoo", "SOAP"])
def test_a_deepcopy_on_a_mesh_steps_like_the_original(dist: Any, name: str) -> None:
    """On a 2-rank mesh, ``copy.deepcopy`` of the parameters and the optimizer together gives
    an optimizer over the copied DTensors that plans again at its next step (collectively)
    and then steps exactly like the original: parameters and state bitwise equal. An
    optimizer whose PipelineConfig holds a process group refuses to be copied. Catches:
    owner-held state or step counters lost in the copy, a copy that keeps the original's
    runtime (its plan, buffers and parameters), a copy that shares the original's tensors."""
    for out in dist(2).run(_deepcopy_on_a_mesh, name, timeout=TIMEOUT):
        assert out == {
            "planned_before": False,
            "planned_after": True,
            "own_params": True,
            "params": True,
            "state": True,
            "refused": ("TypeError", True),
        }, out


def _cleared_state(name: str) -> dict[str, Any]:
    """Two steps, ``optimizer.state.clear()`` on every rank, two more; and a fresh optimizer
    over copies of the parameters taken at the clear, stepping the same two."""
    shapes = dict(FIRST)
    grads = grad_steps(shapes, 4)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    kw = OWNER_KW.get(name, {"lr": 0.02, "momentum": 0.9})
    make = lambda ps: getattr(canzona, name)(ps, **kw)  # noqa: E731
    opt = make(params)
    for g in grads[:2]:
        set_grads(params, g)
        opt.step()
    fresh_params = [(n, nn.Parameter(p.detach().clone())) for n, p in params]
    fresh = make(fresh_params)
    opt.state.clear()
    for g in grads[2:]:
        for ps, o in ((params, opt), (fresh_params, fresh)):
            set_grads(ps, g)
            o.step()
    return {
        "params": all(
            torch.equal(full_of(p), full_of(q))
            for (_, p), (_, q) in zip(params, fresh_params, strict=True)
        ),
        "state": _same(_state_fulls(opt), _state_fulls(fresh)),
    }


@pytest.mark.parametrize("name", ["Muon", "Shampoo", "SOAP", "NorMuon"])
def test_a_state_cleared_on_every_rank_starts_afresh_on_the_owners(dist: Any, name: str) -> None:
    """Catches: owner-held state (held on the owner rank, outside ``optimizer.state``) kept
    after the user cleared ``optimizer.state``, or the step's cached lists still holding the
    cleared tensors: the run must go on exactly as a fresh optimizer's."""
    for out in dist(2).run(_cleared_state, name, timeout=TIMEOUT):
        assert out == {"params": True, "state": True}, (name, out)
