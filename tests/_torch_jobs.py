"""A torch.optim.Muon + AdamW job, saved after a few steps and continued by canzona.Muon."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

import canzona

from _cases import full_of, grad_steps, set_grads

#: Matrices (Muon) and vectors (AdamW); odd sizes so that shards are uneven; dotted names,
#: as a model's (DCP's flattened keys put them between dots).
SHAPES: dict[str, tuple[int, ...]] = {"mlp.up": (16, 12), "mlp.down": (12, 16),
                                      "attn.odd": (7, 13), "mlp.bias": (16,),
                                      "norm.weight": (12,)}  # fmt: skip
MUON_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}
ADAMW_KW: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8}
SAVED, CONTINUED = 3, 3  # steps before the checkpoint, steps after it
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def schedule(step: int) -> float:
    """A decaying LR factor: the saved lr differs from the optimizer's constructed one."""
    return 1.0 / (1.0 + step)


def torch_job(values: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The torch job: ``SAVED`` steps, then its checkpoint and ``CONTINUED`` more steps.

    Returns:
        The checkpoint (parameters, both optimizers' and schedulers' state dicts, copied;
        ``dcp`` and ``flat``: both optimizers in one of DCP's state dicts, nested and
        flattened), and the parameters after the continued steps (the reference).
    """
    module = nn.Module()  # the parameters' names are their FQNs for DCP's state dicts
    for n, v in values.items():
        path, leaf = n.rsplit(".", 1)
        if not hasattr(module, path):
            module.add_module(path, nn.Module())
        getattr(module, path).register_parameter(leaf, nn.Parameter(v.clone()))
    params = dict(module.named_parameters())
    matrices = [(n, p) for n, p in params.items() if p.ndim == 2]
    vectors = [(n, p) for n, p in params.items() if p.ndim != 2]
    muon = torch.optim.Muon(matrices, **MUON_KW)
    adamw = torch.optim.AdamW(vectors, foreach=False, **ADAMW_KW)
    schedulers = [LambdaLR(muon, schedule), LambdaLR(adamw, schedule)]
    grads = grad_steps(SHAPES, SAVED + CONTINUED)
    saved: dict[str, Any] = {}
    for step, g in enumerate(grads):
        if step == SAVED:
            saved = copy.deepcopy(
                {
                    "params": {n: p.detach() for n, p in params.items()},
                    "muon": muon.state_dict(),
                    "adamw": adamw.state_dict(),
                    # DCP's forms of both optimizers at once, as TorchTitan's container saves
                    "dcp": get_optimizer_state_dict(module, (muon, adamw)),
                    "flat": get_optimizer_state_dict(module, (muon, adamw), options=FLAT),
                    "schedulers": [s.state_dict() for s in schedulers],
                }
            )
        for n, p in params.items():
            p.grad = g[n].clone()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad(set_to_none=True)
        for s in schedulers:
            s.step()
    return saved, {n: p.detach().clone() for n, p in params.items()}


def canzona_groups(params: list[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """canzona.Muon's groups of the job: the matrices, then the vectors routed to AdamW."""
    adamw = {"lr": ADAMW_KW["lr"], "weight_decay": ADAMW_KW["weight_decay"]}
    return [
        {"params": [(n, p) for n, p in params if p.ndim == 2]},
        {"params": [(n, p) for n, p in params if p.ndim != 2], "algorithm": "adamw", **adamw},
    ]


def continue_with_canzona(
    saved: dict[str, Any],
    params: list[tuple[str, nn.Parameter]],
    convert: Callable[[canzona.Muon, dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """canzona.Muon over ``params`` (holding the saved values) resumed from the torch job.

    The resume follows torch's order: optimizer, scheduler, then both states.
    ``convert`` replaces :func:`canzona.from_torch_state` (for a test's own sources).
    """
    opt = canzona.Muon(canzona_groups(params), **MUON_KW)
    scheduler = LambdaLR(opt, schedule)
    if convert is None:
        state = canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    else:
        state = convert(opt, saved)
    opt.load_state_dict(state)
    muon_s, adamw_s = saved["schedulers"]
    scheduler.load_state_dict(
        {
            **muon_s,
            "base_lrs": muon_s["base_lrs"] + adamw_s["base_lrs"],
            "_last_lr": muon_s["_last_lr"] + adamw_s["_last_lr"],
            "lr_lambdas": [None, None],
        }
    )
    for g in grad_steps(SHAPES, SAVED + CONTINUED)[SAVED:]:
        set_grads(params, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
        scheduler.step()
    return {n: full_of(p).detach() for n, p in params}
