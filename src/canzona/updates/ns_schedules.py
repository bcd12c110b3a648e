"""Newton–Schulz coefficient schedules (one ``(a, b, c)`` per iteration) and the named sets."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from types import MappingProxyType
from typing import TypeAlias

from canzona.defaults import MUON_DEFAULTS

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "MAX_NS_STEPS",
    "NS_SCHEDULES",
    "POLAR_EXPRESS_SAFETY",
    "NSCoefficients",
    "NamedSchedule",
    "Schedule",
    "ns_norm_scale",
    "resolve_ns_coefficients",
]

Triple: TypeAlias = tuple[float, float, float]
Schedule: TypeAlias = tuple[Triple, ...]
"""One ``(a, b, c)`` per Newton–Schulz iteration."""
NSCoefficients: TypeAlias = str | Sequence[float] | Sequence[Sequence[float]]
"""What ``ns_coefficients`` accepts: a triple, a sequence of triples, or a registered name."""

DEFAULT_NS_COEFFICIENTS: Triple = MUON_DEFAULTS.ns_coefficients
DEFAULT_NS_STEPS = MUON_DEFAULTS.ns_steps
#: Schedules and step counts are limited to ``[0, MAX_NS_STEPS)`` iterations, as torch's Muon.
MAX_NS_STEPS = 100
#: Schedules already resolved, by :func:`_cache_key` (a step resolves one per batch).
_RESOLVED: dict[tuple[object, ...], Schedule] = {}
_RESOLVED_MAX = 64

# Polar Express, arXiv 2505.16932: the published polynomials before the safety scaling. They are
# the paper's optimal composition for singular values in [1e-3, 1] (lower bound 1e-3, cushion
# 0.02407327424182761, eight iterations); the eighth is the limit (15/8, -10/8, 3/8) that every
# later polynomial equals numerically.
_POLAR_EXPRESS_RAW: Schedule = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
#: The Polar Express safety factor: polynomials run on ``x / 1.01`` and the input norm is
#: multiplied by ``1.01``, so that round-off never pushes a singular value past the interval
#: the polynomials were optimised for.
POLAR_EXPRESS_SAFETY = 1.01


def _safe(raw: Schedule, safety: float) -> Schedule:
    """``p(x / s)`` for every polynomial but the last, as the Polar Express paper prescribes."""
    scaled = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in raw[:-1])
    return (*scaled, raw[-1])


@dataclass(frozen=True, kw_only=True, slots=True)
class NamedSchedule:
    """A registered coefficient set.

    Attributes:
        coefficients: The published per-iteration triples. Asked for more iterations than it
            holds, the set repeats its last triple; asked for fewer, it takes the first ones
            (the rule of the Polar Express code and of the Canzona paper's reference code).
        norm_scale: The input is divided by ``norm_scale * ||X||_F`` (clamped below by ``eps``).
    """

    coefficients: Schedule
    norm_scale: float = 1.0

    def take(self, steps: int) -> Schedule:
        """The first ``steps`` triples, the last one repeated past the published length."""
        head = self.coefficients[:steps]
        return head + (self.coefficients[-1],) * (steps - len(head))


# The registered sets and their sources:
# * "quintic": (3.4445, -4.775, 2.0315) at every iteration, the default of torch.optim.Muon
#   (`simple` in the reference code of the Canzona paper, arXiv 2602.06079).
# * "polar_express": the eight polynomials of "The Polar Express: Optimal Matrix Sign Methods and
#   Their Application to the Muon Algorithm" (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932)
#   with the paper's safety scaling: every polynomial but the last becomes p(x / 1.01), and the
#   input is divided by 1.01 ||X||_F.
# * "tuned_quintic", "qwen_express": `--muon-ns-coefficient-type quintic` and `qwen_express` of
#   the Canzona paper's reference code.
NS_SCHEDULES: Mapping[str, NamedSchedule] = MappingProxyType(
    {
        "quintic": NamedSchedule(coefficients=(DEFAULT_NS_COEFFICIENTS,) * DEFAULT_NS_STEPS),
        "polar_express": NamedSchedule(
            coefficients=_safe(_POLAR_EXPRESS_RAW, POLAR_EXPRESS_SAFETY),
            norm_scale=POLAR_EXPRESS_SAFETY,
        ),
        # `--muon-ns-coefficient-type quintic` of the Canzona paper's reference code (from the
        # modded-nanogpt speedrun): in float64 five steps take every singular value in
        # [0.01, 1] to [0.978, 1.032].
        "tuned_quintic": NamedSchedule(
            coefficients=(
                (4.0848, -6.8946, 2.9270),
                (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012),
            )
        ),
        # `--muon-ns-coefficient-type qwen_express` of the same code: the Polar Express
        # construction with lower bound 1e-3 and no cushion, the first seven divided by the
        # safety factor as above, rounded to four decimals; the input is not rescaled there.
        "qwen_express": NamedSchedule(
            coefficients=(
                (8.3865, -24.3696, 17.7251),
                (4.1414, -3.0173, 0.5524),
                (3.9226, -2.8672, 0.5357),
                (3.2540, -2.3922, 0.4827),
                (2.2512, -1.5963, 0.3960),
                (1.8700, -1.2279, 0.3582),
                (1.8564, -1.2132, 0.3568),
                (1.8750, -1.2500, 0.3750),
            )
        ),
    }
)


def _is_number(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _check_steps(ns_steps: object) -> int:
    """``ns_steps`` as an ``int``: an integer (a numpy one too), not a bool or a float."""
    if not isinstance(ns_steps, Integral) or isinstance(ns_steps, bool):
        raise ValueError(f"ns_steps must be an int in [0, {MAX_NS_STEPS}), got {ns_steps!r}")
    steps = int(ns_steps)
    if not 0 <= steps < MAX_NS_STEPS:
        raise ValueError(f"ns_steps must be an int in [0, {MAX_NS_STEPS}), got {ns_steps!r}")
    return steps


def _triple(value: object, where: str) -> Triple:
    """Validate one ``(a, b, c)``: three finite real numbers (``where`` locates it)."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a sequence (a, b, c), got {value!r}")
    if len(value) != 3:
        raise ValueError(f"{where} must hold three coefficients (a, b, c), got {value!r}")
    if not all(_is_number(x) for x in value):
        raise ValueError(f"{where} must hold three real numbers, got {value!r}")
    a, b, c = (float(x) for x in value)
    if not all(math.isfinite(x) for x in (a, b, c)):
        raise ValueError(f"{where} must be finite, got {value!r}")
    return a, b, c


def _named(value: str) -> NamedSchedule:
    named = NS_SCHEDULES.get(value)
    if named is None:
        raise ValueError(
            f"unknown Newton–Schulz coefficient set, expected one of {sorted(NS_SCHEDULES)} "
            f"or (a, b, c) triples, got {value!r}"
        )
    return named


def resolve_ns_coefficients(value: NSCoefficients, ns_steps: int | None = None) -> Schedule:
    """The per-iteration schedule that ``ns_coefficients`` and ``ns_steps`` describe.

    * a triple ``(a, b, c)``: repeated ``ns_steps`` times (``None``: :data:`DEFAULT_NS_STEPS`),
      as ``torch.optim.Muon``;
    * a sequence of triples: that schedule; its length is the number of iterations, and
      ``ns_steps`` must be ``None`` or equal to it;
    * a name from :data:`NS_SCHEDULES`: the published triples (``None``: all of them); with
      ``ns_steps`` the first ``ns_steps``, the last one repeated past the published length.

    Args:
        value: What the optimizer's ``ns_coefficients`` holds.
        ns_steps: Number of iterations, in ``[0, 100)``, or ``None`` (see above).

    Returns:
        A tuple of ``(a, b, c)`` float triples (empty only for ``ns_steps=0``).

    Raises:
        ValueError: On an empty schedule, a triple that is not three finite real numbers, an
            unknown name, ``ns_steps`` outside ``[0, 100)``, a schedule of 100 or more
            iterations, or ``ns_steps`` that contradicts the length of an explicit schedule.
            The message names the offending value.
    """
    key = _cache_key(value, ns_steps)
    if key is not None:
        cached = _RESOLVED.get(key)
        if cached is not None:
            return cached
    schedule = _resolve(value, ns_steps)
    if key is not None:
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[key] = schedule
    return schedule


def _cache_key(value: object, ns_steps: object) -> tuple[object, ...] | None:
    """A key under which :func:`resolve_ns_coefficients` may reuse a result, or None.

    Only names and tuples or lists of plain ``int``/``float`` values (at most two levels)
    are keyed: their value decides the result. Anything else (a tensor, a bool, which
    the validation refuses but which compares equal to 1) is resolved every time, and so
    is a schedule with a zero coefficient (``0.0 == -0.0``, but the iteration may keep
    the sign of a zero).
    """
    if type(ns_steps) is not int and ns_steps is not None:
        return None
    if type(value) is str:
        return (value, ns_steps)
    if type(value) is not tuple and type(value) is not list:
        return None
    leaves: list[object] = []
    for x in value:
        kind = type(x)
        if (kind is float or kind is int) and x != 0:
            leaves.append(x)
        elif (kind is tuple or kind is list) and all(
            (type(y) is float or type(y) is int) and y != 0 for y in x
        ):
            leaves.append(tuple(x))
        else:
            return None
    return (tuple(leaves), ns_steps)


def _resolve(value: NSCoefficients, ns_steps: int | None) -> Schedule:
    steps = None if ns_steps is None else _check_steps(ns_steps)
    if isinstance(value, str):
        named = _named(value)
        return named.take(len(named.coefficients) if steps is None else steps)
    if not isinstance(value, Sequence):
        raise ValueError(
            f"ns_coefficients must be a name, an (a, b, c) triple or a sequence of triples, "
            f"got {value!r}"
        )
    if len(value) == 0:
        raise ValueError(f"ns_coefficients must not be empty, got {value!r}")
    if not any(isinstance(x, Sequence) and not isinstance(x, str) for x in value):
        triple = _triple(value, "ns_coefficients")
        return (triple,) * (DEFAULT_NS_STEPS if steps is None else steps)
    schedule = tuple(_triple(t, f"ns_coefficients[{i}]") for i, t in enumerate(value))
    if len(schedule) >= MAX_NS_STEPS:
        raise ValueError(
            f"a schedule must have fewer than {MAX_NS_STEPS} iterations, got {len(schedule)}"
        )
    if steps is not None and steps != len(schedule):
        raise ValueError(
            f"ns_steps={steps!r} contradicts the schedule of {len(schedule)} iterations given as "
            f"ns_coefficients (its length sets the number of iterations; pass ns_steps=None)"
        )
    return schedule


def ns_norm_scale(value: NSCoefficients) -> float:
    """By how much the input norm is multiplied before the first iteration.

    ``1.01`` for ``"polar_express"`` (the Polar Express normalisation), ``1.0`` for every other
    name, triple or explicit schedule.

    Args:
        value: What the optimizer's ``ns_coefficients`` holds.

    Returns:
        The factor.

    Raises:
        ValueError: On an unknown name.
    """
    return _named(value).norm_scale if isinstance(value, str) else 1.0
