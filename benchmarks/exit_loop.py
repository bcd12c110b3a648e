"""Exit loop: run a short FSDP2 training job many times and count the runs where a rank dies.

Each run starts ``--world`` fresh Python processes (``--launcher spawn``: one ``python`` per
rank, joined by a ``FileStore``; ``--launcher torchrun``: ``torchrun --standalone``), trains
a small MLP under ``fully_shard`` for ``--steps`` steps (forward, backward, gradient
clipping, ``step()``, an LR scheduler), calls ``destroy_process_group()`` and lets the
interpreter exit with the model and the optimizer still alive, as a training script does.
A run fails when a rank exits non-zero, dies from a signal or prints ``terminate called``.

The race this catches sits in the last milliseconds of a process: a collective's work handle
that the interpreter's main thread has dropped is released by the process group's worker
thread, which must take the GIL; during interpreter shutdown that thread is ended inside a
C++ destructor and the process aborts (SIGABRT). ``--pin`` puts each rank on one CPU, so
that the main thread and the process group's threads share a core: the race then shows in
about half of the runs instead of a few percent (measured on 2 cores, see
docs/reliability.md). ``--optimizer muon adamw`` interleaves runs of both optimizers, so
that both see the same machine load.

    python benchmarks/exit_loop.py --runs 200              # about 15 minutes on 2 cores
    python benchmarks/exit_loop.py --runs 40 --pin         # the test's setting, longer
    python benchmarks/exit_loop.py --runs 100 --optimizer muon adamw --launcher torchrun

Writes ``benchmarks/results/exit_loop.json`` (``--out`` to change the directory).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import RESULTS, write_json

ABORT = "terminate called"
OPTIMIZERS = ("muon", "adamw")
LAUNCHERS = ("spawn", "torchrun")
JOB_TIMEOUT_S = 180.0

_KEEP: object = None  # a rank's model and optimizer, alive until the interpreter exits


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One job: how its ranks ended.

    Attributes:
        index: Position of the run in the loop.
        optimizer: ``"muon"`` (``canzona.Muon``) or ``"adamw"`` (``torch.optim.AdamW``).
        exit_codes: Each process's exit code (negative: killed by that signal; the launcher's
            own code with ``torchrun``).
        seconds: Wall time of the run.
        stderr: What the ranks wrote to stderr, when the run failed (its first and last
            lines when long).
        aborted: Some rank printed ``terminate called``.
    """

    index: int
    optimizer: str
    exit_codes: tuple[int, ...]
    seconds: float
    stderr: str = ""
    aborted: bool = False

    @property
    def ok(self) -> bool:
        """True when every rank exited with status 0 and none printed ``terminate called``."""
        return all(code == 0 for code in self.exit_codes) and not self.aborted


def train_rank(rank: int, world: int, store: str | None, steps: int, optimizer: str) -> object:
    """One rank's job, up to ``destroy_process_group()``; returns what must outlive it.

    Args:
        rank: This rank (ignored with ``store=None``: the launcher's environment names it).
        world: Number of ranks (likewise).
        store: Path of the ``FileStore`` joining the ranks; None for ``env://`` (torchrun).
        steps: Training steps.
        optimizer: ``"muon"`` or ``"adamw"``.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import canzona

    torch.set_num_threads(1)
    if store is None:
        dist.init_process_group("gloo")
    else:
        file_store = dist.FileStore(store, world)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", rank=rank, world_size=world, store=file_store)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    else:
        groups = canzona.param_groups(model, adamw={"lr": 3e-4, "weight_decay": 0.0})
        opt = canzona.Muon(groups, lr=0.02)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * steps))
    data = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        model(torch.randn(8, 32, generator=data)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad()
    dist.destroy_process_group()
    return model, opt, schedule


def _pin(rank: int) -> None:
    """Run this process (and the threads it starts later) on one CPU."""
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def _worker_args(steps: int, optimizer: str, pin: bool) -> list[str]:
    return [
        "--worker",
        "--steps",
        str(steps),
        "--optimizer",
        optimizer,
        *(["--pin"] if pin else []),
    ]


def run_job(
    index: int,
    *,
    world: int = 2,
    steps: int = 20,
    optimizer: str = "muon",
    pin: bool = False,
    launcher: str = "spawn",
    timeout_s: float = JOB_TIMEOUT_S,
) -> Run:
    """Run one job in fresh processes and report how its ranks ended.

    Raises:
        ValueError: For an unknown ``optimizer`` or ``launcher``.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    script = [str(Path(__file__).resolve()), *_worker_args(steps, optimizer, pin)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="canzona-exit-") as tmp:
        if launcher == "torchrun":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            commands = [[*torchrun, "--nproc-per-node", str(world), *script]]
        else:
            store = ["--world", str(world), "--store", os.path.join(tmp, "store")]
            commands = [[sys.executable, *script, "--rank", str(r), *store] for r in range(world)]
        procs = [
            subprocess.Popen(
                c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            for c in commands
        ]
        errors: list[str] = []
        codes: list[int] = []
        for proc in procs:
            try:
                _, err = proc.communicate(
                    timeout=max(1.0, timeout_s - (time.perf_counter() - start))
                )
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err += f"\n(killed after {timeout_s:g} s)"
            codes.append(proc.returncode)
            errors.append(err)
    text = "\n".join(e.strip() for e in errors if e.strip())
    run = Run(
        index=index,
        optimizer=optimizer,
        exit_codes=tuple(codes),
        seconds=time.perf_counter() - start,
        aborted=ABORT in text,
    )
    if run.ok:
        return run
    short = text if len(text) <= 3000 else f"{text[:1000]}\n...\n{text[-2000:]}"
    return Run(**{**asdict(run), "stderr": short})


def run_jobs(runs: int, *, optimizers: Sequence[str] = ("muon",), **job: Any) -> list[Run]:
    """``runs`` jobs per optimizer, interleaved (so that every optimizer sees the same load)."""
    return [
        run_job(i * len(optimizers) + j, optimizer=name, **job)
        for i in range(runs)
        for j, name in enumerate(optimizers)
    ]


def upper_bound(failures: int, runs: int, confidence: float = 0.95) -> float:
    """One-sided Clopper–Pearson upper bound of a failure rate (bisection on the binomial)."""
    if runs <= 0 or failures >= runs:
        return 1.0

    def at_most(p: float) -> float:  # P(X <= failures) for X ~ Binomial(runs, p)
        return math.fsum(
            math.comb(runs, k) * p**k * (1 - p) ** (runs - k) for k in range(failures + 1)
        )

    lo, hi = failures / runs, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at_most(mid) > 1 - confidence else (lo, mid)
    return hi


def summary(results: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per optimizer: runs, failed runs, failure rate and its 95% upper bound."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r.optimizer for r in results):
        mine = [r for r in results if r.optimizer == name]
        failed = sum(not r.ok for r in mine)
        out[name] = {
            "runs": len(mine),
            "failed": failed,
            "aborts": sum(r.aborted for r in mine),
            "rate": failed / len(mine),
            "rate_upper_95": upper_bound(failed, len(mine)),
            "median_run_s": sorted(r.seconds for r in mine)[len(mine) // 2],
        }
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="jobs per optimizer")
    parser.add_argument("--world", type=int, default=2, help="ranks per job")
    parser.add_argument("--steps", type=int, default=20, help="training steps per job")
    parser.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=["muon"])
    parser.add_argument("--launcher", choices=LAUNCHERS, default="spawn")
    parser.add_argument("--pin", action="store_true", help="each rank on one CPU")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the JSON")
    worker = parser.add_argument_group("one rank (used by the loop itself)")
    worker.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    worker.add_argument("--store", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    global _KEEP
    args = _parser().parse_args(argv)
    if args.worker:
        rank = args.rank if args.store else int(os.environ.get("LOCAL_RANK", "0"))
        if args.pin:
            _pin(rank)
        _KEEP = train_rank(args.rank, args.world, args.store, args.steps, args.optimizer[0])
        return 0
    if args.runs < 1 or args.world < 1 or args.steps < 1:
        raise SystemExit(f"--runs, --world and --steps must be >= 1, got {vars(args)}")
    job = {"world": args.world, "steps": args.steps, "pin": args.pin, "launcher": args.launcher}
    results: list[Run] = []
    began = time.perf_counter()
    for i in range(args.runs):
        batch = run_jobs(1, optimizers=args.optimizer, **job)
        batch = [Run(**{**asdict(r), "index": len(results) + k}) for k, r in enumerate(batch)]
        results += batch
        for r in batch:
            if not r.ok:
                first = r.stderr.strip().splitlines()[:1]
                print(f"run {r.index} ({r.optimizer}): exit codes {list(r.exit_codes)}", flush=True)
                print("  " + "".join(first), flush=True)
        if (i + 1) % 10 == 0 or i + 1 == args.runs:
            done = ", ".join(
                f"{name} {s['failed']}/{s['runs']} failed" for name, s in summary(results).items()
            )
            print(f"after {i + 1} rounds ({time.perf_counter() - began:.0f} s): {done}", flush=True)
    stats = summary(results)
    for name, s in stats.items():
        print(
            f"{name}: {s['failed']} of {s['runs']} runs failed ({s['aborts']} aborts at exit); "
            f"rate {100 * s['rate']:.1f}%, 95% upper bound {100 * s['rate_upper_95']:.1f}%"
        )
    path = write_json(
        "exit_loop",
        {"config": job, "summary": stats, "failures": [asdict(r) for r in results if not r.ok]},
        out_dir=args.out,
    )
    print(f"wrote {path}")
    return 1 if any(s["failed"] for s in stats.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
