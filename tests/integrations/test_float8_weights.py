"""Weights wrapped for torchao's float8 training step exactly as plain ones, and stay wrapped.

torchao's float8 training wraps weights in tensor subclasses before FSDP2 shards them, so a
parameter is a DTensor whose local shard is the subclass: ``convert_to_float8_training``
with ``enable_fsdp_float8_all_gather=True`` wraps ``nn.Linear`` weights in
``WeightWithDynamicFloat8CastTensor`` (FSDP2's all-gather casts them to float8 only as long
as they stay wrapped), and TorchTitan's float8 MoE converter wraps grouped experts' stacks
in ``Float8TrainingWeightWrapperTensor`` (``quantize_`` with ``Float8TrainingOpConfig``).
No forward runs here (float8 matmuls need a GPU): the gradients are set. Skipped where
torchao is not installed (``nox -s tests`` installs it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import canzona

from _cases import set_grads
from _dist import mesh

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed (nox -s tests installs it)",
)

WRAPPER = "WeightWithDynamicFloat8CastTensor"
EXPERTS = "Float8TrainingWeightWrapperTensor"
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Muon": {"lr": 0.02, "weight_decay": 0.1},
    "NorMuon": {"lr": 0.02},
    "Shampoo": {"lr": 0.01, "precondition_frequency": 1, "start_preconditioning_step": 1},
    "SOAP": {"lr": 0.01, "precondition_frequency": 1},
}
SAVED, STOP = 2, 4


class _Experts(nn.Module):
    """Grouped experts' weights, ``(experts, out, in)`` stacks as TorchTitan keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 24, 16))
        self.w2 = nn.Parameter(torch.randn(4, 16, 24))


def _model(float8: bool, sharded: bool, experts: bool = True) -> nn.Module:
    """Two linears (and a norm, which stays plain) and experts, float8-converted or not."""
    torch.manual_seed(0)
    layers = [nn.Linear(32, 48, bias=False), nn.LayerNorm(48), nn.Linear(48, 16)]
    model = nn.Sequential(*layers, *([_Experts()] if experts else []))
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        experts = Float8TrainingOpConfig()
        quantize_(model, config=experts, filter_fn=lambda m, _: isinstance(m, _Experts))
    if sharded:
        for layer in model:
            fully_shard(layer, mesh=mesh())
        fully_shard(model, mesh=mesh())
    return model


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    opt: torch.optim.Optimizer = getattr(canzona, name)(
        canzona.param_groups(model, adamw={"lr": 1e-3}), **OPTIMIZERS[name]
    )
    return opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    params = list(model.named_parameters())
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        set_grads(params, {n: torch.randn(p.shape, generator=gen) for n, p in params})
        opt.step()
        opt.zero_grad(set_to_none=True)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A parameter's full value as a plain tensor (a wrapper's own data)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
    for inner in ("_tensor", "_data"):
        full = getattr(full, inner, full)
    assert type(full) in (torch.Tensor, nn.Parameter), type(full)
    return full.detach().clone()


def _matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D weights (torch.optim.Muon takes no stacks)."""
    return [p for p in model.parameters() if p.ndim == 2]


def _kinds(model: nn.Module) -> list[str]:
    """The class of each parameter's local data, in order."""
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p.data for p in model.parameters()]
    return [type(t).__name__ for t in locals_]


def _sharded(name: str, path: str) -> dict[str, Any]:
    """Plain and float8 weights, the same steps; float8 linears saved and resumed with DCP.

    The checkpoint leaves the experts out: DCP pickles their wrapper (the model's state;
    canzona's state holds plain tensors), which ``torch.load`` refuses without an allow-list.
    """
    plain = _model(float8=False, sharded=True)
    _train(plain, _optimizer(plain, name), range(STOP))
    wrapped = _model(float8=True, sharded=True)
    _train(wrapped, _optimizer(wrapped, name), range(STOP))
    saved = _model(float8=True, sharded=True, experts=False)
    opt = _optimizer(saved, name)
    _train(saved, opt, range(SAVED))
    model_sd, optim_sd = get_state_dict(saved, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train(saved, opt, range(SAVED, STOP))
    resumed = _model(float8=True, sharded=True, experts=False)
    again = _optimizer(resumed, name)
    model_sd, optim_sd = get_state_dict(resumed, again)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(
        resumed, again, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    _train(resumed, again, range(SAVED, STOP))
    want = [_plain(p) for p in plain.parameters()]
    pairs = zip(resumed.parameters(), saved.parameters(), strict=True)
    experts = _model(float8=True, sharded=True)
    alone = canzona.Muon(list(experts[3].parameters()), lr=0.02)  # the stacks only
    _train(experts, alone, range(2))
    return {
        "expert_bytes_sent": alone.last_step_stats.bytes_sent,
        "kinds": _kinds(wrapped),
        "resumed_kinds": _kinds(resumed),
        "same": [
            torch.equal(_plain(p), w) for p, w in zip(wrapped.parameters(), want, strict=True)
        ],
        "resumed_same": [torch.equal(_plain(a), _plain(b)) for a, b in pairs],
    }


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fsdp2_float8_weights_step_as_plain_ones(dist: Any, tmp_path: Path, name: str) -> None:
    """Two FSDP2 ranks (the expert stacks sharded over the experts): float8-wrapped weights
    end bit for bit where plain ones do, still wrapped (FSDP2's float8 all-gather goes on),
    the wrapped expert stacks move no bytes, and a DCP checkpoint of the float8 linears
    resumes exactly.

    Catches: a step that replaces a parameter's local shard (or its ``.data``) with a plain
    tensor, which would silently turn the float8 all-gather off; state or math that follows
    the wrapper's class instead of its values."""
    kinds = [WRAPPER, "Tensor", "Tensor", WRAPPER, "Tensor", EXPERTS, EXPERTS]
    for out in dist(2).run(_sharded, name, str(tmp_path / "ck"), timeout=120):
        assert out["kinds"] == kinds, out
        assert out["resumed_kinds"] == kinds[:5], out
        assert out["same"] == [True] * 7, out
        assert out["resumed_same"] == [True] * 5, out
        assert out["expert_bytes_sent"] == 0, out


def _fsdp_tp(float8: bool) -> list[torch.Tensor]:
    """Colwise and rowwise linears on the ``tp`` axis of a (2, 2) mesh, FSDP2 over ``dp``
    (``_StridedShard`` rows), trained three steps by canzona.Muon; the full weights."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 32, bias=False))
    plan: dict[str, Any] = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
        plan = {"0": Float8ColwiseParallel(), "1": Float8RowwiseParallel()}
    dm = mesh((2, 2), ("dp", "tp"))
    parallelize_module(model, dm["tp"], plan)
    fully_shard(model, mesh=dm["dp"])
    _train(model, canzona.Muon(canzona.param_groups(model), lr=0.02), range(3))
    assert _kinds(model) == [WRAPPER if float8 else "Tensor"] * 2, _kinds(model)
    return [_plain(p) for p in model.parameters()]


def _fsdp_tp_pair() -> bool:
    return all(torch.equal(a, b) for a, b in zip(_fsdp_tp(False), _fsdp_tp(True), strict=True))


def test_fsdp_tp_float8_weights_step_as_plain_ones(dist: Any) -> None:
    """Four ranks, FSDP2 over tensor parallel with torchao's float8 parallel styles: the
    wrapped shards (``_StridedShard`` fragments among them) end bit for bit where plain
    ones do, and stay wrapped."""
    assert dist(4).run(_fsdp_tp_pair, timeout=120) == [True] * 4


def test_one_process_float8_weights_match_torch_muon() -> None:
    """One process: canzona.Muon on float8-wrapped weights equals torch.optim.Muon on them,
    bit for bit, and the weights stay wrapped."""
    got, want = _model(float8=True, sharded=False), _model(float8=True, sharded=False)
    _train(got, canzona.Muon(_matrices(got), lr=0.02), range(3))
    _train(want, torch.optim.Muon(_matrices(want), lr=0.02), range(3))
    assert _kinds(got) == [WRAPPER, "Tensor", "Tensor", WRAPPER, "Tensor", EXPERTS, EXPERTS]
    pairs = zip(got.parameters(), want.parameters(), strict=True)
    assert all(torch.equal(_plain(a), _plain(b)) for a, b in pairs)
