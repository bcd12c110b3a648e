"""Float64 single-device Shampoo, SOAP and NorMuon written from the algorithms, to check canzona.

Nothing here uses :mod:`canzona.updates`: each matrix is processed on its own, in float64, with
the formulas written out plainly, so that an agreement with the library is evidence and not a
tautology. Parameters may be stacks ``(..., m, n)``; every trailing matrix is then an independent
parameter. Both classes keep float64 copies of the parameters: feed them the same gradients as the
optimizer under test and compare ``params`` (or ``directions``) after each step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.defaults import NORMUON_DEFAULTS, SHAMPOO_DEFAULTS, SOAP_DEFAULTS

__all__ = ["ReferenceNorMuon", "ReferenceSOAP", "ReferenceShampoo"]

_F64 = torch.float64


def _matrices(t: Tensor) -> list[Tensor]:
    """Views of the trailing matrices of ``t`` (a 2-D tensor is a list of one)."""
    return list(t.reshape(-1, t.shape[-2], t.shape[-1]).unbind(0))


def _stack_like(mats: Sequence[Tensor], like: Tensor) -> Tensor:
    return torch.stack(list(mats)).reshape(like.shape)


def _stack_sides(
    lefts: Sequence[Tensor | None], rights: Sequence[Tensor | None], like: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Stack per-matrix left/right statistics into ``(..., m, m)`` and ``(..., n, n)``."""
    batch = like.shape[:-2]
    out: list[Tensor | None] = []
    for mats in (lefts, rights):
        present = [x for x in mats if x is not None]
        if len(present) != len(mats) or not present:
            out.append(None)
            continue
        k = present[0].shape[-1]
        out.append(torch.stack(present).reshape(*batch, k, k))
    return out[0], out[1]


@dataclass
class _ShampooMatrix:
    m: Tensor
    v: Tensor
    left: Tensor | None
    right: Tensor | None
    left_root: Tensor | None = None
    right_root: Tensor | None = None


@dataclass
class _NorMuonMatrix:
    buf: Tensor
    v: Tensor


@dataclass
class _SoapMatrix:
    m: Tensor
    v: Tensor
    left: Tensor | None
    right: Tensor | None
    q_left: Tensor | None
    q_right: Tensor | None


class _Reference:
    """Parameter bookkeeping shared by the two references."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        self.params: list[Tensor] = [p.detach().to(_F64).clone() for p in params]
        for p in self.params:
            if p.ndim < 2:
                raise ValueError(f"reference optimizers take matrices, got shape {tuple(p.shape)}")
        self.directions: list[Tensor] = []
        self.steps = 0

    def _check_grads(self, grads: Sequence[Tensor]) -> list[Tensor]:
        if len(grads) != len(self.params):
            raise ValueError(f"expected {len(self.params)} gradients, got {len(grads)}")
        out = []
        for p, g in zip(self.params, grads, strict=True):
            if g.shape != p.shape:
                raise ValueError(f"gradient shape {tuple(g.shape)} != parameter {tuple(p.shape)}")
            out.append(g.detach().to(_F64))
        return out


class ReferenceShampoo(_Reference):
    r"""Shampoo with Adam grafting and decoupled weight decay, in float64.

    Per matrix, at step :math:`t` with gradient :math:`G`:

    .. math::
        L_t &= \beta_2 L_{t-1} + (1-\beta_2) G G^\top, \quad
        R_t = \beta_2 R_{t-1} + (1-\beta_2) G^\top G \quad (\text{sums if } \beta_2 = 1) \\
        M_t &= \frac{\beta_1 m_{t-1} + (1-\beta_1) G}{1-\beta_1^t}, \quad
        D_t = \frac{M_t}{\sqrt{v_t / (1-\beta_{2g}^t)} + \epsilon_g}, \quad
        v_t = \beta_{2g} v_{t-1} + (1-\beta_{2g}) G^2 \\
        P_t &= \hat L^{-1/4} M_t \hat R^{-1/4}, \quad
        \hat X^{-1/4} = Q \max(\Lambda, \epsilon)^{-1/4} Q^\top,\
        Q \Lambda Q^\top = X / (1-\beta_2^s) + \epsilon I

    where the roots are recomputed at the step :math:`s = t_0` and at the steps
    :math:`s > t_0` with :math:`s \bmod f = 0`; the direction is
    :math:`P_t \|D_t\| / \|P_t\|` (grafting ``"adam"``) or :math:`P_t` for
    :math:`t \ge t_0`, else :math:`D_t` or :math:`M_t`; then
    :math:`\theta \leftarrow \theta(1 - \gamma\lambda) - \gamma \cdot \text{direction}`. Bias
    corrections only when ``bias_correction`` (the factors' only when :math:`\beta_2 < 1`).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float = SHAMPOO_DEFAULTS.lr,
        weight_decay: float = SHAMPOO_DEFAULTS.weight_decay,
        betas: tuple[float, float] = SHAMPOO_DEFAULTS.betas,
        epsilon: float = SHAMPOO_DEFAULTS.epsilon,
        precondition_frequency: int = SHAMPOO_DEFAULTS.precondition_frequency,
        start_preconditioning_step: int = SHAMPOO_DEFAULTS.start_preconditioning_step,
        max_precond_dim: int = SHAMPOO_DEFAULTS.max_precond_dim,
        grafting: str = SHAMPOO_DEFAULTS.grafting,
        grafting_beta2: float = SHAMPOO_DEFAULTS.grafting_beta2,
        grafting_epsilon: float = SHAMPOO_DEFAULTS.grafting_epsilon,
        bias_correction: bool = SHAMPOO_DEFAULTS.bias_correction,
    ) -> None:
        super().__init__(params)
        if grafting not in ("adam", "none"):
            raise ValueError(f"grafting must be 'adam' or 'none', got {grafting!r}")
        self.lr, self.weight_decay = lr, weight_decay
        self.beta1, self.beta2 = betas
        self.epsilon = epsilon
        self.frequency, self.start = precondition_frequency, start_preconditioning_step
        self.max_dim = max_precond_dim
        self.grafting, self.graft_beta2, self.graft_eps = grafting, grafting_beta2, grafting_epsilon
        self.bias_correction = bias_correction
        self._state: list[list[_ShampooMatrix]] = []
        for p in self.params:
            m, n = p.shape[-2:]
            self._state.append(
                [
                    _ShampooMatrix(
                        m=torch.zeros(m, n, dtype=_F64),
                        v=torch.zeros(m, n, dtype=_F64),
                        left=torch.zeros(m, m, dtype=_F64) if m <= self.max_dim else None,
                        right=torch.zeros(n, n, dtype=_F64) if n <= self.max_dim else None,
                    )
                    for _ in _matrices(p)
                ]
            )

    def _root(self, x: Tensor, t: int) -> Tensor:
        correction = 1 - self.beta2**t if self.bias_correction and self.beta2 < 1 else 1.0
        a = x / correction + self.epsilon * torch.eye(x.shape[0], dtype=_F64)
        lam, q = torch.linalg.eigh(a)
        lam = torch.clamp(lam, min=self.epsilon)
        root: Tensor = q @ torch.diag(lam ** (-0.25)) @ q.T
        return root

    def _factor(self, x: Tensor | None, gram: Tensor) -> Tensor | None:
        if x is None:
            return None
        return x + gram if self.beta2 == 1 else self.beta2 * x + (1 - self.beta2) * gram

    def _direction(self, g: Tensor, s: _ShampooMatrix, t: int) -> Tensor:
        if self.beta1 > 0:
            s.m = self.beta1 * s.m + (1 - self.beta1) * g
            m_hat = s.m / (1 - self.beta1**t if self.bias_correction else 1.0)
        else:
            m_hat = g
        s.left = self._factor(s.left, g @ g.T)
        s.right = self._factor(s.right, g.T @ g)
        if t == self.start or (t > self.start and t % self.frequency == 0):
            s.left_root = self._root(s.left, t) if s.left is not None else None
            s.right_root = self._root(s.right, t) if s.right is not None else None
        graft = None
        if self.grafting == "adam":
            s.v = self.graft_beta2 * s.v + (1 - self.graft_beta2) * g * g
            v_hat = s.v / (1 - self.graft_beta2**t if self.bias_correction else 1.0)
            graft = m_hat / (torch.sqrt(v_hat) + self.graft_eps)
        if t < self.start:
            return graft if graft is not None else m_hat.clone()
        p = m_hat
        if s.left_root is not None:
            p = s.left_root @ p
        if s.right_root is not None:
            p = p @ s.right_root
        if graft is not None:
            p_norm = torch.linalg.norm(p)
            p = p * (torch.linalg.norm(graft) / p_norm) if p_norm > 0 else torch.zeros_like(p)
        return p

    def factors(self, index: int) -> tuple[Tensor | None, Tensor | None]:
        """The Kronecker factors ``(L, R)`` of parameter ``index``, stacked like it.

        Args:
            index: Position of the parameter.

        Returns:
            ``(..., m, m)`` and ``(..., n, n)`` float64 tensors; ``None`` for a side without one.
        """
        states = self._state[index]
        return _stack_sides([s.left for s in states], [s.right for s in states], self.params[index])

    def step(self, grads: Sequence[Tensor], *, lr: float | None = None) -> list[Tensor]:
        """One step on every parameter; returns the parameters (float64) after it.

        Args:
            grads: One gradient per parameter, any dtype.
            lr: Learning rate of this step (defaults to the constructor's).

        Returns:
            ``self.params``; the directions are in ``self.directions``.
        """
        gs = self._check_grads(grads)
        self.steps += 1
        rate = self.lr if lr is None else lr
        self.directions = []
        for i, g in enumerate(gs):
            dirs = [
                self._direction(gm, s, self.steps)
                for gm, s in zip(_matrices(g), self._state[i], strict=True)
            ]
            d = _stack_like(dirs, g)
            self.directions.append(d)
            self.params[i] = self.params[i] * (1 - rate * self.weight_decay) - rate * d
        return self.params


class ReferenceSOAP(_Reference):
    r"""SOAP as the authors' reference implementation runs it on matrices, in float64.

    Per matrix: the first call only sets :math:`L = (1-\beta_s) G G^\top`,
    :math:`R = (1-\beta_s) G^\top G` and :math:`Q_L, Q_R` to their eigenvectors (of
    :math:`X + 10^{-30} I`, by decreasing eigenvalue) and leaves the parameter alone. Call
    :math:`k \ge 2`, with :math:`t = k - 1`:

    .. math::
        \tilde G &= Q_L^\top G Q_R, \quad m \leftarrow \beta_1 m + (1-\beta_1) \tilde G, \quad
        v \leftarrow \beta_2 v + (1-\beta_2) \tilde G^2 \\
        N &= Q_L \frac{m}{\sqrt v + \epsilon} Q_R^\top \quad
        (\text{divided by } 10^{-30} + \mathrm{RMS}(N) \text{ if normalize\_grads}) \\
        \theta &\leftarrow \theta - \gamma \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t} N, \quad
        \theta \leftarrow \theta - \gamma\lambda\theta

    then :math:`L, R` absorb :math:`G` (EMA with :math:`\beta_s`), and when :math:`t` is a
    multiple of the frequency each basis is re-sorted by :math:`\mathrm{diag}(Q^\top X Q)`
    (decreasing, stable; :math:`v` follows the permutation) and replaced by the orthogonal factor
    of :math:`X Q`; :math:`m` (which lives in the eigenbasis) is re-expressed in the new basis.
    A side longer than ``max_precond_dim`` keeps the identity.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float = SOAP_DEFAULTS.lr,
        betas: tuple[float, float] = SOAP_DEFAULTS.betas,
        shampoo_beta: float = SOAP_DEFAULTS.shampoo_beta,
        eps: float = SOAP_DEFAULTS.eps,
        weight_decay: float = SOAP_DEFAULTS.weight_decay,
        precondition_frequency: int = SOAP_DEFAULTS.precondition_frequency,
        max_precond_dim: int = SOAP_DEFAULTS.max_precond_dim,
        normalize_grads: bool = SOAP_DEFAULTS.normalize_grads,
        correct_bias: bool = SOAP_DEFAULTS.correct_bias,
    ) -> None:
        super().__init__(params)
        self.lr, self.weight_decay = lr, weight_decay
        self.beta1, self.beta2 = betas
        self.stat_beta = shampoo_beta if shampoo_beta >= 0 else betas[1]
        self.eps, self.frequency, self.max_dim = eps, precondition_frequency, max_precond_dim
        self.normalize_grads, self.correct_bias = normalize_grads, correct_bias
        self._state: list[list[_SoapMatrix | None]] = [
            [None for _ in _matrices(p)] for p in self.params
        ]

    def _ema(self, x: Tensor | None, gram: Tensor) -> Tensor | None:
        return None if x is None else x + (1 - self.stat_beta) * (gram - x)

    @staticmethod
    def _eigenvectors(x: Tensor | None) -> Tensor | None:
        if x is None:
            return None
        vectors = torch.linalg.eigh(x + 1e-30 * torch.eye(x.shape[0], dtype=_F64))[1]
        return torch.flip(vectors, dims=[1])

    def _first(self, g: Tensor) -> _SoapMatrix:
        m, n = g.shape
        left = torch.zeros(m, m, dtype=_F64) if m <= self.max_dim else None
        right = torch.zeros(n, n, dtype=_F64) if n <= self.max_dim else None
        left, right = self._ema(left, g @ g.T), self._ema(right, g.T @ g)
        return _SoapMatrix(
            m=torch.zeros(m, n, dtype=_F64),
            v=torch.zeros(m, n, dtype=_F64),
            left=left,
            right=right,
            q_left=self._eigenvectors(left),
            q_right=self._eigenvectors(right),
        )

    @staticmethod
    def _to_eigen(x: Tensor, s: _SoapMatrix) -> Tensor:
        left = s.q_left.T @ x if s.q_left is not None else x
        return left @ s.q_right if s.q_right is not None else left

    @staticmethod
    def _from_eigen(x: Tensor, s: _SoapMatrix) -> Tensor:
        left = s.q_left @ x if s.q_left is not None else x
        return left @ s.q_right.T if s.q_right is not None else left

    @staticmethod
    def _power_qr(x: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
        """Order by decreasing ``diag(Q^T X Q)`` and one power iteration + QR."""
        estimate = torch.diag(q.T @ x @ q)
        order = torch.argsort(estimate, descending=True, stable=True)
        return order, torch.linalg.qr(x @ q[:, order])[0]

    def _refresh(self, s: _SoapMatrix) -> None:
        if s.left is not None and s.q_left is not None:
            order, s.q_left = self._power_qr(s.left, s.q_left)
            s.v = s.v[order, :]
        if s.right is not None and s.q_right is not None:
            order, s.q_right = self._power_qr(s.right, s.q_right)
            s.v = s.v[:, order]

    def _direction(self, g: Tensor, s: _SoapMatrix, calls: int) -> Tensor:
        t = calls - 1
        g_rot = self._to_eigen(g, s)
        s.m = self.beta1 * s.m + (1 - self.beta1) * g_rot
        s.v = self.beta2 * s.v + (1 - self.beta2) * g_rot**2
        n = self._from_eigen(s.m / (torch.sqrt(s.v) + self.eps), s)
        if self.normalize_grads:
            n = n / (1e-30 + math.sqrt(float(torch.mean(n**2))))
        s.left, s.right = self._ema(s.left, g @ g.T), self._ema(s.right, g.T @ g)
        if t % self.frequency == 0:
            m_plain = self._from_eigen(s.m, s)
            self._refresh(s)
            s.m = self._to_eigen(m_plain, s)
        return n

    def step_size(self, lr: float | None = None) -> float:
        """Step size of the latest call (0 after the first call, bias corrections folded in).

        Args:
            lr: Learning rate (defaults to the constructor's).

        Returns:
            The step size.
        """
        rate = self.lr if lr is None else lr
        if self.steps <= 1:
            return 0.0
        t = self.steps - 1
        if not self.correct_bias:
            return rate
        return rate * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)

    def statistics(self, index: int) -> tuple[Tensor | None, Tensor | None]:
        """The statistics ``(L, R)`` of parameter ``index``, stacked like it.

        Args:
            index: Position of the parameter.

        Returns:
            ``(..., m, m)`` and ``(..., n, n)`` float64 tensors; ``None`` for a side without one
            (or before the first call).
        """
        states = self._state[index]
        lefts = [s.left if s is not None else None for s in states]
        rights = [s.right if s is not None else None for s in states]
        return _stack_sides(lefts, rights, self.params[index])

    def step(self, grads: Sequence[Tensor], *, lr: float | None = None) -> list[Tensor]:
        """One call on every parameter; returns the parameters (float64) after it.

        Args:
            grads: One gradient per parameter, any dtype.
            lr: Learning rate of this step (defaults to the constructor's).

        Returns:
            ``self.params``; the directions (zeros on the first call) are in ``self.directions``.
        """
        gs = self._check_grads(grads)
        self.steps += 1
        rate = self.lr if lr is None else lr
        self.directions = []
        for i, g in enumerate(gs):
            dirs = []
            for j, gm in enumerate(_matrices(g)):
                state = self._state[i][j]
                if state is None:
                    self._state[i][j] = self._first(gm)
                    dirs.append(torch.zeros_like(gm))
                else:
                    dirs.append(self._direction(gm, state, self.steps))
            d = _stack_like(dirs, g)
            self.directions.append(d)
            if self.steps == 1:
                continue
            p = self.params[i] - self.step_size(rate) * d
            if self.weight_decay > 0:
                p = p - rate * self.weight_decay * p
            self.params[i] = p
        return self.params


def _lr_factor(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """The learning-rate shape factors of Muon's scale modes, written out."""
    factors = {
        None: math.sqrt(max(1.0, m / n)),
        "original": math.sqrt(max(1.0, m / n)),
        "match_rms_adamw": 0.2 * math.sqrt(max(m, n)),
        "spectral": math.sqrt(m / n),
        "unit_rms": math.sqrt(max(m, n)),
        "none": 1.0,
    }
    if adjust_lr_fn not in factors:
        raise ValueError(f"unknown adjust_lr_fn, got {adjust_lr_fn!r}")
    return factors[adjust_lr_fn]


def _orthogonalise(
    x: Tensor, coefficients: Sequence[tuple[float, float, float]], norm_scale: float, eps: float
) -> Tensor:
    """Newton–Schulz with one ``(a, b, c)`` per iteration: ``X <- aX + (bA + cA^2)X``."""
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(norm_scale * float(torch.linalg.norm(x)), eps)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class ReferenceNorMuon(_Reference):
    r"""NorMuon as Algorithm 1 of arXiv 2510.05491 states it, in float64, matrix by matrix.

    Per matrix (``m x n``, rows = output neurons), at step :math:`t` with gradient :math:`G`:

    .. math::
        B &\leftarrow \mu B + (1-\mu) G, \quad
        \tilde B = (1-\mu) G + \mu B \ (\text{nesterov, else } B) \\
        O &= \mathrm{NS}(\tilde B): \ X \leftarrow \tilde B / \max(s\|\tilde B\|_F, \varepsilon)
        \ (\text{transposed if tall}), \
        X \leftarrow a_k X + (b_k A + c_k A^2) X,\ A = XX^\top \\
        v_i &\leftarrow \beta_2 v_i + (1-\beta_2)\,\tfrac1n \textstyle\sum_j O_{ij}^2, \quad
        \hat O_{ij} = O_{ij} / (\sqrt{v_i} + \epsilon) \\
        D &= \rho\sqrt{mn}\,\hat O / \|\hat O\|_F \ (\texttt{"rms"}) \quad\text{or}\quad
        \|O\|_F\,\hat O / \|\hat O\|_F \ (\texttt{"preserve\_norm"}) \\
        \theta &\leftarrow \theta(1-\gamma\lambda) - \gamma\, f(m, n)\, \sigma\, D

    with :math:`(a_k, b_k, c_k)` the given schedule, :math:`f` the shape factor of
    ``adjust_lr_fn`` and :math:`\sigma` = ``scale``. The norms are not guarded: a zero
    gradient is not supported here.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        *,
        lr: float = NORMUON_DEFAULTS.lr,
        weight_decay: float = NORMUON_DEFAULTS.weight_decay,
        momentum: float = NORMUON_DEFAULTS.momentum,
        nesterov: bool = NORMUON_DEFAULTS.nesterov,
        ns_coefficients: Sequence[tuple[float, float, float]] = (
            (NORMUON_DEFAULTS.ns_coefficients,) * NORMUON_DEFAULTS.ns_steps
        ),
        ns_norm_scale: float = 1.0,
        ns_eps: float = NORMUON_DEFAULTS.eps,
        beta2: float = NORMUON_DEFAULTS.beta2,
        eps: float = NORMUON_DEFAULTS.normuon_eps,
        rescale: str = NORMUON_DEFAULTS.rescale,
        rms: float = NORMUON_DEFAULTS.rms,
        adjust_lr_fn: str | None = "none",
        scale: float = 1.0,
    ) -> None:
        super().__init__(params)
        if rescale not in ("rms", "preserve_norm"):
            raise ValueError(f"rescale must be 'rms' or 'preserve_norm', got {rescale!r}")
        self.lr, self.weight_decay = lr, weight_decay
        self.momentum, self.nesterov = momentum, nesterov
        self.coefficients: list[tuple[float, float, float]] = [
            (float(a), float(b), float(c)) for a, b, c in ns_coefficients
        ]
        self.ns_norm_scale, self.ns_eps = ns_norm_scale, ns_eps
        self.beta2, self.eps, self.rescale, self.rms = beta2, eps, rescale, rms
        self.adjust_lr_fn, self.scale = adjust_lr_fn, scale
        self._state = [
            [
                _NorMuonMatrix(buf=torch.zeros_like(x), v=torch.zeros(x.shape[0], dtype=_F64))
                for x in _matrices(p)
            ]
            for p in self.params
        ]

    def _direction(self, g: Tensor, s: _NorMuonMatrix) -> Tensor:
        s.buf = self.momentum * s.buf + (1 - self.momentum) * g
        blended = (1 - self.momentum) * g + self.momentum * s.buf if self.nesterov else s.buf
        o = _orthogonalise(blended, self.coefficients, self.ns_norm_scale, self.ns_eps)
        m, n = o.shape
        s.v = self.beta2 * s.v + (1 - self.beta2) * (o**2).mean(dim=1)
        o_hat = o / (torch.sqrt(s.v)[:, None] + self.eps)
        size = self.rms * math.sqrt(m * n) if self.rescale == "rms" else float(torch.linalg.norm(o))
        direction: Tensor = size * o_hat / float(torch.linalg.norm(o_hat))
        return direction

    def second_moments(self, index: int) -> Tensor:
        """The per-row second moments of parameter ``index``, shaped ``(..., m, 1)``.

        Args:
            index: Position of the parameter.

        Returns:
            A float64 tensor.
        """
        p = self.params[index]
        return torch.stack([s.v for s in self._state[index]]).reshape(*p.shape[:-1], 1)

    def step(self, grads: Sequence[Tensor], *, lr: float | None = None) -> list[Tensor]:
        """One step on every parameter; returns the parameters (float64) after it.

        Args:
            grads: One gradient per parameter, any dtype.
            lr: Learning rate of this step (defaults to the constructor's).

        Returns:
            ``self.params``; the directions :math:`D` are in ``self.directions``.
        """
        gs = self._check_grads(grads)
        self.steps += 1
        rate = self.lr if lr is None else lr
        self.directions = []
        for i, g in enumerate(gs):
            dirs = [
                self._direction(gm, s) for gm, s in zip(_matrices(g), self._state[i], strict=True)
            ]
            d = _stack_like(dirs, g)
            self.directions.append(d)
            m, n = g.shape[-2:]
            adjusted = rate * _lr_factor(self.adjust_lr_fn, m, n) * self.scale
            self.params[i] = self.params[i] * (1 - rate * self.weight_decay) - adjusted * d
        return self.params
