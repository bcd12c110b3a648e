"""Run every benchmark in one mode: ``run_all.py --quick|--full`` (the ``nox -s bench`` entry).

Each script runs in its own process (one intra-op thread, ``OMP_NUM_THREADS=1``), in the order
plan_quality, kernels, alloc_faults, step_latency, overhead, gc_in_step, fused_exchanges,
train_step, large_world, and writes its JSON (which names the commit it was produced from) under
``benchmarks/results/``.
Full mode also rewrites each script's section of ``docs/benchmarks.md`` and its images under
``docs/img/`` (the published numbers); quick mode, about six minutes on 2 cores, writes its
JSON, Markdown and charts under ``benchmarks/results/quick/`` and leaves the published files
alone.

    python benchmarks/run_all.py --quick                  # what ``nox -s bench`` runs
    python benchmarks/run_all.py --full                   # the published numbers
    python benchmarks/run_all.py --full --only overhead   # one script
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from _report import QUICK
from _report import QUICK_DOC as _QUICK_DOC

HERE = Path(__file__).resolve().parent
SCRIPTS = (
    "plan_quality",
    "kernels",
    "alloc_faults",
    "step_latency",
    "overhead",
    "gc_in_step",
    "fused_exchanges",
    "train_step",
    "large_world",
)
QUICK_DOC = str(_QUICK_DOC)
QUICK_OUTPUTS = {
    "plan_quality": ["--out", str(QUICK), "--doc", QUICK_DOC, "--plot", str(QUICK / "loads.png")],
    "kernels": ["--out-dir", str(QUICK), "--doc", QUICK_DOC],
    "alloc_faults": ["--out", str(QUICK), "--doc", QUICK_DOC],
    "gc_in_step": ["--out", str(QUICK), "--doc", QUICK_DOC],
    "step_latency": ["--out", str(QUICK), "--doc", QUICK_DOC, "--chart", str(QUICK / "chart.png")],
    "overhead": ["--out", str(QUICK), "--doc", QUICK_DOC, "--plot", str(QUICK / "overhead.png")],
    "fused_exchanges": ["--out", str(QUICK), "--doc", QUICK_DOC],
    "train_step": ["--out", str(QUICK), "--doc", QUICK_DOC],
    "large_world": ["--out", str(QUICK), "--doc", QUICK_DOC],
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every benchmark's quick mode (default)")
    mode.add_argument("--full", action="store_true", help="every benchmark's full mode")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, help="run only these")
    args = parser.parse_args(argv)
    flag = "--full" if args.full else "--quick"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    failed, began = [], time.perf_counter()
    for name in args.only or SCRIPTS:
        start = time.perf_counter()
        print(f"== {name} {flag}", flush=True)
        extra: list[str] = []
        if not args.full:  # keep the published full-mode numbers and files untouched
            extra = QUICK_OUTPUTS[name]
        command = [sys.executable, str(HERE / f"{name}.py"), flag, *extra]
        code = subprocess.call(command, env=env)
        print(f"== {name}: exit {code}, {time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    print(f"== all: {time.perf_counter() - began:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
