"""canzona.from_torch_state: a torch.optim.Muon + AdamW job continues with canzona.Muon."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import canzona

from _cases import full_tensors
from _torch_jobs import SHAPES, canzona_groups, continue_with_canzona, torch_job


def _params(values: dict[str, torch.Tensor]) -> list[tuple[str, nn.Parameter]]:
    return [(n, nn.Parameter(v.clone())) for n, v in values.items()]


def test_a_torch_muon_and_adamw_job_continues_bit_for_bit() -> None:
    """Catches: a state key or tensor dropped, the AdamW step count reset, the saved lr not
    taken (the scheduler's lr of the saved step), Muon and AdamW state swapped; and a
    warning of other values where the sources' are the optimizer's."""
    saved, want = torch_job(full_tensors(SHAPES))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = continue_with_canzona(saved, _params(saved["params"]))
    for name in SHAPES:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("form", ["dcp", "flat"])
def test_dcp_state_dicts_of_both_optimizers_continue_bit_for_bit(form: str) -> None:
    """DCP's ``get_optimizer_state_dict`` of both optimizers, keyed by name (nested) or
    flattened (``state.{name}.{key}``: TorchTitan's container). Catches: a format read as
    another (a flattened key split at the wrong dot), parameters taken by position."""
    saved, want = torch_job(full_tensors(SHAPES))
    got = continue_with_canzona(
        saved, _params(saved["params"]), lambda opt, s: canzona.from_torch_state(opt, s[form])
    )
    for name in SHAPES:
        assert torch.equal(got[name], want[name]), name


def test_sources_named_by_the_caller_and_params_never_stepped() -> None:
    """Names given with the state dict match as saved ones do; a parameter the source never
    stepped gets no state entry and starts afresh."""
    saved, _ = torch_job(full_tensors(SHAPES))
    for key in ("muon", "adamw"):
        for group in saved[key]["param_groups"]:
            names = group.pop("param_names")
        saved[key] = (saved[key], names)
    del saved["adamw"][0]["state"][saved["adamw"][0]["param_groups"][0]["params"][0]]
    params = _params(saved["params"])
    opt = canzona.Muon(canzona_groups(params), lr=0.02)
    state = canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    assert sorted(state["state"]) == [0, 1, 2, 4]  # "mlp.bias" (index 3) was never stepped
    assert state["state"][0]["step"].item() == 0.0  # torch.optim.Muon counts no steps
    assert state["state"][4]["step"].item() == 3.0
    assert [g["param_names"] for g in state["param_groups"]] == [
        ["mlp.up", "mlp.down", "attn.odd"], ["mlp.bias", "norm.weight"]]  # fmt: skip
    opt.load_state_dict(state)
    assert [n for n, p in params if p in opt.state] == [
        "mlp.up", "mlp.down", "attn.odd", "norm.weight"]  # fmt: skip


def _no_names(sd: dict[str, Any]) -> None:
    for group in sd["param_groups"]:
        del group["param_names"]


def _rename(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["param_names"][0] = "elsewhere"


def _duplicate(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["param_names"][1] = "mlp.up"


def _flag(flag: str) -> Callable[[dict[str, Any]], None]:
    def edit(sd: dict[str, Any]) -> None:
        sd["param_groups"][0][flag] = True

    return edit


def _l2(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["decoupled_weight_decay"] = False


def _extra_key(sd: dict[str, Any]) -> None:
    entry = next(iter(sd["state"].values()))
    entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()


def _split_lr(sd: dict[str, Any]) -> None:
    group = sd["param_groups"][0]
    second = {**group, "params": group["params"][1:], "param_names": group["param_names"][1:]}
    group["params"], group["param_names"] = group["params"][:1], group["param_names"][:1]
    sd["param_groups"].append({**second, "lr": 0.5})


BAD: dict[str, tuple[str, Callable[[dict[str, Any]], None], str]] = {
    "no names": ("adamw", _no_names, "source 1 does not name its parameters"),
    "a parameter in no source": (
        "muon",
        _rename,
        "parameter 'mlp.up' (param group 0) is in no source",
    ),
    "twice": ("muon", _duplicate, "parameter 'mlp.up' is in source 0 and in source 0"),
    "amsgrad": ("adamw", _flag("amsgrad"), "source 1, param group 0: amsgrad=True has no"),
    "maximize": ("adamw", _flag("maximize"), "source 1, param group 0: maximize=True has no"),
    "L2": ("adamw", _l2, "Adam's L2 weight decay (weight_decay=0.01)"),
    "extra key": ("adamw", _extra_key, "differs in 'max_exp_avg_sq'"),
    "two lrs": ("muon", _split_lr, "param group 0 of the optimizer takes parameters from"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_sources_canzona_cannot_continue_are_named(case: str) -> None:
    """Each refusal names the source, group, parameter or key; nothing is loaded."""
    key, edit, message = BAD[case]
    saved, _ = torch_job(full_tensors(SHAPES))
    edit(saved[key])
    opt = canzona.Muon(canzona_groups(_params(saved["params"])), lr=0.02)
    with pytest.raises(ValueError) as info:
        canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    assert message in str(info.value)
    assert not opt.state


def test_a_parameter_the_optimizer_lacks_or_routes_elsewhere_is_named() -> None:
    saved, _ = torch_job(full_tensors(SHAPES))
    params = _params(saved["params"])
    opt = canzona.Muon(canzona_groups(params[:-1]), lr=0.02)  # without "norm.weight"
    with pytest.raises(ValueError) as lacks:
        canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    assert "source 1 holds parameter 'norm.weight', which the optimizer lacks" in str(lacks.value)
    routed = [{"params": params[:2]}, {"params": params[2:], "algorithm": "adamw"}]
    opt = canzona.Muon(routed, lr=0.02)  # "attn.odd" to AdamW here, Muon's in the source
    with pytest.raises(ValueError) as elsewhere:
        canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    assert "'attn.odd' is in a 'adamw' param group of the optimizer, but" in str(elsewhere.value)


def test_other_optimizers_unnamed_params_and_non_state_dicts_are_refused() -> None:
    saved, _ = torch_job(full_tensors(SHAPES))
    params = _params(saved["params"])
    normuon = canzona.NorMuon(canzona_groups(params), lr=0.02)
    with pytest.raises(TypeError, match=r"converts for canzona\.Muon, got NorMuon"):
        canzona.from_torch_state(normuon, saved["muon"], saved["adamw"])
    unnamed = canzona.Muon([p for _, p in params if p.ndim == 2], lr=0.02)
    with pytest.raises(ValueError, match="param group 0 of the optimizer has no parameter names"):
        canzona.from_torch_state(unnamed, saved["muon"])
    opt = canzona.Muon(canzona_groups(params), lr=0.02)
    with pytest.raises(ValueError, match="source 1 is not a state dict"):
        canzona.from_torch_state(opt, saved["muon"], {"state": {}})
    sgd = copy.deepcopy(saved["adamw"])
    del sgd["param_groups"][0]["betas"]
    with pytest.raises(ValueError, match="source 1, param group 0 is neither"):
        canzona.from_torch_state(opt, saved["muon"], sgd)
    names = saved["adamw"]["param_groups"][0]["param_names"]
    with pytest.raises(ValueError, match="source 1 holds 2 parameters, given 1 names"):
        canzona.from_torch_state(opt, saved["muon"], (saved["adamw"], names[:1]))


def test_flattened_sources_that_cannot_be_read_are_named() -> None:
    saved, _ = torch_job(full_tensors(SHAPES))
    opt = canzona.Muon(canzona_groups(_params(saved["params"])), lr=0.02)
    flat = saved["flat"]
    with pytest.raises(ValueError, match="source 0 is flattened: its keys name its parameters"):
        canzona.from_torch_state(opt, (flat, list(SHAPES)))
    orphan = {k: v for k, v in flat.items() if not k.startswith("param_groups.mlp.up.")}
    with pytest.raises(ValueError) as info:
        canzona.from_torch_state(opt, orphan)
    assert "source 0 holds state for 'mlp.up' but no param-group values" in str(info.value)
    with pytest.raises(ValueError, match="source 0 is not a state dict: neither"):
        canzona.from_torch_state(opt, {**flat, "optimizer": 1})
    # a param_groups entry without a parameter's name (before: a bare unpacking error)
    with pytest.raises(ValueError, match="source 0 is not a state dict: neither"):
        canzona.from_torch_state(opt, {**flat, "param_groups.lr": 0.1})


def test_values_the_optimizer_keeps_where_its_sources_differ_are_named() -> None:
    """Catches: a torch AdamW with other betas and weight decay than the optimizer's AdamW
    group (torch's default betas (0.9, 0.999)) continued with the group's without a word,
    and a Muon group's other momentum likewise; the lr is the source's, never named."""
    saved, _ = torch_job(full_tensors(SHAPES))
    for group in saved["adamw"]["param_groups"]:
        group.update(betas=(0.9, 0.999), weight_decay=0.05)
    saved["muon"]["param_groups"][0]["momentum"] = 0.9
    opt = canzona.Muon(canzona_groups(_params(saved["params"])), lr=0.02)
    with pytest.warns(UserWarning) as seen:
        canzona.from_torch_state(opt, saved["muon"], saved["adamw"])
    texts = sorted(str(w.message) for w in seen)
    assert len(texts) == 2, texts
    assert "param group 0 continues with its own values where its source's differ " in texts[0]
    assert "(momentum 0.9 -> 0.95)" in texts[0], texts
    assert "(betas (0.9, 0.999) -> (0.9, 0.95), weight_decay 0.05 -> 0.01)" in texts[1], texts
    assert all("lr " not in t.split("(")[1] for t in texts), texts
