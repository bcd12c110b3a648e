"""Python's garbage collector inside a step: collections started, their time, the step's time.

A step over many matrices creates and drops thousands of short-lived tensor objects in bursts;
with the collector on, the bursts start collections inside the step. On world 2 forked gloo
ranks (one thread each) the overhead benchmark's setup (``N`` 8x8 fp32 ``Shard(0)`` matrices,
Muon with one fp32 Newton–Schulz iteration) runs two ``canzona.Muon`` on their own copies of
the same matrices in one launch: ``PipelineConfig(pause_gc=True)`` (the default) and
``pause_gc=False``, step by step in turn. For each, rank 0's collections that start while
``step()`` runs are counted by generation (``gc.callbacks``) and timed, next to the step time
(the slowest rank's, barrier before each step). Then one full collection (``gc.collect()``)
is timed with the number of objects the process tracks: what a full collection costs the step
it lands in. The two optimizers must end with bitwise equal parameters.

    python benchmarks/gc_in_step.py --full    # the published numbers, about two minutes
    python benchmarks/gc_in_step.py --tiny --out /tmp/g --doc /tmp/g/b.md   # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import gc
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
from overhead import CANZONA_KW, _fingerprint, _gather_times, _local, _matrices

from _report import markdown_table, publish

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"counts": (256, 1024, 4096), "steps": 30},
    "quick": {"counts": (1024,), "steps": 10},
    "tiny": {"counts": (64,), "steps": 3},
}
VARIANTS = {"paused": True, "on": False}


class _Collections:
    """Collections that start while :attr:`inside` is set: generation and seconds of each."""

    def __init__(self) -> None:
        self.inside = False
        self.seen: list[tuple[int, float]] = []
        self._start: tuple[int, float] | None = None

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = (info["generation"], time.perf_counter()) if self.inside else None
        elif self._start is not None:
            generation, began = self._start
            self.seen.append((generation, time.perf_counter() - began))
            self._start = None


def _case(rank: int, world: int, count: int, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fulls, full_grads = _matrices(count, (8, 8), 0), _matrices(count, (8, 8), 1)
    grads = [distribute_tensor(g, mesh, [Shard(0)]) for g in full_grads]
    runs: dict[str, dict[str, Any]] = {}
    for name, pause in VARIANTS.items():
        named = [
            (f"layers.{i % 8}.w{i}", nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])))
            for i, f in enumerate(fulls)
        ]
        pipeline = canzona.PipelineConfig(pause_gc=pause)
        runs[name] = {
            "params": [p for _, p in named],
            "opt": canzona.Muon(named, **CANZONA_KW, pipeline=pipeline),
            "watch": _Collections(),
            "times": [],
        }
    for run in runs.values():
        gc.callbacks.append(run["watch"])
    try:
        for i in range(steps + WARMUP):  # the warm-up steps each (_ranks.WARMUP)
            for run in runs.values():
                for p, g in zip(run["params"], grads, strict=True):
                    p.grad = g
                dist.barrier()
                timed = i >= WARMUP
                run["watch"].inside = timed
                start = time.perf_counter()
                run["opt"].step()
                end = time.perf_counter()
                run["watch"].inside = False
                starts, ends = _gather_times(start, end)
                if timed:
                    run["times"].append(max(ends) - min(starts))
    finally:
        for run in runs.values():
            gc.callbacks.remove(run["watch"])
    objects = len(gc.get_objects())
    began = time.perf_counter()
    gc.collect()
    full_s = time.perf_counter() - began
    out: dict[str, Any] = {"objects": objects, "full_collection_s": full_s, "variants": {}}
    for name, run in runs.items():
        seen = run["watch"].seen
        out["variants"][name] = {
            "step_s": statistics.median(run["times"]),
            "per_step": {str(g): sum(1 for gen, _ in seen if gen == g) / steps for g in (0, 1, 2)},
            "collection_s_per_step": sum(s for _, s in seen) / steps,
            "fingerprint": _fingerprint([_local(p) for p in run["params"]]),
        }
    return out


def run(preset: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for count in preset["counts"]:
        began = time.perf_counter()
        result = launch(_case, 2, count, preset["steps"])[0]
        prints = {v["fingerprint"] for v in result["variants"].values()}
        rows.append({"n": count, **result, "same_parameters": len(prints) == 1})
        print(f"N {count}: {time.perf_counter() - began:.0f} s", flush=True)
    return rows


def render(payload: dict[str, Any]) -> str:
    """The Markdown section of docs/benchmarks.md."""
    lines = [
        "## Garbage collection in the step",
        "",
        f"`{payload['command']}` ({payload['mode']} mode, {payload['date']}, commit "
        f"`{payload['commit']}`, {payload['cpu']}): the overhead benchmark's setup (N 8x8 fp32 "
        "matrices, `Shard(0)` on 2 forked gloo ranks, Muon with one fp32 Newton–Schulz "
        "iteration), two `canzona.Muon` in one launch taking turns step by step: "
        "`PipelineConfig(pause_gc=True)` (the default) and `pause_gc=False`. Rank 0's "
        "collections that start inside `step()`, per step by generation, and the time they "
        f"take; median step time (slowest rank) over {payload['preset']['steps']} steps after "
        f"{WARMUP} warm-up steps. *Full collection*: one `gc.collect()` after the steps, with the "
        "objects the process tracks (what a full collection costs the step it lands in).",
        "",
    ]
    body = []
    for r in payload["rows"]:
        for name in VARIANTS:
            v = r["variants"][name]
            body.append(
                [
                    r["n"],
                    f"`pause_gc={VARIANTS[name]}`",
                    f"{v['step_s'] * 1e3:.2f}",
                    " / ".join(f"{v['per_step'][g]:.2f}" for g in ("0", "1", "2")),
                    f"{v['collection_s_per_step'] * 1e3:.3f}",
                    f"{r['full_collection_s'] * 1e3:.0f} ms, {r['objects']:,} objects",
                    "yes" if r["same_parameters"] else "**no**",
                ]
            )
    lines += [
        markdown_table(
            [
                "N",
                "setting",
                "step ms",
                "collections per step (gen 0 / 1 / 2)",
                "ms in them per step",
                "full collection",
                "same parameters",
            ],
            body,
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one N (default)")
    mode.add_argument("--full", action="store_true", help="the published numbers")
    mode.add_argument("--tiny", action="store_true", help="seconds; smoke tests only")
    parser.add_argument("--out", type=Path, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, help="Markdown file")
    args = parser.parse_args(argv)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    from kernels import cpu_description

    preset = PRESETS[name]
    start = time.perf_counter()
    payload: dict[str, Any] = {
        "mode": name,
        "command": f"python benchmarks/gc_in_step.py --{name}",
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "preset": {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()},
        "rows": run(preset),
    }
    payload["bench_seconds"] = time.perf_counter() - start
    publish("gc_in_step", payload, render, mode=name, out=args.out, doc=args.doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
