"""A tiny Qwen3-style decoder (RMSNorm, RoPE, GQA with q/k norms, SwiGLU) and its FSDP×TP layout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DecoderConfig", "QwenDecoder", "parallelize"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderConfig:
    """Shape of the decoder; the defaults are the demo's embedded configuration.

    Attributes:
        vocab_size: Tokens (bytes: 256).
        dim: Width of the residual stream.
        n_layers: Decoder blocks.
        n_heads: Query heads.
        n_kv_heads: Key/value heads (grouped-query attention); divides ``n_heads``.
        head_dim: Width of one head.
        ffn_dim: Hidden width of the SwiGLU MLP.
        max_seq_len: Longest sequence the rotary tables cover.
        rope_theta: Rotary base.
        norm_eps: RMSNorm epsilon.
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 384
    max_seq_len: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads must divide n_heads, got {self.n_kv_heads} and {self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (rotary pairs), got {self.head_dim}")


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` and scale it by the learned weight."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables ``(seq_len, head_dim)`` of the rotary embedding (half-split)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(batch, seq, heads, head_dim)`` by position."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    s = x.shape[1]
    return x * cos[:s, None, :] + rotated * sin[:s, None, :]


class Attention(nn.Module):
    """Causal grouped-query attention with RMSNorm on queries and keys (as in Qwen3).

    Head counts are read from the projections' local output widths, so the same code
    runs on a tensor-parallel rank that holds only some of the heads.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attend causally over ``x`` of shape ``(batch, seq, dim)``."""
        heads = "b s (h d) -> b s h d"  # the local heads (TP shards q/k/v by heads)
        q = self.q_norm(rearrange(self.q_proj(x), heads, d=self.head_dim))
        k = self.k_norm(rearrange(self.k_proj(x), heads, d=self.head_dim))
        v = rearrange(self.v_proj(x), heads, d=self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (rearrange(t, "b s h d -> b h s d") for t in (q, k, v))
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        merged: Tensor = self.o_proj(rearrange(out, "b h s d -> b s (h d)"))
        return merged


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """``down(silu(gate(x)) * up(x))``."""
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Block(nn.Module):
    """Pre-norm decoder block: attention then MLP, each with a residual connection."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """One block over ``x`` of shape ``(batch, seq, dim)``."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class QwenDecoder(nn.Module):
    """Token embedding, decoder blocks, final norm and an untied ``lm_head``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise weights (call under a fixed seed for a reproducible model).

        Embeddings ~ N(0, 1); linear layers ~ N(0, 1/fan_in), with the output
        projections of each residual branch scaled down by ``sqrt(2 * n_layers)``.
        """
        nn.init.normal_(self.embed_tokens.weight)
        depth_scale = math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = module.in_features**-0.5
                if name.endswith(("o_proj", "down_proj")):
                    std /= depth_scale
                nn.init.normal_(module.weight, std=std)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits ``(batch, seq, vocab)``, or the mean cross-entropy when ``targets`` is given."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {tokens.shape[1]} tokens exceeds max_seq_len {self.cfg.max_seq_len}"
            )
        cos, sin = self.rope_cos, self.rope_sin
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: Tensor = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def parallelize(model: QwenDecoder, mesh: DeviceMesh) -> QwenDecoder:
    """Shard ``model`` in place: FSDP2 on a 1-D mesh, FSDP×TP on a ``("dp", "tp")`` mesh.

    Tensor parallel (on ``mesh["tp"]``): column-wise q/k/v/gate/up, row-wise o/down, and the
    q/k norms replicated over the head dimension they see. Then ``fully_shard`` per block and
    on the root (on ``mesh["dp"]``); the embedding, final norm and head stay off TP.

    Args:
        model: The full model, identical on every rank.
        mesh: A 1-D mesh (FSDP) or a 2-D mesh named ``("dp", "tp")``.

    Returns:
        The same model object, sharded.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if mesh.ndim == 2:
        if mesh.mesh_dim_names != ("dp", "tp"):
            raise ValueError(f"a 2-D mesh must be named ('dp', 'tp'), got {mesh.mesh_dim_names}")
        tp = mesh.size(1)
        cfg = model.cfg
        if cfg.n_kv_heads % tp or cfg.ffn_dim % tp:
            raise ValueError(f"tensor-parallel degree {tp} must divide kv heads and ffn_dim")
        heads = SequenceParallel(sequence_dim=2, use_local_output=True)  # (b, s, heads, d)
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "self_attn.q_norm": heads,
            "self_attn.k_norm": heads,
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    elif mesh.ndim == 1:
        dp_mesh = mesh
    else:
        raise ValueError(f"mesh must be 1-D or 2-D, got {mesh.ndim}-D")
    for layer in model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model
