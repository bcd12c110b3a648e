"""A step is all or nothing: a failure on any rank changes no parameter and no state anywhere.

Each trial runs a few steps, makes one step fail (a raising computation on some ranks, or
NaN gradients that make an eigendecomposition fail), and checks that every rank raised the
same :class:`canzona.UpdateFailedError` naming the failing ranks, that no parameter and no
optimizer state changed on any rank (full tensors of the parameters and of
``state_dict()``, bit for bit), and that the same step retried once the cause is gone
continues exactly as a run where it never failed. The failures are injected by patching the
optimizer's functions inside the ranks, and the patches are undone after each trial.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona
import canzona.optim.adamw_route as adamw_route_module
import canzona.optim.base as base_module
import canzona.optim.muon as muon_module
from canzona.optim.base import MatrixOptimizer
from canzona.runtime import ComputeBatch

from _cases import full_of, full_tensors, grad_steps, set_grads, sharded_params
from _dist import mesh

TIMEOUT = 120
NAMES = ("Muon", "Shampoo", "SOAP")
# roots and bases refreshed at every step, so that owner-held state changes at every step
KW: dict[str, dict[str, Any]] = {
    "Muon": {"lr": 0.02, "momentum": 0.9, "ns_dtype": torch.float32},
    "Shampoo": {"lr": 0.01, "precondition_frequency": 1, "start_preconditioning_step": 1},
    "SOAP": {"lr": 0.01, "precondition_frequency": 1},
}
STEPS = 3
INJECTED = "injected failure"

Params = list[tuple[str, nn.Parameter]]
Grads = list[dict[str, torch.Tensor]]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def patched(owner: Any, attr: str, value: Any) -> Iterator[None]:
    """``owner.attr = value`` inside the block; the attribute as it was afterwards."""
    had = attr in vars(owner)
    old = vars(owner).get(attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, attr, old)
        else:
            delattr(owner, attr)


def failing_directions(
    cls: type[MatrixOptimizer], fails: Callable[[ComputeBatch], bool]
) -> contextlib.AbstractContextManager[None]:
    """``cls._directions`` raising after it ran (its owner-held state already advanced)."""
    original = cls._directions

    def directions(self: Any, batch: ComputeBatch, full: torch.Tensor) -> torch.Tensor:
        out = original(self, batch, full)
        if fails(batch):
            raise RuntimeError(INJECTED)
        return out

    return patched(cls, "_directions", directions)


def on_ranks(ranks: tuple[int, ...], names: tuple[str, ...] = ()) -> Callable[[ComputeBatch], bool]:
    """A predicate: this rank is one of ``ranks`` and the batch holds one of ``names`` (or any)."""

    def fails(batch: ComputeBatch) -> bool:
        hit = not names or any(it.name.split("@")[0] in names for it in batch.items)
        return tdist.get_rank() in ranks and hit

    return fails


def failing_after(
    module: Any, attr: str, ranks: tuple[int, ...]
) -> contextlib.AbstractContextManager[None]:
    """``module.attr`` raising on ``ranks`` after it ran (the state it updates has changed)."""
    original = getattr(module, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if tdist.get_rank() in ranks:
            raise RuntimeError(INJECTED)
        return out

    return patched(module, attr, wrapper)


def snapshot(params: Params, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Full parameters and full ``state_dict()`` tensors (collective), and the param groups."""
    out: dict[str, Any] = {f"param {n}": full_of(p) for n, p in params}
    sd = opt.state_dict()
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            out[f"state {pid} {key}"] = (
                value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
            )
    out["param_groups"] = repr(sd["param_groups"])
    out["skipped_steps"] = getattr(opt, "skipped_steps", 0)
    return out


def differences(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys missing on one side or whose values differ (tensors: dtype and every bit)."""
    keys = sorted(set(got) | set(want))
    bad = []
    for key in keys:
        if key not in got or key not in want:
            bad.append(f"{key} (only on one side)")
            continue
        a, b = got[key], want[key]
        if isinstance(a, torch.Tensor):
            same = a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
        else:
            same = a == b
        if not same:
            bad.append(key)
    return bad


def raised(fn: Callable[[], Any]) -> dict[str, str]:
    """What ``fn()`` raised: type, message and the type of the chained cause."""
    try:
        fn()
    except Exception as exc:  # reported to the test
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else ""
        return {"kind": type(exc).__name__, "message": str(exc), "cause": cause}
    return {"kind": "ok", "message": "", "cause": ""}


def build(
    name: str,
    params: Params,
    *,
    overlap: bool = True,
    atomic: bool = True,
    capacity_mb: float = 1e-4,
    dedup: bool = True,
    skip_nonfinite: bool = False,
) -> MatrixOptimizer:
    """The optimizer ``name``: matrices in its own group, vectors in an AdamW group."""
    matrices = [(n, p) for n, p in params if p.ndim >= 2]
    vectors = [(n, p) for n, p in params if p.ndim < 2]
    groups: list[dict[str, Any]] = [{"params": matrices}]
    if vectors:
        groups.append({"params": vectors, "algorithm": "adamw", "lr": 3e-3})
    cls = getattr(canzona, name)
    opt: MatrixOptimizer = cls(
        groups,
        **KW[name],
        plan=canzona.PlanConfig(capacity_mb=capacity_mb, replica_dedup=dedup),
        pipeline=canzona.PipelineConfig(
            overlap=overlap, atomic=atomic, skip_nonfinite=skip_nonfinite
        ),
    )
    return opt


@dataclass
class Failure:
    """How one trial makes its step fail.

    Attributes:
        label: Names the case in assertion messages.
        arm: Called on the optimizer just before the failing step; returns the context that
            makes the step fail and the ranks expected to be named.
        grads: Gradients of the failing attempt only (e.g. with a NaN), when not the step's own.
        expect: Text every rank's message must contain (besides the ranks).
    """

    label: str
    arm: Callable[[MatrixOptimizer], tuple[Any, tuple[int, ...]]]
    grads: dict[str, torch.Tensor] | None = None
    expect: list[str] = field(default_factory=list)


def trial(
    make: Callable[[], tuple[Params, MatrixOptimizer]],
    grads: Grads,
    fail_step: int,
    failure: Failure,
    reference: dict[str, Any],
) -> dict[str, Any]:
    """Fail step ``fail_step`` once, retry it with the cause removed, finish the steps."""
    params, opt = make()
    for g in grads[:fail_step]:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    before = snapshot(params, opt)
    context, ranks = failure.arm(opt)
    set_grads(params, failure.grads if failure.grads is not None else grads[fail_step])
    with context:
        outcome = raised(opt.step)
    after = snapshot(params, opt)
    state_entries = len(opt.state)
    set_grads(params, grads[fail_step])
    retry = raised(opt.step)
    opt.zero_grad(set_to_none=True)
    for g in grads[fail_step + 1 :]:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        "label": failure.label,
        "ranks": list(ranks),
        "expect": failure.expect,
        **outcome,
        "changed": differences(after, before),
        "state_entries": state_entries,
        "retry": retry["kind"],
        "differs_from_uninterrupted": differences(snapshot(params, opt), reference),
    }


def uninterrupted(
    make: Callable[[], tuple[Params, MatrixOptimizer]], grads: Grads
) -> dict[str, Any]:
    """The final snapshot of a run in which no step fails."""
    params, opt = make()
    for g in grads:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return snapshot(params, opt)


def check(per_rank: list[list[dict[str, Any]]]) -> None:
    """Every trial: the same UpdateFailedError everywhere, nothing changed, an exact retry."""
    for trials in zip(*per_rank, strict=True):
        label = trials[0]["label"]
        ranks = trials[0]["ranks"]
        assert ranks, f"{label}: no failing rank expected"
        messages = {t["message"] for t in trials}
        assert len(messages) == 1, f"{label}: ranks raised different messages: {messages}"
        for rank, t in enumerate(trials):
            where = f"{label}, rank {rank}"
            assert t["kind"] == "UpdateFailedError", f"{where}: {t}"
            assert t["message"].startswith(f"the step failed on ranks {ranks} ("), where
            assert t["message"].endswith("nothing was updated on any rank"), where
            for text in t["expect"]:
                assert text in t["message"], f"{where}: {text!r} not in {t['message']!r}"
            # a failing rank chains what raised there; the others have nothing to chain
            assert bool(t["cause"]) == (rank in ranks), f"{where}: cause {t['cause']!r}"
            assert t["changed"] == [], f"{where}: the failed step changed {t['changed']}"
            assert t["retry"] == "ok", where
            assert t["differs_from_uninterrupted"] == [], (
                f"{where}: the retried run differs from an uninterrupted one in "
                f"{t['differs_from_uninterrupted']}"
            )


# --------------------------------------------------------------------------- owner failures

GROUPED: dict[str, tuple[int, ...]] = {f"w{i}": (8 + 2 * i, 8) for i in range(6)}
GROUPED["bias"] = (8,)


def _grouped(name: str, overlap: bool, atomic: bool = True) -> Callable[[], tuple[Params, Any]]:
    fulls = full_tensors(GROUPED)

    def make() -> tuple[Params, Any]:
        params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in GROUPED})
        return params, build(name, params, overlap=overlap, atomic=atomic)

    return make


def _in_group(position: str) -> Failure:
    """The owner of the first matrix of the first, a middle or the last micro-group fails."""

    def arm(opt: Any) -> tuple[Any, tuple[int, ...]]:
        groups = opt._runtime.plan.micro_groups
        assert len(groups) >= 3, f"{len(groups)} micro-groups: the case needs 3 or more"
        k = {"first": 0, "middle": len(groups) // 2, "last": len(groups) - 1}[position]
        target, owner = groups[k].names[0], groups[k].owners[0]
        failure.expect = [f"rank {owner}: computing micro-group {k} (parameters ['{target}'])"]
        failure.expect.append(f"RuntimeError: {INJECTED}")
        return failing_directions(type(opt), on_ranks((owner,), (target,))), (owner,)

    failure = Failure(f"micro-group {position}", arm)
    return failure


def _micro_group_failures(name: str) -> list[dict[str, Any]]:
    grads = grad_steps(GROUPED, STEPS)
    reference = uninterrupted(_grouped(name, True), grads)
    out = []
    for overlap in (True, False):
        make = _grouped(name, overlap)
        for position in ("first", "middle", "last"):
            # the third step: the state copies the second step kept are refilled, not new
            out.append(trial(make, grads, 2, _in_group(position), reference))
            out[-1]["label"] += f", overlap={overlap}"
    return out


@pytest.mark.parametrize("name", NAMES)
def test_owner_failure_in_any_micro_group_changes_nothing(dist: Any, name: str) -> None:
    """The owner's computation raises in the first, a middle or the last micro-group.

    One matrix per owner per micro-group (a tiny capacity), overlap on and off, the failure
    at the third step, after the owner-held state advanced and its copies were kept (CPU
    default). Catches: applying a micro-group's directions before the vote, a rank that
    skips the vote, state (momentum, AdamW moments, owner-held state, step counters) not
    rolled back or restored from a kept copy that was not refilled, a retry that differs.
    """
    check(dist(2).run(_micro_group_failures, name, timeout=TIMEOUT))


# --------------------------------------------------------------------------- local failures

MIXED: dict[str, tuple[int, ...]] = {
    "square": (8, 8),
    "tall": (12, 6),
    "rep": (6, 10),
    "plain": (7, 5),
    "bias": (6,),
}


def _mixed(name: str, skip_nonfinite: bool = False) -> Callable[[], tuple[Params, Any]]:
    """DTensor rows, a Replicate matrix computed by every rank (no dedup), a plain tensor."""
    fulls = full_tensors(MIXED)

    def make() -> tuple[Params, Any]:
        placements: dict[str, tuple[Placement, ...]] = {
            n: (Shard(0),) for n in MIXED if n not in ("rep", "plain")
        }
        placements["rep"] = (Replicate(),)
        sharded = dict(sharded_params({n: fulls[n] for n in placements}, mesh((4,)), placements))
        sharded["plain"] = nn.Parameter(fulls["plain"].clone())
        params = [(n, sharded[n]) for n in MIXED]
        opt = build(name, params, dedup=False, skip_nonfinite=skip_nonfinite)
        return params, opt

    return make


def _plain_only(name: str) -> Callable[[], tuple[Params, Any]]:
    """A DDP-style job: plain tensors only, replicated on every rank."""
    fulls = full_tensors(MIXED)

    def make() -> tuple[Params, Any]:
        params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
        return params, build(name, params)

    return make


def _local_failure(label: str, ranks: tuple[int, ...], target: str) -> Failure:
    def arm(opt: Any) -> tuple[Any, tuple[int, ...]]:
        return failing_directions(type(opt), on_ranks(ranks, (target,))), ranks

    expect = [f"rank {r}: computing a local matrix (parameters ['{target}'])" for r in ranks]
    return Failure(label, arm, expect=expect)


def _module_failure(label: str, module: Any, attr: str, ranks: tuple[int, ...]) -> Failure:
    def arm(opt: Any) -> tuple[Any, tuple[int, ...]]:
        return failing_after(module, attr, ranks), ranks

    return Failure(label, arm, expect=[f"rank {r}: " for r in ranks])


def _local_failures(name: str) -> list[dict[str, Any]]:
    grads = grad_steps(MIXED, STEPS)
    make = _mixed(name)
    reference = uninterrupted(make, grads)
    failures = [
        _local_failure("plain tensor on ranks 1 and 3", (1, 3), "plain"),
        _local_failure("Replicate without dedup on rank 2", (2,), "rep"),
        _module_failure("AdamW moments on rank 0", adamw_route_module, "adamw_moments_", (0,)),
    ]
    failures[-1].expect.append(f"rank 0: preparing the step raised RuntimeError: {INJECTED}")
    if name == "Muon":  # the momentum is updated in place before the payload travels
        prepare = _module_failure(
            "Muon momentum on rank 1", muon_module, "muon_prepare_runs_", (1,)
        )
        prepare.expect.append("rank 1: preparing the step raised")
        failures.append(prepare)
    out = [trial(make, grads, 1, f, reference) for f in failures]
    ddp = _plain_only(name)
    only_plain = _local_failure("plain tensors only, on ranks 1 and 2", (1, 2), "tall")
    out.append(trial(ddp, grads, 1, only_plain, uninterrupted(ddp, grads)))
    # the NaN check itself fails (skip_nonfinite): every rank raises before anything runs
    checked = _mixed(name, skip_nonfinite=True)
    nan_check = _module_failure("the NaN check on rank 3", base_module, "all_finite", (3,))
    nan_check.expect.append("rank 3: checking the gradients for NaN/Inf raised RuntimeError")
    out.append(trial(checked, grads, 1, nan_check, uninterrupted(checked, grads)))
    return out


@pytest.mark.parametrize("name", NAMES)
def test_local_adamw_and_check_failures_change_nothing(dist: Any, name: str) -> None:
    """Failures outside the owner pipeline, on some ranks only, at world 4.

    A plain tensor (every rank updates its own copy) failing on ranks 1 and 3, in an
    optimizer with DTensors and in one of plain tensors only (DDP-style); a ``Replicate``
    matrix without dedup failing on rank 2; the AdamW moments (and Muon's momentum) raising
    after they were updated in place; the NaN check of ``skip_nonfinite`` raising on rank 3.
    Catches: a rank that applies its local items while another one failed (replicas
    diverge), in-place state not restored, a failure before the header that reaches only
    one rank.
    """
    check(dist(4).run(_local_failures, name, timeout=TIMEOUT))


# --------------------------------------------------------------------------- first step, NaN


def _first_step_and_nan(name: str) -> list[dict[str, Any]]:
    """The very first step fails (lazy state must vanish again), and NaN gradients fail eigh."""
    grads = grad_steps(GROUPED, STEPS)
    make = _grouped(name, True)
    reference = uninterrupted(make, grads)
    out = [trial(make, grads, 0, _in_group_first_step(), reference)]
    if name != "Muon":
        # eigh of a NaN statistic: Shampoo at every root refresh, SOAP when it builds its bases
        nan_at = 1 if name == "Shampoo" else 0
        bad = {n: g.clone() for n, g in grads[nan_at].items()}
        bad["w3"][2, 1] = float("nan")

        def arm(opt: Any) -> tuple[Any, tuple[int, ...]]:
            owner = _owner_of(opt, "w3")
            failure.expect = [f"rank {owner}: computing micro-group", "['w3']", "LinAlgError"]
            return contextlib.nullcontext(), (owner,)

        failure = Failure("NaN gradient fails eigh", arm, grads=bad)
        out.append(trial(make, grads, nan_at, failure, reference))
    return out


def _owner_of(opt: Any, target: str) -> int:
    plan = opt._runtime.plan
    if plan is None:  # before the first step: plan the same way the step will
        opt._sync_plan()
        plan = opt._runtime.plan
    owner: int = plan.assignment.owner[target]
    return owner


def _in_group_first_step() -> Failure:
    def arm(opt: Any) -> tuple[Any, tuple[int, ...]]:
        owner = _owner_of(opt, "w2")
        failure.expect = ["['w2']", f"RuntimeError: {INJECTED}"]
        return failing_directions(type(opt), on_ranks((owner,), ("w2",))), (owner,)

    failure = Failure("first step", arm)
    return failure


@pytest.mark.parametrize("name", NAMES)
def test_first_step_and_nan_gradient_failures_change_nothing(dist: Any, name: str) -> None:
    """A failure at the first step leaves no state behind; a NaN gradient that makes the
    eigendecomposition fail (Shampoo, SOAP) is retried with a finite gradient exactly.

    Catches: lazily created state (step counters, momentum, owner-held state) left in
    place by a failed first step, owner-held state half-updated with NaN.
    """
    per_rank = dist(2).run(_first_step_and_nan, name, timeout=TIMEOUT)
    check(per_rank)
    for trials in per_rank:  # the failed first step left no state entry behind
        assert trials[0]["state_entries"] == 0, trials[0]["state_entries"]


# --------------------------------------------------------------------------- atomic=False

SHAMPOO_OWNER = [
    "factor_left",
    "factor_right",
    "graft_exp_avg_sq",
    "inv_root_left",
    "inv_root_right",
]


def _not_atomic(name: str) -> dict[str, Any]:
    """atomic=False: the failed step leaves every parameter alone but the state advanced."""
    grads = grad_steps(GROUPED, STEPS)
    params, opt = _grouped(name, True, atomic=False)()
    set_grads(params, grads[0])
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = snapshot(params, opt)
    groups = opt._runtime.plan.micro_groups
    target, owner = groups[-1].names[0], groups[-1].owners[0]
    set_grads(params, grads[1])
    with failing_directions(type(opt), on_ranks((owner,), (target,))):
        outcome = raised(opt.step)
    after = snapshot(params, opt)
    changed = differences(after, before)
    return {
        "kind": outcome["kind"],
        "params_changed": [k for k in changed if k.startswith("param ")],
        "state_changed": sorted({k.split()[-1] for k in changed if k.startswith("state ")}),
    }


@pytest.mark.parametrize(
    ("name", "advanced"),
    [
        ("Muon", ["exp_avg", "exp_avg_sq", "momentum_buffer"]),
        ("Shampoo", ["exp_avg", "exp_avg_sq", *SHAMPOO_OWNER]),
        ("SOAP", ["exp_avg", "exp_avg_sq", "gg_left", "gg_right", "q_left", "q_right"]),
    ],
)
def test_without_atomic_a_failed_step_leaves_parameters_but_advances_state(
    dist: Any, name: str, advanced: list[str]
) -> None:
    """``PipelineConfig(atomic=False)``: parameters untouched, step counters restored, the
    state updated in place before the vote (momentum, Adam moments, owner-held state)
    advanced. Catches: parameters written before the vote in that mode too, and a mode that
    silently copies anyway (the documented saving)."""
    for out in dist(2).run(_not_atomic, name, timeout=TIMEOUT):
        assert out["kind"] == "UpdateFailedError"
        assert out["params_changed"] == []
        assert out["state_changed"] == advanced, out


def _applied_in_part(where: str) -> dict[str, Any]:
    """Rank 0's apply raises after the decision (``where``: the matrix directions' batch, or
    AdamW's parameter updates), in the second step; the two steps after it and one of a copy
    of the optimizer; then the weights and the state dict of the first step are loaded and
    one step runs."""
    rank = tdist.get_rank()
    shapes = {"w0": (16, 8), "w1": (8, 12), "bias": (8,)}
    fulls, grads = full_tensors(shapes), grad_steps(shapes, 4)

    def make() -> tuple[Params, Any]:
        params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in shapes})
        groups = [
            {"params": params[:2]},
            {"params": params[2:], "algorithm": "adamw", "lr": 3e-3},
        ]
        return params, canzona.Muon(groups, **KW["Muon"], plan=canzona.PlanConfig(cost="flops"))

    params, opt = make()
    set_grads(params, grads[0])
    opt.step()
    weights = [p.detach().clone() for _, p in params]
    sd = copy.deepcopy(opt.state_dict())  # its tensors are the state's own
    attr = "_apply_batch" if where == "directions" else "_adamw_params"

    held: list[weakref.ref[torch.Tensor]] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        workspace = torch.empty(1024)  # lives as long as this frame's traceback
        held.append(weakref.ref(workspace))
        raise torch.OutOfMemoryError(INJECTED)

    outcomes: list[dict[str, Any]] = []
    for k in (1, 2, 3):
        set_grads(params, grads[k])
        fails = k == 1 and rank == 0
        with patched(canzona.Muon, attr, refuse) if fails else contextlib.nullcontext():
            outcomes.append(raised(opt.step))
        gc.collect()
        outcomes[-1]["frames_held"] = any(ref() is not None for ref in held)
    set_grads(params, grads[3])
    copied = raised(copy.deepcopy(opt).step)  # a copy fails its steps as the original
    with torch.no_grad():
        for (_, p), w in zip(params, weights, strict=True):
            p.copy_(w)
    opt.load_state_dict(sd)
    set_grads(params, grads[3])
    outcomes.append(raised(opt.step))
    ref_params, ref = make()
    for k in (0, 3):
        set_grads(ref_params, grads[k])
        ref.step()
    pairs = zip(params, ref_params, strict=True)
    same = all(torch.equal(full_of(p), full_of(q)) for (_, p), (_, q) in pairs)
    return {"outcomes": outcomes, "same": same, "copied": copied}


@pytest.mark.parametrize("where", ["directions", "adamw"])
def test_an_apply_that_raises_after_the_decision_fails_every_later_step(
    dist: Any, where: str
) -> None:
    """The apply follows the decision, so a failure in it on one rank (out of memory for a
    cast) cannot be undone: the other ranks applied the step. That rank raises
    ``PartialUpdateError``, and every later step raises ``UpdateFailedError`` on every rank
    naming it, until a checkpoint is loaded; then the steps are those of a run without the
    failed one. Catches: the failing rank rolling its state back while the others committed
    and every rank stepping on, silently apart; the kept failure holding the failed step's
    frames (and their tensors) through its traceback; a copy of the optimizer stepping on
    from the parameters updated in part."""
    out = dist(2).run(_applied_in_part, where, timeout=TIMEOUT)
    what = "the matrix directions" if where == "directions" else "AdamW's parameter updates"
    assert out[0]["outcomes"][0]["kind"] == "PartialUpdateError"
    # the failure kept until the load holds no frame of the failed step (nor its tensors)
    assert [o["frames_held"] for o in out[0]["outcomes"][:3]] == [False] * 3
    assert out[0]["outcomes"][0]["message"].startswith(f"rank 0: applying {what} raised ")
    assert out[1]["outcomes"][0]["kind"] == "ok"
    for o in out:
        for later in o["outcomes"][1:3]:
            assert later["kind"] == "UpdateFailedError", later
            assert later["message"].startswith(
                "the step failed on ranks [0] (rank 0: an earlier step's apply (parameters "
                "updated in part) raised PartialUpdateError: rank 0: applying "
            ), later["message"]
        assert o["outcomes"][3]["kind"] == "ok"
        assert o["same"]
        assert o["copied"]["message"] == o["outcomes"][2]["message"], o["copied"]


def _prepare_fails_midway() -> list[str]:
    """Shampoo on two ranks; at the second step rank 1's prepare writes NaN into its
    payloads and raises: what ``step()`` raised on each rank."""
    shapes = {n: s for n, s in GROUPED.items() if n != "bias"}
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    grads = grad_steps(shapes, 2)
    opt = canzona.Shampoo(params, **KW["Shampoo"], pipeline=canzona.PipelineConfig(timeout_s=20.0))
    set_grads(params, grads[0])
    opt.step()
    original = canzona.Shampoo._prepare_group

    def prepare(self: Any, group: Any, work: Any, grads: Any, txn: Any) -> None:
        original(self, group, work, grads, txn)
        if tdist.get_rank() == 1:
            for payload in work.payloads:
                payload.fill_(float("nan"))
            raise RuntimeError(INJECTED)

    set_grads(params, grads[1])
    with patched(canzona.Shampoo, "_prepare_group", prepare):
        try:
            opt.step()
        except canzona.UpdateFailedError as exc:
            return [str(exc)]
    return ["ok"]


def test_a_rank_whose_prepare_failed_sends_zeros(dist: Any) -> None:
    """Catches: a rank whose prepare failed sending what its payload buffers held (half
    written, stale or never written) instead of zeros: the owners computed on it, and
    Shampoo's eigendecomposition of NaN statistics failed on healthy ranks too, so the
    error named them as failing. Only rank 1 must be named."""
    want = (
        "the step failed on ranks [1] (rank 1: preparing the step raised RuntimeError: "
        f"{INJECTED}); nothing was updated on any rank"
    )
    assert dist(2).run(_prepare_fails_midway, timeout=TIMEOUT) == [[want], [want]]
