"""An optimizer built before fully_shard updates nothing: every rank says so."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import canzona

from _dist import mesh


def _built_too_early(build_after: bool) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    if not build_after:
        opt = canzona.Muon(model.parameters(), lr=0.02)  # holds the parameters FSDP replaces
    fully_shard(model, mesh=mesh())
    if build_after:
        opt = canzona.Muon(model.parameters(), lr=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_an_optimizer_built_before_fully_shard_warns_on_every_rank(dist: Any) -> None:
    """Catches: the silent no-op (no warning), or a warning on some ranks only."""
    for msgs in dist(2).run(_built_too_early, False):
        assert len(msgs) == 1, msgs  # once, after 3 steps without a matrix gradient
        assert "none of its 2 matrix parameters has had a gradient in 3 steps" in msgs[0]
        assert "built before fully_shard" in msgs[0]


def test_a_correctly_built_optimizer_does_not_warn(dist: Any) -> None:
    assert dist(2).run(_built_too_early, True) == [[], []]
