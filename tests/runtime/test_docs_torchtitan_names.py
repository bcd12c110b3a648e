"""docs/usage.md's split declarations for TorchTitan 0.3.0's Llama 3 and Qwen3 names: every
attention projection is split per head, experts and routers are routed as documented, and
(where TorchTitan and triton are installed) the example's stand-in has the parameter names and
shapes of TorchTitan's own models and gets the same groups."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_docs_usage import _blocks

import canzona

MARKER = "def per_head("
# matrices the optimizer sees in layer 0: (q + 2 kv) heads + o heads + w1, w2, w3 (or experts)
MATRICES = {
    "llama3 8B": (32 + 2 * 8) + 32 + 3,
    "qwen3 32B": (64 + 2 * 8) + 64 + 3,
    "qwen3 30B-A3B": (32 + 2 * 4) + 32 + 3 * 128,
    "qwen3 debugmodel_non_fused_qkv": (16 + 2 * 8) + 16 + 3,
}


def _example() -> dict[str, Any]:
    blocks = [b for b in _blocks("usage.md") if MARKER in b]
    assert len(blocks) == 1, MARKER
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    exec(compile(blocks[0], "<docs/usage.md>", "exec"), namespace)
    return namespace


def _expected(shape: dict[str, Any]) -> tuple[dict[str, list[tuple[int, int]]], set[str]]:
    """TorchTitan's layer-0 matrices with the blocks each should become, and its AdamW names."""
    dim, hd, ffn = shape["dim"], shape["head_dim"], shape["ffn"]
    heads, kv = shape["heads"], shape["kv_heads"]
    qkv, att = "layers.0.attention.qkv_linear.", "layers.0.attention."
    if shape.get("fused", True):
        blocks = {f"{qkv}wqkv.weight": [(hd, dim)] * (heads + 2 * kv)}
    else:
        blocks = {f"{qkv}wq.weight": [(hd, dim)] * heads}
        blocks |= {f"{qkv}wk.weight": [(hd, dim)] * kv, f"{qkv}wv.weight": [(hd, dim)] * kv}
    blocks[f"{att}wo.weight"] = [(dim, hd)] * heads
    adamw = {"tok_embeddings.weight", "norm.weight"}
    adamw |= {"layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"}
    if not shape.get("tied", False):
        adamw.add("lm_head.weight")
    if shape.get("qk_norm", False):
        adamw |= {f"{att}q_norm.weight", f"{att}k_norm.weight"}
    if experts := shape.get("experts", 0):
        inner = "layers.0.moe.routed_experts.inner_experts."
        mlp = {"w1_EFD": (ffn, dim), "w2_EDF": (dim, ffn), "w3_EFD": (ffn, dim)}
        blocks |= {inner + w: [s] * experts for w, s in mlp.items()}
        adamw.add("layers.0.moe.router.gate.weight")
    else:
        mlp = {"w1": (ffn, dim), "w2": (dim, ffn), "w3": (ffn, dim)}
        blocks |= {f"layers.0.feed_forward.{w}.weight": [s] for w, s in mlp.items()}
    return blocks, adamw


def _matrices(group: dict[str, Any], p: torch.Tensor) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix ``group`` makes of ``p``."""
    m, n = p.shape[-2:]
    if "split" in group:
        return list(group["split"].shapes(m, n))
    return [(m, n)] * (p.shape[0] if p.ndim == 3 else 1)


def _routes(groups: list[dict[str, Any]]) -> list[tuple[Any, Any, list[str]]]:
    return [(g.get("split"), g.get("algorithm"), [n for n, _ in g["params"]]) for g in groups]


def test_torchtitan_split_example_routes_every_name() -> None:
    """Catches: a documented pattern deleted or mistyped (a fused ``wqkv``, ``wq``/``wk``/``wv``
    or ``wo`` updated whole: wrong block counts; a pattern matching nothing raises), a split on
    the wrong dimension or size, a stand-in whose sizes differ from the flavour's (totals), and
    experts or routers routed elsewhere than documented."""
    namespace = _example()
    flavours, groups = namespace["flavours"], namespace["groups"]
    assert set(flavours) == set(groups) == set(MATRICES)
    for flavour, shape in flavours.items():
        blocks, adamw = _expected(shape)
        got: dict[str, list[tuple[int, int]]] = {}
        got_adamw: set[str] = set()
        for g in groups[flavour]:
            if g.get("algorithm") == "adamw":
                got_adamw |= {n for n, _ in g["params"]}
            else:
                got |= {n: _matrices(g, p) for n, p in g["params"]}
        assert got == blocks, flavour
        assert got_adamw == adamw, flavour
        assert sum(len(b) for b in got.values()) == MATRICES[flavour], flavour
        split = {n for g in groups[flavour] if "split" in g for n, _ in g["params"]}
        assert split == {n for n in blocks if ".attention." in n}, flavour


def test_torchtitan_stand_in_matches_torchtitan() -> None:
    """Catches: a stand-in name or shape that is not TorchTitan 0.3.0's (the documented
    patterns would then be checked on names TorchTitan does not use), and routing that
    differs on TorchTitan's own module classes (e.g. its embedding or router not sent to
    AdamW)."""
    llama3 = pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan, triton")
    qwen3 = pytest.importorskip("torchtitan.models.qwen3", reason="needs torchtitan, triton")
    namespace = _example()
    configs = {"llama3": llama3.llama3_configs, "qwen3": qwen3.qwen3_configs}
    for flavour, shape in namespace["flavours"].items():
        family, name = flavour.split()
        config = configs[family][name](attn_backend="flex")
        config.layers = config.layers[:1]
        with torch.device("meta"):
            real = config.build()
            stand_in = namespace["Decoder"](**shape)
        named = [(n, tuple(p.shape)) for n, p in real.named_parameters()]
        assert named == [(n, tuple(p.shape)) for n, p in stand_in.named_parameters()], flavour
        split = namespace["per_head"](shape["head_dim"])
        groups = canzona.param_groups(real, split=split, lr=0.02, adamw={"lr": 8e-4})
        assert _routes(groups) == _routes(namespace["groups"][flavour]), flavour
