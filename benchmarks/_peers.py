"""Other distributed Muon implementations, built on the benchmark's DTensor matrices.

Each constructor takes ``(named, mesh, hp)`` (the ``(name, DTensor parameter)`` list, the
device mesh and the Muon hyper-parameters) and returns a ``torch.optim.Optimizer``, or raises
when the peer cannot run here; the benchmark records the exception text. CPU shims for
torchtitan's DistMuon live in this file only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

Named = Sequence[tuple[str, Tensor]]
PeerFactory = Callable[[Named, Any, dict[str, Any]], torch.optim.Optimizer]


class FullTensorMuon(torch.optim.Optimizer):
    """The naive distributed Muon: every rank gathers every matrix and orthogonalises it.

    Momentum is kept per shard; the blended momentum is ``full_tensor()``-ed, run through
    ``torch.optim.Muon``'s own Newton–Schulz, and each rank keeps its shard of the result.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        *,
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
        }
        super().__init__(list(params), defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.optim._muon import (
            DEFAULT_A,
            DEFAULT_B,
            DEFAULT_C,
            DEFAULT_NS_STEPS,
            EPS,
            _adjust_lr,
            _zeropower_via_newtonschulz,
        )

        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf, grad = state["momentum_buffer"], p.grad
                buf.lerp_(grad, 1 - group["momentum"])
                blended = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                full = blended.full_tensor() if isinstance(blended, DTensor) else blended
                update = _zeropower_via_newtonschulz(
                    full, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS
                )
                if isinstance(p, DTensor):
                    update = distribute_tensor(
                        update, p.device_mesh, p.placements, src_data_rank=None
                    )
                lr = _adjust_lr(group["lr"], None, p.shape)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-lr)


def full_tensor_muon(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    return FullTensorMuon([p for _, p in named], **hp)


def torch_muon(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` straight on the DTensor parameters."""
    return torch.optim.Muon([p for _, p in named], **hp)


@contextlib.contextmanager
def _cpu_stream_shim() -> Iterator[None]:
    """Torchtitan creates ``Stream(device=..., priority=0)``; ``torch.cpu.Stream`` takes neither."""
    real = torch.cpu.Stream
    torch.cpu.Stream = lambda device=None, priority=0: real()  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        torch.cpu.Stream = real  # type: ignore[misc]


def torchtitan_dist_muon(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """Torchtitan 0.3.0 ``flex_shard`` DistMuon: one ``Owned`` compute layout per matrix.

    Two CPU shims: DistMuon checks for one CUDA device per process (we return the CPU device),
    and its transfer stream is built with CUDA-only keyword arguments (see above).
    """
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as runtime
    from torchtitan.distributed.flex_shard import dist_muon
    from torchtitan.distributed.flex_shard.optimizer_reshard import (
        BucketConfig,
        ComputeLayout,
        Owned,
    )

    class CpuDistMuon(dist_muon.DistMuon):
        def _validate_parameter_storage(self) -> torch.device:
            return torch.device("cpu")

    if not getattr(runtime._CommunicationContext, "_cpu_shim", False):
        create = runtime._CommunicationContext.create.__func__  # type: ignore[attr-defined]

        def create_on_cpu(cls: Any, device: torch.device) -> Any:
            with _cpu_stream_shim():
                return create(cls, device)

        runtime._CommunicationContext.create = classmethod(create_on_cpu)  # type: ignore[assignment]
        runtime._CommunicationContext._cpu_shim = True  # type: ignore[attr-defined]

    layouts = {
        name: ComputeLayout(shardings_by_mesh_axis={a: Owned() for a in mesh.mesh_dim_names})
        for name, _ in named
    }
    layers = sorted({name.split(".")[1] for name, _ in named}, key=int)
    buckets = [BucketConfig(patterns=(f"layers.{i}.*",), name=f"layer{i}") for i in layers]
    groups = dist_muon._normalize_param_groups(
        [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    )
    return CpuDistMuon(groups, compute_sharding_by_fqn=layouts, bucket_configs=buckets, **hp)


def muon_fsdp2(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """muon-fsdp2 0.3.0 (``rms_scale=False``: torch's original lr adjustment)."""
    import muon_fsdp2 as mf

    group = {
        "params": [p for _, p in named],
        "use_muon": True,
        "lr": hp["lr"],
        "momentum": hp["momentum"],
        "weight_decay": hp["weight_decay"],
        "nesterov": hp["nesterov"],
        "rms_scale": False,
        "ns_steps": 5,
    }
    return mf.Muon([group])


def muonium(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """Muonium 0.2.0 with the classic Newton–Schulz (plain weight decay)."""
    import muonium as mu

    return mu.Muon(
        [p for _, p in named],
        lr=hp["lr"],
        wd=hp["weight_decay"],
        use_cautious_wd=False,
        momentum=hp["momentum"],
        nesterov=hp["nesterov"],
        orthogonalization_strategy="newton_schulz",
    )


def heavyball(named: Named, mesh: Any, hp: dict[str, Any]) -> torch.optim.Optimizer:
    """Heavyball 3.2.1 ``Muon`` (its own 5-step bf16 Newton–Schulz coefficients)."""
    import heavyball as hb

    return hb.Muon(
        [p for _, p in named], lr=hp["lr"], weight_decay=hp["weight_decay"], compile_step=False
    )


PEERS: dict[str, PeerFactory] = {
    "torchtitan": torchtitan_dist_muon,
    "muon_fsdp2": muon_fsdp2,
    "muonium": muonium,
    "heavyball": heavyball,
    "full_tensor": full_tensor_muon,
    "torch_dtensor": torch_muon,
}
PEER_LABELS = {
    "torchtitan": "torchtitan 0.3.0 `flex_shard` DistMuon",
    "muon_fsdp2": "muon-fsdp2 0.3.0",
    "muonium": "muonium 0.2.0",
    "heavyball": "heavyball 3.2.1 `Muon`",
    "dion": "dion (microsoft/dion)",
    "full_tensor": "`full_tensor()` Muon (every rank gathers and computes every matrix)",
    "torch_dtensor": "`torch.optim.Muon` on the DTensors",
}
#: Peers that take seconds per step: timed over fewer steps.
SLOW = ("torch_dtensor",)
#: Peers that compile kernels with torch.compile on first use (tens of seconds on 2 cores).
COMPILING = ("muon_fsdp2", "heavyball")
NOT_INSTALLABLE = {
    "dion": "not on PyPI (the package index this machine reaches); its repository installs "
    "only from source",
}
