"""The step's local gradients read in one pass: the same tensors and errors as one by one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.placement_types import Replicate, Shard

import canzona
from canzona.runtime import grad_codes, local_grad, local_grads
from canzona.runtime.tensors import NO_GRAD

from _cases import full_of, full_tensors, grad_steps, reference_muon, set_grads, sharded_params
from _dist import mesh


def _cases() -> dict[str, Any]:
    dm = mesh((2,))
    row = nn.Parameter(distribute_tensor(torch.randn(4, 6), dm, [Shard(0)]))
    col = nn.Parameter(distribute_tensor(torch.randn(4, 6), dm, [Shard(0)]))
    plain = nn.Parameter(torch.randn(3, 3))
    row.grad = distribute_tensor(torch.arange(24.0).view(4, 6), dm, [Shard(0)])
    col.grad = distribute_tensor(torch.arange(24.0).view(4, 6), dm, [Replicate()])
    plain.grad = torch.ones(3, 3)
    names = ["x", "row", "col", "plain"]
    params = [row, col, plain]
    raw = [None, *(p.grad for p in params)]
    got = local_grads(names, [1, 2, 3], params, raw, [NO_GRAD, *grad_codes(params, raw[1:])])
    one_by_one = [local_grad(names[i], p) for i, p in zip([1, 2, 3], params, strict=True)]
    errors = {}
    bad = nn.Parameter(distribute_tensor(torch.randn(4, 6), dm, [Shard(0)]))
    for label, grad in (("none", None), ("plain", torch.ones(4, 6)), ("sparse", torch.eye(4, 6))):
        bad.grad = grad.to_sparse() if label == "sparse" else grad
        try:
            local_grads(["bad"], [0], [bad], [bad.grad], grad_codes([bad], [bad.grad]))
        except (RuntimeError, TypeError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    return {
        "same": [torch.equal(a, b) for a, b in zip(got, one_by_one, strict=True)],
        "row_is_local": got[0].data_ptr() == row.grad._local_tensor.data_ptr(),
        "plain_is_grad": got[2] is plain.grad,
        "col_rows": got[1].tolist(),
        "errors": errors,
    }


def test_local_grads_read_what_local_grad_reads(dist: Any) -> None:
    """Catches: a one-pass read that skips the placement check (a Replicate gradient of a
    row-sharded parameter read whole instead of redistributed), copies the shards, or lets
    a missing, plain-for-DTensor or sparse gradient through without local_grad's error."""
    for rank, out in enumerate(dist(2).run(_cases)):
        assert out["same"] == [True, True, True]
        assert out["row_is_local"] and out["plain_is_grad"]
        rows = torch.arange(24.0).view(4, 6)[2 * rank : 2 * rank + 2]
        assert out["col_rows"] == rows.tolist()  # redistributed to the parameter's rows
        assert out["errors"] == {
            "none": "RuntimeError: parameter 'bad' has no gradient",
            "plain": (
                "TypeError: parameter 'bad' is a DTensor but its gradient is a plain tensor; "
                "set .grad to a DTensor with the parameter's placements"
            ),
            "sparse": "RuntimeError: parameter 'bad': sparse gradients are not supported",
        }


class _CountingParam(nn.Parameter):
    """A parameter that counts the reads of its ``.grad`` (all instances together)."""

    reads = 0

    @property  # type: ignore[override]
    def grad(self) -> torch.Tensor | None:
        type(self).reads += 1
        return torch.Tensor.grad.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        torch.Tensor.grad.__set__(self, value)  # type: ignore[attr-defined]


def test_a_step_reads_each_gradient_once() -> None:
    """Catches: a step that reads ``p.grad`` again after the presence flags (each read costs
    microseconds per parameter on the host, the most of any per-parameter work measured)."""
    params = [_CountingParam(torch.randn(8, 4)) for _ in range(6)]
    bias = _CountingParam(torch.randn(4))
    opt = canzona.Muon(
        [{"params": params}, {"params": [bias], "algorithm": "adamw"}],
        pipeline=canzona.PipelineConfig(skip_nonfinite=True),
    )
    for step in range(3):
        for p in (*params, bias):
            p.grad = torch.randn_like(p)
        _CountingParam.reads = 0
        opt.step()
        assert _CountingParam.reads == len(params) + 1, f"step {step}"


def _placements_on_some_ranks(when: str) -> dict[str, Any]:
    """Rank 1 (``when``: at the first step, or once steps are steady and the header rides the
    first gather) or every rank (``"every rank"``) gives ``w0`` a gradient in ``Shard(1)``,
    its parameter being in ``Shard(0)``; then the steps go on with ``Shard(0)`` gradients."""
    import torch.distributed as tdist

    rank = tdist.get_rank()
    dm = mesh((2,))
    shapes = {"w0": (6, 4), "w1": (4, 6)}
    fulls, grads = full_tensors(shapes), grad_steps(shapes, 7)
    params = sharded_params(fulls, dm, {n: (Shard(0),) for n in shapes})
    flops = canzona.PlanConfig(cost="flops")  # no re-pricing: the header rides from step 2
    opt = canzona.Muon(params, lr=0.02, plan=flops)
    odd = 0 if when == "first step" else 3
    outcomes, rode = [], []
    for k, step in enumerate(grads):
        set_grads(params, step)
        if k == odd:  # distribute_tensor is a collective: every rank builds it
            moved = distribute_tensor(step["w0"], dm, [Shard(1)])
            if rank == 1 or when == "every rank":
                params[0][1].grad = moved
        before = {n: full_of(p) for n, p in params}
        try:
            rode.append(opt._runtime._rides())  # this step's header rides its first gather
            opt.step()
            outcomes.append("ok")
        except Exception as exc:
            unchanged = all(torch.equal(full_of(p), before[n]) for n, p in params)
            outcomes.append(f"{type(exc).__name__} unchanged={unchanged}: {exc}")
    want = reference_muon(
        fulls, [g for k, g in enumerate(grads) if k != odd or when == "every rank"], lr=0.02
    )  # the step that raised changed nothing
    same = [torch.equal(full_of(p), want[n]) for n, p in params]
    return {"outcomes": outcomes, "same": same, "rode": rode}


@pytest.mark.parametrize("when", ["first step", "steady steps", "every rank"])
def test_a_gradient_in_other_placements_on_some_ranks_is_named_everywhere(
    dist: Any, when: str
) -> None:
    """A gradient in other placements than its parameter's is redistributed as it is read (a
    collective): on one rank only, every rank raises ``GradientMismatchError`` naming it,
    before any redistribution, and nothing changes; on every rank, the step runs. Catches:
    the codes left out of the header (rank 1 waited in the redistribution, rank 0 in the
    step's first collective, until the deadline), and a header riding the first gather
    while gradients are redistributed before it."""
    out = dist(2).run(_placements_on_some_ranks, when)
    odd = 0 if when == "first step" else 3
    for o in out:
        for k, outcome in enumerate(o["outcomes"]):
            if k != odd or when == "every rank":
                assert outcome == "ok", (k, outcome)
            else:
                assert outcome.startswith("GradientMismatchError unchanged=True: "), outcome
                assert "'w0' has a gradient in other placements than the parameter's on " in (
                    outcome
                )
                assert "ranks [1] only" in outcome and "'w1'" not in outcome
        assert o["same"] == [True, True]  # bitwise torch.optim.Muon on the steps taken
        # the odd step's header rode its first gather once the steps were steady; none
        # rides right after it (nor after a step whose gradients were redistributed), and
        # the steps are steady again later
        assert o["rode"][odd] == (when != "first step"), o["rode"]
        assert not o["rode"][odd + 1] and any(o["rode"][odd + 2 :]), o["rode"]


def _gradient_on_another_mesh() -> dict[str, Any]:
    """A gradient in its parameter's placements on a mesh of the same ranks in the other
    order (each rank's local rows are the other's)."""
    from torch.distributed.device_mesh import DeviceMesh

    a = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp",))
    b = DeviceMesh("cpu", [1, 0], mesh_dim_names=("dp",))
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    p = nn.Parameter(distribute_tensor(w, a, [Shard(0)], src_data_rank=None))
    p.grad = distribute_tensor(g, b, [Shard(0)], src_data_rank=None)
    opt = canzona.Muon([("w", p)], lr=0.02)
    try:
        opt.step()
        outcome = "no error"
    except canzona.UpdateFailedError as exc:
        outcome = str(exc)
    return {"outcome": outcome, "unchanged": torch.equal(p.full_tensor(), w)}


def test_a_gradient_on_another_mesh_fails_the_step_everywhere(dist: Any) -> None:
    """Catches: a gradient compared with its parameter by placements alone, its local shard
    taken as the parameter's: each rank stepped with the other rank's rows, silently."""
    for out in dist(2).run(_gradient_on_another_mesh):
        assert "raised RuntimeError: parameter 'w' is on DeviceMesh(" in out["outcome"], out
        assert "but its gradient on DeviceMesh(" in out["outcome"], out
        assert out["unchanged"] is True
