"""Element-wise AdamW step, bitwise equal to ``torch.optim.AdamW(foreach=False)``."""

from __future__ import annotations

from torch import Tensor

from canzona.updates.common import check_step

__all__ = ["adamw_"]


def adamw_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    r"""One AdamW step on a tensor (or any shard of it); updates ``param`` and the moments in place.

    The op sequence of torch 2.13's single-tensor Adam with decoupled weight decay (no amsgrad,
    no maximize, not capturable), hence bitwise equal to ``torch.optim.AdamW(foreach=False)``:

    .. math::
        \theta &\leftarrow \theta (1 - \gamma\lambda) \quad (\lambda \ne 0) \\
        m &\leftarrow m + (1-\beta_1)(g - m), \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \theta &\leftarrow \theta - \frac{\gamma}{1-\beta_1^t}
            \frac{m}{\sqrt{v} / \sqrt{1-\beta_2^t} + \epsilon}

    ``step`` is a Python int, so nothing here synchronises with the device.

    Args:
        param: Parameter, updated in place.
        grad: Gradient.
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        step: 1-based count of this update (incremented by the caller before the call).
        lr: Learning rate.
        betas: ``(beta1, beta2)``.
        eps: Denominator term.
        weight_decay: Decoupled weight decay coefficient.
    """
    check_step(step)
    beta1, beta2 = betas
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
