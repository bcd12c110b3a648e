"""Muon's coefficient schedules and scale modes, and NorMuon, on one device: against float64
references written from the formulas, and bitwise against the forms they must equal."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import pytest
import torch
from torch import nn

import canzona
from canzona.testing import ReferenceNorMuon
from canzona.updates import NS_SCHEDULES, ns_norm_scale, resolve_ns_coefficients

F64 = torch.float64
SHAPES: dict[str, tuple[int, ...]] = {
    "tall": (24, 16),
    "wide": (16, 24),
    "twin": (16, 24),  # the same shape as "wide": computed in one batch with it
    "stack": (3, 12, 20),
}
LR, WD, SCALE, STEPS = 0.02, 0.1, 0.5, 5


def _start(
    shapes: dict[str, tuple[int, ...]] = SHAPES, dtype: torch.dtype = F64, seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    values = {n: torch.randn(s, generator=gen, dtype=F64).to(dtype) for n, s in shapes.items()}
    grads = [
        {n: torch.randn(s, generator=gen, dtype=F64).to(dtype) for n, s in shapes.items()}
        for _ in range(STEPS)
    ]
    return values, grads


def _train(
    cls: type[torch.optim.Optimizer],
    values: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    **kw: Any,
) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    params = {n: nn.Parameter(v.clone()) for n, v in values.items()}
    opt = cls(list(params.items()), **kw)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}, opt


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


# ------------------------------------------------------------------ Muon, float64 reference
def _lr_factor(mode: str | None, m: int, n: int) -> float:
    """The shape factors of docs/optimizers.md, written out."""
    return {
        None: math.sqrt(max(1.0, m / n)),
        "original": math.sqrt(max(1.0, m / n)),
        "match_rms_adamw": 0.2 * math.sqrt(max(m, n)),
        "spectral": math.sqrt(m / n),
        "unit_rms": math.sqrt(max(m, n)),
        "none": 1.0,
    }[mode]


def _reference_muon(
    values: dict[str, torch.Tensor],
    grads: list[dict[str, torch.Tensor]],
    *,
    schedule: list[tuple[float, float, float]],
    norm_scale: float,
    adjust_lr_fn: str | None,
) -> dict[str, torch.Tensor]:
    """Muon in float64, matrix by matrix, from the formulas (momentum 0.95, Nesterov)."""
    out = {}
    for name, value in values.items():
        mats = list(value.reshape(-1, *value.shape[-2:]))
        bufs = [torch.zeros_like(x) for x in mats]
        for g in grads:
            gs = list(g[name].reshape(-1, *value.shape[-2:]))
            for i, (x, b, gi) in enumerate(zip(mats, bufs, gs, strict=True)):
                b = 0.95 * b + 0.05 * gi
                bufs[i] = b
                o = 0.05 * gi + 0.95 * b
                tall = o.shape[0] > o.shape[1]
                o = o.T if tall else o
                o = o / max(norm_scale * o.norm().item(), 1e-7)
                for a, bb, c in schedule:
                    gram = o @ o.T
                    o = a * o + (bb * gram + c * gram @ gram) @ o
                o = o.T if tall else o
                m, n = x.shape
                mats[i] = x * (1 - LR * WD) - LR * _lr_factor(adjust_lr_fn, m, n) * SCALE * o
        out[name] = torch.stack(mats).reshape(value.shape)
    return out


MUON_CASES: dict[str, tuple[Any, int | None, str | None]] = {
    "polar_express/spectral": ("polar_express", None, "spectral"),
    "polar_express_5/unit_rms": ("polar_express", 5, "unit_rms"),
    "tuned_quintic_7/match_rms_adamw": ("tuned_quintic", 7, "match_rms_adamw"),
    "qwen_express/none": ("qwen_express", None, "none"),
    "sequence/original": (
        ((4.0, -5.0, 2.0), (3.4445, -4.775, 2.0315), (2.0, -1.5, 0.5)),
        None,
        None,
    ),
    "triple_3/spectral": ((3.4445, -4.775, 2.0315), 3, "spectral"),
}


@pytest.mark.parametrize("case", list(MUON_CASES))
def test_muon_float64_matches_the_formulas(case: str) -> None:
    """Schedule (a name's norm margin included), ``ns_steps`` semantics, every scale mode and
    ``scale``: float64 Muon equals the written-out formulas to rounding (measured: < 1e-14).
    Catches: a schedule cut or repeated wrongly, Polar Express without its 1.01 input margin
    (a 1% change), a shape factor or ``scale`` left out or applied twice."""
    coefficients, ns_steps, adjust = MUON_CASES[case]
    values, grads = _start()
    got, _ = _train(
        canzona.Muon,
        values,
        grads,
        lr=LR,
        weight_decay=WD,
        ns_coefficients=coefficients,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust,
        scale=SCALE,
        ns_dtype=F64,
    )
    want = _reference_muon(
        values,
        grads,
        schedule=[tuple(map(float, t)) for t in resolve_ns_coefficients(coefficients, ns_steps)],
        norm_scale=ns_norm_scale(coefficients),
        adjust_lr_fn=adjust,
    )
    for n in values:
        assert _rel(got[n] - values[n], want[n] - values[n]) < 1e-13, n


def test_named_schedules_take_their_first_steps_and_repeat_the_last() -> None:
    """``ns_steps`` with a name: the first ``ns_steps`` triples, the last one repeated past the
    published length; bitwise the explicit schedule (a name without a norm margin)."""
    values, grads = _start(dtype=torch.float32)
    published = NS_SCHEDULES["tuned_quintic"].coefficients
    for steps, explicit in ((3, published[:3]), (7, published + published[-1:] * 2)):
        named, _ = _train(
            canzona.Muon, values, grads, ns_coefficients="tuned_quintic", ns_steps=steps
        )
        listed, _ = _train(canzona.Muon, values, grads, ns_coefficients=[list(t) for t in explicit])
        for n in values:
            assert torch.equal(named[n], listed[n]), (steps, n)


# ------------------------------------------------------------------ NorMuon, float64 reference
NORMUON_CASES: dict[str, dict[str, Any]] = {
    "defaults/polar_express": {"ns_coefficients": "polar_express"},
    "preserve_norm/original": {"rescale": "preserve_norm", "adjust_lr_fn": "original"},
    "rms_0.3/spectral/beta2_0/no_nesterov": {
        "rms": 0.3,
        "adjust_lr_fn": "spectral",
        "beta2": 0.0,
        "nesterov": False,
        "ns_coefficients": "tuned_quintic",
    },
}


@pytest.mark.parametrize("case", list(NORMUON_CASES))
def test_normuon_float64_matches_the_reference(case: str) -> None:
    """canzona.NorMuon in float64 against ReferenceNorMuon (Algorithm 1 of arXiv 2510.05491,
    written independently): parameters and the owner-held second moments to rounding
    (measured: < 5e-15; 1e-13 leaves room for other BLAS builds). Catches: the second moment
    of another axis or not carried across steps, the wrong rescale, a lost scale factor,
    states of a batch of same-shape matrices mixed up (``wide`` and ``twin`` are one batch,
    the stack another)."""
    kw = NORMUON_CASES[case]
    values, grads = _start()
    got, opt = _train(
        canzona.NorMuon, values, grads, lr=LR, weight_decay=WD, scale=SCALE, ns_dtype=F64, **kw
    )
    coefficients = kw.get("ns_coefficients", (3.4445, -4.775, 2.0315))
    ref = ReferenceNorMuon(
        list(values.values()),
        lr=LR,
        weight_decay=WD,
        nesterov=kw.get("nesterov", True),
        ns_coefficients=resolve_ns_coefficients(coefficients),
        ns_norm_scale=ns_norm_scale(coefficients),
        beta2=kw.get("beta2", 0.95),
        rescale=kw.get("rescale", "rms"),
        rms=kw.get("rms", 0.2),
        adjust_lr_fn=kw.get("adjust_lr_fn", "none"),
        scale=SCALE,
    )
    for g in grads:
        ref.step(list(g.values()))
    state = opt.state_dict()["state"]
    for i, n in enumerate(values):
        assert _rel(got[n] - values[n], ref.params[i] - values[n]) < 1e-13, n
        v = state[i]["second_momentum_buffer"]
        assert v.shape == (*values[n].shape[:-1], 1)
        assert _rel(v, ref.second_moments(i)) < 1e-13, n


def test_normuon_batch_equals_separate_optimizers_bitwise() -> None:
    """Four same-shape matrices and a stack computed in one optimizer (their states stacked
    into one call) equal each matrix alone in its own optimizer, bit for bit, parameters and
    second moments. Catches: a stacked state not copied back, or copied to the wrong matrix."""
    shapes = {f"m{i}": (20, 24) for i in range(4)}
    shapes["stack"] = (3, 20, 24)
    values, grads = _start(shapes, dtype=torch.float32, seed=2)
    kw: dict[str, Any] = {"lr": LR, "ns_dtype": torch.float32}
    joint, opt = _train(canzona.NorMuon, values, grads, **kw)
    joint_sd = opt.state_dict()["state"]
    for i, n in enumerate(shapes):
        mats = [values[n]] if values[n].ndim == 2 else list(values[n])
        for k, mat in enumerate(mats):
            alone_grads = [{"x": g[n] if g[n].ndim == 2 else g[n][k]} for g in grads]
            alone, alone_opt = _train(canzona.NorMuon, {"x": mat}, alone_grads, **kw)
            v = alone_opt.state_dict()["state"][0]["second_momentum_buffer"]
            if values[n].ndim == 2:
                assert torch.equal(joint[n], alone["x"]), n
                assert torch.equal(joint_sd[i]["second_momentum_buffer"], v), n
            else:
                assert torch.equal(joint[n][k], alone["x"]), (n, k)
                assert torch.equal(joint_sd[i]["second_momentum_buffer"][k], v), (n, k)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_normuon_float32_and_float64_matrices_in_one_batch(ns_dtype: torch.dtype) -> None:
    """A float32 and a float64 matrix of one shape share a batch (their payloads have the
    Newton–Schulz dtype) but not a state dtype: each still gets, bit for bit, what it gets
    alone."""
    gen = torch.Generator().manual_seed(4)
    values = {"f32": torch.randn(16, 24, generator=gen), "f64": torch.randn(16, 24, generator=gen)}
    values["f64"] = values["f64"].double()
    grads = [
        {n: torch.randn(16, 24, generator=gen).to(v.dtype) for n, v in values.items()}
        for _ in range(3)
    ]
    joint, opt = _train(canzona.NorMuon, values, grads, lr=LR, ns_dtype=ns_dtype)
    state = opt.state_dict()["state"]
    for i, n in enumerate(values):
        alone, alone_opt = _train(
            canzona.NorMuon, {n: values[n]}, [{n: g[n]} for g in grads], lr=LR, ns_dtype=ns_dtype
        )
        assert torch.equal(joint[n], alone[n]), n
        v = alone_opt.state_dict()["state"][0]["second_momentum_buffer"]
        assert v.dtype == values[n].dtype and torch.equal(state[i]["second_momentum_buffer"], v)


def test_normuon_state_is_fp32_for_bf16_parameters() -> None:
    """The momentum keeps the parameter's dtype (storage layout); the owner-held second moment
    is float32, shaped ``(..., m, 1)``; the direction is applied from float32."""
    values, grads = _start({"w": (16, 24), "s": (2, 8, 12)}, dtype=torch.bfloat16)
    _, opt = _train(canzona.NorMuon, values, grads, lr=LR)
    state = opt.state_dict()["state"]
    assert opt.param_groups[0]["algorithm"] == "normuon"
    assert set(state[0]) == {"step", "momentum_buffer", "second_momentum_buffer"}
    assert state[0]["momentum_buffer"].dtype == torch.bfloat16
    assert state[0]["second_momentum_buffer"].dtype == torch.float32
    assert state[0]["second_momentum_buffer"].shape == (16, 1)
    assert state[1]["second_momentum_buffer"].shape == (2, 8, 1)
    assert bool((state[0]["second_momentum_buffer"] > 0).all())


# ------------------------------------------------------------------ groups, cost, errors
def test_scale_is_a_group_entry_read_at_every_step() -> None:
    """Doubling ``group["scale"]`` mid-run moves the parameters exactly as doubling ``lr``
    (weight decay 0: the direction does not depend on either). Catches: ``scale`` read once
    at construction, or applied to the weight decay."""
    values, grads = _start(dtype=torch.float32)
    for cls in (canzona.Muon, canzona.NorMuon):
        runs = []
        for key, value in (("scale", 2.0), ("lr", 2 * LR)):
            params = {n: nn.Parameter(v.clone()) for n, v in values.items()}
            opt = cls(list(params.items()), lr=LR, weight_decay=0.0, adjust_lr_fn="spectral")
            for t, g in enumerate(grads):
                if t == 2:
                    opt.param_groups[0][key] = value
                for n, p in params.items():
                    p.grad = g[n].clone()
                opt.step()
            runs.append({n: p.detach() for n, p in params.items()})
        for n in values:
            assert torch.equal(runs[0][n], runs[1][n]), (cls.__name__, n)


@pytest.mark.parametrize("cls", [canzona.Muon, canzona.NorMuon])
def test_a_state_dict_saved_before_scale_existed_loads_with_scale_1(
    cls: type[torch.optim.Optimizer],
) -> None:
    """Param groups saved without ``scale`` (checkpoints of earlier versions) get the default
    and continue exactly like the run that saved them. Catches: a KeyError at the next step."""
    values, grads = _start(dtype=torch.float32)
    params = {n: nn.Parameter(v.clone()) for n, v in values.items()}
    opt = cls(list(params.items()), lr=LR)
    twin = {n: nn.Parameter(v.clone()) for n, v in values.items()}
    twin_opt = cls(list(twin.items()), lr=LR)
    for t, g in enumerate(grads):
        if t == 2:
            saved = copy.deepcopy(opt.state_dict())
            for group in saved["param_groups"]:
                del group["scale"]
            twin_opt = cls(list(twin.items()), lr=LR)
            twin_opt.load_state_dict(saved)
            assert twin_opt.param_groups[0]["scale"] == 1.0
        for ps, o in ((params, opt), (twin, twin_opt)):
            for n, p in ps.items():
                p.grad = g[n].clone()
            o.step()
    for n in values:
        assert torch.equal(params[n], twin[n]), n


def test_the_plan_costs_the_iterations_each_group_runs() -> None:
    """The cost model of each matrix group: ``ns_steps`` = the schedule's length (what runs),
    NorMuon's element-wise extra on top. Catches: a plan costed with the class defaults."""
    p = [nn.Parameter(torch.zeros(4, 4)) for _ in range(4)]
    muon = canzona.Muon(
        [
            {"params": p[:1]},
            {"params": p[1:2], "ns_coefficients": "polar_express"},
            {"params": p[2:3], "ns_coefficients": "polar_express", "ns_steps": 3},
            {"params": p[3:], "ns_coefficients": [[3.0, -4.0, 2.0]] * 4},
        ]
    )
    cost = muon._cost()
    assert cost is not None
    assert dict(cost.models) == {
        str(i): canzona.cost_model("muon", ns_steps=k) for i, k in enumerate((5, 8, 3, 4))
    }
    normuon = canzona.NorMuon(p, ns_coefficients="qwen_express")
    cost = normuon._cost()
    assert cost is not None and cost.name == "muon"
    assert dict(cost.models) == {"0": canzona.cost_model("muon", ns_steps=8, extra_elementwise=6)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ns_coefficients": []}, "ns_coefficients must not be empty, got "),
        ({"ns_coefficients": (1.0, 2.0)}, "three coefficients (a, b, c), got (1.0, 2.0)"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0), (1.0, 2.0)]}, "ns_coefficients[1]"),
        ({"ns_coefficients": (1.0, math.inf, 3.0)}, "must be finite, got (1.0, inf, 3.0)"),
        ({"ns_coefficients": [(1.0, 2.0, math.nan)]}, "must be finite, got (1.0, 2.0, nan)"),
        ({"ns_coefficients": "polar-express"}, "got 'polar-express'"),
        ({"ns_coefficients": [(1.0, 2.0, 3.0)] * 2, "ns_steps": 3}, "ns_steps=3 contradicts"),
        ({"ns_steps": 100}, "got 100"),
        ({"adjust_lr_fn": "rms"}, "got 'rms'"),
        ({"scale": -0.5}, "got -0.5"),
    ],
)
@pytest.mark.parametrize("cls", [canzona.Muon, canzona.NorMuon])
def test_bad_schedules_and_scales_raise_naming_the_value(
    cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], message: str
) -> None:
    """In the constructor and, as a param group's own value, in ``add_param_group``."""
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([nn.Parameter(torch.zeros(4, 4))], **kwargs)
    opt = cls([nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))], **kwargs})
    assert len(opt.param_groups) == 1
