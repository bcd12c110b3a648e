"""An ``optimizer.state`` entry cleared on some ranks only is refused by the step's check.

A parameter's state lies in pieces on every rank (a sharded momentum) or in one copy per
replica (a plain tensor's AdamW moments): clearing the entry on one rank would start one
piece or one replica afresh while the others go on, and the ranks would drift apart
without an error. The step's check compares which entries begin afresh: every rank raises
the same error and nothing changes; cleared on every rank, the step goes on as a fresh
optimizer's would.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

import canzona

from _cases import full_of, full_tensors, grad_steps, local_pieces, set_grads, sharded_params
from _dist import mesh

TIMEOUT = 60
MATRICES = {"w0": (16, 8), "w1": (8, 24), "w2": (12, 12)}
#: A 1-D parameter (AdamW on its shards) and a plain tensor (a replica on every rank).
OTHERS = {"bias": (16,), "plain": (6, 4)}


def _params() -> list[tuple[str, nn.Parameter]]:
    fulls = full_tensors({**MATRICES, **OTHERS})
    sharded = sharded_params(
        {n: fulls[n] for n in (*MATRICES, "bias")},
        mesh((2,)),
        {n: (Shard(0),) for n in (*MATRICES, "bias")},
    )
    return [*sharded, ("plain", nn.Parameter(fulls["plain"].clone()))]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _run(cleared: str, after: int, everywhere: bool, gap: bool = False) -> dict[str, Any]:
    """``after`` steps (``gap``: the last without ``cleared``'s gradient), ``cleared``'s
    entry cleared on rank 1 (every rank: ``everywhere``), a step tried; then cleared on
    every rank, two more steps."""
    params = _params()
    by_name = dict(params)
    opt = canzona.Muon(
        [
            {"params": [by_name[n] for n in MATRICES], "param_names": list(MATRICES)},
            {
                "params": [by_name[n] for n in OTHERS],
                "param_names": list(OTHERS),
                "algorithm": "adamw",
            },
        ],
        lr=0.02,
        momentum=0.9,
        weight_decay=0.1,
    )
    grads = grad_steps({**MATRICES, **OTHERS}, after + 3)
    for k, g in enumerate(grads[:after]):
        set_grads(params, g)
        if gap and k == after - 1:
            by_name[cleared].grad = None
        opt.step()
    if everywhere or tdist.get_rank() == 1:
        opt.state.pop(by_name[cleared])
    set_grads(params, grads[after])
    out: dict[str, Any] = {"error": None}
    if not everywhere:
        before = local_pieces(params, opt)
        try:
            opt.step()
        except canzona.UpdateFailedError as exc:
            out["error"] = str(exc)
        out["unchanged"] = _same(before, local_pieces(params, opt))
        opt.state.pop(by_name[cleared], None)  # now on every rank
    for g in grads[after:]:
        set_grads(params, g)
        opt.step()
    out["params"] = {n: full_of(p) for n, p in params}
    out["state"] = {
        f"{n} {k}": (v.full_tensor() if isinstance(v, DTensor) else v.clone())
        for n, p in params
        for k, v in opt.state[p].items()
    }
    return out


def _cleared_on_one_rank(cleared: str, after: int, gap: bool) -> dict[str, Any]:
    got = _run(cleared, after, everywhere=False, gap=gap)
    want = _run(cleared, after, everywhere=True, gap=gap)
    return {
        "error": got["error"],
        "unchanged": got["unchanged"],
        "params": all(torch.equal(got["params"][n], v) for n, v in want["params"].items()),
        "state": got["state"].keys() == want["state"].keys()
        and all(torch.equal(got["state"][k], v) for k, v in want["state"].items()),
    }


@pytest.mark.parametrize("cleared", ["w1", "bias", "plain"])
@pytest.mark.parametrize(
    ("after", "gap"), [(1, False), (3, False), (4, True)], ids=["apart", "riding", "gap"]
)
def test_a_state_entry_cleared_on_one_rank_fails_the_step_everywhere(
    dist: Any, cleared: str, after: int, gap: bool
) -> None:
    """Catches: a rank that started a sharded momentum's piece (``w1``), its shard's AdamW
    moments (``bias``) or its replica's (``plain``) afresh alone while the other rank went
    on, silently apart (before: no error, the ranks' pieces of one state from different
    steps, the plain tensor's replicas different). Every rank must raise the same error
    naming the parameter and the rank, change nothing, and once the entry is cleared on
    every rank go on bit for bit as a run where every rank cleared it at once. After one
    step the check runs on its own; after three it rides the first gather; ``gap``: the
    step before the clear had no gradient for the parameter (its entry is outside the
    step's cached lists, which must not vouch for it)."""
    want = f"optimizer.state entries were cleared on some ranks only: {cleared!r} on ranks [1]. "
    for out in dist(2).run(_cleared_on_one_rank, cleared, after, gap, timeout=TIMEOUT):
        assert out["error"] is not None and out["error"].startswith(want), out["error"]
        assert out["error"].endswith("nothing changed"), out["error"]
        assert out == {**out, "unchanged": True, "params": True, "state": True}
