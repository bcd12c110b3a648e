"""A torch.optim.Muon + AdamW job continues with canzona.Muon on a mesh, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from _cases import full_tensors, sharded_params
from _dist import mesh
from _torch_jobs import SHAPES, continue_with_canzona, torch_job

LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...]]] = {
    # mesh shape, the matrices' placements, the vectors'
    "fsdp": ((2,), (Shard(0),), (Shard(0),)),
    "fsdp_tp": ((2, 2), (Shard(0), Shard(1)), (Shard(0), Replicate())),
}


def _as_dtensors(sd: dict[str, Any], layouts: dict[str, tuple[Any, ...]]) -> None:
    """A state dict's tensors as a sharded job saves them: DTensors on the mesh (``layouts``:
    per parameter name, its mesh and placements)."""
    names = [n for group in sd["param_groups"] for n in group["param_names"]]
    order = [pid for group in sd["param_groups"] for pid in group["params"]]
    for pid, name in zip(order, names, strict=True):
        entry = sd["state"].get(pid, {})
        for key, value in entry.items():
            if key != "step":
                entry[key] = distribute_tensor(value, *layouts[name])


def _resumed(layout: str, sources: str) -> dict[str, Any]:
    """Every rank: the torch job's checkpoint loaded into sharded parameters; its tensors
    full (one process, DDP) or DTensors in the parameters' layout (as TorchTitan's DistMuon
    and AdamW under FSDP2 save them) or replicated on the mesh."""
    shape, matrix, vector = LAYOUTS[layout]
    saved, want = torch_job(full_tensors(SHAPES))
    placements = {n: matrix if len(s) == 2 else vector for n, s in SHAPES.items()}
    dm = mesh(shape)
    params = sharded_params(saved["params"], dm, placements)
    if sources != "full":
        layouts = {
            n: (dm, placements[n] if sources == "dtensor" else (Replicate(),) * len(shape))
            for n in SHAPES
        }
        for key in ("muon", "adamw"):
            _as_dtensors(saved[key], layouts)
    got = continue_with_canzona(saved, params)
    return {n: (bool((got[n] == want[n]).all()), float((got[n] - want[n]).abs().max()))
            for n in SHAPES}  # fmt: skip


CASES = [("fsdp", "full"), ("fsdp_tp", "full"), ("fsdp", "dtensor"), ("fsdp_tp", "replicated")]


@pytest.mark.parametrize(("layout", "sources"), CASES)
def test_a_torch_job_continues_on_a_mesh_bit_for_bit(dist: Any, layout: str, sources: str) -> None:
    """Catches: checkpoint tensors not sliced to each rank's shard (or sliced wrongly), DTensor
    sources not taken in their own layout, and everything the one-device test catches, on
    FSDP and FSDP x TP layouts."""
    world = 2 if layout == "fsdp" else 4
    for rank, result in enumerate(dist(world).run(_resumed, layout, sources)):
        bad = {n: diff for n, (equal, diff) in result.items() if not equal}
        assert not bad, f"rank {rank}: {bad}"
