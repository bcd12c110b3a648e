"""A TorchTitan DistMuon job's state continues under canzona.Muon (canzona.from_torch_state).

DistMuon (torchtitan 0.3.0, ``flex_shard``) saves ``torch.optim.Muon``'s layout with its
momentum buffers as DTensors in the parameters' layout. It runs here on CPU through the
benchmarks' two shims (``benchmarks/_peers.py``); skipped where torchtitan is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.placement_types import Shard

import canzona

from _dist import mesh

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (nox -s tests installs it; see docs/torchtitan.md)",
)

#: DistMuon buckets its matrices by layer: TorchTitan's names.
SHAPES = {"layers.0.wq": (64, 32), "layers.0.wo": (32, 64), "layers.1.w2": (48, 40)}
HP: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
SAVED, CONTINUED = 3, 3


def _continued() -> dict[str, tuple[bool, float]]:
    """DistMuon for ``SAVED`` steps; then canzona.Muon from its state against torch.optim.Muon
    on the full tensors from the same momentum, for ``CONTINUED`` steps."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import _peers

    dm = mesh((2,), ("dp",))
    gen = torch.Generator().manual_seed(0)
    fulls = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(6)]

    def sharded(values: dict[str, torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
        return [(n, nn.Parameter(distribute_tensor(v.clone(), dm, [Shard(0)])))
                for n, v in values.items()]  # fmt: skip

    def step(opt: torch.optim.Optimizer, params: list[Any], grad: dict[str, Any]) -> None:
        for n, p in params:
            g = grad[n].clone()
            p.grad = distribute_tensor(g, dm, [Shard(0)]) if isinstance(p, DTensor) else g
        opt.step()
        opt.zero_grad(set_to_none=True)

    named = sharded(fulls)
    old = _peers.torchtitan_dist_muon(named, dm, dict(HP))
    for g in grads[:SAVED]:
        step(old, named, g)
    saved = copy.deepcopy(old.state_dict())
    values = {n: p.full_tensor().detach().clone() for n, p in named}
    ref = [(n, nn.Parameter(v.clone())) for n, v in values.items()]
    torch_muon = torch.optim.Muon(ref, **HP)
    momentum = copy.deepcopy(torch_muon.state_dict())
    for pid, entry in saved["state"].items():
        momentum["state"][pid] = {"momentum_buffer": entry["momentum_buffer"].full_tensor()}
    torch_muon.load_state_dict(momentum)
    params = sharded(values)
    opt = canzona.Muon(params, **HP)
    opt.load_state_dict(canzona.from_torch_state(opt, saved))
    for g in grads[SAVED:]:
        step(opt, params, g)
        step(torch_muon, ref, g)
    want = {n: p.detach() for n, p in ref}
    got = {n: p.full_tensor().detach() for n, p in params}
    return {n: (torch.equal(got[n], want[n]), float((got[n] - want[n]).abs().max())) for n in got}


def test_a_dist_muon_job_continues_under_canzona_bit_for_bit(dist: Any) -> None:
    """Catches: DistMuon's DTensor momentum not taken in its own layout (or its groups, which
    name their parameters, not read as torch.optim.Muon's)."""
    for rank, result in enumerate(dist(2).run(_continued)):
        bad = {n: diff for n, (equal, diff) in result.items() if not equal}
        assert not bad, f"rank {rank}: {bad}"
