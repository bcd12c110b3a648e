"""The ``muon`` package's MuonWithAuxAdam state continues under canzona.Muon (from_torch_state).

``muon-optimizer`` (Keller Jordan's Muon) keeps Muon and Adam in one optimizer whose groups
carry a ``use_muon`` flag; its Adam counts steps in an int. Skipped where it is not installed
(``nox -s tests`` installs it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import canzona

muon = pytest.importorskip("muon")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8, bias=False))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_muon_with_aux_adam_job_continues_from_its_state() -> None:
    """Catches: the ``use_muon`` flag not read (its Muon group is then refused), its int step
    count not loaded as canzona's count, states landing on other parameters than their own,
    the source groups' lr not taken."""
    old = _model()
    name_of = {p: n for n, p in old.named_parameters()}
    matrices = [p for p in old.parameters() if p.ndim == 2]
    others = [p for p in old.parameters() if p.ndim != 2]
    groups: list[dict[str, Any]] = [
        {"params": others, "use_muon": False, "lr": 3e-3, "betas": (0.9, 0.95)},
        {"params": matrices, "use_muon": True, "lr": 0.02, "weight_decay": 0.01},
    ]
    source = muon.SingleDeviceMuonWithAuxAdam(groups)
    _train(old, source, 3, seed=1)
    names = [name_of[p] for g in source.param_groups for p in g["params"]]
    saved = copy.deepcopy(source.state_dict())

    new = _model()
    new.load_state_dict(old.state_dict())
    opt = canzona.Muon(canzona.param_groups(new, adamw={"lr": 1e-3}), lr=0.05)
    with pytest.warns(UserWarning) as seen:  # the values canzona.Muon keeps are named
        opt.load_state_dict(canzona.from_torch_state(opt, (saved, names)))
    texts = sorted(str(w.message) for w in seen)
    assert "param group 0 continues" in texts[0] and "(weight_decay 0.01 -> 0.1)" in texts[0]
    assert "param group 1 continues" in texts[1] and "(eps 1e-10 -> 1e-08)" in texts[1]
    by_name = dict(new.named_parameters())
    for pid, entry in saved["state"].items():
        state = opt.state[by_name[names[pid]]]
        for key, value in entry.items():
            if key == "step":
                assert state["step"].item() == value == 3, names[pid]
            else:
                assert torch.equal(state[key], value), (names[pid], key)
    assert [g["lr"] for g in opt.param_groups] == [0.02, 3e-3]  # the source groups' lr
    before = {n: p.detach().clone() for n, p in new.named_parameters()}
    _train(new, opt, 1, seed=2)
    assert all(not torch.equal(p, before[n]) for n, p in new.named_parameters())
