"""The rank side of the step-latency benchmark: build the model, step every runner in turn.

``rank_body`` runs on each forked rank: it builds the case's model (``_qwen`` or
``_structure``), creates one optimizer per strategy, ``canzona`` variant and peer, steps
them in turn on the same gradients from the same initial weights, and returns per-step
times, ``last_step_stats`` and fingerprints of the parameters; rank 0 adds what each plan
predicts (``_plan_facts``). ``single_body`` runs the same optimizer on the unsharded model.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import _peers
import _qwen
import _structure
import canzona
from _latency_report import STRATEGIES
from _plan_facts import cost_table, measured_cost, plan_facts
from _ranks import WARMUP

MUON_HP = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
SHAMPOO_HP = {"lr": 1e-3, "precondition_frequency": 1, "start_preconditioning_step": 1}
SOAP_HP = {"lr": 3e-3, "precondition_frequency": 1}
OPTIMIZERS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "muon": (lambda *a, **k: canzona.Muon(*a, **k), MUON_HP),
    "shampoo": (lambda *a, **k: canzona.Shampoo(*a, **k), SHAMPOO_HP),
    "soap": (lambda *a, **k: canzona.SOAP(*a, **k), SOAP_HP),
}
#: ``canzona`` and its variants: (PlanConfig, PipelineConfig) keyword arguments.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "canzona": ({}, {}),
    "canzona_no_overlap": ({}, {"overlap": False}),
    "canzona_unchecked": ({}, {"check_every_step": False, "progress_markers": False}),
    "canzona_one_group": ({"capacity_mb": 4096.0}, {}),
    "canzona_depth2": ({}, {"depth": 2}),
    "canzona_depth3": ({}, {"depth": 3}),
    "canzona_not_atomic": ({}, {"atomic": False}),
    "canzona_free_buffers": ({}, {"keep_buffers": False}),
}
SLOW_PEER_STEPS = 3  # timed steps of the peers in _peers.SLOW (seconds per step)
GRAD_SETS = 2
ModelConfig = _qwen.ModelConfig | _structure.StructureConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One launch of ``world`` ranks: every strategy (and peer) on one model and mesh."""

    optimizer: str
    model_key: str
    model: ModelConfig
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
    """A factory of the case's optimizer with ``strategy`` or a ``canzona`` variant."""
    make, hp = OPTIMIZERS[case.optimizer]
    plan_kw, pipeline_kw = VARIANTS.get(strategy, ({}, {}))
    name = "canzona" if strategy in VARIANTS else strategy
    plan = canzona.PlanConfig(**{"strategy": name, "capacity_mb": case.capacity_mb, **plan_kw})
    pipeline = canzona.PipelineConfig(**pipeline_kw)

    def factory(named: Any, mesh: Any) -> torch.optim.Optimizer:
        opt: torch.optim.Optimizer = make(
            _groups(case.model, named), **hp, plan=plan, pipeline=pipeline
        )
        return opt

    return factory


def _build(model: ModelConfig, mesh_kind: str, world: int) -> tuple[list[Any], Any]:
    """The benchmark model's optimizer parameters ``(name, parameter)`` and its mesh."""
    if isinstance(model, _structure.StructureConfig):
        module, mesh = _structure.build(model, mesh_kind, world)
        return list(module.named_parameters()), mesh
    decoder, mesh = _qwen.build(model, mesh_kind, world)
    return decoder.matrices(), mesh


def _groups(model: ModelConfig, named: Any) -> list[Any]:
    """Param groups: the structure model's splits and AdamW router; else one group."""
    if isinstance(model, _structure.StructureConfig):
        return _structure.param_groups(model, list(named))
    return list(named)


def _peer_params(model: ModelConfig, named: list[Any]) -> list[Any]:
    """What the other Muons get: the matrices (the structure model's router is AdamW's)."""
    if isinstance(model, _structure.StructureConfig):
        return _structure.matrices(named)
    return named


def model_mib(model: ModelConfig) -> float:
    """fp32 MiB of the matrices the optimizer updates."""
    if isinstance(model, _structure.StructureConfig):
        return model.mib()
    return _qwen.mib(model)


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
        self.first_s: float | None = None  # the first step: planning and calibration
        self.plan_versions: list[int] = []  # after the first step and after the last

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
        if self.canzona and index in (0, WARMUP + self.steps - 1):
            self.plan_versions.append(self.opt._runtime._plan_version)  # type: ignore[attr-defined]
        if index == 0:
            self.first_s = elapsed
        if index < WARMUP:
            return
        self.times.append(elapsed)
        if self.canzona:
            last = self.opt.last_step_stats  # type: ignore[attr-defined]
            stats = last.as_dict()
            stats["group_compute_s"] = list(last.group_compute_s)
            self.cpu.append(stats["compute_cpu_s"])
            self.stats.append(stats)

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        out: dict[str, Any] = {"times": self.times, "stats": self.stats, "cpu_compute": self.cpu}
        out["first_s"] = self.first_s
        if self.canzona:
            out["plan_versions"] = self.plan_versions
            runtime = self.opt._runtime  # type: ignore[attr-defined]
            out["calibration_s"] = runtime.calibration_s
            out["calibrations"] = runtime.calibrations
            out["repricings"] = runtime.repricings
            out["reprice_s"] = runtime.reprice_s
        return out


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
    named, mesh = _build(case.model, case.mesh, world)
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
            opt = factory(named if label in order else _peer_params(case.model, named), mesh)
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
    seconds = time.perf_counter() - began
    time_cost = measured_cost(reference_runner.opt)
    pinned = _structure.is_expert if isinstance(case.model, _structure.StructureConfig) else None
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
            if runner.canzona and rank == 0:
                result["plan"] = plan_facts(
                    runner.opt,
                    time_cost=time_cost,
                    optimizer=case.optimizer,
                    world=world,
                    pinned=pinned,
                )
        out[runner.label] = result
    meta: dict[str, Any] = {
        "seconds": seconds,
        "load": os.getloadavg(),
        "param_bytes": sum(_qwen.local(p).numel() * p.element_size() for p in params),
    }
    if rank == 0 and time_cost is not None:
        meta["cost_table"] = cost_table(time_cost)
    if pinned is not None:  # bytes sent for the expert stacks alone, measured per strategy
        meta["pinned_bytes_sent"] = _experts_only(case, named, pool[0])
    out["_meta"] = meta
    return out


def _experts_only(case: Case, named: list[Any], grads: list[torch.Tensor]) -> dict[str, int]:
    """``last_step_stats.bytes_sent`` of an optimizer holding only the expert stacks.

    One optimizer per strategy, two steps (the first plans, and calibrates under
    ``canzona``), on the stacks as the timed runs left them.
    """
    chosen = [(i, n, p) for i, (n, p) in enumerate(named) if _structure.is_expert(n)]
    make, hp = OPTIMIZERS[case.optimizer]
    out = {}
    for strategy in [s for s in case.strategies if s not in VARIANTS or s == "canzona"]:
        plan = canzona.PlanConfig(strategy=strategy, capacity_mb=case.capacity_mb)
        opt = make([(n, p) for _, n, p in chosen], **hp, plan=plan)
        for _ in range(2):
            for i, _, p in chosen:
                p.grad = grads[i].clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[strategy] = opt.last_step_stats.bytes_sent
    return out


def single_body(rank: int, world: int, case: Case) -> dict[str, Any]:
    """The same optimizer on the unsharded model in one process: the redundancy denominator."""
    _quiet()
    named, _ = _build(case.model, "none", 1)
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
