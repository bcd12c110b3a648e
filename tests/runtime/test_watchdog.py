"""The watchdog: which collective handles it keeps, and how a failed wait is reported."""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as tdist

import canzona
from canzona.runtime.config import CollectiveTimeoutError
from canzona.runtime.tensors import local_tensor
from canzona.runtime.watchdog import RETAINED_WORKS, Watchdog

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:43752. This is typically caused by a remote worker crashing."
)


class _Work:
    """A work handle: completes at once, or raises ``error`` after sleeping ``delay`` s."""

    def __init__(self, error: str | None = None, delay: float = 0.0) -> None:
        self.error, self.delay = error, delay

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.error is None:
            return True
        time.sleep(self.delay)
        raise RuntimeError(self.error)


def test_wait_keeps_the_latest_work_handles() -> None:
    """Catches: a handle dropped as soon as it is waited. gloo's worker thread would then
    free the collective's tensors itself, taking the GIL, and abort the process when that
    happens during interpreter shutdown (``terminate called without an active exception``,
    see tests/runtime/test_exit.py)."""
    watchdog = Watchdog(None, 0, 1, 5.0)
    works = [_Work() for _ in range(RETAINED_WORKS + 1)]
    refs = [weakref.ref(w) for w in works]
    for work in works:
        watchdog.wait(work, "a collective")
    del works, work
    gc.collect()
    alive = [ref() is not None for ref in refs]
    assert alive == [False] + [True] * RETAINED_WORKS  # the oldest goes, the latest stay


def test_a_closed_connection_is_reported_as_such() -> None:
    """Catches: a peer that crashed reported as a timeout of the full deadline."""
    watchdog = Watchdog(None, 3, 4, 5.0)
    with pytest.raises(CollectiveTimeoutError) as info:
        watchdog.wait(_Work(GLOO_CLOSED), "the gather of micro-group 2")
    message = str(info.value)
    assert message.startswith("rank 3: the gather of micro-group 2 (step 0) failed after 0.")
    assert "of the 5s deadline: a peer rank closed its connection" in message
    assert "did not complete" not in message
    assert "Connection closed by peer" in message  # gloo's text names the peer's address


def test_a_late_peer_is_reported_after_the_deadline() -> None:
    """Catches: a timeout reported as a closed connection, or without its deadline."""
    watchdog = Watchdog(None, 0, 2, 0.2)
    with pytest.raises(CollectiveTimeoutError) as info:
        watchdog.wait(_Work("Operation timed out!", delay=0.2), "the scatter of micro-group 0")
    message = str(info.value)
    assert "the scatter of micro-group 0 (step 0) did not complete within 0.2s" in message
    assert "closed" not in message


class _GlooWork:
    """A collective whose peer never comes, waited on as gloo does: the timeout in whole
    milliseconds, rounded down, and no limit at all for 0 ms (the peer arrives then, much
    later: the wait returns)."""

    def __init__(self) -> None:
        self.timeouts: list[int] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is not None
        ms = int(timeout.total_seconds() * 1000)
        self.timeouts.append(ms)
        if ms == 0:
            return True
        time.sleep(ms / 1000)
        raise RuntimeError(f"Timed out waiting {ms}ms for recv operation to complete")


@pytest.mark.parametrize("timeout_s", [0.0505, 0.0005])
def test_a_deadline_of_a_fraction_of_a_millisecond_still_ends_the_wait(timeout_s: float) -> None:
    """Catches: a wait woken less than a millisecond before the deadline (gloo rounds its
    timeout down to whole milliseconds) waiting again with a timeout of 0 ms, which gloo
    takes as no limit: the step went on waiting for a late peer past ``timeout_s``."""
    watchdog = Watchdog(None, 0, 2, timeout_s)
    work = _GlooWork()
    with pytest.raises(CollectiveTimeoutError, match=f"did not complete within {timeout_s:g}s"):
        watchdog.wait(work, "the gather of micro-group 0")
    assert work.timeouts and min(work.timeouts) >= 1, work.timeouts


def test_an_early_failure_is_not_reported_as_the_deadline() -> None:
    """Catches: the process group's own (shorter) timeout reported as ``timeout_s`` passing."""
    watchdog = Watchdog(None, 1, 2, 60.0)
    error = "Timed out waiting 30000ms for recv operation to complete"
    with pytest.raises(CollectiveTimeoutError) as info:
        watchdog.wait(_Work(error), "the step's cross-rank check")
    message = str(info.value)
    assert "failed after 0.0s, before the 60s deadline, in the process group" in message
    assert error in message and "did not complete within" not in message


class _Store:
    """A key-value store like the default one; ``set`` fails once it has gone away."""

    def __init__(self, entries: dict[str, str], gone: bool = False) -> None:
        self.entries, self.gone = entries, gone

    def set(self, key: str, value: str) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer")
        self.entries[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.entries for k in keys)

    def get(self, key: str) -> bytes:
        return self.entries[key].encode()


def _marking(monkeypatch: pytest.MonkeyPatch, store: _Store, rank: int, world: int) -> Watchdog:
    from canzona.runtime import watchdog as module

    monkeypatch.setattr(module, "default_store", lambda: store)
    monkeypatch.setattr(module.dist, "get_process_group_ranks", lambda _: list(range(world)))
    watchdog = Watchdog(object(), rank, world, 5.0, tag="t")  # type: ignore[arg-type]
    assert watchdog.markers
    return watchdog


def test_ranks_behind_in_the_same_step_or_in_none_are_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: ranks compared by step alone (a rank stuck at an earlier collective of the
    same step would not be named)."""
    store = _Store({})
    watchdog = _marking(monkeypatch, store, 2, 5)
    store.entries = {
        watchdog._key(1): "7|1|the gather of micro-group 0",
        watchdog._key(2): "7|3|the scatter of micro-group 1",
        watchdog._key(3): "6|9|the step's success vote",
    }
    watchdog.step = 7
    watchdog.mark(3, "the scatter of micro-group 1")
    assert watchdog.behind() == [
        (0, "not waiting in any collective"),
        (1, "step 7: the gather of micro-group 0"),
        (3, "step 6: the step's success vote"),
        (4, "not waiting in any collective"),
    ]


def test_a_store_that_went_away_turns_the_markers_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: a slow wait that raises because the store it publishes to is gone (the step
    would fail where the collective itself succeeds)."""
    watchdog = _marking(monkeypatch, _Store({}, gone=True), 0, 2)
    watchdog.mark(0, "the step's cross-rank check")
    watchdog._publish()
    assert not watchdog.markers and watchdog.behind() == []


def _peer_leaves() -> tuple[str, str]:
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    if tdist.get_rank() == 1:  # closes its connections of ``group``
        tdist.destroy_process_group(group)
        del group
        gc.collect()
        return "left", ""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    weight.grad = torch.ones_like(weight)
    pipeline = canzona.PipelineConfig(process_group=group, timeout_s=30.0)
    opt = canzona.Muon([("w", weight)], lr=0.02, pipeline=pipeline)
    try:
        opt.step()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_a_peer_that_leaves_is_named_as_a_closed_connection(dist: Any) -> None:
    """Catches: the rank left behind waiting for the full 30 s deadline, or reporting a
    peer that is gone as a late one, on a real gloo process group."""
    out = dist(2).run(_peer_leaves, timeout=60)
    assert out[1] == ("left", "")
    kind, message = out[0]
    assert kind == "CollectiveTimeoutError", message
    assert "of the 30s deadline: a peer rank closed its connection" in message


def _stages_with_equal_names() -> tuple[str, str]:
    """Two pipeline stages (mesh ``(pp, dp)``), each with its own optimizer on its dp group,
    over parameters of the same name and shape; at the second step stage 1 misses a
    gradient on its second rank, and stage 0's second rank comes late (healthy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = tdist.get_rank()
    stage = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    p = torch.nn.Parameter(distribute_tensor(full, stage, [Shard(0)], src_data_rank=None))
    pipeline = canzona.PipelineConfig(process_group=stage.get_group(), timeout_s=30.0)
    opt = canzona.Muon([("w", p)], lr=0.02, pipeline=pipeline)
    for step in range(2):
        missing = step == 1 and rank == 3
        ones = torch.ones(8, 4)
        p.grad = None if missing else distribute_tensor(ones, stage, [Shard(0)], src_data_rank=None)
        if step == 1 and rank == 1:
            time.sleep(2.5)  # past the grace and one look at the store of the peer waiting
        try:
            opt.step()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        opt.zero_grad()
    return "ok", ""


def test_optimizers_on_disjoint_groups_keep_their_markers_apart(dist: Any) -> None:
    """Catches: the markers keyed by the optimizer's name and group rank only, so that a
    stage's healthy rank waiting for a late peer reads the other stage's failure as its
    own peer leaving (``CollectiveTimeoutError``, a collective left in flight); and an
    error of a stage's group naming its ranks without saying which global ranks they are."""
    out = dist(4).run(_stages_with_equal_names, timeout=90)
    assert out[:2] == [("ok", ""), ("ok", "")]
    note = (
        "(rank numbers here are ranks of the optimizer's process group, whose ranks 0 and 1 "
        "are global ranks 2, 3)"
    )
    for kind, message in out[2:]:
        assert kind == "GradientMismatchError", message
        assert message.endswith(
            f"(missing on ranks [1]). Every rank must produce a gradient "
            f"for the same parameters (or none), in the same placements. {note}"
        )


def test_a_group_of_the_global_ranks_in_order_adds_no_note() -> None:
    """Catches: the note appended where rank numbers already are the global ones."""
    assert Watchdog(None, 0, 1, 1.0).rank_note() == ""
    identity = Watchdog(None, 0, 3, 1.0)
    identity.global_ranks = (0, 1, 2)
    assert identity.rank_note() == ""
    shifted = Watchdog(None, 0, 3, 1.0)
    shifted.global_ranks = (4, 5, 6)
    assert shifted.rank_note().endswith("whose ranks 0 to 2 are global ranks 4, 5, 6)")


def _owner_late_in_the_last_group() -> dict[str, Any]:
    """World 2, several micro-groups; at the second step the owner of the last group takes
    2.2 s in its math, past the 1 s deadline of its peer, which waits on the last scatter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(0)
    named = [
        (
            f"w{i}",
            torch.nn.Parameter(
                distribute_tensor(torch.randn(8, 6, generator=gen), mesh, [Shard(0)])
            ),
        )
        for i in range(5)
    ]
    opt = canzona.Muon(
        named,
        lr=0.02,
        plan=canzona.PlanConfig(capacity_mb=1e-4),
        pipeline=canzona.PipelineConfig(process_group=group, timeout_s=1.0),
    )
    for _, p in named:
        p.grad = distribute_tensor(torch.ones(8, 6), mesh, [Shard(0)])
    opt.step()
    last = opt._runtime.plan.micro_groups[-1]  # type: ignore[attr-defined]
    late = last.owners[0]
    directions = opt._directions

    def slow(batch: Any, full: torch.Tensor) -> torch.Tensor:
        out = directions(batch, full)
        if any(it.name in last.names for it in batch.items):
            time.sleep(2.2)
        return out

    if tdist.get_rank() == late:
        opt._directions = slow  # type: ignore[method-assign]
    for _, p in named:
        p.grad = distribute_tensor(torch.ones(8, 6) * 2, mesh, [Shard(0)])
    return {
        "late": tdist.get_rank() == late,
        "groups": len(opt._runtime.plan.micro_groups),  # type: ignore[attr-defined]
        **_step_and_look(opt, [p for _, p in named]),
    }


def _step_and_look(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], closure: Any = None
) -> dict[str, Any]:
    """Step; what it raised, and whether every local shard and step counter stayed."""
    before = [local_tensor(p).clone() for p in params]
    counters = [float(opt.state[p]["step"]) for p in params]
    kind, message = "ok", ""
    try:
        opt.step(closure)
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
    unchanged = all(torch.equal(local_tensor(p), b) for p, b in zip(params, before, strict=True))
    steps = [float(opt.state[p]["step"]) for p in params]
    return {"kind": kind, "message": message, "unchanged": unchanged and steps == counters}


def test_a_rank_late_past_the_deadline_in_the_last_group_applies_nothing(dist: Any) -> None:
    """Catches: the late owner applying the step alone. Its peer had posted its part of
    every collective before it gave up at the deadline, so the late rank's collectives all
    completed and the vote said success: one rank's shards a step ahead of the other's,
    and no error on it."""
    out = dist(2).run(_owner_late_in_the_last_group, timeout=60)
    assert all(o["groups"] >= 2 for o in out), out
    _assert_no_rank_applied(out)


def _late_before_a_vote_only_step(where: str, check_every_step: bool) -> dict[str, Any]:
    """World 2, plain tensors (each rank updates them alone: the step's only collective is
    the vote); at the fourth step one rank takes 2.2 s ``where`` (its closure, its prepare,
    or before it calls ``step()``, there on a host whose wall clock is 1.5 s behind its
    peer's), past its peer's 1 s deadline in the vote."""
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    gen = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.nn.Parameter(torch.randn(8, 6, generator=gen))) for i in range(3)]
    opt = canzona.Muon(
        named,
        lr=0.02,
        pipeline=canzona.PipelineConfig(
            process_group=group, timeout_s=1.0, check_every_step=check_every_step
        ),
    )
    for step in range(3):
        for _, p in named:
            p.grad = torch.ones(8, 6) * (step + 1)
        opt.step()
    assert opt._runtime.plan is None  # type: ignore[attr-defined]  # nothing to plan
    late = tdist.get_rank() == 1
    prepare = opt._prepare

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(2.2)
        return prepare(*args, **kwargs)

    def closure() -> None:
        if late:
            time.sleep(2.2)

    if late and where == "prepare":
        opt._prepare = slow  # type: ignore[method-assign]
    for _, p in named:
        p.grad = torch.ones(8, 6) * 4
    params = [p for _, p in named]
    wall = time.time
    if late and where == "before":  # its forward and backward, say: no collective holds its peer
        time.sleep(2.2)
        time.time = lambda: wall() - 1.5  # type: ignore[assignment]
    try:
        looked = _step_and_look(opt, params, closure if where == "closure" else None)
        return {"late": late, **looked}
    finally:
        time.time = wall  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("where", "check_every_step"),
    [
        ("prepare", False),
        ("prepare", True),
        ("closure", False),
        ("before", False),
    ],
)
def test_a_rank_late_past_the_deadline_before_a_vote_only_step_applies_nothing(
    dist: Any, where: str, check_every_step: bool
) -> None:
    """Catches: the late rank applying the step alone. Its lateness falls before its
    pipeline starts (in its closure, its prepare, or before it calls ``step()``), and the
    vote, the step's only collective, completes on it (its peer had posted its part before
    giving up): its own time stays under the deadline, so only when its peer entered the
    vote (sent with the flags) shows that the peer may have left. ``before`` also catches
    entry times read from wall clocks, which hosts' clocks set apart make look short."""
    out = dist(2).run(_late_before_a_vote_only_step, where, check_every_step, timeout=60)
    _assert_no_rank_applied(out)


def _assert_no_rank_applied(out: list[dict[str, Any]]) -> None:
    """The waiting rank timed out, the late one learnt it before applying: nothing changed."""
    late = next(o for o in out if o["late"])
    waiting = next(o for o in out if not o["late"])
    assert waiting["kind"] == "CollectiveTimeoutError", waiting
    assert "did not complete within 1s" in waiting["message"], waiting
    assert "never built this optimizer" not in waiting["message"], waiting  # a later step
    assert late["kind"] == "CollectiveTimeoutError", late
    assert "peers gave up waiting for this rank past the 1s deadline" in late["message"], late
    assert late["unchanged"] and waiting["unchanged"], out
