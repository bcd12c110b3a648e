"""Types of the numbers an optimizer is given, checked against its signature's annotations."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

import torch


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_NUMBER = "a number or a 0-dim tensor"
_LR = "a number or a 1-element tensor"  # a tensor's size: checked by range
_INTEGER = "an integer"
_INTEGER_OR_NONE = "an integer or None"
_SEQUENCE = "a sequence of numbers"
#: What each annotation of an optimizer's signature takes, as its errors say it (others are
#: checked by range).
_TAKES = {
    "float": _NUMBER,
    "float | Tensor": _LR,
    "int": _INTEGER,
    "int | None": _INTEGER_OR_NONE,
    "tuple[float, float]": _SEQUENCE,
}


@cache
def typed_keys(cls: type) -> Mapping[str, str]:
    """What each number (or pair of numbers) that ``cls`` takes must be, by name."""
    out = {}
    for name, parameter in inspect.signature(cls).parameters.items():
        annotation = parameter.annotation
        if isinstance(annotation, str) and annotation in _TAKES:
            out[name] = _TAKES[annotation]
    return out


def _number_like(value: object) -> bool:
    """A number, or a 0-dim tensor (the math broadcasts it as it would a float)."""
    return _number(value) or (isinstance(value, torch.Tensor) and value.dim() == 0)


def _fits(value: object, want: str) -> bool:
    if want == _LR and isinstance(value, torch.Tensor):
        return True
    if want == _INTEGER_OR_NONE and value is None:
        return True
    if want in (_INTEGER, _INTEGER_OR_NONE):
        return (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if want == _SEQUENCE:
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            return False
        return all(_number_like(v) for v in value)
    return _number_like(value)


def check_types(group: Mapping[str, Any], cls: type) -> None:
    """Raise ``TypeError`` naming the key and value where ``group`` has a number of another type.

    The types follow the annotations of ``cls``'s signature: ``float`` takes a real number
    or a 0-dim tensor (``bool`` is no number here, a string none anywhere), ``float |
    Tensor`` (the learning rate) also a one-element tensor, as torch.optim does, ``int`` an
    integer (or a float with an integral value), ``int | None`` that or ``None``,
    ``tuple[float, float]`` a sequence of such numbers. The ranges are checked after.
    """
    for key, want in typed_keys(cls).items():
        if key in group and not _fits(group[key], want):
            value = group[key]
            raise TypeError(f"{key} must be {want}, got {value!r} ({type(value).__name__})")


def typed_defaults(defaults: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``defaults`` checked by :func:`check_types`, sequences as tuples, integers as ints.

    A sequence may be any iterable of numbers (a generator, an array, a tensor), as the
    constructors took it before; an integer a numpy one or an integral float.
    """
    takes = typed_keys(cls)
    out = dict(defaults)
    for key, want in takes.items():
        value = out.get(key)
        sequence = isinstance(value, Iterable) and not isinstance(value, str | bytes)
        if want == _SEQUENCE and sequence:
            out[key] = tuple(value)  # type: ignore[arg-type]  # a generator: read once
    check_types(out, cls)
    for key, want in takes.items():
        if key in out and (want == _INTEGER or (want == _INTEGER_OR_NONE and out[key] is not None)):
            out[key] = int(out[key])
    return out
