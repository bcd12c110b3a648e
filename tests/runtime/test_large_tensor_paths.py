"""Paths for large tensors (row-major results, strided parts packed by one copy, Nesterov
blends a tensor at a time): the same values, and the same bits in a distributed step."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.distributed.tensor.placement_types import Shard

import canzona
import canzona.runtime.exchanges as exchanges
import canzona.runtime.pipeline as pipeline
import canzona.updates.batched as batched
from canzona.runtime.exchanges import STRIDED_COPY_NUMEL, concat, row_major
from canzona.updates.batched import LERP_OUT_NUMEL

from _cases import CountOps, compare, full_tensors, grad_steps, plan, reference_muon, run_steps
from _cases import sharded_params as shard
from _dist import mesh

CPU = torch.device("cpu")


def _transposed(k: int, m: int, n: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``k`` matrices ``m x n`` laid out as Newton–Schulz returns tall ones (transposes)."""
    gen = torch.Generator().manual_seed(k * m + n)
    return torch.randn((k, n, m), generator=gen).to(dtype).mT


def test_row_major_copies_large_transposed_cpu_stacks_only() -> None:
    """Catches: a row-major copy with other values or still strided, and one taken for a
    small, contiguous or merely strided stack (which it would only slow down)."""
    big = _transposed(3, 512, 128)
    assert big.shape[1] * big.shape[2] >= STRIDED_COPY_NUMEL and not big.is_contiguous()
    out = row_major(big)
    assert out.is_contiguous() and out.dtype == big.dtype
    assert torch.equal(out, big)
    small = _transposed(3, 24, 8)
    rows = torch.randn(3, 1024, 128).narrow(1, 0, 512)  # strided, not transposed
    flat = big.contiguous()
    for same in (small, rows, flat):
        assert row_major(same) is same


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_concat_packs_the_parts_flattened_one_after_another(dtype: torch.dtype) -> None:
    """Every mix of parts: small and large, contiguous, row blocks of a stack, transposed,
    one-element flags, a cast. Catches: a part out of place, a large strided part copied in
    its memory order instead of row-major, a run around it dropped or shifted."""
    big = _transposed(2, 512, 128, torch.float32)
    stack = torch.randn(3, 512, 64)
    flag = torch.ones(1)
    parts = [
        flag,
        stack.narrow(1, 0, 256),  # large, strided (rows of each matrix)
        torch.randn(40),
        torch.randn(2, 5, 3).mT,  # small, strided
        big,  # large, transposed
        flag,
        big.narrow(1, 256, 256),
        stack.narrow(1, 256, 256).contiguous(),
    ]
    want = torch.cat([p.reshape(-1) for p in parts]).to(dtype)
    got = concat(parts, dtype, CPU)
    assert got.dtype == dtype and torch.equal(got, want)
    assert concat([], dtype, CPU).numel() == 0


def test_concat_copies_a_large_strided_part_once() -> None:
    """Catches: flattening a large strided part before packing it (a clone, then the copy
    into the buffer: every element copied twice)."""
    stack = torch.randn(4, 512, 64)
    parts = [stack.narrow(1, 0, 256), torch.randn(8), _transposed(2, 512, 128, torch.float32)]
    with CountOps(key=lambda op: str(op.overloadpacket)) as seen:
        concat(parts, torch.bfloat16, CPU)
    assert seen.ops["aten.clone"] == 0 and seen.ops["aten._reshape_copy"] == 0, seen.ops
    assert seen.ops["aten.copy_"] == 2 + 1  # the two strided parts, the run of one


# tall matrices stacked per owner (Newton–Schulz returns a batch of them transposed; a
# matrix alone comes back row-major), the big ones sharded by rows (each rank sends the
# owner a block of rows of every matrix: a strided part of the scatter), small ones, a wide one
SHAPES = {
    "tall": (8, 96, 48),
    "tall_pair": (2, 40, 32),
    "tall_one": (24, 8),
    "wide": (8, 24),
    "stack": (3, 40, 20),
}
KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}


def _exact_with_small_threshold(world: int) -> dict[str, Any]:
    """A step with every large-tensor path taken for these small ones, against torch's Muon."""
    fulls = full_tensors(SHAPES)
    grads = grad_steps(SHAPES, 2)
    want = reference_muon(fulls, grads, **KW)
    seen: Counter[str] = Counter()
    original_row_major, original_fill = pipeline.row_major, exchanges._fill

    def spy_row_major(stack: torch.Tensor) -> torch.Tensor:
        out = original_row_major(stack)
        seen["row_major"] += out is not stack
        return out

    def spy_fill(region: torch.Tensor, run: list[torch.Tensor]) -> None:
        seen["direct"] += 1
        original_fill(region, run)

    original_lerp = torch.lerp

    def spy_lerp(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen["lerp_cast"] += "out" in kwargs and kwargs["out"].dtype != args[0].dtype
        return original_lerp(*args, **kwargs)

    exchanges.STRIDED_COPY_NUMEL = batched.LERP_OUT_NUMEL = 64
    pipeline.row_major, exchanges._fill = spy_row_major, spy_fill
    torch.lerp = spy_lerp  # type: ignore[assignment]
    try:
        out: dict[str, Any] = {}
        for strategy in ("canzona", "replicated"):
            rows = {n: (Shard(1 if n == "tall" else 0),) for n in SHAPES}
            params = shard(fulls, mesh((world,)), rows)
            got = run_steps(
                lambda ps, s=strategy: canzona.Muon(ps, **KW, plan=plan(s)), params, grads
            )
            out[strategy] = {n: eq for n, (eq, _) in compare(got, want).items()}
    finally:
        exchanges.STRIDED_COPY_NUMEL = STRIDED_COPY_NUMEL
        batched.LERP_OUT_NUMEL = LERP_OUT_NUMEL
        pipeline.row_major, exchanges._fill = original_row_major, original_fill
        torch.lerp = original_lerp  # type: ignore[assignment]
    out["seen"] = dict(seen)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_large_tensor_paths_keep_muon_bitwise(dist: Any, world: int) -> None:
    """Tall results made row-major (96 x 48 ones by ATen's blocked transpose), scatter
    parts copied straight into the send buffer, payloads blended a tensor at a time (fp32
    blends written straight into the bf16 payloads, ``out=`` of the payload's dtype): still
    torch.optim.Muon bit for bit, for the owners' scatter and for the fragments each rank
    keeps under ``replicated``. Catches: a transposed copy that moves values, a part packed
    at the wrong offset, a blend with its operands swapped."""
    ranks = dist(world).run(_exact_with_small_threshold, world)
    seen: Counter[str] = sum((Counter(out["seen"]) for out in ranks), Counter())
    assert seen["row_major"] > 0 and seen["direct"] > 0 and seen["lerp_cast"] > 0, seen
    for out in ranks:
        for strategy in ("canzona", "replicated"):
            assert all(out[strategy].values()), (strategy, out[strategy])
