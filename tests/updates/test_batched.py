"""The list ops of the element-wise phases equal the single-tensor ops bit for bit."""

from __future__ import annotations

import pytest
import torch

from canzona.updates.batched import (
    FLAT_BLEND_NUMEL,
    LERP_OUT_NUMEL,
    PrepareRun,
    mul_,
    muon_prepare_batch_,
    muon_prepare_runs_,
)


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


# small tensors (one blend per run), larger ones (one foreach copy and blend for both runs),
# large ones (the first run blends a tensor at a time into its payload, the second as before)
@pytest.mark.parametrize("scale", [1, 30, 300])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("homed", [False, True])
def test_muon_prepare_by_runs_equals_the_foreach_prepare(
    nesterov: bool, scale: int, homed: bool
) -> None:
    """Payloads filled a run at a time equal the foreach prepare's, bit for bit, and so do
    the momentum buffers, whether the blend concatenates the buffers (tensors of at most
    FLAT_BLEND_NUMEL elements), runs on the payload views, or writes each payload with its
    own lerp (at least LERP_OUT_NUMEL elements on average); with ``homed``, the first run's
    buffers lie back to back in one region (its home) and its momentum is updated there.
    Catches: a run filled from the buffers before the momentum update, a blend with the
    wrong weight or operands swapped, a run's tensors out of order, a home updated with the
    gradients as ``self`` (operands swapped) or left out of the foreach and not updated."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(4 * scale, 8), (3 * scale, 8), (5 * scale, 8), (2 * scale, 6), (7 * scale, 6)]
    assert (scale == 1) == all(r * c <= FLAT_BLEND_NUMEL for r, c in shapes)
    first_mean = sum(r * c for r, c in shapes[:3]) / 3
    second_mean = sum(r * c for r, c in shapes[3:]) / 2
    assert (first_mean >= LERP_OUT_NUMEL) == (scale == 300) and second_mean < LERP_OUT_NUMEL
    grads = [torch.randn(s, generator=gen) for s in shapes]
    bufs = [torch.randn(s, generator=gen) for s in shapes]
    want_bufs = [b.clone() for b in bufs]
    want = [torch.empty(s) for s in shapes]
    muon_prepare_batch_(want_bufs, grads, want, momentum=0.95, nesterov=nesterov)
    # two runs in buffer order (2, 0, 1) and (4, 3): as payload views of one flat buffer
    flat = torch.full((sum(g.numel() for g in grads),), float("nan"))
    cut = 96 * scale
    first = flat[:cut].view(-1, 8)
    second = flat[cut:].view(-1, 6)
    place = None
    if homed:  # the first run's buffers back to back, as optim.flat_homes.home lays them
        place = torch.cat([bufs[2], bufs[0], bufs[1]])
        bufs[2], bufs[0], bufs[1] = place.split([5 * scale, 4 * scale, 3 * scale])
    runs = [
        PrepareRun(
            (bufs[2], bufs[0], bufs[1]),
            (grads[2], grads[0], grads[1]),
            first,
            tuple(first.split([5 * scale, 4 * scale, 3 * scale])),
            place,
        ),
        PrepareRun(
            (bufs[4], bufs[3]),
            (grads[4], grads[3]),
            second,
            tuple(second.split([7 * scale, 2 * scale])),
        ),
    ]
    loose = [3, 4] if homed else list(range(5))
    muon_prepare_runs_(
        [bufs[k] for k in loose],
        [grads[k] for k in loose],
        runs,
        momentum=0.95,
        nesterov=nesterov,
    )
    for b, w in zip(bufs, want_bufs, strict=True):
        assert torch.equal(b, w)
    got = [*runs[0].views, *runs[1].views]
    for g, w in zip(got, [want[2], want[0], want[1], want[4], want[3]], strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize(
    ("buf_dtype", "payload_dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float64, torch.bfloat16),
        (torch.float64, torch.float32),
    ],
)
def test_a_payload_of_another_dtype_gets_the_blend_then_the_cast(
    buf_dtype: torch.dtype, payload_dtype: torch.dtype
) -> None:
    """The Nesterov blend written straight into a lower-precision payload (one lerp with
    ``out=`` per tensor on the CPU) equals torch's ``grad.lerp(buf, mu)`` in the buffers'
    dtype, then cast, bit for bit; a transposed payload view and a column-major gradient
    among them. Catches: the blend computed in the payload's dtype (its operands cast
    first), operands swapped."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(1, 1), (7, 13), (64, 96), (300, 257)]
    grads = [(torch.randn(s, generator=gen) * 1e3).to(buf_dtype) for s in shapes]
    grads[1] = grads[1].mT.contiguous().mT
    bufs = [torch.randn(s, generator=gen).to(buf_dtype) for s in shapes]
    want_bufs = [b.clone().lerp_(g, 1 - 0.95) for b, g in zip(bufs, grads, strict=True)]
    want = [g.lerp(b, 0.95).to(payload_dtype) for g, b in zip(grads, want_bufs, strict=True)]
    out = [torch.empty(s, dtype=payload_dtype) for s in shapes]
    out[2] = torch.empty(shapes[2][::-1], dtype=payload_dtype).mT
    muon_prepare_batch_(bufs, grads, out, momentum=0.95, nesterov=True)
    for b, w in zip(bufs, want_bufs, strict=True):
        assert torch.equal(b, w)
    for o, w in zip(out, want, strict=True):
        assert o.dtype == payload_dtype and torch.equal(o, w)
