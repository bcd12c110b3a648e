"""A torch.optim.Muon + AdamW job on one device continues with canzona.Muon on a mesh, bitwise."""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from _cases import full_tensors, sharded_params
from _dist import mesh
from _torch_jobs import SHAPES, continue_with_canzona, torch_job

LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Placement, ...], tuple[Placement, ...]]] = {
    # mesh shape, the matrices' placements, the vectors'
    "fsdp": ((2,), (Shard(0),), (Shard(0),)),
    "fsdp_tp": ((2, 2), (Shard(0), Shard(1)), (Shard(0), Replicate())),
}


def _resumed(layout: str) -> dict[str, Any]:
    """Every rank: the torch job's checkpoint (full tensors) loaded into sharded parameters."""
    shape, matrix, vector = LAYOUTS[layout]
    saved, want = torch_job(full_tensors(SHAPES))
    placements = {n: matrix if len(s) == 2 else vector for n, s in SHAPES.items()}
    params = sharded_params(saved["params"], mesh(shape), placements)
    got = continue_with_canzona(saved, params)
    return {n: (bool((got[n] == want[n]).all()), float((got[n] - want[n]).abs().max()))
            for n in SHAPES}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_one_device_torch_job_continues_on_a_mesh_bit_for_bit(dist: Any, layout: str) -> None:
    """Catches: full checkpoint tensors not sliced to each rank's shard (or sliced wrongly),
    and everything the one-device test catches, on FSDP and FSDP x TP layouts."""
    world = 2 if layout == "fsdp" else 4
    for rank, result in enumerate(dist(world).run(_resumed, layout)):
        bad = {n: diff for n, (equal, diff) in result.items() if not equal}
        assert not bad, f"rank {rank}: {bad}"
