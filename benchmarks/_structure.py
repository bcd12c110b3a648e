"""A model where structure matters: per-head attention blocks, a small MoE layer, dense MLPs.

Every layer has Qwen3-0.6B's attention proportions at width ``h`` (``_qwen.layer_shapes``:
q 2h x h for 16 heads, k/v h x h for 8 key/value heads, o h x 2h; head dimension ``h / 8``),
declared to the optimizer as one matrix per head: q, k and v split into heads along their rows
(``canzona.Split(dim=0, size=head_dim)``), o along its columns (``Split(dim=1, ...)``). Each
layer's MLP is either dense (gate/up 3h x h, down h x 3h, unsplit) or a mixture of experts:
three 3-D expert stacks ``(E, ffn, h)``, ``(E, ffn, h)``, ``(E, h, ffn)`` and a router
``(E, h)`` that goes to AdamW, as in the Canzona paper's code. Under FSDP2 every parameter is
``Shard(0)``: the stacks are sharded over the experts (expert parallel, ``E / world`` whole
experts per rank), and each rank holds whole q/k/v heads. The model is never run forward: the
benchmark sets seeded gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import canzona
from _qwen import HEADS, layer_shapes

ROW_HEADS = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
COLUMN_HEADS = ("o_proj.weight",)
ROUTER = "router.weight"


@dataclass(frozen=True, kw_only=True, slots=True)
class StructureConfig:
    """Width, layer kinds (``"dense"`` or ``"moe"``) and experts of the structure model."""

    name: str
    width: int
    layers: tuple[str, ...] = ("dense", "moe")
    experts: int = 8
    expert_ratio: int = 4  # an expert's hidden size is width / expert_ratio

    def __post_init__(self) -> None:
        if any(kind not in ("dense", "moe") for kind in self.layers):
            raise ValueError(f"layer kinds are 'dense' or 'moe', got {self.layers!r}")
        if self.width % HEADS or self.width % self.expert_ratio:
            raise ValueError(f"width must be a multiple of {HEADS} and of expert_ratio")

    @property
    def head_dim(self) -> int:
        return 2 * self.width // HEADS

    @property
    def expert_ffn(self) -> int:
        return self.width // self.expert_ratio

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.width,) * len(self.layers)

    def describe(self) -> str:
        h, kinds = self.width, " + ".join(self.layers)
        return (
            f"{len(self.layers)} layers ({kinds}), width {h}, per-head attention (head dim "
            f"{self.head_dim}: q/k/v split by rows, o by columns), {self.experts} experts of "
            f"{self.expert_ffn}×{h} per stack, router to AdamW"
        )

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name and shape, in the model's order."""
        h, e, f = self.width, self.experts, self.expert_ffn
        out: list[tuple[str, tuple[int, ...]]] = []
        for i, kind in enumerate(self.layers):
            s = layer_shapes(h)
            out += [(f"layers.{i}.attn.{n}.weight", s[n]) for n in ("q_proj", "k_proj", "v_proj")]
            out.append((f"layers.{i}.attn.o_proj.weight", s["o_proj"]))
            if kind == "dense":
                out += [(f"layers.{i}.mlp.{n}.weight", s[n]) for n in ("gate_proj", "up_proj")]
                out.append((f"layers.{i}.mlp.down_proj.weight", s["down_proj"]))
            else:
                out.append((f"layers.{i}.mlp.{ROUTER}", (e, h)))
                out += [
                    (f"layers.{i}.mlp.experts.w1", (e, f, h)),
                    (f"layers.{i}.mlp.experts.w2", (e, h, f)),
                    (f"layers.{i}.mlp.experts.w3", (e, f, h)),
                ]
        return out

    def mib(self) -> float:
        """fp32 MiB of the parameters the matrix algorithm updates (router left out)."""
        total = sum(_numel(s) for n, s in self.shapes() if not n.endswith(ROUTER))
        return total * 4 / 2**20


def _numel(shape: Sequence[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


class _Holder(nn.Module):
    """A module holding parameters of given shapes (dots in names become submodules)."""


def _module(config: StructureConfig) -> nn.Module:
    layers = nn.ModuleList()
    for i in range(len(config.layers)):
        block = _Holder()
        for name, shape in config.shapes():
            prefix = f"layers.{i}."
            if not name.startswith(prefix):
                continue
            parent = block
            *path, leaf = name[len(prefix) :].split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, _Holder())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
        layers.append(block)
    root = _Holder()
    root.add_module("layers", layers)
    return root


def build(
    config: StructureConfig, mesh_kind: str, world: int, *, seed: int = 0
) -> tuple[nn.Module, DeviceMesh | None]:
    """The model with identical weights on every rank: plain (``none``) or FSDP2 (``fsdp``)."""
    torch.manual_seed(seed)
    model = _module(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    if mesh_kind == "none":
        return model, None
    if mesh_kind != "fsdp":
        raise ValueError(f"the structure model runs on 'none' or 'fsdp', got {mesh_kind!r}")
    if config.experts % world:
        raise ValueError(f"{config.experts} experts do not spread evenly over {world} ranks")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def param_groups(config: StructureConfig, named: Sequence[tuple[str, Tensor]]) -> list[Any]:
    """The optimizer's param groups: one per distinct split, the unsplit matrices, AdamW.

    The router goes to AdamW in a group of its own (``algorithm="adamw"``).
    """
    d = config.head_dim
    rows = [(n, p) for n, p in named if n.endswith(ROW_HEADS)]
    columns = [(n, p) for n, p in named if n.endswith(COLUMN_HEADS)]
    router = [(n, p) for n, p in named if n.endswith(ROUTER)]
    taken = {n for n, _ in (*rows, *columns, *router)}
    plain = [(n, p) for n, p in named if n not in taken]
    groups: list[dict[str, Any]] = [
        {"params": rows, "split": canzona.Split(dim=0, size=d)},
        {"params": columns, "split": canzona.Split(dim=1, size=d)},
        {"params": plain},
    ]
    if router:
        groups.append({"params": router, "algorithm": "adamw", "lr": 3e-4})
    return groups


def matrices(named: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """The parameters a Muon updates (what the peers get): everything but the router."""
    return [(n, p) for n, p in named if not n.endswith(ROUTER)]


def is_expert(name: str) -> bool:
    """Whether a plan item belongs to an expert stack."""
    return ".experts." in name
