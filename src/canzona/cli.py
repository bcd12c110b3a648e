"""The ``canzona`` command line: ``canzona plan``, ``canzona calibrate`` and ``canzona demo``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from canzona.plan import CostModel, MatrixSpec, cost_model
from canzona.plan.cost import NORMUON_ELEMENTWISE, MuonCost
from canzona.plan.measured import MeasuredCost, load_cost_file, owner_stack
from canzona.plan.models import MODELS, SPLITS, model_specs
from canzona.plan.report import (
    UNITS,
    StrategyRun,
    compare_strategies,
    format_bytes,
    load_histogram,
    metrics,
    rank_metrics,
    strategy_table,
)

__all__ = ["load_specs", "main", "plot_loads"]

OPTIMIZERS = ("muon", "normuon", "shampoo", "soap", "adamw")

#: File types ``--plot`` writes (matplotlib's Agg canvas), by extension.
PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class CliError(Exception):
    """A user error reported as one line on stderr."""


_MATRIX_KEYS = {"name", "shape", "itemsize", "ranks"}


def load_specs(path: Path) -> list[MatrixSpec]:
    """Read matrices from a JSON file.

    The file holds a list of ``{"name": ..., "shape": [...]}`` objects (optionally
    ``"itemsize"`` and ``"ranks"``), or an object with such a list under ``"matrices"``.

    Raises:
        CliError: If the file cannot be read or does not describe valid matrices.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CliError(f"cannot read model file {str(path)!r}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("matrices")
    if not isinstance(data, list) or not data:
        raise CliError(f"model file {str(path)!r} must hold a non-empty list of matrices")
    specs = []
    for entry in data:
        if not isinstance(entry, dict) or "name" not in entry or "shape" not in entry:
            raise CliError(f"each matrix needs 'name' and 'shape', got {entry!r}")
        unknown = sorted(set(entry) - _MATRIX_KEYS)
        if unknown:  # a typo (item_size) would otherwise plan with the default silently
            raise CliError(
                f"matrix {entry['name']!r} has unknown keys {unknown}; a matrix takes "
                f"{sorted(_MATRIX_KEYS)}"
            )
        ranks = entry.get("ranks")
        try:
            spec = MatrixSpec(
                entry["name"],
                tuple(entry["shape"]) if isinstance(entry["shape"], list) else entry["shape"],
                entry.get("itemsize", 4),
                tuple(ranks) if isinstance(ranks, list) else ranks,
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
        specs += _matrices_of(spec)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})[:3]
        raise CliError(
            f"model file {str(path)!r} has duplicate matrix names {twice} (a stack's matrices "
            "are named name[0], name[1], ...)"
        )
    return specs


def _matrices_of(spec: MatrixSpec) -> list[MatrixSpec]:
    """A stack's matrices ``name[0]``, ``name[1]``, ...; a 2-D matrix as it is.

    Each matrix of a stack has its own owner, as the optimizers plan a 3-D parameter.
    """
    if len(spec.shape) == 2:
        return [spec]
    return [
        MatrixSpec(f"{spec.name}[{k}]", (spec.m, spec.n), spec.itemsize, spec.ranks)
        for k in range(spec.batch)
    ]


def _resolve_model(
    value: str, split: str | None, world: int | None
) -> tuple[str, list[MatrixSpec]]:
    if value in MODELS:
        return value, model_specs(value, split=split or "qkv", world=world)
    path = Path(value)
    if path.suffix == ".json" or path.exists():
        if split is not None:  # a model file lists its matrices as they are split
            raise CliError(f"--split applies to the built-in models, not to {value!r}")
        return path.stem, load_specs(path)
    raise CliError(f"unknown model {value!r}; choose one of {', '.join(MODELS)} or a JSON file")


def plot_loads(runs: Mapping[str, StrategyRun], path: Path, *, title: str) -> None:
    """Draw each strategy's per-rank loads (relative to the lower bound) into a PNG.

    Raises:
        ImportError: If matplotlib (the ``plot`` extra) is missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 1.9 * len(runs)), sharex=True)
    axes = list(axes) if len(runs) > 1 else [axes]
    for ax, (name, run) in zip(axes, runs.items(), strict=True):
        a = run.plan.assignment
        bound = a.lower_bound or 1.0
        ax.stairs([x / bound for x in a.loads], range(a.num_ranks + 1), fill=True, color="#4477aa")
        ax.axhline(1.0, color="#cc3311", linestyle="--", linewidth=1, label="lower bound")
        ax.set_ylabel("load / LB")
        ax.set_title(
            f"{name}: makespan/LB {a.makespan_ratio:.3f}, balance {a.balance_ratio:.3f}",
            fontsize=9,
            loc="left",
        )
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("rank")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_plot_path(path: Path) -> None:
    """Refuse a ``--plot`` file matplotlib cannot write, before any planning.

    Raises:
        CliError: For a missing or unknown extension, or when matplotlib is not installed.
    """
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in PLOT_FORMATS:
        raise CliError(
            f"--plot needs a file ending in one of .{', .'.join(PLOT_FORMATS)}, got {str(path)!r}"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib: pip install 'canzona[plot]'")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="canzona", description="Exact, load-balanced matrix optimizers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan",
        help="compare owner-assignment strategies on a model",
        description="Plan owners and micro-groups for a model and compare all strategies.",
    )
    plan.add_argument(
        "--model", required=True, help=f"one of {', '.join(MODELS)}, or a JSON file of matrices"
    )
    plan.add_argument("--world", type=int, required=True, help="number of ranks")
    plan.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="the cost model (default: muon, or the optimizer a --cost table was timed for)",
    )
    plan.add_argument("--alpha", type=float, default=1.0, help="compute weight in [0, 1]")
    plan.add_argument("--capacity-mb", type=float, default=512.0, help="micro-group capacity")
    plan.add_argument(
        "--split",
        choices=SPLITS,
        help="built-in models only: fused qkv/gate_up as one matrix (none), q/k/v and "
        "gate/up apart (qkv, the default), or one matrix per attention head (heads)",
    )
    plan.add_argument(
        "--cost",
        type=Path,
        metavar="FILE.json",
        help="price matrices with a table of measured seconds (written by canzona calibrate)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", type=Path, metavar="FILE.png", help="plot per-rank loads")
    cal = sub.add_parser(
        "calibrate",
        help="time the owner math of a model's matrices on this machine",
        description="Time each distinct matrix shape of a model under an optimizer on this "
        "machine and write a cost table for canzona plan --cost.",
    )
    cal.add_argument("--model", required=True, help=f"one of {', '.join(MODELS)}, or a JSON file")
    cal.add_argument("--optimizer", choices=OPTIMIZERS[:-1], default="muon")
    cal.add_argument("--split", choices=SPLITS, help="as for canzona plan")
    cal.add_argument("--out", type=Path, required=True, metavar="FILE.json")
    cal.add_argument("--device", default="cpu", help="torch device (cpu, cuda, ...)")
    cal.add_argument(
        "--ns-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="Muon's Newton-Schulz dtype",
    )
    cal.add_argument(
        "--budget", type=float, default=60.0, help="seconds of timing; the rest is predicted"
    )
    cal.add_argument(
        "--world",
        type=int,
        help="ranks the plan is for: each shape timed on the stack an owner forms (its count / "
        "world matrices, at most 8), as the runtime calibrates; default: one matrix per call",
    )
    cal.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="reuse and extend the timings kept in DIR (the runtime's calibration cache format)",
    )
    sub.add_parser(
        "demo", add_help=False, help="run the demo (arguments go to the demo's own parser)"
    )
    return parser


#: The most ranks a plan is made for (planning cost and memory grow with the world).
MAX_WORLD = 1 << 20


def _check_world(world: int | None) -> None:
    if world is not None and not 1 <= world <= MAX_WORLD:
        raise CliError(f"--world must be in [1, {MAX_WORLD}], got {world}")


def _warn(command: str, message: str) -> None:
    print(f"canzona {command}: warning: {message}", file=sys.stderr)


def _plan(args: argparse.Namespace) -> int:
    _check_world(args.world)
    if not 0 <= args.alpha <= 1:
        raise CliError(f"--alpha must be in [0, 1], got {args.alpha}")
    if not 0 < args.capacity_mb < float("inf"):
        raise CliError(f"--capacity-mb must be positive, got {args.capacity_mb}")
    if args.plot is not None:
        check_plot_path(args.plot)
    model, specs = _resolve_model(args.model, args.split, args.world)
    name = args.optimizer or "muon"
    optimizer: str | CostModel = _closed_form(name)
    if args.cost is not None:
        try:
            table, meta = load_cost_file(args.cost)
        except ValueError as exc:
            raise CliError(str(exc)) from None
        _check_table(args.cost, table, meta, specs, args.world)
        optimizer = table.for_world(args.world)  # its transfer share: this world's
        timed = _timed_name(optimizer.base)
        if args.optimizer is not None and args.optimizer != timed:
            raise CliError(
                f"--optimizer {args.optimizer} contradicts the cost table {str(args.cost)!r}, "
                f"which times {timed}'s math (leave --optimizer out, or calibrate {args.optimizer})"
            )
        name = timed
    if args.world > len(specs):
        _warn(
            "plan",
            f"{args.world} ranks for {len(specs)} matrices: at most "
            f"{len(specs)} ranks own a matrix, the other {args.world - len(specs)} own nothing "
            "(and only take part in the collectives)",
        )
    experts = MODELS[args.model].experts if args.model in MODELS else 0  # not a file
    if experts and (args.world > experts or experts % args.world):
        _warn(
            "plan",
            f"{model}'s experts are pinned to the ranks that hold them only when --world "
            f"divides its {experts} experts per layer: over {args.world} ranks they travel to "
            "their owners like the other matrices",
        )
    try:
        runs = compare_strategies(
            specs,
            args.world,
            optimizer=optimizer,
            alpha=args.alpha,
            capacity_mb=args.capacity_mb,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    canzona = runs["canzona"].plan
    if args.plot is not None:
        try:
            plot_loads(runs, args.plot, title=f"{model}, world {args.world}, {name}")
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'canzona[plot]'") from None
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot write the plot to {str(args.plot)!r}: {exc}") from None
    if args.json:
        out: dict[str, Any] = {
            "model": model,
            "world": args.world,
            "optimizer": name,
            "cost": "measured" if args.cost is not None else "flops",
            "alpha": args.alpha,
            "capacity_mb": args.capacity_mb,
            "matrices": len(specs),
            "units": {"capacity_mb": "MiB", **_units(measured=args.cost is not None)},
            "strategies": {
                name: {**metrics(run), **rank_metrics(run)} for name, run in runs.items()
            },
            "digest": canzona.digest(),
            "owners": dict(canzona.assignment.owner),
        }
        print(json.dumps(out, indent=2))
        return 0
    total = sum(s.nbytes for s in specs)
    print(
        f"{model}: {len(specs)} matrices ({format_bytes(total)}), world {args.world}, "
        f"optimizer {name}"
        + (f" (measured costs: {args.cost})" if args.cost is not None else "")
        + f", alpha {args.alpha:g}, capacity {args.capacity_mb:g} MiB"
    )
    print()
    print(strategy_table(runs))
    print()
    print(f"canzona per-rank load / mean load ({args.world} ranks):")
    print(load_histogram(canzona.assignment.loads))
    print()
    print(f"canzona plan digest: {canzona.digest()}")
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _check_table(
    path: Path, table: MeasuredCost, meta: Mapping[str, Any], specs: list[MatrixSpec], world: int
) -> None:
    """Warn when a cost table was timed for another plan than this one."""
    counts: dict[tuple[int, int], int] = {}
    for s in specs:  # matrices, not specs: a 3-D stack is ``batch`` of them
        counts[s.m, s.n] = counts.get((s.m, s.n), 0) + s.batch
    expected = {shape: owner_stack(count, world) for shape, count in counts.items()}
    stacks = meta.get("stacks")
    other = [
        (m, n, k, expected[m, n])
        for m, n, k in (e for e in (stacks if isinstance(stacks, list) else []) if _stack_row(e))
        if expected.get((m, n), k) != k
    ]
    if other:
        m, n, k, here = other[0]
        _warn(
            "plan",
            f"the cost table {str(path)!r} timed {len(other)} of the model's shapes on other "
            f"stacks than an owner forms at world {world} ({m}x{n} on {k} matrices per call, "
            f"{here} here; canzona calibrate --world {world} times this plan's stacks)",
        )
    timed = {(int(shape[0]), int(shape[1])) for shape, _ in table.table}
    if not timed & set(counts):
        _warn(
            "plan",
            f"the cost table {str(path)!r} timed none of the model's {len(counts)} distinct "
            "shapes: every price is predicted from its fit",
        )


def _stack_row(entry: object) -> bool:
    """Whether a table's ``meta.stacks`` entry reads as ``[m, n, matrices per call]``."""
    return isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) for v in entry)


def _closed_form(name: str) -> str | CostModel:
    """The cost model ``--optimizer name`` plans with: NorMuon's is Muon's plus its rescale."""
    if name == "normuon":
        return cost_model("muon", extra_elementwise=NORMUON_ELEMENTWISE)
    return name


def _timed_name(base: CostModel) -> str:
    """The optimizer a cost table timed, from its closed-form base model."""
    if isinstance(base, MuonCost) and base.extra_elementwise == NORMUON_ELEMENTWISE:
        return "normuon"
    return base.name


def _units(*, measured: bool) -> dict[str, str]:
    """The JSON fields' units: a measured table prices work in seconds, not FLOPs."""
    if not measured:
        return dict(UNITS)
    return {k: v.replace("FLOPs", "seconds (measured)") for k, v in UNITS.items()}


def _calibrate(args: argparse.Namespace) -> int:
    if not args.budget > 0:
        raise CliError(f"--budget must be positive, got {args.budget}")
    _check_world(args.world)
    existing = next((p for p in args.out.parents if p.exists()), Path("."))  # its folder
    if args.out.is_dir() or not existing.is_dir():
        raise CliError(f"cannot write the cost table to {str(args.out)!r}: not a file path")
    if not os.access(existing, os.W_OK):
        raise CliError(
            f"cannot write the cost table to {str(args.out)!r}: {str(existing)!r} is not writable"
        )
    _, specs = _resolve_model(args.model, args.split, None)
    from canzona.optim.calibration import calibrate_model  # torch: only for this command

    try:
        summary = calibrate_model(
            specs,
            optimizer=args.optimizer,
            out=args.out,
            device=args.device,
            ns_dtype=args.ns_dtype,
            budget_s=args.budget,
            cache=args.cache,
            world=args.world,
        )
    except (ValueError, RuntimeError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot write the cost table to {str(args.out)!r}: {exc}") from None
    print(
        f"{args.model}: {summary['shapes']} distinct shapes, {summary['timed']} with timings "
        f"({summary['timed'] - summary['cached']} timed now, {summary['cached']} from the "
        f"cache) in {summary['seconds']:.1f} s on "
        f"{summary['device']}; table written to {args.out}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``canzona`` command.

    Args:
        argv: Arguments without the program name (defaults to ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = _parser()
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "demo":
        from canzona import demo

        return int(demo.main(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        return _plan(args)
    except CliError as exc:
        print(f"canzona {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (e.g. ``head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
