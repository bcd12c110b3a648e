"""An owner-held state exchange that fails on one rank fails on every rank and moves nothing."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

import canzona
import canzona.runtime.statecomm as statecomm

from _cases import OWNER_KW, full_of, full_tensors, grad_steps, set_grads, sharded_params
from _dist import mesh

TIMEOUT = 120
FIRST = {f"a{i}": s for i, s in enumerate([(16, 16), (24, 8), (8, 24), (7, 13)])}
LATER = {f"b{i}": s for i, s in enumerate([(12, 12), (20, 6), (6, 20)])}
INJECTED = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"
EXPORT = "exporting the owner-held state"
IMPORT = "moving the owner-held state to its owners"


def _fulls(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dict()`` with full tensors (collective)."""
    out: dict[str, Any] = {}
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"{pid}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a
    )


def _held(opt: Any, params: list[tuple[str, Any]], *, clone: bool) -> dict[str, Any]:
    """What this rank holds: its shards, its element-wise state and its owner-held state."""
    take = (lambda t: t.clone()) if clone else (lambda t: t)
    out = {f"param {n}": take(p.to_local()) for n, p in params}
    for i, (_, p) in enumerate(params):
        for key, v in opt.state.get(p, {}).items():
            out[f"state {i}.{key}"] = take(v.to_local() if isinstance(v, DTensor) else v)
    for item_key, state in opt._owner.states.items():
        for key, v in state.items():
            out[f"owner {item_key}.{key}"] = take(v)
    return out


def _setup(name: str) -> tuple[list[tuple[str, Any]], Any]:
    """FIRST and LATER sharded on a (2,) mesh; an optimizer over FIRST."""
    shapes = {**FIRST, **LATER}
    params = sharded_params(full_tensors(shapes), mesh((2,)), {n: (Shard(0),) for n in shapes})
    opt = getattr(canzona, name)(
        params[: len(FIRST)],
        **OWNER_KW[name],
        plan=canzona.PlanConfig(strategy="numel"),
        pipeline=canzona.PipelineConfig(timeout_s=20.0),
    )
    return params, opt


def _run(name: str, case: dict[str, Any] | None) -> dict[str, Any]:
    """Two steps on FIRST, ``add_param_group(LATER)`` (the next step re-plans and moves the
    owner-held state), and three more steps; before the third, every run loads the state
    saved after the first and saves. ``case["when"]`` says which call fails: rank
    ``case["rank"]``'s ``case["buffer"]``-th state buffer of the exchange ``case["what"]``
    raises in the move (``"move"``), the save (``"save"``) or the load (``"load"``).
    The failed call is taken again."""
    params, opt = _setup(name)
    grads = grad_steps({**FIRST, **LATER}, 5)
    real = statecomm.state_buffer
    calls = [0]
    out: dict[str, Any] = {}

    def buffer(what: str, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        if case is not None and what.startswith(case["what"]) and armed[0]:
            calls[0] += 1
            if calls[0] == case["buffer"]:
                armed[0] = False
                raise torch.OutOfMemoryError(INJECTED)
        return real(what, numel, dtype, device)

    def attempt(fn: Any, when: str) -> None:
        mine = case is not None and case["when"] == when
        before = _held(opt, params, clone=True)  # state_dict() would move the state
        armed[0] = mine and tdist.get_rank() == case["rank"]  # type: ignore[index]
        try:
            fn()
        except canzona.UpdateFailedError as exc:
            armed[0] = False
            out["error"] = str(exc)
            out["unchanged"] = _same(before, _held(opt, params, clone=False))
            fn()  # taken again
        if mine:
            out["armed_left"] = armed[0]

    armed = [False]
    statecomm.state_buffer = buffer
    try:
        for step, g in enumerate(grads):
            if step == 1:
                saved = opt.state_dict()  # whose tensors the next step changes in place
                saved["state"] = {
                    pid: {k: v.clone() for k, v in entry.items()}
                    for pid, entry in saved["state"].items()
                }
            if step == 2:
                attempt(partial(opt.load_state_dict, saved), "load")  # back to after step 1
                attempt(opt.state_dict, "save")
                opt.add_param_group({"params": params[len(FIRST) :]})
            set_grads(params if step >= 2 else params[: len(FIRST)], g)
            if step == 2:
                attempt(opt.step, "move")
            else:
                opt.step()
    finally:
        statecomm.state_buffer = real
    return {**out, "params": {n: full_of(p) for n, p in params}, "state": _fulls(opt)}


def _failing_and_straight(name: str, case: dict[str, Any]) -> dict[str, Any]:
    failed = _run(name, case)
    straight = _run(name, None)
    return {
        "error": failed.get("error"),
        "unchanged": failed.get("unchanged"),
        "armed_left": failed["armed_left"],
        "params": all(torch.equal(failed["params"][n], v) for n, v in straight["params"].items()),
        "state": _same(failed["state"], straight["state"]),
    }


CASES = [
    {"when": "move", "what": EXPORT, "buffer": 1, "rank": 1},  # the exported pieces
    {"when": "move", "what": f"{EXPORT}'s receive buffer", "buffer": 1, "rank": 0},
    {"when": "move", "what": IMPORT, "buffer": 2, "rank": 1},  # a new owner's state
    {"when": "move", "what": f"{IMPORT}'s send buffer", "buffer": 1, "rank": 0},
    {"when": "save", "what": f"{EXPORT}'s send buffer", "buffer": 1, "rank": 1},
    {"when": "load", "what": f"{IMPORT}'s receive buffer", "buffer": 1, "rank": 1},
]


@pytest.mark.parametrize("name", ["Shampoo", "NorMuon"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c['when']}-{c['what']}" for c in CASES])
def test_a_state_exchange_that_fails_on_one_rank_fails_everywhere(
    dist: Any, name: str, case: dict[str, Any]
) -> None:
    """Catches: a rank whose allocation for the owner-held state's exchange (after a re-plan,
    in ``state_dict()`` or ``load_state_dict()``) raised alone while the others entered the
    exchange and waited for it until their timeout; and a failed move or load that lost or
    changed state. Every rank must raise the same error naming the failing rank, nothing may
    change, and once the call is taken again the run must equal one without the failure,
    bit for bit."""
    phase = EXPORT if case["what"].startswith(EXPORT) else IMPORT
    want = f"{phase} failed on ranks [{case['rank']}] (rank {case['rank']}: OutOfMemoryError: "
    for out in dist(2).run(_failing_and_straight, name, case, timeout=TIMEOUT):
        assert out["armed_left"] is False, out  # the injected failure happened
        assert out["error"] is not None and out["error"].startswith(want), out["error"]
        assert INJECTED in out["error"], out["error"]
        assert out["error"].endswith("the owner-held state stays where it was"), out["error"]
        assert out["unchanged"] is True
        assert out["params"] is True
        assert out["state"] is True


def _cleared_on_one_rank(name: str, straight: bool = False) -> dict[str, Any]:
    """Two steps, then rank 1 alone clears the first parameter's ``optimizer.state`` entry;
    ``state_dict()`` and a step that re-plans (after ``add_param_group``) are tried, then
    rank 0 clears it too and the step is taken again, and once more. ``straight``: both
    ranks clear it at once, and nothing fails."""
    params, opt = _setup(name)
    grads = grad_steps({**FIRST, **LATER}, 4)
    for g in grads[:2]:
        set_grads(params[: len(FIRST)], g)
        opt.step()
    first = params[0][1]
    if straight or tdist.get_rank() == 1:
        opt.state.pop(first)
    out: dict[str, Any] = {}
    if not straight:
        try:
            opt.state_dict()
        except canzona.UpdateFailedError as exc:
            out["save"] = str(exc)
    routes = dict(opt._runtime.routes)
    opt.add_param_group({"params": params[len(FIRST) :]})
    set_grads(params, grads[2])
    before = _held(opt, params, clone=True)
    if not straight:
        try:
            opt.step()
        except canzona.UpdateFailedError as exc:
            out["move"] = str(exc)
            out["unchanged"] = _same(before, _held(opt, params, clone=False))
    opt.state.pop(first, None)  # cleared on every rank: the step goes on
    opt.step()
    out["stepped"] = "step" in opt.state[first]
    # the re-plan gave some matrix with state another owner (its state moved)
    out["moved"] = any(
        routes[n].computing != opt._runtime.routes[n].computing for n in routes if n != "a0"
    )
    set_grads(params, grads[3])
    opt.step()
    return {**out, "params": {n: full_of(p) for n, p in params}, "state": _fulls(opt)}


def _cleared_and_straight(name: str) -> dict[str, Any]:
    failed, straight = _cleared_on_one_rank(name), _cleared_on_one_rank(name, straight=True)
    return {
        **failed,
        "params": all(torch.equal(failed["params"][n], v) for n, v in straight["params"].items()),
        "state": _same(failed["state"], straight["state"]),
    }


@pytest.mark.parametrize("name", ["Shampoo", "NorMuon"])
def test_a_state_entry_cleared_on_one_rank_fails_the_save_and_the_step_everywhere(
    dist: Any, name: str
) -> None:
    """Catches: ranks that read different owner-held state entries from their own
    ``optimizer.state`` entering different exchanges (gloo aborted the job with a
    collective mismatch; a rank without entries skipped the exchange the others waited in).
    Every rank must raise the same error naming the parameter, in ``state_dict()`` and in
    the step that re-plans (its check, before the move), change nothing, and step on
    once the entry is cleared on every rank, exactly as a run where every rank cleared it
    at once (before: matrices whose owner the re-plan changed started afresh)."""
    detail = "('a0' on ranks [0] only), as when an optimizer.state entry is cleared on some"
    cleared = "optimizer.state entries were cleared on some ranks only: 'a0' on ranks [1]. "
    for out in dist(2).run(_cleared_and_straight, name, timeout=TIMEOUT):
        assert out["save"].startswith(f"{EXPORT}: the ranks hold owner-held state"), out
        assert detail in out["save"], out["save"]
        assert out["move"].startswith(cleared), out["move"]
        assert out["unchanged"] is True
        assert out["stepped"] is True
        # the refused move kept where the state lives: the next step moved it, and the
        # matrices that changed owners continued their state (before: afresh, from zeros)
        assert out["moved"] is True
        assert out["params"] is True
        assert out["state"] is True


def _load_after_a_failed_move(name: str) -> dict[str, Any]:
    """A re-plan's move that fails on rank 1 at every try; then a checkpoint of another
    optimizer over the same parameters (and groups) is loaded, and exported again."""
    params, opt = _setup(name)
    other = getattr(canzona, name)(
        params[: len(FIRST)], **OWNER_KW[name], pipeline=canzona.PipelineConfig(timeout_s=20.0)
    )
    other.add_param_group({"params": params[len(FIRST) :]})
    grads = grad_steps({**FIRST, **LATER}, 3)
    set_grads(params, grads[0])
    other.step()
    saved = other.state_dict()
    want = _fulls(other)
    for g in grads[1:]:
        set_grads(params[: len(FIRST)], g)
        opt.step()
    opt.add_param_group({"params": params[len(FIRST) :]})
    set_grads(params, grads[2])
    real = statecomm.state_buffer

    def buffer(what: str, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
        if what.startswith(EXPORT) and tdist.get_rank() == 1:
            raise torch.OutOfMemoryError(INJECTED)
        return real(what, numel, dtype, device)

    out: dict[str, Any] = {}
    statecomm.state_buffer = buffer
    try:
        with pytest.raises(canzona.UpdateFailedError, match=f"{EXPORT} failed on ranks \\[1\\]"):
            opt.step()  # the move of the old state to the new plan's owners
        opt.load_state_dict(saved)  # replaces that state: nothing to move first
    finally:
        statecomm.state_buffer = real
    out["loaded"] = _same(_fulls(opt), want)
    opt.step()
    out["stepped"] = "step" in opt.state[params[-1][1]]
    return out


@pytest.mark.parametrize("name", ["Shampoo", "NorMuon"])
def test_a_checkpoint_loads_where_the_old_state_cannot_move(dist: Any, name: str) -> None:
    """Catches: ``load_state_dict()`` first moving the owner-held state it replaces to the
    new plan's owners, so that after a move that keeps failing (a rank out of memory for
    it) no checkpoint could be loaded either, although loading one is the way back. The
    load must succeed, hold the checkpoint's state bit for bit, and the job step on."""
    for out in dist(2).run(_load_after_a_failed_move, name, timeout=TIMEOUT):
        assert out == {"loaded": True, "stepped": True}
