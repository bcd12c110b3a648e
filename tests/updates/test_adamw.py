"""The element-wise AdamW step reproduces torch.optim.AdamW(foreach=False) bit for bit."""

from __future__ import annotations

import pytest
import torch

from canzona.updates import adamw_


@pytest.mark.parametrize("shape", [(7,), (16, 24), (3, 5, 4)])
@pytest.mark.parametrize(
    ("lr", "betas", "eps", "weight_decay"),
    [(1e-3, (0.9, 0.999), 1e-8, 0.01), (3e-2, (0.8, 0.95), 1e-6, 0.0)],
)
def test_matches_torch_adamw_bitwise(
    shape: tuple[int, ...], lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]

    param = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW(
        [param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
    )
    ours, m, v = p0.clone(), torch.zeros(shape), torch.zeros(shape)
    for step, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        adamw_(ours, g, m, v, step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        assert torch.equal(ours, param.detach())
    state = opt.state[param]
    assert torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])


def test_shards_give_the_full_result() -> None:
    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(10, 6, generator=gen), torch.randn(10, 6, generator=gen)
    full, m, v = p.clone(), torch.zeros(10, 6), torch.zeros(10, 6)
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    adamw_(full, g, m, v, 1, **kwargs)  # type: ignore[arg-type]
    parts = []
    for rows in (slice(0, 3), slice(3, 10)):
        part = p[rows].clone()
        adamw_(part, g[rows], torch.zeros_like(part), torch.zeros_like(part), 1, **kwargs)  # type: ignore[arg-type]
        parts.append(part)
    assert torch.equal(torch.cat(parts), full)


def test_zero_gradient_is_finite_and_step_is_checked() -> None:
    p, m, v = torch.ones(4), torch.zeros(4), torch.zeros(4)
    adamw_(p, torch.zeros(4), m, v, 1, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    assert torch.equal(p, torch.ones(4))
    with pytest.raises(ValueError, match="step"):
        adamw_(p, torch.zeros(4), m, v, 0, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
