"""TorchTitan route with blocks: per-head ``wqkv``/``wo`` and MoE experts by TorchTitan's names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_torchtitan import ADAMW_LR, HAS_TRITON, LR, requires_torchtitan, tiny_qwen3
from test_torchtitan_routing import _doc_block, _Plain

import canzona
from canzona.integrations.torchtitan import canzona_optimizers


def _heads(t: torch.Tensor, split: canzona.Split | None) -> list[torch.Tensor]:
    """The matrices the optimizer sees in ``t``: its blocks, or each matrix of a stack."""
    if split is None:
        return list(t) if t.ndim == 3 else [t]
    assert split.size is not None
    return list(t.split(split.size, dim=split.dim))


@requires_torchtitan
@pytest.mark.skipif(not HAS_TRITON, reason="TorchTitan 0.3.0's models import triton")
@pytest.mark.parametrize("experts", [0, 4])
def test_docs_per_head_example(experts: int) -> None:
    """Catches: split patterns that miss TorchTitan's names (a fused ``wqkv`` orthogonalised
    whole), blocks that do not follow its head-by-head layout, the split groups placed after
    the catch-all one, and experts or the router routed to the wrong algorithm: the update
    must equal ``torch.optim.Muon`` on every head (and every expert) as a separate matrix."""
    namespace: dict[str, Any] = {}
    exec(compile(_doc_block("def canzona_per_head"), "<torchtitan.md>", "exec"), namespace)
    head_dim = 16
    model = tiny_qwen3(experts=experts)
    opt = namespace["canzona_per_head"](head_dim).build(model_parts=[model])
    (inner,) = opt.optimizers
    routed = [(g["algorithm"], g.get("split"), g["param_names"]) for g in inner.param_groups]
    layers = ("layers.0.", "layers.1.")
    inner_experts = "moe.routed_experts.inner_experts."
    ffn = [f"{inner_experts}{w}" for w in ("w1_EFD", "w2_EDF", "w3_EFD")]
    mlp = ffn if experts else [f"feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
    assert routed[1:] == [
        (
            "muon",
            canzona.Split(0, size=head_dim),
            [f"{x}attention.qkv_linear.wqkv.weight" for x in layers],
        ),
        ("muon", canzona.Split(1, size=head_dim), [f"{x}attention.wo.weight" for x in layers]),
        ("muon", None, [x + m for x in layers for m in mlp]),
    ]
    assert routed[0][0] == "adamw"
    assert ("layers.0.moe.router.gate.weight" in routed[0][2]) == bool(experts)

    named = dict(model.named_parameters())
    splits = {n: g.get("split") for g in inner.param_groups for n in g["param_names"]}
    matrix = [n for g in inner.param_groups if g["algorithm"] == "muon" for n in g["param_names"]]
    refs = {n: [b.detach().clone() for b in _heads(named[n], splits[n])] for n in matrix}
    leaves = [leaf.requires_grad_() for n in matrix for leaf in refs[n]]
    torch_muon = torch.optim.Muon(leaves, lr=0.02, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in named.values():
            p.grad = torch.randn(p.shape, generator=gen)
        for n in matrix:
            for leaf, g in zip(refs[n], _heads(named[n].grad, splits[n]), strict=True):
                leaf.grad = g.clone()
        opt.step()
        torch_muon.step()
    for n in matrix:
        updated = _heads(named[n].detach(), splits[n])
        split = splits[n]
        assert len(updated) == ({0: 8, 1: 4}[split.dim] if split else experts or 1), n
        for got, want in zip(updated, refs[n], strict=True):
            assert torch.equal(got, want.detach()), (n, (got - want).abs().max().item())


@requires_torchtitan
def test_split_pattern_that_matches_nothing_is_named() -> None:
    """Catches: a mistyped split pattern dropped silently (the matrices then orthogonalised
    whole, with nothing said)."""
    config = canzona_optimizers(
        "muon", lr=LR, adamw_lr=ADAMW_LR, split={r"\.wqkv\.weight$": canzona.Split(0, size=4)}
    )
    with pytest.raises(ValueError, match=r"split pattern '\\\.wqkv\\\.weight\$' matched no matrix"):
        config.build(model_parts=[_Plain()])
