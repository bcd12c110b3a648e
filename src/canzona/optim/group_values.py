"""Param-group values in a state dict: plain values DCP can gather, offload and flatten."""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from canzona.optim.adamw_route import scalar
from canzona.plan import Split

#: The prefix of a saved :class:`~canzona.Split` (a string: DCP holds no objects, and a
#: consolidated state dict is copied leaf by leaf, so every Split saves as one leaf).
SPLIT_TAG = "canzona.Split"


def saved_value(value: Any) -> Any:
    """A param-group value as ``state_dict()`` writes it.

    ``torch.distributed.checkpoint.state_dict.get_state_dict`` with ``full_state_dict`` or
    ``cpu_offload`` accepts tensors, numbers, strings, None and containers of them only: a
    dtype becomes its name (``"torch.bfloat16"``), a Split one string
    (``'canzona.Split {"dim": 0, "sizes": [8, 4, 4], "size": null}'``): a tuple of its fields
    would have another structure for another declaration of the same blocks, which the
    consolidated loads cannot match leaf by leaf.
    """
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, Split):
        sizes = None if value.sizes is None else list(value.sizes)
        fields = {"dim": value.dim, "sizes": sizes, "size": value.size}
        return f"{SPLIT_TAG} {json.dumps(fields)}"
    return value


def loaded_value(value: Any) -> Any:
    """The inverse of :func:`saved_value` (values saved as objects pass unchanged).

    Raises:
        ValueError: for a saved Split whose fields do not make a Split.
    """
    if isinstance(value, str) and value.startswith("torch."):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    if isinstance(value, str) and value.startswith(f"{SPLIT_TAG} {{"):
        try:
            fields = json.loads(value.removeprefix(SPLIT_TAG))
            sizes = fields["sizes"]
            return Split(
                dim=fields["dim"],
                sizes=None if sizes is None else tuple(sizes),
                size=fields["size"],
            )
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"a saved split must be {SPLIT_TAG} and its fields, got {value!r}"
            ) from exc
    # the tagged tuple of earlier checkpoints
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 4:
        tag, dim, sizes, size = value
        if tag == SPLIT_TAG:
            return Split(dim=dim, sizes=None if sizes is None else tuple(sizes), size=size)
    return value


def saved_groups(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``state_dict()``'s param groups with every value as :func:`saved_value` writes it."""
    return [{k: v if k == "params" else saved_value(v) for k, v in g.items()} for g in groups]


def loaded_groups(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """A state dict's param groups with every value as :func:`loaded_value` reads it."""
    return [{k: v if k == "params" else loaded_value(v) for k, v in g.items()} for g in groups]


#: Types :func:`plain_value` passes through unchanged (checked first: it runs per step).
_SCALARS = frozenset({float, int, bool, str, type(None), torch.dtype})


def plain_value(value: Any) -> Any:
    """A process-independent view of a param-group value, for the cross-rank check.

    Numbers (numpy's by their type too), strings, dtypes and containers of them compare by
    value; a tensor or numpy array by its dtype and its value when it has one element (an
    array: its values); any other object only by its type (its ``repr`` may hold a memory
    address that differs between processes).
    """
    if type(value) in _SCALARS:
        return value
    if value is None or isinstance(value, bool | int | float | str | torch.dtype):
        return value
    if isinstance(value, Tensor):
        # the dtype too: a float32 tensor lr gives float32 products where a float gives float64
        held = scalar(value) if value.numel() == 1 else tuple(value.shape)
        return (str(value.dtype), held)
    if isinstance(value, list | tuple):
        return tuple(plain_value(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), plain_value(v)) for k, v in value.items()))
    if isinstance(value, Split):
        return value.describe()
    if isinstance(value, numbers.Real):  # a numpy scalar: by its type (its rounding) and value
        return (type(value).__qualname__, float(value))
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # a numpy array: its values
        return (type(value).__qualname__, str(value.dtype), plain_value(value.tolist()))
    return type(value).__qualname__
