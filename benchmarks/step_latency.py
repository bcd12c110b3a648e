"""Optimizer-step latency of every owner strategy and of other distributed Muons, in one run.

For each case (optimizer x model x mesh x world size) the script forks ``world`` gloo ranks on
the CPU, builds a Qwen3-like model (``_qwen.py``) sharded with FSDP2 (``--mesh fsdp``) or
FSDP x TP on a (2, 2) mesh (``--mesh fsdp_tp``), feeds every optimizer the same gradients
(seeded, set as DTensors in each parameter's placements) from the same initial weights, and
times ``optimizer.step()`` (barrier before each step; a step's time is the slowest rank's).
Strategies: ``replicated`` (every rank computes every matrix), ``round_robin``, ``count``,
``numel``, ``canzona`` and ``canzona`` without overlap; for Muon also the peers of
``_peers.py``; diagnostic variants of ``canzona`` (``VARIANTS``: no per-step checks, one
micro-group, pipeline depth 2 and 3, ``atomic=False``). One extra process runs the same
optimizer on the unsharded model: its compute time is the denominator of the redundancy
factor, and its parameters must equal the distributed ones bit for bit. The *structure* model
(``_structure.py``: per-head attention blocks, expert stacks under expert parallel, dense
MLPs) runs with its blocks declared by ``canzona.Split`` in the param groups.

For every strategy the script also predicts each rank's owner time from the measured cost
model of the ``canzona`` run (``_plan_facts.py``) and reports it next to the measured
``last_step_stats.compute_s``, with the calibration time. Full mode writes
``benchmarks/results/step_latency.json`` (with the commit it ran on), the ``step_latency``
section of ``docs/benchmarks.md`` and a chart under ``docs/img/``.

    python benchmarks/step_latency.py --quick          # 1.5-3 minutes on 2 cores
    python benchmarks/step_latency.py --full           # about 15 minutes
    python benchmarks/step_latency.py --from-json benchmarks/results/step_latency.json
    python benchmarks/step_latency.py --world 2 --mesh fsdp --optimizer muon --steps 20
    python benchmarks/step_latency.py --quick --model structure --world 2

Quick and tiny runs write under ``benchmarks/results/quick/`` unless ``--out``/``--doc``/
``--chart`` say otherwise (``run_all.py --quick`` passes them): only full mode touches the
published files.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _qwen
import _structure
from _latency_chart import draw_chart
from _latency_checks import _ratio, format_bound, format_measured
from _latency_ranks import (
    MUON_HP,
    OPTIMIZERS,
    SHAMPOO_HP,
    SLOW_PEER_STEPS,
    SOAP_HP,
    WARMUP,
    Case,
    model_mib,
    rank_body,
    single_body,
)
from _latency_report import evaluate_targets, explain, render
from _ranks import launch
from kernels import cpu_description

from _report import DOC, RESULTS, ROOT, update_section, write_json

#: Diagnostic variants per kind of case: ``muon`` (every Muon case), ``depth`` (added on the
#: heterogeneous and structure cases at world 2: the micro-group choice), ``precond``
#: (Shampoo and SOAP: the all-or-nothing step copies owner-held state).
DEPTH = ("canzona_one_group", "canzona_depth2", "canzona_depth3")
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(512,) * 4),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(768, 384, 384, 288)),
            "structure": _structure.StructureConfig(name="structure", width=768),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(256,) * 4),
            "w128": _qwen.ModelConfig(name="qwen3-like width 128", widths=(128,) * 2),
        },
        "steps": 10,
        # a 10 ms step: 10 of them last 0.1 s, inside one burst of this machine's noise
        "min_steps": {"w128": 60},
        "diagnostics": {
            "muon": (
                "canzona_unchecked",
                "canzona_one_group",
                "canzona_not_atomic",
                "canzona_free_buffers",
            ),
            "depth": DEPTH,
            "precond": ("canzona_not_atomic", "canzona_free_buffers"),
        },
        "peers": (
            "torchtitan",
            "muon_fsdp2",
            "muonium",
            "heavyball",
            "full_tensor",
            "torch_dtensor",
        ),
    },
    "quick": {
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(256,) * 4),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(384, 192, 192, 144)),
            "structure": _structure.StructureConfig(name="structure", width=256),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(128,) * 4),
            "w128": _qwen.ModelConfig(name="qwen3-like width 128", widths=(128,) * 2),
        },
        "steps": 8,
        "diagnostics": {
            "depth": (*DEPTH, "canzona_not_atomic"),
            "precond": ("canzona_not_atomic",),
        },
        "peers": ("torchtitan", "full_tensor"),
    },
    "tiny": {  # CI smoke tests: seconds, not a measurement
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(64,) * 2),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(96, 64, 48)),
            "structure": _structure.StructureConfig(name="structure", width=64),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(32,) * 2),
            "w128": _qwen.ModelConfig(name="qwen3-like width 128", widths=(32,) * 2),
        },
        "steps": 2,
        "diagnostics": {
            "depth": (*DEPTH, "canzona_not_atomic"),
            "precond": ("canzona_not_atomic", "canzona_free_buffers"),
        },
        "peers": ("full_tensor",),
    },
}
PLOT_PATH = ROOT / "docs" / "img" / "step_latency_compute.png"


# -------------------------------------------------------------------------------- the parent


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _measured_group_factor(per: list[dict[str, Any]]) -> float | None:
    """Measured per-group imbalance: the median over steps of the summed group maxima.

    Per step: the sum over micro-groups of the slowest rank's compute in the group, over the
    slowest rank's compute summed over the groups (1.0: every group as even as the totals).
    """
    factors = []
    for step in zip(*(p["stats"] for p in per), strict=True):
        groups = [s.get("group_compute_s", []) for s in step]
        if not groups[0] or len({len(g) for g in groups}) != 1:
            continue
        busiest = max(sum(g) for g in groups)
        if busiest > 0:
            factors.append(sum(max(col) for col in zip(*groups, strict=True)) / busiest)
    return _median(factors) if factors else None


def _prediction(predicted: list[float], run: dict[str, Any]) -> dict[str, Any]:
    """Predicted against measured owner time per rank, and the busiest rank's error."""
    wall, cpu = run["compute_s"], run["compute_cpu_s"]
    busiest = max(range(len(wall)), key=wall.__getitem__)
    busiest_cpu = max(range(len(cpu)), key=cpu.__getitem__)
    return {
        "predicted_s": predicted,
        "measured_s": wall,
        "measured_cpu_s": cpu,
        "busiest": busiest,
        "error": predicted[busiest] / wall[busiest] - 1 if wall[busiest] else None,
        "error_cpu": predicted[busiest_cpu] / cpu[busiest_cpu] - 1 if cpu[busiest_cpu] else None,
    }


def summarize(case: Case, ranks: list[dict[str, Any]], single: dict[str, Any]) -> dict[str, Any]:
    """Per-run medians, ratios, balance and redundancy for one case."""
    single_cpu = _median(single["cpu_compute"])
    single_wall = _median([s["compute_s"] for s in single["stats"]])
    out: dict[str, Any] = {
        "case": case.key,
        "optimizer": case.optimizer,
        "model": case.model_key,
        "model_name": case.model.name,
        "model_layers": case.model.describe(),
        "mesh": case.mesh,
        "world": case.world,
        "steps": case.steps,
        "capacity_mb": case.capacity_mb,
        "single_device": {
            "step_s": _median(single["times"]),
            "compute_cpu_s": single_cpu,
            "compute_s": single_wall,
            "matches_distributed": None,
        },
        "runs": {},
    }
    canz = ranks[0].get("canzona", {})
    if "full_fingerprint" in canz:
        out["single_device"]["matches_distributed"] = (
            canz["full_fingerprint"] == single["full_fingerprint"]
        )
    out["load_average"] = ranks[0]["_meta"]["load"]
    out["interleaved_seconds"] = ranks[0]["_meta"]["seconds"]
    out["param_bytes"] = [r["_meta"]["param_bytes"] for r in ranks]
    if "cost_table" in ranks[0]["_meta"]:
        out["cost_table"] = ranks[0]["_meta"]["cost_table"]
    if "pinned_bytes_sent" in ranks[0]["_meta"]:
        out["experts_bytes_sent"] = {
            s: [r["_meta"]["pinned_bytes_sent"][s] for r in ranks]
            for s in ranks[0]["_meta"]["pinned_bytes_sent"]
        }
    out["single_device"]["wall_over_cpu"] = single_wall / single_cpu if single_cpu else None
    for label in ranks[0]:
        if label.startswith("_"):
            continue
        per = [r[label] for r in ranks]
        if "error" in per[0]:
            out["runs"][label] = {"error": per[0]["error"]}
            continue
        steps = [max(ts) for ts in zip(*(p["times"] for p in per), strict=True)]
        run: dict[str, Any] = {
            "steps_s": steps,
            "step_s": _median(steps),
            "step_min_s": min(steps),
            "step_max_s": max(steps),
            "step_iqr_s": (
                statistics.quantiles(steps, n=4)[2] - statistics.quantiles(steps, n=4)[0]
            )
            if len(steps) >= 2
            else 0.0,
            "identical": all(
                p["fingerprint"] == p.get("reference_fingerprint", c["canzona"]["fingerprint"])
                for p, c in zip(per, ranks, strict=True)
            )
            if "canzona" in ranks[0] and "fingerprint" in ranks[0]["canzona"]
            else None,
            "max_rel_diff": max((p.get("max_rel_diff", 0.0) for p in per), default=0.0),
        }
        if per[0]["stats"]:
            cpu = [_median(p["cpu_compute"]) for p in per]
            wall = [_median([s["compute_s"] for s in p["stats"]]) for p in per]
            last = [p["stats"][-1] for p in per]
            run.update(
                compute_cpu_s=cpu,
                compute_s=wall,
                wait_s=[_median([s["wait_s"] for s in p["stats"]]) for p in per],
                balance=max(cpu) / statistics.mean(cpu) if statistics.mean(cpu) else float("nan"),
                balance_wall=max(wall) / statistics.mean(wall)
                if statistics.mean(wall)
                else float("nan"),
                redundancy=sum(cpu) / single_cpu if single_cpu else float("nan"),
                redundancy_wall=sum(wall) / single_wall if single_wall else float("nan"),
                bytes_sent=[s["bytes_sent"] for s in last],
                bytes_received=[s["bytes_received"] for s in last],
                collectives=[s["collectives"] for s in last],
                micro_groups=last[0]["micro_groups"],
                matrices_computed=[s["matrices_computed"] for s in last],
                backup_bytes=[s["backup_bytes"] for s in last],
                group_factor_measured=_measured_group_factor(per),
            )
        run["first_step_s"] = max((p["first_s"] or 0.0) for p in per)
        if "plan_versions" in per[0]:
            run["calibration_s"] = [p["calibration_s"] for p in per]
            versions = per[0]["plan_versions"]
            run["replans_after_first_step"] = versions[-1] - versions[0] if versions else None
            run["calibrations"] = max(p["calibrations"] for p in per)
            run["repricings"] = max(p["repricings"] for p in per)
            run["reprice_s"] = [p["reprice_s"] for p in per]
        if "plan" in per[0]:
            run["plan"] = per[0]["plan"]
            if "predicted_s" in run["plan"] and "compute_s" in run:
                run["prediction"] = _prediction(run["plan"]["predicted_s"], run)
        out["runs"][label] = run
    base = out["runs"].get("replicated", {}).get("step_s")
    ref = out["runs"].get("canzona", {}).get("step_s")
    for run in out["runs"].values():
        if "step_s" in run:
            run["vs_replicated"] = run["step_s"] / base if base else None
            run["vs_canzona"] = run["step_s"] / ref if ref else None
    return out


def plan_cases(args: argparse.Namespace, preset: dict[str, Any]) -> list[Case]:
    models = preset["models"]
    steps = args.steps or preset["steps"]
    peers = tuple(args.peers.split(",")) if args.peers is not None else preset["peers"]
    peers = tuple(p for p in peers if p)
    cases: list[Case] = []

    def add(optimizer: str, key: str, mesh: str, world: int, with_peers: bool) -> None:
        if args.world and world not in args.world:
            return
        if args.mesh and mesh not in args.mesh:
            return
        if args.optimizer and optimizer not in args.optimizer:
            return
        if args.model and key not in args.model:
            return
        model = models[key]
        # about four micro-groups per step for canzona: capacity = a quarter of a rank's share
        capacity = max(0.05, round(model_mib(model) / world / 4, 3))
        kinds = preset.get("diagnostics", {})
        diagnostics = kinds.get("muon" if optimizer == "muon" else "precond", ())
        if optimizer == "muon" and key in ("hetero", "structure") and world == 2:
            diagnostics = (
                *diagnostics,
                *(d for d in kinds.get("depth", ()) if d not in diagnostics),
            )
        cases.append(
            Case(
                optimizer=optimizer,
                model_key=key,
                model=model,
                mesh=mesh,
                world=world,
                steps=steps if args.steps else max(steps, preset.get("min_steps", {}).get(key, 0)),
                capacity_mb=capacity,
                peers=peers if with_peers else (),
                diagnostics=tuple(diagnostics),
            )
        )

    for world in (2, 4):
        add("muon", "qwen", "fsdp", world, True)
        add("muon", "hetero", "fsdp", world, False)
        add("muon", "structure", "fsdp", world, True)
        add("muon", "w128", "fsdp", world, False)  # small matrices: the runtime's own cost
    add("muon", "qwen", "fsdp_tp", 4, True)
    for optimizer in ("shampoo", "soap"):
        add(optimizer, "small", "fsdp", 4, False)
    return cases


def run_case(case: Case, timeout: float) -> dict[str, Any]:
    began = time.perf_counter()
    single = launch(single_body, 1, case, timeout=timeout)[0]
    ranks = launch(rank_body, case.world, case, timeout=timeout)
    summary = summarize(case, ranks, single)
    # each strategy's plan as it ran, priced in the closed-form FLOPs and in measured seconds
    for key, field_name in (
        ("planned_makespan_ratio", "makespan_ratio_flops"),
        ("planned_makespan_ratio_time", "makespan_ratio_time"),
    ):
        summary[key] = {
            s: summary["runs"][s]["plan"][field_name]
            for s in ("round_robin", "count", "numel", "canzona")
            if field_name in summary["runs"].get(s, {}).get("plan", {})
        }
    summary["bench_seconds"] = time.perf_counter() - began
    return summary


# -------------------------------------------------------------------------------- report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller models (default)")
    mode.add_argument("--full", action="store_true", help="step times of 0.3-1.5 s, all peers")
    mode.add_argument("--tiny", action="store_true", help="seconds; for smoke tests only")
    parser.add_argument("--world", type=int, nargs="+", choices=(2, 4), help="world sizes")
    parser.add_argument("--mesh", nargs="+", choices=("fsdp", "fsdp_tp"), help="meshes")
    parser.add_argument("--optimizer", nargs="+", choices=tuple(OPTIMIZERS), help="optimizers")
    parser.add_argument(
        "--model", nargs="+", choices=("qwen", "hetero", "structure", "small", "w128")
    )
    parser.add_argument("--steps", type=int, help="timed steps per run (>= 10 for a measurement)")
    parser.add_argument(
        "--peers", help="comma-separated peers (default: the preset's; '' for none)"
    )
    parser.add_argument(
        "--out", type=Path, help="directory of the JSON file (full: benchmarks/results)"
    )
    parser.add_argument("--doc", type=Path, help="Markdown file (full: docs/benchmarks.md)")
    parser.add_argument("--chart", type=Path, help="PNG of per-rank compute (full: docs/img/)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument(
        "--from-json", type=Path, help="only re-render the docs section from a results file"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.from_json:
        saved: dict[str, Any] = json.loads(args.from_json.read_text())
        _default_outputs(args, saved["mode"])
        return publish(saved, args, None)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    _default_outputs(args, name)
    preset = PRESETS[name]
    torch.set_num_threads(1)
    began = time.perf_counter()
    cases = plan_cases(args, preset)
    if not cases:
        parser.error("no case matches the chosen --world/--mesh/--optimizer/--model")
    results = []
    for case in cases:
        print(
            f"{case.key}: {case.model.describe()}, {len(case.strategies)} strategies, "
            f"peers {list(case.peers)}",
            flush=True,
        )
        summary = run_case(case, args.timeout)
        results.append(summary)
        for label, run in summary["runs"].items():
            if "error" in run:
                print(f"  {label:20s} did not run: {run['error'].splitlines()[-1][:120]}")
            else:
                print(
                    f"  {label:20s} {run['step_s'] * 1e3:8.1f} ms  x replicated "
                    f"{_ratio(run.get('vs_replicated'))}  x canzona {_ratio(run.get('vs_canzona'))}"
                    f"  same params: {run.get('identical')}",
                    flush=True,
                )
        print_prediction(summary)
    payload: dict[str, Any] = {
        "mode": name,
        "command": " ".join(["python benchmarks/step_latency.py", *(argv or [f"--{name}"])]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "steps": results[0]["steps"],
        "warmup": WARMUP,
        "slow_peer_steps": SLOW_PEER_STEPS,
        "models": {
            k: {
                "name": v.name,
                "widths": list(v.widths),
                "layers": v.describe(),
                "mib": model_mib(v),
            }
            for k, v in preset["models"].items()
        },
        "hyper_parameters": {"muon": MUON_HP, "shampoo": SHAMPOO_HP, "soap": SOAP_HP},
        "cases": results,
    }
    payload["bench_seconds"] = time.perf_counter() - began
    return publish(payload, args, name)


def print_prediction(summary: dict[str, Any]) -> None:
    """Per strategy and rank: predicted and measured owner time, the busiest rank's error."""
    canz = summary["runs"].get("canzona", {})
    if "calibration_s" in canz:
        print(
            f"  calibration {max(canz['calibration_s']):.3f} s (slowest rank), "
            f"re-plans after the first step: {canz.get('replans_after_first_step')}"
        )
    for label, run in summary["runs"].items():
        pred = run.get("prediction")
        if pred is None:
            continue
        ms = "/".join(f"{x * 1e3:.1f}" for x in pred["predicted_s"])
        wall = "/".join(f"{x * 1e3:.1f}" for x in pred["measured_s"])
        cpu = "/".join(f"{x * 1e3:.1f}" for x in pred["measured_cpu_s"])
        print(
            f"  {label:20s} owner ms predicted {ms} | measured {wall} (CPU {cpu}) | error "
            f"{100 * pred['error']:+.1f}% (CPU {100 * pred['error_cpu']:+.1f}%)"
        )


def _default_outputs(args: argparse.Namespace, mode: str) -> None:
    """Full mode writes the published files; the other modes under ``results/quick/``."""
    quick = RESULTS / "quick"
    if args.out is None:
        args.out = RESULTS if mode == "full" else quick
    if args.doc is None:
        args.doc = DOC if mode == "full" else quick / "benchmarks_quick.md"
    if args.chart is None:
        args.chart = PLOT_PATH if mode == "full" else quick / f"step_latency_{mode}.png"


def publish(payload: dict[str, Any], args: argparse.Namespace, name: str | None) -> dict[str, Any]:
    """Targets, notes and chart from the cases; the JSON (when ``name``) and the docs section."""
    payload["targets"] = evaluate_targets(payload["cases"])
    payload["notes"] = explain(payload)
    chart = draw_chart(payload["cases"], args.chart)
    payload["chart"] = str(chart) if chart else None
    payload["doc"] = str(args.doc)
    if name is not None:
        path = write_json(
            "step_latency" if name == "full" else f"step_latency_{name}", payload, out_dir=args.out
        )
        print(f"wrote {path}")
    machine = payload.get("machine") or _machine()
    update_section("step_latency", render({**payload, "machine": machine}), doc=args.doc)
    print(f"updated the 'step_latency' section of {args.doc}")
    for t in payload["targets"]:
        print(
            f"  {'ok  ' if t['met'] else 'MISS' if t['met'] is False else '--  '} "
            f"{t['name']}: {format_measured(t)} (target {format_bound(t)})"
        )
    return payload


def _machine() -> dict[str, Any]:
    from _report import machine_info

    return machine_info()


if __name__ == "__main__":
    main()
