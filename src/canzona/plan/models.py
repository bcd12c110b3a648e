"""Shape catalogue of real models (Qwen3 dense and MoE) for benchmarks, examples and tests."""

from __future__ import annotations

from dataclasses import dataclass

from canzona.plan.spec import MatrixSpec

__all__ = ["MODELS", "CatalogueEntry", "ModelShape", "adamw_specs", "catalogue", "model_specs"]

HEAD_DIM = 128
QWEN3_VOCAB = 151936


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """The dimensions that determine a decoder's matrix shapes.

    Attributes:
        layers: Number of decoder layers.
        hidden: Model width.
        heads: Attention (query) heads.
        kv_heads: Key/value heads.
        ffn: Dense MLP width (0 for MoE models).
        vocab: Vocabulary size.
        tied: Whether the LM head shares the embedding matrix.
        experts: Routed experts per layer (0 for dense models).
        expert_ffn: Width of one expert's MLP.
        head_dim: Width of one attention head.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int = 0
    vocab: int = QWEN3_VOCAB
    tied: bool = False
    experts: int = 0
    expert_ffn: int = 0
    head_dim: int = HEAD_DIM

    def __post_init__(self) -> None:
        if (self.ffn > 0) == (self.experts > 0):
            raise ValueError(f"exactly one of ffn and experts must be set, got {self!r}")


MODELS: dict[str, ModelShape] = {
    "qwen3-0.6b": ModelShape(layers=28, hidden=1024, ffn=3072, heads=16, kv_heads=8, tied=True),
    "qwen3-1.7b": ModelShape(layers=28, hidden=2048, ffn=6144, heads=16, kv_heads=8, tied=True),
    "qwen3-4b": ModelShape(layers=36, hidden=2560, ffn=9728, heads=32, kv_heads=8, tied=True),
    "qwen3-8b": ModelShape(layers=36, hidden=4096, ffn=12288, heads=32, kv_heads=8),
    "qwen3-14b": ModelShape(layers=40, hidden=5120, ffn=17408, heads=40, kv_heads=8),
    "qwen3-32b": ModelShape(layers=64, hidden=5120, ffn=25600, heads=64, kv_heads=8),
    "qwen3-30b-a3b": ModelShape(
        layers=48, hidden=2048, heads=32, kv_heads=4, experts=128, expert_ffn=768
    ),
    "qwen3-235b-a22b": ModelShape(
        layers=94, hidden=4096, heads=64, kv_heads=4, experts=128, expert_ffn=1536
    ),
}


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    """One parameter of a catalogued model.

    Attributes:
        spec: Its shape as a matrix spec (fp32 payload).
        adamw: Whether the parameter is routed to AdamW (embedding, LM head) rather than to the
            matrix optimizer.
    """

    spec: MatrixSpec
    adamw: bool = False


def _attention(prefix: str, cfg: ModelShape, split_heads: bool) -> list[MatrixSpec]:
    h, d = cfg.hidden, cfg.head_dim
    if not split_heads:
        return [
            MatrixSpec(f"{prefix}.q_proj", (cfg.heads * d, h)),
            MatrixSpec(f"{prefix}.k_proj", (cfg.kv_heads * d, h)),
            MatrixSpec(f"{prefix}.v_proj", (cfg.kv_heads * d, h)),
            MatrixSpec(f"{prefix}.o_proj", (h, cfg.heads * d)),
        ]
    specs = [MatrixSpec(f"{prefix}.q_proj.{i}", (d, h)) for i in range(cfg.heads)]
    specs += [MatrixSpec(f"{prefix}.k_proj.{i}", (d, h)) for i in range(cfg.kv_heads)]
    specs += [MatrixSpec(f"{prefix}.v_proj.{i}", (d, h)) for i in range(cfg.kv_heads)]
    specs += [MatrixSpec(f"{prefix}.o_proj.{i}", (h, d)) for i in range(cfg.heads)]
    return specs


def _mlp(prefix: str, hidden: int, ffn: int) -> list[MatrixSpec]:
    return [
        MatrixSpec(f"{prefix}.gate_proj", (ffn, hidden)),
        MatrixSpec(f"{prefix}.up_proj", (ffn, hidden)),
        MatrixSpec(f"{prefix}.down_proj", (hidden, ffn)),
    ]


def catalogue(name: str, *, split_heads: bool = False) -> list[CatalogueEntry]:
    """Every weight matrix of a catalogued model, in model order.

    Per layer ``layers.{i}.self_attn.{q,k,v,o}_proj`` and ``layers.{i}.mlp.{gate,up,down}_proj``
    (MoE: ``layers.{i}.mlp.gate`` (the router) and ``layers.{i}.mlp.experts.{e}.*`` as
    individual 2-D matrices), plus ``embed_tokens`` and, for untied models, ``lm_head``
    (both flagged for AdamW). Norm weights (1-D) are not matrices and are left out.

    Args:
        name: A key of ``MODELS``.
        split_heads: Split each attention projection into one matrix per head.

    Raises:
        ValueError: On an unknown model name.
    """
    cfg = MODELS.get(name)
    if cfg is None:
        raise ValueError(f"unknown model, expected one of {sorted(MODELS)}, got {name!r}")
    entries = [CatalogueEntry(MatrixSpec("embed_tokens", (cfg.vocab, cfg.hidden)), adamw=True)]
    for i in range(cfg.layers):
        layer = f"layers.{i}"
        specs = _attention(f"{layer}.self_attn", cfg, split_heads)
        if cfg.experts:
            specs.append(MatrixSpec(f"{layer}.mlp.gate", (cfg.experts, cfg.hidden)))
            for e in range(cfg.experts):
                specs += _mlp(f"{layer}.mlp.experts.{e}", cfg.hidden, cfg.expert_ffn)
        else:
            specs += _mlp(f"{layer}.mlp", cfg.hidden, cfg.ffn)
        entries += [CatalogueEntry(s) for s in specs]
    if not cfg.tied:
        entries.append(CatalogueEntry(MatrixSpec("lm_head", (cfg.vocab, cfg.hidden)), adamw=True))
    return entries


def model_specs(
    name: str, *, split_heads: bool = False, include_adamw: bool = False
) -> list[MatrixSpec]:
    """The matrices of a catalogued model that the matrix optimizer updates.

    Args:
        name: A key of ``MODELS``.
        split_heads: Split each attention projection into one matrix per head.
        include_adamw: Also return the AdamW-routed embedding and LM head.
    """
    return [
        e.spec for e in catalogue(name, split_heads=split_heads) if include_adamw or not e.adamw
    ]


def adamw_specs(name: str) -> list[MatrixSpec]:
    """The AdamW-routed parameters of a catalogued model (embedding, untied LM head)."""
    return [e.spec for e in catalogue(name) if e.adamw]
