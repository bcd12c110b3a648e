"""Helpers of the distributed optimizer tests: sharded params, identical grads, references."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import canzona

SHAPES: dict[str, tuple[int, ...]] = {
    "square": (16, 16),
    "tall": (24, 8),
    "wide": (8, 24),
    "odd": (7, 13),
    "tiny": (5, 3),
    "stack": (3, 6, 10),
}
#: Two of each test shape: at world 4 too, every owner gets matrices in several micro-groups.
SHAPES_TWICE = {**SHAPES, **{f"{n}_again": s for n, s in SHAPES.items()}}
#: Capacity in MiB: one matrix per owner and micro-group, many micro-groups.
TINY_MB = 1e-4
#: The calibration tests' matrices: three distinct shapes, one of them twice.
CALIBRATION_SHAPES: dict[str, tuple[int, ...]] = {
    "a": (16, 16), "b": (16, 16), "c": (24, 8), "d": (8, 24),
}  # fmt: skip


def full_tensors(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic full parameters (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def grad_steps(
    shapes: dict[str, tuple[int, ...]], steps: int, seed: int = 1
) -> list[dict[str, torch.Tensor]]:
    """Deterministic full gradients for ``steps`` steps."""
    gen = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(steps)]


def placements_for(kind: str, ndim: int) -> tuple[Placement, ...]:
    """Placements by name for 1-D and 2-D meshes."""
    last = ndim - 1
    table: dict[str, tuple[Placement, ...]] = {
        "row": (Shard(0),),
        "col": (Shard(last),),
        "lead": (Shard(0),),
        "rep": (Replicate(),),
        "2d": (Shard(0), Shard(last)),
        "2d_rows": (Shard(0), Shard(0)),
        "hsdp": (Replicate(), Shard(0)),
        "hsdp_col": (Replicate(), Shard(last)),
    }
    return table[kind]


def sharded_params(
    fulls: dict[str, torch.Tensor], mesh: Any, placements: dict[str, tuple[Placement, ...]]
) -> list[tuple[str, nn.Parameter]]:
    """Named DTensor parameters (``mesh`` may differ per parameter: pass a dict)."""
    out = []
    for name, full in fulls.items():
        m = mesh[name] if isinstance(mesh, dict) else mesh
        out.append((name, nn.Parameter(distribute_tensor(full.clone(), m, placements[name]))))
    return out


def set_grads(params: Sequence[tuple[str, torch.Tensor]], grads: dict[str, torch.Tensor]) -> None:
    """Give each parameter the gradient ``grads[name]`` in the parameter's own layout."""
    for name, p in params:
        g = grads[name].clone()
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        else:
            p.grad = g


def full_of(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a plain full tensor."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()


def local_pieces(
    params: Sequence[tuple[str, torch.Tensor]], opt: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """This rank's pieces of the parameters and of every ``optimizer.state`` tensor, copied."""

    def own(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"param {n}": own(p) for n, p in params}
    for n, p in params:
        for key, value in opt.state.get(p, {}).items():
            out[f"state {n} {key}"] = own(value)
    return out


def run_steps(
    make: Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer],
    params: list[tuple[str, nn.Parameter]],
    grads: list[dict[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """Run one optimizer step per entry of ``grads``; return the full parameters."""
    opt = make(params)
    for g in grads:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: full_of(p) for n, p in params}


def reference_muon(
    fulls: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], **kwargs: Any
) -> dict[str, torch.Tensor]:
    """``torch.optim.Muon`` on plain tensors, one matrix at a time (3-D stacks per matrix)."""
    out: dict[str, torch.Tensor] = {}
    for name, full in fulls.items():
        mats = [full.clone()] if full.ndim == 2 else [m.clone() for m in full]
        ps = [nn.Parameter(m) for m in mats]
        opt = torch.optim.Muon(ps, **kwargs)
        for g in grads:
            gs = [g[name]] if full.ndim == 2 else list(g[name])
            for p, gg in zip(ps, gs, strict=True):
                p.grad = gg.clone()
            opt.step()
        out[name] = ps[0].detach() if full.ndim == 2 else torch.stack([p.detach() for p in ps])
    return out


def local_optimizer(
    cls: type[torch.optim.Optimizer],
    fulls: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    **kwargs: Any,
) -> dict[str, torch.Tensor]:
    """A canzona optimizer on plain tensors (single device)."""
    params = [(n, nn.Parameter(t.clone())) for n, t in fulls.items()]
    return run_steps(lambda ps: cls(ps, **kwargs), params, grads)


def compare(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, tuple[bool, float]]:
    """Per parameter: (bitwise equal, max relative difference)."""
    out = {}
    for name, w in want.items():
        g = got[name]
        rel = ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() if w.numel() else 0.0
        out[name] = (bool(torch.equal(g, w)), rel)
    return out


def strategies() -> tuple[str, ...]:
    """Every planning strategy the runtime executes."""
    return ("canzona", "replicated", "round_robin", "count", "numel")


def plan(strategy: str = "canzona", **kw: Any) -> canzona.PlanConfig:
    """A PlanConfig."""
    return canzona.PlanConfig(strategy=strategy, **kw)


#: Hyper-parameters of the optimizers with owner-held state in the state tests.
OWNER_KW: dict[str, dict[str, Any]] = {
    "Shampoo": {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2},
    "SOAP": {"lr": 0.01, "precondition_frequency": 2},
    "NorMuon": {"lr": 0.02, "beta2": 0.9, "ns_dtype": torch.float32},
}


def run_with_late_group(
    params: list[tuple[str, torch.Tensor]],
    grads: Sequence[dict[str, torch.Tensor]],
    first: int,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """Shampoo over ``params[:first]``; the rest joins by ``add_param_group`` at step 2.

    Returns every parameter's full value after the steps.
    """
    opt = canzona.Shampoo(params[:first], **kw)
    for step, g in enumerate(grads):
        if step == 2:
            opt.add_param_group({"params": params[first:]})
        set_grads(params if step >= 2 else params[:first], g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: full_of(p) for n, p in params}


def first_step_mismatch(
    opt: torch.optim.Optimizer,
    params: Sequence[tuple[str, torch.Tensor]],
    shapes: dict[str, tuple[int, ...]],
) -> str:
    """One step; ``"PlanMismatchError"`` when the ranks' plans disagree, else ``"no error"``."""
    set_grads(params, grad_steps(shapes, 1)[0])
    try:
        opt.step()
    except canzona.PlanMismatchError as exc:
        return type(exc).__name__
    return "no error"


def assert_bitwise(per_rank: Sequence[dict[str, Any]], reference: str) -> None:
    """Every rank's ``{case: compare(...)}`` is bitwise; the failure names the ``reference``."""
    for rank, results in enumerate(per_rank):
        for case, comp in results.items():
            bad = {n: rel for n, (eq, rel) in comp.items() if not eq}
            assert not bad, f"rank {rank}, {case}: {reference}: {bad}"


class ThreeLinears(nn.Module):
    """``up`` (no bias), ``down`` (bias) and ``head`` (no bias), ReLUs between them."""

    def __init__(self, width: int, hidden: int, out: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=True)
        self.head = nn.Linear(width, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.down(torch.relu(self.up(x)))))
        return out


def three_linears(layout: str, width: int, hidden: int, out: int) -> nn.Module:
    """A seeded :class:`ThreeLinears` in ``layout``: ``plain``, ``fsdp`` over every rank, or
    ``fsdp_tp`` on a (2, 2) ``(dp, tp)`` mesh (up/down tensor parallel, head on dp only)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from _dist import mesh

    torch.manual_seed(0)
    model = ThreeLinears(width, hidden, out)
    if layout == "fsdp_tp":
        dm = mesh((2, 2), ("dp", "tp"))
        parallelize_module(model, dm["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=dm["dp"])
    elif layout == "fsdp":
        fully_shard(model, mesh=mesh((torch.distributed.get_world_size(),), ("dp",)))
    return model


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched inside the mode, by ``key(op)`` (default: its name).

    ``key=lambda op: str(op.overloadpacket)`` counts ops without their overload.
    """

    def __init__(self, key: Callable[[Any], str] = str) -> None:
        super().__init__()
        self.key = key
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[self.key(func)] += 1
        return func(*args, **(kwargs or {}))
