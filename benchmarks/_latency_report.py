"""Report side of the step-latency benchmark: targets, notes, Markdown and the chart.

Everything here works on the JSON payload of ``step_latency.py`` (plain dicts), so the
section of ``docs/benchmarks.md`` can be re-rendered from a results file without a run.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _peers
from _latency_checks import (
    _mib,
    _ms,
    _ratio,
    best_baseline,
    format_bound,
    format_measured,
    note,
    ratio_row,
    render_atomic,
    render_buffers,
    render_depth,
    render_prediction,
    render_structure,
    structure_targets,
    target_row,
    time_targets,
)
from _qwen import layer_shapes

from _report import markdown_table

STRATEGIES = ("replicated", "round_robin", "count", "numel", "canzona", "canzona_no_overlap")
#: Extra ``canzona`` runs that show where time goes: not part of the step-time targets.
DIAGNOSTICS = (
    "canzona_unchecked",
    "canzona_one_group",
    "canzona_depth2",
    "canzona_depth3",
    "canzona_not_atomic",
    "canzona_free_buffers",
)
LABELS = {
    "replicated": "`replicated` (synchronous baseline)",
    "round_robin": "`round_robin` (layer-wise)",
    "count": "`count` (dion-style)",
    "numel": "`numel` (the paper's proxy)",
    "canzona": "`canzona` (α-balanced + micro-groups + overlap)",
    "canzona_no_overlap": "`canzona`, `overlap=False`",
    "canzona_unchecked": "`canzona`, no per-step checks or progress markers (diagnostic)",
    "canzona_one_group": "`canzona`, one micro-group (diagnostic)",
    "canzona_depth2": "`canzona`, pipeline depth 2 (diagnostic)",
    "canzona_depth3": "`canzona`, pipeline depth 3 (diagnostic)",
    "canzona_not_atomic": "`canzona`, `atomic=False` (diagnostic)",
    "canzona_free_buffers": "`canzona`, `keep_buffers=False` (diagnostic)",
}
TARGETS = {
    "muon_w4_vs_replicated": 0.35,
    "muon_w2_vs_replicated": 0.6,
    "hetero_w2_vs_rr_count": 0.9,
    "hetero_w2_vs_numel": 1.0,
    "vs_fastest_peer": 1.0,
    "redundancy": 1.15,
    "balance": 1.10,
    "precond_w4_vs_replicated": 0.3,
    "w128_w2_vs_replicated": 0.6,
    "w128_w4_vs_replicated": 0.35,
}


def group_sync_factor(
    widths: Sequence[int], world: int, strategy: str, capacity_mb: float, optimizer: str
) -> float:
    """Planned sum over micro-groups of the busiest rank's load, over the busiest total load.

    1.0 when every micro-group is as balanced as the whole plan; above 1 when ranks that
    finish a group early must wait for its gather or scatter.
    """
    from canzona.plan import MatrixSpec, PlanConfig, build_plan

    specs = [
        MatrixSpec(f"layers.{i}.{name}", shape)
        for i, h in enumerate(widths)
        for name, shape in layer_shapes(h).items()
    ]
    config = PlanConfig(strategy=strategy, capacity_mb=capacity_mb)
    plan = build_plan(specs, world, config, optimizer=optimizer)
    loads = [g.rank_loads for g in plan.micro_groups]
    totals = [sum(x) for x in zip(*loads, strict=True)]
    return float(sum(max(g) for g in loads) / max(totals))


def _find(
    cases: list[dict[str, Any]], optimizer: str, model: str, mesh: str, world: int
) -> dict[str, Any] | None:
    for c in cases:
        if (c["optimizer"], c["model"], c["mesh"], c["world"]) == (optimizer, model, mesh, world):
            return c
    return None


def evaluate_targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target with its measured value (None when the case was not run)."""
    rows: list[dict[str, Any]] = []
    for world, key in ((4, "muon_w4_vs_replicated"), (2, "muon_w2_vs_replicated")):
        c = _find(cases, "muon", "qwen", "fsdp", world)
        if c is not None:
            rows.append(
                ratio_row(
                    f"Muon, world {world} (FSDP): `canzona` / `replicated`",
                    "vs_replicated",
                    c,
                    TARGETS[key],
                    "replicated",
                )
            )
    for world in (2, 4):  # small matrices: what remains is the runtime's host work
        c = _find(cases, "muon", "w128", "fsdp", world)
        if c is not None:
            rows.append(
                ratio_row(
                    f"Qwen3-like width 128, 2 layers, world {world}: `canzona` / `replicated`",
                    "vs_replicated",
                    c,
                    TARGETS[f"w128_w{world}_vs_replicated"],
                    "replicated",
                )
            )
    c = _find(cases, "muon", "hetero", "fsdp", 2)
    if c is not None:
        best = best_baseline(c)
        rows.append(
            ratio_row(
                f"heterogeneous, world 2: `canzona` / best of `round_robin`, `count` ({best})",
                "hetero",
                c,
                TARGETS["hetero_w2_vs_rr_count"],
                best,
            )
        )
        rows.append(
            ratio_row(
                "heterogeneous, world 2: `canzona` / `numel`",
                "hetero",
                c,
                TARGETS["hetero_w2_vs_numel"],
                "numel",
            )
        )
    rows += structure_targets(cases)
    for world in (2, 4):
        c = _find(cases, "muon", "qwen", "fsdp", world)
        if c is None:
            continue
        peers = {
            k: v["step_s"]
            for k, v in c["runs"].items()
            if k not in (*STRATEGIES, *DIAGNOSTICS) and "step_s" in v
        }
        if peers:
            fastest = min(peers, key=peers.__getitem__)
            rows.append(
                ratio_row(
                    f"Muon, world {world}: `canzona` / fastest peer ({fastest})",
                    "peer",
                    c,
                    TARGETS["vs_fastest_peer"],
                    fastest,
                )
            )
    for c in cases:
        run = c["runs"].get("canzona", {})
        if "redundancy" in run:
            rows.append(
                target_row(
                    f"{c['case']}: `canzona` redundancy factor (CPU seconds)",
                    "redundancy",
                    c,
                    TARGETS["redundancy"],
                    run["redundancy"],
                )
            )
            plan = run.get("plan", {})
            floor = (
                plan["lower_bound_s"] / statistics.mean(plan["predicted_s"])
                if plan.get("lower_bound_s") and plan.get("predicted_s")
                else None
            )
            row = target_row(
                f"{c['case']}: `canzona` per-rank compute balance (CPU seconds)",
                "balance",
                c,
                TARGETS["balance"],
                run["balance"],
                floor=floor,
            )
            missed = row["met"] is False
            if missed and floor is not None and floor > TARGETS["balance"]:  # ruled out
                row["met"] = None
            rows.append(row)
    for optimizer in ("shampoo", "soap"):
        c = _find(cases, optimizer, "small", "fsdp", 4)
        if c is not None:
            rows.append(
                ratio_row(
                    f"{optimizer.capitalize()}, world 4: `canzona` / `replicated`",
                    "vs_replicated",
                    c,
                    TARGETS["precond_w4_vs_replicated"],
                    "replicated",
                )
            )
    return rows + time_targets(cases)


def _spread(cases: list[dict[str, Any]]) -> float:
    """Largest median / best step of ``canzona`` over the cases."""
    runs = [c["runs"]["canzona"] for c in cases if "step_s" in c["runs"].get("canzona", {})]
    return max((r["step_s"] / r["step_min_s"] for r in runs), default=1.0)


def render_case(c: dict[str, Any]) -> str:
    rows = []
    planned = c.get("planned_makespan_ratio", {})
    for label in (*STRATEGIES, *DIAGNOSTICS):
        run = c["runs"].get(label)
        if run is None or "step_s" not in run:
            continue
        plan_key = "canzona" if label.startswith("canzona") else label
        rows.append(
            [
                LABELS[label],
                _ratio(planned.get(plan_key)) if label != "replicated" else "–",
                f"{_ms(run['step_s'])} ({_ms(run['step_min_s'])}–{_ms(run['step_max_s'])})",
                _ratio(run.get("vs_replicated")),
                "/".join(f"{x * 1e3:.0f}" for x in run.get("compute_cpu_s", [])),
                _ratio(run.get("balance")),
                _ratio(run.get("redundancy")),
                f"{_ratio(run.get('redundancy_wall'))}",
                _mib(run.get("bytes_sent", [])),
                "/".join(map(str, run.get("collectives", []))),
                "yes" if run.get("identical") else "**no**",
            ]
        )
    sd = c["single_device"]
    head = (
        f"#### {c['optimizer'].capitalize()}, {c['model_name']} ({c['model_layers']}), "
        f"{c['mesh']}, world {c['world']}\n\n"
        f"Single device: step {_ms(sd['step_s'])} ms, compute {sd['compute_cpu_s'] * 1e3:.0f} "
        f"CPU ms; `canzona` parameters equal to the single-device ones bit for bit: "
        f"{'yes' if sd['matches_distributed'] else '**no**'}. Micro-groups per step "
        f"(`capacity_mb={c['capacity_mb']}`): "
        f"{c['runs'].get('canzona', {}).get('micro_groups', '–')}. Load average during the "
        f"case: {c['load_average'][0]:.1f} (single-device compute wall/CPU "
        f"{sd['wall_over_cpu']:.2f}; 1.0 on an idle machine)."
    )
    table = markdown_table(
        [
            "strategy",
            "planned makespan / LB (FLOPs)",
            "step ms, median (min–max)",
            "× replicated",
            "compute per rank, CPU ms",
            "balance",
            "redundancy",
            "redundancy (wall)",
            "MiB sent per rank",
            "collectives",
            "params = canzona",
        ],
        rows,
    )
    return f"{head}\n\n{table}"


def render_peers(cases: list[dict[str, Any]]) -> str:
    lines = []
    with_peers = [c for c in cases if any(k not in (*STRATEGIES, *DIAGNOSTICS) for k in c["runs"])]
    errors: dict[str, dict[str, str]] = {}
    for c in with_peers:
        rows = []
        for label, run in c["runs"].items():
            if label in (*STRATEGIES, *DIAGNOSTICS) and label not in ("canzona", "replicated"):
                continue
            name = LABELS.get(label) or _peers.PEER_LABELS.get(label, label)
            if "error" in run:
                errors.setdefault(label, {})[c["case"]] = run["error"]
                continue
            same = "bitwise" if run.get("identical") else f"max rel. diff {run['max_rel_diff']:.1e}"
            rows.append(
                [
                    name,
                    _ms(run["step_s"]),
                    _ratio(run.get("vs_canzona")),
                    _ratio(run.get("vs_replicated")),
                    "–" if label == "canzona" else same,
                ]
            )
        lines += [
            f"#### Muon peers, {c['model_name']}, {c['mesh']}, world {c['world']}",
            "",
            markdown_table(
                [
                    "implementation",
                    "step ms (median)",
                    "× canzona",
                    "× replicated",
                    "parameters vs canzona",
                ],
                rows,
            ),
            "",
        ]
    for name, why in _peers.NOT_INSTALLABLE.items():
        errors.setdefault(name, {})["all cases"] = f"not installed: {why}"
    if errors:
        lines += ["Peers that did not run, with the exact error:", ""]
        for label, where in errors.items():
            texts: dict[str, list[str]] = {}
            for case, text in where.items():
                texts.setdefault(text, []).append(case)
            for text, where_ in texts.items():
                lines.append(
                    f"- {_peers.PEER_LABELS.get(label, label)} ({', '.join(where_)}): `{text}`"
                )
        lines.append("")
    return "\n".join(lines)


def _verdict(t: dict[str, Any]) -> str:
    if t["met"] is None:
        return "–" if "floor" not in t else f"– (lower bound allows {t['floor']:.3f})"
    return "met" if t["met"] else "**missed**"


def render(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    cases = payload["cases"]
    targets = payload["targets"]
    target_rows = [
        [
            t["name"],
            format_bound(t),
            format_measured(t),
            _ratio(t.get("paired")),
            _ratio(t.get("best")),
            _verdict(t),
        ]
        for t in targets
    ]
    parts = [
        "## Optimizer step latency",
        f"`{payload['command']}` ({payload['mode']} mode, {payload['date']}, commit "
        f"`{payload.get('commit') or 'not recorded'}`): {payload['cpu']}, "
        f"{m['cpu_count']} cores, torch {m['torch']}, gloo, one intra-op thread per rank "
        f"(`OMP_NUM_THREADS={m['omp_num_threads']}`), {payload['steps']} timed steps after "
        f"{payload['warmup']} warm-up steps{_more_steps(payload)}; "
        f"{payload['bench_seconds']:.0f} s in all.",
        "Each case forks its ranks once and runs every strategy (and, for Muon, every peer) "
        "from the same initial weights on the same gradients. A step's time is the slowest "
        "rank's `optimizer.step()` after a barrier; the table gives the median and the range "
        "over the timed steps. *Compute per rank* is the CPU time of the owner-side math "
        "(the Newton–Schulz or preconditioner work: `last_step_stats.compute_cpu_s`; "
        "`compute_s` is its wall time); *balance* is max/mean of it; *redundancy* is its sum "
        "over ranks divided by the compute of one process running the same optimizer on the "
        "unsharded model (ideal 1.0; `replicated` ≈ W). The wall-clock variant is shown too: "
        "with 4 ranks on 2 cores two ranks share a core whenever more than two compute at once, "
        "which inflates wall seconds but not CPU seconds. *Planned makespan / LB (FLOPs)* "
        "prices each strategy's plan as it ran (for `canzona`, balanced in measured seconds) "
        "in the optimizer's closed-form FLOPs; the same plans in measured seconds are in the "
        "prediction section below. Muon: lr 0.02, momentum 0.95 "
        "(Nesterov), weight decay 0.1, bf16 Newton–Schulz (5 steps, torch's coefficients). "
        "Shampoo and SOAP refresh their preconditioners every step "
        "(`precondition_frequency=1`), the step whose work the owners split.",
        "Models (`benchmarks/_qwen.py`): Qwen3-0.6B's seven matrices per layer with its "
        "proportions at width h (q 2h×h, k/v h×h for 16 query over 8 key/value heads, "
        "o h×2h, gate/up 3h×h, down h×3h). "
        + "; ".join(
            f"*{v['name']}*: {v['layers']}"
            for k, v in payload["models"].items()
            if k != "structure"
        )
        + ". The *structure* model (`benchmarks/_structure.py`) is described with its section "
        "below.",
        "### Targets",
        markdown_table(
            [
                "target",
                "bound",
                "measured (ratio of medians)",
                "median of per-round ratios",
                "ratio of best steps",
                "",
            ],
            target_rows,
        ),
        "A target is met or missed on the ratio of median step times (other targets: on the "
        "measured value shown; `–` where it does not apply, e.g. a balance the plan's lower "
        "bound rules out). The strategies and peers "
        "of a case take turns step by step (a *round* is one step of each), so the median of "
        "the per-round ratios pairs steps taken seconds apart, and the ratio of best steps "
        "shows each side with the least interference. All three are given because this "
        "machine was shared with other work during the run (see each case's load average): "
        f"the median `canzona` step was up to {_spread(cases):.2f}× its best step.",
    ]
    if payload.get("notes"):
        parts.append("\n".join(f"- {n}" for n in payload["notes"]))
    parts.append("### Strategies")
    parts += [render_case(c) for c in cases]
    structure = payload["models"].get("structure", {}).get("layers", "")
    for extra in (
        render_prediction(cases, LABELS),
        render_structure(cases, LABELS, structure),
        render_atomic(cases),
        render_buffers(cases),
        render_depth(cases),
    ):
        if extra:
            parts.append(extra)
    peers = render_peers(cases)
    if peers:
        parts += [
            "### Other distributed Muon implementations",
            "Same model, gradients, hyper-parameters and bf16 Newton–Schulz, in the same "
            "run as the strategies above. heavyball's Muon uses its own Newton–Schulz "
            "coefficients and momentum, so its parameters differ by design; muon-fsdp2 "
            "compiles its Newton–Schulz and adds eps to the norm instead of clamping it. "
            "`torch.optim.Muon` on the DTensors takes seconds per step, so it is timed over "
            f"{payload.get('slow_peer_steps', 3)} steps and compared with `canzona` after as "
            "many. `nox -s bench` installs the peers with `--no-deps` (pip never replaces "
            "the pinned torch; versions in `noxfile.py`); a missing one is listed below "
            "with its import error. torchtitan's DistMuon runs on CPU with two shims in "
            "`benchmarks/_peers.py`: "
            "it requires one CUDA device per process (the shim returns the CPU device) and "
            "builds its transfer stream with CUDA-only arguments "
            "(`Stream(device=..., priority=0)`). On the structure case the peers get the "
            "matrices as the model holds them (no per-head blocks, expert stacks as 3-D "
            "tensors; the router, which canzona's AdamW group updates, is left out), so their "
            "parameters differ from canzona's by design.",
            peers,
        ]
    if payload.get("chart"):
        rel = Path(os.path.relpath(payload["chart"], Path(payload["doc"]).parent)).as_posix()
        parts.append(f"![per-rank compute per strategy]({rel})")
    return "\n\n".join(parts)


def _held(case: dict[str, Any]) -> str:
    """Where the structure model's held matrices are owned, from the case's bytes sent."""
    runs, experts = case["runs"], case.get("experts_bytes_sent", {})
    mib = {
        s: "/".join(f"{b / 2**20:.1f}" for b in runs[s]["bytes_sent"]) for s in ("canzona", "numel")
    }
    stay = [s for s in ("canzona", "numel") if s in experts and not any(experts[s])]
    out = (
        " On the structure model `Shard(0)` rows leave whole heads and whole experts on one "
        "rank. "
        + (
            f"Every expert stays where it lies under {' and '.join(f'`{s}`' for s in stay)} "
            "(0 bytes sent for the expert stacks), and `numel`"
            if stay
            else "`numel`"
        )
        + " owns every q/k/v head block on the rank that holds it: it sends "
        f"{mib['numel']} MiB per rank. "
    )
    extra = sum(runs["canzona"]["bytes_sent"]) > sum(runs["numel"]["bytes_sent"])
    out += (
        "`canzona`'s refinement moves some head blocks off their holders to even the ranks' "
        "owner time, and each such block travels whole to its owner and back: `canzona` "
        f"sends {mib['canzona']} MiB per rank."
        if extra
        else f"So does `canzona` ({mib['canzona']} MiB per rank)."
    )
    return out + (
        " The o-projection blocks (columns, split across the ranks' rows) and the three dense "
        "MLP matrices are placed freely; with three MLP matrices on two ranks one rank holds "
        "two of them."
    )


def _more_steps(payload: dict[str, Any]) -> str:
    """Models timed over more steps than the rest (short steps), e.g. " (w128: 60)"."""
    more = {
        c["model"]: c["steps"] for c in payload["cases"] if c.get("steps", 0) > payload["steps"]
    }
    return " (" + ", ".join(f"{k}: {v}" for k, v in sorted(more.items())) + ")" if more else ""


def _group_factor(payload: dict[str, Any], case: dict[str, Any], strategy: str) -> float:
    """The planned per-group imbalance of a run: from its plan, else re-planned in FLOPs."""
    planned = case["runs"].get(strategy, {}).get("plan", {}).get("group_factor")
    if planned is not None:
        return float(planned)
    widths = payload["models"][case["model"]]["widths"]
    return group_sync_factor(
        widths, case["world"], strategy, case["capacity_mb"], case["optimizer"]
    )


def explain(payload: dict[str, Any]) -> list[str]:
    """One note per missed target, decomposing the measured numbers."""
    cases = {c["case"]: c for c in payload["cases"]}
    notes: list[str] = []
    for t in payload["targets"]:
        if t["met"] is not False:
            continue
        c = cases[t["case"]]
        own = note(t, c, payload)
        if own is not None:
            notes.append(own)
            continue
        runs, world = c["runs"], c["world"]
        canz = runs["canzona"]
        head = f"**{t['name']}**: {format_measured(t)} against {format_bound(t)}"
        if t.get("best") is not None:
            head += f" (per-round {_ratio(t['paired'])}, best steps {_ratio(t['best'])})"
        rest = canz["step_s"] - max(canz["compute_s"])
        if t["kind"] == "vs_replicated":
            lean = runs.get("canzona_unchecked", {}).get("step_s")
            lean_txt = (
                f"; without the per-step checks and progress markers the step takes "
                f"{_ms(lean)} ms ({_ratio(lean / runs['replicated']['step_s'])} × replicated)"
                if lean
                else ""
            )
            one = runs.get("canzona_one_group")
            if one:  # the case's capacity cuts the plan; the default one would not
                lean_txt += (
                    f". The case's capacity ({c['capacity_mb']:g} MB) cuts the plan into "
                    f"{canz['micro_groups']} micro-groups, each with its own collectives and "
                    f"smaller kernel calls; in one group (the default capacity holds this "
                    f"model) the step takes {_ms(one['step_s'])} ms "
                    f"({_ratio(one['step_s'] / runs['replicated']['step_s'])} × replicated)"
                )
            notes.append(
                f"{head}. `canzona` step {_ms(canz['step_s'])} ms = owner compute (slowest "
                f"rank {_ms(max(canz['compute_s']))} ms wall, {_ms(max(canz['compute_cpu_s']))} "
                f"ms CPU) + {_ms(rest)} ms of collectives, element-wise phases and checks; "
                f"`replicated` {_ms(runs['replicated']['step_s'])} ms. The ideal 1/{world} "
                f"holds for the compute only: the non-compute part does not shrink with the "
                f"number of owners{lean_txt}."
            )
        elif t["kind"] == "hetero":
            other = runs[t["versus"]]
            timed = "canzona" in c.get("planned_makespan_ratio_time", {})
            plan = c.get("planned_makespan_ratio_time" if timed else "planned_makespan_ratio", {})
            unit = "the calibration table's seconds" if timed else "FLOPs"
            bound = plan.get("canzona", 1.0) / plan.get(t["versus"], 1.0)
            lean = runs.get("canzona_unchecked", {}).get("step_s")
            rest_other = other["step_s"] - max(other["compute_s"])
            sync = {s: _group_factor(payload, c, s) for s in ("canzona", t["versus"])}
            notes.append(
                f"{head}. The plans' makespan / LB in {unit} is {_ratio(plan.get('canzona'))} "
                f"for `canzona` and {_ratio(plan.get(t['versus']))} for `{t['versus']}`, so even "
                f"a purely compute-bound step cannot beat {bound:.3f}. Measured, the slowest "
                f"rank's owner compute is {_ms(max(canz['compute_cpu_s']))} vs "
                f"{_ms(max(other['compute_cpu_s']))} CPU ms "
                f"({max(canz['compute_cpu_s']) / max(other['compute_cpu_s']):.3f}); outside "
                f"the owner compute (gather and scatter, the element-wise phases, the per-step "
                f"checks) `canzona` spends {_ms(rest)} ms and `{t['versus']}` "
                f"{_ms(rest_other)} ms. "
                + (
                    "Part of `canzona`'s extra is waiting inside the pipeline: its micro-groups "
                    "are less even than its totals"
                    if rest > rest_other and sync["canzona"] > sync[t["versus"]]
                    else "The micro-groups' evenness does not explain the difference"
                )
                + ": summed over the groups, the busiest rank's load "
                f"is {sync['canzona']:.3f}× the busiest rank's total for `canzona` and "
                f"{sync[t['versus']]:.3f}× for `{t['versus']}`, and each group's gather and "
                f"scatter wait for all of its owners (the overlap hides this only in part)"
                + (
                    f". Without the per-step checks and progress markers `canzona` takes "
                    f"{_ms(lean)} ms ({lean / other['step_s']:.3f} × `{t['versus']}`)"
                    if lean
                    else ""
                )
                + "."
                + (_held(c) if c["model"] == "structure" else "")
            )
        elif t["kind"] == "peer":
            peer = runs[t["versus"]]
            notes.append(
                f"{head}: `canzona` {_ms(canz['step_s'])} ms vs {t['versus']} "
                f"{_ms(peer['step_s'])} ms (median over {c['steps']} interleaved steps; "
                f"ranges {_ms(canz['step_min_s'])}–{_ms(canz['step_max_s'])} and "
                f"{_ms(peer['step_min_s'])}–{_ms(peer['step_max_s'])} ms). `canzona` spends "
                f"{_ms(rest)} ms per step outside the owner compute"
                + (
                    f"; without per-step checks and progress markers its step takes "
                    f"{_ms(runs['canzona_unchecked']['step_s'])} ms"
                    if "canzona_unchecked" in runs
                    else ""
                )
                + "."
            )
        elif t["kind"] == "redundancy":
            sd = c["single_device"]
            notes.append(
                f"{head}: the ranks' owner compute adds up to "
                f"{_ms(sum(canz['compute_cpu_s']))} CPU ms against "
                f"{_ms(sd['compute_cpu_s'])} on one process. No matrix is computed twice "
                f"(each rank's `matrices_computed`: {canz['matrices_computed']}); the single "
                f"process stacks the same-shape matrices of all layers into one batched "
                f"kernel, while an owner gets one or two of each shape per micro-group."
            )
        elif t["kind"] == "balance":
            notes.append(
                f"{head}: per-rank owner compute "
                f"{'/'.join(f'{x * 1e3:.0f}' for x in canz['compute_cpu_s'])} CPU ms; planned "
                f"makespan / LB {_ratio(c.get('planned_makespan_ratio', {}).get('canzona'))}."
            )
    return notes
