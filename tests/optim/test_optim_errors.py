"""Errors of the optimizer classes: what raises, what the message names, what stays unchanged."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _optim_cases import (
    NAMES,
    OPTIMIZERS,
    assert_params_equal,
    assert_state_dicts_equal,
    gradients,
    make,
    train,
)
from torch import nn

import canzona


# ------------------------------------------------------------------ parameters and groups
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(5,), (2, 3, 4, 5), ()])
@pytest.mark.parametrize("named", [False, True])
def test_non_matrix_parameter_in_a_matrix_group(
    name: str, shape: tuple[int, ...], named: bool
) -> None:
    """Catches: a 1-D, 4-D or 0-D tensor accepted in a matrix group (at construction or by
    ``add_param_group``), a refused group left in ``param_groups``, an error without the
    parameter's name or the way out (``algorithm="adamw"``)."""
    cls, kwargs = OPTIMIZERS[name]
    odd = nn.Parameter(torch.zeros(shape))
    params: list[Any] = [("blocks.0.odd", odd)] if named else [odd]
    label = "'blocks.0.odd'" if named else str(shape)

    def check(error: pytest.ExceptionInfo[ValueError]) -> None:
        message = str(error.value)
        assert label in message
        assert f"is {len(shape)}-D" in message
        assert 'algorithm="adamw"' in message

    with pytest.raises(ValueError) as error:
        cls(params, **kwargs)
    check(error)

    square = nn.Parameter(torch.zeros(4, 4))
    opt = cls([("square", square)] if named else [square], **kwargs)
    with pytest.raises(ValueError) as error:
        opt.add_param_group({"params": params})
    check(error)
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": params, "algorithm": "adamw"})  # the way out works
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("algorithm", ["sgd", "Muon", None, "other"])
def test_unknown_algorithm(name: str, algorithm: str | None) -> None:
    cls, kwargs = OPTIMIZERS[name]
    others = [n for n in NAMES if n != name]
    for value in (algorithm, others[0]):
        group = {"params": [nn.Parameter(torch.zeros(3, 3))], "algorithm": value}
        with pytest.raises(ValueError, match=re.escape(f"got {value!r}")):
            cls([group], **kwargs)
        opt = cls([nn.Parameter(torch.zeros(3, 3))], **kwargs)
        with pytest.raises(ValueError, match="algorithm"):
            opt.add_param_group(group)
        assert len(opt.param_groups) == 1


def test_param_names_of_another_length_are_refused_at_the_step() -> None:
    a, b = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(3, 3))
    opt = canzona.Muon([("a", a), ("b", b)], ns_dtype=torch.float32)
    a.grad, b.grad = torch.ones(3, 3), torch.ones(3, 3)
    opt.param_groups[0]["param_names"].pop()  # names no longer line up with params
    before = a.detach().clone()
    with pytest.raises(ValueError, match="param group 0 has 2 params but 1 param_names"):
        opt.step()
    assert torch.equal(a, before)


def test_complex_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="complex"):
        canzona.Muon([nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))])


BAD_HPARAMS: list[tuple[str, dict[str, Any], str]] = [
    ("muon", {"lr": -1e-3}, "-0.001"),
    ("muon", {"lr": torch.tensor([1e-3, 2e-3])}, "1-element"),
    ("muon", {"weight_decay": -0.1}, "-0.1"),
    ("muon", {"momentum": -0.5}, "-0.5"),
    ("muon", {"momentum": float("nan")}, "momentum should be >= 0 but is: nan"),
    ("muon", {"eps": 0.0}, "eps must be > 0, got 0.0"),
    ("muon", {"eps": float("nan")}, "eps must be > 0, got nan"),
    ("muon", {"ns_steps": 100}, "100"),
    ("muon", {"ns_steps": -1}, "-1"),
    ("muon", {"adjust_lr_fn": "spectrum"}, "'spectrum'"),
    ("muon", {"adjust_lr_fn": "Original"}, "'Original'"),
    ("muon", {"scale": 0.0}, "scale must be a positive finite number, got 0.0"),
    ("muon", {"scale": float("inf")}, "got inf"),
    ("muon", {"scale": float("nan")}, "got nan"),
    ("muon", {"ns_coefficients": (3.4, -4.7)}, "ns_coefficients"),
    ("muon", {"ns_coefficients": ()}, "must not be empty, got ()"),
    ("muon", {"ns_coefficients": []}, "must not be empty, got ()"),
    ("muon", {"ns_coefficients": (3.4, float("nan"), 2.0)}, "finite, got (3.4, nan, 2.0)"),
    ("muon", {"ns_coefficients": ((3.4, -4.7, 2.0), (1.0, 2.0))}, "ns_coefficients[1]"),
    ("muon", {"ns_coefficients": ((3.4, -4.7, 2.0), (1.0, 2.0, "c"))}, "'c'"),
    ("muon", {"ns_coefficients": "polar"}, "'polar'"),
    ("muon", {"ns_coefficients": 3.4}, "got 3.4"),
    ("muon", {"ns_coefficients": ((1.0, 2.0, 3.0),) * 3, "ns_steps": 5}, "ns_steps=5"),
    ("muon", {"ns_coefficients": ((1.0, 2.0, 3.0),) * 100}, "got 100"),
    ("muon", {"ns_coefficients": "polar_express", "ns_steps": 100}, "got 100"),
    ("normuon", {"beta2": 1.0}, "beta2"),
    ("normuon", {"beta2": -0.1}, "-0.1"),
    ("normuon", {"normuon_eps": 0.0}, "normuon_eps must be a positive finite number, got 0.0"),
    ("normuon", {"rescale": "frobenius"}, "'frobenius'"),
    ("normuon", {"rms": 0.0}, "rms"),
    ("normuon", {"rms": float("inf")}, "inf"),
    ("normuon", {"adjust_lr_fn": "spectrum"}, "'spectrum'"),
    ("normuon", {"ns_coefficients": ()}, "must not be empty"),
    ("muon", {"ns_dtype": torch.int32}, "int32"),
    ("muon", {"adamw_betas": (0.9, 1.0)}, "adamw_betas"),
    ("muon", {"adamw_eps": -1e-8}, "adamw_eps"),
    ("shampoo", {"lr": -1e-3}, "-0.001"),
    ("shampoo", {"betas": (1.0, 0.999)}, "betas"),
    ("shampoo", {"betas": (0.9, 1.5)}, "1.5"),
    ("shampoo", {"betas": (-0.1, 0.999)}, "-0.1"),
    ("shampoo", {"epsilon": 0.0}, "epsilon"),
    ("shampoo", {"weight_decay": -0.1}, "-0.1"),
    ("shampoo", {"precondition_frequency": 0}, "precondition_frequency"),
    ("shampoo", {"start_preconditioning_step": 0}, "start_preconditioning_step"),
    ("shampoo", {"grafting": "sgd"}, "sgd"),
    ("shampoo", {"grafting_beta2": 1.0}, "grafting_beta2"),
    ("soap", {"lr": -1e-3}, "-0.001"),
    ("soap", {"betas": (0.95, 1.0)}, "betas"),
    ("soap", {"betas": (1.2, 0.95)}, "1.2"),
    ("soap", {"eps": 0.0}, "eps"),
    ("soap", {"weight_decay": -0.1}, "-0.1"),
    ("soap", {"precondition_frequency": 0}, "precondition_frequency"),
    ("soap", {"adamw_betas": (1.0, 0.9)}, "adamw_betas"),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    BAD_HPARAMS,
    ids=[f"{n}-{next(iter(kw))}={next(iter(kw.values()))}" for n, kw, _ in BAD_HPARAMS],
)
def test_bad_hyper_parameters(name: str, kwargs: dict[str, Any], match: str) -> None:
    cls, defaults = OPTIMIZERS[name]
    with pytest.raises(ValueError, match=re.escape(match)):
        cls([nn.Parameter(torch.zeros(4, 4))], **{**defaults, **kwargs})


WRONG_TYPES: list[tuple[str, str, Any, str]] = [
    ("muon", "lr", None, "lr must be a number or a 1-element tensor, got None"),
    ("muon", "lr", "0.5", "lr must be a number or a 1-element tensor, got '0.5' (str)"),
    ("muon", "weight_decay", None, "weight_decay must be a number or a 0-dim tensor, got None"),
    ("muon", "momentum", "0.9", "momentum must be a number or a 0-dim tensor, got '0.9'"),
    ("muon", "eps", None, "eps must be a number or a 0-dim tensor, got None"),
    ("muon", "adamw_betas", None, "adamw_betas must be a sequence of numbers, got None"),
    ("muon", "adamw_eps", None, "adamw_eps must be a number or a 0-dim tensor, got None"),
    ("muon", "scale", True, "scale must be a number or a 0-dim tensor, got True (bool)"),
    ("normuon", "beta2", None, "beta2 must be a number or a 0-dim tensor, got None"),
    ("shampoo", "betas", (0.9, "0.99"), "betas must be a sequence of numbers"),
    ("shampoo", "precondition_frequency", 2.5, "precondition_frequency must be an integer"),
    ("shampoo", "max_precond_dim", None, "max_precond_dim must be an integer, got None"),
    ("soap", "shampoo_beta", None, "shampoo_beta must be a number or a 0-dim tensor, got None"),
    ("soap", "lr", True, "lr must be a number or a 1-element tensor, got True (bool)"),
    # a 1-element tensor that is not 0-dim: the AdamW update raised after the vote
    ("muon", "adamw_eps", torch.tensor([1e-8]), "adamw_eps must be a number or a 0-dim tensor"),
    ("shampoo", "betas", (torch.tensor([0.9]), 0.999), "betas must be a sequence of numbers"),
]


@pytest.mark.parametrize(
    ("name", "key", "value", "match"),
    WRONG_TYPES,
    ids=[f"{n}-{k}={v!r}" for n, k, v, _ in WRONG_TYPES],
)
def test_a_value_of_the_wrong_type_is_named_wherever_it_is_given(
    name: str, key: str, value: Any, match: str
) -> None:
    """At the constructor (``TypeError``), in an added group (``ValueError`` naming the
    group) and set between steps (the step fails naming it, nothing is updated): the key
    and the value, where arithmetic on it would raise Python's own message or, for a
    string ``lr``, store it for a scheduler to fail on."""
    cls, defaults = OPTIMIZERS[name]
    with pytest.raises(TypeError, match=re.escape(match)):
        cls([nn.Parameter(torch.zeros(4, 4))], **{**defaults, key: value})
    p = nn.Parameter(torch.randn(4, 4))
    opt = cls([p], **defaults)
    with pytest.raises(ValueError, match=re.escape(f"param group 1: {match}")):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], key: value})
    p.grad = torch.randn(4, 4)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0][key] = value
    with pytest.raises(canzona.UpdateFailedError, match=re.escape(f"param group 0: {match}")):
        opt.step()
    assert torch.equal(p, before)


TAKEN: list[tuple[str, str, Any, Any]] = [
    ("muon", "adamw_betas", np.array([0.9, 0.95]), (0.9, 0.95)),
    ("muon", "adamw_betas", (b for b in (0.9, 0.95)), (0.9, 0.95)),
    ("shampoo", "betas", (torch.tensor(0.5), torch.tensor(0.999)), None),
    ("muon", "momentum", torch.tensor(0.9), None),
    ("muon", "weight_decay", 0, 0),
    ("shampoo", "start_preconditioning_step", 1.0, 1),
    ("shampoo", "precondition_frequency", np.int64(2), 2),
    ("soap", "max_precond_dim", np.int32(3), 3),
    ("muon", "ns_steps", np.int64(3), 3),
    ("normuon", "ns_steps", 2.0, 2),
]


@pytest.mark.parametrize(
    ("name", "key", "value", "stored"),
    TAKEN,
    ids=[f"{n}-{k}-{i}" for i, (n, k, _, _) in enumerate(TAKEN)],
)
def test_values_the_constructors_took_before_the_type_checks_are_taken(
    name: str, key: str, value: Any, stored: Any
) -> None:
    """Catches: the type checks refusing an array, a generator or tensors for a pair, a
    tensor for a float, an integral float or a numpy integer for an integer (the last two
    stored as ``int``: the cost model takes nothing else)."""
    cls, defaults = OPTIMIZERS[name]
    p = nn.Parameter(torch.randn(4, 4))
    opt = cls([p], **{**defaults, key: value})
    if stored is not None:
        assert opt.defaults[key] == stored and type(opt.defaults[key]) is type(stored)
    for _ in range(2):
        p.grad = torch.randn(4, 4)
        opt.step()
    assert torch.isfinite(p).all()


def test_a_value_the_step_table_cannot_read_fails_the_step() -> None:
    """Catches: an error from building the step's table (here reading a string ns_dtype's
    item size) raised bare, which on a mesh hangs the ranks that went on."""
    p = nn.Parameter(torch.randn(4, 4))
    opt = canzona.Muon([p], lr=0.02)
    p.grad = torch.randn(4, 4)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["ns_dtype"] = "bfloat16"
    with pytest.raises(canzona.UpdateFailedError, match="param group 0: ns_dtype must be a"):
        opt.step()
    assert torch.equal(p, before)


def test_a_numpy_integer_ns_steps_set_in_a_group_runs_as_the_int() -> None:
    """Catches: ``ns_steps`` checked with ``isinstance(..., int)``, which refused a numpy
    integer given in a param group (torch.optim.Muon takes it) while a numpy ``lr`` passed."""
    grads = [torch.randn(6, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    results = []
    for steps in (3, np.int64(3)):
        p = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(9)))
        opt = canzona.Muon([p], lr=0.02)
        opt.param_groups[0]["ns_steps"] = steps
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
    p.grad = grads[0].clone()
    opt.param_groups[0]["ns_steps"] = 2.5
    with pytest.raises(
        canzona.UpdateFailedError, match=r"ns_steps must be an integer or None, got 2\.5"
    ):
        opt.step()


def test_a_numpy_value_changed_between_steps_is_checked_again() -> None:
    """Catches: numpy scalars fingerprinted by their type alone, so that a new value (here
    a negative learning rate) was never checked, nor compared across ranks."""
    p = nn.Parameter(torch.randn(4, 4))
    opt = canzona.Muon([p], lr=np.float32(0.02))
    p.grad = torch.randn(4, 4)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["lr"] = np.float32(-1.0)
    with pytest.raises(canzona.UpdateFailedError, match=r"Invalid learning rate: -1\.0"):
        opt.step()
    assert torch.equal(p, before)


BAD_GROUPS: list[tuple[str, dict[str, Any], str]] = [
    ("muon", {"ns_steps": 200}, "200"),
    ("muon", {"adjust_lr_fn": "spectrum"}, "spectrum"),
    ("muon", {"scale": -1.0}, "-1.0"),
    ("muon", {"ns_coefficients": "polar"}, "polar"),
    ("muon", {"ns_coefficients": [[3.4, -4.7, 2.0], [1.0, 2.0]]}, "[1.0, 2.0]"),
    ("normuon", {"beta2": 1.5}, "1.5"),
    ("normuon", {"rescale": "frobenius"}, "frobenius"),
    ("shampoo", {"betas": (1.5, 0.9)}, "1.5"),
    ("shampoo", {"grafting": "sgd"}, "sgd"),
    ("soap", {"betas": (0.9, 1.5)}, "1.5"),
]


@pytest.mark.parametrize(
    ("name", "group", "value"), BAD_GROUPS, ids=[f"{n}-{v}" for n, _, v in BAD_GROUPS]
)
def test_bad_group_hyper_parameters_raise_by_the_first_step(
    name: str, group: dict[str, Any], value: str
) -> None:
    """Values given per param group are not checked by the constructor (as in torch.optim);
    the update math refuses them at the latest on the first step, naming the value."""
    cls, kwargs = OPTIMIZERS[name]
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.randn(4, 4)
    with pytest.raises((ValueError, RuntimeError), match=re.escape(value)):
        opt = cls([{"params": [p], **group}], **kwargs)
        opt.step()


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("muon", {"lr": -0.02}),
        ("muon", {"momentum": -0.5}),
        ("shampoo", {"lr": -0.01}),
        ("soap", {"lr": -0.01}),
        *[(name, group) for name, group, _ in BAD_GROUPS],
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items()),
)
def test_bad_group_hyper_parameters_are_refused_when_the_group_is_added(
    name: str, group: dict[str, Any]
) -> None:
    cls, kwargs = OPTIMIZERS[name]
    good = nn.Parameter(torch.randn(4, 4))
    opt = cls([good], **kwargs)
    bad = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [bad], **group})
    with pytest.raises(ValueError):
        cls([{"params": [bad], **group}], **kwargs)


# ------------------------------------------------------------------ load_state_dict
def _trained(
    name: str, *, named: bool = False, shapes: dict[str, tuple[int, ...]] | None = None
) -> Any:
    values = None
    if shapes is not None:
        gen = torch.Generator().manual_seed(0)
        values = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    params, opt = make(name, values, named=named)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return params, opt


def _first_matrix_key(sd: dict[str, Any], pid: Any) -> str:
    return next(k for k in sd["state"][pid] if k != "step")


def _drop_key(sd: dict[str, Any]) -> str:
    key = _first_matrix_key(sd, 1)
    del sd["state"][1][key]
    return f"state of parameter 'param1' is missing key '{key}'"


def _extra_key(sd: dict[str, Any]) -> str:
    sd["state"][1]["bogus"] = torch.zeros(1)
    return "state of parameter 'param1' has unexpected key 'bogus'"


def _bad_shape(sd: dict[str, Any]) -> str:
    key = _first_matrix_key(sd, 2)
    sd["state"][2][key] = torch.zeros(3, 3)
    return f"state '{key}' of parameter 'param2' has shape (3, 3)"


def _bad_adamw_shape(sd: dict[str, Any]) -> str:
    sd["state"][4]["exp_avg_sq"] = torch.zeros(6)
    return "state 'exp_avg_sq' of parameter 'param4' has shape (6,), expected (7,)"


def _not_a_tensor(sd: dict[str, Any]) -> str:
    key = _first_matrix_key(sd, 0)
    sd["state"][0][key] = 1.0
    return f"state '{key}' of parameter 'param0' is not a tensor"


def _bad_step(sd: dict[str, Any]) -> str:
    sd["state"][0]["step"] = torch.tensor([1.0, 2.0])
    return "state 'step' of parameter 'param0' must hold one value"


def _unknown_id(sd: dict[str, Any]) -> str:
    sd["state"][99] = {"step": torch.tensor(1.0)}
    return "unknown parameter id 99"


def _fewer_groups(sd: dict[str, Any]) -> str:
    del sd["param_groups"][1]
    return "state_dict has 1 param groups, the optimizer has 2"


def _swapped_algorithm(sd: dict[str, Any]) -> str:
    mine = sd["param_groups"][0]["algorithm"]
    sd["param_groups"][0]["algorithm"] = "adamw"
    return f"param group 0: state dict algorithm 'adamw' does not match '{mine}'"


def _no_state(sd: dict[str, Any]) -> str:
    del sd["state"]
    return "'state' and 'param_groups'"


EDITS: dict[str, Callable[[dict[str, Any]], str]] = {
    "missing_key": _drop_key,
    "extra_key": _extra_key,
    "shape": _bad_shape,
    "adamw_shape": _bad_adamw_shape,
    "not_a_tensor": _not_a_tensor,
    "step": _bad_step,
    "unknown_id": _unknown_id,
    "fewer_groups": _fewer_groups,
    "algorithm": _swapped_algorithm,
    "no_state": _no_state,
}


def _assert_refused(name: str, opt: Any, params: Any, bad: Any, match: str) -> None:
    """``load_state_dict(bad)`` raises ValueError(match) and the optimizer is left as it was:
    same state dict, and it continues exactly like an untouched copy."""
    before = copy.deepcopy(opt.state_dict())
    twin_params, twin = make(name, {n: p.detach() for n, p in params.items()})
    twin.load_state_dict(copy.deepcopy(before))
    with pytest.raises(ValueError, match=re.escape(match)):
        opt.load_state_dict(bad)
    assert_state_dicts_equal(opt.state_dict(), before)
    grads = gradients(steps=3, seed=11)
    train(params, opt, grads)
    train(twin_params, twin, grads)
    assert_params_equal(params, twin_params)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("edit", list(EDITS))
def test_load_state_dict_refuses_a_damaged_state_dict(name: str, edit: str) -> None:
    """Catches: a damaged entry loaded (or half-loaded before the error), an error that
    does not name the key or parameter, a check dropped for one kind of damage."""
    params, opt = _trained(name)
    bad = copy.deepcopy(opt.state_dict())
    match = EDITS[edit](bad)
    _assert_refused(name, opt, params, bad, match)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_refuses_torch_adamw(name: str) -> None:
    params, opt = _trained(name)
    twins = [nn.Parameter(p.detach().clone()) for p in params.values()]
    adamw = torch.optim.AdamW([{"params": twins[:4]}, {"params": twins[4:]}])
    for p in twins:
        p.grad = torch.ones_like(p)
    adamw.step()
    match = "param group 0 of the state dict has no 'algorithm' entry"
    _assert_refused(name, opt, params, adamw.state_dict(), match)
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(adamw.state_dict())
    way = "; torch.optim.Muon's and AdamW's convert with canzona.from_torch_state)"
    assert (way in str(info.value)) == (name == "muon")  # the way out, where there is one


@pytest.mark.parametrize(
    ("name", "other"),
    [("muon", "shampoo"), ("shampoo", "soap"), ("soap", "shampoo"), ("soap", "muon")],
)
def test_load_state_dict_refuses_another_optimizer_type(name: str, other: str) -> None:
    params, opt = _trained(name)
    _, foreign = _trained(other)
    match = f"state dict algorithm '{other}' does not match '{name}'"
    _assert_refused(name, opt, params, foreign.state_dict(), match)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_refuses_another_model(name: str) -> None:
    params, opt = _trained(name)
    fewer = {"square": (8, 8), "tall": (12, 6), "stack": (3, 5, 7), "bias": (7,), "gain": (12,)}
    _, other = _trained(name, shapes=fewer)
    match = "param group 0: state dict has 3 parameters, the optimizer has 4"
    _assert_refused(name, opt, params, other.state_dict(), match)

    transposed = {
        "square": (8, 8),
        "tall": (6, 12),
        "wide": (6, 12),
        "stack": (3, 5, 7),
        "bias": (7,),
        "gain": (12,),
    }
    _, other = _trained(name, shapes=transposed)
    key = _first_matrix_key(other.state_dict(), 1)
    match = f"state '{key}' of parameter 'param1' has shape (6, 12), expected (12, 6)"
    _assert_refused(name, opt, params, other.state_dict(), match)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_errors_use_parameter_names(name: str) -> None:
    _, opt = _trained(name, named=True)
    bad = copy.deepcopy(opt.state_dict())
    key = _first_matrix_key(bad, 1)
    del bad["state"][1][key]
    with pytest.raises(
        ValueError, match=re.escape(f"state of parameter 'tall' is missing key '{key}'")
    ):
        opt.load_state_dict(bad)

    renamed = copy.deepcopy(opt.state_dict())
    renamed["param_groups"][0]["param_names"] = ["square", "tall", "vide", "stack"]
    before = copy.deepcopy(opt.state_dict())
    match = "parameter names differ at position 2: 'wide' here, 'vide' in the state dict"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(renamed)
    assert_state_dicts_equal(opt.state_dict(), before)

    # DCP rebuilds "params" from this optimizer's names and keeps the saved "param_names"
    longer = copy.deepcopy(opt.state_dict())
    longer["param_groups"][0]["param_names"] = ["square", "tall", "wide", "stack", "extra"]
    match = r"at position 4: None here, 'extra' in the state dict \(4 names here, 5 there\)"
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(longer)
    assert_state_dicts_equal(opt.state_dict(), before)


@pytest.mark.parametrize("name", NAMES)
def test_load_state_dict_names_a_group_dcp_gave_no_hyper_parameters(name: str) -> None:
    """Catches: a checkpoint whose param groups hold the parameters otherwise (DCP then
    gives a group only its "params") reported as not saved by a canzona optimizer."""
    params, opt = _trained(name, named=True)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0] = {"params": bad["param_groups"][0]["params"]}
    match = "param group 0 of the state dict holds parameters but no hyper-parameters"
    _assert_refused(name, opt, params, bad, match)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("switch", ["to_adamw", "from_adamw"])
def test_a_group_keeps_its_algorithm_once_it_has_state(name: str, switch: str) -> None:
    """Catches: switching a param group's algorithm after its first step failing inside the
    math (a KeyError on a missing buffer) or, worse, running with the wrong state; an error
    that does not name the parameter and both algorithms; a refused step that changes a
    parameter or the state."""
    cls, kwargs = OPTIMIZERS[name]
    weight = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    start = "adamw" if switch == "from_adamw" else cls.algorithm
    opt = cls([{"params": [("layer.weight", weight)], "algorithm": start}], **kwargs)
    weight.grad = torch.ones_like(weight)
    opt.step()
    before = (weight.detach().clone(), copy.deepcopy(opt.state_dict()))
    opt.param_groups[0]["algorithm"] = cls.algorithm if start == "adamw" else "adamw"
    with pytest.raises(canzona.UpdateFailedError) as error:
        opt.step()
    message = str(error.value)
    assert "param group 0" in message and "'layer.weight'" in message
    assert f"has {start!r} state" in message
    assert f"is now {opt.param_groups[0]['algorithm']!r}" in message
    assert torch.equal(weight.detach(), before[0])
    opt.param_groups[0]["algorithm"] = start
    assert_state_dicts_equal(opt.state_dict(), before[1])
    opt.step()  # switched back: the group steps again
    loaded = cls([{"params": [("layer.weight", weight)], "algorithm": start}], **kwargs)
    loaded.load_state_dict(opt.state_dict())
    loaded.param_groups[0]["algorithm"] = opt.param_groups[0]["algorithm"] = other = (
        cls.algorithm if start == "adamw" else "adamw"
    )
    copied = copy.deepcopy(opt)
    for refusing in (opt, loaded, copied):  # states from a step, load_state_dict, a copy
        with pytest.raises(canzona.UpdateFailedError, match=f"is now {other!r}"):
            refusing.step()


# ------------------------------------------------------------------ pipeline configuration
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0.0}, "timeout_s must be > 0, got 0.0"),
        ({"timeout_s": float("nan")}, "timeout_s must be > 0, got nan"),
        ({"depth": 0}, "depth must be an int >= 1, got 0"),
        ({"depth": 1.5}, "depth must be an int >= 1, got 1.5"),
        ({"fuse_bytes": -1}, "fuse_bytes must be an int >= 0, got -1"),
        ({"fuse_bytes": True}, "fuse_bytes must be an int >= 0, got True"),
        ({"reprice_steps": True}, "reprice_steps must be an int >= 0, got True"),
        ({"overlap": 1}, "overlap must be a bool, got 1"),
        ({"atomic": None}, "atomic must be a bool, got None"),
        ({"keep_buffers": "yes"}, "keep_buffers must be a bool or None, got 'yes'"),
        ({"pause_gc": 1}, "pause_gc must be a bool, got 1"),
    ],
)
def test_bad_pipeline_config(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=re.escape(match)):
        canzona.PipelineConfig(**kwargs)


def test_step_buffers_are_kept_on_the_cpu_and_freed_on_accelerators_by_default() -> None:
    """Catches: a default that frees CPU buffers, or an explicit setting the device overrides."""
    default = canzona.PipelineConfig()
    assert (default.keeps_buffers("cpu"), default.keeps_buffers("cuda")) == (True, False)
    kept = canzona.PipelineConfig(keep_buffers=True)
    freed = canzona.PipelineConfig(keep_buffers=False)
    assert (kept.keeps_buffers("cpu"), kept.keeps_buffers("cuda")) == (True, True)
    assert (freed.keeps_buffers("cpu"), freed.keeps_buffers("cuda")) == (False, False)


@pytest.mark.parametrize("name", ["muon", "shampoo", "soap", "normuon"])
@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("betas", (0.5, 0.6), "'adamw_betas'"),
        ("eps", 1e-2, "'adamw_eps'"),
        ("amsgrad", True, "no amsgrad"),
        ("maximize", True, "no maximize"),
    ],
)
def test_an_adamw_group_refuses_torch_adamw_names(
    name: str, key: str, value: Any, says: str
) -> None:
    """Catches: ``{"algorithm": "adamw", "betas": ...}`` (torch.optim.AdamW's names)
    silently ignored: the AdamW route reads ``adamw_betas`` and ``adamw_eps`` and
    implements neither amsgrad nor maximize."""
    cls, kwargs = OPTIMIZERS[name]
    group = {"params": [nn.Parameter(torch.randn(4))], "algorithm": "adamw", key: value}
    with pytest.raises(ValueError, match=re.escape(says)) as info:
        cls([group], **kwargs)
    assert f"got {key}={value!r}" in str(info.value)
    opt = cls([nn.Parameter(torch.randn(4, 4))], **kwargs)
    with pytest.raises(ValueError, match=re.escape(f"got {key}={value!r}")):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    if key in ("betas", "eps"):
        group[f"adamw_{key}"] = group.pop(key)
        cls([group], **kwargs)  # the names it reads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_group_copied_from_an_adamw_group_is_added(name: str) -> None:
    """Catches: ``add_param_group`` with the settings of one of the optimizer's own AdamW
    groups (the usual way to add parameters like existing ones) refused as torch.optim.
    AdamW's names: the optimizer itself fills every group with its defaults (Muon's
    Newton-Schulz ``eps``, SOAP's ``betas``). A value the user gives is still refused."""
    cls, kwargs = OPTIMIZERS[name]
    model = nn.Sequential(nn.Linear(4, 4))
    opt = cls(canzona.param_groups(model, adamw={"lr": 1e-3}), **kwargs)
    adamw = next(g for g in opt.param_groups if g["algorithm"] == "adamw")
    settings = {k: v for k, v in adamw.items() if k not in ("params", "param_names")}
    assert settings.keys() & {"betas", "eps"}  # filled in by the optimizer's defaults
    opt.add_param_group({**settings, "params": [("extra", nn.Parameter(torch.zeros(4)))]})
    assert opt.param_groups[-1]["algorithm"] == "adamw"
    key = sorted(settings.keys() & {"betas", "eps"})[0]
    other = (0.5, 0.6) if key == "betas" else 1e-2
    with pytest.raises(ValueError, match=re.escape(f"got {key}={other!r}")):
        opt.add_param_group({**settings, key: other, "params": [nn.Parameter(torch.zeros(4))]})


@pytest.mark.parametrize("name", ["muon", "shampoo"])
@pytest.mark.parametrize("algorithm", ["matrix", "adamw"])
def test_a_parameter_twice_in_one_group_is_refused(name: str, algorithm: str) -> None:
    """Catches: the same tensor listed twice in one group (unnamed parameters get distinct
    names) accepted: its step counted once but its update applied about twice."""
    cls, kwargs = OPTIMIZERS[name]
    p = nn.Parameter(torch.randn(8, 4))
    group: dict[str, Any] = {"params": [p, nn.Parameter(torch.randn(8, 4)), p]}
    if algorithm == "adamw":
        group["algorithm"] = "adamw"
    same = re.escape("'param2' is the same tensor as 'param0'")
    # torch's own warning comes first
    with pytest.warns(UserWarning, match="duplicate"), pytest.raises(ValueError, match=same):
        cls([group], **kwargs)


@pytest.mark.parametrize("name", ["shampoo", "soap"])
def test_a_split_changed_after_the_state_names_the_difference_briefly(name: str) -> None:
    """Catches: a group's ``split`` changed in place after its blocks' state was created,
    refused with a message that listed every state entry with its shape twice (8 KB for
    five blocks) and never said what differs; now the counts and the first difference,
    nothing changed, and setting the split back lets the step continue."""
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(20, 8))
    opt = cls([{"params": [("w", p)], "split": canzona.Split(dim=0, size=4)}], **kwargs)
    p.grad = torch.randn(20, 8)
    opt.step()
    before = p.detach().clone()
    opt.param_groups[0]["split"] = canzona.Split(dim=0, size=5)
    with pytest.raises(canzona.UpdateFailedError) as info:
        opt.step()
    message = str(info.value)
    assert "30 owner-held state entries, now 24; no longer 'exp_avg#4'" in message, message
    assert re.search(r"'[^']*#0[^']*' was \(\(4, 8\), torch.float32, 0\), now \(\(5, 8\)", message)
    assert "split" in message and len(message) < 1000, message
    assert torch.equal(p.detach(), before)
    opt.param_groups[0]["split"] = canzona.Split(dim=0, size=4)
    opt.step()
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("shampoo", {"max_precond_dim": 8}, "changed max_precond_dim from 8192 to 8 after"),
        ("shampoo", {"grafting": "none"}, "grafting from 'adam' to 'none'"),
        ("shampoo", {"betas": (0.0, 0.999)}, "betas[0] > 0 from True to False"),
        ("soap", {"max_precond_dim": 8}, "changed max_precond_dim from 10000 to 8 after"),
        ("shampoo", {"split": canzona.Split(dim=0, size=8)}, "has state of another param group"),
    ],
)
def test_a_value_that_shapes_existing_state_cannot_change(
    name: str, change: dict[str, Any], named: str
) -> None:
    """Catches: a group value that decides which owner-held state exists and its shapes
    (Shampoo's factors per side, first moment and grafting moment; SOAP's factors) changed
    after the state was created: the step mixed the old state with the new value and
    ``state_dict()`` wrote keys no optimizer with that value loads; ``state_dict()`` after
    the refused step exporting (and moving) the state by the new value, which dropped the
    factors it no longer gives for good (every later step: ``KeyError``)."""
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(16, 8))
    opt = cls([{"params": [("w", p)]}], **kwargs)
    p.grad = torch.randn(16, 8)
    opt.step()
    before = (p.detach().clone(), copy.deepcopy(opt.state_dict()))
    saved = {k: opt.param_groups[0][k] for k in change if k in opt.param_groups[0]}
    saved.update({k: None for k in change.keys() - saved.keys()})  # no split: None
    opt.param_groups[0].update(change)
    with pytest.raises(canzona.UpdateFailedError, match=re.escape(named)):
        opt.step()
    assert torch.equal(p.detach(), before[0])
    with pytest.raises(ValueError, match=re.escape(named)):
        opt.state_dict()  # refused as the step is: it would export by the new value
    opt.param_groups[0].update(saved)
    if "split" in change:
        del opt.param_groups[0]["split"]
    assert repr(opt.state_dict()) == repr(before[1])
    opt.step()  # back to the values the state has
    assert not torch.equal(p.detach(), before[0])
    if name == "shampoo":
        opt.param_groups[0]["betas"] = (0.9, 0.99)  # beta2 shapes nothing
        opt.step()
    fresh = cls([{"params": [("w", nn.Parameter(torch.randn(16, 8)))], **change}], **kwargs)
    fresh.param_groups[0].update(saved)  # before the first step: no state to keep
    fresh.param_groups[0]["params"][0].grad = torch.randn(16, 8)
    fresh.step()


@pytest.mark.parametrize("edit", ["max_precond_dim", "algorithm"])
def test_a_loaded_optimizer_still_refuses_an_edit_its_state_cannot_take(edit: str) -> None:
    """Catches: ``load_state_dict`` leaving the records of each group's state (its algorithm,
    the values that shape its state) keyed by the groups it replaced, so that after any
    load a state-shaping edit was no longer refused and the step ran on state built for
    the old values; and a load of state saved with other state-shaping values taken for
    an edit (a wrong refusal)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(8, 8, generator=gen) for _ in range(3)]
    p = nn.Parameter(torch.randn(8, 8, generator=gen))
    opt = canzona.Shampoo([p], lr=0.01)
    p.grad = grads[0].clone()
    opt.step()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.param_groups[0][edit] = {"max_precond_dim": 4, "algorithm": "adamw"}[edit]
    p.grad = grads[1].clone()
    error, message = {
        "max_precond_dim": (canzona.UpdateFailedError, "max_precond_dim from 8192 to 4 after"),
        "algorithm": (canzona.UpdateFailedError, r"has 'shampoo' state .* keeps its algorithm"),
    }[edit]
    with pytest.raises(error, match=message):
        opt.step()
    # state saved with grafting="none" loads into an optimizer that stepped with "adam"
    a, b = (nn.Parameter(torch.ones(8, 8)) for _ in range(2))
    src = canzona.Shampoo([a], lr=0.01, grafting="none")
    dst = canzona.Shampoo([b], lr=0.01)
    for g in grads[:2]:
        a.grad, b.grad = g.clone(), g.clone()
        src.step()
        dst.step()
    dst.load_state_dict(copy.deepcopy(src.state_dict()))
    with torch.no_grad():
        b.copy_(a)
    a.grad, b.grad = grads[2].clone(), grads[2].clone()
    src.step()
    dst.step()
    assert torch.equal(a.detach(), b.detach())


def test_a_copied_optimizer_refuses_a_new_algorithm_for_stepped_state() -> None:
    """Catches: a deepcopy forgetting which algorithm each group's state belongs to: a
    stepped group switched to ``"adamw"`` in the copy failed with ``KeyError: 'exp_avg'``
    instead of the refusal that names the group."""
    p = nn.Parameter(torch.randn(8, 8))
    opt = canzona.Muon([p], lr=0.02)
    p.grad = torch.randn(8, 8)
    opt.step()
    copied = copy.deepcopy(opt)
    copied.param_groups[0]["algorithm"] = "adamw"
    copied.param_groups[0]["params"][0].grad = torch.randn(8, 8)
    with pytest.raises(canzona.UpdateFailedError, match=r"has 'muon' state .* keeps its algorithm"):
        copied.step()
