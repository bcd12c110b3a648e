"""Closed-form per-matrix cost models (FLOPs, bytes moved, bytes in flight) for each optimizer."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol, runtime_checkable

from canzona.defaults import MUON_DEFAULTS, SHAMPOO_DEFAULTS, SOAP_DEFAULTS
from canzona.plan.spec import MatrixSpec

__all__ = [
    "COST_MODELS",
    "NORMUON_ELEMENTWISE",
    "AdamWCost",
    "CostModel",
    "MuonCost",
    "ShampooCost",
    "SoapCost",
    "cost_model",
    "cost_model_params",
    "in_flight",
    "priced",
    "resolve_cost_model",
    "total_of",
]

#: FLOPs per element for Muon's element-wise work: momentum (2), Nesterov blend (2),
#: Frobenius norm (2), normalisation (1), shape-scaled learning rate and weight decay (3).
MUON_ELEMENTWISE = 10
#: Extra FLOPs per element of NorMuon's normalisation, on top of Muon's: square, row mean,
#: division by the row scale, Frobenius norm (2), rescale (pass as ``extra_elementwise``).
NORMUON_ELEMENTWISE = 6
#: FLOPs per element for Adam-style element-wise work (both moments, bias correction,
#: square root, division, weight decay, learning rate).
ADAM_ELEMENTWISE = 12
#: FLOPs of a symmetric eigendecomposition of a d x d matrix with eigenvectors, in units of
#: d^3 (Householder tridiagonalisation ~4/3, implicit QR with vector accumulation ~6, and the
#: reconstruction Q diag Q^T ~2, rounded to 10).
EIGH_FACTOR = 10.0
#: Householder QR of a d x d matrix costs ~(4/3) d^3 for R; forming Q doubles it.
QR_FACTOR = 2.0


@runtime_checkable
class CostModel(Protocol):
    """What the planner needs to know about one optimizer's per-matrix work."""

    @property
    def name(self) -> str:
        """Short name of the optimizer (``"muon"``, ``"shampoo"``, ...)."""
        ...

    def flops(self, spec: MatrixSpec) -> float:
        """Floating point operations of one optimizer step on the owner."""
        ...

    def comm_bytes(self, spec: MatrixSpec) -> int:
        """Bytes that travel to the owner before it computes (the full payload)."""
        ...

    def memory_bytes(self, spec: MatrixSpec) -> int:
        """Bytes in flight on the owner while the matrix is being computed."""
        ...


def _payload(spec: MatrixSpec) -> int:
    return spec.numel * spec.itemsize


def _non_negative_int(owner: str, field_name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{owner}: {field_name} must be an integer >= 0, got {value!r}")


def _positive_int(owner: str, field_name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {field_name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class MuonCost:
    """Muon (and NorMuon): momentum, then Newton-Schulz orthogonalisation of the m x n update.

    With ``a = min(m, n)`` and ``b = max(m, n)`` (Muon transposes so that ``X`` is a x b), one
    quintic Newton-Schulz iteration computes ``A = X X^T`` (a x b times b x a: ``2 a^2 b``),
    ``B = c1 A + c2 A A`` (``2 a^3``) and ``B X`` (``2 a^2 b``), i.e. ``4 a^2 b + 2 a^3`` per
    iteration, whatever its coefficients. The total is
    ``batch * (ns_steps * (4 a^2 b + 2 a^3) + (10 + extra_elementwise) m n)``, the last term
    being the element-wise momentum, normalisation and update.

    Attributes:
        ns_steps: Number of Newton-Schulz iterations. For a coefficient schedule (one triple per
            iteration, e.g. ``"polar_express"``) pass its length, ``len(schedule)``; a
            zero-length schedule (normalisation only) is allowed.
        extra_elementwise: FLOPs per element on top of Muon's ``10``; NorMuon passes
            ``NORMUON_ELEMENTWISE``.
    """

    ns_steps: int = MUON_DEFAULTS.ns_steps
    extra_elementwise: int = 0
    name: str = field(default="muon", init=False)

    def __post_init__(self) -> None:
        for field_name in ("ns_steps", "extra_elementwise"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"muon: {field_name} must be an integer >= 0, got {value!r}")

    def flops(self, spec: MatrixSpec) -> float:
        """``batch * (ns_steps * (4 a^2 b + 2 a^3) + (10 + extra_elementwise) m n)``."""
        a, b = min(spec.m, spec.n), max(spec.m, spec.n)
        per_iter = 4 * a * a * b + 2 * a**3
        elementwise = (MUON_ELEMENTWISE + self.extra_elementwise) * spec.m * spec.n
        return float(spec.batch * (self.ns_steps * per_iter + elementwise))

    def comm_bytes(self, spec: MatrixSpec) -> int:
        """The full gradient (or momentum) payload, ``numel * itemsize``."""
        return _payload(spec)

    def memory_bytes(self, spec: MatrixSpec) -> int:
        """The assembled full matrix on the owner, ``numel * itemsize``."""
        return _payload(spec)


class _GradientPayload:
    """The full gradient travels to the owner and is held there while it computes."""

    __slots__ = ()

    def comm_bytes(self, spec: MatrixSpec) -> int:
        """The full gradient payload, ``numel * itemsize``."""
        return _payload(spec)

    def memory_bytes(self, spec: MatrixSpec) -> int:
        """The assembled full matrix on the owner, ``numel * itemsize``."""
        return _payload(spec)


def _kronecker_flops(
    spec: MatrixSpec, *, max_dim: int, products: int, cube: float, frequency: int
) -> float:
    """Per-side Kronecker work: ``products`` products of ``2 d^2 (mn/d)`` and ``cube d^3 / f``.

    A side longer than ``max_dim`` costs nothing; the element-wise Adam-like term
    ``ADAM_ELEMENTWISE * m n`` is always added; the total is multiplied by the batch.
    """
    m, n = spec.m, spec.n
    total = float(ADAM_ELEMENTWISE * m * n)
    for d in (m, n):
        if d <= max_dim:
            total += 2 * d * m * n * products + cube * d**3 / frequency
    return spec.batch * total


@dataclass(frozen=True, kw_only=True, slots=True)
class ShampooCost(_GradientPayload):
    """Shampoo with Kronecker factors ``L`` (m x m) and ``R`` (n x n).

    Per step and per preconditioned side (a side of size ``d <= max_precond_dim``):

    * statistics: ``G G^T`` costs ``2 m^2 n`` (left), ``G^T G`` costs ``2 m n^2`` (right);
    * preconditioning: ``L^{-1/4} G`` costs ``2 m^2 n``, ``G R^{-1/4}`` costs ``2 m n^2``;
    * inverse fourth root by symmetric eigendecomposition, ``10 d^3`` (``EIGH_FACTOR``),
      recomputed every ``precondition_frequency`` steps, so amortised by that factor.

    A side larger than ``max_precond_dim`` contributes no statistic, no preconditioning and no
    root (it is left unpreconditioned). Element-wise grafting adds ``12 m n``. Everything is
    multiplied by the batch for 3-D shapes.

    Attributes:
        precondition_frequency: Steps between two root computations.
        max_precond_dim: Largest side that gets a Kronecker factor.
    """

    precondition_frequency: int = SHAMPOO_DEFAULTS.precondition_frequency
    max_precond_dim: int = SHAMPOO_DEFAULTS.max_precond_dim
    name: str = field(default="shampoo", init=False)

    def __post_init__(self) -> None:
        _positive_int("shampoo", "precondition_frequency", self.precondition_frequency)
        _non_negative_int("shampoo", "max_precond_dim", self.max_precond_dim)

    def flops(self, spec: MatrixSpec) -> float:
        """Statistics + preconditioning + amortised roots + element-wise, times the batch."""
        return _kronecker_flops(
            spec,
            max_dim=self.max_precond_dim,
            products=2,
            cube=EIGH_FACTOR,
            frequency=self.precondition_frequency,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SoapCost(_GradientPayload):
    """SOAP: Adam in the eigenbasis of Shampoo's factors.

    Per step and per preconditioned side (``d <= max_precond_dim``):

    * statistics as Shampoo: ``2 m^2 n`` (left), ``2 m n^2`` (right);
    * projection of the gradient into the eigenbasis ``Q_L^T G Q_R`` and of the update back
      out ``Q_L U Q_R^T``: ``2 m^2 n`` per left side and ``2 m n^2`` per right side, twice;
    * eigenbasis refresh every ``precondition_frequency`` steps: one power-iteration step
      ``S Q`` (``2 d^3``) followed by a QR (``(4/3) d^3 * 2``, ``QR_FACTOR``), amortised.

    A side above ``max_precond_dim`` uses the identity basis (no cost). Adam's element-wise work
    in the rotated space adds ``12 m n``. Everything is multiplied by the batch.

    Attributes:
        precondition_frequency: Steps between two eigenbasis refreshes.
        max_precond_dim: Largest side that gets a Kronecker factor.
    """

    precondition_frequency: int = SOAP_DEFAULTS.precondition_frequency
    max_precond_dim: int = SOAP_DEFAULTS.max_precond_dim
    name: str = field(default="soap", init=False)

    def __post_init__(self) -> None:
        _positive_int("soap", "precondition_frequency", self.precondition_frequency)
        _non_negative_int("soap", "max_precond_dim", self.max_precond_dim)

    def flops(self, spec: MatrixSpec) -> float:
        """Statistics + two projections + amortised refresh + element-wise, times the batch."""
        return _kronecker_flops(
            spec,
            max_dim=self.max_precond_dim,
            products=3,
            cube=2.0 + QR_FACTOR * 4.0 / 3.0,
            frequency=self.precondition_frequency,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AdamWCost(_GradientPayload):
    """AdamW: purely element-wise, ``12 * numel`` FLOPs (``ADAM_ELEMENTWISE``)."""

    name: str = field(default="adamw", init=False)

    def flops(self, spec: MatrixSpec) -> float:
        """``12 * numel``."""
        return float(ADAM_ELEMENTWISE * spec.numel)


@dataclass(frozen=True, slots=True)
class GroupedCost:
    """Prices each matrix with the cost model its :attr:`MatrixSpec.cost_key` names.

    One optimizer's param groups can set the work differently (``ns_steps``,
    ``precondition_frequency``, ...): each group gets its own model, so the plan costs
    what the user runs.

    Attributes:
        models: Cost model per key.
        name: The optimizer's name.
    """

    models: Mapping[str, CostModel]
    name: str = "grouped"

    def __post_init__(self) -> None:
        if not isinstance(self.models, Mapping):
            raise ValueError(
                f"GroupedCost maps str keys to cost models, got {type(self.models).__name__} "
                f"{self.models!r}"
            )
        if not self.models:
            raise ValueError("GroupedCost needs at least one cost model")
        for key, model in self.models.items():
            if not isinstance(key, str) or not isinstance(model, CostModel):
                raise ValueError(f"GroupedCost maps str keys to cost models, got {key!r}")

    def model_of(self, spec: MatrixSpec) -> CostModel:
        """The model that prices ``spec`` (its ``cost_key``'s); ValueError for an unknown key."""
        model = self.models.get(spec.cost_key) if spec.cost_key is not None else None
        if model is None:
            raise ValueError(
                f"matrix {spec.name!r} has cost_key {spec.cost_key!r}, not one of "
                f"{sorted(self.models)}"
            )
        return model

    def flops(self, spec: MatrixSpec) -> float:
        """The FLOPs of the spec's own model."""
        return self.model_of(spec).flops(spec)

    def comm_bytes(self, spec: MatrixSpec) -> int:
        """The bytes of the spec's own model."""
        return self.model_of(spec).comm_bytes(spec)

    def memory_bytes(self, spec: MatrixSpec) -> int:
        """The bytes in flight of the spec's own model."""
        return self.model_of(spec).memory_bytes(spec)

    def params(self) -> dict[str, Any]:
        """Every model's name and parameters (what the plan digest covers)."""
        return {
            key: {"name": m.name, "params": cost_model_params(m)}
            for key, m in sorted(self.models.items())
        }


COST_MODELS: Mapping[str, type[Any]] = {
    "muon": MuonCost,
    "shampoo": ShampooCost,
    "soap": SoapCost,
    "adamw": AdamWCost,
}


def cost_model(name: str, **params: Any) -> CostModel:
    """Build the cost model of an optimizer by name.

    Args:
        name: One of ``"muon"``, ``"shampoo"``, ``"soap"``, ``"adamw"``.
        **params: The model's parameters (``ns_steps`` for Muon; ``precondition_frequency``
            and ``max_precond_dim`` for Shampoo and SOAP).

    Returns:
        A frozen cost model.

    Raises:
        ValueError: On an unknown name, an unknown parameter or an invalid value.
    """
    cls = COST_MODELS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown optimizer cost model, expected one of {sorted(COST_MODELS)}, got {name!r}"
        )
    allowed = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ValueError(f"cost model {name!r} takes {sorted(allowed)}, got {unknown!r}")
    model: CostModel = cls(**params)
    return model


def resolve_cost_model(optimizer: str | CostModel) -> CostModel:
    """Accept a cost model or the name of a built-in one."""
    if isinstance(optimizer, str):
        return cost_model(optimizer)
    if not isinstance(optimizer, CostModel):
        raise ValueError(f"optimizer must be a name or a CostModel, got {optimizer!r}")
    return optimizer


def cost_model_params(model: CostModel) -> dict[str, Any]:
    """The parameters identifying a cost model (used by the plan digest)."""
    params = getattr(model, "params", None)
    if callable(params):
        return dict(params())
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        return {f.name: getattr(model, f.name) for f in dataclasses.fields(model) if f.init}
    return {}


def _finite_nonnegative(value: float) -> bool:
    try:
        return math.isfinite(value) and value >= 0
    except (OverflowError, TypeError):  # an int past a float's range; not a number
        return False


def priced(specs: Sequence[MatrixSpec], model: CostModel) -> tuple[list[float], list[int]]:
    """Each spec's work and its bytes in transit, checked (see :func:`in_flight`)."""
    work = [model.flops(s) for s in specs]
    nbytes = [model.comm_bytes(s) for s in specs]
    for s, f, b in zip(specs, work, nbytes, strict=True):
        if not (_finite_nonnegative(f) and _finite_nonnegative(b)):
            _raise_price(s, f, b, "bytes")
    return work, nbytes


def in_flight(specs: Sequence[MatrixSpec], model: CostModel) -> list[int]:
    """Each spec's bytes in flight on its owner, checked.

    Raises:
        ValueError: naming the first matrix whose price is not finite and >= 0.
    """
    nbytes = [model.memory_bytes(s) for s in specs]
    for s, b in zip(specs, nbytes, strict=True):
        if not _finite_nonnegative(b):
            _raise_price(s, model.flops(s), b, "bytes in flight")
    return nbytes


def _raise_price(spec: MatrixSpec, work: float, nbytes: float, kind: str) -> NoReturn:
    raise ValueError(
        f"the cost model prices matrix {spec.name!r} {spec.shape} at {work!r} (work) and "
        f"{nbytes!r} {kind}; both must be finite and >= 0"
    )


def total_of(values: Sequence[float], what: str) -> float:
    """``math.fsum(values)``, or ValueError where the sum leaves a float's range."""
    try:
        return math.fsum(values)
    except OverflowError:
        raise ValueError(
            f"{what} add up past a float's range (largest {max(values)!r}); price them in "
            "larger units"
        ) from None
