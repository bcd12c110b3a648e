"""Strategy comparison and text rendering shared by the ``canzona plan`` command and benchmarks."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from canzona.plan.assign import STRATEGIES
from canzona.plan.build import Plan, PlanConfig, build_plan
from canzona.plan.cost import CostModel
from canzona.plan.spec import MatrixSpec

__all__ = [
    "UNITS",
    "StrategyRun",
    "compare_strategies",
    "format_bytes",
    "format_seconds",
    "load_histogram",
    "metrics",
    "rank_metrics",
    "recv_bytes",
    "strategy_table",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyRun:
    """A plan built with one strategy and the time it took.

    Attributes:
        plan: The plan.
        seconds: Wall-clock time of :func:`~canzona.plan.build.build_plan`.
    """

    plan: Plan
    seconds: float


def compare_strategies(
    specs: Sequence[MatrixSpec],
    num_ranks: int,
    *,
    optimizer: str | CostModel = "muon",
    alpha: float = 1.0,
    capacity_mb: float = 512.0,
    refine: bool = True,
    strategies: Iterable[str] = STRATEGIES,
) -> dict[str, StrategyRun]:
    """Build one plan per strategy on the same instance, timing each.

    Args:
        specs: The matrices.
        num_ranks: Number of ranks.
        optimizer: A cost model or the name of a built-in one.
        alpha: Blend of compute and communication for ``canzona``.
        capacity_mb: Micro-group capacity per rank, in mebibytes.
        refine: Refinement for ``canzona``.
        strategies: Which strategies to run, in order.

    Returns:
        Strategy name -> plan and planning time.
    """
    runs: dict[str, StrategyRun] = {}
    for strategy in strategies:
        config = PlanConfig(strategy=strategy, alpha=alpha, capacity_mb=capacity_mb, refine=refine)
        start = time.perf_counter()
        plan = build_plan(specs, num_ranks, config, optimizer=optimizer)
        runs[strategy] = StrategyRun(plan=plan, seconds=time.perf_counter() - start)
    return runs


#: Units of the values of :func:`metrics` and :func:`rank_metrics`.
UNITS: dict[str, str] = {
    "balance_ratio": "max load / mean load",
    "makespan_ratio": "makespan / lower bound",
    "makespan": "FLOPs",
    "lower_bound": "FLOPs",
    "max_recv_bytes_per_rank": "bytes",
    "micro_groups": "count",
    "plan_seconds": "seconds",
    "loads": "FLOPs per rank",
    "recv_bytes": "bytes per rank",
}


def recv_bytes(run: StrategyRun) -> tuple[int, ...]:
    """Bytes each rank receives for the matrices it computes (none on a single rank)."""
    a = run.plan.assignment
    return a.comm_bytes if a.num_ranks > 1 else (0,) * a.num_ranks


def metrics(run: StrategyRun) -> dict[str, Any]:
    """The headline numbers of one run: the columns of :func:`strategy_table`.

    ``balance_ratio`` is the table's "balance", ``makespan_ratio`` its "makespan/LB",
    ``max_recv_bytes_per_rank`` its "max recv/rank", ``micro_groups`` its "groups" and
    ``plan_seconds`` its "plan time"; :data:`UNITS` gives the units.
    """
    a = run.plan.assignment
    return {
        "balance_ratio": a.balance_ratio,
        "makespan_ratio": a.makespan_ratio,
        "makespan": a.makespan,
        "lower_bound": a.lower_bound,
        "max_recv_bytes_per_rank": max(recv_bytes(run), default=0),
        "micro_groups": len(run.plan.micro_groups),
        "plan_seconds": run.seconds,
    }


def rank_metrics(run: StrategyRun) -> dict[str, list[float] | list[int]]:
    """Per-rank ``loads`` and ``recv_bytes`` of one run, in rank order."""
    return {"loads": list(run.plan.assignment.loads), "recv_bytes": list(recv_bytes(run))}


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``'512.0 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_seconds(s: float) -> str:
    """Seconds with a readable unit: ``'4.9 ms'``."""
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def strategy_table(runs: Mapping[str, StrategyRun]) -> str:
    """A fixed-width text table comparing strategies."""
    headers = ["strategy", "balance", "makespan/LB", "max recv/rank", "groups", "plan time"]
    rows = []
    for name, run in runs.items():
        m = metrics(run)
        rows.append(
            [
                name,
                f"{m['balance_ratio']:.3f}",
                f"{m['makespan_ratio']:.3f}",
                format_bytes(m["max_recv_bytes_per_rank"]),
                str(m["micro_groups"]),
                format_seconds(m["plan_seconds"]),
            ]
        )
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def load_histogram(loads: Sequence[float], *, bins: int = 8, width: int = 40) -> str:
    """A text histogram of per-rank loads, relative to the mean load.

    Args:
        loads: Per-rank loads.
        bins: Number of equal-width bins between the smallest and largest load.
        width: Characters of the longest bar.

    Returns:
        One line per bin: the bin's range (load / mean), a bar and the number of ranks.
    """
    if not loads:
        return "(no ranks)"
    mean = math.fsum(loads) / len(loads)
    rel = [x / mean if mean else 1.0 for x in loads]
    lo, hi = min(rel), max(rel)
    if hi - lo < 1e-9:
        return f"{lo:6.3f}          | {'#' * width} {len(rel)}"
    step = (hi - lo) / bins
    counts = [0] * bins
    for x in rel:
        counts[min(bins - 1, int((x - lo) / step))] += 1
    top = max(counts)
    lines = []
    for i, count in enumerate(counts):
        bar = "#" * max(1 if count else 0, round(width * count / top))
        lines.append(f"{lo + i * step:6.3f}-{lo + (i + 1) * step:6.3f} | {bar:<{width}} {count}")
    return "\n".join(lines)
