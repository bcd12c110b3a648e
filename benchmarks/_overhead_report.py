"""Report of ``overhead.py``: the Markdown section of ``docs/benchmarks.md`` and its plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _report import markdown_table

IMPLS = (
    "canzona",
    "canzona_gc_on",
    "replicated",
    "redistribute",
    "torchtitan",
    "torch_muon",
    "adamw_foreach",
    "shampoo",
    "soap",
)
LABELS = {
    "canzona": "`canzona.Muon`, `canzona` plan",
    "canzona_gc_on": "`canzona.Muon`, `canzona` plan, `pause_gc=False`",
    "replicated": "`canzona.Muon`, `replicated` plan",
    "redistribute": "`DTensor.redistribute` Muon (every rank gathers every matrix)",
    "torchtitan": "torchtitan 0.3.0 DistMuon",
    "torch_muon": "one process: `torch.optim.Muon`",
    "adamw_foreach": "one process: `AdamW(foreach=True)`",
    "shampoo": "`canzona.Shampoo`, `canzona` plan, no root refresh in the timed steps",
    "soap": "`canzona.SOAP`, `canzona` plan, no basis refresh in the timed steps",
}
#: Small all-to-alls timed per case for the collective's floor (``overhead.FLOOR_CALLS``).
FLOOR_CALLS = 100
#: Steps a profiled case records, and takes in turn with its replay (``_replay.replay``).
REPLAY_TURNS = 30
#: Implementations with one collective per matrix (seconds per step at large N): timed steps.
SLOW_STEPS = {"redistribute": 3}
#: Implementations that run only in the target case (shape, world): diagnostics.
ONLY_IN = {"canzona_gc_on": ("8x8", 2), "shampoo": ("8x8", 2), "soap": ("8x8", 2)}


def fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``(fixed, slope)`` of time against N."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - slope * mx, slope


def _launch_fits(rows: Sequence[dict[str, Any]]) -> str:
    """The target case's fit per launch and its smallest step: how far the noise moves it.

    The published fit runs through the median over the launches at each N; a fit through one
    launch's steps alone, and the step at the smallest N (mostly fixed cost), show how much of
    the intercept is noise. Empty when the case ran in fewer than two launches.
    """
    case = sorted((r for r in rows if (r["shape"], r["world"]) == ("8x8", 2)), key=lambda r: r["n"])
    runs = [r.get("launches", {}).get("canzona", []) for r in case]
    count = min((len(v) for v in runs), default=0)
    if len(case) < 2 or count < 2 or not all(isinstance(x, float) for v in runs for x in v):
        return ""
    per = [
        fit_line([(r["n"], v[k]) for r, v in zip(case, runs, strict=True)]) for k in range(count)
    ]
    fixed = ", ".join(f"{f * 1e3:.2f}" for f, _ in per)
    slope = ", ".join(f"{s * 1e6:.1f}" for _, s in per)
    low = case[0]
    first = runs[0]
    return (
        f"Fitted to each launch on its own, `canzona`'s fixed cost is {fixed} ms (slope "
        f"{slope} µs per matrix): the intercept moves with the noise of the largest N. The "
        f"step at N = {low['n']} (mostly fixed cost) took {min(first) * 1e3:.2f} to "
        f"{max(first) * 1e3:.2f} ms in the {count} launches."
    )


def _adamw_launches(rows: Sequence[dict[str, Any]], n: int = 1024) -> str:
    """The AdamW target's two sides launch by launch, and where the ``canzona`` step goes.

    Empty unless both the world-2 ``canzona`` and the one-process AdamW case ran at ``n``.
    """
    by = {(r["shape"], r["world"], r["n"]): r for r in rows}
    ours, one = by.get(("8x8", 2, n)), by.get(("8x8", 1, n))
    if ours is None or one is None:
        return ""
    mine = ours.get("launches", {}).get("canzona", [])
    theirs = one.get("launches", {}).get("adamw_foreach", [])
    if not mine or len(mine) != len(theirs):
        return ""
    ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(mine, theirs, strict=True))
    text = (
        f"At N = {n}, launch by launch, the `canzona` step took "
        + ", ".join(f"{x * 1e3:.2f}" for x in mine)
        + " ms and one process's AdamW(foreach) step "
        + ", ".join(f"{x * 1e3:.2f}" for x in theirs)
        + f" ms (ratios {ratios})."
    )
    prof = ours.get("profile")
    if prof:
        before = prof["step_s"] - prof["total_s"]
        text += (
            f" Of rank 0's median step ({prof['step_s'] * 1e3:.2f} ms), "
            f"{before * 1e3:.2f} ms come before the matrix phase (the momentum update into "
            f"the payloads), {prof['compute_s'] * 1e3:.2f} ms are the "
            f"owners' Newton–Schulz and {prof['apply_s'] * 1e3:.2f} ms the apply."
        )
    return text


def _gc_sentence(rows: Sequence[dict[str, Any]]) -> str:
    """``canzona`` (collector paused in the step) against ``pause_gc=False``, launch by launch."""
    case = sorted(
        (r for r in rows if (r["shape"], r["world"]) == ONLY_IN["canzona_gc_on"]),
        key=lambda r: r["n"],
    )
    parts = []
    for r in case:
        ours = r.get("launches", {}).get("canzona", [])
        on = r.get("launches", {}).get("canzona_gc_on", [])
        pairs = [
            (a, b)
            for a, b in zip(ours, on, strict=False)
            if isinstance(a, float) and isinstance(b, float)
        ]
        if pairs:
            ratios = ", ".join(f"{a / b:.3f}" for a, b in pairs)
            parts.append(f"N = {r['n']}: {ratios}")
    if not parts:
        return ""
    return (
        "The collector paused during the step (`PipelineConfig(pause_gc=True)`, the default) "
        "against left on (`pause_gc=False`), at world 2 on 8x8 matrices, step time paused / on "
        "within each launch (both run in the same processes, one after the other): "
        + "; ".join(parts)
        + "."
    )


def _same_rows(rows: Sequence[dict[str, Any]]) -> str:
    """Which distributed runs ended bitwise equal to the one-process ``canzona.Muon``."""
    verdicts: dict[str, list[bool]] = {}
    for r in rows:
        for impl, same in r.get("same_as_one_process", {}).items():
            verdicts.setdefault(impl, []).append(same)
    if not verdicts:
        return ""
    parts = [f"{LABELS[impl]}: {sum(v)} of {len(v)} runs" for impl, v in sorted(verdicts.items())]
    return (
        "After the timed steps, rank 0's parameters equal the rows of the one-process "
        "`canzona.Muon` (same matrices, gradients and steps) bit for bit in: "
        + "; ".join(parts)
        + "."
    )


def _render_profile(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where a ``canzona`` step goes at world 2 on 8x8 matrices (rank 0, ``last_step_stats``)."""
    shown = sorted(
        (r for r in rows if r["shape"] == "8x8" and r["world"] == 2 and "profile" in r),
        key=lambda r: r["n"],
    )
    if not shown:
        return []
    body = []
    for r in shown:
        p = r["profile"]
        before = p["step_s"] - p["total_s"]
        rest = p["total_s"] - p["compute_s"] - p["wait_s"] - p["apply_s"]
        spread = [f"{p[k] * 1e3:.2f}" if k in p else "–" for k in ("skew_s", "from_last_s")]
        calls = [
            f"{p[k] * 1e3:.2f}" if k in p else "–"
            for k in ("host_gaps_s", "step_calls_s", "replay_calls_s")
        ]
        turn = f"{p['replay_s'] / p['paired_step_s']:.2f}" if "replay_s" in p else "–"
        body.append(
            [
                r["n"],
                *(f"{x * 1e3:.2f}" for x in (p["step_s"], before, p["wait_s"])),
                *(f"{x * 1e3:.2f}" for x in (p["compute_s"], p["apply_s"], rest)),
                int(p["collectives"]),
                int(p["batches"]),
                *spread,
                *calls,
                turn,
            ]
        )
    floors = [r["profile"]["all_to_all_s"] for r in shown if "all_to_all_s" in r["profile"]]
    floor = (
        f" One small all-to-all between these two processes takes {min(floors) * 1e3:.2f} to "
        f"{max(floors) * 1e3:.2f} ms when both ranks enter it together (median of "
        f"{FLOOR_CALLS} after a barrier, from the last rank's entry to the last rank's exit, "
        "per row); a steady step (every timed one) makes two when nothing fails: the "
        "micro-group's gather, which carries every rank's header (the cross-rank check), and "
        "its scatter, which carries every rank's success flag (the vote); the first two steps "
        "after a plan make one more, the header check on its own." + _issue_sentence(shown)
        if floors
        else ""
    )
    headers = [
        "N",
        "step (ms)",
        "before the matrix phase (ms)",
        "gather/scatter waits (ms)",
        "owner math (ms)",
        "apply (ms)",
        "rest of the matrix phase (ms)",
        "all-to-alls",
        "batches",
        "ranks' start spread (ms)",
        "from the last rank's start (ms)",
        "between the all-to-all calls (ms)",
        "inside them (ms)",
        "replayed: inside them (ms)",
        "replay / step",
    ]
    return [
        "### Where a `canzona` step goes (world 2, 8x8, rank 0)",
        "",
        "Rank 0's medians over the timed steps (`optimizer.last_step_stats` and the step's own "
        "time). *Before the matrix phase*: the step's table and payloads and the AdamW route "
        "(the header check, that every rank's inputs and plan digest agree, rides the first "
        "gather in these steady steps); *gather/scatter waits*: blocked on the micro-groups' "
        "all-to-alls; *owner "
        "math*: Newton–Schulz and momentum on the owners' batches; *apply*: writing the "
        "directions into the local shards after the vote; *rest of the matrix phase*: "
        "casting and packing the payloads, issuing the all-to-alls and reading the vote "
        "(the status elements of the last scatter). *All-to-alls*: those of the matrix "
        "phase, the header check included. *Ranks' start spread*: how far apart the "
        "ranks entered `step()` after the barrier before it (the first rank in waits for "
        "the last at the first gather, and the step time, the slowest rank's, includes "
        "it); *from the last rank's start*: from the last rank's entry to the last rank's "
        "return. The intercept of the fit (the fixed cost) is what remains at N = 0 of "
        "these columns. *Between the all-to-all calls*: rank 0's host time in a step outside "
        "the calls that issue and wait for its all-to-alls (its Python, its kernels, its "
        "owner math), summed over the gaps' medians; *inside them*: in those calls. "
        "*Replayed*: every rank replays its median step without canzona (`benchmarks/"
        "_replay.py`): it busy-waits through each of its gaps and makes the same calls on "
        "buffers of the same sizes; *inside them* is rank 0's time in the replay's calls, "
        "*replay / step* the slowest rank's replayed step over the real one, the two taken "
        f"in turn ({REPLAY_TURNS} times each, medians). The replay holds no canzona code, so "
        "what its calls take is what these collectives cost when the ranks enter them at "
        "the step's moments on this machine." + floor,
        "",
        markdown_table(headers, body),
        "",
    ]


def render(payload: dict[str, Any], plot: str | None) -> str:
    """The Markdown section of docs/benchmarks.md."""
    rows = payload["rows"]
    impls = [i for i in IMPLS if any(i in r["times"] for r in rows)]
    launches = int(payload["preset"].get("launches", 1))
    spread = max(
        (
            max(v) / min(v) - 1
            for r in rows
            for v in r.get("launches", {}).values()
            if len(v) > 1 and all(isinstance(x, float) for x in v)
        ),
        default=0.0,
    )
    lines = [
        "## Runtime overhead: step time against the number of matrices",
        "",
        f"`{payload['command']}` ({payload['mode']} mode, {payload['date']}, commit "
        f"`{payload['commit']}`, {payload.get('cpu', 'unknown CPU')}, "
        f"{payload['machine']['cpu_count']} cores, torch {payload['machine']['torch']}): "
        "N small fp32 matrices, Muon with one fp32 Newton–Schulz "
        "iteration (almost no math), `Shard(0)` on a `(world,)` mesh of forked gloo ranks, one "
        "thread per rank; median step time of the slowest rank over "
        f"{payload['preset']['steps']} timed steps after {payload.get('warmup', 2)} warm-up "
        "steps for `canzona.Muon` (its plan's re-pricing among them) and 2 for the others "
        "(the `redistribute` "
        f"Muon, one collective per matrix: {SLOW_STEPS['redistribute']} steps)"
        + (
            f"; each case ran in {launches} launches (one-process baselines {launches} times) "
            "and the table shows the median over them (the `redistribute` Muon: one launch); "
            f"the launches of a case differ by up to {spread:.0%} here"
            if launches > 1
            else ""
        )
        + ". One-process baselines run on the full matrices. Load average during the run: "
        f"{payload['load_average']:.1f} on {payload['machine']['cpu_count']} cores (this "
        "machine may be shared: numbers from a loaded machine are slower and noisier).",
        "",
    ]
    for shape in sorted({r["shape"] for r in rows}):
        headers = ["N", "world", *[LABELS[i] for i in impls]]
        body = []
        for r in sorted(
            (r for r in rows if r["shape"] == shape), key=lambda r: (r["n"], r["world"])
        ):
            cells = [r["n"], r["world"]]
            for impl in impls:
                v = r["times"].get(impl)
                cells.append(
                    f"{v * 1e3:.2f} ms" if isinstance(v, float) else ("–" if v is None else "fails")
                )
            body.append(cells)
        lines += [f"### {shape} matrices", "", markdown_table(headers, body), ""]
    failures = sorted(
        {(impl, v) for r in rows for impl, v in r["times"].items() if isinstance(v, str)}
    )
    if failures:
        lines += ["Runs that fail, with the exact error:", ""]
        lines += [f"- {LABELS[impl]}: `{why}`" for impl, why in failures]
        lines.append("")
    same = _same_rows(rows)
    if same:
        lines += [same, ""]
    fit_rows = [
        [f["shape"], f["world"], LABELS[f["impl"]], f"{f['fixed_ms']:.2f}", f"{f['slope_us']:.1f}"]
        for f in payload["fits"]
    ]
    lines += [
        "### Fit: time = fixed + slope × N",
        "",
        markdown_table(
            ["shape", "world", "implementation", "fixed (ms)", "slope (µs / matrix)"], fit_rows
        ),
        "",
    ]
    lines += _render_profile(rows)
    tgt = [
        [t["target"], f"≤ {t['limit']:g}", f"{t['value']:.3g}", "met" if t["met"] else "**missed**"]
        for t in payload["targets"]
    ]
    lines += [
        "### Targets (world 2, 8x8)",
        "",
        markdown_table(["target", "limit", "measured", ""], tgt),
        "",
    ]
    reference = _machine_reference(payload)
    if reference:
        lines += [reference, ""]
    spread = _launch_fits(rows)
    if spread:
        lines += [spread, ""]
    adamw = _adamw_launches(rows)
    if adamw:
        lines += [adamw, ""]
    paused = _gc_sentence(rows)
    if paused:
        lines += [paused, ""]
    if plot:
        lines += [f"![step time against N]({plot})", ""]
    return "\n".join(lines)


def draw(result: dict[str, Any], path: Path) -> bool:
    """Step time against N, one panel per (shape, world); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    panels = sorted({(r["shape"], r["world"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (shape, world) in zip(axes[0], panels, strict=True):
        for impl in IMPLS:
            pts = sorted(
                (r["n"], r["times"][impl] * 1e3)
                for r in rows
                if (r["shape"], r["world"]) == (shape, world)
                and isinstance(r["times"].get(impl), float)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=LABELS[impl].replace("`", ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{shape}, world {world}")
        ax.set_xlabel("matrices N")
        ax.set_ylabel("step time (ms)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _issue_sentence(shown: Sequence[dict[str, Any]]) -> str:
    """The host time of issuing one small all-to-all, through c10d's wrapper and directly."""
    pairs = [
        (r["profile"]["issue_wrapper_s"], r["profile"]["issue_direct_s"])
        for r in shown
        if "issue_direct_s" in r["profile"]
    ]
    if not pairs:
        return ""
    wrapper = [w * 1e6 for w, _ in pairs]
    direct = [d * 1e6 for _, d in pairs]
    return (
        f" Issuing one takes rank 0 {min(wrapper):.0f} to {max(wrapper):.0f} µs through "
        f"`dist.all_to_all_single` and {min(direct):.0f} to {max(direct):.0f} µs through the "
        "call on the process group that the runtime makes (`canzona.runtime.alltoall`, "
        "without the wrapper's checks), medians per row, taken in turn."
    )


def _machine_reference(payload: dict[str, Any]) -> str:
    """The target case's fit against this run's own yardsticks: what the machine costs.

    The absolute limits are in µs and ms of the machine they were set on; a fit in the same
    run of one process's ``AdamW(foreach=True)`` (a step with one dispatch per op and list,
    no collective) and the latency of one small all-to-all say how fast this machine is.
    """
    fits = {(f["shape"], f["world"], f["impl"]): f for f in payload["fits"]}
    ours = fits.get(("8x8", 2, "canzona"))
    adamw = fits.get(("8x8", 1, "adamw_foreach"))
    floors = [
        r["profile"]["all_to_all_s"]
        for r in payload["rows"]
        if (r["shape"], r["world"]) == ("8x8", 2) and "all_to_all_s" in r.get("profile", {})
    ]
    if ours is None or adamw is None or not floors:
        return ""
    floor = statistics.median(floors) * 1e3
    return (
        "The same run's yardsticks: one process's `AdamW(foreach=True)` costs "
        f"{adamw['slope_us']:.1f} µs per 8x8 matrix (fit at world 1), so `canzona`'s slope at "
        f"world 2 is {ours['slope_us'] / adamw['slope_us']:.2f}× that; one small all-to-all "
        f"takes {floor:.2f} ms (median over the rows), so the fixed cost is "
        f"{ours['fixed_ms'] / floor:.1f} of them (a steady step makes two)."
        + _replay_sentence(payload["rows"], ours["fixed_ms"], _fixed_limit(payload))
    )


def _fixed_limit(payload: dict[str, Any]) -> float:
    """The fixed-cost target's limit in ms (the target whose name starts with "fixed")."""
    return next(float(t["limit"]) for t in payload["targets"] if t["target"].startswith("fixed"))


def _replay_sentence(rows: Sequence[dict[str, Any]], fixed_ms: float, limit_ms: float) -> str:
    """The smallest target-case step split into host work and collectives, from its replay."""
    case = sorted(
        (
            r
            for r in rows
            if (r["shape"], r["world"]) == ("8x8", 2) and "replay_calls_s" in r.get("profile", {})
        ),
        key=lambda r: r["n"],
    )
    if not case:
        return ""
    p = case[0]["profile"]
    calls, replayed = p["step_calls_s"] * 1e3, p["replay_calls_s"] * 1e3
    gaps, count = p["host_gaps_s"] * 1e3, int(p["collectives"])
    return (
        f" Where the fixed cost goes, at N = {case[0]['n']} (see the table): rank 0 spends "
        f"{gaps:.2f} ms of host work between its all-to-all calls and {calls:.2f} ms inside "
        f"them; replayed without canzona, at the same moments, the same {count} calls take "
        f"{replayed:.2f} ms, {replayed / (count * p['all_to_all_s'] * 1e3):.1f}× what "
        f"{count} all-to-alls entered right after a barrier take: what these collectives "
        "cost at these moments with no canzona code around them. "
        + (
            f"They alone take more than a fixed cost of {limit_ms:g} ms allows (now "
            f"{fixed_ms:.2f})."
            if replayed >= limit_ms
            else f"A fixed cost of {limit_ms:g} ms (now {fixed_ms:.2f}) therefore leaves at most "
            f"{limit_ms - replayed:.2f} ms for a step's host work at N = 0, against {gaps:.2f} "
            f"ms between the calls at N = {case[0]['n']}."
        )
    )
