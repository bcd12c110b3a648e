"""Small fp32 matrices stacked on their owners: batched Newton–Schulz, bitwise the loop."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

import canzona

from _cases import full_of, full_tensors, grad_steps, placements_for, set_grads, sharded_params
from _dist import mesh

TIMEOUT = 60
# 8 x 8 and 8 x 16 stacks batch bit for bit on torch 2.13's CPU build; 6 x 8 ones never do
SHAPES = {f"a{i}": (8, 8) for i in range(8)} | {f"b{i}": (6, 8) for i in range(4)}
SHAPES |= {f"c{i}": (8, 16) for i in range(4)}
KW: dict[str, Any] = {"lr": 0.02, "momentum": 0.9, "nesterov": True, "ns_dtype": torch.float32}
STEPS = 3


def _per_matrix() -> dict[str, torch.Tensor]:
    """One process, every matrix in a param group of its own: stacks of one, the loop."""
    params = {n: nn.Parameter(t) for n, t in full_tensors(SHAPES).items()}
    opt = canzona.Muon([{"params": [(n, p)]} for n, p in params.items()], **KW)
    for grads in grad_steps(SHAPES, STEPS):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def _stacked(kind: str) -> dict[str, Any]:
    ns = importlib.import_module("canzona.updates.newton_schulz")  # the function shadows it
    ns._BATCH_EXACT.clear()
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), {n: placements_for(kind, 2) for n in SHAPES})
    opt = canzona.Muon(params, **KW)
    for grads in grad_steps(SHAPES, STEPS):
        set_grads(params, grads)
        opt.step()
    batched = {key[4:6] for key, ok in ns._BATCH_EXACT.items() if ok and key[2] == torch.float32}
    return {"params": {n: full_of(p) for n, p in params}, "batched": batched}


def test_owners_stack_small_fp32_matrices_bitwise_as_the_per_matrix_run(dist: Any) -> None:
    """Catches: small fp32 stacks batched where their kernels round differently (6 x 8), and
    the batched path not taken at all for the shapes whose kernels match (8 x 8, 8 x 16),
    on row and column shards over 2 ranks against one process running each matrix alone."""
    expected = _per_matrix()
    for kind in ("row", "col"):
        outs = dist(2).run(_stacked, kind, timeout=TIMEOUT)
        for out in outs:
            for name, want in expected.items():
                assert torch.equal(out["params"][name], want), (kind, name)
        batched = set().union(*(out["batched"] for out in outs))  # each rank's own stacks
        assert batched >= {(8, 8), (8, 16)} and (6, 8) not in batched, (kind, batched)
