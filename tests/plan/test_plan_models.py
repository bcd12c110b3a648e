"""The Qwen3 shape catalogue."""

from __future__ import annotations

import pytest

from canzona.plan.models import MODELS, adamw_specs, catalogue, model_specs


def _shapes(name: str, **kwargs: bool) -> dict[str, tuple[int, ...]]:
    return {s.name: s.shape for s in model_specs(name, **kwargs)}


def test_dense_shapes() -> None:
    s = _shapes("qwen3-8b")
    assert s["layers.0.self_attn.q_proj"] == (4096, 4096)
    assert s["layers.0.self_attn.k_proj"] == (1024, 4096)
    assert s["layers.0.self_attn.v_proj"] == (1024, 4096)
    assert s["layers.35.self_attn.o_proj"] == (4096, 4096)
    assert s["layers.0.mlp.gate_proj"] == s["layers.0.mlp.up_proj"] == (12288, 4096)
    assert s["layers.0.mlp.down_proj"] == (4096, 12288)
    assert len(s) == 36 * 7
    small = _shapes("qwen3-0.6b")
    assert small["layers.0.self_attn.q_proj"] == (2048, 1024)
    assert small["layers.0.self_attn.o_proj"] == (1024, 2048)
    assert _shapes("qwen3-32b")["layers.63.mlp.down_proj"] == (5120, 25600)


def test_moe_shapes() -> None:
    s = _shapes("qwen3-30b-a3b")
    assert len(s) == 48 * (4 + 128 * 3)  # the router goes to AdamW
    assert s["layers.0.self_attn.q_proj"] == (4096, 2048)
    assert s["layers.0.self_attn.k_proj"] == (512, 2048)
    assert {e.spec.name: e.spec.shape for e in catalogue("qwen3-30b-a3b")}["layers.0.mlp.gate"] == (
        128,
        2048,
    )
    assert s["layers.47.mlp.experts.127.gate_proj"] == (768, 2048)
    assert s["layers.0.mlp.experts.0.down_proj"] == (2048, 768)
    big = _shapes("qwen3-235b-a22b")
    assert len(big) == 94 * 388
    assert big["layers.0.self_attn.q_proj"] == (8192, 4096)
    assert big["layers.93.mlp.experts.5.up_proj"] == (1536, 4096)


@pytest.mark.parametrize(
    ("name", "billions"),
    [("qwen3-8b", 6.95), ("qwen3-32b", 31.2), ("qwen3-30b-a3b", 29.9), ("qwen3-235b-a22b", 234)],
)
def test_non_embedding_parameter_counts_match_the_model_cards(name: str, billions: float) -> None:
    total = sum(s.numel for s in model_specs(name))
    assert total == pytest.approx(billions * 1e9, rel=0.01)


def test_split_heads() -> None:
    s = _shapes("qwen3-8b", split="heads")
    assert s["layers.0.self_attn.q_proj.31"] == (128, 4096)
    assert s["layers.0.self_attn.k_proj.7"] == (128, 4096)
    assert s["layers.0.self_attn.o_proj.0"] == (4096, 128)
    assert "layers.0.self_attn.q_proj" not in s
    assert len(s) == 36 * (32 + 8 + 8 + 32 + 3)
    whole = sum(x.numel for x in model_specs("qwen3-8b"))
    assert sum(x.numel for x in model_specs("qwen3-8b", split="heads")) == whole


def test_adamw_entries() -> None:
    untied = {s.name: s.shape for s in adamw_specs("qwen3-8b")}
    assert untied == {"embed_tokens": (151936, 4096), "lm_head": (151936, 4096)}
    assert [s.name for s in adamw_specs("qwen3-1.7b")] == ["embed_tokens"]  # tied
    with_adamw = model_specs("qwen3-1.7b", include_adamw=True)
    assert with_adamw[0].name == "embed_tokens" and len(with_adamw) == 28 * 7 + 1
    entries = catalogue("qwen3-14b")
    assert [e.spec.name for e in entries if e.adamw] == ["embed_tokens", "lm_head"]
    assert entries[-1].spec.name == "lm_head"


def test_every_model_builds_and_unknown_fails() -> None:
    for name in MODELS:
        specs = model_specs(name)
        assert specs and len({s.name for s in specs}) == len(specs)
    with pytest.raises(ValueError, match="unknown model"):
        model_specs("llama-7b")


def test_fused_layout_is_one_matrix_per_projection() -> None:
    s = _shapes("qwen3-8b", split="none")
    assert s["layers.0.self_attn.qkv_proj"] == ((32 + 2 * 8) * 128, 4096)
    assert s["layers.0.mlp.gate_up_proj"] == (2 * 12288, 4096)
    assert "layers.0.self_attn.q_proj" not in s
    whole = sum(x.numel for x in model_specs("qwen3-8b"))
    assert sum(x.numel for x in model_specs("qwen3-8b", split="none")) == whole
    with pytest.raises(ValueError, match="split must be one of"):
        model_specs("qwen3-8b", split="rows")


def test_experts_name_their_rank_under_expert_parallelism() -> None:
    specs = {s.name: s for s in model_specs("qwen3-30b-a3b", world=8)}
    assert specs["layers.0.mlp.experts.0.up_proj"].holders == (0,)
    assert specs["layers.0.mlp.experts.127.down_proj"].holders == (7,)
    assert specs["layers.0.mlp.experts.16.gate_proj"].holders == (1,)
    assert all(s.pinned for s in specs.values() if s.holders)
    assert specs["layers.0.self_attn.q_proj"].holders is None
    assert all(s.holders is None for s in model_specs("qwen3-30b-a3b", world=3))  # uneven


def test_routers_go_to_adamw() -> None:
    names = [s.name for s in adamw_specs("qwen3-30b-a3b")]
    assert "layers.0.mlp.gate" in names and "layers.47.mlp.gate" in names
    assert all(not s.name.endswith("mlp.gate") for s in model_specs("qwen3-30b-a3b"))


@pytest.mark.parametrize("world", [0, -2, True])
def test_a_world_below_one_is_named(world: int) -> None:
    """Catches: ``world=0`` dividing by zero while placing the experts."""
    with pytest.raises(ValueError, match=f"world must be a positive int or None, got {world}"):
        model_specs("qwen3-30b-a3b", world=world)
