"""Muon's three phases reproduce torch.optim.Muon bit for bit, on full matrices and on shards."""

from __future__ import annotations

import itertools

import pytest
import torch

from canzona.updates import (
    ADJUST_LR_FNS,
    muon_apply_,
    muon_direction,
    muon_lr,
    muon_prepare_,
)

STEPS = 4
LR = 0.02


def _grads(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(STEPS)]


def _torch_muon(p0: torch.Tensor, grads: list[torch.Tensor], **group: object) -> torch.Tensor:
    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Muon([param], lr=LR, **group)  # type: ignore[arg-type]
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return param.detach()


def _ours(
    p0: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr_fn: str | None,
) -> torch.Tensor:
    param, buf = p0.clone(), torch.zeros_like(p0)
    adjusted = muon_lr(LR, adjust_lr_fn, p0.shape)
    for g in grads:
        blended = muon_prepare_(buf, g, momentum=momentum, nesterov=nesterov)
        direction = muon_direction(blended)
        muon_apply_(param, direction, lr=LR, weight_decay=weight_decay, adjusted_lr=adjusted)
    return param


CASES = list(
    itertools.product(
        [(24, 16), (16, 24), (32, 32)],
        [True, False],
        [0.0, 0.1],
        [None, "original", "match_rms_adamw"],
    )
)


@pytest.mark.parametrize(("shape", "nesterov", "weight_decay", "adjust_lr_fn"), CASES)
def test_matches_torch_muon_bitwise(
    shape: tuple[int, int], nesterov: bool, weight_decay: float, adjust_lr_fn: str | None
) -> None:
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    grads = _grads(shape, seed=8)
    group = {
        "momentum": 0.9,
        "nesterov": nesterov,
        "weight_decay": weight_decay,
        "adjust_lr_fn": adjust_lr_fn,
    }
    expected = _torch_muon(p0, grads, **group)
    assert torch.equal(_ours(p0, grads, **group), expected)  # type: ignore[arg-type]


def test_stacked_directions_match_torch_muon_bitwise() -> None:
    # Four same-shape matrices through one batched direction call (the owner's micro-group).
    shape = (4, 32, 48)
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    grads = _grads(shape, seed=10)
    expected = torch.stack(
        [_torch_muon(p0[i], [g[i] for g in grads], weight_decay=0.1) for i in range(4)]
    )
    param, buf = p0.clone(), torch.zeros_like(p0)
    adjusted = muon_lr(LR, None, shape)
    for g in grads:
        direction = muon_direction(muon_prepare_(buf, g, momentum=0.95, nesterov=True))
        muon_apply_(param, direction, lr=LR, weight_decay=0.1, adjusted_lr=adjusted)
    assert torch.equal(param, expected)


def test_prepare_and_apply_are_elementwise_on_shards() -> None:
    # Rows split in uneven shards (as FSDP's Shard(0) does) give the full result bit for bit.
    shape = (20, 12)
    gen = torch.Generator().manual_seed(11)
    p_full, g = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    buf_full = torch.randn(shape, generator=gen)
    blended_full = muon_prepare_(buf_full.clone(), g, momentum=0.95, nesterov=True)
    direction = muon_direction(blended_full)
    expected = p_full.clone()
    muon_apply_(expected, direction, lr=LR, weight_decay=0.1, adjusted_lr=0.05)

    blended_parts, new_parts = [], []
    for rows in (slice(0, 7), slice(7, 14), slice(14, 20)):
        buf = buf_full[rows].clone()
        blended_parts.append(muon_prepare_(buf, g[rows], momentum=0.95, nesterov=True))
        part = p_full[rows].clone()
        muon_apply_(part, direction[rows], lr=LR, weight_decay=0.1, adjusted_lr=0.05)
        new_parts.append(part)
    assert torch.equal(torch.cat(blended_parts), blended_full)
    assert torch.equal(torch.cat(new_parts), expected)


def test_prepare_without_nesterov_returns_the_buffer() -> None:
    buf, g = torch.zeros(3, 4), torch.ones(3, 4)
    out = muon_prepare_(buf, g, momentum=0.9, nesterov=False)
    assert out is buf
    assert torch.allclose(buf, torch.full((3, 4), 0.1))


def test_lr_adjustment() -> None:
    assert muon_lr(0.1, None, (32, 8)) == pytest.approx(0.2)
    assert muon_lr(0.1, "original", (8, 32)) == pytest.approx(0.1)
    assert muon_lr(0.1, "match_rms_adamw", (8, 32)) == pytest.approx(0.1 * 0.2 * 32**0.5)
    assert muon_lr(0.1, None, (5, 32, 8)) == pytest.approx(0.2)  # trailing dims of a stack
    # spectral is sqrt(m / n) on both sides of the square; original never goes below 1
    assert muon_lr(0.1, "spectral", (32, 8)) == pytest.approx(0.2)
    assert muon_lr(0.1, "spectral", (8, 32)) == pytest.approx(0.05)
    assert muon_lr(0.1, "unit_rms", (8, 32)) == pytest.approx(0.1 * 32**0.5)
    assert muon_lr(0.1, "unit_rms", (32, 8)) == pytest.approx(0.1 * 32**0.5)
    assert muon_lr(0.1, "none", (32, 8)) == 0.1
    with pytest.raises(ValueError, match=r"adjust_lr_fn.*'scion'"):
        muon_lr(0.1, "scion", (4, 4))
    with pytest.raises(ValueError, match="matrix shape"):
        muon_lr(0.1, None, (4,))


@pytest.mark.parametrize("adjust_lr_fn", [None, *ADJUST_LR_FNS])
@pytest.mark.parametrize("shape", [(32, 8), (8, 32), (24, 24)])
def test_lr_scale_multiplies_and_is_exact_at_one(
    adjust_lr_fn: str | None, shape: tuple[int, int]
) -> None:
    base = muon_lr(0.02, adjust_lr_fn, shape)
    assert muon_lr(0.02, adjust_lr_fn, shape, scale=1.0) == base  # bitwise: torch's value
    assert muon_lr(0.02, adjust_lr_fn, shape, scale=0.5) == pytest.approx(0.5 * base, rel=1e-15)
    assert muon_lr(0.02, "unit_rms", shape, scale=0.2) == pytest.approx(
        muon_lr(0.02, "match_rms_adamw", shape), rel=1e-15
    )


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_lr_scale_must_be_positive_and_finite(scale: float) -> None:
    with pytest.raises(ValueError, match=f"scale.*{scale!r}"):
        muon_lr(0.1, None, (4, 4), scale=scale)


def _semi_orthogonal(m: int, n: int) -> torch.Tensor:
    q = torch.linalg.qr(
        torch.randn(
            max(m, n), min(m, n), generator=torch.Generator().manual_seed(0), dtype=torch.float64
        )
    )[0]
    return q if m >= n else q.T


@pytest.mark.parametrize("shape", [(48, 12), (12, 48), (20, 20)])
def test_lr_modes_give_the_documented_size_of_an_orthogonal_update(shape: tuple[int, int]) -> None:
    # What each mode promises for lr = 1 and O with every singular value 1 (Muon's target):
    # entry RMS 1 (unit_rms) or 0.2 (match_rms_adamw); spectral norm sqrt(m / n) (spectral);
    # spectral norm sqrt(max(1, m / n)) (original). A swapped m / n or min / max fails here.
    m, n = shape
    o = _semi_orthogonal(m, n)

    def rms(x: torch.Tensor) -> float:
        return x.square().mean().sqrt().item()

    def spectral(x: torch.Tensor) -> float:
        return torch.linalg.matrix_norm(x, ord=2).item()

    assert rms(muon_lr(1.0, "unit_rms", shape) * o) == pytest.approx(1.0, rel=1e-12)
    assert rms(muon_lr(1.0, "match_rms_adamw", shape) * o) == pytest.approx(0.2, rel=1e-12)
    assert spectral(muon_lr(1.0, "spectral", shape) * o) == pytest.approx((m / n) ** 0.5, rel=1e-12)
    assert spectral(muon_lr(1.0, "original", shape) * o) == pytest.approx(
        max(1.0, m / n) ** 0.5, rel=1e-12
    )
    assert rms(muon_lr(1.0, "none", shape) * o) == pytest.approx(max(m, n) ** -0.5, rel=1e-12)


def test_zero_gradient_gives_finite_update() -> None:
    param, buf = torch.ones(16, 24), torch.zeros(16, 24)
    direction = muon_direction(
        muon_prepare_(buf, torch.zeros(16, 24), momentum=0.95, nesterov=True)
    )
    assert torch.equal(direction, torch.zeros_like(direction))
    muon_apply_(param, direction, lr=0.0, weight_decay=0.1, adjusted_lr=0.0)
    assert torch.equal(param, torch.ones(16, 24))
