"""Step-latency report: prediction, balance in time, calibration, structure and diagnostics.

Targets, notes and Markdown for what the measured cost model promises (each rank's owner
time predicted from the calibration table, balance in wall time, calibration cost), for the
structure case (per-head blocks and expert stacks), for the cost of the all-or-nothing step
(``PipelineConfig(atomic=False)`` against the default) and for the micro-group choice
(pipeline depth 1, 2, 3 and one micro-group). Everything works on the JSON payload of
``step_latency.py`` (plain dicts).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from canzona.runtime import PipelineConfig
from canzona.runtime.repricing import ROUNDS, SKIPPED_STEPS

from _report import markdown_table


def _rounds_text() -> str:
    """Which steps record owner calls and which re-plan, round by round (1-based steps)."""
    steps, start, parts = PipelineConfig().reprice_steps, 1, []
    for r in range(ROUNDS):
        first = start + SKIPPED_STEPS
        due = first + steps
        calls = "" if r == 0 else " on every round's calls"
        parts.append(f"steps {first} to {due - 1} recorded, re-planned at step {due}{calls}")
        start = due
    return "; ".join(parts)


#: Bounds on what the measured cost model promises (world 2, one thread per rank).
TIME_TARGETS = {"prediction_error": 0.05, "balance_time": 1.05, "calibration_s": 2.0}
#: ``canzona`` against ``numel`` and the best of ``round_robin`` and ``count`` on the structure
#: case at world 2. It is also the case with per-head blocks next to MLP matrices of the
#: measured-cost targets, whose bound (0.9 against each) this one implies.
STRUCTURE_TARGET = 0.85
BASELINES = ("replicated", "round_robin", "count", "numel")
ATOMIC = ("canzona", "canzona_not_atomic")
BUFFERS = ("canzona", "canzona_free_buffers")
DEPTH = ("canzona", "canzona_depth2", "canzona_depth3", "canzona_one_group")
DEPTH_LABELS = {
    "canzona": "depth 1 (default)",
    "canzona_depth2": "depth 2",
    "canzona_depth3": "depth 3",
    "canzona_one_group": "one micro-group (`capacity_mb` 4096)",
}


# ------------------------------------------------------------------------------ formatting


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _per_rank_ms(values: Sequence[float]) -> str:
    return "/".join(f"{x * 1e3:.1f}" for x in values)


def _mib(values: Sequence[int]) -> str:
    return "/".join(f"{v / 2**20:.1f}" for v in values)


def format_measured(t: dict[str, Any]) -> str:
    """A target's measured value in its unit."""
    x = t["measured"]
    if x is None:
        return "–"
    unit = t.get("unit", "ratio")
    if unit == "pct":
        return f"{100 * x:.1f}%"
    if unit == "s":
        return f"{x:.2f} s"
    if unit in ("bytes", "count"):
        return f"{int(x)}"
    return _ratio(x)


def format_bound(t: dict[str, Any]) -> str:
    """A target's bound in its unit."""
    unit, bound = t.get("unit", "ratio"), t["target"]
    if unit == "pct":
        return f"≤ {100 * bound:g}%"
    if unit == "s":
        return f"≤ {bound:g} s"
    return f"≤ {bound:g}"


# ------------------------------------------------------------------------------ targets


def target_row(
    name: str, kind: str, case: dict[str, Any], target: float, measured: float | None, **extra: Any
) -> dict[str, Any]:
    """One target: met when ``measured <= target`` (None when not measured)."""
    met = None if measured is None else measured <= target
    row = {
        "name": name,
        "kind": kind,
        "case": case["case"],
        "target": target,
        "measured": measured,
        "met": met,
    }
    return {**row, **extra}


def ratio_row(
    name: str, kind: str, case: dict[str, Any], target: float, versus: str
) -> dict[str, Any]:
    """A step-time ratio: of medians (the measure), paired by round, and of best steps."""
    a, b = case["runs"]["canzona"], case["runs"][versus]
    paired = [x / y for x, y in zip(a["steps_s"], b["steps_s"], strict=False)]
    return target_row(
        name,
        kind,
        case,
        target,
        a["step_s"] / b["step_s"],
        versus=versus,
        best=a["step_min_s"] / b["step_min_s"],
        paired=_median(paired),
    )


def best_baseline(case: dict[str, Any]) -> str:
    """The faster of ``round_robin`` and ``count`` in a case."""
    steps = {
        s: case["runs"].get(s, {}).get("step_s") or float("inf") for s in ("round_robin", "count")
    }
    return min(steps, key=steps.__getitem__)


def time_targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prediction error, balance in time and calibration cost, at world 2 (where they are set).

    At world 4 four ranks share this machine's two cores, so each rank's wall time is about
    twice its CPU time: the prediction table shows those cases (with the CPU-time error),
    but they are not judged.
    """
    rows: list[dict[str, Any]] = []
    for c in cases:
        if c["world"] != 2:
            continue
        canz = c["runs"].get("canzona", {})
        pred, plan = canz.get("prediction"), canz.get("plan", {})
        if pred is not None and pred["error"] is not None:
            rows.append(
                target_row(
                    f"{c['case']}: `canzona` busiest rank's owner time, error of the "
                    "prediction (absolute)",
                    "prediction",
                    c,
                    TIME_TARGETS["prediction_error"],
                    abs(pred["error"]),
                    unit="pct",
                )
            )
        if "lower_bound_s" in plan and canz.get("compute_s"):
            wall = canz["compute_s"]
            floor = plan["lower_bound_s"] / statistics.mean(plan["predicted_s"])
            row = target_row(
                f"{c['case']}: `canzona` busiest rank's owner time / mean (wall seconds)",
                "balance_time",
                c,
                TIME_TARGETS["balance_time"],
                max(wall) / statistics.mean(wall),
                floor=floor,
            )
            if row["met"] is False and floor > TIME_TARGETS["balance_time"]:  # not allowed
                row["met"] = None
            rows.append(row)
        if "calibration_s" in canz:
            rows.append(
                target_row(
                    f"{c['case']}: calibration at the first step (slowest rank)",
                    "calibration",
                    c,
                    TIME_TARGETS["calibration_s"],
                    max(canz["calibration_s"]),
                    unit="s",
                )
            )
            rows.append(
                target_row(
                    f"{c['case']}: calibrations after the first step",
                    "calibration",
                    c,
                    0,
                    canz["calibrations"] - 1 if "calibrations" in canz else None,
                    unit="count",
                )
            )
            replans = canz.get("replans_after_first_step")
            rows.append(
                target_row(
                    f"{c['case']}: re-plans after the first step besides the re-pricing "
                    "by the steps' own calls",
                    "calibration",
                    c,
                    0,
                    None if replans is None else replans - canz.get("repricings", 0),
                    unit="count",
                )
            )
    return rows


def structure_targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``canzona`` against the baselines (world 2), expert bytes and exactness (every world)."""
    rows: list[dict[str, Any]] = []
    for c in cases:
        if c["model"] != "structure" or c["optimizer"] != "muon":
            continue
        runs = c["runs"]
        if c["world"] == 2 and "canzona" in runs:
            best = best_baseline(c)
            rows.append(
                ratio_row(
                    f"structure, world 2: `canzona` / best of `round_robin`, `count` ({best})",
                    "hetero",
                    c,
                    STRUCTURE_TARGET,
                    best,
                )
            )
            rows.append(
                ratio_row(
                    "structure, world 2: `canzona` / `numel`",
                    "hetero",
                    c,
                    STRUCTURE_TARGET,
                    "numel",
                )
            )
        sent = c.get("experts_bytes_sent", {}).get("canzona")
        if sent is not None:
            rows.append(
                target_row(
                    f"{c['case']}: bytes sent per rank for the expert stacks under `canzona`",
                    "experts_bytes",
                    c,
                    0,
                    max(sent),
                    unit="bytes",
                )
            )
        differ = [
            s
            for s, r in runs.items()
            if (s in BASELINES or s.startswith("canzona")) and r.get("identical") is False
        ]
        if not c["single_device"].get("matches_distributed"):
            differ.append("single device")
        rows.append(
            target_row(
                f"{c['case']}: strategies not bitwise equal to the single-device run",
                "exactness",
                c,
                0,
                len(differ),
                unit="count",
                differ=differ,
            )
        )
    return rows


# ------------------------------------------------------------------------------ notes


def _drift(case: dict[str, Any]) -> str:
    """How far the same table's prediction missed `replicated`'s owner time.

    Every rank computes every matrix there: no plan to get wrong, only the machine's speed.
    """
    p = case["runs"].get("replicated", {}).get("prediction")
    if not p or p.get("error_cpu") is None:
        return ""
    return (
        f"; priced with the same table, `replicated`'s owner time was off by "
        f"{100 * p['error']:+.1f}% wall, {100 * p['error_cpu']:+.1f}% CPU"
    )


def note(t: dict[str, Any], case: dict[str, Any], payload: dict[str, Any]) -> str | None:
    """The note of a missed target of a kind this module owns (None for other kinds)."""
    canz = case["runs"].get("canzona", {})
    head = f"**{t['name']}**: {format_measured(t)} against {format_bound(t)}"
    load = case["load_average"][0]
    if t["kind"] == "prediction":
        p = canz["prediction"]
        return (
            f"{head}. Predicted per rank {_per_rank_ms(p['predicted_s'])} ms from the "
            f"calibration table; measured {_per_rank_ms(p['measured_s'])} ms wall, "
            f"{_per_rank_ms(p['measured_cpu_s'])} ms CPU (error against CPU time "
            f"{100 * p['error_cpu']:+.1f}%). The table times each shape once, at the first "
            f"step, with the batch an owner is expected to stack and at a second batch size, "
            f"as the median of five calls (three for a call over 20 ms) taken round by round "
            f"over the shapes (in the thread's CPU time: one intra-op thread per rank; a short "
            f"call after touching 32 MiB, so with cold caches), and takes the median over the "
            f"ranks"
            + (
                "; then the owner calls of the steps (their CPU time, the median over the "
                "ranks) re-priced every shape they ran and the plan was rebuilt on that table, "
                f"in {ROUNDS} rounds ({_rounds_text()}; the timed steps come after it)"
                if canz.get("repricings")
                else ""
            )
            + "; the prediction prices each batch a micro-group stacks as one call, and "
            "the step's owner time is measured in wall time, seconds to a minute after the "
            "table's last timings (this machine's speed drifts by up to 10% in that time"
            + _drift(case)
            + f"): the load average during the case was {load:.1f}"
            + (
                f" and {case['world']} ranks shared the machine's cores"
                if case["world"] > 2
                else ""
            )
            + "; the error against CPU time shows how much of the gap is contention."
        )
    if t["kind"] == "balance_time":
        return (
            f"{head} (the plan's lower bound allows {t['floor']:.3f}). Owner time per rank "
            f"{_per_rank_ms(canz['compute_s'])} ms wall, "
            f"{_per_rank_ms(canz['compute_cpu_s'])} ms CPU (balance in CPU time "
            f"{_ratio(canz.get('balance'))}); predicted "
            f"{_per_rank_ms(canz['plan']['predicted_s'])} ms."
        )
    if t["kind"] == "calibration":
        return (
            f"{head}. Calibration per rank: "
            f"{'/'.join(f'{x:.2f}' for x in canz.get('calibration_s', []))} s; first step "
            f"{_ms(canz.get('first_step_s'))} ms, median step {_ms(canz.get('step_s'))} ms."
        )
    if t["kind"] == "experts_bytes":
        sent = case.get("experts_bytes_sent", {})
        return f"{head}. Bytes per rank for the stacks alone, by strategy: " + "; ".join(
            f"`{s}` {'/'.join(map(str, v))}" for s, v in sent.items()
        )
    if t["kind"] == "exactness":
        return f"{head}: {', '.join(t.get('differ', []))}."
    return None


# ------------------------------------------------------------------------------ Markdown


def render_prediction(cases: list[dict[str, Any]], labels: dict[str, str]) -> str:
    """The predicted against measured owner time of every strategy, and the calibration."""
    rows, calib = [], []
    for c in cases:
        for label, run in c["runs"].items():
            p = run.get("prediction")
            if p is None:
                continue
            rows.append(
                [
                    c["case"],
                    labels.get(label, label),
                    _ratio(run["plan"].get("makespan_ratio_time")),
                    _per_rank_ms(p["predicted_s"]),
                    _per_rank_ms(p["measured_s"]),
                    _per_rank_ms(p["measured_cpu_s"]),
                    f"{100 * p['error']:+.1f}%" if p["error"] is not None else "–",
                    f"{100 * p['error_cpu']:+.1f}%" if p["error_cpu"] is not None else "–",
                ]
            )
        canz = c["runs"].get("canzona", {})
        if "calibration_s" in canz:
            shapes = sum(len(m["table"]) for m in c.get("cost_table", {}).values())
            calib.append(
                [
                    c["case"],
                    f"{max(canz['calibration_s']):.2f}",
                    shapes,
                    _ms(canz.get("first_step_s")),
                    _ms(canz.get("step_s")),
                    canz.get("replans_after_first_step", "–"),
                    canz.get("repricings", "–"),
                    _ms(max(canz["reprice_s"])) if canz.get("reprice_s") else "–",
                ]
            )
    if not rows and not calib:
        return ""
    parts = [
        "### Predicted and measured owner time",
        'The `canzona` strategy plans with measured costs (`PlanConfig(cost="measured")`, '
        "the default): at the first step each rank times the owner math of every distinct "
        "(param group, shape) and the ranks agree on one table. Every strategy's plan is "
        "priced with the table of the case's `canzona` run: a rank's *predicted* owner time "
        "is the sum, over the batches it computes (per micro-group, param group and shape, "
        "as the runtime stacks them), of the table's seconds for one call on that many "
        "matrices (`plan.measured.predict_seconds`: a fixed part and a part per matrix where "
        "the shape was timed at two batch sizes; transfers left out). *Measured* is "
        "`last_step_stats.compute_s` (wall; CPU time "
        "`compute_cpu_s` next to it), the median over the timed steps. The error is "
        "predicted / measured − 1 on the busiest rank (by wall time, and by CPU time); "
        "*planned makespan / LB* prices the plan and its lower bound in the table's seconds "
        "(the bound counts each matrix at its line's price per matrix, the calls' fixed parts "
        "left out, so no stacking of the matrices goes below it). "
        "The table holds wall times taken during the first step: on a machine shared with "
        "other work, or with more ranks than cores, they carry the contention of that moment.",
    ]
    if rows:
        parts.append(
            markdown_table(
                [
                    "case",
                    "strategy",
                    "planned makespan / LB (measured s)",
                    "predicted ms per rank",
                    "measured ms per rank (wall)",
                    "measured CPU ms per rank",
                    "error, busiest rank (wall)",
                    "error (CPU)",
                ],
                rows,
            )
        )
    if calib:
        parts += [
            "Calibration happens once, inside the first step of the `canzona` run. The "
            "steps after it record their owner calls (`PipelineConfig.reprice_steps`, 3 by "
            "default, after the first step), the ranks agree on each call's median, and the "
            "next step re-prices the table with them and re-plans; the new plan's steps do "
            f"it once more, on the calls of both rounds (*re-pricings*: {ROUNDS}; the milliseconds "
            "are the last such step's extra work: the all-gather, the new plan and its "
            "routes); the timed steps start after it. Otherwise steps re-plan only when the "
            "parameters or their groups change.",
            markdown_table(
                [
                    "case",
                    "calibration s (slowest rank)",
                    "shapes timed",
                    "first step ms",
                    "median step ms",
                    "re-plans after the first step",
                    "re-pricings",
                    "re-pricing ms (slowest rank)",
                ],
                calib,
            ),
        ]
    return "\n\n".join(parts)


def render_structure(cases: list[dict[str, Any]], labels: dict[str, str], layers: str) -> str:
    """Expert bytes per strategy (measured and from the plan) and exactness, per case."""
    shown = [c for c in cases if c["model"] == "structure"]
    if not shown:
        return ""
    parts = [
        "### Structure: per-head blocks and experts",
        f"The *structure* model ({layers}) declares its blocks in param groups: "
        '`{"params": [...], "split": canzona.Split(dim=0, size=head_dim)}` for q/k/v, '
        "`Split(dim=1, ...)` for o, the unsplit matrices and expert stacks in a third group, "
        'the router in an `algorithm="adamw"` group. FSDP2 shards every parameter '
        "`Shard(0)`: each rank holds whole experts (expert parallel), which `canzona` and "
        "`numel` keep where they lie, and whole q/k/v heads, which `numel` owns where they "
        "lie and `canzona` too, but for those its refinement moves off their holders to even "
        "the ranks' owner time (the MiB sent per rank in the tables above count them). "
        "Every strategy is compared bit for "
        "bit with the single-device run with the same splits. *Measured* bytes come from an "
        "optimizer holding only the expert stacks (`last_step_stats.bytes_sent` after its "
        "second step; its plan covers the stacks alone, so `round_robin` and `count` may deal "
        "them differently than in the whole model); *from the plan* of the whole model: "
        "gather from the holder and scatter back for every expert computed elsewhere. "
        "*÷ lower bound*: the busiest rank's predicted owner time over the plan's lower "
        "bound, which counts what is pinned (each rank's experts) and that matrices are not "
        "divided (at world 2 some rank takes two of the three dense MLP matrices, the "
        "costliest items), each matrix at its own part of a stacked call (the calls' fixed "
        "parts left out): near 1.000 no assignment of whole blocks does better, and the "
        "lower bound over `numel`'s busiest rank bounds the ratio to `numel` any plan can "
        "reach in owner time.",
    ]
    for c in shown:
        sent = c.get("experts_bytes_sent", {})
        rows = []
        for label in ("replicated", "round_robin", "count", "numel", "canzona"):
            run = c["runs"].get(label)
            if run is None or "step_s" not in run:
                continue
            plan = run.get("plan", {})
            planned = plan.get("pinned_bytes_sent")
            busiest = max(plan["predicted_s"]) if plan.get("predicted_s") else None
            bound = plan.get("lower_bound_s")
            rows.append(
                [
                    labels.get(label, label),
                    _ms(run["step_s"]),
                    _ms(busiest),
                    _ratio(busiest / bound) if busiest is not None and bound else "–",
                    "/".join(map(str, sent[label])) if label in sent else "–",
                    "/".join(map(str, planned)) if planned is not None else "–",
                    "yes" if run.get("identical") else "**no**",
                ]
            )
        same = "yes" if c["single_device"].get("matches_distributed") else "**no**"
        parts += [
            f"#### {c['case']}: `canzona` parameters equal to the single-device run with the "
            f"same splits: {same}",
            markdown_table(
                [
                    "strategy",
                    "step ms",
                    "busiest rank's owner ms, predicted",
                    "÷ lower bound",
                    "expert bytes sent per rank, measured",
                    "from the plan",
                    "params = canzona",
                ],
                rows,
            ),
        ]
    return "\n\n".join(parts)


def _pair(c: dict[str, Any], pair: tuple[str, str]) -> list[str] | None:
    """Step times of two runs of a case: each median, the ratio of medians, per round."""
    a, b = (c["runs"].get(k, {}) for k in pair)
    if "step_s" not in a or "step_s" not in b:
        return None
    per_round = [x / y for x, y in zip(a["steps_s"], b["steps_s"], strict=False)]
    return [
        c["case"],
        _ms(a["step_s"]),
        _ms(b["step_s"]),
        _ratio(a["step_s"] / b["step_s"]),
        _ratio(_median(per_round)),
    ]


def render_atomic(cases: list[dict[str, Any]]) -> str:
    """Step time with and without the copies that make a failed step change nothing."""
    rows = []
    for c in cases:
        row = _pair(c, ATOMIC)
        if row is None:
            continue
        backup = c["runs"]["canzona"].get("backup_bytes", [])
        params = c.get("param_bytes", [])
        share = "/".join(f"{x / y:.2f}" for x, y in zip(backup, params, strict=False) if y)
        rows.append([*row, _mib(backup), _mib(params), share or "–"])
    if not rows:
        return ""
    return "\n\n".join(
        [
            "### Cost of the all-or-nothing step",
            "With `PipelineConfig(atomic=True)` (the default) the optimizer copies the state a "
            "step changes before its success vote (momentum, Adam moments, owner-held state), "
            "so that a failed step changes nothing on any rank; `atomic=False` skips the copies "
            "(the parameters are still written only after the vote). *Backup* is "
            "`last_step_stats.backup_bytes` of the default run, the memory the copies hold "
            "during a step, next to the bytes of the parameters each rank holds.",
            markdown_table(
                [
                    "case",
                    "step ms, atomic (default)",
                    "step ms, `atomic=False`",
                    "ratio of medians",
                    "median of per-round ratios",
                    "backup MiB per rank",
                    "parameter MiB per rank",
                    "backup / parameters",
                ],
                rows,
            ),
        ]
    )


def render_buffers(cases: list[dict[str, Any]]) -> str:
    """Step time with the step buffers kept between steps (the CPU default) and freed."""
    rows = [row for c in cases if (row := _pair(c, BUFFERS)) is not None]
    if not rows:
        return ""
    return "\n\n".join(
        [
            "### Step buffers kept between steps",
            "On the CPU, `PipelineConfig(keep_buffers=None)` (the default) keeps the step's flat "
            "buffers (payloads and, with `atomic`, the state copies) allocated between steps; "
            "`keep_buffers=False` frees them after each step, as the default does on "
            "accelerators, and the next step faults their pages in again.",
            markdown_table(
                [
                    "case",
                    "step ms, kept (default)",
                    "step ms, `keep_buffers=False`",
                    "ratio of medians",
                    "median of per-round ratios",
                ],
                rows,
            ),
        ]
    )


def render_depth(cases: list[dict[str, Any]]) -> str:
    """Pipeline depth 1-3 and one micro-group: step time and per-group imbalance."""
    parts = []
    for c in cases:
        runs = c["runs"]
        if not all(k in runs and "step_s" in runs[k] for k in DEPTH):
            continue
        base = runs["canzona"]["step_s"]
        rows = [
            [
                DEPTH_LABELS[k],
                _ms(runs[k]["step_s"]),
                _ratio(runs[k]["step_s"] / base),
                runs[k].get("micro_groups", "–"),
                _ratio(runs[k].get("plan", {}).get("group_factor")),
                _ratio(runs[k].get("group_factor_measured")),
                _ms(max(runs[k].get("wait_s", [0.0]))),
            ]
            for k in DEPTH
        ]
        parts += [
            f"#### {c['case']}",
            markdown_table(
                [
                    "pipeline",
                    "step ms",
                    "× depth 1",
                    "micro-groups",
                    "summed per-group imbalance, planned",
                    "measured",
                    "wait ms, slowest rank",
                ],
                rows,
            ),
        ]
    if not parts:
        return ""
    head = [
        "### Micro-groups: pipeline depth and one group",
        "`PipelineConfig(depth=d)` issues gathers `d` micro-groups ahead and keeps `d` "
        "scatters in flight, so ranks may drift `d` groups apart; one micro-group "
        "(`PlanConfig(capacity_mb=4096)`) has nothing to wait for between groups but "
        "nothing to overlap either. *Summed per-group imbalance*: the sum over micro-groups "
        "of the busiest rank's load in the group, over the busiest rank's total (1.0: every "
        "group as even as the whole plan); *planned* in the calibration table's seconds, "
        "*measured* from each rank's compute time per group (`last_step_stats."
        "group_compute_s`), median over steps.",
    ]
    return "\n\n".join(head + parts)
