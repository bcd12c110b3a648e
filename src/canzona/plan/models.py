"""Shape catalogue of real models (Qwen3 dense and MoE) for benchmarks, examples and tests."""

from __future__ import annotations

from dataclasses import dataclass

from canzona.plan.spec import MatrixSpec

__all__ = [
    "MODELS",
    "SPLITS",
    "CatalogueEntry",
    "ModelShape",
    "adamw_specs",
    "catalogue",
    "model_specs",
]

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


SPLITS = ("none", "qkv", "heads")
"""How a catalogued model's fused parameters become matrices (``canzona plan --split``)."""


def _attention(prefix: str, cfg: ModelShape, split: str) -> list[MatrixSpec]:
    h, d = cfg.hidden, cfg.head_dim
    q, kv = cfg.heads * d, cfg.kv_heads * d
    if split == "none":  # a fused QKV projection updated as one matrix
        return [
            MatrixSpec(f"{prefix}.qkv_proj", (q + 2 * kv, h)),
            MatrixSpec(f"{prefix}.o_proj", (h, q)),
        ]
    if split == "qkv":
        return [
            MatrixSpec(f"{prefix}.q_proj", (q, h)),
            MatrixSpec(f"{prefix}.k_proj", (kv, h)),
            MatrixSpec(f"{prefix}.v_proj", (kv, h)),
            MatrixSpec(f"{prefix}.o_proj", (h, q)),
        ]
    specs = [MatrixSpec(f"{prefix}.q_proj.{i}", (d, h)) for i in range(cfg.heads)]
    specs += [MatrixSpec(f"{prefix}.k_proj.{i}", (d, h)) for i in range(cfg.kv_heads)]
    specs += [MatrixSpec(f"{prefix}.v_proj.{i}", (d, h)) for i in range(cfg.kv_heads)]
    specs += [MatrixSpec(f"{prefix}.o_proj.{i}", (h, d)) for i in range(cfg.heads)]
    return specs


def _mlp(
    prefix: str, hidden: int, ffn: int, split: str, holders: tuple[int, ...] | None = None
) -> list[MatrixSpec]:
    pinned = holders is not None
    if split == "none":  # a fused gate/up projection updated as one matrix
        up = [
            MatrixSpec(f"{prefix}.gate_up_proj", (2 * ffn, hidden), holders=holders, pinned=pinned)
        ]
    else:
        up = [
            MatrixSpec(f"{prefix}.gate_proj", (ffn, hidden), holders=holders, pinned=pinned),
            MatrixSpec(f"{prefix}.up_proj", (ffn, hidden), holders=holders, pinned=pinned),
        ]
    return [*up, MatrixSpec(f"{prefix}.down_proj", (hidden, ffn), holders=holders, pinned=pinned)]


def _expert_holders(expert: int, experts: int, world: int | None) -> tuple[int, ...] | None:
    """The rank holding an expert under expert parallelism over ``world`` ranks.

    Experts go to ranks in equal contiguous chunks; None when they do not spread evenly.
    """
    if world is None or world > experts or experts % world:
        return None
    return (expert // (experts // world),)


def catalogue(name: str, *, split: str = "qkv", world: int | None = None) -> list[CatalogueEntry]:
    """Every weight matrix of a catalogued model, in model order.

    Per layer the attention projections and ``layers.{i}.mlp.{gate,up,down}_proj`` (MoE:
    ``layers.{i}.mlp.gate`` (the router, routed to AdamW) and ``layers.{i}.mlp.experts.{e}.*``
    as individual 2-D matrices), plus ``embed_tokens`` and, for untied models, ``lm_head``
    (both flagged for AdamW). Norm weights (1-D) are not matrices and are left out.

    Args:
        name: A key of ``MODELS``.
        split: ``"qkv"``: q, k, v, o, gate, up and down each one matrix (the checkpoint's
            own parameters, or fused ones declared with ``canzona.Split``); ``"none"``: a
            fused ``qkv_proj`` and ``gate_up_proj`` each updated as one matrix; ``"heads"``:
            one matrix per attention head (q/k/v by rows, o by columns), gate and up apart.
        world: With expert parallelism over this many ranks, each expert's matrices name the
            rank that holds them (``MatrixSpec.holders``, pinned): they never travel.

    Raises:
        ValueError: On an unknown model name or split, or a world below 1.
    """
    cfg = MODELS.get(name)
    if cfg is None:
        raise ValueError(f"unknown model, expected one of {sorted(MODELS)}, got {name!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ValueError(f"world must be a positive int or None, got {world!r}")
    entries = [CatalogueEntry(MatrixSpec("embed_tokens", (cfg.vocab, cfg.hidden)), adamw=True)]
    for i in range(cfg.layers):
        layer = f"layers.{i}"
        entries += [CatalogueEntry(s) for s in _attention(f"{layer}.self_attn", cfg, split)]
        if cfg.experts:
            router = MatrixSpec(f"{layer}.mlp.gate", (cfg.experts, cfg.hidden))
            entries.append(CatalogueEntry(router, adamw=True))
            for e in range(cfg.experts):
                holders = _expert_holders(e, cfg.experts, world)
                specs = _mlp(f"{layer}.mlp.experts.{e}", cfg.hidden, cfg.expert_ffn, split, holders)
                entries += [CatalogueEntry(s) for s in specs]
        else:
            entries += [CatalogueEntry(s) for s in _mlp(f"{layer}.mlp", cfg.hidden, cfg.ffn, split)]
    if not cfg.tied:
        entries.append(CatalogueEntry(MatrixSpec("lm_head", (cfg.vocab, cfg.hidden)), adamw=True))
    return entries


def model_specs(
    name: str, *, split: str = "qkv", include_adamw: bool = False, world: int | None = None
) -> list[MatrixSpec]:
    """The matrices of a catalogued model that the matrix optimizer updates.

    Args:
        name: A key of ``MODELS``.
        split: How fused parameters become matrices (see :func:`catalogue`).
        include_adamw: Also return the AdamW-routed embedding, LM head and routers.
        world: Expert parallelism over this many ranks (see :func:`catalogue`).
    """
    return [
        e.spec for e in catalogue(name, split=split, world=world) if include_adamw or not e.adamw
    ]


def adamw_specs(name: str) -> list[MatrixSpec]:
    """The AdamW-routed parameters of a catalogued model (embedding, untied LM head, routers)."""
    return [e.spec for e in catalogue(name) if e.adamw]
