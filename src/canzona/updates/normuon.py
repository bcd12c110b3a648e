"""NorMuon's owner-side step: per-row second moment of the orthogonalised update, RMS matching."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.defaults import NORMUON_DEFAULTS
from canzona.updates.common import (
    PROBED_DTYPES,
    State,
    check_beta,
    check_positive,
    check_step,
    matrix_shape,
)

__all__ = [
    "NORMUON_RESCALES",
    "NorMuonHParams",
    "normuon_batch_exact",
    "normuon_direction",
    "normuon_init",
]

#: How :func:`normuon_direction` sets the size of its result (see :class:`NorMuonHParams`).
NORMUON_RESCALES: tuple[str, ...] = ("rms", "preserve_norm")
_KEY = "second_momentum_buffer"
# (device type, device index, dtype, batch, rows, cols, cpu threads) -> probe passed?
_BATCH_EXACT: dict[tuple[object, ...], bool] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class NorMuonHParams:
    r"""Hyper-parameters of NorMuon's normalisation (momentum and Newton–Schulz are Muon's).

    Attributes:
        beta2: EMA coefficient :math:`\beta_2` of the per-row second moment, in ``[0, 1)``.
        eps: Added to :math:`\sqrt{v}` (and the floor of the norm that the rescale divides
            by); the authors' reference implementation uses ``1e-10``.
        rescale: ``"rms"``: the result has entry RMS ``rms`` (Algorithm 1 of the paper; pair it
            with ``adjust_lr_fn="none"``). ``"preserve_norm"``: the result keeps the Frobenius
            norm of the orthogonalised input (the authors' reference code, which then scales
            the learning rate by :math:`\sqrt{\max(1, m/n)}`, i.e. ``"original"``).
        rms: Target entry RMS :math:`\rho` of ``"rms"``; the paper's 0.2 matches AdamW's
            typical update RMS ("Muon is Scalable for LLM Training", arXiv 2502.16982).
    """

    beta2: float = NORMUON_DEFAULTS.beta2
    eps: float = NORMUON_DEFAULTS.normuon_eps
    rescale: str = NORMUON_DEFAULTS.rescale
    rms: float = NORMUON_DEFAULTS.rms

    def __post_init__(self) -> None:
        check_beta("beta2", self.beta2)
        check_positive("eps", self.eps)
        if self.rescale not in NORMUON_RESCALES:
            raise ValueError(f"rescale must be one of {NORMUON_RESCALES}, got {self.rescale!r}")
        check_positive("rms", self.rms)
        for name in ("eps", "rms"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)!r}")


def normuon_init(
    shape: tuple[int, ...] | torch.Size,
    hp: NorMuonHParams,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> State:
    """Allocate the state of one matrix (or a stack) of ``shape`` ``(..., m, n)``.

    One key, ``second_momentum_buffer`` (the name of the authors' reference code), of shape
    ``(..., m, 1)``: the second moment of each row (output neuron), starting at zero. It does
    not depend on ``hp``, which is taken for the signature every ``*_init`` shares.

    Args:
        shape: Shape of the full matrix or stack.
        hp: Hyper-parameters.
        dtype: Dtype of the state and of the direction's arithmetic.
        device: Device of the state.

    Returns:
        The state dict.
    """
    batch, m, _ = matrix_shape(shape)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return {_KEY: torch.zeros((*batch, m, 1), dtype=dtype, device=dev)}


def _normalise(o: Tensor, v: Tensor, hp: NorMuonHParams) -> Tensor:
    """Update ``v`` in place and return the rescaled direction; any leading dims.

    All reductions run over the trailing one or two dims only, so each matrix of a stack sees
    the same formulas as alone (whether also the same rounding is what the probe checks).
    """
    v.lerp_(o.square().mean(dim=-1, keepdim=True), 1 - hp.beta2)
    normalised = o / (v.sqrt() + hp.eps)
    norm: Tensor = torch.linalg.vector_norm(normalised, dim=(-2, -1), keepdim=True)
    norm = norm.clamp(min=hp.eps)
    if hp.rescale == "rms":
        factor = hp.rms * math.sqrt(o.size(-2) * o.size(-1)) / norm
    else:
        target: Tensor = torch.linalg.vector_norm(o, dim=(-2, -1), keepdim=True)
        factor = target / norm
    return normalised * factor


def _normalise_loop(o: Tensor, v: Tensor, hp: NorMuonHParams) -> Tensor:
    """A stack ``(B, m, n)`` matrix by matrix (``v`` is ``(B, m, 1)``, updated through views)."""
    return torch.stack([_normalise(o[i], v[i], hp) for i in range(o.size(0))])


def normuon_batch_exact(
    batch: int, rows: int, cols: int, *, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> bool:
    """Whether :func:`normuon_direction` may run a stack in one go without changing a bit.

    A reduction over one matrix and the same reduction over a stack of them may split and
    order their sums differently (one output against many, more than one thread, GPU
    reduction heuristics). The first call for a key runs both paths, for both rescale modes,
    on a seeded random stack and compares results and state updates with :func:`torch.equal`
    (one host sync, once per key: device, dtype, ``(batch, rows, cols)`` and, on CPU, the
    intra-op thread count). Only float32 and float64 are ever batched: with a half-precision
    output a different accumulation order would only rarely show.

    Args:
        batch: Number of matrices in the stack.
        rows: Rows of each matrix.
        cols: Columns of each matrix.
        dtype: Dtype of the state (the arithmetic).
        device: Device of the state.

    Returns:
        True when the stacked path may be used.
    """
    if batch < 2 or dtype not in PROBED_DTYPES:
        return False
    dev = torch.device(device)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    key = (dev.type, dev.index, dtype, batch, rows, cols, threads)
    cached = _BATCH_EXACT.get(key)
    if cached is None:
        gen = torch.Generator(device=dev).manual_seed(0)
        o = torch.randn((batch, rows, cols), generator=gen, device=dev, dtype=dtype)
        v = torch.rand((batch, rows, 1), generator=gen, device=dev, dtype=dtype)
        cached = True
        for rescale in NORMUON_RESCALES:
            hp = NorMuonHParams(rescale=rescale)
            v_stack, v_loop = v.clone(), v.clone()
            same = torch.equal(_normalise(o, v_stack, hp), _normalise_loop(o, v_loop, hp))
            cached = cached and same and torch.equal(v_stack, v_loop)
        _BATCH_EXACT[key] = cached
    return cached


def normuon_direction(
    orthogonalised: Tensor,
    state: State,
    step: int,
    hp: NorMuonHParams,
    *,
    batched: bool | None = None,
) -> Tensor:
    r"""NorMuon's direction from Muon's orthogonalised update; updates ``state`` in place.

    "NorMuon: Making Muon more efficient and scalable" (Li, Liu, Liang, Chen, Zhao 2025,
    arXiv 2510.05491), Algorithm 1, on each trailing matrix :math:`O` (``m x n``, rows = output
    neurons) in the state's dtype:

    .. math::
        v &\leftarrow \beta_2 v + (1-\beta_2)\,\mathrm{mean}_{\mathrm{cols}}(O \odot O)
            \quad (\text{per row, as lerp}) \\
        \hat O &= O \oslash (\sqrt{v} + \epsilon) \\
        D &= \frac{s}{\max(\|\hat O\|_F, \epsilon)}\,\hat O, \qquad
            s = \begin{cases} \rho\sqrt{mn} & \texttt{rescale="rms"} \\
                \|O\|_F & \texttt{rescale="preserve\_norm"} \end{cases}

    with :math:`\rho` = ``hp.rms``; the parameter then moves by :math:`-\gamma' D`
    (:func:`~canzona.updates.muon.muon_apply_`) with :math:`\gamma'` from
    :func:`~canzona.updates.muon.muon_lr`: ``"none"`` gives the paper's
    :math:`\hat\eta = 0.2\,\eta\sqrt{mn}/\|\hat O\|_F`, ``"original"`` the reference code's.
    There is no bias correction, as in the paper: a factor :math:`1/(1-\beta_2^t)` on
    :math:`v` would change :math:`\hat O` by one scalar per matrix, which the rescale removes
    (up to :math:`\epsilon`); ``step`` is therefore only checked. A zero input gives a zero
    direction.

    A stack ``(..., m, n)`` gives, bit for bit, what a loop over its matrices gives: it runs in
    one go only where :func:`normuon_batch_exact` verified that this changes nothing.

    Args:
        orthogonalised: Output of :func:`~canzona.updates.muon.muon_direction` for the full
            matrices ``(..., m, n)``, any floating dtype (cast to the state's); not modified.
        state: Output of :func:`normuon_init` for this shape.
        step: 1-based count of calls for this matrix.
        hp: Hyper-parameters.
        batched: ``None`` chooses as above; ``True`` forces one go, ``False`` the loop.

    Returns:
        The direction, a new tensor in the state's dtype.

    Raises:
        ValueError: On ``step < 1`` or a state whose shape does not match ``(..., m, 1)``.
    """
    check_step(step)
    v = state[_KEY]
    o_shape = tuple(orthogonalised.shape)
    if orthogonalised.ndim < 2 or tuple(v.shape) != (*o_shape[:-1], 1):
        raise ValueError(
            f"state {_KEY!r} of shape {tuple(v.shape)} does not fit a direction of shape {o_shape}"
        )
    # contiguous: Newton-Schulz returns a tall matrix transposed in memory or not by how
    # many it ran with, and the reductions below round by the memory order
    o = orthogonalised.to(v.dtype).contiguous()
    if o.ndim == 2:
        return _normalise(o, v, hp)
    m, n = o_shape[-2:]
    count = math.prod(o_shape[:-2])
    if count == 0:
        return torch.empty(o_shape, dtype=v.dtype, device=v.device)
    if batched is None:
        batched = normuon_batch_exact(count, m, n, dtype=v.dtype, device=v.device)
    run: Callable[[Tensor, Tensor, NorMuonHParams], Tensor] = (
        _normalise if batched else _normalise_loop
    )
    return run(o.reshape(count, m, n), v.view(count, m, 1), hp).reshape(o_shape)
