"""Newton–Schulz orthogonalisation with coefficient schedules, bitwise equal to torch's Muon."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from canzona.defaults import MUON_DEFAULTS
from canzona.updates.common import PROBED_DTYPES
from canzona.updates.cuda_graphs import replay_in_pieces
from canzona.updates.ns_schedules import (
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    NSCoefficients,
    Schedule,
    ns_norm_scale,
    resolve_ns_coefficients,
)

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_EPS",
    "DEFAULT_NS_STEPS",
    "MIN_BATCHED_SIDE",
    "batch_kernels_exact",
    "newton_schulz",
    "newton_schulz_flops",
]

DEFAULT_NS_EPS = MUON_DEFAULTS.eps

# Below this smaller side a half-precision stack always runs matrix by matrix (see
# batch_kernels_exact).
MIN_BATCHED_SIDE = 32
# Bytes between the starts of a stack's matrices in the per-matrix loop (see _aligned_stack).
_ALIGN = 512
# Largest matrix whose norm the per-matrix loop takes for the whole stack in one CPU call (see
# _ns_loop): ATen's reduction grain, below which a reduction is never split across threads.
_NORM_GRAIN = 32768
# (device type, device index, dtype, batch, rows, cols, cpu threads, schedule, norm scale)
# -> probe passed?
_BATCH_EXACT: dict[tuple[object, ...], bool] = {}


def _check_args(x: Tensor, eps: float, dtype: torch.dtype, norm_scale: float) -> None:
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs a (..., m, n) tensor, got shape {tuple(x.shape)}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}")
    if not (norm_scale > 0 and math.isfinite(norm_scale)):
        raise ValueError(f"norm_scale must be positive and finite, got {norm_scale!r}")


def _normalise(out: Tensor, norm: Tensor, eps: float, norm_scale: float) -> Tensor:
    """``out / max(norm_scale * norm, eps)``; no multiply when the scale is 1 (torch's ops)."""
    if norm_scale != 1.0:
        norm = norm * norm_scale
    return out.div(norm.clamp(min=eps))


def _ns_matrix(
    x: Tensor, schedule: Schedule, eps: float, dtype: torch.dtype, norm_scale: float
) -> Tensor:
    """One matrix, with the exact op sequence of ``torch.optim._muon._zeropower_via_newtonschulz``.

    The only difference is that the normalisation is out of place: torch divides in place, which
    overwrites its argument when that argument already has ``dtype``.
    """
    # the op sequence of torch's: only Python-level dispatch is trimmed (no ``to`` when
    # the dtype already matches, ``torch.mm`` for ``@``, ``vector_norm`` for ``norm()``)
    out = x if x.dtype == dtype else x.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        out = out.T
    out = _normalise(out, torch.linalg.vector_norm(out), eps, norm_scale)
    mm, addmm = torch.mm, torch.addmm
    for a, b, c in schedule:
        gram = mm(out, out.T)
        update = addmm(gram, gram, gram, beta=b, alpha=c)
        out = addmm(out, update, out, beta=a)
    return out.T if tall else out


def _ns_stack(
    x: Tensor, schedule: Schedule, eps: float, dtype: torch.dtype, norm_scale: float
) -> Tensor:
    """A stack ``(B, m, n)`` with batched kernels: the same formulas as :func:`_ns_matrix`."""
    out = x.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        out = out.mT
    norm = torch.linalg.vector_norm(out, dim=(-2, -1), keepdim=True)
    out = _normalise(out, norm, eps, norm_scale)
    for a, b, c in schedule:
        gram = out @ out.mT
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        out = torch.baddbmm(out, update, out, beta=a)
    return out.mT if tall else out


def _aligned_stack(
    count: int, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """An empty ``(count, rows, cols)`` stack whose matrices start where fresh allocations would.

    BLAS picks its kernels by address alignment as well as by shape: on torch 2.13's CPU build a
    5 x 9 fp32 product rounds differently when its operand starts 52 bytes past a 64-byte
    boundary. A matrix alone is a fresh allocation (64-byte aligned on CPU, 512 on CUDA), so each
    matrix of the stack starts on a multiple of :data:`_ALIGN` bytes.
    """
    size = dtype.itemsize
    stride = -(-rows * cols * size // _ALIGN) * _ALIGN // size
    flat = torch.empty(count * stride, dtype=dtype, device=device)
    return flat.as_strided((count, rows, cols), (stride, cols, 1))


def _ns_loop(
    x: Tensor,
    schedule: Schedule,
    eps: float,
    dtype: torch.dtype,
    norm_scale: float,
    branches: Sequence[torch.cuda.Stream] = (),
) -> Tensor:
    """A stack ``(B, m, n)`` matrix by matrix: :func:`_ns_matrix`'s ops on each, bit for bit.

    The element-wise ops (the cast, the norm's clamp and the division) run once on the whole
    stack: each element goes through the same IEEE operation with the same operands, so only
    the number of calls changes. On the CPU the norms of matrices of at most
    :data:`_NORM_GRAIN` elements are one call over the stack too: such a reduction is never
    split across threads, and ATen sums each matrix of a stack in the order it sums the
    matrix alone (measured on torch 2.13: equal bit for bit on 24,000 random stacks of fp32,
    bf16 and fp16 matrices up to that size, contiguous, transposed and in the aligned layout
    below, at one and two threads). Larger matrices and other devices take one norm call per
    matrix (a batched reduction may sum in another order there). Every product is one call
    per matrix, on a matrix that starts where a fresh allocation would (see
    :func:`_aligned_stack`). With CUDA ``branches`` (while a CUDA graph is captured, see
    :func:`~canzona.updates.cuda_graphs.replay_exact`) matrix ``i``'s products are issued on
    ``branches[i % len(branches)]``, forked from and joined back to the current stream: the
    same kernels on the same operands, which the replayed graph runs side by side.
    """
    count, rows, cols = x.shape
    out = _aligned_stack(count, rows, cols, dtype, x.device)
    src = x
    if x.dtype != dtype:
        src = out.copy_(x)
    tall = rows > cols
    if tall:
        src, out = src.mT, out.mT
    norm = torch.linalg.vector_norm
    if src.device.type == "cpu" and rows * cols <= _NORM_GRAIN:
        norms = norm(src, dim=(-2, -1))
    else:
        norms = torch.stack([norm(one) for one in src.unbind(0)])
    if norm_scale != 1.0:
        norms = norms * norm_scale
    torch.div(src, norms.clamp(min=eps).view(-1, 1, 1), out=out)
    if branches:
        return _branched_products(out, schedule, tall, branches)
    mm, addmm = torch.mm, torch.addmm
    results = []
    for one in out.unbind(0):
        for a, b, c in schedule:
            gram = mm(one, one.T)
            update = addmm(gram, gram, gram, beta=b, alpha=c)
            one = addmm(one, update, one, beta=a)
        results.append(one.T if tall else one)
    return torch.stack(results)


def _branched_products(
    out: Tensor, schedule: Schedule, tall: bool, branches: Sequence[torch.cuda.Stream]
) -> Tensor:
    """:func:`_ns_loop`'s products, matrix ``i`` on ``branches[i % len(branches)]``."""
    mm, addmm = torch.mm, torch.addmm
    main = torch.cuda.current_stream(out.device)
    for branch in branches:
        branch.wait_stream(main)
    results = []
    for i, one in enumerate(out.unbind(0)):
        with torch.cuda.stream(branches[i % len(branches)]):
            for a, b, c in schedule:
                gram = mm(one, one.T)
                update = addmm(gram, gram, gram, beta=b, alpha=c)
                one = addmm(one, update, one, beta=a)
        results.append(one.T if tall else one)
    for branch in branches:
        main.wait_stream(branch)
    return torch.stack(results)


def batch_kernels_exact(
    batch: int,
    rows: int,
    cols: int,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    schedule: Schedule | None = None,
    norm_scale: float = 1.0,
) -> bool:
    """Whether :func:`newton_schulz` may use batched kernels on this stack without changing a bit.

    Batched matmuls do not always run the kernel that a single matmul runs. On the CPU build of
    torch 2.13, ``baddbmm`` switches to a naive loop when ``k * m * n < 400`` and otherwise calls
    MKL's batched gemm, whose small-matrix kernels round differently from ``addmm``'s for some
    fp32 shapes with a side below 12 (11 x 11, not 8 x 8); GPU libraries pick their own batched
    algorithms. Two guards:

    * in half precision (bf16, fp16) the smaller side must be at least
      :data:`MIN_BATCHED_SIDE`: with a half-precision output a different fp32 accumulation
      order flips a bit only rarely, which a probe on a few hundred elements would miss, and
      below this size no probe is trusted. Measured on torch 2.13's CPU build: bf16 stacks
      whose smaller side is 12 or 16 differ from the loop on 1-7% of random inputs (the probe
      passes for them); none of 300 inputs per shape differed for sides 17 to 31, nor for
      larger shapes; 32 keeps a margin. In fp32 and fp64 a different order shows on nearly
      every input, so the probe decides alone: measured on the same build, each of 1,023 fp32
      (shape, batch) cases with sides 2 to 32 and batches 2 to 16 matched the loop on all of
      12 random inputs or on none, and so did 27 cases with batches 64 to 2,048 in fp32 and in
      fp64, at one and two threads, on 5 inputs each (8 x 8 matches, 6 x 8 and 11 x 11 do
      not);
    * a probe: the first call for a key runs the full iteration on a seeded random stack both
      ways and compares them with :func:`torch.equal` (one host sync, once per key). Keys are
      device, dtype, ``(batch, rows, cols)``, on CPU the intra-op thread count, and the schedule
      and norm scale (BLAS may special-case some scalars, such as a zero ``beta``).

    On the reference CPU (AVX-512, MKL) the batched and per-matrix paths were found bitwise equal
    for every shape with a side of at least 32 up to 512 x 1024 (fp32) and 96 x 256 (bf16).

    Args:
        batch: Number of matrices in the stack.
        rows: Rows of each matrix.
        cols: Columns of each matrix.
        dtype: Iteration dtype.
        device: Device that runs the iteration.
        schedule: The per-iteration coefficients (default: torch's triple, five times).
        norm_scale: Factor of the input norm (see :func:`newton_schulz`).

    Returns:
        True when the batched path may be used.
    """
    if batch < 2 or (dtype not in PROBED_DTYPES and min(rows, cols) < MIN_BATCHED_SIDE):
        return False
    if schedule is None:
        schedule = (DEFAULT_NS_COEFFICIENTS,) * DEFAULT_NS_STEPS
    dev = torch.device(device)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    key = (dev.type, dev.index, dtype, batch, rows, cols, threads, schedule, norm_scale)
    cached = _BATCH_EXACT.get(key)
    if cached is None:
        gen = torch.Generator(device=dev).manual_seed(0)
        probe = torch.randn((batch, rows, cols), generator=gen, device=dev, dtype=torch.float32)
        args = (schedule, DEFAULT_NS_EPS, dtype, norm_scale)
        cached = torch.equal(_ns_stack(probe, *args), _ns_loop(probe, *args))
        _BATCH_EXACT[key] = cached
    return cached


def newton_schulz(
    x: Tensor,
    *,
    coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
    steps: int | None = None,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
    batched: bool | None = None,
    norm_scale: float | None = None,
) -> Tensor:
    r"""Approximately orthogonalise each trailing matrix of ``x`` with quintic iterations.

    With :math:`X_0 = G / \max(s\|G\|_F, \varepsilon)` (``G`` cast to ``dtype`` and transposed
    when tall, :math:`s` = ``norm_scale``), iteration :math:`k` computes :math:`A = X X^\top`,
    :math:`B = b_k A + c_k A^2`, :math:`X \leftarrow a_k X + BX` with the :math:`k`-th triple of
    the schedule (:func:`~canzona.updates.ns_schedules.resolve_ns_coefficients`). The default
    triple favours speed over convergence: five steps leave the singular values of a
    well-conditioned input in about ``[0.68, 1.13]`` (the band that the quintic oscillates in)
    rather than at 1, which is what Muon uses; ``"polar_express"`` takes them to 1.

    For a 2-D input and one triple the op sequence is that of
    ``torch.optim._muon._zeropower_via_newtonschulz`` and the result is bitwise identical to it;
    unlike torch, the input is never modified. A stack ``(..., m, n)`` gives, bit for bit, what a
    Python loop over its matrices gives: batched kernels (``baddbmm``, one norm per matrix) are
    used only where :func:`batch_kernels_exact` has verified that they match the per-matrix
    kernels for this schedule; elsewhere the matrices run one by one, on CUDA replayed from a
    CUDA graph where that graph gives the same bits
    (:func:`~canzona.updates.cuda_graphs.replay_in_pieces`).

    Args:
        x: Matrices ``(..., m, n)``, any floating dtype.
        coefficients: One triple ``(a, b, c)`` (repeated ``steps`` times), a sequence of
            triples (one per iteration), or a name from
            :data:`~canzona.updates.ns_schedules.NS_SCHEDULES`.
        steps: Number of iterations, ``0 <= steps < 100``; ``None`` means 5 for a triple, the
            schedule's length otherwise. With a name, the first ``steps`` triples (the last
            repeated past the published length); with a sequence of triples, its length.
        eps: Lower clamp of the scaled Frobenius norm (keeps a zero matrix at zero).
        dtype: Dtype of the iteration and of the result; ``torch.bfloat16`` reproduces torch's
            Muon, ``torch.float32`` is much faster on CPUs without bf16 matmul units.
        batched: ``None`` chooses as above; ``True`` forces the batched kernels (fastest, may
            round differently from the per-matrix path); ``False`` forces the per-matrix loop.
        norm_scale: Factor :math:`s` of the input norm; ``None`` takes that of the named set
            (``1.01`` for ``"polar_express"``, else 1), see
            :func:`~canzona.updates.ns_schedules.ns_norm_scale`.

    Returns:
        Tensor of ``x``'s shape and dtype ``dtype``.

    Raises:
        ValueError: On fewer than two dims, an invalid schedule (see
            :func:`~canzona.updates.ns_schedules.resolve_ns_coefficients`), ``steps`` outside
            ``[0, 100)``, a non-positive ``eps``, a non-floating ``dtype`` or a ``norm_scale``
            that is not positive and finite.
    """
    schedule = resolve_ns_coefficients(coefficients, steps)
    scale = ns_norm_scale(coefficients) if norm_scale is None else float(norm_scale)
    _check_args(x, eps, dtype, scale)
    if x.ndim == 2:
        return _ns_matrix(x, schedule, eps, dtype, scale)
    m, n = x.shape[-2:]
    count = math.prod(x.shape[:-2])
    stack = x if x.ndim == 3 else x.reshape(count, m, n)
    if count == 0:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    if batched is None:
        batched = batch_kernels_exact(
            count, m, n, dtype=dtype, device=x.device, schedule=schedule, norm_scale=scale
        )
    if batched:
        out = _ns_stack(stack, schedule, eps, dtype, scale)
    else:
        # the loop runs the same kernels on every matrix, each at an aligned start, whatever
        # the stack's size: one bitwise check per matrix shape and settings
        key = ("newton_schulz", dtype, schedule, eps, scale)
        graphed = replay_in_pieces(
            lambda s, br: _ns_loop(s, schedule, eps, dtype, scale, br), stack, key, (m, n, key)
        )
        out = _ns_loop(stack, schedule, eps, dtype, scale) if graphed is None else graphed
    return out if x.ndim == 3 else out.reshape(x.shape)


def newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs of :func:`newton_schulz` on one ``rows x cols`` matrix.

    With ``a = min(rows, cols)`` and ``b = max(rows, cols)`` each step costs ``2a^2 b`` for
    ``X X^T``, ``2a^3`` for ``A A`` and ``2a^2 b`` for ``B X``: ``steps * (4a^2 b + 2a^3)``.
    For a schedule, pass its length.

    Args:
        rows: Rows of the matrix.
        cols: Columns of the matrix.
        steps: Number of iterations (``len(schedule)``).

    Returns:
        The FLOP count (a multiply-add counts as two).
    """
    a, b = min(rows, cols), max(rows, cols)
    return steps * (4 * a * a * b + 2 * a**3)
