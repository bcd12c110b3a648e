"""Replay the step-latency cases' plans from their stored cost tables, without timing anything.

A planner change moves owners or micro-groups; measuring what that does to step times needs
the machine the published step-latency run came from. This script answers the part that
does not: for every case of ``benchmarks/step_latency.py --full`` it builds the case's model
and ``canzona`` optimizer on forked gloo ranks, as the benchmark does, but replaces the
runtime's calibration by the cost table that the published run measured (``cost_table`` in
``benchmarks/results/step_latency.json``), takes one step (Muon with one Newton–Schulz
iteration: the plan does not depend on it) and reports the plan the runtime built: the
runtime's own prediction of each rank's owner time (``benchmarks/_plan_facts.py``), the
micro-groups and each rank's stacked calls, next to the values the published run recorded.
On the code of the published run the two agree exactly.

    python benchmarks/replay_plans.py                 # every case; JSON under benchmarks/results
    python benchmarks/replay_plans.py --model w128    # some cases
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _latency_ranks
import canzona
import canzona.runtime.plan_inputs as plan_inputs
import step_latency
from _plan_facts import plan_facts
from _ranks import launch
from canzona.plan import CostModel, GroupedCost
from canzona.plan.measured import measured_from_params

from _report import RESULTS, ROOT, write_json

SOURCE = RESULTS / "step_latency.json"
PUBLISHED_NS_STEPS = 5  # the settings the stored tables were measured with


def stored_cost(tables: Mapping[str, Any], bases: Mapping[int, CostModel]) -> GroupedCost:
    """The measured cost model of a stored ``cost_table`` (one entry per param group)."""
    models: dict[str, CostModel] = {}
    for key, entry in tables.items():
        base = bases[int(key)]
        if getattr(base, "ns_steps", PUBLISHED_NS_STEPS) != PUBLISHED_NS_STEPS:
            base = dataclasses.replace(base, ns_steps=PUBLISHED_NS_STEPS)  # type: ignore[type-var]
        models[key] = measured_from_params(base, entry)
    return GroupedCost(models, name=next(iter(models.values())).name)


def _replay(rank: int, world: int, case: Any, tables: Mapping[str, Any]) -> dict[str, Any]:
    """On one rank: plan ``case`` from ``tables`` (one step) and report the plan."""
    torch.set_num_threads(1)
    used: list[GroupedCost] = []

    def from_table(
        shapes: Any, table: Any, compute: Any, bases: Mapping[int, CostModel], **kw: Any
    ) -> GroupedCost:
        used.append(stored_cost(tables, bases))
        return used[-1]

    vars(plan_inputs)["calibrate"] = from_table  # the runtime plans from the stored table
    named, _mesh = _latency_ranks._build(case.model, case.mesh, world)
    make, hp = _latency_ranks.OPTIMIZERS[case.optimizer]
    kw = {**hp, "ns_steps": 1} if case.optimizer == "muon" else dict(hp)
    opt = make(
        _latency_ranks._groups(case.model, named),
        **kw,
        plan=canzona.PlanConfig(capacity_mb=case.capacity_mb),
    )
    for _, p in named:
        p.grad = torch.zeros_like(p)
    opt.step()
    facts = plan_facts(opt, time_cost=used[-1], optimizer=case.optimizer, world=world)
    return {
        "predicted_s": facts["predicted_s"],
        "micro_groups": facts["micro_groups"],
        "group_factor": facts["group_factor"],
        "calls": opt.last_step_stats.batches,
    }


def run(models: Sequence[str] | None) -> list[dict[str, Any]]:
    """Every selected case: the replayed plan next to the published run's."""
    published = json.loads(SOURCE.read_text())
    args = argparse.Namespace(world=None, mesh=None, optimizer=None, model=models, steps=None)
    args.peers = ""
    rows = []
    for case in step_latency.plan_cases(args, step_latency.PRESETS["full"]):
        key = (case.optimizer, case.model_key, case.mesh, case.world)
        saved = next(
            c
            for c in published["cases"]
            if (c["optimizer"], c["model"], c["mesh"], c["world"]) == key
        )
        ranks = launch(_replay, case.world, case, saved["cost_table"])
        before = saved["runs"]["canzona"]
        row = {
            "case": case.key,
            "published": {
                "predicted_s": before["plan"]["predicted_s"],
                "micro_groups": before["micro_groups"],
                "group_factor": before["plan"]["group_factor"],
            },
            "replayed": {**ranks[0], "calls": [r["calls"] for r in ranks]},
        }
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: Mapping[str, Any]) -> str:
    def ms(values: Sequence[float]) -> str:
        return "/".join(f"{v * 1e3:.2f}" for v in values)

    old, new = row["published"], row["replayed"]
    return (
        f"{row['case']}: predicted owner ms {ms(old['predicted_s'])} -> {ms(new['predicted_s'])}, "
        f"micro-groups {old['micro_groups']} -> {new['micro_groups']}, "
        f"calls per rank {'/'.join(map(str, new['calls']))}"
    )


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", nargs="+", choices=("qwen", "hetero", "structure", "small", "w128")
    )
    parser.add_argument("--out", type=Path, help="directory of the JSON file")
    args = parser.parse_args(argv)
    rows = run(args.model)
    published = json.loads(SOURCE.read_text())
    payload = {
        "source": str(SOURCE.relative_to(ROOT)),
        "source_commit": published["commit"],
        "cases": rows,
    }
    print(f"wrote {write_json('replay_plans', payload, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
