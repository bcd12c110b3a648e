"""Fused exchanges: what sharing one all-to-all between small micro-groups saves, measured.

Two measurements on forked gloo ranks (one thread each), in one run:

* **Steps.** ``N`` small fp32 matrices (Muon with one fp32 Newton–Schulz iteration, so that
  the step is host work and collectives), ``Shard(0)`` on a ``(world,)`` mesh, a capacity
  that cuts the plan into ``G`` micro-groups; ``canzona.Muon`` with the default
  ``PipelineConfig(fuse_bytes=32 KiB)`` (``G + 1`` all-to-alls per step where the groups
  move at most 32 KiB per rank) and with
  ``fuse_bytes=0`` (``2G``) take turns step by step from the same weights on the same
  gradients. Median of the slowest rank's step; both end with the same parameters, compared
  bit for bit.
* **The limit.** Two all-to-alls of ``s`` bytes per rank (split evenly over the peers)
  issued together and waited for, against one of ``2s`` that packs both into one send buffer
  and copies both out of the receive buffer (what a fused exchange does): below the
  crossing point fusion saves time; ``fuse_bytes`` sits below it.

Writes ``benchmarks/results/fused_exchanges.json`` and the ``fused_exchanges`` section of
``docs/benchmarks.md``.

    python benchmarks/fused_exchanges.py --quick   # a reduced grid, under results/quick/
    python benchmarks/fused_exchanges.py --full    # the published grid, a few minutes
    python benchmarks/fused_exchanges.py --tiny --out /tmp/f --doc /tmp/f/b.md  # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import canzona
from _ranks import WARMUP, launch

from _report import machine_info, markdown_table, publish

KW: dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 1,
    "ns_dtype": torch.float32,
}
MIB = 1 << 20
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "worlds": (2, 4),
        "count": 64,
        "shape": (64, 32),
        "groups": (2, 4, 8, 16),
        "steps": 40,
        "sizes": (4 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, MIB),
        "calls": 100,
    },
    "quick": {
        "worlds": (2,),
        "count": 64,
        "shape": (64, 32),
        "groups": (4, 16),
        "steps": 12,
        "sizes": (16 << 10, 256 << 10),
        "calls": 15,
    },
    "tiny": {
        "worlds": (2,),
        "count": 8,
        "shape": (8, 8),
        "groups": (4,),
        "steps": 2,
        "sizes": (4 << 10,),
        "calls": 3,
    },
}
VARIANTS = {"fused": 32 << 10, "apart": 0}  # the default fuse_bytes, and off


def _slowest(start: float, end: float) -> float:
    """The slowest rank's duration of a call entered after a barrier (from its own start)."""
    t = torch.tensor([end - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _steps(
    rank: int, world: int, count: int, shape: tuple[int, int], groups: int, steps: int
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(shape, generator=gen) for _ in range(count)]
    grads = [torch.randn(shape, generator=gen) for _ in range(count)]
    # the bytes a rank owns, split into `groups` rounds (the planner balances owners)
    capacity_mb = count * shape[0] * shape[1] * 4 / world / groups / MIB
    runs: dict[str, Any] = {}
    for label, fuse in VARIANTS.items():
        params = [
            (f"w{i}", nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])))
            for i, f in enumerate(fulls)
        ]
        opt = canzona.Muon(
            params,
            **KW,
            plan=canzona.PlanConfig(capacity_mb=capacity_mb),
            pipeline=canzona.PipelineConfig(fuse_bytes=fuse),
        )
        runs[label] = {"params": params, "opt": opt, "times": []}
    dgrads = [distribute_tensor(g, mesh, [Shard(0)]) for g in grads]
    for i in range(steps + WARMUP):  # planning, first allocations, the re-pricing's re-plan
        for run in runs.values():
            for (_, p), g in zip(run["params"], dgrads, strict=True):
                p.grad = g
            dist.barrier()
            start = time.perf_counter()
            run["opt"].step()
            seconds = _slowest(start, time.perf_counter())
            if i >= WARMUP:
                run["times"].append(seconds)
    out: dict[str, Any] = {}
    for label, run in runs.items():
        stats = run["opt"].last_step_stats
        out[label] = {
            "step_s": statistics.median(run["times"]),
            "micro_groups": stats.micro_groups,
            "collectives": stats.collectives,
            "bytes_sent": stats.bytes_sent,
        }
    a, b = (
        torch.cat([p.detach().to_local().reshape(-1) for _, p in runs[k]["params"]])
        for k in VARIANTS
    )
    out["identical"] = bool(torch.equal(a, b))
    return out


def _apart(a: torch.Tensor, b: torch.Tensor, world: int) -> None:
    """Two all-to-alls issued together, then waited for."""
    splits = [a.numel() // world] * world
    oa, ob = torch.empty_like(a), torch.empty_like(b)
    wa = dist.all_to_all_single(oa, a, splits, splits, async_op=True)
    wb = dist.all_to_all_single(ob, b, splits, splits, async_op=True)
    wa.wait()
    wb.wait()


def _together(a: torch.Tensor, b: torch.Tensor, world: int) -> None:
    """One all-to-all carrying both (segments by peer), packed and copied out as fused."""
    n = a.numel() // world
    inp = torch.cat(
        [t for r in range(world) for t in (a[r * n : (r + 1) * n], b[r * n : (r + 1) * n])]
    )
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, [2 * n] * world, [2 * n] * world, async_op=True).wait()
    torch.cat([out[2 * r * n : (2 * r + 1) * n] for r in range(world)])
    torch.cat([out[(2 * r + 1) * n : (2 * r + 2) * n] for r in range(world)])


def _limit(rank: int, world: int, sizes: tuple[int, ...], calls: int) -> list[dict[str, Any]]:
    """Two all-to-alls of ``s`` bytes per rank against one fused one with its copies."""
    rows = []
    for size in sizes:
        n = size // 4 // world  # float32 elements per peer
        a, b = torch.randn(n * world), torch.randn(n * world)
        seen: dict[str, list[float]] = {"apart": [], "fused": []}
        for i in range(calls + 3):
            for label, fn in (("apart", _apart), ("fused", _together)):
                dist.barrier()
                start = time.perf_counter()
                fn(a, b, world)
                seconds = _slowest(start, time.perf_counter())
                if i >= 3:
                    seen[label].append(seconds)
        rows.append({"bytes": size, **{k: statistics.median(v) for k, v in seen.items()}})
    return rows


def _body(rank: int, world: int, preset: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    steps = {
        g: _steps(rank, world, preset["count"], preset["shape"], g, preset["steps"])
        for g in preset["groups"]
    }
    return {"steps": steps, "limit": _limit(rank, world, preset["sizes"], preset["calls"])}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _kib(size: int) -> str:
    return f"{size >> 10} KiB" if size < MIB else f"{size >> 20} MiB"


def render(payload: dict[str, Any]) -> str:
    preset = payload["preset"]
    m, n = preset["shape"]
    lines = [
        "## Fused exchanges: small micro-groups sharing all-to-alls",
        "",
        f"`python benchmarks/fused_exchanges.py --{payload['mode']}` ({payload['mode']} mode, "
        f"{payload['date']}, commit `{payload['commit']}`): {payload['cpu']}, "
        f"{machine_info()['cpu_count']} cores, torch {torch.__version__}, gloo, one thread per "
        f"rank; load average {payload['load_average']:.1f}. {preset['count']} matrices of "
        f"{m}x{n} (fp32, Muon with one fp32 Newton–Schulz iteration: host work and "
        "collectives), `Shard(0)`, a capacity that cuts the plan into the given number of "
        "micro-groups; the default `PipelineConfig(fuse_bytes=32 KiB)` and `fuse_bytes=0` take "
        f"turns step by step, median of the slowest rank over {preset['steps']} steps.",
        "",
    ]
    rows = []
    for world, result in payload["worlds"].items():
        for groups, r in result["steps"].items():
            f, a = r["fused"], r["apart"]
            per_rank = preset["count"] * m * n * 4 / int(world) / int(groups)
            rows.append(
                [
                    world,
                    groups,
                    f"{per_rank / 1024:.0f}",
                    f["micro_groups"],
                    f"{f['collectives']} / {a['collectives']}",
                    _ms(f["step_s"]),
                    _ms(a["step_s"]),
                    f"{f['step_s'] / a['step_s']:.3f}",
                    "yes" if r["identical"] and f["bytes_sent"] == a["bytes_sent"] else "**no**",
                ]
            )
    headers = [
        "world",
        "groups asked",
        "KiB per rank and group",
        "micro-groups",
        "all-to-alls, fused / apart",
        "step ms, fused",
        "step ms, apart",
        "fused / apart",
        "same parameters and bytes",
    ]
    lines += [markdown_table(headers, rows), ""]
    lines += [
        "The limit: two all-to-alls of *s* bytes per rank (split evenly over the peers) "
        "issued together, against one of 2*s* packed into one buffer and copied out of one "
        "(a fused exchange's work); median of the slowest rank over "
        f"{preset['calls']} calls.",
        "",
    ]
    rows = []
    for world, result in payload["worlds"].items():
        for r in result["limit"]:
            ratio = r["fused"] / r["apart"]
            rows.append([world, _kib(r["bytes"]), _ms(r["apart"]), _ms(r["fused"]), f"{ratio:.3f}"])
    headers = [
        "world",
        "bytes per rank and exchange",
        "two all-to-alls ms",
        "one fused ms",
        "ratio",
    ]
    lines += [markdown_table(headers, rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a reduced grid (default)")
    mode.add_argument("--full", action="store_true", help="the published grid")
    mode.add_argument("--tiny", action="store_true", help="seconds; smoke tests only")
    parser.add_argument("--out", type=Path, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, help="Markdown file")
    args = parser.parse_args(argv)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    preset = PRESETS[name]
    from kernels import cpu_description

    start = time.perf_counter()
    worlds = {str(w): launch(_body, w, preset)[0] for w in preset["worlds"]}
    payload: dict[str, Any] = {
        "mode": name,
        "command": f"python benchmarks/fused_exchanges.py --{name}",
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "load_average": os.getloadavg()[0],
        "preset": {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()},
        "worlds": worlds,
        "bench_seconds": time.perf_counter() - start,
    }
    publish("fused_exchanges", payload, render, mode=name, out=args.out, doc=args.doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
