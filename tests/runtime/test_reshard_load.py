"""Loaded state in other placements than its parameters' moves in canzona's own exchange.

DTensor's redistribution is a collective that waits without a deadline: a rank that failed in
it alone (out of memory) left the others waiting until the process group's own timeout. Here
every buffer is allocated before a vote, so a failure raises the same error on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

import canzona
from canzona.runtime import fragment_for, statecomm
from canzona.runtime import reshard as reshard_module
from canzona.runtime.watchdog import Watchdog

from _cases import (
    OWNER_KW,
    full_of,
    full_tensors,
    grad_steps,
    local_pieces,
    set_grads,
    sharded_params,
)
from _dist import mesh

TIMEOUT = 60
WHAT = "load_state_dict's move of the loaded state into its parameters' layouts"
OWNER_WHAT = "load_state_dict's move of the loaded owner-held state into the checkpoint layout"


def _dtensor(full: torch.Tensor, m: Any, placements: tuple[Placement, ...]) -> DTensor:
    """``full`` laid out in ``placements`` (any, ``_StridedShard`` too), without a collective."""
    coord = m.get_coordinate()
    local = fragment_for(full.shape, m.shape, placements, coord).read(full).contiguous()
    return DTensor.from_local(
        local, m, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


#: (mesh shape, tensor shape, dtype, source placements, target placements or None: plain)
CASES: list[tuple[tuple[int, ...], tuple[int, ...], torch.dtype, Any, Any]] = [
    ((4,), (7, 13), torch.float32, (Shard(0),), (Shard(1),)),
    ((4,), (5, 3), torch.float32, (Shard(1),), (Shard(0),)),  # ranks without columns
    ((4,), (9, 6), torch.bfloat16, (Replicate(),), (Shard(0),)),
    ((4,), (6, 10), torch.float32, (Shard(0),), (Replicate(),)),
    ((4,), (7, 13), torch.float64, (Shard(0),), None),
    ((4,), (11, 4, 6), torch.float32, (Shard(0),), (Shard(2),)),
    ((2, 2), (16, 12), torch.float32, (Shard(0), Shard(1)), (Replicate(), Shard(0))),
    ((2, 2), (10, 9), torch.bfloat16, (Shard(0), Shard(0)), (Shard(1), Replicate())),
    ((2, 2), (12, 8), torch.float32, (_StridedShard(0, split_factor=2), Shard(0)), (Shard(0),) * 2),
    ((2, 2), (13, 7), torch.float32, (Replicate(), Shard(1)), (Shard(1), Shard(0))),
    # fragments of several runs per dimension, as source and as target
    (
        (2, 2),
        (12, 8),
        torch.float32,
        (_StridedShard(0, split_factor=2), Shard(1)),
        (Shard(1), Shard(0)),
    ),
    (
        (2, 2),
        (12, 8),
        torch.float32,
        (Shard(1), Replicate()),
        (_StridedShard(0, split_factor=3), Shard(0)),
    ),
    ((4,), (8, 10), torch.bfloat16, (_StridedShard(0, split_factor=2),), (Shard(1),)),
]


def _moved(batch_bytes: int) -> list[bool]:
    """Every case in one call (several batches when ``batch_bytes`` is small), each rank's
    result against the target layout's slice of the full tensor, bit for bit."""
    reshard_module.BATCH_BYTES = batch_bytes
    gen = torch.Generator().manual_seed(3)
    pairs, wants = [], []
    for mesh_shape, shape, dtype, source, target in CASES:
        m = mesh(mesh_shape)
        full = torch.randn(shape, generator=gen).to(dtype)
        value = _dtensor(full, m, source)
        param = _dtensor(torch.zeros(shape, dtype=dtype), m, target) if target else torch.zeros(1)
        pairs.append((value, param))
        wants.append(_dtensor(full, m, target).to_local() if target else full)
    watchdog = Watchdog(tdist.group.WORLD, tdist.get_rank(), tdist.get_world_size(), 30.0)
    got = reshard_module.to_storage_layouts(pairs, watchdog=watchdog, what=WHAT)
    out = []
    for g, w, (_, param) in zip(got, wants, pairs, strict=True):
        local = g.to_local() if isinstance(g, DTensor) else g
        same_layout = not isinstance(param, DTensor) or (
            isinstance(g, DTensor) and g.placements == param.placements
        )
        out.append(same_layout and local.dtype == w.dtype and torch.equal(local, w))
    return out


@pytest.mark.parametrize("batch_bytes", [256 * 2**20, 200], ids=["one-exchange", "batches"])
def test_loaded_state_moves_into_any_layout_exactly(dist: Any, batch_bytes: int) -> None:
    """Catches: a piece read from or written to the wrong place (uneven shards, ranks that
    hold nothing, 3-D, ``_StridedShard``, a replicated source read once), a dtype lost in
    the byte packing, or batches whose pieces are paired out of order."""
    for out in dist(4).run(_moved, batch_bytes, timeout=TIMEOUT):
        assert out == [True] * len(CASES)


MATRICES = {"w0": (12, 8), "w1": (7, 13)}
OTHERS = {"bias": (10,), "plain": (6, 4)}


def _optimizer(params: list[tuple[str, nn.Parameter]], name: str) -> Any:
    by_name = dict(params)
    return getattr(canzona, name)(
        [
            {"params": [by_name[n] for n in MATRICES], "param_names": list(MATRICES)},
            {
                "params": [by_name[n] for n in OTHERS],
                "param_names": list(OTHERS),
                "algorithm": "adamw",
            },
        ],
        **OWNER_KW.get(name, {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}),
        pipeline=canzona.PipelineConfig(timeout_s=20.0),
    )


def _params(fulls: dict[str, torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
    sharded = [n for n in fulls if n != "plain"]
    out = sharded_params(
        {n: fulls[n] for n in sharded}, mesh((4,)), {n: (Shard(0),) for n in sharded}
    )
    return [*out, ("plain", nn.Parameter(fulls["plain"].clone()))]


def _relaid(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with every element-wise DTensor in other placements: columns, or the whole on
    every rank; the plain parameter's moments as a DTensor sharded by rows."""
    state = {}
    for pid, entry in sd["state"].items():
        state[pid] = {}
        for key, value in entry.items():
            if isinstance(value, DTensor):
                other = (Shard(1),) if value.ndim > 1 else (Replicate(),)
                value = value.redistribute(value.device_mesh, other)
            elif key != "step" and value.ndim == 2:  # the plain parameter's
                value = _dtensor(value, mesh((4,)), (Shard(0),))
            state[pid][key] = value.clone()  # not the saving optimizer's own tensors
    return {**sd, "state": state}


def _resumed(name: str, fail: str) -> dict[str, Any]:
    """Two steps, save; a second optimizer over copies of the parameters (one step of its
    own) loads the save relaid in other placements, owner-held state included (``fail``:
    rank 1's first try runs out of memory in the ``"element-wise"`` or the ``"owner-held"``
    state's move); both take three more steps."""
    shapes = {**MATRICES, **OTHERS}
    grads = grad_steps(shapes, 6)
    params = _params(full_tensors(shapes))
    opt = _optimizer(params, name)
    for g in grads[:2]:
        set_grads(params, g)
        opt.step()
    saved = _relaid(opt.state_dict())
    params2 = _params({n: full_of(p).detach() for n, p in params})
    opt2 = _optimizer(params2, name)
    set_grads(params2, grads[5])
    opt2.step()  # state of its own, which a failed load must leave as it is
    with torch.no_grad():
        for (_, p), (_, q) in zip(params, params2, strict=True):
            q.copy_(p)
    out: dict[str, Any] = {"error": None}
    if fail:
        before = (local_pieces(params2, opt2), _saved(opt2))
        with _out_of_memory_on_rank_1(fail):
            try:
                opt2.load_state_dict(saved)
            except canzona.UpdateFailedError as exc:
                out["error"] = str(exc)
        after = (local_pieces(params2, opt2), _saved(opt2))
        out["unchanged"] = all(
            b.keys() == a.keys() and all(torch.equal(v, a[k]) for k, v in b.items())
            for b, a in zip(before, after, strict=True)
        )
    opt2.load_state_dict(saved)
    for g in grads[2:5]:
        for ps, o in ((params, opt), (params2, opt2)):
            set_grads(ps, g)
            o.step()
    out["same"] = all(
        torch.equal(full_of(p), full_of(q)) for (_, p), (_, q) in zip(params, params2, strict=True)
    )
    return out


def _out_of_memory(*_: Any) -> torch.Tensor:
    raise torch.OutOfMemoryError("injected")


@contextmanager
def _out_of_memory_on_rank_1(where: str) -> Iterator[None]:
    """Rank 1 runs out of memory packing the ``where`` state's move (the other's goes on)."""
    read, move = reshard_module._read, statecomm.reshard_loaded

    def failing_move(*args: Any, **kwargs: Any) -> Any:
        reshard_module._read = _out_of_memory  # type: ignore[assignment]
        try:
            return move(*args, **kwargs)
        finally:
            reshard_module._read = read

    if tdist.get_rank() == 1:
        if where == "owner-held":
            statecomm.reshard_loaded = failing_move  # type: ignore[assignment]
        else:
            reshard_module._read = _out_of_memory  # type: ignore[assignment]
    try:
        yield
    finally:
        reshard_module._read, statecomm.reshard_loaded = read, move


def _saved(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``state_dict()``'s tensors, whole (collective): owner-held state included."""
    out = {}
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"{pid} {key}"] = (
                value.full_tensor() if isinstance(value, DTensor) else value.clone()
            )
    return out


@pytest.mark.parametrize("name", ["Muon", "Shampoo"])
def test_a_checkpoint_in_other_placements_resumes_exactly(dist: Any, name: str) -> None:
    """Catches: state loaded in other placements (columns, replicated, a plain parameter's
    as row shards; Shampoo's owner-held factors too) rebuilt wrong in its parameters' or
    the checkpoint's layout: the resumed run must equal the run that never stopped, bit
    for bit."""
    for out in dist(4).run(_resumed, name, "", timeout=TIMEOUT):
        assert out == {"error": None, "same": True}


@pytest.mark.parametrize(
    ("name", "where"),
    [("Muon", "element-wise"), ("Shampoo", "element-wise"), ("Shampoo", "owner-held")],
)
def test_a_load_whose_move_fails_on_one_rank_fails_everywhere(
    dist: Any, name: str, where: str
) -> None:
    """Catches: a rank that ran out of memory moving the loaded state while the others
    waited in the exchange (before: in DTensor's redistribution, until the process group's
    own timeout). Every rank must raise the same error naming rank 1, change nothing (the
    optimizer's state, owner-held included), and load it when asked again, resuming
    exactly. The element-wise state moves first; Shampoo's factors after it."""
    what = WHAT if where == "element-wise" else OWNER_WHAT
    want = f"{what} failed on ranks [1] (rank 1: OutOfMemoryError: injected); nothing was loaded"
    for out in dist(4).run(_resumed, name, where, timeout=TIMEOUT):
        assert out == {"error": want, "unchanged": True, "same": True}


def _refused_on_rank_1() -> str:
    m = mesh((4,))
    value = _dtensor(torch.arange(8.0).view(4, 2), m, (Shard(0),))
    mine = ValueError("wrong here") if tdist.get_rank() == 1 else None
    watchdog = Watchdog(tdist.group.WORLD, tdist.get_rank(), tdist.get_world_size(), 30.0)
    try:
        reshard_module.reshard_loaded(
            [(value, (Shard(1),))], watchdog=watchdog, what="x", error=mine
        )
    except canzona.UpdateFailedError as exc:
        return str(exc)
    return "no error"


def test_what_one_rank_found_wrong_fails_the_move_everywhere(dist: Any) -> None:
    """Catches: a rank that found the loaded state wrong (a mesh with ranks outside the
    process group, another mesh than the parameter's) raising alone while the others
    entered the exchange."""
    want = "x failed on ranks [1] (rank 1: ValueError: wrong here); nothing was loaded"
    assert dist(4).run(_refused_on_rank_1, timeout=TIMEOUT) == [want] * 4
