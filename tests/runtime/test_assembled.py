"""Shards that arrive in many small pieces are applied whole, read by one index, and exact."""

from __future__ import annotations

from typing import Any

import torch
from test_blocks_exact import reference_blocks
from torch.distributed.tensor.placement_types import Shard

import canzona
from canzona import Split
from canzona.runtime.assembled import Assembled, assemble_deliveries
from canzona.runtime.schedule_parts import Delivery, Target, rects

from _cases import compare, full_tensors, grad_steps, plan, set_grads, sharded_params
from _dist import mesh

F32 = torch.float32


def _rect(param: int, rows: Any, cols: Any) -> Target:
    return Target(param, None, 1, None, rects(rows, cols))


def _deliveries() -> tuple[list[Delivery], dict[int, tuple[int, ...]], dict[int, int]]:
    """Parameters 0, 1, 4 and 7 qualify; 2, 3, 5 and 6 each fail one condition."""
    shapes: dict[int, tuple[int, ...]] = {p: (2, 4) for p in range(8)}
    shapes |= {0: (6, 8), 1: (4, 5), 6: (100, 100)}
    sizes = {p: 4 for p in shapes} | {2: 2}  # parameter 2 is half precision
    out: list[Delivery] = []
    offset = 0

    def add(shape: tuple[int, int], targets: list[Target], full: tuple[int, int] = (12, 4)) -> None:
        nonlocal offset
        count = sum(t.count for t in targets)
        out.append(Delivery(offset, shape, 0, full, F32, tuple(targets), count))
        offset += count * shape[0] * shape[1] + 3  # a gap, as another owner's flag would be

    # 0: four fragments of two column runs each (the second starts past column 0 of the
    # fragment), two per delivery, rows on either side
    add((3, 4), [_rect(0, ((0, 3),), ((0, 2), (4, 6))), _rect(0, ((0, 3),), ((2, 4), (6, 8)))])
    add((3, 4), [_rect(0, ((3, 6),), ((2, 4), (6, 8))), _rect(0, ((3, 6),), ((0, 2), (4, 6)))])
    # 1: rows at full width, one block then two
    add((2, 5), [Target(1, None, 1, (0, 2))], full=(2, 5))
    add((1, 5), [Target(1, None, 2, (2, 4))], full=(2, 5))
    # 2: half precision, three pieces
    add((1, 4), [_rect(2, ((0, 1),), ((0, 4),))])
    add((1, 2), [_rect(2, ((1, 2),), ((0, 2),)), _rect(2, ((1, 2),), ((2, 4),))])
    # 3 would qualify but shares a delivery with 5, whose pieces leave two elements out
    add((1, 4), [_rect(3, ((0, 1),), ((0, 4),)), _rect(5, ((0, 1),), ((0, 4),))])
    add((1, 4), [_rect(3, ((1, 2),), ((0, 4),))])
    add((1, 2), [_rect(5, ((1, 2),), ((0, 2),))])
    # 4 and 7 share both their deliveries
    add((1, 4), [_rect(4, ((0, 1),), ((0, 4),)), _rect(7, ((0, 1),), ((0, 4),))])
    add((1, 4), [_rect(7, ((1, 2),), ((0, 4),)), _rect(4, ((1, 2),), ((0, 4),))])
    # 6: two pieces of 5000 elements, too large to be worth an index
    add((50, 100), [_rect(6, ((0, 50),), ((0, 100),))])
    add((50, 100), [_rect(6, ((50, 100),), ((0, 100),))])
    return out, shapes, sizes


def _by_piece(
    out: torch.Tensor, deliveries: list[Delivery], param: int, shape: Any
) -> torch.Tensor:
    """The parameter's shard written piece by piece, as the apply reads each target."""
    local = torch.full(shape, float("nan"))
    for d in deliveries:
        data = out.narrow(0, d.offset, d.count * d.shape[0] * d.shape[1]).view(d.count, *d.shape)
        i = 0
        for t in d.targets:
            if t.param == param and t.rows is not None:
                local[t.rows[0] : t.rows[1]] = data[i : i + t.count].reshape(-1, shape[1])
            elif t.param == param and t.rects is not None:
                for (f0, f1), (g0, g1), (r0, r1), (c0, c1) in t.rects:
                    local[r0:r1, c0:c1] = data[i, f0:f1, g0:g1]
            i += t.count
    return local


def test_the_index_reads_each_shard_as_its_pieces_would_write_it() -> None:
    deliveries, shapes, sizes = _deliveries()
    rest, assembled = assemble_deliveries(
        deliveries, shapes, sizes.__getitem__, torch.device("cpu")
    )
    assert isinstance(assembled, Assembled)
    assert [w.param for w in assembled.params] == [0, 1, 4, 7]
    assert [(w.offset, w.shape, w.full) for w in assembled.params] == [
        (0, (6, 8), (12, 4)), (48, (4, 5), (2, 5)), (68, (2, 4), (12, 4)), (76, (2, 4), (12, 4)),
    ]  # fmt: skip
    assert rest == [d for d in deliveries if d.targets[0].param not in (0, 1, 4, 7)]
    out = torch.randn(deliveries[-1].offset + 5000)
    read = out.index_select(0, assembled.index)
    for w in assembled.params:
        got = read.narrow(0, w.offset, w.shape[0] * w.shape[1]).view(w.shape)
        assert torch.equal(got, _by_piece(out, deliveries, w.param, w.shape)), w.param


def test_nothing_qualifies_nothing_changes() -> None:
    deliveries, shapes, sizes = _deliveries()
    few = [d for d in deliveries if d.targets[0].param not in (0, 1, 4, 7)]
    rest, assembled = assemble_deliveries(few, shapes, sizes.__getitem__, torch.device("cpu"))
    assert assembled is None and rest == few


KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
SHAPES = {"o": (12, 16), "o2": (8, 24), "plain": (10, 12)}
SPLITS = {"o": Split(dim=1, size=4), "o2": Split(dim=1, size=4)}


def _case() -> dict[str, Any]:
    """Column blocks of row shards: a rank that owns none of a parameter's blocks gets its
    shard in one small piece per block, and applies it whole."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 3)
    want = reference_blocks(fulls, grads, lambda ps: torch.optim.Muon(ps, **KW), SPLITS)
    params = sharded_params(fulls, mesh((4,)), {n: (Shard(0),) for n in SHAPES})
    groups: list[dict[str, Any]] = [
        {"params": [(n, p)], "split": SPLITS[n]} for n, p in params if n in SPLITS
    ]
    groups.append({"params": [(n, p) for n, p in params if n not in SPLITS]})
    opt = canzona.Muon(groups, **KW, plan=plan("round_robin"))
    assembled = []
    for g in grads:
        set_grads(params, g)
        opt.step()
        assembled.append(opt.last_step_stats.assembled)
    got = {n: p.full_tensor() for n, p in params}
    return {"equal": {n: eq for n, (eq, _) in compare(got, want).items()}, "assembled": assembled}


def test_assembled_shards_match_torch_muon_on_their_blocks(dist: Any) -> None:
    per_rank = dist(4).run(_case)
    for r in per_rank:
        assert r["equal"] == {"o": True, "o2": True, "plain": True}
    counts = [r["assembled"] for r in per_rank]
    assert sum(c[-1] for c in counts) > 0, counts  # the path ran on some rank
    assert all(len(set(c)) == 1 for c in counts), counts  # every step alike
