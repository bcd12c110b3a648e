"""PlanConfig, Plan validation, digest stability across processes, summary."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

import canzona
from canzona.plan import (
    MIB,
    GroupedCost,
    MatrixSpec,
    Plan,
    PlanConfig,
    assign_owners,
    build_plan,
    cost_model,
    micro_groups,
)
from canzona.plan.models import model_specs
from canzona.plan.spec import Ranks

from _plan_strategies import instances

SRC = Path(canzona.__file__).resolve().parents[1]

DIGEST_SCRIPT = """
from canzona.plan import MatrixSpec, PlanConfig, build_plan
from canzona.plan.models import model_specs
specs = model_specs("qwen3-8b", split="heads")
specs += [MatrixSpec(f"r{i}", (64, 32 + i), ranks=(1, 5, 9)) for i in range(20)]
specs += [MatrixSpec("stack", (4, 256, 128), itemsize=2)]
plan = build_plan(specs, 24, PlanConfig(alpha=0.7, capacity_mb=96), optimizer="soap")
print(plan.digest())
"""


def _digest_in_process() -> str:
    namespace: dict[str, object] = {}
    code = DIGEST_SCRIPT.replace("print(plan.digest())", "result = plan.digest()")
    exec(code, namespace)
    return str(namespace["result"])


def test_digest_is_identical_across_processes() -> None:
    expected = _digest_in_process()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
        out = subprocess.run(
            [sys.executable, "-c", DIGEST_SCRIPT],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert out.stdout.strip() == expected
    assert len(expected) == 64 and int(expected, 16) >= 0


def _small() -> tuple[list[MatrixSpec], Plan]:
    specs = [MatrixSpec(f"w{i}", (32 * (1 + i % 3), 64)) for i in range(12)]
    return specs, build_plan(specs, 4, PlanConfig(capacity_mb=16 / 1024))


def test_digest_changes_with_owner_shape_group_and_config() -> None:
    specs, plan = _small()
    assert build_plan(specs, 4, plan.config).digest() == plan.digest()
    a = plan.assignment
    moved = dict(a.owner)
    moved["w0"] = (moved["w0"] + 1) % 4
    other = dataclasses.replace(a, owner=moved)
    cap = plan.config.capacity_bytes
    regrouped = micro_groups(specs, other, capacity_bytes=cap)
    changed_owner = Plan(
        specs=specs,
        num_ranks=4,
        config=plan.config,
        optimizer=plan.optimizer,
        assignment=other,
        micro_groups=tuple(regrouped),
    )
    assert changed_owner.digest() != plan.digest()

    reshaped = [MatrixSpec("w0", (32, 65)), *specs[1:]]
    assert build_plan(reshaped, 4, plan.config).digest() != plan.digest()

    coarse = micro_groups(specs, a, capacity_bytes=1 << 30)
    assert len(coarse) != len(plan.micro_groups)
    changed_groups = dataclasses.replace(plan, micro_groups=tuple(coarse))
    assert changed_groups.digest() != plan.digest()

    assert build_plan(specs, 4, dataclasses.replace(plan.config, alpha=0.5)).digest() != (
        plan.digest()
    )
    assert build_plan(specs, 4, plan.config, optimizer="soap").digest() != plan.digest()
    assert build_plan(specs, 4, plan.config, optimizer=cost_model("muon", ns_steps=3)).digest() != (
        plan.digest()
    )


def test_digest_covers_every_spec_field_and_config_entry_even_with_the_same_owners() -> None:
    """Catches: a spec field or config entry left out of the digest. Each variant keeps the
    owners and groups of the base plan, so only the field itself can tell the digests apart
    (ranks planning with different payload sizes, cost keys, eligibility or pinning would
    exchange mismatched buffers)."""
    grouped = GroupedCost({"a": cost_model("muon"), "b": cost_model("muon")})
    base_spec = MatrixSpec("w", (8, 8), 4, (0, 1), "a", (0,), False)
    variants = [
        MatrixSpec("w", (8, 8), 2, (0, 1), "a", (0,), False),  # itemsize
        MatrixSpec("w", (8, 8), 4, None, "a", (0,), False),  # eligible ranks
        MatrixSpec("w", (8, 8), 4, (0, 1), "b", (0,), False),  # cost key
        MatrixSpec("w", (8, 8), 4, (0, 1), "a", (0,), True),  # pinned
        MatrixSpec("w", (8, 8), 4, (0, 1), "a", None, False),  # holders
    ]
    base = build_plan([base_spec], 2, PlanConfig(), optimizer=grouped)
    digests = {base.digest()}
    for spec in variants:
        plan = build_plan([spec], 2, PlanConfig(), optimizer=grouped)
        assert plan.assignment.owner == base.assignment.owner
        digests.add(plan.digest())
    for change in ({"replica_dedup": False}, {"cost": "flops"}, {"refine": False}):
        plan = build_plan([base_spec], 2, PlanConfig(**change), optimizer=grouped)
        assert plan.assignment.owner == base.assignment.owner
        digests.add(plan.digest())
    assert len(digests) == 1 + len(variants) + 3


def test_digest_tells_apart_which_rank_set_a_spec_names() -> None:
    """Catches: rank sets written once and named by index, with the sets or the index left
    out of the digest. Each variant keeps the plan's owners and groups and differs from the
    base only in which eligible or holding ranks one spec names."""
    base_specs = [
        MatrixSpec("a", (8, 8), 4, (0, 1, 2, 3)),
        MatrixSpec("b", (8, 8), 4, (0, 1), holders=(0,)),
        MatrixSpec("c", (8, 8), 4, (2, 3), holders=(2,)),
    ]
    base = build_plan(base_specs, 4, PlanConfig())
    variants = [
        [base_specs[0], dataclasses.replace(base_specs[1], ranks=(0, 1, 2, 3)), base_specs[2]],
        [base_specs[0], base_specs[1], dataclasses.replace(base_specs[2], holders=(3,))],
        [base_specs[0], dataclasses.replace(base_specs[1], holders=(0, 1)), base_specs[2]],
        [dataclasses.replace(base_specs[0], ranks=(0, 1, 2)), *base_specs[1:]],
    ]
    digests = {base.digest()}
    for specs in variants:
        digests.add(dataclasses.replace(base, specs=specs).digest())
    assert len(digests) == 1 + len(variants)
    sets = base.canonical()["rank_sets"]
    assert sets == [[0, 1, 2, 3], [0, 1], [0], [2, 3], [2]]  # each set once, first use first


@settings(max_examples=40, deadline=None)
@given(instances())
def test_plan_is_consistent(inst: tuple[list[MatrixSpec], int]) -> None:
    specs, p = inst
    plan = build_plan(specs, p, PlanConfig(capacity_mb=0.01))
    for s in specs:
        assert plan.owner(s.name) == plan.assignment.owner[s.name]
        assert plan.spec(s.name) is s
    summary = plan.summary()
    assert summary["micro_groups"] == len(plan.micro_groups)
    assert summary["group_makespan"] >= summary["makespan"] * (1 - 1e-12)
    assert summary["makespan"] >= summary["lower_bound"] * (1 - 1e-12)
    reversed_plan = build_plan(specs[::-1], p, PlanConfig(capacity_mb=0.01))
    assert dict(reversed_plan.assignment.owner) == dict(plan.assignment.owner)
    assert reversed_plan.micro_groups == plan.micro_groups


def test_summary_of_a_real_model() -> None:
    plan = build_plan(model_specs("qwen3-1.7b"), 16)
    s = plan.summary()
    assert set(s) >= {
        "balance_ratio",
        "makespan",
        "lower_bound",
        "max_comm_bytes",
        "micro_groups",
        "group_makespan",
    }
    assert s["matrices"] == 28 * 7 and s["num_ranks"] == 16 and s["strategy"] == "canzona"
    assert s["max_comm_bytes"] == max(plan.assignment.comm_bytes)


def test_plan_config_validation() -> None:
    cfg = PlanConfig()
    assert (cfg.strategy, cfg.alpha, cfg.capacity_mb, cfg.refine, cfg.replica_dedup) == (
        "canzona",
        1.0,
        512.0,
        True,
        True,
    )
    assert cfg.capacity_bytes == 512 * MIB
    assert PlanConfig(alpha=0).alpha == 0.0
    # integers are stored as floats: ranks passing alpha=1 and alpha=1.0 plan the same digest
    assert (
        type(PlanConfig(alpha=1).alpha) is float
        and type(PlanConfig(capacity_mb=2).capacity_mb) is float
    )
    specs = [MatrixSpec("w", (8, 8))]
    one = build_plan(specs, 2, PlanConfig(alpha=1, capacity_mb=2))
    assert one.digest() == build_plan(specs, 2, PlanConfig(alpha=1.0, capacity_mb=2.0)).digest()
    # and -0.0 is 0.0: one rank's computed -0.0 against another's 0.0 plans one digest
    zero = build_plan(specs, 2, PlanConfig(alpha=0.0)).digest()
    assert build_plan(specs, 2, PlanConfig(alpha=-0.0)).digest() == zero
    # a capacity below one byte still admits one byte (a matrix per owner per group)
    assert PlanConfig(capacity_mb=1e-9).capacity_bytes == 1
    # fractions of a MiB count (not truncated to whole MiB first)
    assert PlanConfig(capacity_mb=1.5).capacity_bytes == 3 * MIB // 2
    assert PlanConfig(capacity_mb=0.25).capacity_bytes == MIB // 4
    assert len(build_plan(specs, 2, PlanConfig(capacity_mb=1e-9)).micro_groups) == 1
    for kwargs, match in [
        ({"strategy": "lpt"}, "strategy"),
        ({"alpha": 2.0}, "alpha"),
        ({"alpha": True}, "alpha"),
        ({"capacity_mb": 0}, "capacity_mb"),
        ({"capacity_mb": True}, "capacity_mb must be a positive finite number, got True"),
        ({"capacity_mb": float("inf")}, "capacity_mb"),
        # finite, but no count of bytes (an OverflowError later, in capacity_bytes)
        (
            {"capacity_mb": 1e308},
            r"capacity_mb must be a positive finite number of bytes, got 1e\+308",
        ),
        ({"capacity_mb": 10**400}, "capacity_mb must be a positive finite number of bytes"),
        ({"refine": 1}, "refine"),
        ({"replica_dedup": "yes"}, "replica_dedup"),
    ]:
        with pytest.raises(ValueError, match=match):
            PlanConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PlanConfig("canzona")  # type: ignore[misc]


def test_plan_rejects_inconsistent_parts() -> None:
    specs, plan = _small()
    groups = plan.micro_groups
    with pytest.raises(ValueError, match="missing"):
        dataclasses.replace(plan, micro_groups=groups[:-1])
    with pytest.raises(ValueError, match="repeated"):
        dataclasses.replace(
            plan, micro_groups=(*groups, dataclasses.replace(groups[0], index=len(groups)))
        )
    with pytest.raises(ValueError, match="index"):
        dataclasses.replace(plan, micro_groups=(groups[1], groups[0], *groups[2:]))
    with pytest.raises(ValueError, match="does not match"):
        dataclasses.replace(plan, num_ranks=5)
    wrong = dataclasses.replace(groups[0], owners=tuple((o + 1) % 4 for o in groups[0].owners))
    with pytest.raises(ValueError, match="differs"):
        dataclasses.replace(plan, micro_groups=(wrong, *groups[1:]))
    restricted = [MatrixSpec("a", (4, 4), ranks=(1,)), MatrixSpec("b", (4, 4))]
    rplan = build_plan(restricted, 2)
    bad = dataclasses.replace(rplan.assignment, owner={"a": 0, "b": 1})
    with pytest.raises(ValueError, match="not eligible"):
        dataclasses.replace(rplan, assignment=bad)
    with pytest.raises(ValueError, match="duplicate"):
        build_plan([MatrixSpec("a", (2, 2)), MatrixSpec("a", (2, 2))], 2)
    with pytest.raises(ValueError, match="PlanConfig"):
        build_plan(specs, 2, {"strategy": "canzona"})  # type: ignore[arg-type]


def test_every_strategy_builds_a_plan() -> None:
    specs = model_specs("qwen3-0.6b")
    for strategy in ("canzona", "numel", "round_robin", "count", "replicated"):
        plan = build_plan(specs, 8, PlanConfig(strategy=strategy, capacity_mb=64))
        assert plan.assignment.strategy == strategy
        assert sum(len(g.names) for g in plan.micro_groups) == len(specs)


def test_plan_of_matrices_restricted_to_a_sub_mesh() -> None:
    specs = [MatrixSpec(f"tp{i}", (256, 128), ranks=(0, 2, 4, 6)) for i in range(10)]
    plan = build_plan(specs, 8)
    assert {plan.owner(s.name) for s in specs} <= {0, 2, 4, 6}
    assert assign_owners(specs, 8).owner == plan.assignment.owner


def test_largest_catalogued_model_plans_at_1024_ranks() -> None:
    # a sanity check of scale (no wall-clock assertion): 36,566 matrices over 1024 ranks
    specs = model_specs("qwen3-235b-a22b")
    plan = build_plan(specs, 1024)
    assert len(plan.assignment.owner) == len(specs) == 94 * 388
    assert plan.assignment.makespan_ratio < 1.05
    assert sum(len(g.names) for g in plan.micro_groups) == len(specs)


def test_rank_sets_hash_once_and_behave_as_tuples() -> None:
    """Catches: a rank set whose hash, equality or membership differs from the tuple's
    (dictionaries keyed by either would miss), one that hashes or scans its ranks on every
    lookup, a spec that keeps a plain copy of it (every later lookup hashing thousands of
    ranks again), and a cache that leaks into what the digest or a pickle carries."""
    plain = tuple(range(0, 2048, 2))
    ranks = Ranks(plain)
    assert ranks == plain and hash(ranks) == hash(plain) and {plain: 1}[ranks] == 1
    assert [r in ranks for r in (0, 1, 2046, 2047, -2, 2048)] == [
        r in plain for r in (0, 1, 2046, 2047, -2, 2048)
    ]
    assert ranks.__dict__ == {"hash": hash(plain), "members": frozenset(plain)}  # once, kept
    assert MatrixSpec("a", (4, 4), 4, ranks).ranks is ranks
    assert type(MatrixSpec("b", (4, 4), 4, (0, 1)).ranks) is Ranks
    assert json.dumps(ranks) == json.dumps(plain)
    back = pickle.loads(pickle.dumps(ranks))
    assert type(back) is Ranks and back == plain and not back.__dict__ and hash(back) == hash(plain)
