"""canzona.integrations.torchtitan: canzona's optimizers inside TorchTitan's OptimizersContainer.

The first tests need no torchtitan. The rest run TorchTitan's own Qwen3 model, its FSDP
wrapping (``apply_fsdp_to_decoder``) and its ``OptimizersContainer`` machinery, and are
skipped where torchtitan is not installed: the ``test`` extra does not pull it (see
docs/torchtitan.md for the install line). The one substitution: the model's inner attention
is TorchTitan's ``ScaledDotProductAttention`` instead of FlexAttention, which has no
backward on CPU.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import canzona
from canzona.integrations.torchtitan import (
    ADAMW_PATTERN,
    OPTIMIZER_NAMES,
    build_optimizer,
    canzona_optimizers,
    resolve_name,
)

requires_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (nox -s tests installs it; see docs/torchtitan.md)",
)

LR, ADAMW_LR = 0.02, 3e-3
STEPS = 4
TOL = 1e-5  # FSDP on 2 ranks against one process, fp32 (measured ~1e-7)


# -- without torchtitan ----------------------------------------------------------------------


def test_module_imports_and_builds_without_torchtitan() -> None:
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torchtitan" or name.startswith("torchtitan."):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
import torch
import canzona.integrations.torchtitan as tt
opt = tt.build_optimizer("canzona.Muon", [{"params": [torch.nn.Parameter(torch.ones(3, 2))],
                                          "param_names": ["w"], "lr": 0.1, "fused": True}])
print(type(opt).__name__)
try:
    tt.CanzonaOptimizersContainer
except ImportError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "Muon"
    assert lines[1].startswith("canzona.integrations.torchtitan needs torchtitan")


def test_build_optimizer_takes_torchtitan_groups() -> None:
    w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.zeros(4))
    groups = [
        {"params": [w], "param_names": ["lin.weight"], "lr": 0.02, "fused": True, "foreach": False},
        {
            "params": [b],
            "param_names": ["lin.bias"],
            "algorithm": "adamw",
            "lr": 1e-3,
            "fused": True,
            "foreach": False,
        },
    ]
    opt = build_optimizer("canzona.Shampoo", groups, plan=canzona.PlanConfig(strategy="numel"))
    assert isinstance(opt, canzona.Shampoo)
    assert opt.plan_config.strategy == "numel"
    for group in opt.param_groups:
        assert "fused" not in group and "foreach" not in group
    assert [g["param_names"] for g in opt.param_groups] == [["lin.weight"], ["lin.bias"]]
    with pytest.raises(ValueError, match=r"unknown canzona optimizer 'canzona\.Adam'"):
        build_optimizer("canzona.Adam", groups)
    with pytest.raises(ValueError, match=r"'lin.bias' .*is 1-D"):
        build_optimizer("canzona.Muon", [{"params": [b], "param_names": ["lin.bias"]}])
    with pytest.raises(ValueError, match=r"unknown canzona optimizer 'adam'; .*'canzona\.Muon'"):
        canzona_optimizers("adam", lr=0.1, adamw_lr=0.1)


@pytest.mark.parametrize("name", ["muon", "Muon", "canzona.Muon", "canzona.muon"])
def test_short_and_container_names_resolve(name: str) -> None:
    """Catches: the container's own name (``"canzona.Muon"``) refused by the helper."""
    assert resolve_name(name) == "canzona.Muon"
    assert {resolve_name(n) for n in OPTIMIZER_NAMES} == set(OPTIMIZER_NAMES)
    assert resolve_name("soap") == "canzona.SOAP" and resolve_name("normuon") == "canzona.NorMuon"


def test_unknown_names_list_the_valid_ones() -> None:
    """Catches: a typo answered without the names that would work."""
    with pytest.raises(ValueError) as info:
        resolve_name("canzona.Muonn")
    message = str(info.value)
    assert "did you mean 'canzona.Muon'?" in message
    for name in (*OPTIMIZER_NAMES, "muon", "shampoo", "soap", "normuon"):
        assert repr(name) in message


@pytest.mark.parametrize(
    ("fqn", "adamw"),
    [
        ("tok_embeddings.weight", True),
        ("output.weight", True),
        ("lm_head.weight", True),
        ("norm.weight", True),
        ("layers.0.attention_norm.weight", True),
        ("layers.3.attention.q_norm.weight", True),
        ("layers.0.feed_forward.w1.bias", True),
        ("layers.0.attention.qkv_linear.wqkv.weight", False),
        ("layers.0.attention.wo.weight", False),
        ("layers.1.feed_forward.w2.weight", False),
        ("layers.1.moe.experts.w1", False),
        ("layers.0.moe.shared_output.weight", False),  # "output." inside a name
    ],
)
def test_adamw_pattern_on_torchtitan_names(fqn: str, adamw: bool) -> None:
    assert bool(re.search(ADAMW_PATTERN, fqn)) is adamw


# -- with torchtitan ---------------------------------------------------------------------------


def tiny_qwen3(seed: int = 0, experts: int = 0) -> nn.Module:
    """TorchTitan's Qwen3 (fused QKV, q/k norms, SwiGLU) at 2 layers, dim 64, vocab 256.

    With ``experts`` > 0 the SwiGLU is an MoE layer of that many experts (TorchTitan's
    ``moe.routed_experts.inner_experts.w1_EFD`` stacks and ``moe.router.gate``).
    """
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (
        make_ffn_config,
        make_gqa_config,
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def norm(d: int) -> Any:
        return RMSNorm.Config(normalized_shape=d, eps=1e-6, param_init={"weight": nn.init.ones_})

    dim, head_dim, vocab = 64, 16, 256
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=4,
                n_kv_heads=2,
                head_dim=head_dim,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1e6),
                qk_norm=norm(head_dim),
            ),
            **(
                {
                    "moe": make_moe_config(
                        num_experts=experts,
                        router=make_router_config(
                            dim=dim, num_experts=experts, gate_param_init=init, top_k=2
                        ),
                        routed_experts=make_routed_experts_config(
                            dim=dim,
                            hidden_dim=32,
                            num_experts=experts,
                            top_k=2,
                            param_init=dict.fromkeys(
                                ("w1_EFD", "w2_EDF", "w3_EFD"), init["weight"]
                            ),
                            comm_backend="standard",
                        ),
                    )
                }
                if experts
                else {
                    "feed_forward": make_ffn_config(
                        dim=dim, hidden_dim=128, w1_param_init=init, w2w3_param_init=init
                    )
                }
            ),
        )
        for _ in range(2)
    ]
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=0.02)},
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init),
    )
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attention = nn.ModuleDict(
            {"wqkv": nn.Linear(dim, 3 * dim, bias=False), "wo": nn.Linear(dim, dim, bias=False)}
        )
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.feed_forward = nn.ModuleDict(
            {
                "w1": nn.Linear(dim, hidden, bias=False),
                "w2": nn.Linear(hidden, dim, bias=False),
                "w3": nn.Linear(dim, hidden, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attention["wqkv"](self.attention_norm(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention["wo"](y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        ff = self.feed_forward
        return x + ff["w2"](F.silu(ff["w1"](h)) * ff["w3"](h))


class TinyDecoder(nn.Module):
    """A plain-torch decoder with TorchTitan's module names and ``Decoder`` attributes.

    TorchTitan 0.3.0's own model modules import triton at import time (its MoE token
    dispatcher); this model lets the container, TorchTitan's FSDP wrapping and its
    checkpoint format be tested where triton is not installed.
    """

    enable_weight_tying = False

    def __init__(self, dim: int = 64, hidden: int = 128, vocab: int = 256) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim, hidden, 4) for i in range(2)})
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x))


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    """TorchTitan's Qwen3 (``"qwen3"``) or the plain-torch decoder (``"decoder"``)."""
    if kind == "qwen3":
        return tiny_qwen3(seed)
    torch.manual_seed(seed)
    return TinyDecoder()


HAS_TRITON = importlib.util.find_spec("triton") is not None
KINDS = [
    "decoder",
    pytest.param(
        "qwen3",
        marks=pytest.mark.skipif(
            not HAS_TRITON,
            reason="TorchTitan 0.3.0's model modules import triton, which is not installed",
        ),
    ),
]


def plain_muon(model: nn.Module) -> canzona.Muon:
    """What the container should build: one canzona.Muon, AdamW group first."""
    named = list(model.named_parameters())
    adamw = [(n, p) for n, p in named if re.search(ADAMW_PATTERN, n)]
    matrix = [(n, p) for n, p in named if not re.search(ADAMW_PATTERN, n)]
    return canzona.Muon(
        [
            {"params": adamw, "algorithm": "adamw", "lr": ADAMW_LR, "weight_decay": 0.0},
            {"params": matrix, "lr": LR, "weight_decay": 0.1, "ns_dtype": torch.float32},
        ]
    )


def batches(rank: int = 0, world: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batch every step (so the loss can fall); this rank's rows of it."""
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(7))
    rows = tokens.chunk(world)[rank]
    return [(rows[:, :-1], rows[:, 1:])] * STEPS


def train(
    model: nn.Module, optimizer: Any, data: list[tuple[torch.Tensor, torch.Tensor]], world: int = 1
) -> list[float]:
    """Steps as TorchTitan's trainer takes them: the loss is summed and divided by the global
    token count, and FSDP sums gradients (``apply_fsdp_to_decoder`` turns its division off)."""
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        loss = loss / (y.numel() * world)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * world)  # this rank's mean
    return losses


def shard(model: nn.Module, world: int) -> None:
    """TorchTitan's FSDP wrapping of a decoder, on a CPU mesh of ``world`` ranks.

    ``apply_fsdp_to_decoder`` sets a gradient divide factor of 1, which FSDP turns into a
    ``PREMUL_SUM`` reduce-scatter that gloo does not have; forcing plain sums keeps the same
    arithmetic (TorchTitan scales the loss by the global token count instead).
    """
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from _dist import mesh

    apply_fsdp_to_decoder(
        model,
        mesh((world,)),
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        pp_enabled=False,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def container(model: nn.Module, optimizer: str = "muon", **kwargs: Any) -> Any:
    """The container a job gets from ``optimizer=canzona_optimizers(...)``.

    Muon runs Newton–Schulz in fp32 here, so that FSDP and one process agree to ~1e-7
    (bf16 would add a few percent of noise to each update).
    """
    if optimizer == "muon":
        kwargs.setdefault("ns_dtype", torch.float32)
    config = canzona_optimizers(optimizer, lr=LR, adamw_lr=ADAMW_LR, **kwargs)
    return config.build(model_parts=[model])


@requires_torchtitan
@pytest.mark.parametrize("kind", KINDS)
def test_container_builds_one_canzona_muon_and_matches_it(kind: str) -> None:
    model = tiny_model(kind)
    opt = container(model)
    assert type(opt).__name__ == "CanzonaOptimizersContainer"
    assert [type(o) for o in opt.optimizers] == [canzona.Muon]
    algorithms = [g["algorithm"] for g in opt.optimizers[0].param_groups]
    assert algorithms == ["adamw", "muon"]
    losses = train(model, opt, batches())
    assert losses[-1] < losses[0]

    reference = tiny_model(kind)
    train(reference, plain_muon(reference), batches())
    want = full_params(reference)
    for name, value in full_params(model).items():
        assert torch.equal(value, want[name]), name


def _fsdp_run(kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for route in ("container", "plain"):
        model = tiny_model(kind)
        shard(model, world)
        opt = container(model) if route == "container" else plain_muon(model)
        losses = train(model, opt, batches(rank, world), world)
        out[route] = {"losses": losses, "params": full_params(model)}
    return out


@requires_torchtitan
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp_two_ranks_matches_plain_muon_and_one_process(dist: Any, kind: str) -> None:
    results = dist(2).run(_fsdp_run, kind)
    reference = tiny_model(kind)
    train(reference, plain_muon(reference), batches())
    want = full_params(reference)
    for rank_result in results:
        got, plain = rank_result["container"], rank_result["plain"]
        assert got["losses"][-1] < got["losses"][0]
        for name, value in got["params"].items():
            assert torch.equal(value, plain["params"][name]), name
            torch.testing.assert_close(value, want[name], rtol=TOL, atol=TOL)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _shampoo_round_trip(kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(rank, world)
    hyper = {"precondition_frequency": 1, "start_preconditioning_step": 1, "weight_decay": 0.0}
    model = tiny_model(kind)
    shard(model, world)
    opt = container(model, "shampoo", **hyper)
    train(model, opt, data[:2], world)
    saved_opt = {k: _clone(v) for k, v in opt.state_dict().items()}
    saved_model = [p.detach().clone() for p in model.parameters()]
    train(model, opt, data[2:], world)
    uninterrupted = full_params(model)

    with torch.no_grad():
        for p, value in zip(model.parameters(), saved_model, strict=True):
            p.copy_(value)
    resumed = container(model, "shampoo", **hyper)
    resumed.load_state_dict(saved_opt)
    train(model, resumed, data[2:], world)
    owner_keys = sorted({k.rsplit(".", 1)[-1] for k in saved_opt if k.startswith("state.")})
    return {"uninterrupted": uninterrupted, "resumed": full_params(model), "keys": owner_keys}


@requires_torchtitan
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_keeps_owner_held_shampoo_state(dist: Any, kind: str) -> None:
    for result in dist(2).run(_shampoo_round_trip, kind):
        assert {"exp_avg", "step"} <= set(result["keys"])
        assert len(result["keys"]) > 3, result["keys"]  # factors and roots held on owners
        for name, value in result["resumed"].items():
            assert torch.equal(value, result["uninterrupted"][name]), name


@requires_torchtitan
def test_job_config_parsing_keeps_the_canzona_container() -> None:
    """TorchTitan parses job configs with tyro; the subclass and its factory kwargs survive."""
    from dataclasses import field, make_dataclass

    import tyro
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # registers torchtitan's tyro rules

    # a job config's optimizer field, as in Trainer.Config (built here: Trainer needs torchdata)
    base = OptimizersContainer.Config
    Job = make_dataclass(
        "Job", [("optimizer", base, field(default_factory=base))], kw_only=True, slots=True
    )
    default = Job(optimizer=canzona_optimizers("soap", lr=3e-3, adamw_lr=1e-3))
    parsed = tyro.cli(
        Job,
        args=["--optimizer.implementation", "for-loop"],
        default=default,
        registry=custom_registry,
    )
    assert type(parsed.optimizer).__name__ == "Config"
    assert type(parsed.optimizer).__qualname__ == "CanzonaOptimizersContainer.Config"
    assert parsed.optimizer.implementation == "for-loop"
    assert [g.optimizer_name for g in parsed.optimizer.param_groups] == ["canzona.SOAP"] * 2
    assert isinstance(
        parsed.optimizer.optimizer_factory_kwargs_by_name["canzona.SOAP"]["plan"],
        canzona.PlanConfig,
    )
