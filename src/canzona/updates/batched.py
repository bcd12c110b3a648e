"""The element-wise phases on lists of local tensors: one ``torch._foreach_*`` op per phase.

Each function runs, for every tensor of its lists, the op sequence of its single-tensor
counterpart (:func:`muon_prepare_`, :func:`muon_apply_`, :func:`shampoo_apply_`,
:func:`soap_apply_`, :func:`adamw_`), so the results are bitwise equal to a Python loop over
them; the host pays one dispatch per op and list instead of one per op and tensor.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from canzona.updates.common import check_step
from canzona.updates.soap import SOAPHParams, soap_step_size

_DTYPE = operator.attrgetter("dtype")

__all__ = [
    "FLAT_BLEND_NUMEL",
    "LERP_OUT_NUMEL",
    "PrepareRun",
    "adamw_moments_",
    "adamw_params_",
    "decay_and_step_",
    "flat_blend",
    "mul_",
    "muon_prepare_batch_",
    "muon_prepare_runs_",
    "soap_apply_batch_",
]


#: Mean elements per tensor up to which a CPU run's Nesterov blend concatenates the buffers
#: (see :func:`muon_prepare_runs_`). Measured on torch 2.13's CPU kernels: one foreach lerp_
#: costs 0.46, 0.52, 0.79, 1.7 µs per tensor of 32, 256, 1024, 4096 fp32 elements, the
#: concatenation and one lerp_ 0.11, 0.28, 0.93, 4.6 µs.
FLAT_BLEND_NUMEL = 512
#: Mean elements per tensor from which a CPU run's Nesterov blend writes each payload with its
#: own ``torch.lerp(grad, buf, mu, out=payload)``: one pass over the gradient instead of the
#: concatenation's copy and a blend that reads it back. Measured on torch 2.13 (one thread,
#: fp32, cold caches), per tensor against concatenation plus one foreach ``lerp_``: 1.04x
#: the time at 4096 elements, 0.82x at 8192, 0.72x at 65536, 0.75x at 262144.
LERP_OUT_NUMEL = 8192

#: The last 0-dim CPU factors of :func:`mul_` (a constant decay is one per step and dtype).
_FACTORS: dict[tuple[float, float, torch.dtype], Tensor] = {}


def _factor(value: float, dtype: torch.dtype) -> Tensor:
    """A 0-dim CPU tensor holding ``value`` in ``dtype`` (reused: the ops only read it)."""
    key = (value, math.copysign(1.0, value), dtype)  # 0.0 == -0.0, but not as factors
    factor = _FACTORS.get(key)
    if factor is None:
        if len(_FACTORS) >= 8:
            _FACTORS.clear()
        factor = _FACTORS[key] = torch.tensor(value, dtype=dtype)
    return factor


def mul_(tensors: Sequence[Tensor], value: float) -> None:
    """``t.mul_(value)`` for every tensor, bitwise.

    On the CPU, ``torch._foreach_mul_`` with a Python scalar rounds the scalar to a
    half-precision tensor's dtype before multiplying (``Tensor.mul_`` multiplies in
    float32) and dispatches slowly. A 0-dim tensor factor of the tensors' computation
    dtype (float32 for half precision and float32, float64 for float64) gives
    ``Tensor.mul_``'s results (measured on torch 2.13's CPU kernels) at a third of the
    cost. Elsewhere the Python scalar is used.

    Args:
        tensors: Tensors, updated in place.
        value: The factor.
    """
    if not tensors:
        return
    if tensors[0].device.type != "cpu":
        torch._foreach_mul_(list(tensors), value)
        return
    dtypes = set(map(_DTYPE, tensors))
    if len(dtypes) == 1:
        dtype = torch.promote_types(dtypes.pop(), torch.float32)
        torch._foreach_mul_(list(tensors), _factor(value, dtype))
        return
    for t in tensors:
        t.mul_(value)


def muon_prepare_batch_(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    out: Sequence[Tensor],
    *,
    momentum: float,
    nesterov: bool,
) -> None:
    r"""Muon's momentum for every tensor: :math:`B \leftarrow \mu B + (1-\mu) G`, then the payload.

    Writes ``G.lerp(B, mu)`` (Nesterov) or ``B`` into ``out``: the values
    :func:`~canzona.updates.muon_prepare_` returns, computed in place.

    Payloads of another dtype than the buffers (bf16 for Newton–Schulz in bf16) receive the
    blend computed in the buffers' dtype, cast. On the CPU, where the gradients have the
    buffers' dtype, each is one ``torch.lerp(grad, buf, mu, out=payload)``: the kernel
    computes in the inputs' dtype and rounds on store, as the cast rounds (measured on torch
    2.13: equal bit for bit on 2,000 random tensors from fp32 and fp64 to bf16, fp16 and
    fp32, strided inputs and outputs among them), with no full-precision blend written and
    read back. Elsewhere the blend is made, then copied.

    Args:
        bufs: Momentum buffers, updated in place.
        grads: Gradients (or matching shards).
        out: Where the payloads go (same shapes; of another dtype than the buffers, they
            receive the blend computed in the buffers' dtype, cast).
        momentum: Momentum factor :math:`\mu`.
        nesterov: Whether to use the Nesterov blend.
    """
    if not bufs:
        return
    torch._foreach_lerp_(list(bufs), list(grads), 1 - momentum)
    if nesterov and any(o.dtype != b.dtype for o, b in zip(out, bufs, strict=True)):
        # e.g. fp32 gradients of a bf16 weight: torch blends in fp32, Newton–Schulz casts
        if bufs[0].device.type == "cpu":  # the lerp_ above refused mixed dtypes there
            for g, b, o in zip(grads, bufs, out, strict=True):
                torch.lerp(g, b, momentum, out=o)
            return
        blend = [torch.lerp(g.to(b.dtype), b, momentum) for g, b in zip(grads, bufs, strict=True)]
        torch._foreach_copy_(list(out), blend)
    elif nesterov:
        torch._foreach_copy_(list(out), list(grads))
        torch._foreach_lerp_(list(out), list(bufs), momentum)
    else:
        torch._foreach_copy_(list(out), list(bufs))


class PrepareRun(NamedTuple):
    """One run of :func:`muon_prepare_runs_`: payloads that one concatenation fills.

    Attributes:
        bufs: The run's momentum buffers, each ``(rows, *tail)``, in the run's order.
        grads: Their gradients (same shapes and dtype).
        out: The run's payload region ``(-1, *tail)`` (the buffers' dtype).
        views: The payload views ``out`` is cut into, in the run's order.
        home: ``bufs`` themselves as one region ``(-1, *tail)`` when they lie back to back
            in one storage (see :func:`flat_blend`), else None.
    """

    bufs: tuple[Tensor, ...]
    grads: tuple[Tensor, ...]
    out: Tensor
    views: tuple[Tensor, ...]
    home: Tensor | None = None


def flat_blend(out: Tensor, count: int) -> bool:
    """Whether a run of ``count`` payloads in ``out`` blends as one flat tensor (see below)."""
    return out.device.type == "cpu" and out.numel() <= FLAT_BLEND_NUMEL * count


def muon_prepare_runs_(
    bufs: Sequence[Tensor],
    grads: Sequence[Tensor],
    runs: Sequence[PrepareRun],
    *,
    momentum: float,
    nesterov: bool,
) -> None:
    r""":func:`muon_prepare_batch_` writing payloads that lie back to back, a few calls in all.

    The momentum update of the buffers outside a homed run (``bufs`` and ``grads``) is one
    foreach op as there. A run of small tensors (at most :data:`FLAT_BLEND_NUMEL` elements
    each on average, :func:`flat_blend`) without a home is filled by concatenation:
    ``cat(bufs)`` without Nesterov; with it ``cat(grads)`` and ``lerp_(cat(bufs), mu)``. A
    CPU run of large tensors (at least :data:`LERP_OUT_NUMEL` elements each on average) gets
    one ``torch.lerp(grad, buf, mu, out=payload)`` per tensor (no concatenation's copy read
    back). The payloads of all other runs are filled together: one foreach copy of the
    buffers (without Nesterov) or of the gradients, then one foreach ``lerp_`` with the
    buffers, however many runs there are (with one owner per matrix, as in a job of many
    ranks, a run is a matrix).

    A run whose buffers have a ``home`` (one region holding them back to back) takes its
    momentum update there, as one ``lerp_`` with the concatenated gradients in the payload,
    then blends (or copies) the home into the payload. The same element-wise ops on the same
    values, so the same bits.

    Args:
        bufs: Momentum buffers of the runs without a home, updated in place.
        grads: Their gradients (same shapes and dtype as the buffers).
        runs: The runs (:class:`PrepareRun`), every buffer of ``bufs`` in one of them.
        momentum: Momentum factor :math:`\mu`.
        nesterov: Whether to use the Nesterov blend.
    """
    if bufs:
        torch._foreach_lerp_(list(bufs), list(grads), 1 - momentum)
    views: list[Tensor] = []
    sources: list[Tensor] = []
    blends: list[Tensor] = []
    for run_bufs, run_grads, out, run_views, place in runs:
        if place is not None:
            torch.cat(run_grads, out=out)
            place.lerp_(out, 1 - momentum)
            if nesterov:
                out.lerp_(place, momentum)
            else:
                out.copy_(place)
            continue
        small = flat_blend(out, len(run_bufs))
        if not nesterov:
            if small:
                torch.cat(run_bufs, out=out)
            else:
                views += run_views
                sources += run_bufs
            continue
        if out.device.type == "cpu" and out.numel() >= LERP_OUT_NUMEL * len(run_bufs):
            for grad, buf, view in zip(run_grads, run_bufs, run_views, strict=True):
                torch.lerp(grad, buf, momentum, out=view)
            continue
        if small:
            torch.cat(run_grads, out=out)
            out.lerp_(torch.cat(run_bufs), momentum)
            continue
        views += run_views
        sources += run_grads
        blends += run_bufs
    if views:
        torch._foreach_copy_(views, sources)
    if blends:
        torch._foreach_lerp_(views, blends, momentum)


def decay_and_step_(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    *,
    decay: float,
    alpha: float,
) -> None:
    """``p.mul_(decay)`` then ``p.add_(d, alpha=alpha)`` per pair (Muon's and Shampoo's apply).

    ``decay = 1 - lr * weight_decay``; the multiplication runs even when it is 1, as in the
    single-tensor functions, so the two agree bit for bit.

    Args:
        params: Parameters (or shards), updated in place.
        directions: Matching directions (any dtype; promoted by the add as in ``add_``).
        decay: Decoupled weight-decay factor.
        alpha: Scale of the direction (the negative, shape-adjusted learning rate).
    """
    if not params:
        return
    mul_(params, decay)
    torch._foreach_add_(list(params), list(directions), alpha=alpha)


def soap_apply_batch_(
    params: Sequence[Tensor],
    directions: Sequence[Tensor],
    *,
    lr: float | Tensor,
    weight_decay: float,
    step: int,
    hp: SOAPHParams,
) -> None:
    """:func:`~canzona.updates.soap_apply_` for tensors sharing one step count.

    Args:
        params: Parameters (or shards), updated in place.
        directions: Matching directions.
        lr: Learning rate.
        weight_decay: Weight decay (applied after the step, scaled by ``lr``).
        step: 1-based count of calls for these matrices (nothing happens on step 1).
        hp: Hyper-parameters.
    """
    check_step(step)
    if step == 1 or not params:
        return
    torch._foreach_add_(list(params), list(directions), alpha=-soap_step_size(lr, step, hp))
    if weight_decay > 0:
        torch._foreach_add_(list(params), list(params), alpha=-float(lr * weight_decay))


def adamw_moments_(
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    *,
    betas: tuple[float, float],
) -> None:
    """AdamW's moment updates for every tensor (the first half of :func:`~canzona.updates.adamw_`).

    Args:
        grads: Gradients.
        exp_avgs: First moments, updated in place.
        exp_avg_sqs: Second moments, updated in place.
        betas: ``(beta1, beta2)``.
    """
    if not grads:
        return
    beta1, beta2 = betas
    torch._foreach_lerp_(list(exp_avgs), list(grads), 1 - beta1)
    mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(list(exp_avg_sqs), list(grads), list(grads), value=1 - beta2)


def adamw_params_(
    params: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    step: int,
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    originals: Sequence[Tensor] | None = None,
) -> None:
    """AdamW's parameter update from updated moments (the second half of ``adamw_``).

    Together with :func:`adamw_moments_` (in either order: they touch different tensors)
    the op sequence of ``adamw_``, hence of ``torch.optim.AdamW(foreach=False)``.

    Args:
        params: Parameters, updated in place.
        exp_avgs: First moments (already updated).
        exp_avg_sqs: Second moments (already updated).
        step: 1-based count of this update, shared by every tensor of the lists.
        lr: Learning rate (a 0-dim tensor's arithmetic in its dtype, as torch's).
        betas: ``(beta1, beta2)``.
        eps: Denominator term.
        weight_decay: Decoupled weight decay coefficient.
        originals: The parameters as the user holds them, where ``params`` are their real
            views (complex parameters, as torch.optim.AdamW views them after the decay):
            a 0-dim one is decayed as itself.
    """
    check_step(step)
    if not params:
        return
    beta1, beta2 = betas
    if weight_decay != 0:
        decay = 1 - lr * weight_decay
        whole = params if originals is None else originals
        if isinstance(decay, Tensor) and any(p.dim() == 0 for p in whole):
            # a 0-dim parameter and a 0-dim tensor factor promote to the wider dtype (a
            # float64 lr: the product in float64, complex128 for a complex64 parameter),
            # as torch's own ``mul_`` does
            for p in whole:
                if p.dim() == 0:
                    p.mul_(decay)
            mul_([v for v, p in zip(params, whole, strict=True) if p.dim() != 0], float(decay))
        else:
            mul_(params, float(decay))
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = float(lr / bias_correction1)
    bias_correction2_sqrt = bias_correction2**0.5
    denom = torch._foreach_sqrt(list(exp_avg_sqs))
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(list(params), list(exp_avgs), denom, value=-step_size)
