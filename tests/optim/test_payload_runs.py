"""Payload views grouped into runs that one concatenation fills, and the prepare without them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import canzona
import canzona.optim.muon as muon_module
from canzona.optim.payload_runs import payload_runs


def test_runs_follow_the_buffer_and_break_where_views_are_not_adjacent() -> None:
    """Catches: a run across two buffers, across a gap, across a change of trailing shape,
    or in prepared order instead of buffer order."""
    a, b = torch.zeros(100), torch.zeros(50)
    views = [
        a.narrow(0, 32, 16).view(2, 8),  # 0: after 2
        b.narrow(0, 0, 12).view(3, 4),  # 1: the other buffer
        a.narrow(0, 0, 32).view(4, 8),  # 2: first in a
        a.narrow(0, 48, 12).view(2, 6),  # 3: adjacent to 0, other tail
        a.narrow(0, 70, 6).view(1, 6),  # 4: a gap before it
        b.narrow(0, 12, 8).view(2, 4),  # 5: adjacent to 1
    ]
    runs = payload_runs(views)
    assert runs is not None
    assert [r.positions for r in runs] == [(2, 0), (3,), (4,), (1, 5)]
    assert [tuple(r.out.shape) for r in runs] == [(6, 8), (2, 6), (1, 6), (5, 4)]
    assert all(x is y for x, y in zip(runs[0].views, (views[2], views[0]), strict=True))
    assert runs[0].out.data_ptr() == a.data_ptr()
    assert runs[3].out.data_ptr() == b.data_ptr()
    assert runs[0].take(list(range(6))) == (2, 0)  # type: ignore[arg-type]
    assert runs[1].take(list(range(6))) == (3,)  # type: ignore[arg-type]
    assert payload_runs([torch.zeros(2, 3)]) is None  # not cut from a flat buffer


@pytest.mark.parametrize("nesterov", [True, False])
def test_prepare_without_runs_matches_torch_muon(
    monkeypatch: pytest.MonkeyPatch, nesterov: bool
) -> None:
    """The foreach prepare (taken when the payloads form no runs) is still torch's Muon."""
    monkeypatch.setattr(muon_module, "payload_runs", lambda payloads: None)
    gen = torch.Generator().manual_seed(4)
    shapes = [(8, 8), (8, 8), (6, 10), (12, 4)]
    values = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    kw: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    opt, ref = canzona.Muon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for step in grads:
        for p, q, g in zip(ours, theirs, step, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    work = opt._work[2]  # type: ignore[attr-defined]
    assert [w.cache["runs"] for w in work.groups] == [None]
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
