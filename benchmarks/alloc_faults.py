"""Page faults in the owner math on a CPU: a Newton–Schulz call alone and between others.

The calibration times each shape's owner call back to back with itself; a step calls one
batch after another of different shapes. On a CPU the two can differ by the memory the
call's temporaries land in: glibc's allocator hands freed blocks back to the operating
system (its mmap and trim thresholds adapt to the sizes it sees), and the next call that
needs them faults every page in again. This script measures it on the owner batches of the
step-latency benchmark's Qwen3-like model at world 2 (bf16 Newton–Schulz, 5 steps, one
intra-op thread):

* **first touch**: seconds per page fault (filling a fresh 100 MiB block against filling it
  again);
* **back to back**: each shape warmed up, then called ``repeats`` times in a row (what the
  calibration times);
* **in turn**: rounds that call every shape once, one after another (what an owner's step
  does); per shape the median thread CPU time of a call and its mean minor faults.

Each allocator setting runs in a fresh process, since glibc reads them at start-up: its
defaults, and ``MALLOC_MMAP_THRESHOLD_`` at its largest (32 MiB) with
``MALLOC_TRIM_THRESHOLD_`` at 2 GiB (fixed thresholds keep freed blocks mapped).

    python benchmarks/alloc_faults.py --full    # the published numbers, about a minute
    python benchmarks/alloc_faults.py --tiny --out /tmp/a --doc /tmp/a/b.md  # smoke test
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from canzona.updates.newton_schulz import newton_schulz

from _report import markdown_table, publish

#: glibc settings compared (environment variables read when a process starts).
SETTINGS: dict[str, dict[str, str]] = {
    "glibc defaults": {},
    "fixed thresholds": {
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(2 << 30),
    },
}
PRESETS: dict[str, dict[str, Any]] = {
    "full": {"width": 512, "repeats": 9, "rounds": 10, "touch_mib": 100},
    "quick": {"width": 256, "repeats": 3, "rounds": 4, "touch_mib": 32},
    "tiny": {"width": 32, "repeats": 2, "rounds": 2, "touch_mib": 4},
}


def _batches(width: int) -> list[tuple[int, int, int]]:
    """The owner batches ``(k, m, n)`` of step_latency's Qwen3-like model at world 2."""
    h = width
    return [(4, 3 * h, h), (4, h, h), (2, 2 * h, h), (2, h, 2 * h), (1, h, 3 * h)]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _call(x: torch.Tensor) -> tuple[float, int]:
    """Thread CPU seconds and minor faults of one Newton–Schulz call."""
    f0, t0 = _faults(), time.thread_time()
    newton_schulz(x)
    return time.thread_time() - t0, _faults() - f0


def _first_touch(mib: int) -> dict[str, float]:
    """Seconds per page fault: a fresh block filled once, then again."""
    block = torch.empty(mib << 20, dtype=torch.uint8)
    f0, t0 = _faults(), time.thread_time()
    block.fill_(1)
    first, faults = time.thread_time() - t0, _faults() - f0
    t0 = time.thread_time()
    block.fill_(2)
    second = time.thread_time() - t0
    return {"faults": faults, "first_s": first, "second_s": second,
            "s_per_fault": (first - second) / max(faults, 1)}  # fmt: skip


def _summary(calls: list[tuple[float, int]]) -> dict[str, float]:
    return {
        "ms": statistics.median(t for t, _ in calls) * 1e3,
        "faults": statistics.fmean(f for _, f in calls),
    }


def child(preset: dict[str, Any]) -> dict[str, Any]:
    """One allocator setting, in this process: first touch, back to back, in turn."""
    torch.set_num_threads(1)
    shapes = _batches(preset["width"])
    gen = torch.Generator().manual_seed(0)
    stacks = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    touch = _first_touch(preset["touch_mib"])
    alone = []
    for x in stacks:
        _call(x)
        alone.append(_summary([_call(x) for _ in range(preset["repeats"])]))
    for x in stacks:  # a warm-up round
        _call(x)
    rounds: list[list[tuple[float, int]]] = [[] for _ in stacks]
    for _ in range(preset["rounds"]):
        for calls, x in zip(rounds, stacks, strict=True):
            calls.append(_call(x))
    in_turn = [_summary(calls) for calls in rounds]
    names = sorted({k for env in SETTINGS.values() for k in env})
    return {"seen_env": {k: os.environ.get(k) for k in names},
            "first_touch": touch, "shapes": [list(s) for s in shapes],
            "back_to_back": alone, "in_turn": in_turn}  # fmt: skip


def _run_setting(name: str, env: dict[str, str], preset_name: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", preset_name]
    out = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return {"setting": name, "env": env, **json.loads(out.stdout.strip().splitlines()[-1])}


def render(payload: dict[str, Any]) -> str:
    """The Markdown section of docs/benchmarks.md."""
    runs = payload["settings"]
    head = (
        "## Page faults in the owner math (CPU)\n\n"
        f"`{payload['command']}` (commit `{payload['commit']}`, {payload['date']}): "
        f"{payload['cpu']}, torch {torch.__version__}, one intra-op thread. bf16 "
        "Newton–Schulz (5 steps) on the owner batches `(k, m, n)` of the step-latency "
        f"benchmark's Qwen3-like model at width {payload['preset']['width']}, world 2. *Back "
        f"to back*: each batch warmed up and called {payload['preset']['repeats']} times in a "
        f"row, as the calibration times it; *in turn*: {payload['preset']['rounds']} rounds "
        "that call every batch once, one after another, as an owner's step does. Median "
        "thread CPU time of a call and its mean minor page faults; each allocator setting in "
        "a fresh process.\n\n"
    )
    rows = []
    for run in runs:
        for shape, alone, turn in zip(
            run["shapes"], run["back_to_back"], run["in_turn"], strict=True
        ):
            rows.append([run["setting"], "×".join(map(str, shape)), f"{alone['ms']:.2f}",
                         f"{alone['faults']:.0f}", f"{turn['ms']:.2f}", f"{turn['faults']:.0f}",
                         f"{turn['ms'] / alone['ms']:.3f}"])  # fmt: skip
    table = markdown_table(
        [
            "allocator",
            "batch k×m×n",
            "back to back ms",
            "faults",
            "in turn ms",
            "faults",
            "in turn / back to back",
        ],
        rows,
    )
    touch = runs[0]["first_touch"]
    fixed = " ".join(f"{k}={v}" for k, v in SETTINGS["fixed thresholds"].items())
    tail = (
        f"\n\nFirst touch: {touch['faults']} faults cost "
        f"{touch['s_per_fault'] * 1e6:.2f} µs each ({touch['first_s'] * 1e3:.1f} ms for a fresh "
        f"block, {touch['second_s'] * 1e3:.1f} ms to fill it again). *Fixed thresholds*: "
        f"`{fixed}`, which keep freed blocks up to 32 MiB mapped."
    )
    return head + table + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller batches (default)")
    mode.add_argument("--full", action="store_true", help="the published numbers")
    mode.add_argument("--tiny", action="store_true", help="seconds; smoke tests only")
    mode.add_argument("--child", choices=sorted(PRESETS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, help="Markdown file")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(PRESETS[args.child])))
        return 0
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    from kernels import cpu_description

    start = time.perf_counter()
    runs = [_run_setting(label, env, name) for label, env in SETTINGS.items()]
    payload: dict[str, Any] = {
        "mode": name,
        "command": f"python benchmarks/alloc_faults.py --{name}",
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "preset": PRESETS[name],
        "settings": runs,
        "bench_seconds": time.perf_counter() - start,
    }
    publish("alloc_faults", payload, render, mode=name, out=args.out, doc=args.doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
