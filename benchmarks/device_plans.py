"""Plans priced on a device: every strategy's owners in the seconds a GPU calibration measured.

``benchmarks/gpu_check.sh`` runs ``canzona calibrate --device cuda --world W`` on Qwen3
models (one table per model, split and world size, each shape timed on the stack an owner
of a W-rank plan forms, under ``benchmarks/results/device_costs/``). This script plans each
model for each of those world sizes with every strategy, ``canzona`` twice: on the measured
table (what the runtime plans with, ``PlanConfig(cost="measured")``) and on the closed-form
FLOPs (``cost="flops"``), and prices every plan's owner math in the table's seconds, batch
by batch as the runtime stacks it (``predict_seconds``: per micro-group, rank and shape, one
call of ``fixed + k * per_matrix``). Pure-Python planning on the CPU; no device needed.

The tables time each shape at one matrix and at the owners' stack (at most 8); the GPU check
(``benchmarks/results/gpu_check.json``, the same commit's run) also timed the head blocks in
stacks of 64. Where that longer stack shows calls that run in pieces of the table's stack
(``plan.measured.piece_size``: per-matrix CUDA-graph replays run 8 blocks side by side and
the pieces in turn), the table gets those pieces (``MeasuredCost.pieces``), as a calibration
that times twice the stack gives them now; every plan is priced with it, and ``canzona`` is
planned on it and, as before pieces, on the table's lines alone (``canzona (one call)``).
Writes ``benchmarks/results/device_plans.json`` and the ``device_plans`` section of
``docs/benchmarks.md``.

    python benchmarks/device_plans.py                      # every table found
    python benchmarks/device_plans.py --tables DIR --no-docs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

from canzona.plan import MatrixSpec, PlanConfig, build_plan
from canzona.plan.assign import lower_bound, pinned_ranks
from canzona.plan.measured import MeasuredCost, load_cost_table, piece_size, predict_seconds
from canzona.plan.models import model_specs

from _report import DOC, RESULTS, markdown_table, update_section, write_json

TABLES = RESULTS / "device_costs"
#: The GPU check's results: its head blocks timed in stacks of 8 and 64.
GPU_CHECK = RESULTS / "gpu_check.json"
#: (row label, owner strategy, what it is planned on: the table with its pieces, the table's
#: lines alone, or closed-form FLOPs)
STRATEGIES = (
    ("canzona (measured)", "canzona", "table"),
    ("canzona (one call)", "canzona", "lines"),
    ("canzona (FLOPs)", "canzona", "flops"),
    ("numel", "numel", "table"),
    ("count", "count", "table"),
    ("round_robin", "round_robin", "table"),
)


def long_stacks(path: Path) -> dict[tuple[int, int], dict[int, float]]:
    """The GPU check's head blocks: ``{(m, n): {stack: seconds of one call}}`` (none: {})."""
    if not path.is_file():
        return {}
    out: dict[tuple[int, int], dict[int, float]] = {}
    for row in json.loads(path.read_text()).get("heads", []):
        found = re.search(r"\((\d+)x(\d+)\)", row["shape"])
        if found and isinstance(row.get("canzona"), float):
            shape = (int(found[1]), int(found[2]))
            out.setdefault(shape, {})[int(row["batch"])] = row["canzona"]
    return out


def with_pieces(
    table: MeasuredCost, stacks: dict[tuple[int, int], int], timed: dict[Any, dict[int, float]]
) -> tuple[MeasuredCost, list[dict[str, Any]]]:
    """The table with the pieces that longer timed stacks show, and each shape's evidence.

    ``stacks`` is each shape's stack in the table (``meta.stacks``); ``timed`` the longer
    stacks' seconds (:func:`long_stacks`). A shape's longest timed stack decides, by
    :func:`~canzona.plan.measured.piece_size`'s rule, between one call on its line and
    pieces of its table stack.
    """
    lines = {shape: (fixed, per) for shape, fixed, per in table.batches}
    pieces = list(table.pieces)
    evidence = []
    for shape, calls in sorted(timed.items()):
        k, line = stacks.get(shape), lines.get(shape)
        longest = max(calls)
        if k is None or line is None or longest <= k:
            continue
        size = piece_size(k, line, calls[longest], stack=longest)
        fixed, per = line
        evidence.append(
            {
                "shape": list(shape),
                "table_stack": k,
                "stack": longest,
                "measured_s": calls[longest],
                "one_call_s": fixed + longest * per,
                "pieces_s": -(-longest // k) * fixed + longest * per,
                "piece_size": size,
            }
        )
        if size is not None:
            pieces.append((shape, size))
    return dataclasses.replace(table, pieces=tuple(pieces)), evidence


def table_case(path: Path) -> tuple[str, str, int]:
    """``(model, split, world)`` of a table file named ``<model>__<split>__w<world>.json``."""
    parts = path.stem.split("__")
    if len(parts) != 3 or not all(parts) or not parts[2][1:].isdigit() or parts[2][0] != "w":
        raise ValueError(
            f"a device cost table is named <model>__<split>__w<world>.json, got {path.name!r}"
        )
    return parts[0], parts[1], int(parts[2][1:])


def price(
    specs: list[MatrixSpec], world: int, table: MeasuredCost, strategy: str, planned_on: str
) -> dict[str, Any]:
    """One plan's owner seconds per rank (the table's prices) and its FLOP balance.

    ``planned_on``: ``"table"`` (the table, pieces included), ``"lines"`` (the table
    without its pieces) or ``"flops"`` (closed-form FLOPs).
    """
    cost = table.for_world(world)
    plan_cost = {
        "table": cost,
        "lines": dataclasses.replace(cost, pieces=()),
        "flops": table.base,
    }[planned_on]
    plan = build_plan(specs, world, PlanConfig(strategy=strategy), optimizer=plan_cost)
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


def run_case(
    model: str, split: str, paths: dict[int, Path], timed: dict[Any, dict[int, float]]
) -> dict[str, Any]:
    """Every strategy at each world size, priced with the table timed for that world."""
    specs = model_specs(model, split=split)
    worlds = []
    for world, path in sorted(paths.items()):
        meta = json.loads(path.read_text())["meta"]
        stacks = {(m, n): k for m, n, k in meta.get("stacks", [])}
        table, evidence = with_pieces(load_cost_table(path), stacks, timed)
        rows = {label: price(specs, world, table, s, on) for label, s, on in STRATEGIES}
        best = rows["canzona (measured)"]["makespan_s"]
        for row in rows.values():
            row["vs_measured"] = row["makespan_s"] / best
        worlds.append(
            {
                "world": world,
                "meta": meta,
                "shapes": per_flop(table),
                "pieces": evidence,
                "strategies": rows,
            }
        )
    return {"model": model, "split": split, "matrices": len(specs), "worlds": worlds}


def render(payload: dict[str, Any]) -> str:
    lines = [
        "## Plans priced on a GPU",
        "",
        f"`python benchmarks/device_plans.py` (commit `{payload['commit']}`), from the tables "
        "`bash benchmarks/gpu_check.sh` wrote with `canzona calibrate --device cuda --world W` "
        "(`benchmarks/results/device_costs/`: per world size, each shape timed on the stack "
        "an owner forms). Every strategy plans the model for each world size; `canzona` "
        "three times: on the measured table (the runtime's default), on the table's lines "
        "without the pieces below (*one call*, as it planned before calibrations timed twice "
        "the stack) and on closed-form FLOPs. Each plan's owner math is "
        "priced in the table's seconds as the runtime stacks it (per micro-group, rank and "
        "shape one call, its fixed part once per piece: `predict_seconds`). "
        "*Busiest rank* is the largest per-rank sum; *makespan / LB (s)* divides it by the "
        "lower bound in the table's seconds (each matrix at its share of a stacked call, the "
        "calls' fixed parts left out); *(FLOPs)* is the same plan's makespan / lower bound in "
        "closed-form FLOPs, what a FLOP planner sees. *Pieces:* the tables time a shape at "
        "one matrix and the owners' stack (at most 8); the GPU check timed the head blocks "
        "in stacks of 64 too (`benchmarks/results/gpu_check.json`, "
        f"`{payload.get('gpu_check_commit', '?')}`). Where that stack's time is nearer "
        "pieces of the table's stack, each paying the line's fixed part, than one call on "
        "the line (`plan.measured.piece_size`, the rule a calibration applies to twice the "
        "stack), the table prices calls in such pieces.",
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
        evidence = {
            (tuple(e["shape"]), e["stack"]): e for w in case["worlds"] for e in w.get("pieces", [])
        }
        if evidence:
            lines += ["", "Stacks of the GPU check against the tables' lines:", ""]
        for (shape, stack), e in sorted(evidence.items()):
            verdict = (
                f"pieces of {e['piece_size']}"
                if e["piece_size"] is not None
                else "one call (no pieces)"
            )
            lines.append(
                f"- {shape[0]}×{shape[1]}, {stack} blocks: measured {e['measured_s'] * 1e3:.2f} "
                f"ms; the line as one call {e['one_call_s'] * 1e3:.2f} ms, in pieces of "
                f"{e['table_stack']} {e['pieces_s'] * 1e3:.2f} ms: {verdict}"
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
    parser.add_argument(
        "--gpu-check", type=Path, default=GPU_CHECK, help="GPU check results (longer stacks)"
    )
    args = parser.parse_args(argv)
    paths = sorted(args.tables.glob("*__*.json"))
    if not paths:
        raise SystemExit(f"no cost tables (<model>__<split>__w<world>.json) under {args.tables}")
    grouped: dict[tuple[str, str], dict[int, Path]] = {}
    for path in paths:
        model, split, world = table_case(path)
        grouped.setdefault((model, split), {})[world] = path
    start = time.perf_counter()
    timed = long_stacks(args.gpu_check)
    cases = [
        run_case(model, split, worlds, timed) for (model, split), worlds in sorted(grouped.items())
    ]
    for case in cases:
        for w in case["worlds"]:
            flops = w["strategies"]["canzona (FLOPs)"]["vs_measured"]
            print(f"{case['model']} {case['split']} world {w['world']}: FLOP plan {flops:.3f}")
    check = json.loads(args.gpu_check.read_text()) if args.gpu_check.is_file() else {}
    payload: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu_check_commit": check.get("commit"),
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
