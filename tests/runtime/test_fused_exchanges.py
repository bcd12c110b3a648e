"""Small micro-groups share all-to-alls: fewer collectives, the same bits, the same failures."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.tensor import Replicate, Shard

import canzona
from canzona.runtime import UpdateFailedError

from _cases import (
    SHAPES_TWICE,
    TINY_MB,
    assert_bitwise,
    compare,
    first_step_mismatch,
    full_tensors,
    grad_steps,
    local_optimizer,
    plan,
    reference_muon,
    run_steps,
    set_grads,
    sharded_params,
)
from _dist import mesh

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
SHAPES = SHAPES_TWICE
ROWS = {n: (Shard(0),) for n in SHAPES}
TINY = TINY_MB
# 2-D meshes: FSDP x TP (rows on dp, columns on tp) and HSDP (replicas on the first dim)
LAYOUTS = {
    "2d": lambda shape: (Shard(0), Shard(len(shape) - 1)),
    "hsdp": lambda shape: (Replicate(), Shard(len(shape) - 2)),
}


def _counts(opt: torch.optim.Optimizer) -> tuple[int, int, int, int]:
    stats = opt.last_step_stats  # type: ignore[attr-defined]
    return stats.micro_groups, stats.collectives, stats.bytes_sent, stats.bytes_received


def _bits(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["bits"] for r in per_rank]


def _muon_case(
    world: tuple[int, ...],
    strategy: str,
    fuse_bytes: int,
    overlap: bool,
    depth: int,
    layout: str = "rows",
) -> dict[str, Any]:
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    placements = ROWS if layout == "rows" else {n: LAYOUTS[layout](s) for n, s in SHAPES.items()}
    params = sharded_params(fulls, mesh(world), placements)
    opts: list[torch.optim.Optimizer] = []

    def make(ps: Any) -> torch.optim.Optimizer:
        pipeline = canzona.PipelineConfig(overlap=overlap, depth=depth, fuse_bytes=fuse_bytes)
        opts.append(
            canzona.Muon(ps, **KW, plan=plan(strategy, capacity_mb=TINY), pipeline=pipeline)
        )
        return opts[0]

    got = run_steps(make, params, grads)
    return {
        "bits": {"torch.optim.Muon": compare(got, reference_muon(fulls, grads, **KW))},
        "counts": _counts(opts[0]),
    }


@pytest.mark.parametrize(
    ("world", "overlap", "depth"),
    [((2,), True, 1), ((2,), True, 3), ((2,), False, 1), ((4,), True, 1)],
)
def test_fused_exchanges_are_bitwise_and_save_collectives(
    dist: Any, world: tuple[int, ...], overlap: bool, depth: int
) -> None:
    """n micro-groups take n + 1 all-to-alls fused and 2n apart, moving the same bytes.

    With ``depth`` d the step's first d + 1 gathers travel together, then each scatter with
    the gather issued after it; the last scatters (the vote among them) travel alone.
    Catches: a part copied out of the shared buffer at the wrong offset or in the wrong
    dtype (not bitwise equal), a fused exchange left unwaited or waited twice (a hang or a
    double count), an exchange sent twice (more bytes), fusion that silently stopped.
    """
    size = world[0]
    for strategy in ("canzona", "round_robin"):
        fused, apart = (
            dist(size).run(_muon_case, world, strategy, fuse, overlap, depth)
            for fuse in (1 << 20, 0)
        )
        assert_bitwise(_bits(fused), "torch.optim.Muon")
        assert_bitwise(_bits(apart), "torch.optim.Muon")
        for rank in range(size):
            groups, collectives, sent, received = fused[rank]["counts"]
            assert groups >= 4, groups
            assert collectives == groups + 1, (strategy, rank, groups, collectives)
            assert apart[rank]["counts"] == (groups, 2 * groups, sent, received)


@pytest.mark.parametrize("layout", ["2d", "hsdp"])
def test_fused_exchanges_on_2d_meshes(dist: Any, layout: str) -> None:
    """FSDP x TP fragments and HSDP replica groups (one computation per matrix, sent to
    every replica) through fused exchanges: bitwise, and fewer all-to-alls than apart."""
    fused, apart = (
        dist(4).run(_muon_case, (2, 2), "canzona", fuse, True, 1, layout) for fuse in (1 << 20, 0)
    )
    assert_bitwise(_bits(fused), "torch.optim.Muon")
    assert_bitwise(_bits(apart), "torch.optim.Muon")
    for rank in range(4):
        groups, collectives, sent, received = fused[rank]["counts"]
        assert groups >= 3 and collectives == groups + 1, (rank, groups, collectives)
        assert apart[rank]["counts"] == (groups, 2 * groups, sent, received)


def test_replicated_plans_fuse_their_first_gathers(dist: Any) -> None:
    """Every rank computes every matrix: no scatters, the first two gathers share one."""
    fused, apart = (
        dist(2).run(_muon_case, (2,), "replicated", fuse, True, 1) for fuse in (1 << 20, 0)
    )
    assert_bitwise(_bits(fused), "torch.optim.Muon")
    for rank in range(2):
        groups, collectives, _, _ = fused[rank]["counts"]
        assert groups >= 3, groups
        assert (collectives, apart[rank]["counts"][1]) == (groups - 1, groups)


def _large_groups_case() -> tuple[int, int]:
    """Micro-groups above ``fuse_bytes`` keep one all-to-all per exchange."""
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), ROWS)
    pipeline = canzona.PipelineConfig(fuse_bytes=1)  # below any group's bytes per rank
    opt = canzona.Muon(params, **KW, plan=plan(capacity_mb=TINY), pipeline=pipeline)
    set_grads(params, grad_steps(SHAPES, 1)[0])
    opt.step()
    groups, collectives, _, _ = _counts(opt)
    return groups, collectives


def test_groups_above_the_limit_are_not_fused(dist: Any) -> None:
    for groups, collectives in dist(2).run(_large_groups_case):
        assert collectives == 2 * groups


def _normuon_case(fuse_bytes: int) -> dict[str, Any]:
    """NorMuon: bf16 payloads, float32 directions, so fused exchanges travel as bytes."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    params = sharded_params(fulls, mesh((2,)), ROWS)
    opts: list[torch.optim.Optimizer] = []

    def make(ps: Any) -> torch.optim.Optimizer:
        pipeline = canzona.PipelineConfig(fuse_bytes=fuse_bytes)
        opts.append(canzona.NorMuon(ps, lr=0.02, plan=plan(capacity_mb=TINY), pipeline=pipeline))
        return opts[0]

    got = run_steps(make, params, grads)
    want = local_optimizer(canzona.NorMuon, fulls, grads, lr=0.02)
    return {"bits": {"single device": compare(got, want)}, "counts": _counts(opts[0])}


def test_exchanges_of_different_dtypes_travel_as_bytes(dist: Any) -> None:
    """Catches: a byte view whose split sizes are counted in elements (wrong bytes or a
    size mismatch in the all-to-all), a part viewed back in the wrong dtype."""
    fused = dist(2).run(_normuon_case, 1 << 20)
    assert_bitwise(_bits(fused), "single device")
    for rank in range(2):
        groups, collectives, _, _ = fused[rank]["counts"]
        assert groups >= 4 and collectives == groups + 1, (groups, collectives)


def _failure_case(fail_rank: int) -> list[Any]:
    """The owner of a first-group matrix fails: its scatter travels with a later gather."""
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), ROWS)
    opt = canzona.Muon(params, **KW, plan=plan(capacity_mb=TINY))
    set_grads(params, grad_steps(SHAPES, 1)[0])
    opt.step()
    before = {n: p.detach().to_local().clone() for n, p in params}
    runtime = opt._runtime  # type: ignore[attr-defined]
    target = runtime.plan.micro_groups[0].names[0]
    owner = runtime.plan.micro_groups[0].owners[0]
    original = type(opt)._directions

    def failing(self: Any, batch: Any, full: torch.Tensor) -> torch.Tensor:
        if tdist.get_rank() == fail_rank == owner:
            raise RuntimeError("injected")
        return original(self, batch, full)

    type(opt)._directions = failing  # type: ignore[method-assign]
    try:
        set_grads(params, grad_steps(SHAPES, 2)[1])
        try:
            opt.step()
            outcome = "no error"
        except UpdateFailedError as exc:
            outcome = str(exc)
    finally:
        type(opt)._directions = original  # type: ignore[method-assign]
    unchanged = all(torch.equal(p.detach().to_local(), before[n]) for n, p in params)
    return [owner, target, outcome, unchanged]


def test_a_failure_in_a_fused_micro_group_raises_everywhere_and_changes_nothing(
    dist: Any,
) -> None:
    """Catches: a fused exchange that loses the failure (the vote rides the last scatter)."""
    for fail_rank in (0, 1):
        out = dist(2).run(_failure_case, fail_rank)
        owner, target = out[0][0], out[0][1]
        for _, _, outcome, unchanged in out:
            if owner != fail_rank:
                assert outcome == "no error"
                continue
            assert f"rank {owner}: computing micro-group 0 (parameters ['{target}'])" in outcome
            assert unchanged


def _mismatch_case(field: str, mine: object, theirs: object) -> str:
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), ROWS)
    value = mine if tdist.get_rank() == 0 else theirs
    pipeline = canzona.PipelineConfig(**{field: value})
    opt = canzona.Muon(params, **KW, plan=plan(capacity_mb=TINY), pipeline=pipeline)
    return first_step_mismatch(opt, params, SHAPES)


@pytest.mark.parametrize(
    ("field", "mine", "theirs"),
    [
        ("fuse_bytes", 0, 1 << 20),
        ("depth", 1, 2),
        ("overlap", True, False),
        ("atomic", True, False),
        ("check_every_step", True, False),
        ("skip_nonfinite", True, False),
    ],
)
def test_ranks_that_exchange_differently_fail_before_any_collective(
    dist: Any, field: str, mine: object, theirs: object
) -> None:
    """Catches: a setting that decides the step's collectives (``fuse_bytes``, ``depth``,
    ``overlap``, ``atomic``, ``check_every_step``, ``skip_nonfinite``:
    ``PipelineConfig.collective_settings``) left out of the configuration the ranks compare
    (a hang; with ``atomic``, from the third step on one rank's header rode its first gather
    while the other's travelled alone, and gloo aborted the process on the size mismatch;
    with ``check_every_step``, one rank's header gather met the other's layout agreement),
    or a first step that skips the check where a setting turns it off."""
    assert dist(2).run(_mismatch_case, field, mine, theirs) == ["PlanMismatchError"] * 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_fuse_bytes_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="fuse_bytes"):
        canzona.PipelineConfig(fuse_bytes=bad)
