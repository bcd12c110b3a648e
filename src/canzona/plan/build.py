"""The plan: configuration, owners and micro-groups together, self-validating and hashable."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from canzona.plan.assign import STRATEGIES, Assignment, assign_owners
from canzona.plan.cost import CostModel, cost_model_params, resolve_cost_model
from canzona.plan.micro_groups import MicroGroup, micro_groups
from canzona.plan.spec import MatrixSpec, check_specs

__all__ = ["DIGEST_FORMAT", "MIB", "Plan", "PlanConfig", "build_plan"]

#: Version of the canonical encoding hashed by :meth:`Plan.digest`.
DIGEST_FORMAT = 2
#: Bytes in one mebibyte (``capacity_mb`` is in mebibytes).
MIB = 1 << 20
#: What a plan balances: measured seconds, or closed-form FLOPs.
COSTS = ("measured", "flops")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """How a plan is built.

    Attributes:
        strategy: Owner-assignment strategy, one of ``STRATEGIES``.
        alpha: Weight of compute against communication in the ``canzona`` cost, in [0, 1].
        capacity_mb: Bytes in flight allowed per rank and micro-group, in mebibytes.
        refine: Run the local searches after the greedy assignment (the refinement, and the
            consolidation of calls where costs are measured).
        replica_dedup: Read by the runtime: over ``Replicate`` mesh dimensions, compute each
            matrix once and broadcast (True) or once per replica group (False).
        cost: Read by the runtime: ``"measured"`` times the owner math on the device at the
            first step and balances seconds (the ``canzona`` strategy of a distributed job);
            ``"flops"`` balances the closed-form FLOP counts.
    """

    strategy: str = "canzona"
    alpha: float = 1.0
    capacity_mb: float = 512.0
    refine: bool = True
    replica_dedup: bool = True
    cost: str = "measured"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
        cap = self.capacity_mb
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap < math.inf:
            raise ValueError(f"capacity_mb must be a positive finite number, got {cap!r}")
        try:  # 1e308 MiB, 10**400: bytes past a float's range
            finite = float(cap) * MIB < math.inf
        except OverflowError:
            finite = False
        if not finite:
            raise ValueError(f"capacity_mb must be a positive finite number of bytes, got {cap!r}")
        if not isinstance(self.refine, bool):
            raise ValueError(f"refine must be a bool, got {self.refine!r}")
        if not isinstance(self.replica_dedup, bool):
            raise ValueError(f"replica_dedup must be a bool, got {self.replica_dedup!r}")
        if self.cost not in COSTS:
            raise ValueError(f"cost must be one of {COSTS}, got {self.cost!r}")
        object.__setattr__(self, "alpha", float(alpha) + 0.0)  # -0.0 is 0.0 (one digest)
        object.__setattr__(self, "capacity_mb", float(cap))

    @property
    def capacity_bytes(self) -> int:
        """``capacity_mb`` in bytes (at least 1)."""
        return max(1, int(self.capacity_mb * MIB))


DEFAULT_CONFIG = PlanConfig()


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Owners and micro-groups of a set of matrices over ``num_ranks`` ranks.

    Built by :func:`build_plan`; checks on construction that every matrix sits in exactly one
    micro-group and that every owner is in range, eligible and agrees with the groups.

    Attributes:
        specs: The matrices, in input order.
        num_ranks: Number of ranks.
        config: How the plan was built.
        optimizer: The cost model (name and parameters) the loads are measured with.
        assignment: Owner of every matrix and per-rank loads.
        micro_groups: The micro-groups in schedule order.
    """

    specs: tuple[MatrixSpec, ...]
    num_ranks: int
    config: PlanConfig
    optimizer: CostModel
    assignment: Assignment
    micro_groups: tuple[MicroGroup, ...]
    _index: dict[str, MatrixSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "micro_groups", tuple(self.micro_groups))
        check_specs(self.specs, self.num_ranks)
        object.__setattr__(self, "_index", {s.name: s for s in self.specs})
        a = self.assignment
        if a.num_ranks != self.num_ranks or a.strategy != self.config.strategy:
            raise ValueError(
                f"assignment ({a.strategy!r} over {a.num_ranks} ranks) does not match the plan "
                f"({self.config.strategy!r} over {self.num_ranks} ranks)"
            )
        if set(a.owner) != set(self._index):
            raise ValueError("assignment and specs cover different matrices")
        for spec in self.specs:
            owner = a.owner[spec.name]
            if spec.ranks is not None and owner not in spec.ranks:
                raise ValueError(f"owner of {spec.name!r} is not eligible, got {owner!r}")
        seen: set[str] = set()
        for expected, group in enumerate(self.micro_groups):
            if group.index != expected:
                raise ValueError(f"group {expected} carries index {group.index!r}")
            for name, owner in zip(group.names, group.owners, strict=True):
                if name in seen or name not in self._index:
                    raise ValueError(f"matrix {name!r} is repeated or unknown in the groups")
                if owner != a.owner[name]:
                    raise ValueError(f"group owner of {name!r} differs from the assignment")
                seen.add(name)
        if len(seen) != len(self.specs):
            missing = sorted(set(self._index) - seen)[:3]
            raise ValueError(f"matrices missing from the micro-groups, e.g. {missing!r}")

    def owner(self, name: str) -> int:
        """The owner rank of matrix ``name``."""
        return self.assignment.owner[name]

    def spec(self, name: str) -> MatrixSpec:
        """The spec of matrix ``name``."""
        return self._index[name]

    def canonical(self) -> dict[str, Any]:
        """The JSON-ready description that :meth:`digest` hashes.

        Rank sets (eligible ranks, holders) are listed once, in first-use order, and specs
        refer to them by index: thousands of matrices share a few sets of hundreds of ranks.
        """
        cfg = self.config
        sets: dict[tuple[int, ...], int] = {}

        def ref(ranks: tuple[int, ...] | None) -> int | None:
            return None if ranks is None else sets.setdefault(ranks, len(sets))

        specs = [
            [
                s.name,
                list(s.shape),
                s.itemsize,
                ref(s.ranks),
                *([] if s.cost_key is None else [s.cost_key]),
                *([] if s.holders is None else [["holders", ref(s.holders), s.pinned]]),
            ]
            for s in self.specs
        ]
        return {
            "format": DIGEST_FORMAT,
            "num_ranks": self.num_ranks,
            "config": {
                "strategy": cfg.strategy,
                "alpha": cfg.alpha,
                "capacity_mb": cfg.capacity_mb,
                "refine": cfg.refine,
                "replica_dedup": cfg.replica_dedup,
                "cost": cfg.cost,
            },
            "optimizer": {
                "name": self.optimizer.name,
                "params": cost_model_params(self.optimizer),
            },
            "specs": specs,
            "rank_sets": [list(ranks) for ranks in sets],
            "owners": [self.assignment.owner[s.name] for s in self.specs],
            "groups": [list(g.names) for g in self.micro_groups],
        }

    def digest(self) -> str:
        """SHA-256 (hex) of the canonical JSON encoding of the plan.

        Covers a format version, the number of ranks, the configuration, the cost model, every
        spec in input order, every owner and every group's matrices, so it is identical in
        every process for the same inputs and differs when any of them differs. Ranks compare
        it before their first collective.
        """
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    def summary(self) -> dict[str, Any]:
        """Headline numbers of the plan.

        ``group_makespan`` is the sum over groups of the largest per-rank load: the time a
        pipeline that synchronises after every group would take (in FLOPs).
        """
        a = self.assignment
        return {
            "strategy": a.strategy,
            "optimizer": self.optimizer.name,
            "num_ranks": self.num_ranks,
            "matrices": len(self.specs),
            "balance_ratio": a.balance_ratio,
            "makespan": a.makespan,
            "lower_bound": a.lower_bound,
            "makespan_ratio": a.makespan_ratio,
            "max_comm_bytes": max(a.comm_bytes, default=0),
            "comm_balance_ratio": a.comm_balance_ratio,
            "micro_groups": len(self.micro_groups),
            "group_makespan": math.fsum(max(g.rank_loads, default=0.0) for g in self.micro_groups),
        }


def build_plan(
    specs: Sequence[MatrixSpec],
    num_ranks: int,
    config: PlanConfig = DEFAULT_CONFIG,
    *,
    optimizer: str | CostModel = "muon",
) -> Plan:
    """Assign owners and form micro-groups.

    Args:
        specs: The matrices; names must be unique.
        num_ranks: Number of ranks.
        config: Strategy, blend, capacity and refinement settings.
        optimizer: A cost model or the name of a built-in one.

    Returns:
        The validated plan.

    Raises:
        ValueError: On invalid specs, configuration or optimizer.
    """
    if not isinstance(config, PlanConfig):
        raise ValueError(f"config must be a PlanConfig, got {config!r}")
    model = resolve_cost_model(optimizer)
    specs = tuple(specs)
    assignment = assign_owners(
        specs,
        num_ranks,
        strategy=config.strategy,
        optimizer=model,
        alpha=config.alpha,
        refine=config.refine,
        capacity_bytes=config.capacity_bytes,
    )
    groups = micro_groups(specs, assignment, capacity_bytes=config.capacity_bytes, optimizer=model)
    return Plan(
        specs=specs,
        num_ranks=num_ranks,
        config=config,
        optimizer=model,
        assignment=assignment,
        micro_groups=tuple(groups),
    )
