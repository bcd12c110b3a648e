"""The list ops of the element-wise phases equal the single-tensor ops bit for bit."""

from __future__ import annotations

import pytest
import torch

from canzona.updates.batched import mul_


def _tensors(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, generator=gen).to(dtype) for _ in range(3)]


@pytest.mark.parametrize(
    "calls",
    [
        # a reused factor must be the one of this value and dtype: 0.1 rounds differently in
        # float32 and float64, and 0.0 and -0.0 compare (and hash) equal but give other zeros
        [(torch.float32, 0.1), (torch.float64, 0.1), (torch.float32, 0.1)],
        [(torch.float32, 0.0), (torch.float32, -0.0), (torch.float32, 0.0)],
        [(torch.bfloat16, 0.998), (torch.float32, 0.998), (torch.float64, 0.998)],
        [(torch.float32, float(v)) for v in (0.5, 0.25, 0.5, 0.125, 0.25)],
    ],
)
def test_mul_equals_tensor_mul_over_repeated_calls(
    calls: list[tuple[torch.dtype, float]],
) -> None:
    for seed, (dtype, value) in enumerate(calls):
        got = _tensors(dtype, seed)
        want = [t.clone() for t in got]
        mul_(got, value)
        for g, w in zip(got, want, strict=True):
            w.mul_(value)
            assert torch.equal(g, w)
            assert torch.equal(torch.signbit(g), torch.signbit(w))  # equal() ignores -0.0
