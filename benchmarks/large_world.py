"""One rank of a job of up to 1024 ranks in one process: the host time of its first and later steps.

A process group of the ``fake`` backend (torch's, for one process that plays one rank of a
larger job) holds one rank of a ``(W,)`` mesh, the first or the last. The parameters are a
Qwen3 model's matrices from the catalogue (``canzona.plan.models``) as FSDP2 stores them
(``Shard(0)`` DTensors holding that rank's rows), every row count the model's and every
column count divided by ``COLS`` (16), so that the owner math stays small on this CPU while
the matrices, their splits and the fragments every rank holds are the model's.
``canzona.Muon`` (one Newton–Schulz iteration, ``PlanConfig(cost="flops")``: no
calibration) steps it with per-head splits (q/k/v rows, o columns, ``canzona.Split``) or
none. The runtime's all-to-alls are replaced: a gather of one vector per rank (the
cross-rank checks, the vote) returns this rank's vector from every rank, as every rank of a
healthy job sends the same, and a payload exchange returns zeros but for the header that
rides a steady step's first gather at the start of every peer's segment, which arrives as this
rank's (until 2026-12-07 it arrived as zeros: every other later step was declined and run
again with the check on its own, about doubling those steps' host time). What is timed is therefore
the rank's own work in a step: its planning and setup at the first step, its packing, owner
math and apply later, without the wire. Each case runs in a process of its own,
forked from the parent once it has imported torch and canzona (a job's ranks have them imported
before their first step; no canzona code has run in the parent, so every cache starts empty).

    python benchmarks/large_world.py --full     # the published numbers, about a minute
    python benchmarks/large_world.py --tiny --out /tmp/w --doc /tmp/w/b.md   # smoke test
    python benchmarks/large_world.py --case qwen3-32b 0 1024 heads 2 1023    # one case
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import markdown_table, publish

PRESETS: dict[str, dict[str, Any]] = {
    "full": {"model": "qwen3-32b", "layers": 0, "worlds": (64, 256, 1024), "steps": 6},
    "quick": {"model": "qwen3-32b", "layers": 16, "worlds": (256,), "steps": 3},
    "tiny": {"model": "qwen3-0.6b", "layers": 2, "worlds": (16,), "steps": 4},
}
SPLITS = ("heads", "none")
COLS = 16


class _Done:
    """A finished collective's handle."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# (element size, send splits, receive splits) -> (send indices, receive indices) of the headers
_HEADER_COPIES: dict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[Any, Any]] = {}


def _header_copies(size: int, out_splits: Any, in_splits: Any) -> tuple[Any, Any]:
    """Where each peer's segment of a gather starts, its header's elements, both buffers."""
    import torch

    from canzona.runtime.checks import RIDE_WORDS

    key = (size, tuple(in_splits), tuple(out_splits))
    cached = _HEADER_COPIES.get(key)
    if cached is None:
        head = RIDE_WORDS * 8 // size
        src, dst, i0, o0 = [], [], 0, 0
        for i, o in zip(in_splits, out_splits, strict=True):
            n = min(head, i, o)
            src += range(i0, i0 + n)
            dst += range(o0, o0 + n)
            i0, o0 = i0 + i, o0 + o
        cached = _HEADER_COPIES[key] = (torch.tensor(src), torch.tensor(dst))
    return cached


def _fake_all_to_all(out: Any, inp: Any, out_splits: Any, in_splits: Any, group: Any) -> _Done:
    if not out_splits and not in_splits:  # one vector per rank: every rank sends this one
        out.copy_(inp)
        return _Done()
    out.zero_()
    # a header riding a gather starts every peer's segment: every peer sends this one
    src, dst = _header_copies(out.element_size(), out_splits, in_splits)
    out.index_copy_(0, dst, inp.index_select(0, src))
    return _Done()


def case(
    model: str, layers: int, world: int, split: str, steps: int, rank: int = 0
) -> dict[str, Any]:
    """Rank ``rank`` of ``world`` ranks: step times and what its steps did (in this process)."""
    import torch
    import torch._dynamo  # FSDP2's fully_shard has imported it before a job's first step
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import canzona
    from canzona.plan.models import MODELS
    from canzona.runtime import pipeline, watchdog
    from canzona.runtime.layout import fragment_for

    torch.set_num_threads(1)
    watchdog.all_to_all = _fake_all_to_all  # type: ignore[assignment]
    pipeline.all_to_all = _fake_all_to_all  # type: ignore[assignment]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    m = MODELS[model]
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    shapes = {
        "q": (q, m.hidden // COLS),
        "k": (kv, m.hidden // COLS),
        "v": (kv, m.hidden // COLS),
        "o": (m.hidden, q // COLS),
        "gate": (m.ffn, m.hidden // COLS),
        "up": (m.ffn, m.hidden // COLS),
        "down": (m.hidden, m.ffn // COLS),
    }
    params: dict[str, torch.nn.Parameter] = {}
    grads: dict[str, torch.Tensor] = {}
    for layer in range(layers or m.layers):
        for kind, shape in shapes.items():
            local = torch.zeros(fragment_for(shape, (world,), (Shard(0),), (rank,)).shape)
            full = torch.Size(shape)
            value = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=full, stride=(shape[1], 1)
            )
            name = f"layers.{layer}.{kind}"
            params[name] = torch.nn.Parameter(value)
            grads[name] = DTensor.from_local(
                torch.full(local.shape, 1e-3), mesh, [Shard(0)], run_check=False, shape=full,
                stride=(shape[1], 1),
            )  # fmt: skip
    by_kind = {k: [(n, p) for n, p in params.items() if n.endswith(f".{k}")] for k in shapes}
    if split == "heads":
        groups: list[dict[str, Any]] = [
            {"params": by_kind["q"] + by_kind["k"] + by_kind["v"],
             "split": canzona.Split(dim=0, size=m.head_dim)},
            {"params": by_kind["o"], "split": canzona.Split(dim=1, size=m.head_dim // COLS)},
            {"params": by_kind["gate"] + by_kind["up"] + by_kind["down"]},
        ]  # fmt: skip
    else:
        groups = [{"params": list(params.items())}]
    opt = canzona.Muon(groups, lr=0.01, ns_steps=1, plan=canzona.PlanConfig(cost="flops"))
    for name, p in params.items():
        p.grad = grads[name]
    times, computes, rode = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        computes.append(opt.last_step_stats.compute_s)
        rode.append(opt.last_step_stats.header_rode)
    # after a plan's first two steps the check rides the first gather: none was declined
    if not all(rode[2:]):
        raise RuntimeError(f"a later step's header did not ride its gather: {rode}")
    stats = opt.last_step_stats
    plan = opt._runtime.plan
    assert plan is not None
    dist.destroy_process_group()
    return {
        "model": model,
        "layers": layers or m.layers,
        "world": world,
        "rank": rank,
        "split": split,
        "matrices": len(plan.specs),
        "first_step_s": times[0],
        "later_step_s": statistics.median(times[1:]),
        "later_compute_s": statistics.median(computes[1:]),
        "owned": sum(plan.owner(s.name) == rank for s in plan.specs),
        "micro_groups": stats.micro_groups,
        "bytes_sent": stats.bytes_sent,
    }


def _child(conn: Connection, args: tuple[str, int, int, str, int, int]) -> None:
    """One case in a forked process: its row, or the error's traceback, through ``conn``."""
    try:
        conn.send(case(*args))
    except BaseException:
        conn.send(traceback.format_exc())
    finally:
        conn.close()


def run(preset: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (world, split, rank) case in a process of its own, forked from this one.

    The first rank and the last: rank 0 owns the most matrices where they outnumber the
    ranks, and the last rank finds itself at the end of every rank set it belongs to.
    """
    import torch  # noqa: F401  imported once, here: the children start with it

    import canzona  # noqa: F401

    fork = multiprocessing.get_context("fork")
    rows = []
    for world in preset["worlds"]:
        for split, rank in itertools.product(SPLITS, (0, world - 1)):
            args = (preset["model"], preset["layers"], world, split, preset["steps"], rank)
            receive, send = fork.Pipe(duplex=False)
            child = fork.Process(target=_child, args=(send, args))
            child.start()
            send.close()
            row = receive.recv()
            child.join()
            if isinstance(row, str):
                raise RuntimeError(f"case {args} failed in its process:\n{row}")
            print(
                f"{row['model']} world {world} split {split} rank {rank}: "
                f"{row['matrices']} matrices, first step {row['first_step_s']:.2f} s, "
                f"later {row['later_step_s'] * 1e3:.0f} ms"
            )
            rows.append(row)
    return rows


def render(payload: dict[str, Any]) -> str:
    """The Markdown section."""
    rows = payload["rows"]
    lines = [
        "## One rank of a large job",
        "",
        f"Commit `{payload['commit']}`, `{payload['command']}` ({payload['cpu']}). One rank of "
        "a job of W ranks, the first (0) or the last (W - 1), in one process (torch's `fake` "
        "process group): the Qwen3 model's matrices as FSDP2 shards them (`Shard(0)`; row "
        f"counts the model's, column counts divided by {COLS}), `canzona.Muon` with one "
        "Newton–Schulz iteration and FLOP costs, with per-head splits (q/k/v rows, o "
        "columns) or none. The all-to-alls do not run: gathers of one vector per rank return "
        "this rank's from every rank (a healthy job's ranks send the same), payloads arrive "
        "as zeros but for the header that rides a steady step's first gather, which arrives "
        "as this rank's (every later step checked: none declined; until this commit's run "
        "the header arrived as zeros, every other later step was declined and run again, "
        "and the published later steps took up to twice as long). *First step*: planning, "
        "routing and the schedule, then the step; *later steps*: median, of which the owners' "
        "math as `last_step_stats.compute_s`.",
        "",
        markdown_table(
            [
                "model",
                "split",
                "matrices",
                "W",
                "rank",
                "first step (s)",
                "later steps (ms)",
                "of which owner math (ms)",
                "matrices the rank owns",
                "micro-groups",
            ],
            [
                [
                    r["model"] + ("" if r["layers"] == 64 else f" ({r['layers']} layers)"),
                    r["split"],
                    r["matrices"],
                    r["world"],
                    r["rank"],
                    f"{r['first_step_s']:.2f}",
                    f"{r['later_step_s'] * 1e3:.0f}",
                    f"{r['later_compute_s'] * 1e3:.0f}",
                    r["owned"],
                    r["micro_groups"],
                ]
                for r in rows
            ],
        ),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one world size (default)")
    mode.add_argument("--full", action="store_true", help="the published numbers")
    mode.add_argument("--tiny", action="store_true", help="seconds; smoke tests only")
    mode.add_argument(
        "--case",
        nargs="+",
        metavar="MODEL LAYERS WORLD SPLIT STEPS [RANK]",
        help="one case in this process, its row as JSON (layers 0: all of the model's)",
    )
    parser.add_argument("--out", type=Path, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, help="Markdown file")
    args = parser.parse_args(argv)
    if args.case:
        if len(args.case) not in (5, 6):
            parser.error("--case takes MODEL LAYERS WORLD SPLIT STEPS [RANK]")
        model, layers, world, split, steps, *rank = args.case
        row = case(model, int(layers), int(world), split, int(steps), *map(int, rank))
        print(json.dumps(row))
        return 0
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    from kernels import cpu_description

    preset = PRESETS[name]
    start = time.perf_counter()
    payload: dict[str, Any] = {
        "mode": name,
        "command": f"python benchmarks/large_world.py --{name}",
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "preset": {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()},
        "rows": run(preset),
    }
    payload["bench_seconds"] = time.perf_counter() - start
    publish("large_world", payload, render, mode=name, out=args.out, doc=args.doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
