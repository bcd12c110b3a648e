"""canzona.param_groups: route a model's parameters to the matrix algorithm or to AdamW."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

HEAD_NAMES = ("lm_head", "output")

NamedParams = list[tuple[str, nn.Parameter]]


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _embedding_and_head_ids(model: nn.Module) -> set[int]:
    ids: set[int] = set()
    for mod_name, module in model.named_modules():
        last = mod_name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) or last in HEAD_NAMES:
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def split_params(
    model: nn.Module, *, to_adamw: Iterable[str] = (), to_matrix: Iterable[str] = ()
) -> tuple[NamedParams, NamedParams]:
    """``model``'s named parameters routed as :func:`param_groups` routes them.

    Returns:
        (parameters for the matrix algorithm, parameters for AdamW), each in
        ``model.named_parameters()`` order.

    Raises:
        ValueError: when a pattern forces a parameter that is not 2-D or 3-D to the
            matrix algorithm.
    """
    to_adamw, to_matrix = tuple(to_adamw), tuple(to_matrix)
    special = _embedding_and_head_ids(model)
    matrix_params: NamedParams = []
    adamw_params: NamedParams = []
    for name, p in model.named_parameters():
        if _matches(name, to_adamw):
            adamw_params.append((name, p))
        elif _matches(name, to_matrix):
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"parameter {name!r} is {p.ndim}-D and cannot use the matrix algorithm"
                )
            matrix_params.append((name, p))
        elif p.ndim in (2, 3) and id(p) not in special:
            matrix_params.append((name, p))
        else:
            adamw_params.append((name, p))
    return matrix_params, adamw_params


def param_groups(
    model: nn.Module,
    *,
    to_adamw: Iterable[str] = (),
    to_matrix: Iterable[str] = (),
    adamw: Mapping[str, Any] | None = None,
    **matrix: Any,
) -> list[dict[str, Any]]:
    """Split ``model``'s parameters into a matrix group and an AdamW group.

    Matrix algorithm: 2-D weights and 3-D stacks of matrices (e.g. grouped experts).
    AdamW: embeddings, the output head (modules named ``lm_head`` or ``output``, and
    any weight tied to an embedding), biases, norms and every other non-matrix
    parameter. Name patterns (``fnmatch``, on ``model.named_parameters()`` names)
    override the routing. The groups hold named parameters, so error messages and
    plans use the model's names.

    The AdamW group has ``weight_decay=0.0`` unless ``adamw`` sets it: norms, biases,
    embeddings and the head are not decayed by default. Its learning rate and the
    matrix group's entries come from the optimizer's defaults unless given here.

    Args:
        model: The model (plain, FSDP2-wrapped or tensor parallel).
        to_adamw: Name patterns forced to AdamW.
        to_matrix: Name patterns forced to the matrix algorithm (must be 2-D or 3-D).
        adamw: Extra entries of the AdamW group (e.g. ``{"lr": 3e-4}``;
            ``{"weight_decay": 0.1}`` decays the whole group).
        **matrix: Extra entries of the matrix group (e.g. ``lr=0.02``).

    Returns:
        Up to two param groups (empty groups are left out), ready for
        :class:`canzona.Muon`, :class:`canzona.Shampoo` or :class:`canzona.SOAP`.

    Raises:
        ValueError: when a pattern forces a parameter that is not 2-D or 3-D to the
            matrix algorithm.
    """
    matrix_params, adamw_params = split_params(model, to_adamw=to_adamw, to_matrix=to_matrix)
    groups: list[dict[str, Any]] = []
    if matrix_params:
        groups.append({"params": matrix_params, **matrix})
    if adamw_params:
        entries = {"weight_decay": 0.0, **(adamw or {}), "algorithm": "adamw"}
        groups.append({"params": adamw_params, **entries})
    return groups
