"""CUDA checks (skipped on machines without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import canzona

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_muon_on_cuda_matches_torch() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fulls = [torch.randn(s, device="cuda", generator=gen) for s in ((64, 32), (32, 96), (48, 48))]
    ours = [nn.Parameter(t.clone()) for t in fulls]
    ref = [nn.Parameter(t.clone()) for t in fulls]
    a, b = canzona.Muon(ours, lr=0.02), torch.optim.Muon(ref, lr=0.02)
    for _ in range(3):
        for p, q in zip(ours, ref, strict=True):
            g = torch.randn(p.shape, device="cuda", generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)


def test_shampoo_state_stays_on_cuda() -> None:
    p = nn.Parameter(torch.randn(16, 24, device="cuda"))
    opt = canzona.Shampoo([p], precondition_frequency=1, start_preconditioning_step=1)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state_dict()["state"][0]
    assert all(v.device.type == "cuda" for k, v in state.items() if k != "step")
