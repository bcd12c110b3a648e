"""Optimizer state across plans, layouts and checkpoints, on real gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

import canzona

from _cases import (
    OWNER_KW,
    SHAPES,
    compare,
    full_of,
    full_tensors,
    grad_steps,
    run_with_late_group,
    set_grads,
    sharded_params,
)
from _dist import mesh

TIMEOUT = 60


def _layout(kind: str) -> tuple[dict[str, tuple[int, ...]], Any, dict[str, Any]]:
    if kind == "hsdp":  # replicate x shard, each replica group computing on its own
        shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"], "stack": SHAPES["stack"]}
        pl = {"square": (Replicate(), Shard(0)), "odd": (Replicate(), Shard(1))}
        pl["stack"] = (Replicate(), Shard(0))
        return shapes, mesh((2, 2)), pl
    if kind == "shard_x_replicate":  # replicated on the second mesh dim
        shapes = {"square": SHAPES["square"], "odd": SHAPES["odd"], "stack": SHAPES["stack"]}
        pl = {"square": (Shard(0), Replicate()), "odd": (Shard(1), Replicate())}
        pl["stack"] = (Shard(2), Replicate())
        return shapes, mesh((2, 2)), pl
    if kind == "experts":  # 3 experts over 4 ranks: one rank holds none
        shapes = {"stack": SHAPES["stack"], "tiny": SHAPES["tiny"]}
        return shapes, mesh((4,)), {"stack": (Shard(0),), "tiny": (Shard(0),)}
    if kind == "experts_uneven":  # 11 experts over 4 ranks: 3, 3, 3 and 2, the last
        # rank's at positions 0 and 1 of its shard while 9 % 2 == 1
        shapes = {"stack": (11, 4, 6), "square": SHAPES["square"]}
        return shapes, mesh((4,)), {"stack": (Shard(0),), "square": (Shard(1),)}
    if kind == "experts2d":  # 3 experts split over both dims of a 2x2 mesh, or by columns
        shapes = {"stack": SHAPES["stack"], "wide_stack": (5, 4, 9)}
        pl = {"stack": (Shard(0), Shard(0)), "wide_stack": (Shard(0), Shard(2))}
        return shapes, mesh((2, 2)), pl
    if kind in ("split", "float64"):  # fused blocks across shard boundaries; float64 state
        shapes = {"qkv": (20, 12), "square": SHAPES["square"]}
        return shapes, mesh((4,)), {"qkv": (Shard(0),), "square": (Shard(1),)}
    if kind == "submeshes":  # one 2-D mesh and two 1-D sub-meshes with two copies each
        shapes = {"square": SHAPES["square"], "wide": SHAPES["wide"], "odd": SHAPES["odd"]}
        dm = mesh((2, 2), ("dp", "tp"))
        meshes = {"square": dm, "wide": dm["dp"], "odd": dm["tp"]}
        pl = {"square": (Shard(0), Shard(1)), "wide": (Shard(1),), "odd": (Shard(0),)}
        return shapes, meshes, pl
    raise ValueError(kind)


def _resume_in_memory(
    kind: str, name: str, save_cfg: dict[str, Any], load_cfg: dict[str, Any]
) -> dict[str, bool]:
    """Save after 3 steps, load into a new optimizer (maybe another PlanConfig), run 2 more."""
    cls = getattr(canzona, name)
    shapes, meshes, placements = _layout(kind)
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 5)
    if kind == "float64":
        fulls = {n: t.double() for n, t in fulls.items()}
        grads = [{n: t.double() for n, t in g.items()} for g in grads]

    def groups(ps: list[tuple[str, nn.Parameter]]) -> Any:
        """With ``split``: q, k, v of 8, 4 and 8 rows, each a matrix of its own."""
        if kind != "split":
            return ps
        qkv = canzona.Split(dim=0, sizes=(8, 4, 8))
        return [{"params": ps[:1], "split": qkv}, {"params": ps[1:]}]

    want = {}
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    ref = cls(groups(params), **OWNER_KW[name])
    for g in grads:
        set_grads(params, g)
        ref.step()
        ref.zero_grad(set_to_none=True)
    want = {n: full_of(p) for n, p in params}

    params = sharded_params(fulls, meshes, placements)
    opt = cls(groups(params), **OWNER_KW[name], plan=canzona.PlanConfig(**save_cfg))
    for g in grads[:3]:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sd = opt.state_dict()
    opt2 = cls(groups(params), **OWNER_KW[name], plan=canzona.PlanConfig(**load_cfg))
    opt2.load_state_dict(sd)
    for g in grads[3:]:
        set_grads(params, g)
        opt2.step()
        opt2.zero_grad(set_to_none=True)
    got = {n: full_of(p) for n, p in params}
    return {n: eq for n, (eq, _) in compare(got, want).items()}


RESUME_CASES = [
    ("hsdp", {"replica_dedup": False}, {"replica_dedup": False}),
    ("hsdp", {"replica_dedup": False}, {"replica_dedup": True}),
    ("hsdp", {"replica_dedup": True}, {"replica_dedup": False}),
    ("shard_x_replicate", {"replica_dedup": False}, {"replica_dedup": True}),
    ("shard_x_replicate", {"strategy": "replicated"}, {"replica_dedup": False}),
    ("experts", {}, {"strategy": "round_robin"}),
    ("experts", {"strategy": "replicated"}, {}),
    ("experts2d", {"replica_dedup": False}, {"strategy": "numel"}),
    ("experts_uneven", {}, {"strategy": "round_robin"}),
    ("submeshes", {}, {"strategy": "count"}),
    ("split", {}, {"strategy": "round_robin"}),
    ("float64", {"strategy": "replicated"}, {}),
]


@pytest.mark.parametrize("name", ["Shampoo", "SOAP", "NorMuon"])
@pytest.mark.parametrize(("kind", "save_cfg", "load_cfg"), RESUME_CASES)
def test_state_dict_round_trip_across_plans(
    dist: Any, name: str, kind: str, save_cfg: dict[str, Any], load_cfg: dict[str, Any]
) -> None:
    """Owner state survives state_dict -> load_state_dict into other plans, on every layout:
    the continued run equals one device, bit for bit. Catches: owner-held state moved to the
    wrong owner, rows or matrices of a stack (or lost, and recreated fresh), replicas that
    load different copies."""
    for out in dist(4).run(_resume_in_memory, kind, name, save_cfg, load_cfg, timeout=TIMEOUT):
        assert all(out.values()), out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 20, bias=False)
        self.down = nn.Linear(20, 12, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _dcp_model(layout: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    if layout == "hsdp":
        fully_shard(model, mesh=mesh((2, 2), ("replicate", "shard")))
    elif layout == "fsdp":
        fully_shard(model, mesh=mesh((4,), ("dp",)))
    return model


def _dcp_train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    params = list(model.named_parameters())
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params}
        set_grads(params, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dcp_hsdp_per_replica_to_fsdp(path: str, name: str) -> dict[str, bool]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    cls = getattr(canzona, name)

    def make(model: nn.Module, dedup: bool) -> torch.optim.Optimizer:
        plan = canzona.PlanConfig(replica_dedup=dedup)
        return cls(canzona.param_groups(model), **OWNER_KW[name], plan=plan)

    plain = _dcp_model("plain")
    _dcp_train(plain, make(plain, True), range(5))
    want = {n: p.detach().clone() for n, p in plain.named_parameters()}

    model = _dcp_model("hsdp")
    opt = make(model, False)
    _dcp_train(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    model = _dcp_model("fsdp")
    opt = make(model, True)
    model_sd, optim_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _dcp_train(model, opt, range(3, 5))
    got = {n: full_of(p) for n, p in model.named_parameters()}
    return {n: eq for n, (eq, _) in compare(got, want).items()}


@pytest.mark.parametrize("name", ["Shampoo", "SOAP", "NorMuon"])
def test_dcp_from_per_replica_hsdp_to_fsdp(dist: Any, tmp_path: Any, name: str) -> None:
    """replica_dedup=False saves Replicate on the replicate dim; DCP reshards it to FSDP."""
    path = str(tmp_path / "ckpt")
    for out in dist(4).run(_dcp_hsdp_per_replica_to_fsdp, path, name, timeout=TIMEOUT):
        assert all(out.values()), out


def _local_then_distributed() -> dict[str, bool]:
    """Shampoo over a plain tensor, then a DTensor group is added: the job becomes distributed."""
    shapes = {"plain": (8, 8), "sharded": (16, 16)}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 4)
    kw = {"lr": 0.01, "precondition_frequency": 1, "start_preconditioning_step": 1}

    def run(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
        return run_with_late_group(params, grads, 1, **kw)

    want = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()])
    sharded = sharded_params({"sharded": fulls["sharded"]}, mesh((2,)), {"sharded": (Shard(0),)})
    got = run([("plain", nn.Parameter(fulls["plain"].clone())), *sharded])
    return {n: eq for n, (eq, _) in compare(got, want).items()}


def test_owner_state_survives_a_replan_that_makes_the_job_distributed(dist: Any) -> None:
    for out in dist(2).run(_local_then_distributed, timeout=TIMEOUT):
        assert all(out.values()), out


def _shard_of(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """``Shard(dim)``'s piece of ``full`` on ``rank``: ``torch.chunk``'s, empty past the end."""
    pieces = full.chunk(world, dim)
    return pieces[rank] if rank < len(pieces) else full.narrow(dim, full.size(dim), 0)


def _plain_storage_state_into_dtensors() -> dict[str, Any]:
    """A one-process Muon state dict (plain momentum) loaded into the sharded optimizer."""
    import copy

    # shards of 2, 2, 2, 1 rows and of 3, 3, 3, 0 columns
    shapes: dict[str, tuple[int, ...]] = {"rows": (7, 6), "cols": (5, 9)}
    dims = {"rows": 0, "cols": 1}
    placements: dict[str, tuple[Placement, ...]] = {n: (Shard(d),) for n, d in dims.items()}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 3)
    kw: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "ns_dtype": torch.float32}
    local = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    ref = canzona.Muon(local, **kw)
    set_grads(local, grads[0])
    ref.step()
    sd = copy.deepcopy(ref.state_dict())
    params = sharded_params({n: full_of(p) for n, p in local}, mesh((4,)), placements)
    opt = canzona.Muon(params, **kw)
    saved = [sd["state"][pid]["momentum_buffer"] for pid in range(len(params))]
    whole: list[tuple[int, ...]] = []  # saved tensors moved (to the device) whole
    to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if type(self) is torch.Tensor and any(
            self.data_ptr() == s.data_ptr() and self.numel() == s.numel() for s in saved
        ):
            whole.append(tuple(self.shape))
        return to(self, *args, **kwargs)

    torch.Tensor.to = spy  # type: ignore[method-assign]
    try:
        opt.load_state_dict(sd)
    finally:
        torch.Tensor.to = to  # type: ignore[method-assign]
    rank = tdist.get_rank()
    kept = {}
    for pid, (name, p) in enumerate(params):
        buf = opt.state[p]["momentum_buffer"]
        full = sd["state"][pid]["momentum_buffer"]
        dim = dims[name]
        kept[name] = {
            "dtensor": isinstance(buf, DTensor),
            "placements": tuple(buf.placements) == placements[name],
            "slice": bool(torch.equal(buf.to_local(), _shard_of(full, dim, rank, 4))),
        }
    for g in grads[1:]:
        set_grads(local, g)
        ref.step()
        set_grads(params, g)
        opt.step()
    return {
        "kept": kept,
        "moved_whole": whole,
        "continued": {
            n: bool(torch.equal(full_of(p), full_of(q)))
            for (n, p), (_, q) in zip(params, local, strict=True)
        },
    }


def test_plain_storage_state_for_dtensor_params_is_sharded(dist: Any) -> None:
    """A consolidated checkpoint (element-wise state as plain full tensors) loads into
    DTensor parameters: each rank keeps its slice, as a DTensor in the parameter's
    placements, and the run continues exactly as the one-process run it came from.

    Catches: a load that refuses plain tensors, keeps the full tensor on every rank, cuts
    the wrong slice (uneven row and column shards), loses the placements, or moves the
    whole tensor to the parameters' device before it cuts the slice (on a GPU, every rank
    would hold a copy of every full tensor while it loads).
    """
    for o in dist(4).run(_plain_storage_state_into_dtensors, timeout=TIMEOUT):
        assert o["moved_whole"] == [], o
        for name in ("rows", "cols"):
            assert o["kept"][name] == {"dtensor": True, "placements": True, "slice": True}, o
        assert o["continued"] == {"rows": True, "cols": True}, o


def _regrouped_on_a_mesh(cls_name: str, edit: str) -> dict[str, bool]:
    """Groups [a, b, c], [d] (a, d (16, 16), b (24, 8), c (8, 24)) on 2 ranks; before step 3
    ``edit`` reverses the first group or drops ``b`` from it. The reference: one process,
    the groups unedited, ``b`` without gradients from step 3 when it is dropped."""
    shapes = {"a": (16, 16), "b": (24, 8), "c": (8, 24), "d": (16, 16)}
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 5)
    cls = getattr(canzona, cls_name)

    def run(params: list[tuple[str, nn.Parameter]], edited: bool) -> dict[str, torch.Tensor]:
        named = dict(params)
        opt = cls([{"params": params[:3]}, {"params": params[3:]}], **OWNER_KW[cls_name])
        frozen: set[str] = set()
        for step, g in enumerate(grads):
            if step == 3 and edit == "drop":
                frozen = {"b"}
                if edited:
                    group = opt.param_groups[0]
                    keep = [i for i, n in enumerate(group["param_names"]) if n != "b"]
                    group["params"] = [group["params"][i] for i in keep]
                    group["param_names"] = [group["param_names"][i] for i in keep]
            elif step == 3 and edited:
                opt.param_groups[0]["params"].reverse()
                opt.param_groups[0]["param_names"].reverse()
            set_grads([(n, p) for n, p in params if n not in frozen], g)
            for n in frozen:
                named[n].grad = None
            opt.step()
        return {n: full_of(p) for n, p in params}

    want = run([(n, nn.Parameter(t.clone())) for n, t in fulls.items()], edited=False)
    sharded = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in shapes})
    got = run(sharded, edited=True)
    return {n: eq for n, (eq, _) in compare(got, want).items()}


@pytest.mark.parametrize("edit", ["reverse", "drop"])
@pytest.mark.parametrize("cls_name", list(OWNER_KW))
def test_param_groups_edited_between_steps_on_a_mesh(dist: Any, cls_name: str, edit: str) -> None:
    """Catches: owner-held state moved by position after the edit (the state of the matrix
    that was at a position given to the one now there: silently wrong, or a shape error on
    its owner while the other rank waited in the state exchange)."""
    for out in dist(2).run(_regrouped_on_a_mesh, cls_name, edit, timeout=TIMEOUT):
        assert out == dict.fromkeys(out, True), out


def _replaced_local_tensors(how: str) -> dict[str, bool]:
    """Muon and AdamW-routed DTensor parameters whose local tensors are replaced after the
    first step, as FSDP2's re-padding (``reset_sharded_param``) or ``swap_tensors`` do."""
    shapes = {"w": (6, 4), "b": (5,)}
    fulls, grads = full_tensors(shapes), grad_steps(shapes, 3)
    runs = []
    for replace in (False, True):
        params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in shapes})
        groups = [{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}]
        opt = canzona.Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
        for i, step in enumerate(grads):
            if replace and i == 1:
                for _, p in params:
                    if how == "local_tensor":
                        p._local_tensor = p._local_tensor.clone()
                    else:
                        torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))
            set_grads(params, step)
            opt.step()
        runs.append({n: full_of(p) for n, p in params})
    return {n: torch.equal(runs[1][n], runs[0][n]) for n in fulls}


@pytest.mark.parametrize("how", ["local_tensor", "swap_tensors"])
def test_replaced_local_tensors_are_the_ones_the_step_updates(dist: Any, how: str) -> None:
    """Bitwise the run without the replacement. Catches: the AdamW route's local tensors
    kept from the first step (the replaced bias was never updated again)."""
    for out in dist(2).run(_replaced_local_tensors, how, timeout=TIMEOUT):
        assert out == {"w": True, "b": True}, out
