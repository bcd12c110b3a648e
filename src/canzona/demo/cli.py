"""The ``canzona demo`` command: flags, progress bar, summary and the optional loss plot."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:
    from canzona.demo.train import DemoSettings

__all__ = ["main"]

PROG = "canzona demo"
OPTIMIZERS = ("muon", "normuon", "shampoo", "soap")  # canzona.demo.train.OPTIMIZERS, no torch
# canzona.updates.NS_SCHEDULES, without importing torch
NS_COEFFICIENTS = ("quintic", "polar_express", "tuned_quintic", "qwen_express")
MESHES = {1: "one process", 2: "FSDP on a (2,) mesh", 4: "FSDP×TP on a (dp=2, tp=2) mesh"}


class _Parser(argparse.ArgumentParser):
    """Errors as one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 100000], got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if not 0 <= value < 2**31:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**31), got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=(
            "Train a tiny Qwen3-style decoder on a generated corpus with canzona's optimizer "
            "on CPU ranks (gloo), compare with AdamW at the same budget, and time the "
            "optimizer step of the canzona plan against the replicated one."
        ),
    )
    parser.add_argument("--steps", type=_positive, default=80, help="training steps per run")
    parser.add_argument(
        "--world",
        type=int,
        choices=sorted(MESHES),
        default=4,
        help="ranks: 4 = FSDP×TP on (2, 2), 2 = FSDP on (2,), 1 = one process",
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="muon")
    parser.add_argument(
        "--ns-coefficients",
        choices=NS_COEFFICIENTS,
        help="Newton–Schulz coefficient set of muon and normuon (default: torch's quintic)",
    )
    parser.add_argument("--seed", type=_seed, default=0, help="model init and batch order")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="write the loss curves")
    return parser


class Progress:
    """A plain-text progress bar: redrawn in place on a terminal, a few lines otherwise."""

    def __init__(self, stream: TextIO, width: int = 24) -> None:
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()
        self._label_width = 16

    def __call__(self, p: dict[str, Any]) -> None:
        """Show one progress payload (``run``, ``step``, ``steps``, ``loss``, mean ``step_s``)."""
        step, steps = p["step"], p["steps"]
        checkpoints = {max(1, round(steps * f / 4)) for f in range(1, 5)}
        if not self.tty and step not in checkpoints:
            return
        filled = round(self.width * step / steps)
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"{p['run']:<{self._label_width}} [{bar}] {step:>{len(str(steps))}}/{steps}"
            f"  loss {p['loss']:6.3f}  {p['step_s']:5.2f} s/step"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if step == steps else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


class _UsageError(Exception):
    """A bad flag value found after parsing; reported as one line, exit status 2."""


def _check_plot(path: Path | None) -> None:
    """Fail before training, not after, on a plot that cannot be written."""
    if path is None:
        return
    if path.suffix.lower() != ".png":
        raise _UsageError(f"--plot needs a .png file name, got {str(path)!r}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise _UsageError("--plot needs matplotlib: pip install 'canzona[plot]'") from None
    # the folders it needs are made when the plot is written, never for a run that fails
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        where = f"{str(path.parent)!r}: {str(existing)!r} is a file"
        raise _UsageError(f"--plot: cannot create {where}")
    if path.is_dir() or not os.access(existing, os.W_OK):
        raise _UsageError(f"--plot: cannot write {str(path)!r}")
    if existing == path.parent:  # try it: access() says yes to root where writes fail (/proc)
        new = not path.exists()
        try:
            with path.open("ab"):
                pass
        except OSError as exc:
            raise _UsageError(f"--plot: cannot write {str(path)!r}: {exc.strerror}") from None
        if new:
            path.unlink()


def plot_losses(result: dict[str, Any], path: Path, title: str) -> None:
    """Draw the training-loss curves of every run into ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in result["runs"].values():
        ax.plot(range(1, len(run.losses) + 1), run.losses, label=run.label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(result: dict[str, Any], settings: DemoSettings) -> list[str]:
    """The printed summary: losses, optimizer-step timings, the plan's balance."""
    from canzona.demo.train import BASELINE_LR, LEARNING_RATES

    runs = result["runs"]
    lr, adamw_lr = LEARNING_RATES[settings.optimizer]
    schedule = f" ({settings.ns_coefficients})" if settings.ns_coefficients else ""
    described = {
        "canzona": f"lr {lr:g} on matrices{schedule}, AdamW lr {adamw_lr:g} on "
        "embedding/head/norms",
        "adamw": f"torch.optim.AdamW on every parameter, lr {BASELINE_LR:g}",
    }
    lines = [
        "",
        f"Loss after {settings.steps} steps (nats/byte; same init, same batches):",
        f"  {'':<16}{'held-out start -> end':<24}{'train first -> last':<22}settings",
    ]
    for key, run in runs.items():
        held_out = f"{run.eval_start:.3f} -> {run.eval_end:.3f}"
        train = f"{run.losses[0]:.3f} -> {run.losses[-1]:.3f}"
        lines.append(f"  {run.label:<16}{held_out:<24}{train:<22}{described[key]}")
    if "adamw" in runs:
        ours, theirs = runs["canzona"].eval_end, runs["adamw"].eval_end
        gap = abs(theirs - ours)
        verdict = (
            "level with AdamW"
            if gap < 5e-4
            else f"{gap:.3f} nats/byte {'below' if ours < theirs else 'above'} AdamW"
        )
        lines.append(f"  {runs['canzona'].label} ends {verdict} on the held-out batch")
    lines.append("")
    timings = result["timings"]
    if timings:
        ours, rep = timings["canzona"], timings["replicated"]
        speedup = rep["step_s"] / max(ours["step_s"], 1e-12)
        lines += [
            f"Optimizer step (median of {settings.timing_steps}, slowest rank): "
            f"canzona plan {ours['step_s'] * 1e3:.1f} ms, replicated plan "
            f"{rep['step_s'] * 1e3:.1f} ms ({speedup:.2f}x)",
            f"  of which matrix compute: canzona {ours['compute_s'] * 1e3:.1f} ms, "
            f"replicated {rep['compute_s'] * 1e3:.1f} ms",
        ]
    else:
        lines.append("Optimizer step: not timed (one process has nothing to distribute)")
    plan = result["plan"]
    owner = plan.get("owner_s") if plan else None
    if owner:
        per_rank = "/".join(f"{t * 1e3:.1f}" for t in owner)
        lines.append(
            f"Plan: {plan['matrices']} matrices on {plan['num_ranks']} ranks, "
            f"{plan['micro_groups']} micro-group(s); owner time per rank as planned (measured "
            f"costs, one fixed part per stacked call) {per_rank} ms, balance ratio "
            f"{max(owner) / (sum(owner) / len(owner)):.3f} (max / mean)"
        )
    elif plan:
        lines.append(
            f"Plan: {plan['matrices']} matrices on {plan['num_ranks']} ranks, balance ratio "
            f"{plan['balance_ratio']:.3f} (max load / mean load), makespan / lower bound "
            f"{plan['makespan_ratio']:.3f}, {plan['micro_groups']} micro-group(s)"
        )
    else:
        lines.append("Plan: one process, every matrix is local (balance ratio 1.000)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``canzona demo``.

    Args:
        argv: The demo's arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 1 when a rank failed, 2 for bad flags.
    """
    try:
        args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a bad flag (already reported on one line)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        _check_plot(args.plot)
        if args.ns_coefficients is not None and args.optimizer not in ("muon", "normuon"):
            raise _UsageError(
                f"--ns-coefficients applies to muon and normuon, not {args.optimizer}"
            )
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    from canzona.launch import RankFailure, limit_threads

    limit_threads()  # before anything imports torch
    from canzona.demo.train import DemoSettings, describe, run_demo

    settings = DemoSettings(
        steps=args.steps,
        world=args.world,
        optimizer=args.optimizer,
        ns_coefficients=args.ns_coefficients,
        seed=args.seed,
    )
    began = time.perf_counter()
    print(describe(settings, MESHES[settings.world]), flush=True)
    try:
        result = run_demo(settings, Progress(sys.stdout))
    except RankFailure as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    for line in summary_lines(result, settings):
        print(line)
    if args.plot is not None:
        title = (
            f"canzona demo: {settings.steps} steps, {settings.world} rank(s), "
            f"{MESHES[settings.world]}"
        )
        try:
            plot_losses(result, args.plot, title)
        except OSError as exc:
            print(f"{PROG}: error: cannot write {str(args.plot)!r}: {exc}", file=sys.stderr)
            return 1
        print(f"Loss curves written to {args.plot}")
    print(f"Finished in {time.perf_counter() - began:.1f} s")
    return 0
