"""Experts under expert parallelism: owners where the data already is, exact per expert."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

import canzona

from _cases import compare, full_tensors, grad_steps, reference_muon, set_grads, sharded_params
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9, "ns_dtype": torch.float32}
REF_KW = {k: v for k, v in KW.items() if k != "ns_dtype"}


def _experts_case(
    mesh_shape: tuple[int, ...],
    placements: dict[str, tuple[Placement, ...]],
    shapes: dict[str, tuple[int, ...]],
    defaults: bool = False,
    dedup: bool = True,
) -> dict[str, Any]:
    """Two steps of canzona.Muon: bytes sent per step, bitwise equality per parameter, and
    the bytes of one step of an optimizer over the ``experts`` stack alone (when there is one).

    ``defaults``: canzona.Muon() against torch.optim.Muon() per expert; else ``KW`` (fp32
    Newton–Schulz) against canzona.Muon on one device.
    """
    fulls = full_tensors(shapes)
    grads = grad_steps(shapes, 2)
    params = sharded_params(fulls, mesh(mesh_shape), placements)
    plan = canzona.PlanConfig(replica_dedup=dedup)
    opt = canzona.Muon(params, plan=plan) if defaults else canzona.Muon(params, **KW, plan=plan)
    sent = []
    for g in grads:
        set_grads(params, g)
        opt.step()
        assert opt.last_step_stats is not None
        sent.append(opt.last_step_stats.bytes_sent)
    got = {n: p.full_tensor() for n, p in params}
    # fp32 Newton–Schulz on both sides: torch.optim.Muon's op sequence in float32
    want = reference_muon(fulls, grads) if defaults else _reference(fulls, grads)
    alone = None
    experts = [(n, p) for n, p in params if n == "experts"]
    if experts and len(experts) < len(params):  # the expert stack's own bytes
        solo = canzona.Muon(experts, **KW, plan=plan)
        set_grads(experts, grads[0])
        solo.step()
        assert solo.last_step_stats is not None
        alone = solo.last_step_stats.bytes_sent
    same = {n: eq for n, (eq, _) in compare(got, want).items()}
    return {"sent": sent, "same": same, "experts_alone": alone}


def _reference(fulls: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]]) -> Any:
    params = [(n, torch.nn.Parameter(t.clone())) for n, t in fulls.items()]
    opt = canzona.Muon(params, **KW)  # one device: canzona.Muon is torch.optim.Muon's update
    for g in grads:
        set_grads(params, g)
        opt.step()
    return {n: p.detach() for n, p in params}


def test_expert_stack_sharded_over_experts_moves_no_bytes(dist: Any) -> None:
    """Equal experts per rank: each expert is owned where it lies (0 bytes sent)."""
    shapes = {"experts": (8, 64, 32)}
    for out in dist(2).run(_experts_case, (2,), {"experts": (Shard(0),)}, shapes):
        assert out["sent"] == [0, 0]
        assert out["same"] == {"experts": True}


def test_expert_stack_with_defaults_moves_no_bytes_and_is_torch_muon_per_expert(
    dist: Any,
) -> None:
    """The requirement as stated: default canzona.Muon (bf16 Newton–Schulz, default plan),
    an (8, 64, 32) stack Shard(0) over the experts on (2,): 0 bytes, and bitwise
    torch.optim.Muon() with every expert a separate 2-D parameter.

    Catches: experts not pinned to their holders under the default (measured-cost) plan, and
    a default hyper-parameter (ns_dtype, momentum, lr, ...) that differs from torch's."""
    shapes = {"experts": (8, 64, 32)}
    pl = {"experts": (Shard(0),)}
    for out in dist(2).run(_experts_case, (2,), pl, shapes, defaults=True):
        assert out["sent"] == [0, 0]
        assert out["same"] == {"experts": True}


@pytest.mark.parametrize(
    "placements",
    [(Shard(0), Shard(0)), (Shard(0), Shard(1))],
    ids=["ep_then_fsdp_experts", "ep_then_fsdp_rows"],
)
def test_expert_parallel_on_a_2d_mesh(dist: Any, placements: tuple[Placement, ...]) -> None:
    """(ep, dp) mesh: experts over ep; FSDP over dp shards experts (whole experts per rank,
    no bytes for them) or rows (no rank holds an expert: balanced as usual)."""
    shapes = {"experts": (8, 16, 12), "shared": (16, 12)}
    pl = {"experts": placements, "shared": (Shard(0), Shard(1))}
    whole = placements == (Shard(0), Shard(0))
    for out in dist(4).run(_experts_case, (2, 2), pl, shapes):
        assert out["same"] == {"experts": True, "shared": True}
        # catches: experts of a 2-D mesh not recognised as held (they would travel)
        if whole:
            assert out["experts_alone"] == 0, out
        else:  # the check can fail: row-sharded experts must travel
            assert out["experts_alone"] > 0, out


@pytest.mark.parametrize("dedup", [True, False], ids=["dedup", "no_dedup"])
def test_experts_replicated_over_dp_travel_only_between_their_holders(
    dist: Any, dedup: bool
) -> None:
    """(ep, dp) mesh, experts ``(Shard(0), Replicate())``: each expert is whole on both
    ranks of its ep row. With ``replica_dedup`` (the default) one holder computes it and
    sends its update to the other (as docs/torchtitan.md says); without, each holder
    updates its own copy and nothing travels. Catches: the docs' zero bytes claimed for
    the default, and experts of replicated stacks leaving their ep row."""
    shapes = {"experts": (4, 16, 12), "shared": (16, 12)}
    pl = {"experts": (Shard(0), Replicate()), "shared": (Shard(0), Shard(1))}
    update = 16 * 12 * 4  # one fp32 expert's direction (KW: fp32 Newton-Schulz)
    for out in dist(4).run(_experts_case, (2, 2), pl, shapes, dedup=dedup):
        assert out["same"] == {"experts": True, "shared": True}
        assert out["experts_alone"] == (update if dedup else 0), out


@pytest.mark.parametrize(
    ("mesh_shape", "placements"),
    [
        ((2,), (_StridedShard(0, split_factor=2),)),
        ((2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
    ],
    ids=["strided_experts", "fsdp_over_ep"],
)
def test_experts_in_strided_runs_are_owned_where_they_lie(
    dist: Any, mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]
) -> None:
    """Experts over the leading dim in strided runs: on (2,) each rank holds experts 0-1 and
    4-5, or 2-3 and 6-7 (two runs); on (dp_shard, ep), FSDP2 over expert parallel, each rank
    two whole experts. Every expert is owned where it lies (0 bytes) and bitwise.

    Catches: an expert's place in a local stack of several runs taken within its run."""
    shapes = {"experts": (8, 16, 12)}
    for out in dist(math.prod(mesh_shape)).run(
        _experts_case, mesh_shape, {"experts": placements}, shapes
    ):
        assert out["sent"] == [0, 0]
        assert out["same"] == {"experts": True}


def test_single_device_reference_is_torch_muon_per_expert() -> None:
    """The reference of this module: canzona.Muon on one device is torch.optim.Muon per expert."""
    shapes = {"experts": (4, 6, 5)}
    fulls, grads = full_tensors(shapes), grad_steps(shapes, 2)
    want = reference_muon(fulls, grads, **REF_KW)
    kw = {**KW, "ns_dtype": torch.bfloat16}
    params = [(n, torch.nn.Parameter(t.clone())) for n, t in fulls.items()]
    opt = canzona.Muon(params, **kw)
    for g in grads:
        set_grads(params, g)
        opt.step()
    assert torch.equal(params[0][1].detach(), want["experts"])


def _bf16_experts(world: int) -> dict[str, bool]:
    """bf16 expert stacks, whole experts per rank, against torch.optim.Muon per expert."""
    shapes = {"experts": (4, 4, 6), "wide": (2, 6, 10)}  # 24 and 60 elements per expert
    fulls = {n: t.bfloat16() for n, t in full_tensors(shapes).items()}
    grads = [{n: t.bfloat16() for n, t in g.items()} for g in grad_steps(shapes, 3)]
    want = reference_muon(fulls, grads, **REF_KW)
    if world == 1:
        params = [(n, torch.nn.Parameter(t.clone())) for n, t in fulls.items()]
    else:
        params = sharded_params(fulls, mesh((world,)), {n: (Shard(0),) for n in shapes})
    opt = canzona.Muon(params, **{**KW, "ns_dtype": torch.bfloat16})
    for g in grads:
        set_grads(params, g)
        opt.step()
    got = {n: p.full_tensor() if world > 1 else p.detach() for n, p in params}
    return {n: eq for n, (eq, _) in compare(got, want).items()}


def test_bf16_expert_stacks_equal_torch_muon_per_expert(dist: Any) -> None:
    """Catches: a half-precision stack updated whole. CPU element-wise kernels round a bf16
    element by its place in the tensor they are given (vector body or scalar tail), so the
    stack's apply differed from torch.optim.Muon's on each expert alone, on one device and
    under expert parallelism (momentum and Newton–Schulz equal, only the parameters apart)."""
    assert _bf16_experts(1) == {"experts": True, "wide": True}
    for out in dist(2).run(_bf16_experts, 2):
        assert out == {"experts": True, "wide": True}
