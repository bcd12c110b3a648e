"""Batched vs per-matrix Newton–Schulz on CPU, on Qwen3 matrix shapes scaled down to fit.

For every distinct matrix shape of the chosen models (divided by ``--scale``), a stack of
``--batch`` random matrices goes through :func:`canzona.updates.newton_schulz` twice: once with
the batched kernels (``batched=True``, one ``baddbmm`` per product for the whole stack) and once
as a Python loop of 2-D calls (what a per-matrix runtime does). Reported per shape and dtype:
matrices per second, achieved GFLOP/s (``steps * (4 a^2 b + 2 a^3)`` per matrix, ``a <= b`` the
sides), the batched/loop throughput ratio, whether the two outputs are bitwise equal, and the
path that the library's default (``batched=None``) picks. One intra-op thread.

    python benchmarks/kernels.py            # quick (< 60 s)
    python benchmarks/kernels.py --full     # larger shapes and stacks (a few minutes)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import canzona  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from canzona.plan import MatrixSpec, MuonCost
from canzona.plan.measured import MeasuredCost, class_fits, fit_loglog
from canzona.plan.models import MODELS, ModelShape
from canzona.updates import (
    DEFAULT_NS_STEPS,
    batch_kernels_exact,
    newton_schulz,
    newton_schulz_flops,
)

from _report import (
    DOC,
    RESULTS,
    machine_info,
    markdown_table,
    update_section,
    write_json,
)

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "models": ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"],
        "scale": 16,
        "batch": 8,
        "repeats": 3,
    },
    "full": {
        "models": ["qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b"],
        "scale": 8,
        "batch": 16,
        "repeats": 5,
    },
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def model_matrices(cfg: ModelShape) -> list[tuple[str, tuple[int, int]]]:
    """Distinct ``(name, (rows, cols))`` weight matrices of one decoder layer (``nn.Linear``)."""
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    mats = [
        ("q_proj", (q, cfg.hidden)),
        ("k/v_proj", (kv, cfg.hidden)),
        ("o_proj", (cfg.hidden, q)),
    ]
    if cfg.experts:
        mats += [
            ("router", (cfg.experts, cfg.hidden)),
            ("expert gate/up", (cfg.expert_ffn, cfg.hidden)),
            ("expert down", (cfg.hidden, cfg.expert_ffn)),
        ]
    else:
        mats += [("gate/up_proj", (cfg.ffn, cfg.hidden)), ("down_proj", (cfg.hidden, cfg.ffn))]
    seen: set[tuple[int, int]] = set()
    out = []
    for name, shape in mats:
        if shape not in seen:
            seen.add(shape)
            out.append((name, shape))
    return out


def _time(fn: Any, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (and, for the default path, the one-off probe)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench_shape(
    rows: int, cols: int, dtype: torch.dtype, batch: int, repeats: int, seed: int = 0
) -> dict[str, Any]:
    """Time the batched kernels and the per-matrix loop on one stack."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, rows, cols), generator=gen)
    t_batched, y_batched = _time(lambda: newton_schulz(x, dtype=dtype, batched=True), repeats)
    t_loop, y_loop = _time(
        lambda: torch.stack([newton_schulz(m, dtype=dtype) for m in x.unbind(0)]), repeats
    )
    flops = batch * newton_schulz_flops(rows, cols, DEFAULT_NS_STEPS)
    return {
        "batched_s": t_batched,
        "loop_s": t_loop,
        "batched_matrices_per_s": batch / t_batched,
        "loop_matrices_per_s": batch / t_loop,
        "batched_gflops": flops / t_batched / 1e9,
        "loop_gflops": flops / t_loop / 1e9,
        "batched_over_loop": t_loop / t_batched,
        "bitwise_equal": torch.equal(y_batched, y_loop),
        "default_uses_batched": batch_kernels_exact(batch, rows, cols, dtype=dtype),
    }


def run(
    models: Sequence[str], scale: int, batch: int, repeats: int, dtypes: Sequence[str]
) -> list[dict[str, Any]]:
    """Benchmark every distinct scaled shape of ``models`` in every dtype."""
    results = []
    for model in models:
        for name, (m, n) in model_matrices(MODELS[model]):
            rows, cols = max(1, math.ceil(m / scale)), max(1, math.ceil(n / scale))
            for dtype_name in dtypes:
                row = {
                    "model": model,
                    "matrix": name,
                    "source_shape": [m, n],
                    "shape": [rows, cols],
                    "dtype": dtype_name,
                    "batch": batch,
                }
                row.update(bench_shape(rows, cols, DTYPES[dtype_name], batch, repeats))
                results.append(row)
                print(
                    f"{model:>14} {name:>15} {m}x{n} -> {rows}x{cols} {dtype_name}: "
                    f"batched {row['batched_gflops']:.1f} GFLOP/s, loop {row['loop_gflops']:.1f}, "
                    f"x{row['batched_over_loop']:.2f}, bitwise {row['bitwise_equal']}",
                    flush=True,
                )
    return results


def cpu_description() -> str:
    """CPU model and the vector extensions that decide bf16 matmul speed (Linux only)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    model, flags = "unknown CPU", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(extras) or 'no AVX-512'})"


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def fit_check(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per dtype, the median error of predicting each shape's time from the other shapes.

    Leave one out: each shape's per-matrix loop time is priced by a ``MeasuredCost`` that
    timed every other shape of the dtype, once with one fit over all of them (``"one fit"``)
    and once with the runtime's fits per shape class as well (``"by class"``).
    """
    base = MuonCost()
    out: dict[str, dict[str, float]] = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        points = [
            ((m, n), base.flops(MatrixSpec("s", (m, n))), r["loop_s"] / r["batch"])
            for r in rows
            if r["dtype"] == dtype
            for m, n in [tuple(r["shape"])]
        ]
        errors: dict[str, list[float]] = {"one fit": [], "by class": []}
        for i, (shape, _, seconds) in enumerate(points):
            others = points[:i] + points[i + 1 :]
            fit = fit_loglog([(w, t) for _, w, t in others])
            for label, classes in (("one fit", ()), ("by class", class_fits(others))):
                model = MeasuredCost(base=base, table=(), fit=fit, class_fits=classes)
                errors[label].append(abs(model.seconds(*shape) / seconds - 1))
        if len(points) > 2:
            out[dtype] = {k: statistics.median(v) for k, v in errors.items()}
    return out


def render(payload: dict[str, Any]) -> str:
    """The Markdown section for docs/benchmarks.md."""
    rows = payload["results"]
    table = markdown_table(
        [
            "model",
            "matrix",
            "source → bench",
            "dtype",
            "stack",
            "batched mat/s",
            "loop mat/s",
            "batched GFLOP/s",
            "loop GFLOP/s",
            "batched / loop",
            "bitwise",
            "default path",
        ],
        [
            [
                r["model"],
                r["matrix"],
                f"{r['source_shape'][0]}×{r['source_shape'][1]} → {r['shape'][0]}×{r['shape'][1]}",
                r["dtype"],
                r["batch"],
                r["batched_matrices_per_s"],
                r["loop_matrices_per_s"],
                r["batched_gflops"],
                r["loop_gflops"],
                r["batched_over_loop"],
                "yes" if r["bitwise_equal"] else "no",
                "batched" if r["default_uses_batched"] else "loop",
            ]
            for r in rows
        ],
    )
    summary = ", ".join(
        f"{d} {_geomean([r['batched_over_loop'] for r in rows if r['dtype'] == d]):.2f}×"
        for d in payload["dtypes"]
    )
    unequal = sum(not r["bitwise_equal"] for r in rows)
    machine = payload["machine"]
    return "\n\n".join(
        [
            "## Newton–Schulz kernels: batched stack vs per-matrix loop",
            f"`{payload['command']}` (commit `{payload.get('commit', 'unknown')}`) — "
            f"{payload['cpu']}, "
            f"torch {machine['torch']}, {payload['threads']} intra-op thread, "
            f"{payload['steps']} quintic steps. Shapes are the distinct per-layer matrices of "
            f"each model divided by {payload['scale']}; each row times a stack of "
            f"{payload['batch']} same-shape matrices (median of {payload['repeats']} runs). "
            "*Batched* runs one `baddbmm` per product for the whole stack; *loop* calls the 2-D "
            "function (bitwise equal to `torch.optim.Muon`'s) once per matrix. *Bitwise*: "
            "the two outputs are identical; *default path*: what `newton_schulz` picks on its "
            "own (batched kernels only where they were verified to be bitwise equal).",
            table,
            f"Geometric-mean batched/loop throughput ratio: {summary}. "
            f"Rows where batched and loop differ in any bit: {unequal} of {len(rows)}."
            + _fit_sentence(payload.get("fit_check", {})),
        ]
    )


def _fit_sentence(check: dict[str, dict[str, float]]) -> str:
    if not check:
        return ""
    parts = ", ".join(
        f"{d} {v['one fit']:.0%} with one fit over every shape, {v['by class']:.0%} by class"
        for d, v in check.items()
    )
    return (
        " Predicting each shape's loop time from the others (leave one out, as the "
        "calibration prices a shape it did not time), median error: "
        f"{parts} (`fit_check` in kernels.json)."
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; write JSON and the Markdown section; return the payload."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small preset, under a minute (default)")
    mode.add_argument("--full", action="store_true", help="larger shapes and stacks")
    parser.add_argument("--models", help="comma-separated model names (overrides the preset)")
    parser.add_argument("--scale", type=int, help="divide every dimension by this")
    parser.add_argument("--batch", type=int, help="matrices per stack")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16, fp32")
    parser.add_argument(
        "--out-dir", type=Path, help="directory of kernels.json (quick: benchmarks/results/quick)"
    )
    parser.add_argument("--doc", type=Path, help="Markdown file (full: docs/benchmarks.md)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)

    preset_name = "full" if args.full else "quick"
    full = preset_name == "full"  # only full mode writes the published files
    args.out_dir = args.out_dir or (RESULTS if full else RESULTS / "quick")
    args.doc = args.doc or (DOC if full else RESULTS / "quick" / "benchmarks_quick.md")
    preset = dict(PRESETS[preset_name])
    for key in ("scale", "batch", "repeats"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    if args.models:
        preset["models"] = args.models.split(",")
    unknown = [m for m in preset["models"] if m not in MODELS]
    dtypes = args.dtypes.split(",")
    if unknown or any(d not in DTYPES for d in dtypes):
        parser.error(f"unknown model or dtype: {unknown or dtypes}")

    torch.set_num_threads(1)
    started = time.perf_counter()
    results = run(preset["models"], preset["scale"], preset["batch"], preset["repeats"], dtypes)
    payload: dict[str, Any] = {
        "mode": preset_name,
        "command": " ".join(["python benchmarks/kernels.py", *(argv or [f"--{preset_name}"])]),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "steps": DEFAULT_NS_STEPS,
        "dtypes": dtypes,
        **preset,
        "seconds": time.perf_counter() - started,
        "results": results,
        "fit_check": fit_check(results),
    }
    path = write_json("kernels", payload, out_dir=args.out_dir)
    update_section("kernels", render({"machine": machine_info(), **payload}), doc=args.doc)
    print(f"wrote {path} and the 'kernels' section of {args.doc}")
    return payload


if __name__ == "__main__":
    main()
