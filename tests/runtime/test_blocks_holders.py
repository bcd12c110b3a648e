"""Owners where the data already is, beyond experts: a head block inside one tensor-parallel
rank's rows, and a matrix that row sharding leaves whole on one rank (default plan: 0 bytes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona import Split

from _cases import full_tensors, grad_steps, reference_muon, set_grads, sharded_params
from _dist import mesh

HEAD = 4  # rows per head of ``q``; 16 rows on 2 tensor-parallel ranks: heads 0, 1 | 2, 3


def _reference_heads(full: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """torch.optim.Muon (defaults) with each head of ``full`` a separate 2-D parameter."""
    heads = [nn.Parameter(h.clone()) for h in full.split(HEAD)]
    opt = torch.optim.Muon(heads)
    for g in grads:
        for p, gh in zip(heads, g.split(HEAD), strict=True):
            p.grad = gh.clone()
        opt.step()
    return torch.cat([p.detach() for p in heads])


def _holders_case(name: str, shape: tuple[int, ...], split: Split | None) -> dict[str, Any]:
    """One parameter ``Shard(0)`` on a (2,) mesh, default canzona.Muon: bytes and result."""
    shapes = {name: shape}
    fulls, grads = full_tensors(shapes), grad_steps(shapes, 2)
    params = sharded_params(fulls, mesh((2,)), {name: (Shard(0),)})
    group: dict[str, Any] = {"params": params}
    if split is not None:
        group["split"] = split
    opt = canzona.Muon([group])
    sent, computed = [], []
    for g in grads:
        set_grads(params, g)
        opt.step()
        assert opt.last_step_stats is not None
        sent.append(opt.last_step_stats.bytes_sent)
        computed.append(opt.last_step_stats.matrices_computed)
    plan = opt._runtime.plan
    owners = dict(plan.assignment.owner) if plan is not None else {}
    got = params[0][1].full_tensor()
    if split is not None:
        want = _reference_heads(fulls[name], [g[name] for g in grads])
    else:
        want = reference_muon(fulls, grads)[name]
    return {"sent": sent, "computed": computed, "owners": owners, "same": torch.equal(got, want)}


def test_heads_inside_one_tensor_parallel_rank_move_no_bytes(dist: Any) -> None:
    """Catches: holders not found for blocks (a head inside one rank's rows is then balanced
    like any matrix and travels), or a block span read against the wrong shard offset."""
    out = dist(2).run(_holders_case, "q", (16, 12), Split(dim=0, size=HEAD))
    for rank, res in enumerate(out):
        assert res["sent"] == [0, 0], (rank, res)
        assert res["computed"] == [2, 2], (rank, res)
        assert res["owners"] == {"q#0": 0, "q#1": 0, "q#2": 1, "q#3": 1}, res["owners"]
        assert res["same"], rank


def test_matrix_fsdp_leaves_on_one_rank_is_owned_there(dist: Any) -> None:
    """A (1, 12) matrix row-sharded on 2 ranks lies whole on rank 0 (rank 1 holds no row).

    Catches: an owner chosen without regard to holders (rank 1 would receive it), and holder
    detection that treats an empty shard as holding the matrix."""
    out = dist(2).run(_holders_case, "row", (1, 12), None)
    for rank, res in enumerate(out):
        assert res["sent"] == [0, 0], (rank, res)
        assert res["owners"] == {"row": 0}, res["owners"]
        assert res["same"], rank
    assert [res["computed"] for res in out] == [[1, 1], [0, 0]]
