"""Pure-Python planning: matrix specs, cost models, owner assignment, micro-groups, digest.

Nothing in this package imports torch, so a plan can be built, inspected and compared in
any process (for example by the ``canzona plan`` command) before a device is touched.
"""

from __future__ import annotations

from canzona.plan.assign import STRATEGIES, Assignment, assign_owners, lower_bound
from canzona.plan.build import MIB, Plan, PlanConfig, build_plan
from canzona.plan.cost import (
    COST_MODELS,
    AdamWCost,
    CostModel,
    GroupedCost,
    MuonCost,
    ShampooCost,
    SoapCost,
    cost_model,
)
from canzona.plan.micro_groups import MicroGroup, micro_groups
from canzona.plan.spec import MatrixSpec
from canzona.plan.split import Split

__all__ = [
    "COST_MODELS",
    "MIB",
    "STRATEGIES",
    "AdamWCost",
    "Assignment",
    "CostModel",
    "GroupedCost",
    "MatrixSpec",
    "MicroGroup",
    "MuonCost",
    "Plan",
    "PlanConfig",
    "ShampooCost",
    "SoapCost",
    "Split",
    "assign_owners",
    "build_plan",
    "cost_model",
    "lower_bound",
    "micro_groups",
]
