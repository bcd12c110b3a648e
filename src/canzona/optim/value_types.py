"""Types of the numbers an optimizer is given, checked against its signature's annotations."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch


def _number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


#: What each annotation of an optimizer's signature takes (others are checked by range).
_TAKES = {
    "float": "a number",
    "float | Tensor": "a number or a 1-element tensor",
    "int": "an integer",
    "tuple[float, float]": "a sequence of numbers",
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


def _fits(value: object, want: str) -> bool:
    if want == "an integer":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if want == "a sequence of numbers":
        return isinstance(value, (tuple, list)) and all(_number(v) for v in value)
    return _number(value) or (want != "a number" and isinstance(value, torch.Tensor))


def check_types(group: Mapping[str, Any], cls: type) -> None:
    """Raise ``TypeError`` naming the key and value where ``group`` has a number of another type.

    The types follow the annotations of ``cls``'s signature: ``float`` takes a real number
    (``bool`` is none here, a string none anywhere), ``float | Tensor`` (``lr``, as in
    torch.optim) also a tensor, ``int`` an integer, ``tuple[float, float]`` a sequence of
    numbers. The ranges are checked after.
    """
    for key, want in typed_keys(cls).items():
        if key in group and not _fits(group[key], want):
            value = group[key]
            raise TypeError(f"{key} must be {want}, got {value!r} ({type(value).__name__})")


def typed_defaults(defaults: Mapping[str, Any], cls: type) -> dict[str, Any]:
    """``defaults`` checked by :func:`check_types`, with sequences of numbers as tuples."""
    check_types(defaults, cls)
    pairs = {k for k, want in typed_keys(cls).items() if want == "a sequence of numbers"}
    return {k: tuple(v) if k in pairs else v for k, v in defaults.items()}
