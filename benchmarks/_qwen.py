"""Qwen3-like decoder for the runtime benchmarks: shapes, sharding, gradients, fingerprints.

Every layer has Qwen3's seven matrices with Qwen3-0.6B's proportions at width ``h``:
``q_proj`` (2h x h), ``k_proj`` and ``v_proj`` (h x h: 16 query heads over 8 key/value heads),
``o_proj`` (h x 2h), ``gate_proj`` and ``up_proj`` (3h x h), ``down_proj`` (h x 3h), as
``nn.Linear`` weights (out x in). ``widths`` gives each layer's ``h``: equal widths make a
runnable decoder (embedding, RMSNorm, GQA attention, SwiGLU, head); unequal ones make the
heterogeneous stack of the step-latency benchmark, which is never run forward.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

HEADS, KV_HEADS = 16, 8  # Qwen3-0.6B
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TP_PLAN = {
    "attn.q_proj": "colwise",
    "attn.k_proj": "colwise",
    "attn.v_proj": "colwise",
    "attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A benchmark model: per-layer widths and the vocabulary of the runnable variant."""

    name: str
    widths: tuple[int, ...]
    vocab: int = 1024

    @property
    def uniform(self) -> bool:
        return len(set(self.widths)) == 1

    def describe(self) -> str:
        runs: list[str] = []
        for w in dict.fromkeys(self.widths):
            n = self.widths.count(w)
            runs.append(f"{n}×{w}" if n > 1 else str(w))
        return f"{len(self.widths)} layers, widths {' + '.join(runs)}"


def layer_shapes(h: int) -> dict[str, tuple[int, int]]:
    """The seven weight shapes (out, in) of a layer of width ``h``."""
    head_dim = 2 * h // HEADS
    q, kv, ffn = HEADS * head_dim, KV_HEADS * head_dim, 3 * h
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (ffn, h),
        "up_proj": (ffn, h),
        "down_proj": (h, ffn),
    }


class Attention(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        s = layer_shapes(h)
        self.head_dim = 2 * h // HEADS
        for name in MATRICES[:4]:
            out, inp = s[name]
            setattr(self, name, nn.Linear(inp, out, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, t, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        s = layer_shapes(h)
        for name in MATRICES[4:]:
            out, inp = s[name]
            setattr(self, name, nn.Linear(inp, out, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(h)
        self.attn = Attention(h)
        self.mlp_norm = nn.RMSNorm(h)
        self.mlp = MLP(h)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Embedding, blocks, final norm and head; ``forward`` needs uniform widths."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(Block(h) for h in config.widths)
        if config.uniform:
            h = config.widths[0]
            self.embed = nn.Embedding(config.vocab, h)
            self.norm = nn.RMSNorm(h)
            self.lm_head = nn.Linear(h, config.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        if not self.config.uniform:
            raise RuntimeError(f"{self.config.name}: layers of unequal widths do not chain")
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def matrices(self) -> list[tuple[str, nn.Parameter]]:
        """The hidden-layer weight matrices (what Muon/Shampoo/SOAP update), in layer order."""
        return [
            (n, p) for n, p in self.named_parameters() if n.startswith("layers.") and p.ndim == 2
        ]


def build(
    config: ModelConfig, mesh_kind: str, world: int, *, seed: int = 0
) -> tuple[Decoder, DeviceMesh | None]:
    """The model with identical initial weights on every rank, sharded as ``mesh_kind`` says.

    ``none``: plain tensors (the single-device reference; no mesh).
    ``fsdp``: FSDP2 ``fully_shard`` on a 1-D ``("dp",)`` mesh of all ranks. ``fsdp_tp``:
    ``Colwise``/``Rowwise`` tensor parallel on the ``tp`` dimension of a ``(world / 2, 2)``
    ``("dp", "tp")`` mesh, then ``fully_shard`` on ``dp`` (embedding and head stay on ``dp``).
    """
    torch.manual_seed(seed)
    model = Decoder(config)
    with torch.no_grad():  # small weights: Qwen-style std 0.02
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.02)
    if mesh_kind == "none":
        return model, None
    if mesh_kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp = mesh
    elif mesh_kind == "fsdp_tp":
        if world % 2 or world < 4:
            raise ValueError(f"fsdp_tp needs an even world of at least 4, got {world}")
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"]
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
    else:
        raise ValueError(f"mesh must be 'none', 'fsdp' or 'fsdp_tp', got {mesh_kind!r}")
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, mesh


def make_gradients(
    params: Sequence[tuple[str, Tensor]], *, seed: int, scale: float = 1e-2
) -> list[Tensor]:
    """Gradients with each parameter's placements; identical full values on every rank.

    The full gradient comes from a generator seeded by ``seed`` and the parameter's position,
    and each rank keeps its own shard of it (no communication).
    """
    grads = []
    for i, (_, p) in enumerate(params):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        full = torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale
        if isinstance(p, DTensor):
            grads.append(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
        else:
            grads.append(full)
    return grads


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def fingerprint(params: Sequence[Tensor]) -> str:
    """sha256 of this rank's shards of ``params`` (bitwise identity check)."""
    h = hashlib.sha256()
    for p in params:
        t = local(p).detach().contiguous()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def max_rel_diff(params: Sequence[Tensor], reference: Sequence[Tensor]) -> float:
    """Max |p - ref| / max |ref| over this rank's shards."""
    worst, scale = 0.0, 0.0
    for p, r in zip(params, reference, strict=True):
        a, b = local(p).detach().double(), r.double()
        if a.numel():
            worst = max(worst, float((a - b).abs().max()))
            scale = max(scale, float(b.abs().max()))
    return worst / scale if scale else worst


def newton_schulz_flops(shape: tuple[int, int], steps: int = 5) -> int:
    a, b = sorted(shape)
    return steps * (4 * a * a * b + 2 * a**3)


def total_flops(config: ModelConfig) -> int:
    return sum(newton_schulz_flops(s) for h in config.widths for s in layer_shapes(h).values())


def mib(config: ModelConfig) -> float:
    return sum(math.prod(s) for h in config.widths for s in layer_shapes(h).values()) * 4 / 2**20
