"""What a canzona optimizer planned, read on a rank: owners priced in measured seconds and FLOPs.

The step-latency benchmark predicts each rank's owner time from the measured cost model of
its ``canzona`` run (``PlanConfig(cost="measured")``: ``opt._runtime.plan.optimizer`` is a
``GroupedCost`` of ``MeasuredCost``, one per param group), for the plan of *every*
strategy: a rank's prediction is the sum, over the batches it computes (per micro-group,
param group and shape, as the runtime stacks them), of the measured seconds of one call on
that many matrices (``predict_seconds``; transfer time left out: the measured ``compute_s``
does not contain it). The same plans priced in the optimizer's closed-form
FLOPs give the *planned makespan / lower bound* of the strategy tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from canzona.plan import GroupedCost, MatrixSpec, cost_model
from canzona.plan.assign import lower_bound, pinned_ranks
from canzona.plan.measured import MeasuredCost, predict_seconds


def measured_cost(opt: torch.optim.Optimizer) -> GroupedCost | None:
    """The measured cost model a ``canzona`` plan was built with (None when it used FLOPs)."""
    runtime = getattr(opt, "_runtime", None)
    plan = getattr(runtime, "plan", None)
    cost = getattr(plan, "optimizer", None)
    if isinstance(cost, GroupedCost) and all(
        isinstance(m, MeasuredCost) for m in cost.models.values()
    ):
        return cost
    return None


def cost_table(cost: GroupedCost) -> dict[str, Any]:
    """The measured table, per param group: ``[[m, n, seconds], ...]``, fit, transfer rate."""
    out = {}
    for key, model in sorted(cost.models.items()):
        assert isinstance(model, MeasuredCost)
        out[key] = {k: v for k, v in model.params().items() if k != "base"}
    return out


def _closed_form(opt: torch.optim.Optimizer, optimizer: str) -> Any:
    """The optimizer's closed-form cost model, from its param groups' hyper-parameters."""
    table = getattr(opt, "_table", None)
    cost = getattr(table, "cost", None)
    return cost if cost is not None else cost_model(optimizer)


def _own_seconds(cost: GroupedCost, key: str | None, m: int, n: int) -> float:
    """One ``m x n`` matrix's own part of a stacked call (its line's price per matrix).

    The call's fixed part is left out (without a batch line: its time alone). What the
    matrix adds to any call it joins is at least this, so a bound built on it bounds the
    stacked predictions too.
    """
    model = cost.models.get(key) if key is not None else next(iter(cost.models.values()))
    if not isinstance(model, MeasuredCost):
        return math.nan
    line = model._lines.get((m, n))
    return model.seconds(m, n) if line is None else line[1]


def _group_factor(loads: list[list[float]]) -> float:
    """Sum over micro-groups of the busiest rank's load, over the busiest rank's total."""
    if not loads:
        return 1.0
    totals = [math.fsum(x) for x in zip(*loads, strict=True)]
    busiest = max(totals)
    return math.fsum(max(g) for g in loads) / busiest if busiest else 1.0


def plan_facts(
    opt: torch.optim.Optimizer,
    *,
    time_cost: GroupedCost | None,
    optimizer: str,
    world: int,
    pinned: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Owner load per rank of ``opt``'s plan, in measured seconds and in FLOPs.

    Args:
        opt: A canzona optimizer after at least one step.
        time_cost: The measured cost model of the case's ``canzona`` run (None: no prediction).
        optimizer: The optimizer's cost-model name (a fallback for the closed form).
        world: Number of ranks.
        pinned: Selects plan items (e.g. experts) whose bytes moved are reported per rank.

    Returns:
        A JSON-friendly dict: ``plan_version``, ``calibration_s``, ``micro_groups``,
        ``makespan_ratio_flops``; with ``time_cost`` also ``predicted_s`` (per rank),
        ``lower_bound_s`` (of the matrices' own parts of their calls, fixed parts left out:
        no plan's stacked prediction goes below it), ``makespan_ratio_time`` and
        ``group_factor`` (per-group imbalance in predicted seconds); with ``pinned`` the
        ``pinned_bytes_sent`` per rank.
    """
    runtime = opt._runtime  # type: ignore[attr-defined]
    facts: dict[str, Any] = {
        "plan_version": runtime._plan_version,
        "calibration_s": runtime.calibration_s,
    }
    plan = runtime.plan
    if plan is None:
        return facts
    a = plan.assignment
    flops_model = _closed_form(opt, optimizer)
    specs: list[MatrixSpec] = list(plan.specs)
    ranks = {s.name: a.computing_ranks(s.name) for s in specs}
    flops = {s.name: flops_model.flops(s) for s in specs}
    flops_load = [0.0] * world
    for s in specs:
        for r in ranks[s.name]:
            flops_load[r] += flops[s.name]
    facts["micro_groups"] = len(plan.micro_groups)
    pins = pinned_ranks(specs)
    bound = lower_bound(list(flops.values()), world, pins)
    facts["makespan_ratio_flops"] = max(flops_load) / bound if bound else 1.0
    if time_cost is not None:
        secs = {s.name: s.batch * _own_seconds(time_cost, s.cost_key, s.m, s.n) for s in specs}
        rounds = [g.names for g in plan.micro_groups]
        predicted = predict_seconds(specs, rounds, lambda n: ranks[n], time_cost, world)
        costs, where = list(secs.values()), list(pins)
        local: dict[tuple[int, str, int, int], int] = {}
        for it in runtime.items:  # matrices a single rank holds and updates: never planned
            if it.is_local:
                key = str(opt._table.row(it.param).batch_key)  # type: ignore[attr-defined]
                costs.append(_own_seconds(time_cost, key, it.m, it.n))
                where.append(it.unit[0])
                at = (it.unit[0], key, it.m, it.n)
                local[at] = local.get(at, 0) + 1
        for (rank, key, m, n), k in local.items():  # one stacked call per group and shape
            model = time_cost.models[key]
            assert isinstance(model, MeasuredCost)
            predicted[rank] += model.batch_seconds(m, n, k)
        bound_s = lower_bound(costs, world, where)
        groups = [
            predict_seconds(specs, [names], lambda n: ranks[n], time_cost, world)
            for names in rounds
        ]
        facts.update(
            predicted_s=predicted,
            lower_bound_s=bound_s,
            makespan_ratio_time=max(predicted) / bound_s if bound_s else 1.0,
            group_factor=_group_factor(groups),
        )
    if pinned is not None:
        facts["pinned_bytes_sent"] = pinned_bytes(specs, ranks, world, pinned, a.replicated)
    return facts


def pinned_bytes(
    specs: list[MatrixSpec],
    ranks: dict[str, tuple[int, ...]],
    world: int,
    selected: Callable[[str], bool],
    replicated: bool,
) -> list[int]:
    """Bytes each rank sends for the selected matrices, derived from the plan.

    A matrix held whole by some ranks (``MatrixSpec.holders``) travels from its holder to
    every computing rank that does not hold it (the gather) and, unless every computing rank
    keeps its own result (``replicated``), back from that rank to the holders (the scatter).
    """
    sent = [0] * world
    for s in specs:
        if not selected(s.name) or s.holders is None:
            continue
        holder = s.holders[0]
        for r in ranks[s.name]:
            if r in s.holders:
                continue
            sent[holder] += s.nbytes
            if not replicated:
                sent[r] += s.nbytes * len(s.holders)
    return sent
