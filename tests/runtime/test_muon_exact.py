"""canzona.Muon on DeviceMeshes equals torch.optim.Muon on the full tensors, bit for bit."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    SHAPES,
    assert_bitwise,
    compare,
    full_of,
    full_tensors,
    grad_steps,
    plan,
    reference_muon,
    run_steps,
    set_grads,
    sharded_params,
    strategies,
)
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}


def _muon_case(
    mesh_shape: tuple[int, ...],
    placements: dict[str, tuple[Placement, ...]],
    *,
    capacity_mb: float = 512.0,
    dedup: bool = True,
    steps: int = 3,
    kinds: tuple[str, ...] | None = None,
    overlaps: tuple[bool, ...] = (True, False),
    depth: int = 1,
) -> dict[str, Any]:
    shapes = {n: SHAPES[n] for n in placements}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, steps)
    want = reference_muon(fulls, grads, **KW)
    dm = mesh(mesh_shape)
    results: dict[str, Any] = {}
    for strategy in kinds or strategies():
        for overlap in overlaps:
            params = sharded_params(fulls, dm, placements)
            got = run_steps(
                lambda ps, s=strategy, o=overlap: canzona.Muon(
                    ps,
                    **KW,
                    plan=plan(s, capacity_mb=capacity_mb, replica_dedup=dedup),
                    pipeline=canzona.PipelineConfig(overlap=o, depth=depth),
                ),
                params,
                grads,
            )
            results[f"{strategy}/overlap={overlap}"] = compare(got, want)
    return results


TORCH_MUON = "not bitwise equal to torch.optim.Muon"


ALL_ROWS = {n: (Shard(0),) if len(s) == 2 else (Shard(1),) for n, s in SHAPES.items()}


def test_fsdp_rows_world4(dist: Any) -> None:
    """Shard(0) on 4 ranks: uneven and empty shards (7x13, 5x3), a stack sharded by rows.

    Catches: an empty shard that sends or receives a fragment of the wrong size (the
    all-to-all's split sizes would disagree), uneven shards cut by another rule than
    ``torch.chunk``'s."""
    assert_bitwise(dist(4).run(_muon_case, (4,), ALL_ROWS), TORCH_MUON)


def test_tp_columns_and_stacks_world4(dist: Any) -> None:
    placements = {n: (Shard(len(s) - 1),) for n, s in SHAPES.items()}
    placements["stack"] = (Shard(0),)  # experts split across ranks (3 over 4: one rank holds none)
    assert_bitwise(dist(4).run(_muon_case, (4,), placements), TORCH_MUON)


def test_2d_mesh_world4(dist: Any) -> None:
    placements = {n: (Shard(0), Shard(len(s) - 1)) for n, s in SHAPES.items()}
    placements["odd"] = (Shard(0), Shard(0))
    assert_bitwise(dist(4).run(_muon_case, (2, 2), placements), TORCH_MUON)


@pytest.mark.parametrize("dedup", [True, False])
def test_hsdp_world4(dist: Any, dedup: bool) -> None:
    placements = {n: (Replicate(), Shard(len(s) - 2)) for n, s in SHAPES.items()}
    placements["square"] = (Replicate(), Replicate())
    assert_bitwise(dist(4).run(_muon_case, (2, 2), placements, dedup=dedup), TORCH_MUON)


@pytest.mark.parametrize("depth", [1, 3])
def test_world2_with_small_micro_groups(dist: Any, depth: int) -> None:
    """A tiny capacity forces one matrix per owner per micro-group: many groups in flight."""
    per_rank = dist(2).run(_muon_case, (2,), ALL_ROWS, capacity_mb=1e-4, depth=depth)
    assert_bitwise(per_rank, TORCH_MUON)


def _mixed_case() -> dict[str, Any]:
    shapes = {"square": SHAPES["square"], "wide": SHAPES["wide"], "odd": SHAPES["odd"]}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    want = reference_muon(fulls, grads, **KW)
    dm = mesh((2, 2), ("dp", "tp"))
    meshes = {"square": dm, "wide": dm["dp"], "odd": dm["tp"]}
    placements = {"square": (Shard(0), Shard(1)), "wide": (Shard(1),), "odd": (Shard(0),)}
    out = {}
    for strategy in strategies():
        params = sharded_params(fulls, meshes, placements)
        got = run_steps(lambda ps, s=strategy: canzona.Muon(ps, **KW, plan=plan(s)), params, grads)
        out[strategy] = compare(got, want)
    return out


def test_mixed_meshes_world4(dist: Any) -> None:
    """One optimizer over params on a 2-D mesh and on two different 1-D sub-meshes.

    Catches: a sub-mesh copy planned on ranks outside it, or copies merged into one matrix
    (each 1-D sub-mesh holds its own copy, updated by one of its own ranks)."""
    assert_bitwise(dist(4).run(_mixed_case), TORCH_MUON)


def _owners_and_stats() -> dict[str, Any]:
    shapes = {"square": (16, 16), "tall": (24, 8)}
    fulls = full_tensors(shapes)
    params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, lr=0.02)
    for p in (p for _, p in params):
        p.grad = torch.zeros_like(p)
    opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    return {"computed": stats.matrices_computed, "collectives": stats.collectives}


def test_more_ranks_than_matrices(dist: Any) -> None:
    """Two matrices on four ranks: two ranks own nothing, every matrix is computed once.

    Catches: a rank with nothing to compute that skips the step's collectives (the others
    would wait for it), and a matrix computed twice."""
    out = dist(4).run(_owners_and_stats)
    assert sum(o["computed"] for o in out) == 2
    assert sorted(o["computed"] for o in out) == [0, 0, 1, 1]


def _hsdp_computed(dedup: bool) -> dict[str, Any]:
    """One step on (replicate 2, shard 2): how many matrices this rank computed."""
    shapes = {f"w{i}": (8, 8) for i in range(4)}
    params = sharded_params(
        full_tensors(shapes), mesh((2, 2)), {n: (Replicate(), Shard(0)) for n in shapes}
    )
    opt = canzona.Muon(params, lr=0.02, plan=plan("canzona", replica_dedup=dedup))
    for _, p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    return {"computed": stats.matrices_computed}


@pytest.mark.parametrize("dedup", [True, False])
def test_replica_groups_compute_their_own_copy_without_dedup(dist: Any, dedup: bool) -> None:
    """HSDP: with ``replica_dedup`` each of the 4 matrices is computed once in the world;
    without it once per replica group (twice), each group's ranks among themselves.

    Catches: replica groups merged into one unit when ``replica_dedup=False`` (the results
    stay bitwise either way, so only the counts tell)."""
    out = dist(4).run(_hsdp_computed, dedup)
    assert sum(o["computed"] for o in out) == (4 if dedup else 8)
    assert all(o["computed"] == (1 if dedup else 2) for o in out)


def test_single_process_matches_torch() -> None:
    shapes = dict(SHAPES)
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    want = reference_muon(fulls, grads, **KW)
    from _cases import local_optimizer

    got = local_optimizer(canzona.Muon, fulls, grads, **KW)
    for name, (eq, rel) in compare(got, want).items():
        assert eq, f"{name}: {rel}"


def _fully_shard_case(world_mesh: tuple[int, ...]) -> dict[str, bool]:
    """FSDP2's own sharding (uneven dims included) against torch.optim.Muon on one device."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(13, 7, bias=False), torch.nn.Linear(7, 30, bias=False)
    )
    model = copy.deepcopy(ref)
    fully_shard(model, mesh=mesh(world_mesh))
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.named_parameters()}
        set_grads(list(model.named_parameters()), grads)
        set_grads(list(ref.named_parameters()), grads)
        opt.step()
        ref_opt.step()
    return {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fully_shard_bitwise(dist: Any, world: int) -> None:
    """Catches (world 3): a default-configured first step that fails where the world size
    does not divide the transfer probe (its all-to-all splits disagreed across ranks)."""
    for out in dist(world).run(_fully_shard_case, (world,)):
        assert all(out.values()), out


def _two_linears() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded two-layer MLP (10 -> 22 -> 9, no biases) and a copy of it to parallelize."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(10, 22, bias=False), torch.nn.ReLU(), torch.nn.Linear(22, 9, bias=False)
    )
    return ref, copy.deepcopy(ref)


def _tp_only_case() -> dict[str, bool]:
    """parallelize_module alone on a (4,) mesh: Colwise Shard(0), Rowwise Shard(1)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref, model = _two_linears()
    parallelize_module(model, mesh((4,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    x = torch.randn(6, 10)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        set_grads(list(model.named_parameters()), grads)
        opt.step()
        ref_opt.step()
    return {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }


def test_tensor_parallel_only_world4(dist: Any) -> None:
    for out in dist(4).run(_tp_only_case):
        assert out == {"0.weight": True, "2.weight": True}


def _fsdp_tp_case() -> dict[str, Any]:
    """parallelize_module on ``tp`` then fully_shard on ``dp`` of a (2, 2) mesh: FSDP's
    ``_StridedShard`` on top of TP's ``Shard`` (Colwise) and ``Shard(0), Shard(1)`` (Rowwise)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref, model = _two_linears()
    dm = mesh((2, 2), ("dp", "tp"))
    parallelize_module(model, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dm["dp"])
    placements = {
        n: [type(pl).__name__ for pl in p.placements] for n, p in model.named_parameters()
    }
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    x = torch.randn(6, 10)
    for _ in range(3):
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            # distribute_tensor cannot cut a _StridedShard; redistribute from Replicate can
            grad = distribute_tensor(q.grad.clone(), p.device_mesh, [Replicate(), Replicate()])
            p.grad = grad.redistribute(p.device_mesh, p.placements)
        opt.step()
        ref_opt.step()
    same = {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }
    return {"placements": placements, "same": same}


def test_fsdp_over_tp_strided_shards_world4(dist: Any) -> None:
    """``parallelize_module`` + ``fully_shard`` (2-D FSDP×TP) equals torch.optim.Muon, bitwise.

    Catches: a ``_StridedShard`` fragment read or written in plain ``Shard`` order (the rows
    of the two TP halves would be interleaved wrongly), a mesh-dim order mix-up.
    """
    for out in dist(4).run(_fsdp_tp_case):
        assert out["placements"] == {
            "0.weight": ["_StridedShard", "Shard"],
            "2.weight": ["Shard", "Shard"],
        }, out
        assert out["same"] == {"0.weight": True, "2.weight": True}, out


def _uneven_fsdp_tp_case(dp: int, tp: int) -> dict[str, bool]:
    """FSDP×TP on a ``(dp, tp)`` mesh with row counts that neither axis divides: Colwise
    weights of 7 and 13 rows under FSDP's ``_StridedShard``, a Rowwise one of 7 columns.

    Gradients are element-wise functions of the parameters (no collective), so the
    reference sees the same values bit for bit."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    ref = torch.nn.Sequential(
        torch.nn.Linear(10, 7, bias=False),
        torch.nn.Linear(7, 13, bias=False),
        torch.nn.Linear(13, 9, bias=False),
    )
    model = copy.deepcopy(ref)
    dm = mesh((dp, tp), ("dp", "tp"))
    plan = {"0": ColwiseParallel(), "1": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, dm["tp"], plan)
    fully_shard(model, mesh=dm["dp"])
    opt = canzona.Muon(model.parameters(), **KW)
    ref_opt = torch.optim.Muon(ref.parameters(), **KW)
    for step in range(3):
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            p.grad = p.detach() * 1.5 - 0.25 * step
            q.grad = q.detach() * 1.5 - 0.25 * step
        opt.step()
        ref_opt.step()
    return {
        n: bool(torch.equal(p.full_tensor(), q.detach()))
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True)
    }


@pytest.mark.parametrize("dp_tp", [(3, 2), (2, 3)])
def test_fsdp_over_tp_with_uneven_rows_world6(dist: Any, dp_tp: tuple[int, int]) -> None:
    """Catches: FSDP's ``_StridedShard`` over TP read in DTensor's left-to-right order,
    which on uneven sizes is not what FSDP stores (7 rows on (3, 2): rank (2, 0) holds no
    row, rank (2, 1) row 6): a KeyError on one rank, split sizes that disagree on others."""
    for out in dist(6).run(_uneven_fsdp_tp_case, *dp_tp):
        assert out == {"0.weight": True, "1.weight": True, "2.weight": True}, out


BATCHED = {f"w{i}": (32, 48) for i in range(4)} | {f"t{i}": (64, 32) for i in range(2)}


def _batched_newton_schulz_case() -> dict[str, Any]:
    """Same-shape matrices with sides >= 32: the owner runs Newton–Schulz on stacks."""
    ns = importlib.import_module("canzona.updates.newton_schulz")

    fulls = full_tensors(BATCHED)
    grads = grad_steps(BATCHED, 3)
    want = reference_muon(fulls, grads, **KW)  # torch.optim.Muon, one matrix at a time
    exact = {
        shape: ns.batch_kernels_exact(2, *shape, dtype=torch.bfloat16)
        for shape in set(BATCHED.values())
    }
    stacks: list[tuple[int, ...]] = []
    original = ns._ns_stack

    def spy(x: torch.Tensor, *args: Any) -> torch.Tensor:
        stacks.append(tuple(x.shape))
        return original(x, *args)

    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in BATCHED})
    ns._ns_stack = spy
    try:
        got = run_steps(lambda ps: canzona.Muon(ps, **KW, plan=plan("count")), params, grads)
    finally:
        ns._ns_stack = original
    return {
        "exact": exact,
        "stacks": sorted(set(stacks)),
        "calls": len(stacks),
        "same": {n: eq for n, (eq, _) in compare(got, want).items()},
    }


def test_batched_newton_schulz_path_world2(dist: Any) -> None:
    """The ``count`` strategy gives each of two ranks two of the four (32, 48) matrices (and
    one (64, 32)): the owner runs Newton–Schulz on the (2, 32, 48) stack with batched
    kernels, and the result is still torch.optim.Muon's, bit for bit.

    Catches: batched kernels used where they round differently, a batch assembled in the
    wrong order (directions of one matrix applied to another), stacks never formed.
    """
    for out in dist(2).run(_batched_newton_schulz_case):
        assert out["exact"] == {(32, 48): True, (64, 32): True}, out
        assert out["stacks"] == [(2, 32, 48)], out
        assert out["calls"] == 3, out  # one stack per step on this rank
        assert all(out["same"].values()), out


def _held_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank's step buffers and state copies hold (between steps: what is kept)."""
    pipelines = opt._runtime._pipelines.values()  # type: ignore[attr-defined]
    work = opt._work[2]  # type: ignore[attr-defined]
    backups = [w.cache["backup"] for w in work.groups if "backup" in w.cache]
    return {
        "schedules": sum(
            b.tensor.untyped_storage().nbytes() for p in pipelines for b in p.schedule.buffers
        ),
        "backups": sum(b.held_bytes for b in backups),
        "backup_groups": len(backups),
    }


def _buffer_policies_case() -> dict[str, Any]:
    """Every ``keep_buffers`` setting: what stays allocated between steps, and the results."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    want = reference_muon(fulls, grads, **KW)
    vectors = {"bias": torch.linspace(-1.0, 1.0, 10)}
    vector_grads = [{"bias": torch.full((10,), 0.1 * (k + 1))} for k in range(3)]
    dm = mesh((2,))
    out: dict[str, Any] = {}
    for keep in (None, True, False):
        params = sharded_params(fulls, dm, ALL_ROWS)
        bias = sharded_params(vectors, dm, {"bias": (Shard(0),)})
        opt = canzona.Muon(
            [{"params": params}, {"params": bias, "algorithm": "adamw", "lr": 1e-3}],
            **KW,
            plan=plan(capacity_mb=1e-4),  # several micro-groups, several step buffers
            pipeline=canzona.PipelineConfig(keep_buffers=keep),
        )
        held = []
        for g, vg in zip(grads, vector_grads, strict=True):
            set_grads(params + bias, g | vg)
            opt.step()
            opt.zero_grad(set_to_none=True)
            held.append(_held_bytes(opt))
        got = {n: full_of(p) for n, p in params + bias}
        out[str(keep)] = {"same": compare(got, want), "held": held, "bias": got["bias"]}
    return out


def test_step_buffers_kept_on_cpu_by_default_and_freed_when_asked(dist: Any) -> None:
    """``keep_buffers``: None keeps the step buffers and the state copies (Muon's momentum,
    the AdamW moments) allocated between steps on the CPU, True keeps them, False frees
    them after every step; all three are bitwise equal to torch.optim.Muon (and to each
    other on the AdamW-routed bias).

    Catches: the flag ignored (either way), a kept buffer whose stale contents leak into
    the next step, copies allocated before the first step that takes them.
    """
    for out in dist(2).run(_buffer_policies_case):
        for keep in ("None", "True", "False"):
            assert all(eq for eq, _ in out[keep]["same"].values()), (keep, out[keep]["same"])
            assert torch.equal(out[keep]["bias"], out["False"]["bias"]), keep
            for held in out[keep]["held"]:
                assert held["backup_groups"] == 2, held  # the Muon group and the AdamW group
                if keep == "False":
                    assert held["schedules"] == 0 and held["backups"] == 0, held
                else:
                    assert held["schedules"] > 0 and held["backups"] > 0, (keep, held)


def _alternating_grads_case() -> dict[str, Any]:
    """``square`` has no gradient on every other step: two schedules, one set of buffers."""
    steps = 4
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, steps)
    for k in range(1, steps, 2):
        del grads[k]["square"]
    want: dict[str, torch.Tensor] = {}
    for name, full in fulls.items():  # torch.optim.Muon skips a parameter without a gradient
        mats = [full.clone()] if full.ndim == 2 else [m.clone() for m in full]
        ps = [torch.nn.Parameter(m) for m in mats]
        ref = torch.optim.Muon(ps, **KW)
        for g in grads:
            if name in g:
                for p, gg in zip(ps, [g[name]] if full.ndim == 2 else list(g[name]), strict=True):
                    p.grad = gg.clone()
                ref.step()
            ref.zero_grad(set_to_none=True)
        want[name] = ps[0].detach() if full.ndim == 2 else torch.stack([p.detach() for p in ps])
    params = sharded_params(fulls, mesh((2,)), ALL_ROWS)
    opt = canzona.Muon(params, **KW, plan=plan(capacity_mb=1e-4))
    allocated = []
    for g in grads:
        set_grads([(n, p) for n, p in params if n in g], g)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pipelines = opt._runtime._pipelines.values()  # type: ignore[attr-defined]
        allocated.append(
            sorted(
                sum(b.tensor.untyped_storage().nbytes() > 0 for b in p.schedule.buffers)
                for p in pipelines
            )
        )
    got = {n: full_of(p) for n, p in params}
    return {"same": compare(got, want), "allocated": allocated}


def test_kept_buffers_belong_to_one_schedule_at_a_time(dist: Any) -> None:
    """A parameter without a gradient on every other step gives two cached schedules; with
    the buffers kept between steps (the CPU default) only the last step's are allocated,
    and the results are torch.optim.Muon's with the same missing gradients, bit for bit.

    Catches: every cached schedule holding its buffers (memory growing with the number of
    gradient patterns), the step's own schedule left without its buffers.
    """
    for out in dist(2).run(_alternating_grads_case):
        assert all(eq for eq, _ in out["same"].values()), out["same"]
        first, *rest = out["allocated"]
        assert first[0] > 0 and len(first) == 1, out["allocated"]  # one schedule so far
        for held in rest:  # two schedules: one with every buffer, the other with none
            assert len(held) == 2 and held[0] == 0 and held[1] > 0, out["allocated"]


def test_a_retired_schedule_keeps_its_buffers_when_another_schedule_runs() -> None:
    """A retired pipeline (a step raised while its collectives were in flight) is never
    freed by a later step that runs another schedule (another set of parameters with
    gradients), even though kept buffers of other schedules are freed.

    Catches: the free of the other cached schedules reaching a retired one, whose buffers a
    collective of the failed step may still read or write.
    """
    gen = torch.Generator().manual_seed(0)
    params = [(f"w{i}", torch.nn.Parameter(torch.randn(8, 8, generator=gen))) for i in range(3)]
    opt = canzona.Muon(params, **KW)
    for _, p in params:
        p.grad = torch.ones(8, 8)
    opt.step()
    (first,) = opt._runtime._pipelines.values()  # type: ignore[attr-defined]
    first.retired = True  # as the engine marks it when a step raises with collectives in flight
    params[0][1].grad = None
    opt.step()
    assert len(opt._runtime._pipelines) == 2  # type: ignore[attr-defined]
    assert all(b.tensor.untyped_storage().nbytes() > 0 for b in first.schedule.buffers)


def _permuted_mesh() -> dict[str, bool]:
    """A 2x2 mesh whose ranks are not in row-major order: [[0, 2], [1, 3]]."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    shapes = {"square": (16, 16), "tall": (24, 8), "wide": (8, 24)}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    want = reference_muon(fulls, grads, lr=0.02, weight_decay=0.1, momentum=0.9)
    dm = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("a", "b"))
    row, col = dm.get_coordinate()  # type: ignore[misc]

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(2, 0)[row].chunk(2, 1)[col].clone()

    placements = [Shard(0), Shard(1)]
    params = [
        (n, torch.nn.Parameter(DTensor.from_local(local(t), dm, placements, run_check=False)))
        for n, t in fulls.items()
    ]
    opt = canzona.Muon([p for _, p in params], lr=0.02, weight_decay=0.1, momentum=0.9)
    for g in grads:
        for n, p in params:
            p.grad = DTensor.from_local(local(g[n]), dm, placements, run_check=False)
        opt.step()
    return {n: torch.equal(p.to_local(), local(want[n])) for n, p in params}


def test_a_mesh_of_permuted_ranks(dist: Any) -> None:
    """Catches: the layout reading a mesh's ranks in sorted order instead of their places
    (a mesh ``[[0, 2], [1, 3]]`` taken for ``[[0, 1], [2, 3]]``): every matrix assembled from
    the wrong ranks' shards. Bitwise ``torch.optim.Muon``."""
    for out in dist(4).run(_permuted_mesh):
        assert all(out.values()), out
