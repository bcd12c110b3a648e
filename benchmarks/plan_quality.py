"""Plan quality: makespan over lower bound and balance of every owner-assignment strategy.

Runs the planner (pure Python, no torch) over a grid of Qwen3 models x world sizes x
optimizers and compares ``canzona`` (LPT + refinement) with plain LPT and the baselines
(``numel``, ``round_robin``, ``count``, ``replicated``); times end-to-end planning of
Qwen3-235B-A22B at 1024 ranks; plots per-rank loads of Qwen3-32B at 256 ranks. Writes
``benchmarks/results/plan_quality[_quick].json``, the plot under ``docs/img/`` and the
``plan_quality`` section of ``docs/benchmarks.md`` (``--out``, ``--plot`` and ``--doc`` send
them elsewhere, as ``run_all.py --quick`` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any

from canzona.plan import (
    STRATEGIES,
    GroupedCost,
    MatrixSpec,
    MuonCost,
    Plan,
    assign_owners,
    build_plan,
)
from canzona.plan.measured import MeasuredCost
from canzona.plan.models import model_specs
from canzona.plan.report import compare_strategies

from _report import DOC, QUICK_DOC, RESULTS, ROOT, markdown_table, update_section, write_json
from _report import QUICK as QUICK_DIR

FULL = {
    "models": ["qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"],
    "worlds": [8, 32, 64, 256, 1024],
    "optimizers": ["muon", "soap"],
}
QUICK = {
    "models": ["qwen3-1.7b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"],
    "worlds": [8, 64, 1024],
    "optimizers": ["muon", "soap"],
}
# "lpt" is canzona without the refinement pass
COLUMNS = ["canzona", "lpt", *[s for s in STRATEGIES if s != "canzona"]]
TARGET_MEAN, TARGET_WORST, TARGET_SECONDS = 1.02, 1.12, 2.0
BIG_MODEL, BIG_WORLD = "qwen3-235b-a22b", 1024
PLOT_MODEL, PLOT_WORLD = "qwen3-32b", 256
SHOWCASE, SHOWCASE_WORLDS = ("qwen3-0.6b", "muon"), [8, 16, 32, 64, 96]
PLOT_PATH = ROOT / "docs" / "img" / f"plan_loads_{PLOT_MODEL}_w{PLOT_WORLD}.png"


def run_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    cells = []
    for optimizer in grid["optimizers"]:
        for model in grid["models"]:
            specs = model_specs(model)
            for world in grid["worlds"]:
                cell: dict[str, Any] = {"optimizer": optimizer, "model": model, "world": world}
                for column in COLUMNS:
                    strategy = "canzona" if column == "lpt" else column
                    start = time.perf_counter()
                    a = assign_owners(
                        specs, world, strategy=strategy, optimizer=optimizer, refine=column != "lpt"
                    )
                    cell[column] = {
                        "makespan_ratio": a.makespan_ratio,
                        "balance_ratio": a.balance_ratio,
                        "comm_balance_ratio": a.comm_balance_ratio,
                        "seconds": time.perf_counter() - start,
                    }
                a = assign_owners(specs, world, optimizer=optimizer, refine=False)
                cell["floor"] = {"balance_ratio": a.lower_bound * world / a.total}
                cells.append(cell)
                print(
                    f"{optimizer:5s} {model:15s} world {world:5d}: canzona "
                    f"{cell['canzona']['makespan_ratio']:.4f} x LB, lpt "
                    f"{cell['lpt']['makespan_ratio']:.4f}, "
                    f"numel {cell['numel']['makespan_ratio']:.4f}",
                    flush=True,
                )
    return cells


def aggregate(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for optimizer in [*sorted({c["optimizer"] for c in cells}), "all"]:
        mine = [c for c in cells if optimizer in ("all", c["optimizer"])]
        per: dict[str, Any] = {}
        for column in COLUMNS:
            ratios = [c[column]["makespan_ratio"] for c in mine]
            worst = max(mine, key=lambda c, col=column: c[col]["makespan_ratio"])
            per[column] = {
                "mean_makespan_ratio": statistics.fmean(ratios),
                "worst_makespan_ratio": max(ratios),
                "worst_cell": f"{worst['model']} @ {worst['world']}",
                "mean_balance_ratio": statistics.fmean(c[column]["balance_ratio"] for c in mine),
                "worst_balance_ratio": max(c[column]["balance_ratio"] for c in mine),
            }
        floors = [c["floor"]["balance_ratio"] for c in mine]
        per["floor"] = {
            "mean_balance_ratio": statistics.fmean(floors),
            "worst_balance_ratio": max(floors),
        }
        per["canzona_worse_than_lpt"] = sum(
            c["canzona"]["makespan_ratio"] > c["lpt"]["makespan_ratio"] * (1 + 1e-12) for c in mine
        )
        per["canzona_better_than_lpt"] = sum(
            c["canzona"]["makespan_ratio"] < c["lpt"]["makespan_ratio"] * (1 - 1e-12) for c in mine
        )
        out[optimizer] = per
    return out


def refinement_showcase() -> list[dict[str, Any]]:
    """A model where plain LPT leaves room that the refinement pass recovers."""
    model, optimizer = SHOWCASE
    specs = model_specs(model)
    rows = []
    for world in SHOWCASE_WORLDS:
        lpt = assign_owners(specs, world, optimizer=optimizer, refine=False)
        canzona = assign_owners(specs, world, optimizer=optimizer)
        rows.append(
            {
                "model": model,
                "optimizer": optimizer,
                "world": world,
                "lpt": lpt.makespan_ratio,
                "canzona": canzona.makespan_ratio,
            }
        )
    return rows


SPLIT_MODELS = {"full": ["qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"], "quick": ["qwen3-8b"]}
SPLIT_WORLDS = {"full": [8, 64, 256], "quick": [8, 64]}


def split_table(mode: str) -> list[dict[str, Any]]:
    """Per split (fused, q/k/v apart, per head), the baselines against canzona, in FLOPs.

    Per-head blocks (128 x 5120) next to MLP matrices (25600 x 5120) differ 40x in FLOPs per
    element: balancing element counts (``numel``) or matrix counts (``count``) leaves ranks
    far apart where FLOP-aware LPT does not. MoE experts are placed per rank (expert
    parallelism) and stay there under ``canzona`` and ``numel`` where the world divides the
    experts per layer; otherwise no rank holds an expert whole and they travel.
    """
    rows = []
    for model in SPLIT_MODELS[mode]:
        for world in SPLIT_WORLDS[mode]:
            for split in ("none", "qkv", "heads"):
                specs = model_specs(model, split=split, world=world)
                row: dict[str, Any] = {
                    "model": model,
                    "world": world,
                    "split": split,
                    "matrices": len(specs),
                }
                for strategy in ("canzona", "numel", "count", "round_robin"):
                    a = assign_owners(specs, world, strategy=strategy, optimizer="muon")
                    row[strategy] = {
                        "makespan_ratio": a.makespan_ratio,
                        "max_recv_bytes": max(a.comm_bytes),
                    }
                rows.append(row)
    return rows


def time_big_model(repeats: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        specs = model_specs(BIG_MODEL)
        t1 = time.perf_counter()
        plan = build_plan(specs, BIG_WORLD)
        t2 = time.perf_counter()
        digest = plan.digest()
        t3 = time.perf_counter()
        runs.append({"catalogue": t1 - t0, "build_plan": t2 - t1, "digest": t3 - t2})
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "model": BIG_MODEL,
        "world": BIG_WORLD,
        "matrices": len(specs),
        "median_seconds": median,
        "end_to_end_seconds": sum(median.values()),
        "makespan_ratio": plan.assignment.makespan_ratio,
        "micro_groups": len(plan.micro_groups),
        "digest": digest,
        "repeats": repeats,
    }


#: Models split per head, as the runtime's measured costs see them: every call pays a fixed
#: part, so the plan's last pass gathers same-shape matrices (``plan/consolidate.py``).
PRICED_CALLS = (("qwen3-32b", 256), ("qwen3-235b-a22b", 1024))
FIXED_S, SECONDS_PER_FLOP = 2e-5, 1e-12  # a GPU-like call: 20 us, then 1 TFLOP/s


def _priced(specs: list[MatrixSpec]) -> GroupedCost:
    """A measured table for ``specs``: ``FIXED_S`` per call plus the FLOPs at a fixed rate."""
    base = MuonCost()
    shapes = sorted({(s.m, s.n) for s in specs})
    per = {mn: SECONDS_PER_FLOP * base.flops(MatrixSpec("s", mn)) for mn in shapes}
    cost = MeasuredCost(
        base=base,
        table=tuple((mn, FIXED_S + per[mn]) for mn in shapes),
        batches=tuple((mn, FIXED_S, per[mn]) for mn in shapes),
    )
    return GroupedCost(models={"0": cost})


def _group_calls(plan: Plan, specs: list[MatrixSpec]) -> int:
    """Stacked calls the owners make per step: one per micro-group, owner and call class."""
    by_name = {s.name: s for s in specs}
    return len(
        {
            (g.index, owner, by_name[n].cost_key, by_name[n].m, by_name[n].n, by_name[n].itemsize)
            for g in plan.micro_groups
            for n, owner in zip(g.names, g.owners, strict=True)
        }
    )


def time_priced_calls(repeats: int) -> list[dict[str, Any]]:
    """``build_plan`` with calls priced (fixed part + per matrix), per head, median seconds."""
    out = []
    for name, world in PRICED_CALLS:
        specs = [
            dataclasses.replace(s, cost_key="0")
            for s in model_specs(name, split="heads", world=world)
        ]
        cost = _priced(specs)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = build_plan(specs, world, optimizer=cost)
            seconds.append(time.perf_counter() - t0)
        out.append(
            {
                "model": name,
                "world": world,
                "matrices": len(specs),
                "build_plan_seconds": statistics.median(seconds),
                "calls": len({(plan.assignment.owner[s.name], s.shape) for s in specs}),
                "micro_groups": len(plan.micro_groups),
                "group_calls": _group_calls(plan, specs),
                "repeats": repeats,
            }
        )
    return out


def draw_plot(path: Path) -> Path | None:
    try:
        from canzona.cli import plot_loads

        runs = compare_strategies(model_specs(PLOT_MODEL), PLOT_WORLD)
        plot_loads(runs, path, title=f"{PLOT_MODEL}, world {PLOT_WORLD}, muon")
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return None
    return path


def _bytes(n: float) -> str:
    from canzona.plan.report import format_bytes

    return format_bytes(int(n))


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def render(payload: dict[str, Any]) -> str:
    grid, summary, big = payload["grid"], payload["summary"], payload["big_model"]
    priced = payload["priced_calls"]
    lines = [
        "## Plan quality",
        "",
        f"`python benchmarks/plan_quality.py --{payload['mode']}` "
        f"({payload['mode']} grid: models {', '.join(grid['models'])}; "
        f"world sizes {', '.join(map(str, grid['worlds']))}; "
        f"optimizers {', '.join(grid['optimizers'])}; date {payload['date']}; "
        f"commit `{payload.get('commit', 'unknown')}`). "
        "The planner is pure Python and runs on one core.",
        "",
        "*makespan / LB* is the largest per-rank optimizer FLOPs divided by the lower bound "
        "max(mean load, costliest matrix, pigeonhole sums); *balance* is max load / mean load. "
        "`lpt` is `canzona` without the refinement pass. Means and worst cells are over the "
        "grid; the embedding and LM head are AdamW-routed and left out.",
        "",
    ]
    for optimizer in grid["optimizers"]:
        per = summary[optimizer]
        rows = []
        for column in COLUMNS:
            s = per[column]
            rows.append(
                [
                    f"`{column}`",
                    f"{s['mean_makespan_ratio']:.4f}",
                    f"{s['worst_makespan_ratio']:.4f} ({s['worst_cell']})",
                    f"{s['mean_balance_ratio']:.3f}",
                    f"{s['worst_balance_ratio']:.3f}",
                ]
            )
        floor = per["floor"]
        rows.append(
            [
                "lower bound (floor)",
                "1",
                "1",
                f"{floor['mean_balance_ratio']:.3f}",
                f"{floor['worst_balance_ratio']:.3f}",
            ]
        )
        headers = ["strategy", "makespan / LB, mean", "makespan / LB, worst cell"]
        headers += ["balance, mean", "balance, worst"]
        lines += [f"### {optimizer}", "", markdown_table(headers, rows), ""]
    all_ = summary["all"]
    canz = all_["canzona"]
    seconds = big["end_to_end_seconds"]
    targets = [
        [
            "`canzona` makespan / LB, mean",
            f"<= {TARGET_MEAN}",
            f"{canz['mean_makespan_ratio']:.4f}",
            _mark(canz["mean_makespan_ratio"] <= TARGET_MEAN),
        ],
        [
            "`canzona` makespan / LB, worst cell",
            f"<= {TARGET_WORST}",
            f"{canz['worst_makespan_ratio']:.4f} ({canz['worst_cell']})",
            _mark(canz["worst_makespan_ratio"] <= TARGET_WORST),
        ],
        [
            "cells where `canzona` is worse than plain LPT",
            "0",
            str(all_["canzona_worse_than_lpt"]),
            _mark(all_["canzona_worse_than_lpt"] == 0),
        ],
        [
            f"planning time, {big['model']} ({big['matrices']} matrices) @ {big['world']}",
            f"< {TARGET_SECONDS} s",
            f"{seconds:.2f} s",
            _mark(seconds < TARGET_SECONDS),
        ],
    ]
    lines += [
        "### Targets",
        "",
        markdown_table(["quantity", "target", "measured", ""], targets),
        "",
        f"Planning time is the median of {big['repeats']} runs of catalogue "
        f"({big['median_seconds']['catalogue']:.2f} s) + `build_plan` "
        f"({big['median_seconds']['build_plan']:.2f} s, owners and {big['micro_groups']} "
        f"micro-groups) + `digest()` ({big['median_seconds']['digest']:.2f} s). Refinement "
        f"improved on plain LPT in {all_['canzona_better_than_lpt']} of "
        f"{payload['cells']} cells.",
        "",
        "With calls priced (the runtime's measured costs: a fixed part per stacked call, "
        f"here {FIXED_S * 1e6:.0f} µs plus {SECONDS_PER_FLOP * 1e12:.0f} ps per FLOP), "
        "`build_plan` ends with the pass that gathers same-shape matrices on fewer owners "
        "(`plan/consolidate.py`, bounded by a work budget), and its micro-groups keep an "
        "owner's same-class matrices together where that finishes no later "
        "(`plan/micro_groups.py`); median of "
        f"{priced[0]['repeats']} runs, models split per head: "
        + "; ".join(
            f"{r['model']} ({r['matrices']} matrices) @ {r['world']}: "
            f"{r['build_plan_seconds']:.2f} s"
            + (
                f" ({r['micro_groups']} micro-group{'s' * (r['micro_groups'] != 1)}, "
                f"{r['group_calls']} stacked calls)"
                if "group_calls" in r
                else ""
            )
            for r in priced
        )
        + ".",
        "",
        "Where `canzona` stays above 1.0 the lower bound, not the assignment, is usually "
        "loose: whole matrices cannot be split, so a few large matrices per rank force a "
        "step. For example Qwen3-8B with Muon at 64 ranks has 108 MLP matrices (14 units "
        "of work each) and 72 attention projections (6 units) for a mean load of 30.7: "
        "at least 44 ranks hold two MLP matrices (28), where any projection makes 34, and "
        "the other ranks fit at most 60 projections below 34, so no assignment beats "
        "34 / 30.7 = 1.11 there.",
        "",
    ]
    splits = payload.get("splits") or []
    if splits:
        table = []
        for r in splits:
            canz = r["canzona"]["makespan_ratio"]
            table.append(
                [
                    r["model"],
                    r["world"],
                    f"`{r['split']}`",
                    r["matrices"],
                    f"{canz:.3f}",
                    *(
                        f"{r[s]['makespan_ratio']:.3f} ({r[s]['makespan_ratio'] / canz:.2f}x)"
                        for s in ("numel", "count", "round_robin")
                    ),
                    _bytes(r["canzona"]["max_recv_bytes"]),
                ]
            )
        lines += [
            "### Splits: fused, q/k/v apart, per head",
            "",
            "`canzona plan --model M --world W --split none|qkv|heads` (Muon, FLOPs): `none` "
            "updates a fused `qkv_proj` and `gate_up_proj` as one matrix each, `qkv` q/k/v and "
            "gate/up apart, `heads` one matrix per attention head (`canzona.Split`). Each "
            "baseline's makespan / lower bound, with its ratio to `canzona`'s; MoE experts "
            "are placed per rank (expert parallelism) and stay there under `canzona` and "
            "`numel` where the world divides the experts per layer (otherwise no rank holds "
            "an expert whole and they travel, as `canzona plan` warns).",
            "",
            markdown_table(
                [
                    "model",
                    "world",
                    "split",
                    "matrices",
                    "`canzona`",
                    "`numel`",
                    "`count`",
                    "`round_robin`",
                    "`canzona` max recv / rank",
                ],
                table,
            ),
            "",
        ]
    show = payload["refinement_showcase"]
    lines += [
        f"The refinement pass matters when a few matrix sizes of similar cost leave LPT a "
        f"poor last choice, as in {show[0]['model']} ({show[0]['optimizer']}):",
        "",
        markdown_table(
            ["world", "`lpt` makespan / LB", "`canzona` makespan / LB"],
            [[r["world"], f"{r['lpt']:.4f}", f"{r['canzona']:.4f}"] for r in show],
        ),
        "",
        "The floor row is the best balance any assignment could reach (lower bound / mean "
        "load): with fewer matrices than ranks most ranks idle, so balance far above 1 at "
        "large world sizes is a property of the model, and makespan / LB is the figure of "
        "merit.",
        "",
    ]
    if payload.get("plot"):
        doc_dir = Path(payload.get("doc") or DOC).parent
        rel = Path(os.path.relpath(payload["plot"], doc_dir))
        lines += [
            f"Per-rank loads of {PLOT_MODEL} at world {PLOT_WORLD} (Muon), each strategy "
            "relative to the lower bound:",
            "",
            f"![per-rank loads]({rel.as_posix()})",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small grid, < 30 s (default)")
    mode.add_argument("--full", action="store_true", help="the full grid")
    parser.add_argument("--no-docs", action="store_true", help="skip docs/benchmarks.md")
    parser.add_argument("--out", type=Path, help="directory of the JSON (full: benchmarks/results)")
    parser.add_argument("--doc", type=Path, help="Markdown file (full: docs/benchmarks.md)")
    parser.add_argument("--plot", type=Path, help="PNG of per-rank loads (full: under docs/img)")
    args = parser.parse_args(argv)
    # only full mode writes the published files; quick mode writes under results/quick
    args.doc = args.doc or (DOC if args.full else QUICK_DOC)
    args.plot = args.plot or (PLOT_PATH if args.full else QUICK_DIR / PLOT_PATH.name)
    name = "full" if args.full else "quick"
    grid = FULL if args.full else QUICK
    start = time.perf_counter()
    cells = run_grid(grid)
    big = time_big_model(repeats=3 if args.full else 1)
    print(f"{BIG_MODEL} @ {BIG_WORLD}: {big['end_to_end_seconds']:.2f} s end to end")
    priced = time_priced_calls(repeats=3 if args.full else 1)
    for row in priced:
        print(
            f"{row['model']} per head @ {row['world']}, calls priced: "
            f"{row['build_plan_seconds']:.2f} s"
        )
    plot = draw_plot(args.plot)
    payload: dict[str, Any] = {
        "mode": name,
        "date": time.strftime("%Y-%m-%d"),
        "grid": grid,
        "cells": len(cells),
        "targets": {"mean": TARGET_MEAN, "worst": TARGET_WORST, "seconds": TARGET_SECONDS},
        "summary": aggregate(cells),
        "big_model": big,
        "priced_calls": priced,
        "refinement_showcase": refinement_showcase(),
        "splits": split_table(name),
        "plot": str(plot) if plot else None,
        "results": cells,
        "bench_seconds": time.perf_counter() - start,
        "doc": str(args.doc),
    }
    out_dir = args.out or (RESULTS if args.full else QUICK_DIR)
    path = write_json(
        "plan_quality" if args.full else "plan_quality_quick", payload, out_dir=out_dir
    )
    print(f"wrote {path}")
    if not args.no_docs:
        print(f"updated {update_section('plan_quality', render(payload), doc=args.doc)}")
    canz = payload["summary"]["all"]["canzona"]
    print(
        f"canzona makespan/LB: mean {canz['mean_makespan_ratio']:.4f}, worst "
        f"{canz['worst_makespan_ratio']:.4f} ({canz['worst_cell']}); "
        f"{payload['bench_seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
