"""Momentum buffers of small matrices homed in one flat buffer: same tensors, values and bits."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import canzona
from canzona.optim.flat_homes import home, span, spans
from canzona.optim.transaction import Backup


def test_home_moves_tensors_back_to_back_keeping_identity_and_values() -> None:
    """Catches: a slot at the wrong offset, a tensor copied instead of moved (a new
    object), values lost in the move, a second call copying again."""
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=gen) for s in [(2, 3), (4, 3), (1, 5)]]
    values = [t.clone() for t in ts]
    ids = [id(t) for t in ts]
    flat = home(ts)
    assert flat is not None and flat.numel() == 6 + 12 + 5
    assert [id(t) for t in ts] == ids
    for t, v, offset in zip(ts, values, (0, 6, 18), strict=True):
        assert torch.equal(t, v)
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert t.storage_offset() == offset and t.is_contiguous()
    ts[1].add_(1)  # the tensors are the buffer's slots
    assert torch.equal(flat[6:18].view(4, 3), values[1] + 1)
    again = home(ts)  # already back to back: nothing moves
    assert again is not None and again.data_ptr() == flat.data_ptr()


def test_home_refuses_what_it_cannot_move_and_moves_nothing() -> None:
    """Catches: a non-contiguous, grad-requiring, empty or mixed-dtype tensor homed."""
    refused = [
        [torch.zeros(2, 2), torch.zeros(3, 2).mT],
        [torch.zeros(2, 2), torch.zeros(2, 2, requires_grad=True)],
        [torch.zeros(2, 2), torch.zeros(0, 2)],
        [torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.float64)],
        [],
    ]
    for ts in refused:
        ptrs = [t.data_ptr() for t in ts]
        assert home(ts) is None
        assert [t.data_ptr() for t in ts] == ptrs


def test_home_moves_a_dtensor_local_shard_in_place(tmp_path: Path) -> None:
    """A DTensor's local shard homed: the DTensor reads and writes the buffer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = f"file://{tmp_path}/store"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dts = [distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]) for _ in range(2)]
        fulls = [d.full_tensor() for d in dts]
        flat = home([d._local_tensor for d in dts])
        assert flat is not None
        for d, f in zip(dts, fulls, strict=True):
            assert torch.equal(d.full_tensor(), f)
        dts[1].mul_(2)
        assert torch.equal(flat[8:].view(4, 2), fulls[1] * 2)
    finally:
        dist.destroy_process_group()


def test_span_and_spans_follow_storage_order() -> None:
    """Catches: a span across a gap or in the wrong order, spans merging non-adjacent
    tensors or losing one."""
    buf = torch.arange(20.0)
    a, b, c = buf[0:4].view(2, 2), buf[4:10].view(2, 3), buf[12:16]
    covered = span([a, b])
    assert covered is not None and torch.equal(covered, buf[:10])
    assert span([b, a]) is None and span([a, c]) is None
    assert span([a, b, c]) is None
    other = torch.ones(3)
    parts = spans([a, b, c, other])
    assert [p.numel() for p in parts] == [10, 4, 3]
    assert torch.equal(torch.cat(parts), torch.cat([a.view(-1), b.view(-1), c, other]))


def test_a_backup_of_homed_tensors_restores_them() -> None:
    """One operand for homed tensors, and the restore writes every tensor back."""
    ts = [torch.randn(3, 2) for _ in range(4)]
    assert home(ts[:3]) is not None
    saved = [t.clone() for t in ts]
    backup = Backup(ts)
    assert len(backup._parts[0].flat or ()) == 2  # the homed three, and the fourth
    backup.take()
    for t in ts:
        t.mul_(-3)
    backup.restore()
    for t, s in zip(ts, saved, strict=True):
        assert torch.equal(t, s)


SHAPES = [(8, 8), (6, 10), (8, 8), (12, 4), (3, 5)]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(steps)]


def _run(opt: torch.optim.Optimizer, params: list[nn.Parameter], grads: Any) -> None:
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_homes_small_momentum_buffers_and_stays_torch_muon(nesterov: bool) -> None:
    """The momentum buffers of small matrices share one storage after a step; the update
    stays torch.optim.Muon's bit for bit through a save and load of the state (into a fresh
    optimizer) and a buffer replaced by the user. Catches: the homing path not taken (the
    exactness tests would then not reach it), a home that loses the momentum, a reloaded
    or replaced buffer not homed again or homed stale."""
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    kw: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    opt = canzona.Muon(ours, **kw)
    ref = torch.optim.Muon(theirs, **kw)
    grads = _grads(6)
    _run(opt, ours, grads[:2])
    _run(ref, theirs, grads[:2])
    bufs = [opt.state[p]["momentum_buffer"] for p in ours]
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1
    # a save and load into a fresh optimizer, then a buffer replaced by an equal copy
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    opt = canzona.Muon(ours, **kw)
    opt.load_state_dict(torch.load(blob, weights_only=False))
    _run(opt, ours, grads[2:4])
    _run(ref, theirs, grads[2:4])
    opt.state[ours[2]]["momentum_buffer"] = opt.state[ours[2]]["momentum_buffer"].clone()
    _run(opt, ours, grads[4:])
    _run(ref, theirs, grads[4:])
    bufs = [opt.state[p]["momentum_buffer"] for p in ours]
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_home_of_a_tensor_that_refuses_set_is_none() -> None:
    """An inference tensor refuses ``set_`` outside inference mode: no home, values kept.
    Catches: the refusal raised out of the step (every later step would fail)."""
    with torch.inference_mode():
        frozen = torch.ones(2, 2)
    ts = [torch.zeros(2, 2), frozen]
    assert home(ts) is None
    assert torch.equal(ts[0], torch.zeros(2, 2)) and torch.equal(ts[1], torch.ones(2, 2))


def _muon_pair(nesterov: bool = True) -> tuple[Any, Any, list[nn.Parameter], list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(1)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    kw: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    ours = [nn.Parameter(v.clone()) for v in values]
    theirs = [nn.Parameter(v.clone()) for v in values]
    return canzona.Muon(ours, **kw), torch.optim.Muon(theirs, **kw), ours, theirs


def test_a_buffer_moved_in_place_is_homed_again() -> None:
    """``buf.data = ...`` keeps the tensor but gives it other storage: the next step sees
    it moved and builds its lists again. Catches: the step still updating the old home
    (the buffer, and the update after it, would lose the momentum)."""
    opt, ref, ours, theirs = _muon_pair()
    grads = _grads(4)
    _run(opt, ours, grads[:2])
    _run(ref, theirs, grads[:2])
    buf = opt.state[ours[1]]["momentum_buffer"]
    buf.data = buf.data.clone()  # the identity stays, the storage does not
    _run(opt, ours, grads[2:])
    _run(ref, theirs, grads[2:])
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


def test_a_buffer_left_out_of_a_new_home_gets_its_own_storage() -> None:
    """A parameter without a gradient for a step leaves the lists: the others stay in (or
    move to) one home and its buffer gets a storage of its own; the update stays
    torch.optim.Muon's. Catches: a left-out buffer left in the old home (it would keep
    a whole old home alive once the others move)."""
    opt, ref, ours, theirs = _muon_pair()
    grads = _grads(4)
    _run(opt, ours, grads[:2])
    _run(ref, theirs, grads[:2])
    for p, q, g in zip(ours[1:], theirs[1:], grads[2][1:], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    ours[0].grad = theirs[0].grad = None
    opt.step()
    ref.step()
    bufs = [opt.state[p]["momentum_buffer"] for p in ours]
    ptrs = [b.untyped_storage().data_ptr() for b in bufs]
    assert len(set(ptrs[1:])) == 1 and ptrs[0] != ptrs[1]  # the rest share a home
    assert bufs[0].untyped_storage().nbytes() == bufs[0].nbytes  # a storage of its own
    _run(opt, ours, grads[3:])
    _run(ref, theirs, grads[3:])
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
