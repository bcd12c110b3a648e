"""Each optimizer's defaults come from canzona.defaults: class, math, cost model, reference."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import canzona
from canzona.defaults import (
    ADAMW_DEFAULTS,
    MUON_DEFAULTS,
    NORMUON_DEFAULTS,
    SHAMPOO_DEFAULTS,
    SOAP_DEFAULTS,
)
from canzona.integrations.torchtitan import canzona_optimizers
from canzona.plan import cost_model
from canzona.plan.cost import MuonCost, ShampooCost, SoapCost
from canzona.testing import ReferenceNorMuon, ReferenceShampoo, ReferenceSOAP
from canzona.updates import NorMuonHParams, ShampooHParams, SOAPHParams
from canzona.updates.newton_schulz import DEFAULT_NS_EPS
from canzona.updates.ns_schedules import DEFAULT_NS_COEFFICIENTS, DEFAULT_NS_STEPS

#: What each defaults field is called where a signature names it otherwise.
REFERENCE_NORMUON_NAMES = {"eps": "ns_eps", "normuon_eps": "eps"}
HPARAMS_NORMUON_NAMES = {"normuon_eps": "eps"}


def _signature(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _mismatches(
    found: Mapping[str, Any],
    defaults: Any,
    *,
    names: Mapping[str, str] | None = None,
    skip: tuple[str, ...] = (),
) -> list[str]:
    """Fields of ``defaults`` whose counterpart in ``found`` is missing or differs."""
    out = []
    for f in dataclasses.fields(defaults):
        if f.name in skip:
            continue
        name = (names or {}).get(f.name, f.name)
        want = getattr(defaults, f.name)
        if name not in found:
            out.append(f"{name}: missing (want {want!r})")
        elif found[name] != want or type(found[name]) is not type(want):
            out.append(f"{name}: {found[name]!r} != {want!r}")
    return out


@pytest.mark.parametrize(
    ("cls", "defaults", "skip"),
    [
        (canzona.Muon, MUON_DEFAULTS, ("ns_steps",)),
        (canzona.NorMuon, NORMUON_DEFAULTS, ("ns_steps",)),
        (canzona.Shampoo, SHAMPOO_DEFAULTS, ()),
        (canzona.SOAP, SOAP_DEFAULTS, ()),
    ],
    ids=["muon", "normuon", "shampoo", "soap"],
)
def test_optimizer_classes(cls: type, defaults: Any, skip: tuple[str, ...]) -> None:
    found = _signature(cls.__init__)
    assert _mismatches(found, defaults, skip=skip) == []
    assert (found["adamw_betas"], found["adamw_eps"]) == (ADAMW_DEFAULTS.betas, ADAMW_DEFAULTS.eps)
    if "ns_steps" in skip:  # None: the default triple runs MUON_DEFAULTS.ns_steps times
        assert found["ns_steps"] is None
        assert MUON_DEFAULTS.ns_steps == DEFAULT_NS_STEPS


def test_the_math() -> None:
    assert MUON_DEFAULTS.ns_coefficients == DEFAULT_NS_COEFFICIENTS
    assert MUON_DEFAULTS.eps == DEFAULT_NS_EPS
    shampoo = dataclasses.asdict(ShampooHParams())
    assert _mismatches(shampoo, SHAMPOO_DEFAULTS, skip=("lr", "weight_decay")) == []
    soap = dataclasses.asdict(SOAPHParams())
    assert _mismatches(soap, SOAP_DEFAULTS, skip=("lr", "weight_decay")) == []
    normuon = dataclasses.asdict(NorMuonHParams())
    extra = ("beta2", "normuon_eps", "rescale", "rms")
    muon_fields = tuple(f.name for f in dataclasses.fields(MUON_DEFAULTS))
    assert normuon.keys() == {HPARAMS_NORMUON_NAMES.get(n, n) for n in extra}
    assert (
        _mismatches(normuon, NORMUON_DEFAULTS, names=HPARAMS_NORMUON_NAMES, skip=muon_fields) == []
    )


def test_the_cost_models_plan_the_default_work() -> None:
    assert MuonCost().ns_steps == MUON_DEFAULTS.ns_steps
    shampoo, soap = ShampooCost(), SoapCost()
    assert (shampoo.precondition_frequency, shampoo.max_precond_dim) == (
        SHAMPOO_DEFAULTS.precondition_frequency,
        SHAMPOO_DEFAULTS.max_precond_dim,
    )
    assert (soap.precondition_frequency, soap.max_precond_dim) == (
        SOAP_DEFAULTS.precondition_frequency,
        SOAP_DEFAULTS.max_precond_dim,
    )
    # what `canzona plan --optimizer NAME` prices
    assert cost_model("muon") == MuonCost()
    assert cost_model("shampoo") == shampoo and cost_model("soap") == soap


def test_the_references() -> None:
    assert _mismatches(_signature(ReferenceShampoo.__init__), SHAMPOO_DEFAULTS) == []
    assert _mismatches(_signature(ReferenceSOAP.__init__), SOAP_DEFAULTS) == []
    found = _signature(ReferenceNorMuon.__init__)
    skip = ("ns_coefficients", "ns_steps")
    assert _mismatches(found, NORMUON_DEFAULTS, names=REFERENCE_NORMUON_NAMES, skip=skip) == []
    default_schedule = (MUON_DEFAULTS.ns_coefficients,) * MUON_DEFAULTS.ns_steps
    assert found["ns_coefficients"] == default_schedule


def test_the_torchtitan_container_routes_adamw_with_the_same_defaults() -> None:
    found = _signature(canzona_optimizers)
    assert (found["adamw_betas"], found["adamw_eps"]) == (ADAMW_DEFAULTS.betas, ADAMW_DEFAULTS.eps)


def test_a_changed_literal_is_caught() -> None:
    """The comparison itself: a signature that drifted from the defaults is reported."""

    def drifted(lr: float = 1e-3, precondition_frequency: int = 21) -> None: ...

    found = _signature(drifted)
    wrong = _mismatches(found, SHAMPOO_DEFAULTS, skip=("betas",))
    assert "precondition_frequency: 21 != 20" in wrong
    assert "epsilon: missing (want 1e-12)" in wrong
    assert not any(w.startswith("lr") for w in wrong)


#: Modules that declare these hyper-parameters: none may spell a default out again.
DECLARING = (
    "optim/muon.py",
    "optim/normuon.py",
    "optim/shampoo.py",
    "optim/soap.py",
    "updates/normuon.py",
    "updates/shampoo.py",
    "updates/soap.py",
    "updates/ns_schedules.py",
    "updates/newton_schulz.py",
    "plan/cost.py",
    "testing/reference.py",
    "integrations/torchtitan.py",
)
SRC = Path(canzona.__file__).resolve().parent


def _literal_defaults(path: Path, names: set[str]) -> list[str]:
    """``name = <literal>`` defaults (arguments and dataclass fields) for the given names."""

    def literal(node: ast.expr | None) -> bool:
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        if isinstance(node, ast.Tuple):
            return all(literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value is not None

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        pairs: list[tuple[str, ast.expr | None]] = []
        if isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            pairs += list(
                zip(
                    [a.arg for a in positional[len(positional) - len(node.defaults) :]],
                    node.defaults,
                    strict=True,
                )
            )
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults, strict=True)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        out += [f"{path.name}:{name}" for name, value in pairs if name in names and literal(value)]
    return out


def test_no_module_spells_a_default_out_again() -> None:
    names = {
        f.name
        for d in (MUON_DEFAULTS, NORMUON_DEFAULTS, SHAMPOO_DEFAULTS, SOAP_DEFAULTS)
        for f in dataclasses.fields(d)
    } | {"adamw_betas", "adamw_eps", "ns_eps", "DEFAULT_NS_STEPS", "DEFAULT_NS_EPS"}
    found = [x for rel in DECLARING for x in _literal_defaults(SRC / rel, names)]
    assert found == []
