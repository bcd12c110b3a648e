"""Ranks on one CUDA device for tests/runtime/test_gpu.py: spawned, each writes a JSON report.

CUDA cannot be used in a forked child, so these ranks are spawned (the fork pool of
``_dist.py`` serves the CPU tests). Several ranks share the one GPU of a test machine
through gloo (whose collectives take CUDA tensors); one rank also runs under NCCL.
"""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import canzona
from canzona.plan.measured import MeasuredCost
from canzona.runtime import calibrate as calibrate_module
from canzona.runtime import calibration_keys

# Four equal shapes (a batched stack on an owner) next to three distinct ones.
SHAPES = ((64, 32),) * 4 + ((32, 96), (48, 48), (96, 64))
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # set_sync_debug_mode("warn")


def launch(
    backend: str,
    world: int,
    tmp: Path,
    device: str = "cuda",
    timeout: float = 240.0,
    count_syncs: bool = True,
    capacity_mb: float | None = None,
    steps: int = 4,
) -> list[dict[str, Any]]:
    """Run :func:`_rank` on ``world`` spawned ranks; their reports in rank order.

    ``device="cpu"`` runs the same steps without the sync count (a dry run of this file), as
    does ``count_syncs=False`` on the GPU. ``capacity_mb`` cuts the plan into micro-groups
    (tiny ones share their all-to-alls, see ``PipelineConfig.fuse_bytes``). Syncs are
    counted in steps 2-4 (of ``steps``); from step 5 on the measured plan is re-priced by
    the calls of steps 2-4 (``PipelineConfig.reprice_steps``).
    """
    ctx = mp.get_context("spawn")
    init = f"file://{tmp / 'init'}"
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, world, backend, init, str(tmp), device, count_syncs, capacity_mb, steps),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        logs = [
            f"--- rank {r} {kind} ---\n{(tmp / f'{r}.{kind}').read_text()}"
            for r in range(world)
            for kind in ("err", "progress", "fault")
            if (tmp / f"{r}.{kind}").exists()
        ]
        raise RuntimeError(f"{backend} ranks exited with {codes}:\n" + "\n".join(logs))
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(world)]


def _rank(
    rank: int,
    world: int,
    backend: str,
    init: str,
    out: str,
    device: str,
    count_syncs: bool,
    capacity_mb: float | None,
    steps: int,
) -> None:
    fault = Path(out, f"{rank}.fault").open("w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(fault)  # a crash in C++ still names the Python line
    if not hasattr(dist, "all_gather_single"):  # torch < 2.13 (a GPU image's own torch)
        dist.all_gather_single = dist.all_gather_into_tensor  # type: ignore[attr-defined]
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        progress = Path(out, f"{rank}.progress")
        report = _steps(rank, world, device, count_syncs, progress, capacity_mb, steps)
        Path(out, f"{rank}.json").write_text(json.dumps(report))
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _steps(
    rank: int,
    world: int,
    device: str,
    count_syncs: bool,
    progress: Path,
    capacity_mb: float | None = None,
    steps: int = 4,
) -> dict[str, Any]:
    """``steps`` steps of canzona.Muon on Shard(0) DTensors next to torch.optim.Muon on the wholes.

    Steps 2-4 (and no others) run under ``torch.cuda.set_sync_debug_mode("warn")``; every
    warning it raises on this thread is one host synchronisation, located at the line of
    ours that caused it.
    """
    mesh = init_device_mesh(device, (world,))
    gen = torch.Generator(device=device).manual_seed(0)
    cuda = device == "cuda"
    count_syncs = count_syncs and cuda

    def shard(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            t.chunk(world, 0)[rank].clone(), mesh, [Shard(0)], run_check=False
        )

    fulls = [torch.randn(s, device=device, generator=gen) for s in SHAPES]
    params = [nn.Parameter(shard(f)) for f in fulls]
    ref = [nn.Parameter(f.clone()) for f in fulls]
    bias = nn.Parameter(shard(torch.randn(8, device=device, generator=gen)))
    plan = (
        canzona.PlanConfig() if capacity_mb is None else canzona.PlanConfig(capacity_mb=capacity_mb)
    )
    groups = [{"params": params}, {"params": [bias], "algorithm": "adamw"}]
    opt = canzona.Muon(groups, lr=0.02, plan=plan)
    ref_opt = torch.optim.Muon(ref, lr=0.02)
    counts: list[int] = []

    def mark(what: str) -> None:
        with progress.open("a") as f:
            f.write(what + "\n")

    sites: set[str] = set()
    for step in range(steps):
        grads = [torch.randn(s, device=device, generator=gen) for s in SHAPES]
        for p, q, g in zip(params, ref, grads, strict=True):
            p.grad, q.grad = shard(g), g.clone()
        bias.grad = shard(torch.randn(8, device=device, generator=gen))
        ref_opt.step()
        mark(f"step {step}")
        if cuda:
            torch.cuda.synchronize()
        if (
            step == 0 or step > 3 or not count_syncs
        ):  # planning, calibration and kernel probes read the device
            opt.step()
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [w for w in caught if SYNC_MESSAGE in str(w.message)]
        counts.append(len(syncs))
        sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    if cuda:
        torch.cuda.synchronize()
    mark("steps done")
    # each rank compares its own rows (no collective needed for the check)
    equal = [
        bool(torch.equal(p.to_local(), q.detach().chunk(world, 0)[rank]))
        for p, q in zip(params, ref, strict=True)
    ]
    made = opt._runtime.plan
    models = list(made.optimizer.models.values()) if made is not None else []
    return {
        "syncs_per_step": counts,
        "sync_sites": sorted(sites),
        "bitwise": equal,
        "cost_models": sorted({type(m).__name__ for m in models}),
        "timed_shapes": sorted(
            [list(k) for m in models if isinstance(m, MeasuredCost) for k, _ in m.table]
        ),
        "timed_on": sorted({str(k[0]) for k in calibrate_module._CACHE}),
        "device": calibration_keys.device_name(torch.device(device)),
        "planned": made is not None,
        "bytes_sent": opt.last_step_stats.bytes_sent if opt.last_step_stats else -1,
        "micro_groups": opt.last_step_stats.micro_groups if opt.last_step_stats else -1,
        "collectives": opt.last_step_stats.collectives if opt.last_step_stats else -1,
        "repricings": opt._runtime.repricings,
        "priced_shapes": sorted(
            [list(k) for m in models if isinstance(m, MeasuredCost) for k in m._index]
        ),
    }
