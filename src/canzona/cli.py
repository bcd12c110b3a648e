"""The ``canzona`` command line: ``canzona plan`` (planner report) and ``canzona demo``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from canzona.plan import MatrixSpec
from canzona.plan.models import MODELS, model_specs
from canzona.plan.report import (
    StrategyRun,
    compare_strategies,
    format_bytes,
    load_histogram,
    metrics,
    strategy_table,
)

__all__ = ["load_specs", "main", "plot_loads"]

OPTIMIZERS = ("muon", "shampoo", "soap", "adamw")


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are a single line on stderr."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class CliError(Exception):
    """A user error reported as one line on stderr."""


def load_specs(path: Path) -> list[MatrixSpec]:
    """Read matrices from a JSON file.

    The file holds a list of ``{"name": ..., "shape": [...]}`` objects (optionally
    ``"itemsize"`` and ``"ranks"``), or an object with such a list under ``"matrices"``.

    Raises:
        CliError: If the file cannot be read or does not describe valid matrices.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"cannot read model file {str(path)!r}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("matrices")
    if not isinstance(data, list) or not data:
        raise CliError(f"model file {str(path)!r} must hold a non-empty list of matrices")
    specs = []
    for entry in data:
        if not isinstance(entry, dict) or "name" not in entry or "shape" not in entry:
            raise CliError(f"each matrix needs 'name' and 'shape', got {entry!r}")
        ranks = entry.get("ranks")
        try:
            specs.append(
                MatrixSpec(
                    entry["name"],
                    tuple(entry["shape"]) if isinstance(entry["shape"], list) else entry["shape"],
                    entry.get("itemsize", 4),
                    tuple(ranks) if isinstance(ranks, list) else ranks,
                )
            )
        except ValueError as exc:
            raise CliError(str(exc)) from None
    return specs


def _resolve_model(value: str, split_heads: bool) -> tuple[str, list[MatrixSpec]]:
    if value in MODELS:
        return value, model_specs(value, split_heads=split_heads)
    path = Path(value)
    if path.suffix == ".json" or path.exists():
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
    plan.add_argument("--optimizer", choices=OPTIMIZERS, default="muon")
    plan.add_argument("--alpha", type=float, default=1.0, help="compute weight in [0, 1]")
    plan.add_argument("--capacity-mb", type=float, default=512.0, help="micro-group capacity")
    plan.add_argument("--split-heads", action="store_true", help="one matrix per attention head")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--plot", type=Path, metavar="FILE.png", help="plot per-rank loads")
    sub.add_parser(
        "demo", add_help=False, help="run the demo (arguments go to the demo's own parser)"
    )
    return parser


def _plan(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise CliError(f"--world must be >= 1, got {args.world}")
    if not 0 <= args.alpha <= 1:
        raise CliError(f"--alpha must be in [0, 1], got {args.alpha}")
    if not 0 < args.capacity_mb < float("inf"):
        raise CliError(f"--capacity-mb must be positive, got {args.capacity_mb}")
    model, specs = _resolve_model(args.model, args.split_heads)
    try:
        runs = compare_strategies(
            specs,
            args.world,
            optimizer=args.optimizer,
            alpha=args.alpha,
            capacity_mb=args.capacity_mb,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    canzona = runs["canzona"].plan
    if args.plot is not None:
        try:
            plot_loads(runs, args.plot, title=f"{model}, world {args.world}, {args.optimizer}")
        except ImportError:
            raise CliError("--plot needs matplotlib: pip install 'canzona[plot]'") from None
    if args.json:
        out: dict[str, Any] = {
            "model": model,
            "world": args.world,
            "optimizer": args.optimizer,
            "alpha": args.alpha,
            "capacity_mb": args.capacity_mb,
            "matrices": len(specs),
            "strategies": {name: metrics(run) for name, run in runs.items()},
            "digest": canzona.digest(),
        }
        print(json.dumps(out, indent=2))
        return 0
    total = sum(s.nbytes for s in specs)
    print(
        f"{model}: {len(specs)} matrices ({format_bytes(total)}), world {args.world}, "
        f"optimizer {args.optimizer}, alpha {args.alpha:g}, capacity {args.capacity_mb:g} MiB"
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
        return _plan(args)
    except CliError as exc:
        print(f"canzona {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into a reader that stopped early (e.g. ``head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
