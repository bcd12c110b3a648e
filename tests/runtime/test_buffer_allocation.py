"""A step whose buffers cannot be allocated on one rank fails on every rank, and changes nothing."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.tensor.placement_types import Shard

import canzona
import canzona.runtime.buffers as buffers_module
import canzona.runtime.pipeline as pipeline_module
import canzona.runtime.topology as topology_module
from canzona.runtime.buffers import FlatBuffer

from _cases import (
    TINY_MB,
    compare,
    full_of,
    full_tensors,
    grad_steps,
    reference_muon,
    set_grads,
    sharded_params,
)
from _dist import mesh

TIMEOUT = 90
KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1}
SHAPES = {"square": (16, 16), "tall": (24, 8), "odd": (7, 13), "stack": (3, 6, 10)}
STEPS = 5
INJECTED = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


def _schedules(opt: Any) -> list[Any]:
    return [p.schedule for p in opt._runtime._pipelines.values()]


def _failing_step(case: dict[str, Any]) -> dict[str, Any]:
    """Five steps; in step ``case["step"]`` (1-based) rank 1's allocations of one kind
    raise: ``"acquire"``, the step buffers (the first ``times`` calls, each after allocating
    its own buffer, so that one buffer is held when the error comes); ``"receive"``, the
    receive buffer of the step's ``call``-th all-to-all (once); ``"release"``, the copies
    out of the step's first fused all-to-all; ``"copies"``, a replicated plan's copies of
    its own fragments; ``"build"``, the step buffers when the schedule is built (the
    first, on the CPU the only allocation of kept buffers)."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, STEPS)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    config = canzona.PipelineConfig(
        keep_buffers=case.get("keep"), fuse_bytes=case.get("fuse", 32 << 10), timeout_s=20.0
    )
    opt = canzona.Muon(
        params,
        **KW,
        plan=canzona.PlanConfig(
            strategy=case.get("strategy", "canzona"),
            cost="flops",
            capacity_mb=case.get("capacity_mb", 512.0),
        ),
        pipeline=config,
    )
    real_acquire, real_receive = FlatBuffer.acquire, pipeline_module.receive_buffer
    real_release, real_copies = pipeline_module.release, pipeline_module.kept_copies
    real_allocate = buffers_module.allocate
    armed = [False]
    left, calls = [0], [0]

    def acquire(buf: FlatBuffer) -> None:
        real_acquire(buf)
        if armed[0] and case["kind"] == "acquire" and left[0] > 0:
            left[0] -= 1
            raise torch.OutOfMemoryError(INJECTED)

    def receive(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if armed[0] and case["kind"] == "receive":
            calls[0] += 1
            if calls[0] == case["call"]:
                raise torch.OutOfMemoryError(INJECTED)
        return real_receive(numel, dtype, device)

    def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if armed[0] and case["kind"] == "build":
            armed[0] = False  # once
            raise torch.OutOfMemoryError(INJECTED)
        return real_allocate(numel, dtype, device)

    def release(wire: Any) -> None:
        if armed[0] and case["kind"] == "release" and wire.layout:
            armed[0] = False  # once
            raise torch.OutOfMemoryError(INJECTED)
        real_release(wire)

    def copies(outs: Any, kept: Any) -> Any:
        if armed[0] and case["kind"] == "copies":
            armed[0] = False  # once
            raise torch.OutOfMemoryError(INJECTED)
        return real_copies(outs, kept)

    out: dict[str, Any] = {"outcomes": [], "unchanged": None, "held_after": None, "rode": []}
    FlatBuffer.acquire = acquire  # type: ignore[method-assign]
    pipeline_module.receive_buffer = receive
    pipeline_module.release = release
    pipeline_module.kept_copies = copies
    buffers_module.allocate = allocate
    try:
        for step, g in enumerate(grads, start=1):
            set_grads(params, g)
            armed[0] = step == case["step"] and tdist.get_rank() == 1
            left[0] = case.get("times", 0)
            before = [p.to_local().clone() for _, p in params]
            state = [
                v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
            ]
            try:
                opt.step()
                out["outcomes"].append(("ok", ""))
                out["rode"].append(opt.last_step_stats.header_rode)
                out["groups"] = opt.last_step_stats.micro_groups
            except canzona.UpdateFailedError as exc:
                out["outcomes"].append(("UpdateFailedError", str(exc)))
                out["rode"].append(None)
                after = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
                now = [p.to_local() for _, p in params]
                out["unchanged"] = (
                    all(map(torch.equal, now, before))
                    and len(after) == len(state)
                    and all(map(torch.equal, after, state))
                )
                out["held_after"] = sum(
                    b.tensor.untyped_storage().nbytes() for s in _schedules(opt) for b in s.buffers
                )
    finally:
        FlatBuffer.acquire = real_acquire  # type: ignore[method-assign]
        pipeline_module.receive_buffer = real_receive
        pipeline_module.release = real_release
        pipeline_module.kept_copies = real_copies
        buffers_module.allocate = real_allocate
    failed = [i for i, (kind, _) in enumerate(out["outcomes"], start=1) if kind != "ok"]
    kept = [g for i, g in enumerate(grads, start=1) if i not in failed]
    got = {n: full_of(p) for n, p in params}
    out["bits"] = compare(got, reference_muon(fulls, kept, **KW))
    return out


#: (case, the error's "where", or None where the step succeeds after a retry)
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    # the first step: the plan's first allocation, after the check that runs apart
    "first-step": ({"kind": "acquire", "step": 1, "times": 1}, "allocating the step's buffers"),
    # the same where the schedule is built: its buffers' first allocation (before: the
    # error on rank 1 alone, while rank 0 waited in the first gather until timeout_s)
    "build": ({"kind": "build", "step": 1}, "allocating the step's buffers"),
    # a steady step (the check rides the first gather: declined), then its retry
    "steady-step": (
        {"kind": "acquire", "step": 4, "times": 2, "keep": False},
        "allocating the step's buffers",
    ),
    # the ride declined; the retry, with the check apart, allocates
    "steady-then-retry": ({"kind": "acquire", "step": 4, "times": 1, "keep": False}, None),
    # the first gather's receive buffer in a steady step: its send, which carried the
    # header, sent from the buffers that went, so zeros went instead: declined, retried
    "receive-first-gather": ({"kind": "receive", "step": 4, "call": 1}, None),
    # a scatter's, with other all-to-alls in flight (many micro-groups, depth 1)
    "receive-scatter": (
        {"kind": "receive", "step": 2, "call": 3, "capacity_mb": TINY_MB, "fuse": 0},
        "allocating the receive buffer of the scatter of micro-group 0",
    ),
    # the last scatter's, whose segments carry the senders' status flags (before: rank 1
    # sent "not failed", every rank passed the vote, and rank 1 applied its own pieces
    # only while the others applied the step: the replicas parted silently)
    "receive-last-scatter": (
        {"kind": "receive", "step": 2, "call": 2},
        "allocating the receive buffer of the scatter of micro-group 0",
    ),
    # a fused all-to-all's: a scatter with the gather issued after it
    "receive-fused": (
        {"kind": "receive", "step": 4, "call": 2, "capacity_mb": TINY_MB, "fuse": 1 << 20},
        "allocating the receive buffer of the scatter of micro-group 0 and the gather of "
        "micro-group 2",
    ),
    # the copies out of a fused all-to-all's receive buffer (the first gathers travel fused)
    "fused-copy": (
        {"kind": "release", "step": 2, "capacity_mb": TINY_MB, "fuse": 1 << 20},
        "copying out the gather of micro-group 0 and the gather of micro-group 1",
    ),
    # a replicated plan keeps copies of its own fragments (no scatter: the vote is apart)
    "replicated-copies": (
        {"kind": "copies", "step": 4, "strategy": "replicated"},
        "keeping the directions of micro-group 0",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_rank_that_cannot_allocate_a_step_buffer_fails_the_step_everywhere(
    dist: Any, name: str
) -> None:
    """Catches: the allocation error raised on its rank alone (the other rank waited in the
    next all-to-all until ``timeout_s``), the views of the step buffers read or written
    after their memory went (a crash), the step buffers kept by the failing rank, and a
    failed step that changed parameters or state. The steps after it match
    ``torch.optim.Muon`` on the gradients of the steps that ran, bit for bit."""
    case, where = CASES[name]
    step = case["step"]
    out = dist(2).run(_failing_step, case, timeout=TIMEOUT)
    for rank, r in enumerate(out):
        kinds = [kind for kind, _ in r["outcomes"]]
        want = ["ok"] * STEPS
        if where is not None:
            want[step - 1] = "UpdateFailedError"
        assert kinds == want, f"rank {rank}: {r['outcomes']}"
        assert all(equal for equal, _ in r["bits"].values()), f"rank {rank}: {r['bits']}"
        if case.get("capacity_mb"):
            assert r["groups"] >= 4, f"rank {rank}: {r['groups']} micro-groups"
        if step > 3:  # the step before rode its check: so would this one
            assert r["rode"][step - 2] is True, f"rank {rank}: no header rode: {r['rode']}"
        if where is None:
            continue
        msg = r["outcomes"][step - 1][1]
        assert f"ranks [1] (rank 1: {where} raised OutOfMemoryError: {INJECTED})" in msg, msg
        assert r["unchanged"] is True, f"rank {rank}: the failed step changed something"
        gives_back = case["kind"] != "copies"  # a failed buffer: the step's memory goes
        if rank == 1 and gives_back and case.get("keep") is None:  # (kept buffers too)
            assert r["held_after"] == 0, r["held_after"]


def _step_patched(opt: Any, module: Any, attr: str, patch: Any) -> dict[str, Any]:
    """One ``opt.step()`` with ``module.attr`` replaced by ``patch``: what it raised, if any."""
    real = getattr(module, attr)
    setattr(module, attr, patch)
    try:
        opt.step()
        return {"kind": "ok", "msg": ""}
    except Exception as exc:
        return {"kind": type(exc).__name__, "msg": str(exc)}
    finally:
        setattr(module, attr, real)


def _fails_twice() -> dict[str, Any]:
    """Rank 1's receive buffer of the step's third all-to-all cannot be allocated, and not
    again after the rank gave its step memory back: it raises alone, while rank 0 waits in
    that all-to-all (on a group of its own: the all-to-all stays in flight). Rank 1 has
    built one optimizer more before: the ranks' construction indices differ."""
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    if tdist.get_rank() == 1:
        canzona.Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1)
    fulls = full_tensors(SHAPES)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    opt = canzona.Muon(
        params,
        **KW,
        plan=canzona.PlanConfig(strategy="canzona", cost="flops", capacity_mb=TINY_MB),
        pipeline=canzona.PipelineConfig(process_group=group, fuse_bytes=0, timeout_s=50.0),
    )
    real = pipeline_module.receive_buffer
    calls = [0]

    def receive(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        if tdist.get_rank() == 1 and calls[0] >= 3:  # the call and its retry
            raise torch.OutOfMemoryError(INJECTED)
        return real(numel, dtype, device)

    set_grads(params, grad_steps(SHAPES, 1)[0])
    return _step_patched(opt, pipeline_module, "receive_buffer", receive)


def test_a_rank_that_raises_alone_is_named_at_once_by_the_ranks_waiting_for_it(
    dist: Any,
) -> None:
    """Catches: a rank that raises alone (here its allocation failed again after it gave its
    step memory back) leaving the others in the collective it never enters until
    ``timeout_s`` (50 s here; the run's own limit is 40 s): they must raise at their next look
    at the job's store, naming the rank and its error, and say the job must restart. Also
    catches ranks that file and look under their own construction indices of the
    optimizer instead of the one they agreed on."""
    out = dist(2).run(_fails_twice, timeout=40)
    assert out[1] == {"kind": "OutOfMemoryError", "msg": INJECTED}, out[1]
    assert out[0]["kind"] == "CollectiveTimeoutError", out[0]
    msg = out[0]["msg"]
    assert msg.startswith("rank 0: the scatter of micro-group 0 (step 1) cannot complete: "), msg
    assert f"rank 1 raised OutOfMemoryError: {INJECTED}, outside the failure handling" in msg, msg
    assert "restart the job" in msg, msg


def _raises_before_the_agreement() -> dict[str, Any]:
    """Rank 1 raises alone in its first step, before the layout agreement (a bug, simulated
    in the structure digest), while rank 0 waits in the agreement (on a group of its own).
    Rank 1 built one optimizer more before: the ranks' construction indices differ."""
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    if tdist.get_rank() == 1:
        canzona.Muon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1)
    params = sharded_params(full_tensors(SHAPES), mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    opt = canzona.Muon(
        params, **KW, pipeline=canzona.PipelineConfig(process_group=group, timeout_s=50.0)
    )
    real = topology_module.structure_digest

    def digest(*args: Any) -> str:
        if tdist.get_rank() == 1:
            raise RuntimeError("a bug (simulated)")
        return real(*args)

    set_grads(params, grad_steps(SHAPES, 1)[0])
    return _step_patched(opt, topology_module, "structure_digest", digest)


def test_a_rank_that_raises_alone_before_the_layout_agreement_is_named_at_once(
    dist: Any,
) -> None:
    """Catches: the first step's layout agreement waiting without a deadline (an
    ``all_gather_object``: until the process group's timeout, 60 s here, past the run's
    40 s), and ranks that file and look under their own construction indices of the
    optimizer before they have agreed on a name."""
    out = dist(2).run(_raises_before_the_agreement, timeout=40)
    assert out[1] == {"kind": "RuntimeError", "msg": "a bug (simulated)"}, out[1]
    assert out[0]["kind"] == "CollectiveTimeoutError", out[0]
    msg = out[0]["msg"]
    assert msg.startswith("rank 0: the layout agreement (sizes) (step 1) cannot complete: "), msg
    assert "rank 1 raised RuntimeError: a bug (simulated), outside the failure handling" in msg


def _raised(call: Any) -> str:
    """``"ok"``, or the name of what ``call()`` raised."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def _failed_then_slow() -> dict[str, Any]:
    """Step 1 fails on every rank (rank 1's receive buffer, once: the failure every rank
    shares); in step 2 rank 1 is late by 2.5 s, so rank 0 looks at the job's store while it
    waits: what the ranks filed on leaving step 1 must not end step 2."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 2)
    params = sharded_params(fulls, mesh((2,)), {n: (Shard(0),) for n in SHAPES})
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=60))  # see _fails_twice
    config = canzona.PipelineConfig(process_group=group, fuse_bytes=0, timeout_s=30.0)
    opt = canzona.Muon(params, **KW, pipeline=config)
    real = pipeline_module.receive_buffer
    calls = [0]

    def receive(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        if tdist.get_rank() == 1 and calls[0] == 1:
            raise torch.OutOfMemoryError(INJECTED)
        if tdist.get_rank() == 1 and calls[0] == 4:  # step 2's first all-to-all
            time.sleep(2.5)
        return real(numel, dtype, device)

    outcomes = []
    pipeline_module.receive_buffer = receive
    try:
        for g in grads:
            set_grads(params, g)
            outcomes.append(_raised(opt.step))
    finally:
        pipeline_module.receive_buffer = real
    return {
        "outcomes": outcomes,
        "bits": compare({n: full_of(p) for n, p in params}, reference_muon(fulls, grads[1:], **KW)),
    }


def test_what_ranks_filed_on_leaving_a_failed_step_does_not_end_the_next(dist: Any) -> None:
    """Catches: a rank that reads what a peer filed when it left an earlier call (here every
    rank raised the failed step's UpdateFailedError) as if the peer had left this one: a
    healthy but slow step would end in a CollectiveTimeoutError."""
    for rank, out in enumerate(dist(2).run(_failed_then_slow, timeout=TIMEOUT)):
        assert out["outcomes"] == ["UpdateFailedError", "ok"], (rank, out["outcomes"])
        assert all(equal for equal, _ in out["bits"].values()), (rank, out["bits"])
