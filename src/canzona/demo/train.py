"""One rank's share of the demo: train with canzona, then with AdamW; time two plans."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

import canzona
from canzona.demo.data import Corpus, shard_rows
from canzona.demo.model import DecoderConfig, QwenDecoder, parallelize
from canzona.plan import GroupedCost, Plan
from canzona.plan.measured import MeasuredCost, predict_seconds
from canzona.updates import NS_SCHEDULES

__all__ = [
    "OPTIMIZERS",
    "DemoSettings",
    "RunResult",
    "demo_rank",
    "describe",
    "mesh_for",
    "run_demo",
]

#: Matrix optimizers the demo trains with, and their canzona classes.
CLASS_NAMES = {"muon": "Muon", "normuon": "NorMuon", "shampoo": "Shampoo", "soap": "SOAP"}
OPTIMIZERS = tuple(CLASS_NAMES)
#: Optimizers that take ``ns_coefficients`` (``--ns-coefficients``).
NEWTON_SCHULZ = ("muon", "normuon")

#: (matrix lr, AdamW lr of embedding/head/norms) per optimizer, from sweeps on this model and
#: corpus (80 and 100 steps, batch 16x64, seeds 0 and 1; one process, whose trajectory the
#: sharded layouts reproduce): Muon lr in {0.01, 0.02, 0.04, 0.06, 0.08}, Shampoo and SOAP lr
#: in {3e-3, 6e-3, 1e-2}. Weight decay is off in every run (short runs; same for all). NorMuon
#: runs in its authors' convention (``rescale="preserve_norm"``, ``adjust_lr_fn="original"``:
#: steps of Muon's size), so it takes Muon's learning rates.
LEARNING_RATES: dict[str, tuple[float, float]] = {
    "muon": (0.04, 6e-3),
    "normuon": (0.04, 6e-3),
    "shampoo": (6e-3, 6e-3),
    "soap": (1e-2, 6e-3),
}
#: Learning rate of the AdamW-only baseline, from {1e-3, 3e-3, 6e-3, 1e-2}: best at 100 steps,
#: within 0.005 nats/byte of the best (1e-2) at 80 steps.
BASELINE_LR = 6e-3
WARMUP_FRACTION = 0.1

Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, kw_only=True, slots=True)
class DemoSettings:
    """What the demo runs.

    Attributes:
        steps: Training steps of each run.
        world: Ranks: 1 (one process), 2 (FSDP) or 4 (FSDP×TP on a 2×2 mesh).
        optimizer: ``"muon"``, ``"normuon"``, ``"shampoo"`` or ``"soap"``.
        ns_coefficients: A registered Newton–Schulz coefficient set for ``"muon"`` and
            ``"normuon"`` (e.g. ``"polar_express"``); None keeps the optimizer's default.
        seed: Model initialisation and batch order.
        batch_size: Global batch (sequences), split over the data-parallel ranks.
        seq_len: Bytes per sequence.
        model: The decoder's shape.
        baseline: Also train the AdamW-only baseline.
        timing_steps: Optimizer steps timed per plan strategy (0, or one rank: no timing).
        corpus_bytes: Size of the generated corpus.
    """

    steps: int = 80
    world: int = 4
    optimizer: str = "muon"
    ns_coefficients: str | None = None
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 64
    model: DecoderConfig = field(default_factory=DecoderConfig)
    baseline: bool = True
    timing_steps: int = 6
    corpus_bytes: int = 400_000

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if self.world not in (1, 2, 4):
            raise ValueError(f"world must be 1, 2 or 4, got {self.world!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.ns_coefficients is not None:
            if self.optimizer not in NEWTON_SCHULZ:
                raise ValueError(
                    f"ns_coefficients applies to {' and '.join(NEWTON_SCHULZ)}, not "
                    f"{self.optimizer!r}"
                )
            if self.ns_coefficients not in NS_SCHEDULES:
                raise ValueError(
                    f"ns_coefficients must be one of {sorted(NS_SCHEDULES)}, "
                    f"got {self.ns_coefficients!r}"
                )
        if self.batch_size % self.data_parallel:
            raise ValueError(
                f"batch_size {self.batch_size} must split over {self.data_parallel} ranks"
            )
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds max_seq_len {self.model.max_seq_len}")
        if self.timing_steps < 0:
            raise ValueError(f"timing_steps must be >= 0, got {self.timing_steps!r}")

    @property
    def data_parallel(self) -> int:
        """Data-parallel degree (world 4 uses 2 ranks for tensor parallel)."""
        return 2 if self.world == 4 else self.world


@dataclass(kw_only=True, slots=True)
class RunResult:
    """One training run, as rank 0 saw it (losses are global means)."""

    label: str
    losses: list[float]
    eval_start: float
    eval_end: float
    step_s: list[float]
    optimizer_s: list[float]


def mesh_for(world: int) -> Any:
    """The demo's mesh: ``None`` on one process, ``(2,)`` for FSDP, ``(2, 2)`` for FSDP×TP."""
    from torch.distributed.device_mesh import init_device_mesh

    if world == 1:
        return None
    if world == 2:
        return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _build_model(settings: DemoSettings, mesh: Any) -> QwenDecoder:
    torch.manual_seed(settings.seed)
    model = QwenDecoder(settings.model)
    return model if mesh is None else parallelize(model, mesh)


def make_optimizer(
    model: nn.Module,
    name: str,
    *,
    strategy: str = "canzona",
    ns_coefficients: str | None = None,
) -> canzona.optim.MatrixOptimizer:
    """The demo's canzona optimizer: matrices with ``name``, embedding/head/norms with AdamW."""
    lr, adamw_lr = LEARNING_RATES[name]
    groups = canzona.param_groups(model, lr=lr, adamw={"lr": adamw_lr, "weight_decay": 0.0})
    plan = canzona.PlanConfig(strategy=strategy)
    if name in NEWTON_SCHULZ:
        kw: dict[str, Any] = {"weight_decay": 0.0, "ns_dtype": torch.float32, "plan": plan}
        if ns_coefficients is not None:
            kw["ns_coefficients"] = ns_coefficients
        if name == "normuon":
            return canzona.NorMuon(
                groups, lr=lr, rescale="preserve_norm", adjust_lr_fn="original", **kw
            )
        return canzona.Muon(groups, lr=lr, **kw)
    if name == "shampoo":
        return canzona.Shampoo(
            groups, lr=lr, precondition_frequency=10, start_preconditioning_step=10, plan=plan
        )
    return canzona.SOAP(groups, lr=lr, weight_decay=0.0, plan=plan)


def _schedule(steps: int) -> Callable[[int], float]:
    warmup = max(1, round(WARMUP_FRACTION * steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _mean(value: torch.Tensor, world: int) -> float:
    """Mean of a scalar over all ranks (tensor-parallel peers hold equal values)."""
    value = value.detach().clone()
    if world > 1:
        dist.all_reduce(value)
        value /= world
    return float(value)


class _Trainer:
    """Batches, losses and the step loop shared by every run of one rank."""

    def __init__(self, settings: DemoSettings, corpus: Corpus, report: Report | None) -> None:
        self.s = settings
        self.corpus = corpus
        self.report = report
        self.rank = dist.get_rank() if settings.world > 1 else 0
        self.dp_rank = self.rank // (settings.world // settings.data_parallel)

    def local(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return tuple(shard_rows(t, self.dp_rank, self.s.data_parallel) for t in batch)

    def eval_loss(self, model: nn.Module) -> float:
        x, y = self.local(self.corpus.eval_batch(4 * self.s.batch_size, self.s.seq_len))
        with torch.no_grad():
            return _mean(model(x, y), self.s.world)

    def train(self, label: str, model: nn.Module, opt: Optimizer) -> RunResult:
        """Train ``model`` for ``settings.steps`` steps; rank 0 reports progress."""
        s = self.s
        sched = LambdaLR(opt, _schedule(s.steps))
        result = RunResult(
            label=label,
            losses=[],
            eval_start=self.eval_loss(model),
            eval_end=0.0,
            step_s=[],
            optimizer_s=[],
        )
        for step in range(s.steps):
            began = time.perf_counter()
            x, y = self.local(self.corpus.batch(step, s.batch_size, s.seq_len, s.seed))
            loss = model(x, y)
            loss.backward()
            opt_began = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            done = time.perf_counter()
            result.losses.append(_mean(loss, s.world))
            result.step_s.append(done - began)
            result.optimizer_s.append(done - opt_began)
            if self.report is not None and self.rank == 0:
                self.report(
                    {
                        "run": label,
                        "step": step + 1,
                        "steps": s.steps,
                        "loss": result.losses[-1],
                        "step_s": statistics.fmean(result.step_s),
                    }
                )
        result.eval_end = self.eval_loss(model)
        return result


def planned_owner_seconds(plan: Plan) -> list[float] | None:
    """Per rank, the owner time the plan predicts with its measured costs, calls priced.

    None for a plan balanced on FLOPs. This is what a measured plan balances: same-shape
    matrices gathered on fewer owners make fewer calls, so FLOP-style loads priced per matrix
    can look uneven where the predicted times are even.
    """
    cost = plan.optimizer
    models = cost.models.values() if isinstance(cost, GroupedCost) else [cost]
    if not isinstance(cost, GroupedCost | MeasuredCost) or not all(
        isinstance(m, MeasuredCost) for m in models
    ):
        return None
    groups = [g.names for g in plan.micro_groups]
    ranks = plan.assignment.computing_ranks
    return predict_seconds(plan.specs, groups, ranks, cost, plan.num_ranks)


def time_strategies(trainer: _Trainer, model: nn.Module, name: str) -> dict[str, Any]:
    """Median optimizer-step time (slowest rank) under the ``canzona`` and ``replicated`` plans.

    One set of gradients is kept; each strategy gets a fresh optimizer (lr 0, so the
    trained weights stay as they are) that steps on it ``timing_steps`` times after one
    warm-up step (which builds the plan and the state).
    """
    s = trainer.s
    x, y = trainer.local(trainer.corpus.batch(s.steps, s.batch_size, s.seq_len, s.seed))
    model(x, y).backward()
    out: dict[str, Any] = {}
    for strategy in ("canzona", "replicated"):
        opt = make_optimizer(model, name, strategy=strategy, ns_coefficients=s.ns_coefficients)
        for group in opt.param_groups:
            group["lr"] = 0.0
        opt.step()
        times, compute = [], []
        for _ in range(s.timing_steps):
            dist.barrier()
            began = time.perf_counter()
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - began)
            stats = opt.last_step_stats
            compute.append(stats.compute_s if stats is not None else 0.0)
        out[strategy] = {
            "step_s": _max(statistics.median(times)),
            "compute_s": _max(statistics.median(compute)),
        }
    model.zero_grad(set_to_none=True)
    return out


def _max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def demo_rank(
    settings: DemoSettings, report: Report | None = None, corpus: Corpus | None = None
) -> dict[str, Any]:
    """Everything one rank does; call it on every rank (the process group already exists).

    Args:
        settings: The demo's settings.
        report: Called on rank 0 after each training step with the run's label, step,
            loss and mean step time so far.
        corpus: The corpus (generated here when not given; a parent can generate it once
            before forking the ranks).

    Returns:
        The runs (``"canzona"`` and, with ``baseline``, ``"adamw"``) and the plan timings.
    """
    mesh = mesh_for(settings.world)
    if corpus is None:
        corpus = Corpus(settings.corpus_bytes)
    trainer = _Trainer(settings, corpus, report)
    model = _build_model(settings, mesh)
    opt = make_optimizer(model, settings.optimizer, ns_coefficients=settings.ns_coefficients)
    runs = {"canzona": trainer.train(f"canzona.{CLASS_NAMES[settings.optimizer]}", model, opt)}
    plan = opt._runtime.plan
    summary = plan.summary() if plan is not None else {}
    if plan is not None:
        summary["owner_s"] = planned_owner_seconds(plan)
    timed = settings.timing_steps > 0 and settings.world > 1
    timings = time_strategies(trainer, model, settings.optimizer) if timed else {}
    del opt, model
    if settings.baseline:
        model = _build_model(settings, mesh)
        adamw = torch.optim.AdamW(
            model.parameters(), lr=BASELINE_LR, betas=(0.9, 0.95), weight_decay=0.0
        )
        runs["adamw"] = trainer.train("AdamW only", model, adamw)
    return {"runs": runs, "plan": summary, "timings": timings}


def describe(settings: DemoSettings, layout: str) -> str:
    """One line naming the model, the mesh and the budget."""
    cfg = settings.model
    with torch.device("meta"):
        params = sum(p.numel() for p in QwenDecoder(cfg).parameters())
    ours = f"canzona.{CLASS_NAMES[settings.optimizer]}"
    if settings.ns_coefficients:
        ours += f" ({settings.ns_coefficients})"
    return (
        f"canzona demo: Qwen3-style decoder ({cfg.n_layers} layers, dim {cfg.dim}, "
        f"{cfg.n_heads} q / {cfg.n_kv_heads} kv heads, byte vocab, {params / 1e6:.2f}M params) "
        f"on {settings.world} CPU rank(s), {layout}; {ours} vs AdamW, "
        f"{settings.steps} steps of {settings.batch_size}x{settings.seq_len} bytes"
    )


def run_demo(settings: DemoSettings, on_progress: Report) -> dict[str, Any]:
    """Run the demo on ``settings.world`` ranks (forked, gloo) or in this process.

    Returns:
        Rank 0's result of :func:`demo_rank`.

    Raises:
        RankFailure: If a rank fails.
    """
    from canzona.launch import run_ranks

    corpus = Corpus(settings.corpus_bytes)  # once, inherited by the forked ranks
    if settings.world == 1:
        return demo_rank(settings, on_progress, corpus)
    results = run_ranks(
        settings.world, lambda progress: demo_rank(settings, progress, corpus), on_progress
    )
    return dict(results[0])
