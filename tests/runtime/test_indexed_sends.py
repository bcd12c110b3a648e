"""Sends of many small pieces read by one index equal the same sends packed piece by piece."""

from __future__ import annotations

from typing import Any

import torch

from canzona.runtime.buffers import Selector
from canzona.runtime.exchanges import assemble, concat, pack, piece_of
from canzona.runtime.layout import Fragment
from canzona.runtime.owner_index import gather_index
from canzona.runtime.payload_layout import INDEXED_NUMEL, SendPart, add_part, indexed
from canzona.runtime.scatter_index import ScatterRead, scatter_parts, scatter_send
from canzona.runtime.schedule_parts import Assembly, Indexed, OwnerBatch, Piece

CPU = torch.device("cpu")


def _views(parts: list[Any], buffers: list[torch.Tensor]) -> list[Any]:
    return [buffers[p[0]].narrow(0, p[1], p[2]) if isinstance(p, list) else p for p in parts]


def test_small_send_parts_of_one_buffer_are_read_by_one_index() -> None:
    buffers = [torch.randn(4000), torch.randn(300).to(torch.bfloat16)]
    mat = buffers[0].narrow(0, 100, 600).view(20, 30)  # a local matrix in buffer 0
    slot = torch.randn(4)
    parts: list[SendPart] = []
    classes: list[int | None] = []
    add_part(parts, slot, classes, None)  # the header's own slot: not in a buffer
    add_part(parts, (0, 0, 10), classes, 0)
    add_part(parts, (0, 10, 5), classes, 0)  # extends the range before it
    add_part(parts, mat[2:5, 3:7], classes, 0)
    add_part(parts, mat[6:9, 3:7], classes, 0)  # same layout: one pattern
    add_part(parts, mat[:, 28:], classes, 0)
    add_part(parts, (0, 1000, INDEXED_NUMEL), classes, 0)  # large: stays a range
    add_part(parts, (0, 50, 3), classes, 0)
    add_part(parts, mat[1:2, :], classes, 0)
    add_part(parts, (1, 7, 9), classes, 1)  # another buffer: another run
    add_part(parts, (1, 40, 2), classes, 1)
    add_part(parts, (0, 3000, 8), classes, 0)  # alone in its run: stays a range
    assert classes == [None, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    merged = indexed(parts, classes, buffers)
    kinds = [type(p).__name__ for p in merged]
    assert kinds == ["Tensor", "Indexed", "list", "Indexed", "Indexed", "list"]
    assert all(p.buffer is buffers[1] for p in merged[4:5] if isinstance(p, Indexed))
    want = pack(_views(parts, buffers), torch.float32, CPU)
    got = pack(_views(merged, buffers), torch.float32, CPU)
    assert torch.equal(got, want)


def _selector(rows: Any, cols: Any) -> Selector:
    return Selector(Fragment((rows, cols)), CPU)


def _batch(k: int, m: int, n: int) -> OwnerBatch:
    return OwnerBatch((None,) * k, 0, m, n, torch.float32)  # type: ignore[arg-type]


def _scatter(status: bool) -> tuple[list[Piece], list[int], list[OwnerBatch]]:
    batches = [_batch(3, 6, 8), _batch(2, 64, 40), _batch(1, 5, 4)]
    top = _selector(((0, 2),), ((0, 8),))
    strided = _selector(((1, 2), (4, 6)), ((2, 5), (6, 8)))  # two row runs, two column runs
    big = _selector(((0, 32),), ((0, 40),))  # 1280 elements: a piece of its own
    pieces = [
        Piece(0, 0, 2, top), Piece(0, 2, 1, strided), Piece(2, 0, 1, _selector(((1, 4),), ((1, 3),))),  # noqa: E501
        Piece(1, 0, 1, big), Piece(0, 1, 2, strided),
        Piece(1, 1, 1, big), Piece(0, 0, 1, top),
        Piece(2, 0, 1, _selector(((0, 5),), ((0, 4),))),
    ]  # fmt: skip
    bounds = [0, 3, 3, 5, 7, 8]  # five targets, the second receiving nothing
    return pieces, bounds, batches


def _piece_by_piece(
    pieces: list[Piece], bounds: list[int], outs: list[torch.Tensor], flag: torch.Tensor | None
) -> list[torch.Tensor]:
    parts: list[torch.Tensor] = []
    for t in range(len(bounds) - 1):
        if flag is not None:
            parts.append(flag)
        parts += [piece_of(outs, pc) for pc in pieces[bounds[t] : bounds[t + 1]]]
    return parts


def test_scatter_sends_read_by_index_equal_the_pieces() -> None:
    for status in (True, False):
        pieces, bounds, batches = _scatter(status)
        send = scatter_send(pieces, bounds, batches, status, CPU)
        reads = [it for it in send.items if isinstance(it, ScatterRead)]
        # the large pieces break the runs; without flags one small piece is left alone
        assert len(reads) == (3 if status else 2) and send.batches == (0, 2)
        gen = torch.Generator().manual_seed(3)
        outs = [torch.randn(len(b.items), b.m, b.n, generator=gen) for b in batches]
        outs[0] = outs[0].mT.contiguous().mT  # a transposed result, as Newton-Schulz's tall
        flag = torch.ones(1) if status else None
        want = concat(_piece_by_piece(pieces, bounds, outs, flag), torch.float32, CPU)
        got = concat(scatter_parts(send, outs, flag), torch.float32, CPU)
        assert torch.equal(got, want), status


def test_an_owner_stack_of_small_runs_is_read_by_one_index() -> None:
    batch = _batch(2, 6, 8)
    runs = [  # (first matrix, count, fragment): together they fill both matrices
        (0, 2, _selector(((0, 2),), ((0, 8),))),
        (0, 2, _selector(((2, 4),), ((0, 8),))),
        (0, 1, _selector(((4, 6),), ((0, 4),))),
        (1, 1, _selector(((4, 5), (5, 6)), ((0, 4),))),  # two row runs: index tensors
        (0, 2, _selector(((4, 6),), ((4, 8),))),
    ]
    offset = 3  # the header's slot before the first source's runs
    for start, count, sel in runs:
        batch.assembly.append(Assembly(offset, start, count, sel))
        offset += count * sel.shape[0] * sel.shape[1]
    recv = torch.randn(offset)
    want = assemble(batch, recv, CPU)  # run by run
    batch.index = gather_index(batch, CPU)
    assert batch.index is not None
    assert torch.equal(assemble(batch, recv, CPU), want)
    batch.assembly.pop()  # a part missing: placed run by run, as before
    assert gather_index(batch, CPU) is None
