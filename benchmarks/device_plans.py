"""Plans priced on a device: every strategy's owners in the seconds a GPU calibration measured.

``benchmarks/gpu_check.sh`` runs ``canzona calibrate --device cuda --world W`` on Qwen3
models (one table per model, split and world size, each shape timed on the stack an owner
of a W-rank plan forms, under ``benchmarks/results/device_costs/``). This script plans each
model for each of those world sizes with every strategy, ``canzona`` twice: on the measured
table (what the runtime plans with, ``PlanConfig(cost="measured")``) and on the closed-form
FLOPs (``cost="flops"``), and prices every plan's owner math in the table's seconds, batch
by batch as the runtime stacks it (``predict_seconds``: per micro-group, rank and shape, one
call of ``fixed + k * per_matrix``). Pure-Python planning on the CPU; no device needed.
Writes ``benchmarks/results/device_plans.json`` and the ``device_plans`` section of
``docs/benchmarks.md``.

    python benchmarks/device_plans.py                      # every table found
    python benchmarks/device_plans.py --tables DIR --no-docs
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from canzona.plan import MatrixSpec, PlanConfig, build_plan
from canzona.plan.assign import lower_bound, pinned_ranks
from canzona.plan.measured import MeasuredCost, load_cost_table, predict_seconds
from canzona.plan.models import model_specs

from _report import DOC, RESULTS, markdown_table, update_section, write_json

TABLES = RESULTS / "device_costs"
#: (row label, owner strategy, planned on the measured table?)
STRATEGIES = (
    ("canzona (measured)", "canzona", True),
    ("canzona (FLOPs)", "canzona", False),
    ("numel", "numel", True),
    ("count", "count", True),
    ("round_robin", "round_robin", True),
)


def table_case(path: Path) -> tuple[str, str, int]:
    """``(model, split, world)`` of a table file named ``<model>__<split>__w<world>.json``."""
    parts = path.stem.split("__")
    if len(parts) != 3 or not all(parts) or not parts[2][1:].isdigit() or parts[2][0] != "w":
        raise ValueError(
            f"a device cost table is named <model>__<split>__w<world>.json, got {path.name!r}"
        )
    return parts[0], parts[1], int(parts[2][1:])


def price(
    specs: list[MatrixSpec], world: int, table: MeasuredCost, strategy: str, measured: bool
) -> dict[str, Any]:
    """One plan's owner seconds per rank (the table's prices) and its FLOP balance."""
    cost = table.for_world(world)
    plan = build_plan(
        specs, world, PlanConfig(strategy=strategy), optimizer=cost if measured else table.base
    )
    planned = list(plan.specs)
    ranks = {s.name: plan.assignment.computing_ranks(s.name) for s in planned}
    rounds = [g.names for g in plan.micro_groups]
    seconds = predict_seconds(planned, rounds, lambda n: ranks[n], cost, world)
    flops = [0.0] * world
    for s in planned:
        for r in ranks[s.name]:
            flops[r] += table.base.flops(s)
    pins = pinned_ranks(planned)
    bound = lower_bound([table.base.flops(s) for s in planned], world, pins)
    # every matrix costs at least its share of a stacked call (a call's fixed part left out)
    bound_s = lower_bound([cost.call_parts(s)[1] for s in planned], world, pins)
    return {
        "makespan_s": max(seconds),
        "makespan_ratio_s": max(seconds) / bound_s if bound_s else 1.0,
        "makespan_ratio_flops": max(flops) / bound if bound else 1.0,
        "micro_groups": len(plan.micro_groups),
    }


def per_flop(table: MeasuredCost) -> list[dict[str, Any]]:
    """Each timed shape's seconds per FLOP, relative to the cheapest shape's."""
    rows = []
    for (m, n), seconds in table.table:
        work = table.base.flops(MatrixSpec("shape", (m, n)))
        rows.append({"shape": [m, n], "seconds": seconds, "s_per_flop": seconds / work})
    best = min((r["s_per_flop"] for r in rows), default=1.0)
    for r in rows:
        r["relative"] = r["s_per_flop"] / best
    return rows


def run_case(model: str, split: str, paths: dict[int, Path]) -> dict[str, Any]:
    """Every strategy at each world size, priced with the table timed for that world."""
    specs = model_specs(model, split=split)
    worlds = []
    for world, path in sorted(paths.items()):
        table = load_cost_table(path)
        rows = {label: price(specs, world, table, s, m) for label, s, m in STRATEGIES}
        best = rows["canzona (measured)"]["makespan_s"]
        for row in rows.values():
            row["vs_measured"] = row["makespan_s"] / best
        meta = json.loads(path.read_text())["meta"]
        worlds.append({"world": world, "meta": meta, "shapes": per_flop(table), "strategies": rows})
    return {"model": model, "split": split, "matrices": len(specs), "worlds": worlds}


def render(payload: dict[str, Any]) -> str:
    lines = [
        "## Plans priced on a GPU",
        "",
        f"`python benchmarks/device_plans.py` (commit `{payload['commit']}`), from the tables "
        "`bash benchmarks/gpu_check.sh` wrote with `canzona calibrate --device cuda --world W` "
        "(`benchmarks/results/device_costs/`: per world size, each shape timed on the stack "
        "an owner forms). Every strategy plans the model for each world size; `canzona` "
        "twice, on the measured table (the runtime's default) and on "
        "closed-form FLOPs. Each plan's owner math is priced in the table's seconds as the "
        "runtime stacks it (per micro-group, rank and shape one call: `predict_seconds`). "
        "*Busiest rank* is the largest per-rank sum; *makespan / LB (s)* divides it by the "
        "lower bound in the table's seconds (each matrix at its share of a stacked call, the "
        "calls' fixed parts left out); *(FLOPs)* is the same plan's makespan / lower bound in "
        "closed-form FLOPs, what a FLOP planner sees.",
    ]
    for case in payload["cases"]:
        meta = case["worlds"][0]["meta"]
        lines += [
            "",
            f"### {case['model']}, split {case['split']} ({case['matrices']} matrices; "
            f"{meta['device']}, torch {meta['torch']}, {meta['ns_dtype']} Newton–Schulz)",
            "",
            "Seconds per FLOP of each timed shape (per matrix, in the stacks each world's "
            "owners form), relative to the cheapest:",
            "",
        ]
        for w in case["worlds"]:
            shapes = sorted(w["shapes"], key=lambda r: r["relative"])
            stacks = {tuple(x[:2]): x[2] for x in w["meta"].get("stacks", [])}
            lines.append(
                f"- world {w['world']}: "
                + ", ".join(
                    f"{r['shape'][0]}×{r['shape'][1]} (stack {stacks.get(tuple(r['shape']), 1)}) "
                    f"{r['relative']:.2f}"
                    for r in shapes
                )
            )
        lines.append("")
        rows = []
        for w in case["worlds"]:
            for label, r in w["strategies"].items():
                rows.append(
                    [
                        w["world"],
                        label,
                        f"{r['makespan_s'] * 1e3:.2f}",
                        f"{r['vs_measured']:.3f}",
                        f"{r['makespan_ratio_s']:.3f}",
                        f"{r['makespan_ratio_flops']:.3f}",
                    ]
                )
        lines.append(
            markdown_table(
                [
                    "world",
                    "strategy",
                    "busiest rank (ms)",
                    "/ canzona (measured)",
                    "makespan / LB (s)",
                    "makespan / LB (FLOPs)",
                ],
                rows,
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=Path, default=TABLES, help="directory of cost tables")
    parser.add_argument("--no-docs", action="store_true", help="skip docs/benchmarks.md")
    parser.add_argument("--out", type=Path, default=None, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, default=DOC, help="Markdown file to update")
    args = parser.parse_args(argv)
    paths = sorted(args.tables.glob("*__*.json"))
    if not paths:
        raise SystemExit(f"no cost tables (<model>__<split>__w<world>.json) under {args.tables}")
    grouped: dict[tuple[str, str], dict[int, Path]] = {}
    for path in paths:
        model, split, world = table_case(path)
        grouped.setdefault((model, split), {})[world] = path
    start = time.perf_counter()
    cases = [run_case(model, split, worlds) for (model, split), worlds in sorted(grouped.items())]
    for case in cases:
        for w in case["worlds"]:
            flops = w["strategies"]["canzona (FLOPs)"]["vs_measured"]
            print(f"{case['model']} {case['split']} world {w['world']}: FLOP plan {flops:.3f}")
    payload: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "cases": cases,
        "bench_seconds": time.perf_counter() - start,
    }
    path = write_json("device_plans", payload, out_dir=args.out)
    print(f"wrote {path}")
    if not args.no_docs:
        print(f"updated {update_section('device_plans', render(payload), doc=args.doc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
