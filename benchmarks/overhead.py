"""Runtime overhead: step time against the number of matrices, with almost no math to hide it.

Every implementation updates ``N`` small matrices (8x8 or 64x32, fp32) with Muon's settings
except one fp32 Newton–Schulz iteration, so what remains of a step is host work (Python loops,
allocations, packing, collectives). On ``world`` forked gloo ranks (one thread each) the
matrices are ``Shard(0)`` DTensors on a ``(world,)`` mesh; world 1 uses plain tensors.
Implementations: ``canzona.Muon`` with the ``canzona`` and the ``replicated`` plan, torchtitan
0.3.0's DistMuon (world >= 2, where it runs) and, in one process on the full matrices,
``torch.optim.Muon`` (``ns_steps=1``) and ``torch.optim.AdamW(foreach=True)``. A step's time
is the slowest rank's (barrier before each step), the median over the timed steps; in full
mode every case runs in three launches (the one-process baselines three times) and the median
over them counts, since on a shared 2-core machine one launch's steps can all be slow together
(the ``redistribute`` Muon runs in the first launch only; every launch's value is in the JSON).
Per implementation the script fits ``time = fixed + slope * N`` (least squares over the N values)
and writes ``benchmarks/results/overhead.json`` (with the commit it ran on), the ``overhead``
section of ``docs/benchmarks.md`` and a plot of step time against N. After the timed steps,
rank 0's shards of the distributed runs that do the same fp32 math (``SAME_MATH``) are
compared bit for bit with the same rows of the one-process ``canzona.Muon`` (same matrices,
gradients and number of steps). Each distributed ``canzona`` case then records its steps'
all-to-all calls and takes turns with their replay without canzona (``_replay.py``): rank 0's
host time between the calls, its time inside them, and the replay's.

    python benchmarks/overhead.py --quick      # a reduced grid, about a minute; under
                                               # benchmarks/results/quick/
    python benchmarks/overhead.py --full       # the published grid, a few minutes
    python benchmarks/overhead.py --tiny --out /tmp/o --doc /tmp/o/b.md   # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import hashlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers
import canzona
from _overhead_report import (
    FLOOR_CALLS,
    IMPLS,
    ONLY_IN,
    REPLAY_TURNS,
    SLOW_STEPS,
    draw,
    fit_line,
    render,
)
from _ranks import WARMUP, launch
from _replay import replay
from kernels import cpu_description

from _report import (
    DOC,
    RESULTS,
    ROOT,
    machine_info,
    update_section,
    write_json,
)

HP: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
MUON_KW: dict[str, Any] = {**HP, "ns_steps": 1}
CANZONA_KW: dict[str, Any] = {**MUON_KW, "ns_dtype": torch.float32}
#: Shampoo and SOAP with their roots or bases computed once, in the warm-up: the timed steps
#: precondition without a decomposition (the host work per matrix, like Muon's one iteration).
SHAMPOO_KW: dict[str, Any] = {
    "lr": 1e-3,
    "start_preconditioning_step": 1,
    "precondition_frequency": 10**6,
}
SOAP_KW: dict[str, Any] = {"lr": 1e-3, "precondition_frequency": 10**6}
SHAPES = {"8x8": (8, 8), "64x32": (64, 32)}
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "counts": (16, 64, 256, 1024, 4096),
        "worlds": (1, 2, 4),
        "shapes": ("8x8", "64x32"),
        "steps": 12,
        "impls": IMPLS,
        "launches": 3,
    },
    "quick": {
        "counts": (16, 256, 1024),
        "worlds": (1, 2),
        "shapes": ("8x8",),
        "steps": 6,
        "impls": IMPLS,
    },
    "tiny": {  # smoke tests: seconds, not a measurement (no torchtitan: its import is slow)
        "counts": (4, 16),
        "worlds": (1, 2),
        "shapes": ("8x8",),
        "steps": 2,
        "impls": tuple(i for i in IMPLS if i != "torchtitan"),
    },
}
#: Targets at world 2 on the 8x8 matrices.
TARGETS = {"slope_us": 15.0, "fixed_ms": 1.0, "vs_adamw": 1.5, "vs_torchtitan": 0.25}
#: Implementations running canzona's fp32 Newton–Schulz: bitwise comparable with the
#: one-process ``canzona.Muon`` (torchtitan's DistMuon runs its own, in bf16).
SAME_MATH = ("canzona", "canzona_gc_on", "replicated", "redistribute")


class RedistributeMuon(torch.optim.Optimizer):
    """Muon whose reconstruction is ``DTensor.redistribute``.

    Each matrix is made ``Replicate`` (an all-gather to every rank), orthogonalised on every
    rank (one fp32 Newton–Schulz iteration, like the others here) and redistributed back to its
    placements (a local slice). The same work as canzona's ``replicated`` plan, with
    DTensor's per-matrix collectives instead of one packed all-to-all per micro-group.
    """

    def __init__(self, params: list[torch.Tensor], **hp: Any) -> None:
        super().__init__(params, dict(hp))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.distributed.tensor import Replicate

        from canzona.updates import muon_direction, muon_lr

        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                blended = p.grad.lerp(buf, group["momentum"])
                full = blended.redistribute(p.device_mesh, [Replicate()]).to_local()
                update = muon_direction(full, steps=1, dtype=torch.float32)
                ones = torch.distributed.tensor.DTensor.from_local(
                    update, p.device_mesh, [Replicate()], run_check=False
                )
                local = ones.redistribute(p.device_mesh, p.placements)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(local, alpha=-muon_lr(group["lr"], None, p.shape))


def _matrices(count: int, shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(count)]


#: Fields of ``last_step_stats`` in the step profile (seconds, except the counts).
PHASES = ("total_s", "compute_s", "wait_s", "apply_s", "collectives", "batches")


def _time_steps(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    steps: int,
    distributed: bool,
    phases: dict[str, float] | None = None,
) -> float:
    """Median seconds of ``opt.step()`` (the slowest rank's when distributed).

    With ``phases`` (a canzona optimizer), it receives this rank's median over the timed steps
    of each :data:`PHASES` field of ``last_step_stats``.
    """
    times = []
    seen: dict[str, list[float]] = {k: [] for k in ("step_s", "skew_s", "from_last_s", *PHASES)}
    # canzona: planning, first allocations, a measured plan's re-pricing (_ranks.WARMUP);
    # the others: two (their first allocations; the slowest take 20 s a step here)
    warmup = WARMUP if hasattr(opt, "_runtime") else 2
    for i in range(steps + warmup):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        mine = end - start
        # perf_counter is the machine's monotonic clock: comparable across the ranks
        starts, ends = _gather_times(start, end) if distributed else ([start], [end])
        if i >= warmup:
            times.append(max(e - s for s, e in zip(starts, ends, strict=True)))
            stats = getattr(opt, "last_step_stats", None)
            if phases is not None and stats is not None:
                seen["step_s"].append(mine)
                seen["skew_s"].append(max(starts) - min(starts))
                seen["from_last_s"].append(max(ends) - max(starts))
                for k in PHASES:
                    seen[k].append(float(getattr(stats, k)))
    if phases is not None and all(seen.values()):
        phases.update({k: statistics.median(v) for k, v in seen.items()})
    return statistics.median(times)


def _gather_times(start: float, end: float) -> tuple[list[float], list[float]]:
    """Every rank's ``(start, end)`` of the same step, in rank order."""
    out = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([start, end], dtype=torch.float64))
    return [float(t[0]) for t in out], [float(t[1]) for t in out]


def _all_to_all_floor(world: int) -> dict[str, float]:
    """One small all-to-all: its latency and the host time of issuing it, medians in seconds.

    ``latency``: from the last rank's entry to the last exit, when every rank enters it
    together: what a step pays per collective before any host work or waiting for a peer.
    ``issue_wrapper`` / ``issue_direct``: rank 0's time in the call that issues it, through
    ``dist.all_to_all_single`` and through the runtime's own call on the process group
    (``canzona.runtime.alltoall``), taken in turn.
    """
    from canzona.runtime.alltoall import all_to_all

    inp, out = torch.zeros(4 * world), torch.empty(4 * world)
    seen: dict[str, list[float]] = {"latency": [], "issue_wrapper": [], "issue_direct": []}
    for i in range(FLOOR_CALLS + 5):
        for how in ("issue_wrapper", "issue_direct"):
            dist.barrier()
            start = time.perf_counter()
            if how == "issue_wrapper":
                work = dist.all_to_all_single(out, inp, async_op=True)
            else:
                work = all_to_all(out, inp, (), (), None)
            issued = time.perf_counter()
            work.wait()
            starts, ends = _gather_times(start, time.perf_counter())
            if i >= 5:
                seen[how].append(issued - start)
                if how == "issue_wrapper":
                    seen["latency"].append(max(ends) - max(starts))
    return {k: statistics.median(v) for k, v in seen.items()}


def _fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes (bitwise identity check)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _first_rows(params: Sequence[torch.Tensor], world: int) -> str:
    """Fingerprint of the rows rank 0 holds under ``Shard(0)`` on ``world`` ranks."""
    return _fingerprint([p.detach().chunk(world, dim=0)[0] for p in params])


def _distributed_case(
    rank: int, world: int, count: int, shape: tuple[int, int], steps: int, impls: Sequence[str]
) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    fulls, full_grads = _matrices(count, shape, 0), _matrices(count, shape, 1)
    times: dict[str, Any] = {}
    prints: dict[str, str] = {}
    profile: dict[str, float] = {}
    makers: dict[str, Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]] = {
        "canzona": lambda ps: canzona.Muon(ps, **CANZONA_KW),
        "canzona_gc_on": lambda ps: canzona.Muon(
            ps, **CANZONA_KW, pipeline=canzona.PipelineConfig(pause_gc=False)
        ),
        "replicated": lambda ps: canzona.Muon(
            ps, **CANZONA_KW, plan=canzona.PlanConfig(strategy="replicated")
        ),
        "torchtitan": lambda ps: _peers.torchtitan_dist_muon(ps, mesh, {**HP, "ns_steps": 1}),
        "redistribute": lambda ps: RedistributeMuon([p for _, p in ps], **HP),
        "shampoo": lambda ps: canzona.Shampoo(ps, **SHAMPOO_KW),
        "soap": lambda ps: canzona.SOAP(ps, **SOAP_KW),
    }
    for impl, make in makers.items():
        if impl not in impls:
            continue
        named = [
            (f"layers.{i % 8}.w{i}", nn.Parameter(distribute_tensor(f.clone(), mesh, [Shard(0)])))
            for i, f in enumerate(fulls)
        ]
        grads = [distribute_tensor(g, mesh, [Shard(0)]) for g in full_grads]
        try:
            opt = make(named)
            timed = min(steps, SLOW_STEPS.get(impl, steps))
            phases = profile if impl == "canzona" else None
            times[impl] = _time_steps(opt, [p for _, p in named], grads, timed, True, phases)
        except Exception as exc:  # a peer that cannot run here is recorded, not fatal
            times[impl] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        if impl in SAME_MATH and timed == steps:  # comparable with the one-process reference
            prints[impl] = _fingerprint([_local(p) for _, p in named])
        if phases is not None:  # after the fingerprint: the replay takes more steps
            turns = max(timed, REPLAY_TURNS)
            profile.update(replay(opt, [p for _, p in named], grads, turns, _gather_times))
    if profile:
        floor = _all_to_all_floor(world)
        profile["all_to_all_s"] = floor["latency"]
        profile["issue_wrapper_s"] = floor["issue_wrapper"]
        profile["issue_direct_s"] = floor["issue_direct"]
    return {"times": times, "fingerprints": prints, "profile": profile}


def _one_process(
    count: int, shape: tuple[int, int], steps: int, impls: Sequence[str], worlds: Sequence[int]
) -> dict[str, Any]:
    """One process on the full matrices; fingerprints of rank 0's rows for every world."""
    fulls, grads = _matrices(count, shape, 0), _matrices(count, shape, 1)
    makers: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
        "canzona": lambda ps: canzona.Muon(ps, **CANZONA_KW),
        "torch_muon": lambda ps: torch.optim.Muon(ps, **MUON_KW),
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    times: dict[str, Any] = {}
    rows: dict[int, str] = {}
    for impl, make in makers.items():
        if impl not in impls and impl != "canzona":  # canzona is the exactness reference
            continue
        params = [nn.Parameter(f.clone()) for f in fulls]
        elapsed = _time_steps(make(params), params, grads, steps, False)
        if impl in impls:
            times[impl] = elapsed
        if impl == "canzona":
            rows = {w: _first_rows(params, w) for w in worlds}
    return {"times": times, "reference_rows": rows}


def _median(values: Sequence[Any]) -> Any:
    """The median of the launches' seconds (lower middle); a failure when none ran."""
    seconds = sorted(v for v in values if isinstance(v, float))
    return seconds[(len(seconds) - 1) // 2] if seconds else values[0]


def run(preset: dict[str, Any]) -> dict[str, Any]:
    """Every (shape, N, world) case; rows of seconds per implementation.

    Each distributed row also says, per canzona-built implementation, whether rank 0's
    parameters equal the one-process ``canzona.Muon`` rows bit for bit (``same_as_one_process``).
    """
    rows: list[dict[str, Any]] = []
    impls = tuple(preset["impls"])
    worlds = tuple(preset["worlds"])
    for shape_name in preset["shapes"]:
        shape = SHAPES[shape_name]
        for count in preset["counts"]:
            reference: dict[int, str] = {}
            for world in worlds:
                began = time.perf_counter()
                row: dict[str, Any] = {"shape": shape_name, "world": world, "n": count}
                repeats = preset.get("launches", 1)
                if world == 1:
                    runs = [_one_process(count, shape, preset["steps"], impls, worlds)]
                    runs += [
                        _one_process(count, shape, preset["steps"], impls, ())
                        for _ in range(repeats - 1)
                    ]
                    reference = runs[0]["reference_rows"]
                else:
                    here = tuple(
                        i
                        for i in impls
                        if ONLY_IN.get(i, (shape_name, world)) == (shape_name, world)
                    )
                    again = tuple(i for i in here if i not in SLOW_STEPS)
                    runs = [
                        launch(_distributed_case, world, count, shape, preset["steps"], todo)[0]
                        for todo in (here, *[again] * (repeats - 1))
                    ]
                    if world in reference:
                        row["same_as_one_process"] = {
                            impl: fp == reference[world]
                            for impl, fp in runs[0]["fingerprints"].items()
                        }
                row["launches"] = {
                    impl: [r["times"][impl] for r in runs if impl in r["times"]]
                    for impl in runs[0]["times"]
                }
                row["times"] = {impl: _median(v) for impl, v in row["launches"].items()}
                profiled = [r for r in runs if r.get("profile")]
                if profiled:  # rank 0's canzona step by phase, from the median launch
                    profiled.sort(key=lambda r: r["times"]["canzona"])
                    row["profile"] = profiled[(len(profiled) - 1) // 2]["profile"]
                rows.append(row)
                print(
                    f"{shape_name} world {world} N {count}: "
                    + ", ".join(
                        f"{k} {v * 1e3:.2f} ms" if isinstance(v, float) else f"{k} failed"
                        for k, v in row["times"].items()
                    )
                    + f" ({time.perf_counter() - began:.0f} s)",
                    flush=True,
                )
    return {"rows": rows, "fits": fits(rows)}


def fits(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``fixed`` (ms) and ``slope`` (µs per matrix) per shape, world and implementation."""
    out = []
    keys = sorted({(r["shape"], r["world"]) for r in rows})
    for shape, world in keys:
        case = [r for r in rows if (r["shape"], r["world"]) == (shape, world)]
        for impl in IMPLS:
            points = [
                (r["n"], r["times"][impl]) for r in case if isinstance(r["times"].get(impl), float)
            ]
            if len(points) < 2:
                continue
            fixed, slope = fit_line(points)
            out.append(
                {
                    "shape": shape,
                    "world": world,
                    "impl": impl,
                    "fixed_ms": fixed * 1e3,
                    "slope_us": slope * 1e6,
                }
            )
    return out


def _lookup(rows: Sequence[dict[str, Any]], shape: str, world: int, n: int, impl: str) -> Any:
    for r in rows:
        if (r["shape"], r["world"], r["n"]) == (shape, world, n):
            return r["times"].get(impl)
    return None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets at world 2 on 8x8 matrices, measured against their limits."""
    rows, out = result["rows"], []
    fit = {(f["impl"]): f for f in result["fits"] if (f["shape"], f["world"]) == ("8x8", 2)}
    if "canzona" in fit:
        out.append(
            {
                "target": "slope (µs per matrix)",
                "limit": TARGETS["slope_us"],
                "value": fit["canzona"]["slope_us"],
            }
        )
        out.append(
            {
                "target": "fixed (ms per step)",
                "limit": TARGETS["fixed_ms"],
                "value": fit["canzona"]["fixed_ms"],
            }
        )
    ours = _lookup(rows, "8x8", 2, 1024, "canzona")
    adamw = _lookup(rows, "8x8", 1, 1024, "adamw_foreach")
    titan = _lookup(rows, "8x8", 2, 1024, "torchtitan")
    if isinstance(ours, float) and isinstance(adamw, float):
        out.append(
            {
                "target": "1024 matrices: canzona / one-process AdamW(foreach)",
                "limit": TARGETS["vs_adamw"],
                "value": ours / adamw,
            }
        )
    if isinstance(ours, float) and isinstance(titan, float):
        out.append(
            {
                "target": "1024 matrices: canzona / torchtitan DistMuon",
                "limit": TARGETS["vs_torchtitan"],
                "value": ours / titan,
            }
        )
    for t in out:
        t["met"] = t["value"] <= t["limit"]
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the grid of the chosen mode; write the JSON, the plot and the section; return both."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="reduced grid (default)")
    mode.add_argument("--full", action="store_true", help="the published grid")
    mode.add_argument("--tiny", action="store_true", help="seconds; for smoke tests only")
    parser.add_argument("--out", type=Path, default=None, help="directory of the JSON result")
    parser.add_argument("--doc", type=Path, default=None, help="Markdown file to update")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of step time against N")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    preset = PRESETS[name]
    torch.set_num_threads(1)
    began = time.perf_counter()
    load0 = os.getloadavg()[0]
    result = run(preset)
    payload: dict[str, Any] = {
        "mode": name,
        "command": " ".join(["python benchmarks/overhead.py", *(argv or [f"--{name}"])]),
        "date": time.strftime("%Y-%m-%d"),
        "preset": {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()},
        "warmup": WARMUP,
        "load_average": (load0 + os.getloadavg()[0]) / 2,
        **result,
        "targets": targets(result),
        "bench_seconds": time.perf_counter() - began,
    }
    full = name == "full"
    out_dir = args.out or (RESULTS if full else RESULTS / "quick")
    plot = args.plot or (
        ROOT / "docs" / "img" / "overhead.png" if full else out_dir / f"overhead_{name}.png"
    )
    drawn = draw(payload, plot)
    payload["plot"] = str(plot) if drawn else None
    payload["machine"] = machine_info()
    payload["cpu"] = cpu_description()
    path = write_json("overhead" if full else f"overhead_{name}", payload, out_dir=out_dir)
    doc = args.doc or (DOC if full else out_dir / "benchmarks_quick.md")
    rel = Path(os.path.relpath(plot, doc.parent)).as_posix() if drawn else None
    update_section("overhead", render(payload, rel), doc=doc)
    print(f"wrote {path} and the 'overhead' section of {doc}")
    for t in payload["targets"]:
        verdict = "met" if t["met"] else "MISSED"
        print(f"target {t['target']}: {t['value']:.3g} (limit {t['limit']:g}) {verdict}")
    return payload


if __name__ == "__main__":
    main()
