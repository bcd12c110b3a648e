"""Bad input on a mesh: the same clear error on every rank, or a correct result; never a hang."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Partial, Shard

import canzona
from canzona.runtime.topology import agree, describe
from canzona.runtime.watchdog import Watchdog

from _cases import (
    SHAPES,
    full_of,
    full_tensors,
    grad_steps,
    run_with_late_group,
    set_grads,
    sharded_params,
)
from _dist import mesh

TIMEOUT = 60  # per scenario; the errors below come within seconds


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # report the exception type and message to the test
        return type(exc).__name__, str(exc)
    return "ok", ""


def _params(names: tuple[str, ...]) -> list[tuple[str, nn.Parameter]]:
    shapes = {n: SHAPES[n] for n in names}
    return sharded_params(full_tensors(shapes), mesh((4,)), {n: (Shard(0),) for n in names})


def _order_mismatch() -> tuple[str, str]:
    params = _params(("square", "tall", "wide"))
    if tdist.get_rank() == 2:
        params = [params[1], params[0], params[2]]
    opt = canzona.Muon(params, lr=0.02)
    for _, p in params:
        p.grad = torch.ones_like(p)
    return _outcome(opt.step)


def test_parameter_order_mismatch_raises_everywhere(dist: Any) -> None:
    """Catches: a header without the parameter-list digest (ranks would exchange fragments of
    different matrices), and a mismatch raised on the odd rank only."""
    out = dist(4).run(_order_mismatch, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"PlanMismatchError"}
    for _, msg in out:
        assert "[0, 1, 3]" in msg and "[2]" in msg and "parameter list" in msg


def _plan_mismatch() -> tuple[tuple[str, str], bool]:
    """Rank 2 plans differently from the same agreed inputs (as a non-deterministic planner
    would); the plan-digest check right after planning must stop every rank."""
    from canzona.runtime import engine

    params = _params(("square", "tall", "wide"))
    before = {n: p.detach().to_local().clone() for n, p in params}
    opt = canzona.Muon(params, lr=0.02)
    for _, p in params:
        p.grad = torch.ones_like(p)
    original = engine.build_plan
    if tdist.get_rank() == 2:

        def other_plan(specs: Any, world: int, config: Any, **kw: Any) -> Any:
            return original(specs, world, canzona.PlanConfig(strategy="replicated"), **kw)

        engine.build_plan = other_plan  # type: ignore[assignment]
    try:
        outcome = _outcome(opt.step)
    finally:
        engine.build_plan = original  # type: ignore[assignment]
    unchanged = all(torch.equal(p.detach().to_local(), before[n]) for n, p in params)
    return outcome, unchanged


def test_plans_that_differ_from_agreed_inputs_raise_everywhere(dist: Any) -> None:
    """Catches: the plan digests not compared after planning (the ranks would exchange
    fragments by different owner maps: a hang or a wrong update), or a mismatch raised on
    the odd rank only."""
    out = dist(4).run(_plan_mismatch, timeout=TIMEOUT)
    for (kind, msg), unchanged in out:
        assert kind == "PlanMismatchError", msg
        assert "plan digests differ" in msg and "[0, 1, 3]" in msg and "[2]" in msg, msg
        assert unchanged


def _set_mismatch() -> tuple[str, str]:
    names = ("square", "tall") if tdist.get_rank() == 1 else ("square", "tall", "wide")
    params = _params(("square", "tall", "wide"))
    params = [(n, p) for n, p in params if n in names]
    opt = canzona.Muon(params, lr=0.02)
    for _, p in params:
        p.grad = torch.ones_like(p)
    return _outcome(opt.step)


def test_parameter_set_mismatch_raises_everywhere(dist: Any) -> None:
    """Catches: a header without the parameter count, or a message without both counts."""
    out = dist(4).run(_set_mismatch, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"PlanMismatchError"}
    assert all("number of parameters (3 vs 2)" in msg for _, msg in out)


def _dtensor(
    full: torch.Tensor, ranks: list[int], names: tuple[str, ...], dim: int
) -> nn.Parameter:
    """``full`` sharded on ``dim`` over a 1-D mesh of ``ranks`` (no process group of its own:
    every collective here is the optimizer's, on the default group)."""
    dm = DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False)
    local = full.tensor_split(len(ranks), dim)[ranks.index(tdist.get_rank())]
    return nn.Parameter(DTensor.from_local(local, dm, [Shard(dim)], run_check=False))


def _layout_mismatch(kind: str) -> tuple[str, str]:
    """Rank 2 alone differs from the others in one parameter's dtype, placement or mesh."""
    odd = tdist.get_rank() == 2
    fulls = full_tensors({"square": (16, 16), "tall": (24, 8)})
    world = [0, 1, 2, 3]
    if kind == "dtype" and odd:
        fulls["tall"] = fulls["tall"].double()
    dim = 1 if kind == "placement" and odd else 0
    names = ("other",) if kind == "dim_names" and odd else ("dp",)
    params = [
        ("square", _dtensor(fulls["square"], world, names, dim)),
        ("tall", _dtensor(fulls["tall"], world, ("dp",), 0)),
    ]
    if kind == "same_names":  # a second mesh of the same shape and names, other rank order
        params[1] = ("tall", _dtensor(fulls["tall"], world[::-1], ("dp",), 0))
    if kind == "overlap":  # copies of one (2,) mesh: [0, 1], [2, 3] and, on rank 3, [3, 1]
        rank = tdist.get_rank()
        ranks = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [3, 1]}[rank]
        params = [("pair", _dtensor(fulls["square"], ranks, ("pair",), 0))]
    opt = canzona.Muon(params, lr=0.02)
    for _, p in params:
        p.grad = torch.ones_like(p)
    return _outcome(opt.step)


@pytest.mark.parametrize(
    ("kind", "error", "detail"),
    [
        ("dtype", "PlanMismatchError", "torch.float64"),
        ("placement", "PlanMismatchError", "Shard(dim=1)"),
        ("dim_names", "PlanMismatchError", "('other',)"),
        ("same_names", "ValueError", "give distinct meshes distinct mesh_dim_names"),
        ("overlap", "PlanMismatchError", "overlap across ranks"),
    ],
)
def test_layouts_that_differ_across_ranks_raise_everywhere(
    dist: Any, kind: str, error: str, detail: str
) -> None:
    """Catches: a parameter's dtype, placements or mesh names left out of what the ranks
    compare (they would exchange fragments of different sizes or layouts), two meshes of one
    shape and names taken for one, and copies of a mesh that share a rank."""
    out = dist(4).run(_layout_mismatch, kind, timeout=TIMEOUT)
    for kind_seen, msg in out:
        assert kind_seen == error, msg
        assert detail in msg, msg
        if error == "PlanMismatchError" and kind != "overlap":
            assert "ranks [0, 1, 3] and ranks [2]" in msg and "first difference" in msg, msg


def _stages_on_one_group() -> tuple[str, str]:
    """Pipeline stages by mistake on the default group: rank 0 one 32x16 matrix, rank 1
    two others (plain tensors)."""
    torch.manual_seed(tdist.get_rank())
    shapes = [(32, 16)] if tdist.get_rank() == 0 else [(8, 32), (8, 8)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    for p in params:
        p.grad = torch.ones_like(p)
    return _outcome(canzona.Muon(params, lr=0.02).step)


def test_ranks_with_other_parameters_are_told_about_process_groups(dist: Any) -> None:
    """Catches: the first difference taken in the configuration tuple that leads the
    description (it differs whenever the parameter counts do), which named no parameter,
    and no word on giving each pipeline stage its own process group."""
    out = dist(2).run(_stages_on_one_group, timeout=TIMEOUT)
    for kind, msg in out:
        assert kind == "PlanMismatchError", msg
        assert "disagree on the number of parameters (1 vs 2)" in msg, msg
        assert "first difference: entry 0: rank 0 has (0, 'param0', (32, 16)," in msg, msg
        assert msg.endswith(
            "need an optimizer each on its own process group: PipelineConfig(process_group=...)"
        ), msg


def _hyper_mismatch(how: str) -> tuple[str, str]:
    params = _params(("square", "tall"))
    if how == "value":
        lr: float | torch.Tensor = 0.02 if tdist.get_rank() else 0.03
    else:  # the same value, exact in float32: a tensor computes in float32, a float in float64
        lr = torch.tensor(5 * 2**-10) if tdist.get_rank() == 1 else 5 * 2**-10
    opt = canzona.Muon(params, lr=lr, weight_decay=0.1)
    for _, p in params:
        p.grad = torch.ones_like(p)
    return _outcome(opt.step)


@pytest.mark.parametrize("how", ["value", "tensor on one rank"])
def test_hyper_parameter_mismatch_raises_everywhere(dist: Any, how: str) -> None:
    """Catches: a header without the hyper-parameter digest (the owner's learning rate would
    silently apply to every rank's shard), a tensor lr compared by its value alone (each
    rank's shard then updated at its own rounding of the rate), and a message that does not
    say which value differs."""
    out = dist(4).run(_hyper_mismatch, how, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"PlanMismatchError"}
    # the first difference names the group, the key and both values
    if how == "value":
        seen = "rank 1 has param group 0 lr=0.02, rank 0 has param group 0 lr=0.03"
    else:
        seen = "has param group 0 lr=0.0048828125, rank 1 has param group 0 lr=tensor(0.0048828125"
    assert all("hyper-parameters" in msg and seen in msg for _, msg in out), out[0][1]


def _closure_raises_on_one_rank(
    check_every_step: bool, source: str = "closure"
) -> tuple[str, str, bool, bool]:
    """Rank 1's closure (or a step pre-hook: ``source``) raises in the third step; every
    rank catches and steps on."""
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 4)
    params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes})
    kwargs: dict[str, Any] = {"lr": 0.01, "precondition_frequency": 1}
    pipeline = canzona.PipelineConfig(check_every_step=check_every_step)
    flops = canzona.PlanConfig(cost="flops")  # the failing step is a steady one
    opt = canzona.Shampoo(
        params, start_preconditioning_step=1, plan=flops, pipeline=pipeline, **kwargs
    )
    local = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    ref = canzona.Shampoo(local, start_preconditioning_step=1, **kwargs)
    outcome: tuple[str, str] = ("ok", "")
    now = [0]

    def pre_hook(o: Any, args: Any, kwargs: Any) -> None:
        if now[0] == 2 and tdist.get_rank() == 1:
            raise RuntimeError("the data loader broke")

    if source == "pre_hook":
        opt.register_step_pre_hook(pre_hook)
    for step, g in enumerate(grads):
        now[0] = step

        def closure(step: int = step, g: dict[str, torch.Tensor] = g) -> None:
            if source == "closure" and step == 2 and tdist.get_rank() == 1:
                raise RuntimeError("the data loader broke")
            for n, p in params:  # each rank its own shard: no collective in the closure
                p.grad = distribute_tensor(g[n], p.device_mesh, p.placements, src_data_rank=None)

        before = [p.to_local().clone() for _, p in params]
        result = _outcome(lambda closure=closure: opt.step(closure))
        if step == 2:
            outcome = result
            unchanged = all(
                torch.equal(p.to_local(), b) for (_, p), b in zip(params, before, strict=True)
            )
            continue
        set_grads(local, g)
        ref.step()  # the reference skips the failed step
    same = all(
        torch.equal(full_of(p), full_of(q)) for (_, p), (_, q) in zip(params, local, strict=True)
    )
    return (*outcome, unchanged, same)


@pytest.mark.parametrize(
    ("check_every_step", "source"), [(True, "closure"), (False, "closure"), (True, "pre_hook")]
)
def test_a_closure_that_raises_on_one_rank_fails_the_step_everywhere(
    dist: Any, check_every_step: bool, source: str
) -> None:
    """Catches: the closure's (or a step pre-hook's) exception raised on its rank only (the
    others went on into the step and waited for it, or paired this step with that rank's
    next one); without the per-step check, the failing rank voting before the pipeline
    (gloo aborted)."""
    out = dist(4).run(_closure_raises_on_one_rank, check_every_step, source, timeout=TIMEOUT)
    what = "running the closure" if source == "closure" else "running a step pre-hook"
    for kind, msg, unchanged, same in out:
        assert kind == "UpdateFailedError", msg
        assert "ranks [1]" in msg and f"{what} raised" in msg, msg
        assert "RuntimeError: the data loader broke" in msg, msg
        assert unchanged and same


def _value_set_between_steps(key: str, value: object, ranks: str) -> tuple[str, str, bool, bool]:
    """A value that breaks the plan's cost model, set at the fourth step (one that rides
    its check on the first gather) on every rank or on rank 1 only, restored after."""
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 5)
    params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes})
    kwargs: dict[str, Any] = {"lr": 0.01, "precondition_frequency": 2}
    opt = canzona.Shampoo(params, start_preconditioning_step=1, **kwargs)
    local = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    ref = canzona.Shampoo(local, start_preconditioning_step=1, **kwargs)
    outcome: tuple[str, str] = ("ok", "")
    unchanged = False
    for step, g in enumerate(grads):
        set_grads(params, g)
        if step != 3:
            opt.step()
            set_grads(local, g)
            ref.step()  # the reference skips the failed step
            continue
        kept = opt.param_groups[0][key]
        if ranks == "every rank" or tdist.get_rank() == 1:
            opt.param_groups[0][key] = value
        before = [p.to_local().clone() for _, p in params]
        outcome = _outcome(opt.step)
        locals_now = [p.to_local() for _, p in params]
        unchanged = all(map(torch.equal, locals_now, before))
        opt.param_groups[0][key] = kept
    same = all(map(torch.equal, [full_of(p) for _, p in params], [q for _, q in local]))
    return (*outcome, unchanged, same)


@pytest.mark.parametrize(
    ("key", "value", "ranks", "detail"),
    [
        ("precondition_frequency", 0, "rank 1", "precondition_frequency must be >= 1, got 0"),
        ("max_precond_dim", None, "every rank", "max_precond_dim must be an integer, got None"),
    ],
)
def test_a_value_the_plan_cannot_price_fails_the_step_everywhere(
    dist: Any, key: str, value: object, ranks: str, detail: str
) -> None:
    """Catches: a group value read by the step's table (the plan's cost model) before the
    hyper-parameter check, raised on its rank alone (the others waited in the first
    gather) and, where every rank has it, as a bare error of the cost model."""
    ranks_seen = "ranks [1]" if ranks == "rank 1" else "ranks [0, 1, 2, 3]"
    out = dist(4).run(_value_set_between_steps, key, value, ranks, timeout=TIMEOUT)
    for kind, msg, unchanged, same in out:
        assert kind == "UpdateFailedError", msg
        assert ranks_seen in msg and f"param group 0: {detail}" in msg, msg
        assert unchanged and same


def _reordered_on_one_rank() -> tuple[str, str]:
    """Two equal-shaped unnamed matrices; after a step rank 1 alone reverses them."""
    shapes = {"a": SHAPES["square"], "b": SHAPES["square"]}
    grads = grad_steps(shapes, 2)
    named = sharded_params(full_tensors(shapes), mesh((4,)), {n: (Shard(0),) for n in shapes})
    params = [p for _, p in named]
    opt = canzona.Shampoo(params, lr=0.01, precondition_frequency=1, start_preconditioning_step=1)
    set_grads(named, grads[0])
    opt.step()
    if tdist.get_rank() == 1:
        opt.param_groups[0]["params"].reverse()
    set_grads(named, grads[1])
    return _outcome(opt.step)


def test_parameters_reordered_on_some_ranks_only_raise_everywhere(dist: Any) -> None:
    """Catches: equal layouts reordered on one rank re-planned without comparing where each
    parameter came from (the owner assembled one matrix from rank 1's rows of the other)."""
    out = dist(4).run(_reordered_on_one_rank, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"PlanMismatchError"}, out
    for _, msg in out:
        assert "ranks [0, 2, 3] vs ranks [1]" in msg and "from positions (1, 0)" in msg, msg


def _partial_grads() -> tuple[str, str]:
    params = _params(("square", "tall"))
    opt = canzona.Muon(params, lr=0.02)
    for name, p in params:
        if not (name == "tall" and tdist.get_rank() in (1, 3)):
            p.grad = torch.ones_like(p)
    return _outcome(opt.step)


def test_gradient_on_some_ranks_only(dist: Any) -> None:
    """Catches: a header without the gradient-presence digest (the ranks would build different
    schedules and hang), and a report that names the wrong parameter or ranks."""
    out = dist(4).run(_partial_grads, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"GradientMismatchError"}
    for _, msg in out:
        assert "'tall' has a gradient on 2 of 4 ranks (missing on ranks [1, 3])" in msg


def _many_partial_grads() -> tuple[str, str]:
    shapes = {f"p{i}": (8, 4) for i in range(7)} | {"none": (8, 4), "all": (8, 4)}
    params = sharded_params(full_tensors(shapes), mesh((4,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, lr=0.02)
    for name, p in params:
        if name == "all" or (name != "none" and tdist.get_rank() != 1):
            p.grad = torch.ones_like(p)
    return _outcome(opt.step)


def test_the_gradient_report_names_five_and_counts_the_rest(dist: Any) -> None:
    """Catches: a report that names a parameter without a gradient on any rank (that is no
    mismatch), or drops the count of the partial parameters past the fifth."""
    out = dist(4).run(_many_partial_grads, timeout=TIMEOUT)
    assert {kind for kind, _ in out} == {"GradientMismatchError"}
    for _, msg in out:
        named = [f"'p{i}' has a gradient on 3 of 4 ranks (missing on ranks [1])" for i in range(5)]
        assert all(n in msg for n in named), msg
        assert "and 2 more." in msg and "'none'" not in msg and "'p5'" not in msg


def _no_grads_anywhere() -> dict[str, Any]:
    params = _params(("square", "tall"))
    before = {n: full_of(p) for n, p in params}
    opt = canzona.Muon(params, lr=0.02)
    kind, _ = _outcome(opt.step)  # step() before any backward
    params[0][1].grad = torch.ones_like(params[0][1])
    params[1][1].requires_grad_(False)  # frozen after construction
    kind2, _ = _outcome(opt.step)
    return {
        "first": kind,
        "second": kind2,
        "tall_unchanged": bool(torch.equal(full_of(params[1][1]), before["tall"])),
        "square_changed": not torch.equal(full_of(params[0][1]), before["square"]),
        "tall_state": len(opt.state[params[1][1]]),
    }


def test_missing_grads_everywhere_are_skipped(dist: Any) -> None:
    """Catches: a missing gradient taken as zero (weight decay would still move the parameter,
    and state would be created), or an error where nothing is wrong."""
    for out in dist(4).run(_no_grads_anywhere, timeout=TIMEOUT):
        assert out == {
            "first": "ok",
            "second": "ok",
            "tall_unchanged": True,
            "square_changed": True,
            "tall_state": 0,
        }


def _partial_placement() -> tuple[str, str]:
    full = torch.randn(8, 8)
    dt = DTensor.from_local(full, mesh((4,)), [Partial()], run_check=False)
    return _outcome(lambda: canzona.Muon([("proj.weight", nn.Parameter(dt))], lr=0.02))


def test_partial_placement_rejected_at_construction(dist: Any) -> None:
    """Catches: a ``Partial`` parameter accepted (its pending sum would be read as a shard)."""
    for kind, msg in dist(4).run(_partial_placement, timeout=TIMEOUT):
        assert kind == "LayoutError"
        assert "'proj.weight'" in msg and "Partial" in msg


def _unreadable_shards(bad_ranks: tuple[int, ...], when: str) -> tuple[str, str]:
    """A ``Shard(0)`` parameter of 12 rows on 4 ranks whose local shard on ``bad_ranks`` is
    one row short of the 3 its placements give; ``when``: the first step,
    ``load_state_dict()`` of a healthy optimizer's state, or the runtime's agreement on the
    layouts (a re-plan's first collective)."""

    def shards(rows: int) -> DTensor:
        return DTensor.from_local(
            torch.randn(rows, 8),
            mesh((4,)),
            [Shard(0)],
            run_check=False,
            shape=(12, 8),
            stride=(8, 1),
        )

    healthy = nn.Parameter(shards(3))
    saved = canzona.Muon([("proj.weight", healthy)], lr=0.02).state_dict()
    p = nn.Parameter(shards(2 if tdist.get_rank() in bad_ranks else 3))
    p.grad = torch.ones_like(p)
    opt = canzona.Muon([("proj.weight", p)], lr=0.02)
    before = p.to_local().clone()
    act = {
        "step": opt.step,
        "load": lambda: opt.load_state_dict(saved),
        "agree": lambda: agree(
            [describe(0, "proj.weight", p, None, tdist.get_rank())],
            watchdog=Watchdog(process_group=None, rank=tdist.get_rank(), world=4, timeout_s=30),
            rank=tdist.get_rank(),
            world=4,
        ),
    }[when]
    kind, msg = _outcome(act)
    assert torch.equal(p.to_local(), before)
    return kind, msg


@pytest.mark.parametrize("when", ["step", "load", "agree"])
@pytest.mark.parametrize("bad_ranks", [(0, 1, 2, 3), (3,)], ids=["every-rank", "rank-3"])
def test_a_local_shard_its_placements_do_not_give_is_refused(
    dist: Any, bad_ranks: tuple[int, ...], when: str
) -> None:
    """Catches: a DTensor whose local shard is not what its placements give (a layout built
    by hand with ``from_local``) routed by the placements (rows sent where they are not),
    and such a shard on one rank raised there only (the others waited for it: a timeout)."""
    out = dist(4).run(_unreadable_shards, bad_ranks, when, timeout=TIMEOUT)
    kinds = {kind for kind, _ in out}
    if when == "load":  # the rank that cannot read it names it, the others name that rank
        assert kinds == ({"LayoutError"} if len(bad_ranks) == 4 else {"LayoutError", "ValueError"})
        for rank, (kind, msg) in enumerate(out):
            if rank not in bad_ranks:
                assert msg == "load_state_dict failed on ranks [3]; nothing was loaded"
                continue
            assert kind == "LayoutError"
            assert "'proj.weight'" in msg and "local shard of shape (2, 8)" in msg
            assert f"on rank {rank} " in msg and "placements give (3, 8)" in msg
        return
    expected = {"step": "UpdateFailedError", "agree": "LayoutError"}[when]
    assert kinds == {expected}
    assert len({msg for _, msg in out}) == 1, "every rank raises the same error"
    msg = out[0][1]
    assert "'proj.weight'" in msg and "local shard of shape (2, 8)" in msg
    assert f"on rank {bad_ranks[0]} " in msg and "placements give (3, 8)" in msg
    assert f"ranks {list(bad_ranks)}" in msg


def _one_d_in_matrix_group() -> tuple[str, str]:
    p = nn.Parameter(distribute_tensor(torch.randn(12), mesh((4,)), [Shard(0)]))
    return _outcome(lambda: canzona.Shampoo([("norm.weight", p)]))


def test_vector_in_matrix_group_rejected(dist: Any) -> None:
    """Catches: a 1-D parameter accepted in a matrix group, or an error that does not say
    where it belongs."""
    for kind, msg in dist(4).run(_one_d_in_matrix_group, timeout=TIMEOUT):
        assert kind == "ValueError"
        assert "'norm.weight'" in msg and 'algorithm="adamw"' in msg


def _nonfinite(
    cls_name: str, skip: bool, at: int = 1, strategy: str = "canzona", last_rank: bool = False
) -> dict[str, Any]:
    """Three steps with a NaN and an inf in step ``at``'s gradients: rank 0's rows, or with
    ``last_rank`` only rank 3's (the last rows of one matrix)."""
    cls = getattr(canzona, cls_name)
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    if last_rank:
        grads[at]["square"][-1, 5] = float("nan")
        grads[at]["square"][-2, 0] = float("inf")
    else:
        grads[at]["square"][3, 5] = float("nan")
        grads[at]["odd"][0, 0] = float("inf")
    cfg = canzona.PipelineConfig(skip_nonfinite=skip)
    local = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    dist_params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes})
    outs, errors, skipped = [], [], []
    for params in (local, dist_params):
        opt = cls(params, lr=0.01, pipeline=cfg, plan=canzona.PlanConfig(strategy=strategy))
        error = "ok"
        for g in grads:
            set_grads(params, g)
            kind, _ = _outcome(opt.step)
            error = kind if kind != "ok" else error
        outs.append({n: full_of(p) for n, p in params})
        errors.append(error)
        skipped.append(opt.skipped_steps)
    same = {
        n: bool(torch.equal(outs[0][n].nan_to_num(7.0), outs[1][n].nan_to_num(7.0)))
        and bool(torch.equal(outs[0][n].isnan(), outs[1][n].isnan()))
        for n in shapes
    }
    return {
        "same": same,
        "errors": errors,
        "skipped": skipped,
        "nan": bool(outs[1]["square"].isnan().any()),
    }


def test_nonfinite_gradients_propagate_as_on_one_device(dist: Any) -> None:
    """Muon: NaN/Inf flow into the parameters exactly as on one device, on every rank.

    Catches: a silent skip or zeroing of non-finite gradients, and a NaN that reaches some
    ranks' shards but not others'."""
    for out in dist(4).run(_nonfinite, "Muon", False, timeout=TIMEOUT):
        assert out == {
            "same": {"square": True, "odd": True},
            "errors": ["ok", "ok"],
            "skipped": [0, 0],
            "nan": True,
        }


@pytest.mark.parametrize("strategy", ["canzona", "replicated"])
def test_nonfinite_gradients_fail_the_eigendecomposition_on_every_rank(
    dist: Any, strategy: str
) -> None:
    """SOAP: eigh rejects NaN on the owner; every rank raises UpdateFailedError, none hangs.

    Catches: a failure that stays on the owner (the others would hang in the next collective
    or return normally), and parameters that differ from one device's afterwards (nothing
    changed on either side). tests/runtime/test_atomic_step.py checks the state as well."""
    for out in dist(4).run(_nonfinite, "SOAP", False, 0, strategy, timeout=TIMEOUT):
        assert out["errors"] == ["UpdateFailedError", "UpdateFailedError"]
        assert out["same"] == {"square": True, "odd": True}


def test_skip_nonfinite_skips_the_step_on_every_rank(dist: Any) -> None:
    """Catches: a skip decided by each rank alone (the rank without NaN would update), a
    skipped step that still advances state, and ``skipped_steps`` not counting it."""
    for name in ("Muon", "SOAP"):
        for out in dist(4).run(_nonfinite, name, True, timeout=TIMEOUT):
            assert out == {
                "same": {"square": True, "odd": True},
                "errors": ["ok", "ok"],
                "skipped": [1, 1],
                "nan": False,
            }


def test_a_nonfinite_gradient_on_the_last_rank_alone_skips_everywhere(dist: Any) -> None:
    """Catches: the skip decided by rank 0's flag (rank 0's gradients are finite here)."""
    for out in dist(4).run(_nonfinite, "Muon", True, 1, "canzona", True, timeout=TIMEOUT):
        assert out == {
            "same": {"square": True, "odd": True},
            "errors": ["ok", "ok"],
            "skipped": [1, 1],
            "nan": False,
        }


def _skip_step_on_rank1() -> tuple[str, str]:
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    params = _params(("square", "tall"))
    opt = canzona.Muon(
        params, lr=0.02, pipeline=canzona.PipelineConfig(process_group=group, timeout_s=2.0)
    )
    for _, p in params:
        p.grad = torch.ones_like(p)
    if tdist.get_rank() == 1:
        return "skipped", ""
    return _outcome(opt.step)


def test_watchdog_names_the_rank_that_never_arrived(dist: Any) -> None:
    """Catches: a wait without a deadline (a hang), and a timeout that does not name rank 1
    or, at a first step, does not say that rank 1 may never have built the optimizer."""
    out = dist(4).run(_skip_step_on_rank1, timeout=TIMEOUT)
    assert out[1] == ("skipped", "")
    for rank in (0, 2, 3):
        kind, msg = out[rank]
        assert kind == "CollectiveTimeoutError", msg
        assert "ranks that have not reached it: 1 (last: not waiting in any collective)" in msg
        assert "did not complete within 2s" in msg
        # a first step: the rank may never have built the optimizer (the message says so)
        assert "how ranks that never built this optimizer look" in msg, msg
        assert "needs PipelineConfig(process_group=...) of those ranks" in msg, msg


def _rank_local_optimizer() -> tuple[str, bool]:
    """Rank 0 alone trains a plain linear (say, a probe) with a group of its own rank."""
    if tdist.get_rank() != 0:
        return "not built", True
    own = tdist.new_group([0], use_local_synchronization=True)
    torch.manual_seed(0)
    model = nn.Linear(12, 8, bias=False)
    reference = copy.deepcopy(model)
    config = canzona.PipelineConfig(process_group=own, timeout_s=5.0)
    opt = canzona.Muon(model.parameters(), lr=0.02, pipeline=config)
    want = torch.optim.Muon(reference.parameters(), lr=0.02)
    outcome = "ok"
    for step in range(2):
        grad = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        model.weight.grad, reference.weight.grad = grad.clone(), grad.clone()
        outcome = _outcome(opt.step)[0]
        want.step()
    return outcome, torch.equal(model.weight, reference.weight)


def test_an_optimizer_of_one_rank_in_a_job_steps_alone_on_a_group_of_its_own(dist: Any) -> None:
    """An optimizer over plain tensors counts them as replicated on every rank of its group
    (the default one: the ranks that never build it would then be waited for, as above); on
    a group of its own rank it steps alone, as ``torch.optim.Muon`` does, bit for bit.
    Catches: a collective of the step on the default group whatever the configured one (rank
    1 never enters it: a timeout after 5 s)."""
    assert dist(2).run(_rank_local_optimizer, timeout=TIMEOUT) == [
        ("ok", True),
        ("not built", True),
    ]


def _storage_bytes(opt: torch.optim.Optimizer) -> list[tuple[bool, int]]:
    """Per cached pipeline: retired, and the smallest storage of its step buffers (bytes)."""
    pipelines = opt._runtime._pipelines.values()  # type: ignore[attr-defined]
    return [
        (p.retired, min(b.tensor.untyped_storage().nbytes() for b in p.schedule.buffers))
        for p in pipelines
    ]


def _timeout_with_gathers_in_flight() -> dict[str, Any]:
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=6))
    params = _params(tuple(SHAPES))  # 10 matrices for 4 ranks
    opt = canzona.Muon(
        params,
        lr=0.02,
        plan=canzona.PlanConfig(capacity_mb=0.0005),  # one matrix per rank and micro-group
        pipeline=canzona.PipelineConfig(
            process_group=group, timeout_s=2.0, check_every_step=False, keep_buffers=False
        ),
    )
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # every rank: plans, and leaves its buffers released (keep_buffers=False)
    out: dict[str, Any] = {
        "groups": opt.last_step_stats.micro_groups,  # type: ignore[attr-defined]
        "after_step": _storage_bytes(opt),
    }
    if tdist.get_rank() == 1:
        return out
    out["outcome"] = _outcome(opt.step)
    out["after_timeout"] = _storage_bytes(opt)
    return out


def test_a_timeout_never_frees_buffers_a_collective_may_still_use(dist: Any) -> None:
    """Catches: freeing the step buffers while gathers issued ahead are still in flight.

    Rank 1 skips the second step: the others time out waiting for the first gather while
    the next micro-group's gather (issued ahead, depth 1) still holds the step buffers.
    Those must stay allocated, and the pipeline retired so the next step builds new ones.
    """
    out = dist(4).run(_timeout_with_gathers_in_flight, timeout=TIMEOUT)
    for rank in range(4):
        assert out[rank]["groups"] >= 2
        assert out[rank]["after_step"] == [(False, 0)]  # released between healthy steps
    assert "outcome" not in out[1]
    for rank in (0, 2, 3):
        kind, msg = out[rank]["outcome"]
        assert kind == "CollectiveTimeoutError", msg
        assert "the gather of micro-group 0" in msg
        [(retired, held)] = out[rank]["after_timeout"]
        assert retired
        assert held > 0


def _replan_after_add_param_group() -> dict[str, Any]:
    shapes = {n: SHAPES[n] for n in ("square", "tall", "wide")}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 4)
    kw = {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 1}

    def run(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        return run_with_late_group(params, grads, 2, **kw)

    want = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()])
    got = run(sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes}))
    return {n: bool(torch.equal(got[n], want[n])) for n in shapes}


def test_add_param_group_after_the_plan_replans_everywhere(dist: Any) -> None:
    """Owner-held Shampoo state moves to the new owners; the result equals one device.

    Catches: a plan kept after ``add_param_group`` (the new matrix would have no owner), and
    owner-held state left on the old owners (recreated fresh: the result would differ)."""
    for out in dist(4).run(_replan_after_add_param_group, timeout=TIMEOUT):
        assert out == {"square": True, "tall": True, "wide": True}


def _add_group_on_some_ranks() -> dict[str, Any]:
    params = _params(("square", "tall", "wide"))
    opt = canzona.Muon(params[:2], lr=0.02)
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # the plan exists
    before = {n: full_of(p) for n, p in params}
    if tdist.get_rank() in (1, 3):
        opt.add_param_group({"params": params[2:]})
    kind, msg = _outcome(opt.step)
    return {
        "kind": kind,
        "msg": msg,
        "unchanged": all(torch.equal(full_of(p), before[n]) for n, p in params),
    }


def test_add_param_group_on_some_ranks_only_raises_everywhere(dist: Any) -> None:
    """Ranks 1 and 3 add a param group, ranks 0 and 2 do not: at the next step every rank
    raises PlanMismatchError naming both rank sets and the parameter counts, and nothing
    changes. Catches: a header that skips its comparison while a rank re-plans (the ranks
    that re-plan would wait in the layout agreement the others never enter)."""
    out = dist(4).run(_add_group_on_some_ranks, timeout=TIMEOUT)
    assert out[0]["msg"] == out[1]["msg"] == out[2]["msg"] == out[3]["msg"]
    for o in out:
        assert o["kind"] == "PlanMismatchError", o
        assert o["msg"].startswith(
            "ranks [0, 2] and ranks [1, 3] disagree on the number of parameters (2 vs 3)"
        ), o["msg"]
        assert "every rank must call step() with the same parameters, param groups" in o["msg"]
        assert o["unchanged"], o


def _redistributed_grads(mode: str) -> list[tuple[str, bool, bool]]:
    """``b``'s gradient in ``Shard(1)`` for a ``Shard(0)`` parameter (its read redistributes
    it, a collective); in the fourth step rank 0 alone sees a NaN (``nan``: in ``a``, with
    ``skip_nonfinite``: every rank skips the step), fails at the gradient before ``b``'s
    (``plain``: ``a``'s a plain tensor) or before its prepare (``closure``: its closure
    raises, without the per-step check). Then one more step. Per step: outcome, whether the
    parameters changed, whether the header rode."""
    rank = tdist.get_rank()
    dm = mesh((2,))
    shapes = {"a": (16, 8), "b": (8, 16)}
    params = sharded_params(full_tensors(shapes), dm, {n: (Shard(0),) for n in shapes})
    config = canzona.PipelineConfig(
        skip_nonfinite=mode == "nan",
        check_every_step=mode != "closure",  # no header: the failure stays local until the vote
        timeout_s=20.0,
    )
    opt = canzona.Muon(params, lr=0.02, ns_dtype=torch.float32, pipeline=config)
    out = []
    for step, grads in enumerate(grad_steps(shapes, 5)):
        if step == 3 and mode == "nan" and rank == 0:
            grads["a"][0, 0] = float("nan")
        for (n, p), g in zip(params, grads.values(), strict=True):
            p.grad = distribute_tensor(g, dm, [Shard(1) if n == "b" else Shard(0)])
        if step == 3 and mode == "plain" and rank == 0:
            params[0][1].grad = grads["a"]
        before = [full_of(p) for _, p in params]
        if step == 3 and mode == "closure" and rank == 0:
            kind, _ = _outcome(lambda: opt.step(_refusing_closure))
        else:
            kind, _ = _outcome(opt.step)
        after = [full_of(p) for _, p in params]
        changed = any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
        out.append((kind, changed, bool(opt.last_step_stats and opt.last_step_stats.header_rode)))
        opt.zero_grad(set_to_none=True)
    return out


def _refusing_closure() -> None:
    raise RuntimeError("the closure refused")


@pytest.mark.parametrize(
    ("mode", "last"),
    [("nan", "ok"), ("plain", "UpdateFailedError"), ("closure", "UpdateFailedError")],
)
def test_a_rank_that_prepares_nothing_still_redistributes_gradients(
    dist: Any, mode: str, last: str
) -> None:
    """Catches: the gradients' redistribution (a collective) left to the prepare, which a
    rank skipped when it failed before it, or stopped at its first bad gradient: the other
    rank waited in a redistribution no watchdog bounds (``closure``: the rank that fails
    before its prepare redistributes them alone); and a header riding the first
    gather of steps whose gradients are redistributed (each rank reads them before it).
    (A rank whose own gradient for such a parameter is missing or plain cannot enter its
    redistribution at all: docs/usage.md says so.)"""
    for rank, out in enumerate(dist(2).run(_redistributed_grads, mode, timeout=TIMEOUT)):
        assert [o[0] for o in out] == ["ok", "ok", "ok", last, "ok"], f"rank {rank}: {out}"
        assert not any(o[2] for o in out), f"rank {rank}: a header rode: {out}"
        assert out[3][1] is False, f"rank {rank}: the fourth step changed parameters"


def _hparam_set_between_steps(what: str) -> dict[str, Any]:
    """After a good step every rank sets a group value the step cannot use (as a scheduler
    or the job may); ``b`` is (1, 16): rank 1 holds an empty shard of it."""
    dm = mesh((2,))
    shapes = {"a": (16, 8), "b": (1, 16), "bias": (8,)}
    params = sharded_params(full_tensors(shapes), dm, {n: (Shard(0),) for n in shapes})
    named = dict(params)
    groups = [
        {"params": [("a", named["a"])]},
        {"params": [("b", named["b"])]},
        {"params": [("bias", named["bias"])], "algorithm": "adamw"},
    ]
    opt = canzona.Muon(groups, lr=0.02, ns_dtype=torch.float32)
    steps = grad_steps(shapes, 3)
    set_grads(params, steps[0])
    opt.step()
    if what == "scale":
        opt.param_groups[1]["scale"] = -1.0
    elif what == "adjust_lr_fn":
        opt.param_groups[1]["adjust_lr_fn"] = "spectrall"
    else:
        opt.param_groups[2]["lr"] = torch.tensor([1e-3, 1e-3])
    set_grads(params, steps[1])
    before = {n: full_of(p) for n, p in params}
    state = {k: v.clone() for k, v in opt.state[named["a"]].items() if torch.is_tensor(v)}
    kind, msg = _outcome(opt.step)
    same = all(torch.equal(before[n], full_of(p)) for n, p in params)
    kept = all(torch.equal(state[k], opt.state[named["a"]][k]) for k in state)
    return {"kind": kind, "msg": msg, "unchanged": same and kept}


@pytest.mark.parametrize(("what", "group"), [("scale", 1), ("adjust_lr_fn", 1), ("adamw_lr", 2)])
def test_a_group_value_set_between_steps_is_checked_before_the_step(
    dist: Any, what: str, group: int
) -> None:
    """Catches: group values checked only when the group was added, so a bad one raised
    in the apply, after the vote: a plain ValueError, part of the step applied (``a``
    updated, its momentum rolled back), and a rank with nothing of ``b`` going on alone."""
    for rank, out in enumerate(dist(2).run(_hparam_set_between_steps, what, timeout=TIMEOUT)):
        assert out["kind"] == "UpdateFailedError", f"rank {rank}: {out}"
        assert f"param group {group}:" in out["msg"], f"rank {rank}: {out['msg']}"
        assert out["unchanged"], f"rank {rank}: the failed step changed something"


def _state_dict_pre_hook_on_one_rank(which: str) -> tuple[str, str, str]:
    """A state-dict pre-hook raises on rank 1 only; every rank catches and steps on.

    ``which``: the optimizer that saves: one that stepped, a copy of it made after its
    step (its process group not yet looked up), or one that never stepped."""
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"]}
    grads = grad_steps(shapes, 3)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Shampoo(params, lr=0.01, pipeline=canzona.PipelineConfig(timeout_s=20.0))
    armed = [False]

    def pre_hook(o: Any) -> None:
        if armed[0] and tdist.get_rank() == 1:
            raise RuntimeError("the checkpoint disk is full")

    if which != "fresh":
        set_grads(params, grads[0])
        opt.step()
    if which == "copied":
        opt = copy.deepcopy(opt)
        params = list(zip([n for n, _ in params], opt.param_groups[0]["params"], strict=True))
    opt.register_state_dict_pre_hook(pre_hook)
    armed[0] = True
    saved = _outcome(opt.state_dict)
    armed[0] = False
    set_grads(params, grads[1])
    stepped = _outcome(opt.step)
    return (*saved, stepped[0])


@pytest.mark.parametrize("which", ["stepped", "copied", "fresh"])
def test_a_state_dict_pre_hook_that_raises_on_one_rank_raises_everywhere(
    dist: Any, which: str
) -> None:
    """Catches: a state-dict pre-hook's exception leaving ``state_dict()`` on its rank alone
    while the others went on into its collectives: the ranks' next calls paired with them
    (gloo aborted the job); and the vote taken on each rank alone where the optimizer had
    not yet looked up its process group (a copy: the others waited in the plan's check
    until ``timeout_s``; one that never stepped: the others returned a state dict). The
    rank raises its own error, the others name it."""
    out = dist(2).run(_state_dict_pre_hook_on_one_rank, which, timeout=TIMEOUT)
    assert out[1] == ("RuntimeError", "the checkpoint disk is full", "ok")
    assert out[0] == (
        "RuntimeError",
        "state_dict failed on ranks [1] (a state-dict pre-hook raised there, or its param "
        "groups no longer fit the optimizer state); nothing was saved",
        "ok",
    )


def _algorithm_switched_on_one_rank() -> dict[str, Any]:
    """Rank 1 alone switches a stepped group to ``"adamw"``; both step, it switches back,
    both step again."""
    shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"]}
    grads = grad_steps(shapes, 3)
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, lr=0.02, pipeline=canzona.PipelineConfig(timeout_s=20.0))
    set_grads(params, grads[0])
    opt.step()
    if tdist.get_rank() == 1:
        opt.param_groups[0]["algorithm"] = "adamw"
    set_grads(params, grads[1])
    before = {n: full_of(p) for n, p in params}
    kind, msg = _outcome(opt.step)
    same = all(torch.equal(before[n], full_of(p)) for n, p in params)
    opt.param_groups[0]["algorithm"] = "muon"
    return {"kind": kind, "msg": msg, "unchanged": same, "then": _outcome(opt.step)[0]}


def test_an_algorithm_switched_on_one_rank_fails_the_step_everywhere(dist: Any) -> None:
    """Catches: the check that a stepped group keeps its algorithm raising on its own rank
    before the step's collectives, so that the rank that switched raised ``ValueError``
    and the others waited in the step until ``timeout_s`` (and the job had to restart).
    Every rank must raise the same error, nothing change, and the job step on once the
    group is switched back."""
    out = dist(2).run(_algorithm_switched_on_one_rank, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert o["kind"] == "UpdateFailedError", f"rank {rank}: {o}"
        assert (
            "has 'muon' state (parameter 'square'), but its algorithm is now 'adamw'" in (o["msg"])
        ), f"rank {rank}: {o['msg']}"
        assert o["unchanged"] is True
        assert o["then"] == "ok"


class _Boom(Exception):
    """A user's own exception."""


def _closure_and_pre_hook_raise_in_a_one_rank_job() -> list[str]:
    """In a job of one rank (``torchrun --nproc-per-node 1``): a closure that raises, then a
    step pre-hook that raises; each exception's type as ``step()`` raised it."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = canzona.Muon([p], lr=0.02)
    out = []

    def boom(*_: Any) -> None:
        raise _Boom("from the user's code")

    for hook in (False, True):
        p.grad = torch.randn(8, 8)
        handle = opt.register_step_pre_hook(boom) if hook else None
        try:
            opt.step(None if hook else boom)
        except Exception as exc:
            out.append(type(exc).__name__)
        if handle is not None:
            handle.remove()
    opt.step()
    return out


def test_a_one_rank_job_raises_the_closures_own_exception(dist: Any) -> None:
    """Catches: a closure's or a step pre-hook's exception turned into ``UpdateFailedError``
    wherever ``torch.distributed`` was initialised, in a job of one rank too (no other rank
    to keep in step), so that a job's ``except`` around ``step()`` missed it; in one
    process it propagates, as in torch.optim."""
    assert dist(1).run(_closure_and_pre_hook_raise_in_a_one_rank_job, timeout=TIMEOUT) == [
        ["_Boom", "_Boom"]
    ]
