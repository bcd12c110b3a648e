"""Optimizer-step latency of every owner strategy and of other distributed Muons, in one run.

For each case (optimizer x model x mesh x world size) the script forks ``world`` gloo ranks on
the CPU, builds a Qwen3-like model (``_qwen.py``) sharded with FSDP2 (``--mesh fsdp``) or
FSDP x TP on a (2, 2) mesh (``--mesh fsdp_tp``), feeds every optimizer the same gradients
(seeded, set as DTensors in each parameter's placements) from the same initial weights, and
times ``optimizer.step()`` (barrier before each step; a step's time is the slowest rank's).
Strategies: ``replicated`` (every rank computes every matrix), ``round_robin``, ``count``,
``numel``, ``canzona`` and ``canzona`` without overlap; for Muon also the peers of
``_peers.py``. One extra process runs the same optimizer on the unsharded model: its compute
time is the denominator of the redundancy factor, and its parameters must equal the
distributed ones bit for bit. Writes ``benchmarks/results/step_latency[_quick].json``, the
``step_latency`` section of ``docs/benchmarks.md`` and a chart under ``docs/img/``.

    python benchmarks/step_latency.py --quick          # under 2 minutes on 2 cores
    python benchmarks/step_latency.py --full           # about 10 minutes
    python benchmarks/step_latency.py --from-json benchmarks/results/step_latency.json
    python benchmarks/step_latency.py --world 2 --mesh fsdp --optimizer muon --steps 20
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _peers
import _qwen
import canzona
from _latency_report import (
    DIAGNOSTICS,
    STRATEGIES,
    _ratio,
    draw_chart,
    evaluate_targets,
    explain,
    render,
)
from _ranks import launch
from kernels import cpu_description

from _report import DOC, RESULTS, ROOT, update_section, write_json

MUON_HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
SHAMPOO_HP = {"lr": 1e-3, "precondition_frequency": 1, "start_preconditioning_step": 1}
SOAP_HP = {"lr": 3e-3, "precondition_frequency": 1}
OPTIMIZERS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "muon": (lambda *a, **k: canzona.Muon(*a, **k), MUON_HP),
    "shampoo": (lambda *a, **k: canzona.Shampoo(*a, **k), SHAMPOO_HP),
    "soap": (lambda *a, **k: canzona.SOAP(*a, **k), SOAP_HP),
}
PRESETS: dict[str, dict[str, Any]] = {
    "full": {
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(512,) * 4),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(768, 384, 384, 288)),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(256,) * 4),
        },
        "steps": 10,
        "diagnostics": DIAGNOSTICS,
        "peers": (
            "torchtitan",
            "muon_fsdp2",
            "muonium",
            "heavyball",
            "full_tensor",
            "torch_dtensor",
        ),
    },
    "quick": {
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(256,) * 4),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(384, 192, 192, 144)),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(128,) * 4),
        },
        "steps": 10,
        "peers": ("torchtitan", "full_tensor"),
    },
    "tiny": {  # CI smoke tests: seconds, not a measurement
        "models": {
            "qwen": _qwen.ModelConfig(name="qwen3-like", widths=(64,) * 2),
            "hetero": _qwen.ModelConfig(name="heterogeneous", widths=(96, 64, 48)),
            "small": _qwen.ModelConfig(name="qwen3-like small", widths=(32,) * 2),
        },
        "steps": 2,
        "peers": ("full_tensor",),
    },
}
WARMUP = 2
SLOW_PEER_STEPS = 3  # timed steps of the peers in _peers.SLOW (seconds per step)
GRAD_SETS = 2
PLOT_PATH = ROOT / "docs" / "img" / "step_latency_compute.png"


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One launch of ``world`` ranks: every strategy (and peer) on one model and mesh."""

    optimizer: str
    model_key: str
    model: _qwen.ModelConfig
    mesh: str
    world: int
    steps: int
    capacity_mb: float
    peers: tuple[str, ...] = ()
    strategies: tuple[str, ...] = STRATEGIES
    diagnostics: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.optimizer}/{self.model_key}/{self.mesh}/w{self.world}"


# -------------------------------------------------------------------------------- on the ranks


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("torch.distributed", "torch._dynamo", "torch._inductor", "torch._functorch"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _canzona_factory(case: Case, strategy: str) -> Callable[..., torch.optim.Optimizer]:
    make, hp = OPTIMIZERS[case.optimizer]
    name = strategy.split("_", 1)[0] if strategy.startswith("canzona") else strategy
    capacity = 4096.0 if strategy == "canzona_one_group" else case.capacity_mb
    plan = canzona.PlanConfig(strategy=name, capacity_mb=capacity)
    pipeline = canzona.PipelineConfig(
        overlap=strategy != "canzona_no_overlap",
        check_every_step=strategy != "canzona_unchecked",
        progress_markers=strategy != "canzona_unchecked",
    )

    def factory(named: Any, mesh: Any) -> torch.optim.Optimizer:
        return make(list(named), **hp, plan=plan, pipeline=pipeline)

    return factory


class Runner:
    """One optimizer of a case, with its own copy of the parameters between its steps.

    All runners of a case step in turn (step 0 of every runner, then step 1, ...), loading
    their parameter values into the shared model before their step and saving them after,
    so that load from outside the benchmark hits every strategy alike.
    """

    def __init__(
        self, label: str, opt: torch.optim.Optimizer, init: list[torch.Tensor], steps: int
    ) -> None:
        self.label = label
        self.opt = opt
        self.values = [x.clone() for x in init]
        self.steps = steps
        self.canzona = hasattr(opt, "last_step_stats")
        self.times: list[float] = []
        self.stats: list[dict[str, Any]] = []
        self.cpu: list[float] = []
        self.error: str | None = None
        self.snapshot_after: int | None = None  # keep the values after this many steps
        self.snapshot: list[torch.Tensor] | None = None

    def step(
        self, index: int, params: list[torch.Tensor], grads: list[torch.Tensor], distributed: bool
    ) -> None:
        """One timed ``opt.step()`` (untimed before ``WARMUP``)."""
        if self.error is not None or index >= WARMUP + self.steps:
            return
        with torch.no_grad():
            for p, v, g in zip(params, self.values, grads, strict=True):
                _qwen.local(p).copy_(v)
                p.grad = g.clone()
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        try:
            self.opt.step()
        except Exception as exc:  # a peer that does not run here: record why
            self.error = describe_error(exc)
            return
        elapsed = time.perf_counter() - start
        with torch.no_grad():
            for p, v in zip(params, self.values, strict=True):
                v.copy_(_qwen.local(p))
                p.grad = None
        if self.snapshot_after == index + 1:
            self.snapshot = [v.clone() for v in self.values]
        if index < WARMUP:
            return
        self.times.append(elapsed)
        if self.canzona:
            stats = self.opt.last_step_stats.as_dict()  # type: ignore[attr-defined]
            self.cpu.append(stats["compute_cpu_s"])
            self.stats.append(stats)

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        return {"times": self.times, "stats": self.stats, "cpu_compute": self.cpu}


def describe_error(exc: BaseException) -> str:
    """``Type: first line`` of an exception, plus the failing line of a peer's compiled code."""
    text = str(exc).strip()
    out = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".strip()
    if "from user code:" in text:  # torch.compile: name the peer's line that failed
        lines = [ln.strip() for ln in text.split("from user code:", 1)[1].splitlines()]
        files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
        if files:
            i = files[-1]
            where = lines[i].replace(str(Path(torch.__file__).parents[1]) + "/", "")
            code = lines[i + 1] if i + 1 < len(lines) else ""
            out += f" ({where}: {code})"
    return out[:600]


def _bind(factory: _peers.PeerFactory, hp: dict[str, Any]) -> Callable[..., Any]:
    return lambda named, mesh: factory(named, mesh, hp)


def _load(params: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values, strict=True):
            _qwen.local(p).copy_(v)


def rank_body(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Every strategy and peer of ``case`` on this rank, interleaved step by step."""
    _quiet()
    model, mesh = _qwen.build(case.model, case.mesh, world)
    named = model.matrices()
    params = [p for _, p in named]
    init = [_qwen.local(p).detach().clone() for p in params]
    pool = [_qwen.make_gradients(named, seed=s) for s in range(GRAD_SETS)]
    order = ["canzona", *[s for s in case.strategies if s != "canzona"], *case.diagnostics]
    entries = [(s, _canzona_factory(case, s)) for s in order]
    entries += [(peer, _bind(_peers.PEERS[peer], dict(MUON_HP))) for peer in case.peers]
    runners: list[Runner] = []
    out: dict[str, Any] = {}
    began = time.perf_counter()
    for label, factory in entries:
        _load(params, init)
        try:
            opt = factory(named, mesh)
        except Exception as exc:  # a peer that does not run here: record why
            out[label] = {"error": describe_error(exc)}
            continue
        steps = min(case.steps, SLOW_PEER_STEPS) if label in _peers.SLOW else case.steps
        runners.append(Runner(label, opt, init, steps))
    reference_runner = next(r for r in runners if r.label == "canzona")
    if any(r.steps < case.steps for r in runners):  # peers timed over fewer steps
        reference_runner.snapshot_after = WARMUP + min(r.steps for r in runners)
    for index in range(WARMUP + case.steps):
        shift = index % len(runners)  # rotate the order: no runner always goes first
        for runner in runners[shift:] + runners[:shift]:
            runner.step(index, params, pool[index % len(pool)], distributed=True)
    for runner in runners:
        result = runner.result()
        if "error" not in result:
            result["fingerprint"] = _qwen.fingerprint(runner.values)
            if runner.label == "canzona":
                _load(params, runner.values)
                result["full_fingerprint"] = _qwen.fingerprint([p.full_tensor() for p in params])
            else:  # compare with canzona after as many steps as this runner took
                short = runner.steps < case.steps and reference_runner.snapshot is not None
                reference = reference_runner.snapshot if short else reference_runner.values
                assert reference is not None
                result["reference_fingerprint"] = _qwen.fingerprint(reference)
                result["max_rel_diff"] = _qwen.max_rel_diff(runner.values, reference)
        out[runner.label] = result
    out["_meta"] = {"seconds": time.perf_counter() - began, "load": os.getloadavg()}
    return out


def single_body(rank: int, world: int, case: Case) -> dict[str, Any]:
    """The same optimizer on the unsharded model in one process: the redundancy denominator."""
    _quiet()
    model, _ = _qwen.build(case.model, "none", 1)
    named = model.matrices()
    params = [p for _, p in named]
    pool = [_qwen.make_gradients(named, seed=s) for s in range(GRAD_SETS)]
    runner = Runner(
        "canzona",
        _canzona_factory(case, "canzona")(named, None),
        [p.detach().clone() for p in params],
        case.steps,
    )
    for index in range(WARMUP + case.steps):
        runner.step(index, params, pool[index % len(pool)], distributed=False)
    run = runner.result()
    run["full_fingerprint"] = _qwen.fingerprint(runner.values)
    return run


# -------------------------------------------------------------------------------- the parent


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(case: Case, ranks: list[dict[str, Any]], single: dict[str, Any]) -> dict[str, Any]:
    """Per-run medians, ratios, balance and redundancy for one case."""
    single_cpu = _median(single["cpu_compute"])
    single_wall = _median([s["compute_s"] for s in single["stats"]])
    out: dict[str, Any] = {
        "case": case.key,
        "optimizer": case.optimizer,
        "model": case.model_key,
        "model_name": case.model.name,
        "model_layers": case.model.describe(),
        "mesh": case.mesh,
        "world": case.world,
        "steps": case.steps,
        "capacity_mb": case.capacity_mb,
        "single_device": {
            "step_s": _median(single["times"]),
            "compute_cpu_s": single_cpu,
            "compute_s": single_wall,
            "matches_distributed": None,
        },
        "runs": {},
    }
    canz = ranks[0].get("canzona", {})
    if "full_fingerprint" in canz:
        out["single_device"]["matches_distributed"] = (
            canz["full_fingerprint"] == single["full_fingerprint"]
        )
    out["load_average"] = ranks[0]["_meta"]["load"]
    out["interleaved_seconds"] = ranks[0]["_meta"]["seconds"]
    out["single_device"]["wall_over_cpu"] = single_wall / single_cpu if single_cpu else None
    for label in ranks[0]:
        if label.startswith("_"):
            continue
        per = [r[label] for r in ranks]
        if "error" in per[0]:
            out["runs"][label] = {"error": per[0]["error"]}
            continue
        steps = [max(ts) for ts in zip(*(p["times"] for p in per), strict=True)]
        run: dict[str, Any] = {
            "steps_s": steps,
            "step_s": _median(steps),
            "step_min_s": min(steps),
            "step_max_s": max(steps),
            "step_iqr_s": (
                statistics.quantiles(steps, n=4)[2] - statistics.quantiles(steps, n=4)[0]
            )
            if len(steps) >= 2
            else 0.0,
            "identical": all(
                p["fingerprint"] == p.get("reference_fingerprint", c["canzona"]["fingerprint"])
                for p, c in zip(per, ranks, strict=True)
            )
            if "canzona" in ranks[0] and "fingerprint" in ranks[0]["canzona"]
            else None,
            "max_rel_diff": max((p.get("max_rel_diff", 0.0) for p in per), default=0.0),
        }
        if per[0]["stats"]:
            cpu = [_median(p["cpu_compute"]) for p in per]
            wall = [_median([s["compute_s"] for s in p["stats"]]) for p in per]
            last = [p["stats"][-1] for p in per]
            run.update(
                compute_cpu_s=cpu,
                compute_s=wall,
                wait_s=[_median([s["wait_s"] for s in p["stats"]]) for p in per],
                balance=max(cpu) / statistics.mean(cpu) if statistics.mean(cpu) else float("nan"),
                balance_wall=max(wall) / statistics.mean(wall)
                if statistics.mean(wall)
                else float("nan"),
                redundancy=sum(cpu) / single_cpu if single_cpu else float("nan"),
                redundancy_wall=sum(wall) / single_wall if single_wall else float("nan"),
                bytes_sent=[s["bytes_sent"] for s in last],
                bytes_received=[s["bytes_received"] for s in last],
                collectives=[s["collectives"] for s in last],
                micro_groups=last[0]["micro_groups"],
                matrices_computed=[s["matrices_computed"] for s in last],
            )
        out["runs"][label] = run
    base = out["runs"].get("replicated", {}).get("step_s")
    ref = out["runs"].get("canzona", {}).get("step_s")
    for run in out["runs"].values():
        if "step_s" in run:
            run["vs_replicated"] = run["step_s"] / base if base else None
            run["vs_canzona"] = run["step_s"] / ref if ref else None
    return out


def plan_cases(args: argparse.Namespace, preset: dict[str, Any]) -> list[Case]:
    models = preset["models"]
    steps = args.steps or preset["steps"]
    peers = tuple(args.peers.split(",")) if args.peers is not None else preset["peers"]
    peers = tuple(p for p in peers if p)
    cases: list[Case] = []

    def add(optimizer: str, key: str, mesh: str, world: int, with_peers: bool) -> None:
        if args.world and world not in args.world:
            return
        if args.mesh and mesh not in args.mesh:
            return
        if args.optimizer and optimizer not in args.optimizer:
            return
        if args.model and key not in args.model:
            return
        model = models[key]
        # about four micro-groups per step for canzona: capacity = a quarter of a rank's share
        capacity = max(0.05, round(_qwen.mib(model) / world / 4, 3))
        cases.append(
            Case(
                optimizer=optimizer,
                model_key=key,
                model=model,
                mesh=mesh,
                world=world,
                steps=steps,
                capacity_mb=capacity,
                peers=peers if with_peers else (),
                diagnostics=preset.get("diagnostics", ()) if optimizer == "muon" else (),
            )
        )

    for world in (2, 4):
        add("muon", "qwen", "fsdp", world, True)
        add("muon", "hetero", "fsdp", world, False)
    add("muon", "qwen", "fsdp_tp", 4, True)
    for optimizer in ("shampoo", "soap"):
        add(optimizer, "small", "fsdp", 4, False)
    return cases


def planned_makespans(case: Case) -> dict[str, float]:
    """The planner's makespan / lower bound of each strategy for this case's matrices."""
    specs = [
        canzona.MatrixSpec(f"layers.{i}.{name}", shape)
        for i, h in enumerate(case.model.widths)
        for name, shape in _qwen.layer_shapes(h).items()
    ]
    out = {}
    for s in ("round_robin", "count", "numel", "canzona"):
        a = canzona.assign_owners(specs, case.world, strategy=s, optimizer=case.optimizer)
        out[s] = a.makespan_ratio
    return out


def run_case(case: Case, timeout: float) -> dict[str, Any]:
    began = time.perf_counter()
    single = launch(single_body, 1, case, timeout=timeout)[0]
    ranks = launch(rank_body, case.world, case, timeout=timeout)
    summary = summarize(case, ranks, single)
    summary["planned_makespan_ratio"] = planned_makespans(case)
    summary["bench_seconds"] = time.perf_counter() - began
    return summary


# -------------------------------------------------------------------------------- report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller models (default)")
    mode.add_argument("--full", action="store_true", help="step times of 0.3-1.5 s, all peers")
    mode.add_argument("--tiny", action="store_true", help="seconds; for smoke tests only")
    parser.add_argument("--world", type=int, nargs="+", choices=(2, 4), help="world sizes")
    parser.add_argument("--mesh", nargs="+", choices=("fsdp", "fsdp_tp"), help="meshes")
    parser.add_argument("--optimizer", nargs="+", choices=tuple(OPTIMIZERS), help="optimizers")
    parser.add_argument("--model", nargs="+", choices=("qwen", "hetero", "small"))
    parser.add_argument("--steps", type=int, help="timed steps per run (>= 10 for a measurement)")
    parser.add_argument(
        "--peers", help="comma-separated peers (default: the preset's; '' for none)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the JSON file")
    parser.add_argument("--doc", type=Path, default=DOC, help="Markdown file to update")
    parser.add_argument("--chart", type=Path, default=PLOT_PATH, help="PNG of per-rank compute")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument(
        "--from-json", type=Path, help="only re-render the docs section from a results file"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.from_json:
        return publish(json.loads(args.from_json.read_text()), args, None)
    name = "full" if args.full else "tiny" if args.tiny else "quick"
    preset = PRESETS[name]
    torch.set_num_threads(1)
    began = time.perf_counter()
    cases = plan_cases(args, preset)
    if not cases:
        parser.error("no case matches the chosen --world/--mesh/--optimizer/--model")
    results = []
    for case in cases:
        print(
            f"{case.key}: {case.model.describe()}, {len(case.strategies)} strategies, "
            f"peers {list(case.peers)}",
            flush=True,
        )
        summary = run_case(case, args.timeout)
        results.append(summary)
        for label, run in summary["runs"].items():
            if "error" in run:
                print(f"  {label:20s} did not run: {run['error'].splitlines()[-1][:120]}")
            else:
                print(
                    f"  {label:20s} {run['step_s'] * 1e3:8.1f} ms  x replicated "
                    f"{_ratio(run.get('vs_replicated'))}  x canzona {_ratio(run.get('vs_canzona'))}"
                    f"  same params: {run.get('identical')}",
                    flush=True,
                )
    payload: dict[str, Any] = {
        "mode": name,
        "command": " ".join(["python benchmarks/step_latency.py", *(argv or [f"--{name}"])]),
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_description(),
        "steps": results[0]["steps"],
        "warmup": WARMUP,
        "slow_peer_steps": SLOW_PEER_STEPS,
        "models": {
            k: {
                "name": v.name,
                "widths": list(v.widths),
                "layers": v.describe(),
                "mib": _qwen.mib(v),
            }
            for k, v in preset["models"].items()
        },
        "hyper_parameters": {"muon": MUON_HP, "shampoo": SHAMPOO_HP, "soap": SOAP_HP},
        "cases": results,
    }
    payload["bench_seconds"] = time.perf_counter() - began
    return publish(payload, args, name)


def publish(payload: dict[str, Any], args: argparse.Namespace, name: str | None) -> dict[str, Any]:
    """Targets, notes and chart from the cases; the JSON (when ``name``) and the docs section."""
    payload["targets"] = evaluate_targets(payload["cases"])
    payload["notes"] = explain(payload)
    chart = draw_chart(payload["cases"], args.chart)
    payload["chart"] = str(chart) if chart else None
    payload["doc"] = str(args.doc)
    if name is not None:
        path = write_json(
            "step_latency" if name == "full" else f"step_latency_{name}", payload, out_dir=args.out
        )
        print(f"wrote {path}")
    machine = payload.get("machine") or _machine()
    update_section("step_latency", render({**payload, "machine": machine}), doc=args.doc)
    print(f"updated the 'step_latency' section of {args.doc}")
    for t in payload["targets"]:
        print(
            f"  {'ok  ' if t['met'] else 'MISS' if t['met'] is False else '--  '} "
            f"{t['name']}: {_ratio(t['measured'])} (target <= {t['target']})"
        )
    return payload


def _machine() -> dict[str, Any]:
    from _report import machine_info

    return machine_info()


if __name__ == "__main__":
    main()
