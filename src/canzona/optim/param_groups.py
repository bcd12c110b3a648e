"""canzona.param_groups: route a model's parameters to the matrix algorithm or to AdamW."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from canzona.optim.owner_state import matrix_shape
from canzona.plan import Split

HEAD_NAMES = ("lm_head", "output")
#: Modules whose weights route tokens to experts: AdamW by default, like the embedding.
ROUTER_NAMES = ("router", "gate")

NamedParams = list[tuple[str, nn.Parameter]]


#: Words of a parameter's own name (split at ``_``) that make it not a weight matrix even
#: when it is 2-D or 3-D: a stack of per-expert biases (``mlp1_bias_EG``), a positional
#: embedding or a class/register token registered as a bare ``nn.Parameter``.
NOT_A_WEIGHT_WORDS = ("bias", "biases", "token", "tokens")


def _not_a_weight(name: str) -> bool:
    """Whether the parameter's own name (after the last ``.``) says bias, embedding or token."""
    words = name.rsplit(".", 1)[-1].lower().split("_")
    return any(w in NOT_A_WEIGHT_WORDS or w.startswith("embed") for w in words)


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _embedding_head_and_router_ids(model: nn.Module) -> set[int]:
    """Parameters of embeddings, the output head and MoE routers.

    A router is a module named ``router`` or exactly ``gate`` (``moe.router.gate``,
    ``mlp.gate``; not ``gate_proj``).
    """
    ids: set[int] = set()
    for mod_name, module in model.named_modules():
        parts = mod_name.split(".")
        special = parts[-1] in HEAD_NAMES or any(p in ROUTER_NAMES for p in parts)
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) or special:
            ids.update(id(p) for p in module.parameters(recurse=False))
    return ids


def _convolution_weight_ids(model: nn.Module) -> set[int]:
    """Weights of convolutions (``nn.Conv1d`` to ``nn.Conv3d`` and their transposes)."""
    return {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, _ConvNd) and isinstance(module.weight, torch.Tensor)
    }


def split_params(
    model: nn.Module, *, to_adamw: Iterable[str] = (), to_matrix: Iterable[str] = ()
) -> tuple[NamedParams, NamedParams]:
    """``model``'s named parameters routed as :func:`param_groups` routes them.

    Returns:
        (parameters for the matrix algorithm, parameters for AdamW), each in
        ``model.named_parameters()`` order.

    Raises:
        TypeError: when ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: when a pattern forces a parameter that is not 2-D or 3-D to the
            matrix algorithm (a pattern that matches nothing: a ``UserWarning``).
    """
    matrix_params, _, adamw_params = _route(model, to_adamw, to_matrix, flatten=False)
    return matrix_params, adamw_params


def _route(
    model: nn.Module, to_adamw: Iterable[str], to_matrix: Iterable[str], *, flatten: bool
) -> tuple[NamedParams, NamedParams, NamedParams]:
    """(matrices and stacks, weights to matricise (``flatten``), AdamW), in model order.

    With ``flatten``, a convolution weight or a weight of more than three dimensions goes
    to the matrix algorithm as its matricisation, unless AdamW's rules claim it first
    (an embedding, the head, a router, a name that says bias, embedding or token); one a
    ``to_matrix`` pattern names is matricised too.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"pass the model (an nn.Module), not its parameters: got {type(model).__name__}"
        )
    to_adamw, to_matrix = tuple(to_adamw), tuple(to_matrix)
    names = [n for n, _ in model.named_parameters()]
    for label, patterns in (("to_adamw", to_adamw), ("to_matrix", to_matrix)):
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                # a warning: a pipeline stage builds its groups from its own part of the model
                hint = _prefixed(names, pattern) or (
                    " (a typo? with pipeline stages, it may match in another stage only)"
                )
                warnings.warn(
                    f"{label} pattern {pattern!r} matches no parameter of the model{hint}",
                    UserWarning,
                    stacklevel=3,
                )
    # a Conv1d weight (out, in, k) is 3-D but one matrix's worth, not a stack of (in, k)
    heads, convs = _embedding_head_and_router_ids(model), _convolution_weight_ids(model)
    matrix_params: NamedParams = []
    nd: NamedParams = []
    adamw_params: NamedParams = []
    for name, p in model.named_parameters():
        matricised = flatten and (p.ndim > 3 or id(p) in convs)
        if _matches(name, to_adamw):
            adamw_params.append((name, p))
        elif _matches(name, to_matrix):
            if matricised:
                nd.append((name, p))
            elif p.ndim in (2, 3):
                matrix_params.append((name, p))
            else:
                hint = (
                    " (flatten=True sends it as its (shape[0], rest) matrix)" if p.ndim > 3 else ""
                )
                raise ValueError(
                    f"parameter {name!r} is {p.ndim}-D and cannot use the matrix algorithm{hint}"
                )
        elif id(p) in heads or _not_a_weight(name):
            adamw_params.append((name, p))
        elif matricised:
            nd.append((name, p))
        elif p.ndim in (2, 3) and id(p) not in convs:
            matrix_params.append((name, p))
        else:
            adamw_params.append((name, p))
    return matrix_params, nd, adamw_params


def param_groups(
    model: nn.Module,
    *,
    to_adamw: Iterable[str] = (),
    to_matrix: Iterable[str] = (),
    adamw: Mapping[str, Any] | None = None,
    split: Mapping[str, Split] | None = None,
    flatten: bool = False,
    **matrix: Any,
) -> list[dict[str, Any]]:
    """Split ``model``'s parameters into a matrix group and an AdamW group.

    Matrix algorithm: 2-D weights and 3-D stacks of matrices (e.g. grouped experts).
    AdamW: embeddings, the output head (modules named ``lm_head`` or ``output``, and
    any weight tied to an embedding), MoE routers (modules named ``router``, or exactly
    ``gate``), convolution weights (``nn.Conv1d``'s 3-D one too: it is not a stack),
    biases, norms and every other non-matrix parameter, and parameters whose own name
    has the word ``bias``, ``token(s)`` or ``embed...`` (split at ``_``) whatever their
    shape: stacks of expert biases (``mlp1_bias_EG``), positional embeddings and class
    tokens registered as bare parameters (``pos_embed``, ``cls_token``). Name patterns
    (``fnmatch``, on ``model.named_parameters()`` names) override the routing. The groups
    hold named parameters, so error messages and plans use the model's names.

    ``split`` declares parameters that are several matrices (fused QKV or gate/up, one
    matrix per head): each matching matrix parameter gets the pattern's
    :class:`~canzona.Split` (the first matching pattern wins), in one matrix group per
    distinct split with the other matrix group's entries. With ``flatten``, a split of a
    convolution splits its ``(shape[0], rest)`` matricisation.

    The AdamW group has ``weight_decay=0.0`` unless ``adamw`` sets it: norms, biases,
    embeddings and the head are not decayed by default. Its learning rate and the
    matrix group's entries come from the optimizer's defaults unless given here.

    Args:
        model: The model (plain, FSDP2-wrapped or tensor parallel).
        to_adamw: Name patterns forced to AdamW.
        to_matrix: Name patterns forced to the matrix algorithm (must be 2-D or 3-D).
        adamw: Extra entries of the AdamW group (e.g. ``{"lr": 3e-4}``;
            ``{"weight_decay": 0.1}`` decays the whole group).
        split: Name pattern -> how the matching matrices split into blocks.
        flatten: Send convolution weights (``nn.Conv1d`` to ``nn.Conv3d``) and other
            weights of more than three dimensions to the matrix algorithm as their
            ``(shape[0], rest)`` matricisation (their own group, with ``flatten=True``),
            but for those AdamW's rules claim (a head, a ``pos_embed``); a ``to_matrix``
            pattern naming a convolution matricises it too. Without it they go to AdamW.
        **matrix: Extra entries of the matrix groups (e.g. ``lr=0.02``).

    Returns:
        The param groups (empty groups are left out): the matrices, the AdamW group, and
        one more per ``split`` declaration and for ``flatten``'s weights; ready for
        :class:`canzona.Muon`, :class:`canzona.NorMuon`, :class:`canzona.Shampoo` or
        :class:`canzona.SOAP`.

    Raises:
        TypeError: when ``model`` is not an ``nn.Module`` (e.g. ``model.parameters()``).
        ValueError: when a ``to_matrix`` pattern forces a parameter that is not 2-D or 3-D
            to the matrix algorithm (one that matches nothing: a ``UserWarning``); for a split
            pattern that matches no parameter, matches a parameter that is not a matrix,
            or whose blocks do not tile the parameter's dimension (naming the pattern or
            the parameter).
    """
    matrix_params, nd, adamw_params = _route(model, to_adamw, to_matrix, flatten=flatten)
    groups: list[dict[str, Any]] = []
    (plain, blocks), (flat, flat_blocks) = _split_groups(model, (matrix_params, nd), split or {})
    if plain:
        groups.append({"params": plain, **matrix})
    groups += [{"params": ps, "split": sp, **matrix} for sp, ps in blocks]
    if flat:
        groups.append({"params": flat, "flatten": True, **matrix})
    groups += [{"params": ps, "split": sp, "flatten": True, **matrix} for sp, ps in flat_blocks]
    if adamw_params:
        entries = {"weight_decay": 0.0, **(adamw or {}), "algorithm": "adamw"}
        groups.append({"params": adamw_params, **entries})
    return groups


Blocks = tuple[NamedParams, list[tuple[Split, NamedParams]]]


def _prefixed(names: list[str], pattern: str) -> str:
    """A hint where ``pattern`` matches names once a wrapper's prefix is allowed, else ''."""
    wrapped = [n for n in names if fnmatch.fnmatchcase(n, f"*.{pattern}")]
    if not wrapped:
        return ""
    return (
        f": the model's names carry a prefix ({wrapped[0]!r}, as under DDP's 'module.' or "
        f"torch.compile's '_orig_mod.'); '*{pattern}' matches them"
    )


def _check_patterns(model: nn.Module, split: Mapping[str, Split], matrices: set[str]) -> None:
    """Every split pattern is a Split that names matrix parameters, and at least one."""
    named = list(model.named_parameters())
    for pattern, value in split.items():
        if not isinstance(value, Split):
            raise ValueError(f"split[{pattern!r}] must be a canzona.Split, got {value!r}")
        if any(fnmatch.fnmatchcase(n, pattern) for n, _ in named):
            continue
        # a tied weight is listed once, under its first name: say which one
        first = {id(p): n for n, p in named}
        aliases = [
            f"{n!r} (tied to {first[id(p)]!r}, the name the model's parameters use)"
            for n, p in model.named_parameters(remove_duplicate=False)
            if fnmatch.fnmatchcase(n, pattern) and id(p) in first
        ]
        found = f": it matches only {', '.join(aliases)}" if aliases else ""
        found = found or _prefixed([n for n, _ in named], pattern)
        raise ValueError(f"split pattern {pattern!r} matches no parameter of the model{found}")
    for name, p in named:
        for pattern in split:
            if fnmatch.fnmatchcase(name, pattern) and name not in matrices:
                raise ValueError(
                    f"split pattern {pattern!r} matches parameter {name!r} ({tuple(p.shape)}), "
                    "which is not a matrix the matrix algorithm updates"
                )


def _split_groups(
    model: nn.Module, kinds: tuple[NamedParams, NamedParams], split: Mapping[str, Split]
) -> tuple[Blocks, Blocks]:
    """Per kind (matrices and stacks, flattened weights): unsplit parameters, split ones."""
    _check_patterns(model, split, {n for kind in kinds for n, _ in kind})
    out: list[Blocks] = []
    for kind, flatten in zip(kinds, (False, True), strict=True):
        plain: NamedParams = []
        blocks: dict[Split, NamedParams] = {}
        for name, p in kind:
            chosen = next((sp for pat, sp in split.items() if fnmatch.fnmatchcase(name, pat)), None)
            if chosen is None:
                plain.append((name, p))
                continue
            chosen.shapes(*matrix_shape(p, {"flatten": flatten}), name=f"parameter {name!r}")
            blocks.setdefault(chosen, []).append((name, p))
        out.append((plain, list(blocks.items())))
    return out[0], out[1]
