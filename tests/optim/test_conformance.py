"""The torch.optim contract that Muon, NorMuon, Shampoo and SOAP all honour, on one device."""

from __future__ import annotations

import collections
import copy
import io
import pickle
from typing import Any

import pytest
import torch
from _optim_cases import (
    NAMES,
    OPTIMIZERS,
    SHAPES,
    assert_params_equal,
    assert_state_dicts_equal,
    gradients,
    initial,
    make,
    parameters,
    set_grads,
    snapshot,
    split_groups,
    train,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import canzona

pytestmark = pytest.mark.parametrize("name", NAMES)


def _transport(sd: dict[str, Any], how: str) -> dict[str, Any]:
    if how == "deepcopy":
        return copy.deepcopy(sd)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer)  # weights_only: dtypes and tuples in the groups must load


# ------------------------------------------------------------------ state_dict
@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_state_dict_round_trip_is_bitwise(name: str, how: str) -> None:
    """Save after 3 steps, load into a fresh optimizer, continue 3 steps: nothing differs.

    Catches: any state left out of the state dict (owner-held state, step counters) or not
    restored by ``load_state_dict``, and a load that changes a value (a dtype round trip)."""
    grads = gradients(steps=6)
    params, opt = make(name)
    train(params, opt, grads[:3])
    saved = _transport(opt.state_dict(), how)
    at_save = snapshot(params)
    train(params, opt, grads[3:])

    params2, opt2 = make(name, at_save)
    opt2.load_state_dict(saved)
    assert_state_dicts_equal(opt2.state_dict(), saved)  # load -> state_dict is the identity
    train(params2, opt2, grads[3:])
    assert_params_equal(params2, params)
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())


def test_state_dict_hooks_see_and_change_the_whole_state(name: str) -> None:
    """torch.optim's state-dict hooks around the owner-held state as around any other.

    Catches: post-hooks run before the owner-held keys (NorMuon's second moment, Shampoo's
    factors, SOAP's bases) and the saved param-group values are added (a hook's edits lost,
    dtypes where the result holds strings); load pre-hooks run after the state dict was
    checked (a hook upgrading old key names never ran) or without seeing owner-held keys;
    load post-hooks run before the owner-held state is in place."""
    grads = gradients(steps=5)
    params, opt = make(name)
    train(params, opt, grads[:3])
    plain = _transport(opt.state_dict(), "deepcopy")
    seen: dict[str, Any] = {}

    def rename(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
        seen["post"] = copy.deepcopy(sd)  # what the hook sees is what state_dict returns
        return {
            **sd,
            "state": {i: {f"old.{k}": v for k, v in e.items()} for i, e in sd["state"].items()},
        }

    handle = opt.register_state_dict_post_hook(rename)
    saved = _transport(opt.state_dict(), "deepcopy")
    handle.remove()
    assert_state_dicts_equal(seen["post"], plain)
    assert all(k.startswith("old.") for e in saved["state"].values() for k in e)
    at_save = snapshot(params)
    train(params, opt, grads[3:])

    params2, opt2 = make(name, at_save)

    def upgrade(o: Any, sd: dict[str, Any]) -> None:
        sd["state"] = {
            i: {k.removeprefix("old."): v for k, v in e.items()} for i, e in sd["state"].items()
        }

    def loaded(o: Any) -> None:
        seen["loaded"] = o.state_dict()

    opt2.register_load_state_dict_pre_hook(upgrade)
    opt2.register_load_state_dict_post_hook(loaded)
    opt2.load_state_dict(saved)
    assert_state_dicts_equal(seen["loaded"], plain)
    train(params2, opt2, grads[3:])
    assert_params_equal(params2, params)


def test_a_load_pre_hook_that_raises_loads_nothing(name: str) -> None:
    """Catches: a load pre-hook's exception swallowed, or raised after a partial load."""
    grads = gradients(steps=4)
    params, opt = make(name)
    train(params, opt, grads[:2])
    saved = _transport(opt.state_dict(), "deepcopy")
    params2, opt2 = make(name)
    train(params2, opt2, grads[2:])
    before = _transport(opt2.state_dict(), "deepcopy")

    def refuse(o: Any, sd: dict[str, Any]) -> None:
        raise RuntimeError("checkpoint from the future")

    opt2.register_load_state_dict_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="checkpoint from the future"):
        opt2.load_state_dict(saved)
    assert_state_dicts_equal(opt2.state_dict(), before)


def test_state_dict_round_trip_before_the_first_step(name: str) -> None:
    grads = gradients(steps=3)
    params, opt = make(name)
    saved = _transport(opt.state_dict(), "deepcopy")
    assert saved["state"] == {}
    params2, opt2 = make(name)
    opt2.load_state_dict(saved)
    train(params, opt, grads)
    train(params2, opt2, grads)
    assert_params_equal(params2, params)
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())


def test_loading_a_fresh_state_forgets_what_the_steps_built(name: str) -> None:
    """Load the state dict of an optimizer that never stepped into one that has: it then
    steps as a fresh one does.

    Catches: owner-held state (momentum, factors, eigenbases) kept past such a load, which
    the next step would start from."""
    grads = gradients(steps=5)
    params, opt = make(name)
    train(params, opt, grads[:3])
    at_load = snapshot(params)
    opt.load_state_dict(_transport(make(name)[1].state_dict(), "deepcopy"))
    assert opt.state_dict()["state"] == {}
    _goes_on_as_a_fresh_one(name, params, opt, at_load, grads[3:])


def _goes_on_as_a_fresh_one(
    name: str, params: Any, opt: torch.optim.Optimizer, at: Any, grads: Any
) -> None:
    """``opt`` steps ``grads`` as a fresh optimizer over parameters ``at`` does."""
    train(params, opt, grads)
    fresh_params, fresh = make(name, at)
    train(fresh_params, fresh, grads)
    assert_params_equal(params, fresh_params)
    assert_state_dicts_equal(opt.state_dict(), fresh.state_dict())


def test_state_dict_keeps_named_parameters(name: str) -> None:
    grads = gradients(steps=4)
    params, opt = make(name, named=True)
    train(params, opt, grads[:2])
    saved = _transport(opt.state_dict(), "torch.save")
    assert saved["param_groups"][0]["param_names"] == ["square", "tall", "wide", "stack"]
    assert saved["param_groups"][1]["param_names"] == ["bias", "gain"]
    params2, opt2 = make(name, snapshot(params), named=True)
    opt2.load_state_dict(saved)
    train(params, opt, grads[2:])
    train(params2, opt2, grads[2:])
    assert_params_equal(params2, params)


def test_dcp_state_dict_api(name: str) -> None:
    """``torch.distributed.checkpoint.state_dict`` without a process group: FQN keys, round trip.

    ``get_optimizer_state_dict`` on a fresh optimizer initialises the state with one step of
    zero gradients at ``lr=0``; that step must leave the parameters alone.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cls, kwargs = OPTIMIZERS[name]
    opt = cls(split_groups(dict(model.named_parameters())), **kwargs)
    fresh = get_optimizer_state_dict(model, opt)
    assert set(fresh["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k

    x, y = torch.randn(16, 6), torch.randn(16, 3)

    def run(m: nn.Module, o: torch.optim.Optimizer, steps: int) -> None:
        for _ in range(steps):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()

    run(model, opt, 3)
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    model2 = copy.deepcopy(model)
    opt2 = cls(split_groups(dict(model2.named_parameters())), **kwargs)
    set_optimizer_state_dict(model2, opt2, saved)
    run(model, opt, 3)
    run(model2, opt2, 3)
    for (n, p), (_, q) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_number_steps_of_older_checkpoints_load_as_tensors(name: str) -> None:
    """A state dict whose ``step`` entries are plain numbers (as older checkpoints and
    torch.optim's older optimizers wrote them) loads, each ``step`` becoming a float32
    scalar tensor, and training continues bit for bit. Catches: a refused number, a number
    kept as a number (the in-place counter update would fail), a wrong value."""
    grads = gradients(steps=5)
    params, opt = make(name)
    train(params, opt, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    numbers = {pid: {**entry, "step": int(entry["step"])} for pid, entry in saved["state"].items()}
    numbers[0]["step"] = float(saved["state"][0]["step"])  # floats load too
    params2, opt2 = make(name, snapshot(params))
    opt2.load_state_dict({**saved, "state": numbers})
    for p in params2.values():
        step = opt2.state[p]["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.ndim == 0
        assert step.item() == 3.0
    train(params, opt, grads[3:])
    train(params2, opt2, grads[3:])
    assert_params_equal(params2, params)
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())


# ------------------------------------------------------------------ copies
def _copied(params: dict[str, nn.Parameter], opt: Any, how: str) -> tuple[Any, Any]:
    """``(params, opt)`` copied together, so that the copy's groups hold the copied params."""
    if how == "deepcopy":
        return copy.deepcopy((params, opt))
    buffer = io.BytesIO()
    if how == "pickle":
        pickle.dump((params, opt), buffer)
        buffer.seek(0)
        return pickle.load(buffer)
    torch.save((params, opt), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_or_unpickled_optimizer_steps_like_the_original(name: str, how: str) -> None:
    """Copy after 2 steps (one of them skipped for a NaN), then step both with the same
    gradients: parameters and state stay bitwise equal, and the copy keeps the plan and
    pipeline configurations and the skipped-step count. Catches: a copy that drops the
    configurations, the runtime or the owner-held state (it would raise or restart
    Shampoo's and SOAP's statistics), or shares them with the original."""
    plan = canzona.PlanConfig(strategy="numel", capacity_mb=1.0)
    pipeline = canzona.PipelineConfig(skip_nonfinite=True, depth=2)
    grads = gradients(steps=5)
    params, opt = make(name, plan=plan, pipeline=pipeline)
    train(params, opt, grads[:2])
    nan = {n: g.clone() for n, g in grads[2].items()}
    nan["square"][0, 0] = float("nan")
    train(params, opt, [nan])  # skipped
    params2, opt2 = _copied(params, opt, how)
    assert all(params2[n] is not params[n] for n in params)
    assert opt2.plan_config == plan and opt2.pipeline_config == pipeline
    assert opt2.skipped_steps == opt.skipped_steps == 1
    assert opt2.defaults == opt.defaults
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())
    train(params, opt, grads[3:])
    train(params2, opt2, grads[3:])
    assert_params_equal(params2, params)
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())
    train(params2, opt2, grads[3:4])  # stepping the copy leaves the original alone
    assert not torch.equal(params2["square"], params["square"])


# ------------------------------------------------------------------ param groups
GROUP_HPARAMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "muon": (
        {"lr": 0.03, "ns_steps": 3, "momentum": 0.8},
        {"lr": 0.01, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.0},
    ),
    "normuon": (
        {"lr": 0.03, "ns_coefficients": "polar_express", "beta2": 0.8, "scale": 2.0},
        {"lr": 0.01, "rescale": "preserve_norm", "adjust_lr_fn": "original", "ns_steps": 3},
    ),
    "shampoo": (
        {"lr": 0.02, "betas": (0.5, 0.99), "precondition_frequency": 3},
        {"lr": 0.005, "grafting": "none", "epsilon": 1e-8, "start_preconditioning_step": 3},
    ),
    "soap": (
        {"lr": 0.02, "betas": (0.9, 0.99), "precondition_frequency": 3},
        {"lr": 0.005, "shampoo_beta": 0.5, "normalize_grads": True, "eps": 1e-6},
    ),
}


def test_param_groups_behave_like_separate_optimizers(name: str) -> None:
    """Two matrix groups with different hyper-parameters (and same-shape matrices in both)."""
    cls, kwargs = OPTIMIZERS[name]
    first, second = GROUP_HPARAMS[name]
    shapes = {"a": (8, 8), "s": (2, 8, 8), "b": (8, 8), "t": (10, 4), "bias": (5,)}
    values, grads = initial(shapes), gradients(shapes, steps=6)
    split = [["a", "s"], ["b", "t"], ["bias"]]

    joint = parameters(values)
    opt = cls(
        [
            {"params": [joint[n] for n in split[0]], **first},
            {"params": [joint[n] for n in split[1]], **second},
            {"params": [joint["bias"]], "algorithm": "adamw", "lr": 0.003},
        ],
        **kwargs,
    )
    alone = parameters(values)
    separate = [
        cls([alone[n] for n in split[0]], **{**kwargs, **first}),
        cls([alone[n] for n in split[1]], **{**kwargs, **second}),
        cls([{"params": [alone["bias"]], "algorithm": "adamw"}], **{**kwargs, "lr": 0.003}),
    ]
    for g in grads:
        set_grads(joint, g)
        set_grads(alone, g)
        opt.step()
        for o in separate:
            o.step()
    assert_params_equal(joint, alone)


# ------------------------------------------------------------------ step
def test_step_with_closure(name: str) -> None:
    params, opt = make(name)
    reference, ref_opt = make(name)
    grads = gradients(steps=2)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = sum((p * grads[0][n]).sum() for n, p in params.items())
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == [True]
    assert isinstance(loss, torch.Tensor)
    assert loss.item() == pytest.approx(
        sum((v * grads[0][n]).sum().item() for n, v in initial().items()), rel=1e-6
    )
    train(reference, ref_opt, grads[:1])  # the closure's gradients are grads[0]
    assert_params_equal(params, reference)
    assert opt.step() is None


def test_lr_scheduler_scales_the_update(name: str) -> None:
    """The direction does not depend on the learning rate: with weight decay 0 the update of a
    scheduled run is the scheduled factor times the update of a constant-lr run, lr=0 leaves the
    parameters bitwise unchanged, and ``group["lr"]`` follows the schedule in every group."""
    factors = [1.0, 0.5, 0.0, 2.0, 0.25, 0.0]
    grads = gradients(steps=len(factors))
    constant, opt = make(name, weight_decay=0.0)
    scheduled, sched_opt = make(name, weight_decay=0.0)
    base = OPTIMIZERS[name][1]["lr"]
    scheduler = LambdaLR(sched_opt, lambda t: factors[min(t, len(factors) - 1)])
    for t, g in enumerate(grads):
        assert all(grp["lr"] == pytest.approx(base * factors[t]) for grp in sched_opt.param_groups)
        before_c, before_s = snapshot(constant), snapshot(scheduled)
        set_grads(constant, g)
        set_grads(scheduled, g)
        opt.step()
        sched_opt.step()
        scheduler.step()
        for n in constant:
            delta_c = constant[n].detach() - before_c[n]
            delta_s = scheduled[n].detach() - before_s[n]
            if factors[t] == 0.0:
                assert torch.equal(scheduled[n].detach(), before_s[n]), (t, n)
            else:
                # each delta is a difference of O(1) fp32 values: up to an ulp (~5e-7) of noise
                torch.testing.assert_close(delta_s, factors[t] * delta_c, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_step_lr_equals_setting_the_lr_by_hand(name: str, tensor_lr: bool) -> None:
    """StepLR (also on a tensor lr, which schedulers fill in place) is read at every step."""
    grads = gradients(steps=6)
    base = OPTIMIZERS[name][1]["lr"]
    lr0: float | torch.Tensor = torch.tensor(base, dtype=torch.float64) if tensor_lr else base
    scheduled, sched_opt = make(name, lr=lr0)
    by_hand, hand_opt = make(name)
    scheduler = StepLR(sched_opt, step_size=2, gamma=0.5)
    for t, g in enumerate(grads):
        for group in hand_opt.param_groups:
            group["lr"] = base * 0.5 ** (t // 2)
        set_grads(scheduled, g)
        set_grads(by_hand, g)
        sched_opt.step()
        hand_opt.step()
        scheduler.step()
    assert_params_equal(scheduled, by_hand)


def test_a_float64_tensor_lr_equals_the_float(name: str) -> None:
    """A tensor lr's arithmetic runs in its dtype, as torch.optim's: in float64 it is
    Python's. (A float32 tensor gives float32 products: ``test_muon_vs_torch.py`` and the
    AdamW-route test compare those with torch.)

    Catches: a tensor lr read differently from the float (e.g. rounded to float32)."""
    grads = gradients(steps=4)
    for lr in (2.0**-6, 0.01, 0.03):
        floats, opt = make(name, lr=lr)
        tensors, topt = make(name, lr=torch.tensor(lr, dtype=torch.float64))
        train(floats, opt, grads)
        train(tensors, topt, grads)
        assert_params_equal(tensors, floats)


def test_parameters_without_gradient_are_skipped(name: str) -> None:
    grads = gradients(steps=5)
    values = initial()
    params, opt = make(name)
    assert opt.step() is None  # no gradient at all: nothing happens
    assert not opt.state
    assert_params_equal(params, values)
    frozen = ("tall", "gain")
    without = {n: v for n, v in values.items() if n not in frozen}
    reference, ref_opt = make(name, without)
    for g in grads[:3]:
        set_grads(params, g)
        for n in frozen:
            params[n].grad = None
        opt.step()
        set_grads(reference, {n: g[n] for n in without})
        ref_opt.step()
    for n in frozen:
        assert torch.equal(params[n].detach(), values[n])
        assert not opt.state.get(params[n])
    for n in without:
        assert torch.equal(params[n].detach(), reference[n].detach()), n

    # partial state survives a round trip, and the frozen parameters start later
    saved = copy.deepcopy(opt.state_dict())
    params2, opt2 = make(name, snapshot(params))
    opt2.load_state_dict(saved)
    train(params, opt, grads[3:])
    train(params2, opt2, grads[3:])
    assert_params_equal(params2, params)
    assert int(opt.state[params["tall"]]["step"]) == 2
    assert int(opt.state[params["square"]]["step"]) == 5


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 16, 20), (2, 24, 16)])
def test_stack_equals_separate_matrices(name: str, shape: tuple[int, int, int]) -> None:
    """A 3-D parameter is a stack of independent matrices: bitwise what separate 2-D ones get."""
    cls, kwargs = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(5)]
    stack = nn.Parameter(start.clone())
    mats = [nn.Parameter(start[i].clone()) for i in range(shape[0])]
    opt, opt_mats = cls([stack], **kwargs), cls(mats, **kwargs)
    for g in grads:
        stack.grad = g.clone()
        for i, p in enumerate(mats):
            p.grad = g[i].clone()
        opt.step()
        opt_mats.step()
    for i, p in enumerate(mats):
        assert torch.equal(stack[i].detach(), p.detach()), i


def test_named_parameters_are_accepted(name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8, bias=False), nn.Tanh(), nn.Linear(8, 4, bias=False))
    twin = copy.deepcopy(model)
    opt = cls(model.named_parameters(), **kwargs)
    plain = cls(twin.parameters(), **kwargs)
    assert opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    x = torch.randn(10, 6)
    for _ in range(4):
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)

    grads = gradients(steps=3)
    named, nopt = make(name, named=True)
    unnamed, uopt = make(name)
    train(named, nopt, grads)
    train(unnamed, uopt, grads)
    assert_params_equal(named, unnamed)


# ------------------------------------------------------------------ editing optimizer.state
def _storage_keys(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
    """The keys of ``p``'s entry that hold real tensors (not the step, not owner-held)."""
    return [k for k, v in opt.state[p].items() if k != "step" and v.numel()]


@pytest.mark.parametrize("how", ["clear", "pop", "new dict", "new mapping"])
def test_a_cleared_state_starts_afresh(name: str, how: str) -> None:
    """Clearing ``optimizer.state`` between steps, as torch.optim allows: the next steps are
    those of a fresh optimizer from the same parameters, owner-held state included.

    Catches: the step's lists reused with the old tensors (Muon kept its old momentum and
    ``state_dict()`` came back empty), owner-held state kept (Shampoo's factors, SOAP's
    bases, NorMuon's second moment: Shampoo failed with KeyError 'step')."""
    grads = gradients(steps=6)
    params, opt = make(name)
    train(params, opt, grads[:3])
    at_reset = snapshot(params)
    if how == "clear":
        opt.state.clear()
    elif how == "pop":
        for p in params.values():
            opt.state.pop(p)
    elif how == "new dict":
        for p in params.values():
            opt.state[p] = {}
    else:
        opt.state = collections.defaultdict(dict)
    _goes_on_as_a_fresh_one(name, params, opt, at_reset, grads[3:])


def test_replaced_state_tensors_are_the_ones_the_step_updates(name: str) -> None:
    """A state tensor replaced between steps (by one like it) is read and updated by the
    next steps, as in torch.optim.

    Catches: the step's cached lists still holding the replaced tensors: the new ones
    never change (the parameters match either way: the replacements are copies)."""
    grads = gradients(steps=5)
    params, opt = make(name)
    ref_params, ref = make(name)
    train(params, opt, grads[:2])
    train(ref_params, ref, grads[:2])
    replaced = {}
    for p in params.values():
        for key in [*_storage_keys(opt, p), "step"]:
            opt.state[p][key] = replaced[(id(p), key)] = opt.state[p][key].clone()
    assert replaced  # every optimizer has element-wise state (AdamW's moments at least)
    train(params, opt, grads[2:])
    train(ref_params, ref, grads[2:])
    assert_params_equal(params, ref_params)
    assert_state_dicts_equal(opt.state_dict(), ref.state_dict())
    for p in params.values():
        for key in _storage_keys(opt, p):
            assert opt.state[p][key] is replaced[(id(p), key)], key


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            "dtype",
            r"state 'exp_avg' of parameter 'param4' was replaced by Tensor \(7,\) torch.float64",
        ),
        (
            "shape",
            r"state 'exp_avg' of parameter 'param4' was replaced by Tensor \(2,\) torch.float32",
        ),
        ("number", r"state 'step' of parameter 'param0' was replaced by a float"),
        ("lost key", r"entry of parameter 'param4' lost key 'exp_avg'"),
        ("owner-held", r"lives on its owner rank"),
    ],
)
def test_a_state_edit_the_step_cannot_use_fails_it_and_changes_nothing(
    name: str, edit: str, match: str
) -> None:
    """Catches: a replacement of another dtype or shape, or an entry missing a key, reaching
    the math (an unclear error after part of the step was applied, or none at all)."""
    grads = gradients(steps=4)
    params, opt = make(name)
    train(params, opt, grads[:2])
    p = params["square"] if edit in ("number", "owner-held") else params["bias"]
    entry = opt.state[p]
    kept = dict(entry)
    if edit == "dtype":
        entry["exp_avg"] = entry["exp_avg"].double()
    elif edit == "shape":
        entry["exp_avg"] = torch.zeros(2)
    elif edit == "number":
        entry["step"] = 2.0
    elif edit == "lost key":
        del entry["exp_avg"]
    else:
        owner_held = [k for k, v in entry.items() if v.numel() == 0 and k != "step"]
        if not owner_held:
            pytest.skip(f"{name} keeps no owner-held state")
        entry[owner_held[0]] = torch.zeros(8, 8)
    before = snapshot(params)
    with pytest.raises(canzona.UpdateFailedError, match=match):
        set_grads(params, grads[2])
        opt.step()
    assert_params_equal(params, before)
    entry.clear()
    entry.update(kept)  # undone: the steps go on as if nothing happened
    ref_params, ref = make(name)
    train(ref_params, ref, grads[:2])
    train(params, opt, grads[2:])
    train(ref_params, ref, grads[2:])
    assert_params_equal(params, ref_params)


def test_zero_grad(name: str) -> None:
    params, opt = make(name)
    set_grads(params, gradients(steps=1)[0])
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params.values())
    opt.zero_grad()
    assert all(p.grad is None for p in params.values())


# ------------------------------------------------------------------ add_param_group
def test_add_param_group_before_the_first_step(name: str) -> None:
    cls, kwargs = OPTIMIZERS[name]
    grads = gradients(steps=4)
    values = initial()
    added = parameters(values)
    opt = cls([added["square"], added["stack"]], **kwargs)
    opt.add_param_group({"params": [added["tall"], added["wide"]], "lr": 0.004})
    opt.add_param_group({"params": [added["bias"], added["gain"]], "algorithm": "adamw"})
    built = parameters(values)
    ref = cls(
        [
            {"params": [built["square"], built["stack"]]},
            {"params": [built["tall"], built["wide"]], "lr": 0.004},
            {"params": [built["bias"], built["gain"]], "algorithm": "adamw"},
        ],
        **kwargs,
    )
    train(added, opt, grads)
    train(built, ref, grads)
    assert_params_equal(added, built)


def test_add_param_group_after_the_first_step(name: str) -> None:
    """The optimizer re-plans: old state is kept, the new groups start from scratch."""
    cls, kwargs = OPTIMIZERS[name]
    grads = gradients(steps=6)
    values = initial()
    first, later = ["square", "stack"], ["tall", "wide", "bias", "gain"]
    params = parameters(values)
    opt = cls([params[n] for n in first], **kwargs)
    old = parameters(values)
    old_opt = cls([old[n] for n in first], **kwargs)
    new = parameters(values)
    new_opt = cls(
        [
            {"params": [new["tall"], new["wide"]], "lr": 0.004},
            {"params": [new["bias"], new["gain"]], "algorithm": "adamw"},
        ],
        **kwargs,
    )
    for t, g in enumerate(grads):
        if t == 3:
            before = copy.deepcopy(opt.state_dict())
            opt.add_param_group({"params": [params["tall"], params["wide"]], "lr": 0.004})
            opt.add_param_group({"params": [params["bias"], params["gain"]], "algorithm": "adamw"})
            after = opt.state_dict()
            assert len(after["param_groups"]) == 3
            assert_state_dicts_equal({**after, "param_groups": []}, {**before, "param_groups": []})
        for n in first:
            params[n].grad = g[n].clone()
            old[n].grad = g[n].clone()
        old_opt.step()
        if t >= 3:
            for n in later:
                params[n].grad = g[n].clone()
                new[n].grad = g[n].clone()
            new_opt.step()
        opt.step()
    for n in first:
        assert torch.equal(params[n].detach(), old[n].detach()), n
    for n in later:
        assert torch.equal(params[n].detach(), new[n].detach()), n
    assert int(opt.state[params["square"]]["step"]) == 6
    assert int(opt.state[params["tall"]]["step"]) == 3


# ------------------------------------------------------------------ edge cases
REGROUPED = {"a": (8, 8), "b": (8, 8), "c": (6, 12), "d": (8, 8), "bias": (7,)}


def _regrouped_run(
    name: str, edit: str, reference: bool, copied: bool = False
) -> dict[str, torch.Tensor]:
    """Six steps over groups [a, b], [c, d], AdamW [bias]; before step 3 ``edit`` changes the
    param groups (``reference``: the same parameters stay, those it removes without grads);
    ``copied``: the optimizer and parameters are deep-copied right after the edit."""
    cls, kwargs = OPTIMIZERS[name]
    params = parameters(initial(REGROUPED))
    grads = gradients(REGROUPED, steps=6)
    opt = cls(
        [
            {"params": [params["a"], params["b"]]},
            {"params": [params["c"], params["d"]]},
            {"params": [params["bias"]], "algorithm": "adamw"},
        ],
        **kwargs,
    )
    frozen: set[str] = set()
    for step, g in enumerate(grads):
        if step == 3:
            groups = opt.param_groups
            if edit == "drop a parameter":
                frozen = {"c"}
                if not reference:
                    groups[1]["params"].remove(params["c"])
            elif edit == "drop a group":
                frozen = {"a", "b"}
                if not reference:
                    del groups[0]
            elif not reference and edit == "reverse a group":
                groups[0]["params"].reverse()
            elif not reference and edit == "reverse the groups":
                groups.reverse()
            elif not reference and edit == "swap across groups":
                groups[0]["params"][1], groups[1]["params"][1] = (
                    groups[1]["params"][1],
                    groups[0]["params"][1],
                )
            if copied:
                params, opt = copy.deepcopy((params, opt))
        for n, p in params.items():
            p.grad = None if n in frozen else g[n].clone()
        opt.step()
    return snapshot(params)


@pytest.mark.parametrize(
    "edit",
    [
        "reverse a group",
        "reverse the groups",
        "swap across groups",
        "drop a parameter",
        "drop a group",
    ],
)
@pytest.mark.parametrize("copied", [False, True], ids=["", "copied"])
def test_param_groups_edited_between_steps_keep_each_parameters_state(
    name: str, edit: str, copied: bool
) -> None:
    """torch.optim keys the state by parameter, so param groups reordered or thinned between
    steps (a frozen layer dropped) change nothing else.

    Catches: owner-held state kept by position (Shampoo's factors, SOAP's bases, NorMuon's
    second moment of the matrix that was at that position: silently wrong results, or a
    shape error on the owner), and group-indexed records breaking on a removed group
    (IndexError on every later step); a copy made after the edit, before the next step,
    taking the state by the old positions (or the group records by the old groups)."""
    got = _regrouped_run(name, edit, reference=False, copied=copied)
    want = _regrouped_run(name, edit, reference=True)
    for n in REGROUPED:
        assert torch.equal(got[n], want[n]), f"{n!r} differs by {(got[n] - want[n]).abs().max()}"


@pytest.mark.parametrize("into", ["adamw", "matrix", "other blocks"])
def test_a_parameter_moved_where_its_state_does_not_fit_is_refused(name: str, into: str) -> None:
    """Catches: a parameter with matrix state moved into the AdamW group (KeyError at every
    later step), AdamW state moved into a matrix group (Shampoo/SOAP went on with AdamW's
    moments), a matrix moved into a group that splits it otherwise (its blocks got zero
    state and the old keys stayed): refused on the step, naming it, nothing changed; once
    its state is cleared it starts afresh in its new group."""
    cls, kwargs = OPTIMIZERS[name]
    params = parameters(initial(REGROUPED))
    grads = gradients(REGROUPED, steps=3)
    opt = cls(
        [
            {"params": [params["a"], params["b"]]},
            {"params": [params["d"]], "split": canzona.Split(dim=0, size=4)},
            {"params": [params["bias"], params["c"]], "algorithm": "adamw"},
        ],
        **kwargs,
    )
    set_grads(params, grads[0])
    opt.step()
    groups = opt.param_groups
    moved, source, target = {
        "adamw": (params["a"], 0, 2),
        "matrix": (params["c"], 2, 0),
        "other blocks": (params["b"], 0, 1),
    }[into]
    held = groups[source]["params"]
    held.pop(next(i for i, p in enumerate(held) if p is moved))
    groups[target]["params"].append(moved)
    if name == "muon" and into == "other blocks":  # its momentum is element-wise: it fits
        set_grads(params, grads[1])
        opt.step()
        return
    before = snapshot(params)
    set_grads(params, grads[1])
    with pytest.raises(canzona.UpdateFailedError, match="has state of another param group"):
        opt.step()
    assert_params_equal(params, before)
    with pytest.raises(canzona.UpdateFailedError, match="has state of another param group"):
        opt.step()  # until it is resolved
    opt.state.pop(moved)
    opt.step()
    assert float(opt.state[moved]["step"]) == 1.0  # afresh in its new group


def test_zero_size_parameter_is_a_no_op(name: str) -> None:
    """A ``(0, n)`` matrix is accepted, left as it is, its step counter advances, and it does
    not disturb the others. Catches: an error for an empty matrix, an empty matrix sent
    through the planner, and a step counter that stays behind."""
    shapes = {"empty": (0, 4), "empty_stack": (2, 0, 3), "square": (8, 8)}
    values, grads = initial(shapes), gradients(shapes, steps=3)
    params, opt = make(name, values)
    reference, ref_opt = make(name, {"square": values["square"]})
    train(params, opt, grads)
    train(reference, ref_opt, [{"square": g["square"]} for g in grads])
    assert params["empty"].shape == (0, 4)
    assert params["empty_stack"].shape == (2, 0, 3)
    assert torch.equal(params["square"].detach(), reference["square"].detach())
    for n in ("empty", "empty_stack"):
        assert opt.state[params[n]]["step"] == len(grads), n


def test_zero_size_parameter_state_dict_round_trip(name: str) -> None:
    shapes = {"empty": (0, 4), "square": (8, 8)}
    values, grads = initial(shapes), gradients(shapes, steps=4)
    params, opt = make(name, values)
    train(params, opt, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    params2, opt2 = make(name, snapshot(params))
    opt2.load_state_dict(saved)
    train(params, opt, grads[2:])
    train(params2, opt2, grads[2:])
    assert_params_equal(params2, params)


def test_zero_gradients_at_lr_zero_change_nothing(name: str) -> None:
    """What ``torch.distributed.checkpoint`` does to create the state: one step of zero
    gradients with ``lr = 0`` (weight decay still on). Parameters unchanged, state finite; then
    the optimizer trains as usual."""
    params, opt = make(name)
    values = snapshot(params)
    for p in params.values():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    assert_params_equal(params, values)
    sd = opt.state_dict()
    assert set(sd["state"]) == set(range(len(SHAPES)))
    for entry in sd["state"].values():
        for key, value in entry.items():
            assert torch.isfinite(value).all(), key
    for group in opt.param_groups:
        group["lr"] = OPTIMIZERS[name][1]["lr"]
    train(params, opt, gradients(steps=3))
    for n, p in params.items():
        assert torch.isfinite(p).all(), n
        assert not torch.equal(p.detach(), values[n]), n


def test_step_hooks_fire_once_per_step_in_torchs_order(name: str) -> None:
    """Catches: a ``step`` that bypasses torch.optim's hook wrapper (a subclass overriding it
    undecorated), so the global and per-optimizer step hooks, and the state-dict hooks that
    checkpointing libraries register, stop firing or fire twice."""
    params, opt = make(name)
    calls: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(
            lambda o, a, k: calls.append("global pre") if o is opt else None
        ),
        opt.register_step_pre_hook(lambda o, a, k: calls.append(f"pre {len(a)} {a[0] is o}")),
        opt.register_step_post_hook(lambda o, a, k: calls.append("post")),
        register_optimizer_step_post_hook(
            lambda o, a, k: calls.append("global post") if o is opt else None
        ),
        opt.register_state_dict_post_hook(lambda o, sd: calls.append("state_dict") or sd),
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_state_dict")),
    ]
    try:
        train(params, opt, gradients(steps=2))
        opt.load_state_dict(opt.state_dict())
    finally:
        for handle in handles:
            handle.remove()
    step = ["global pre", "pre 1 True", "post", "global post"]  # args: (optimizer,)
    assert calls == [*step, *step, "state_dict", "load_state_dict"]


def test_grad_scaler_skips_an_overflowing_step_and_unscales_the_others(name: str) -> None:
    """Catches: ``torch.amp.GradScaler`` stepping on an inf gradient (parameters or state
    changed), or its unscaled gradients not being what the step reads: with the scaler the
    steps equal those of the same optimizer given the unscaled gradients."""
    grads = gradients(steps=3)
    params, opt = make(name)
    ref_params, ref = make(name)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for i, g in enumerate(grads):
        scaler.scale(torch.ones(()))  # what scaling the loss does to the scaler
        for n, p in params.items():
            p.grad = g[n] * scaler.get_scale()
        if i == 1:
            params["square"].grad[0, 0] = float("inf")
        before = (snapshot(params), copy.deepcopy(opt.state_dict()))
        scaler.step(opt)
        scaler.update()
        if i == 1:
            assert_params_equal(params, before[0])
            assert_state_dicts_equal(opt.state_dict(), before[1])
            assert scaler.get_scale() == 512.0
            continue
        set_grads(ref_params, g)
        ref.step()
        assert_params_equal(params, snapshot(ref_params))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_owner_held_placeholders_carry_their_states_dtype(name: str, dtype: torch.dtype) -> None:
    """Catches: ``optimizer.state`` listing owner-held keys as empty tensors of the default
    dtype while ``state_dict()`` holds them in another (a float64 parameter's float64
    factors): tools that read dtypes from ``optimizer.state`` were misled."""
    values = {n: v.to(dtype) for n, v in initial().items()}
    params, opt = make(name, values)
    train(params, opt, [{n: g.to(dtype) for n, g in grads.items()} for grads in gradients(steps=1)])
    saved = opt.state_dict()["state"]
    ids = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    checked = 0
    for p, entry in opt.state.items():
        for key, value in entry.items():
            if value.numel() == 0 and key != "step":
                assert value.dtype == saved[ids[id(p)]][key].dtype, (key, value.dtype)
                checked += 1
    assert (checked > 0) == (name != "muon")  # Muon keeps no owner-held state


def test_parameters_that_start_later_are_stepped_by_their_own_counts(name: str) -> None:
    """Catches: one step count taken for a batch of same-shape matrices (SOAP skipped the
    whole batch on its first one's first step, or bias-corrected the others by its count),
    and for an AdamW group (every parameter bias-corrected by the first one's count): a
    matrix and a bias that get their first gradient a step late must step as they would
    in an optimizer of their own, bitwise."""
    shapes = {"a": (6, 6), "b": (6, 6), "bias": (5,), "late_bias": (5,)}
    values, grads = initial(shapes), gradients(shapes, steps=4)
    late = ("b", "late_bias")
    together, opt = make(name, values)
    apart = {n: make(name, {n: values[n]}) for n in shapes}
    for i, step in enumerate(grads):
        set_grads(together, step)
        for n in late:
            together[n].grad = None if i == 0 else together[n].grad
        opt.step()
        for n, (params, alone) in apart.items():
            if i == 0 and n in late:
                continue
            set_grads(params, {n: step[n]})
            alone.step()
    for n, (params, _) in apart.items():
        assert torch.equal(together[n].detach(), params[n].detach()), n


def test_loaded_owner_held_state_takes_the_optimizers_dtype(name: str) -> None:
    """Catches: owner-held state (Shampoo's and SOAP's factors, NorMuon's second moments)
    kept in a loaded state dict's dtype (a float64 checkpoint into a float32 model: twice
    the memory and float64 arithmetic, while ``state_dict()`` still showed float32), where
    torch.optim casts floating state to the parameter's: the steps after loading a float64
    copy of a state dict equal those after loading the state dict itself, bitwise."""
    grads = gradients(steps=5)
    params, opt = make(name)
    train(params, opt, grads[:3])
    saved = opt.state_dict()
    widened = copy.deepcopy(saved)
    for entry in widened["state"].values():
        for key, value in entry.items():
            if key != "step" and value.is_floating_point():
                entry[key] = value.double()
    runs = []
    for sd in (saved, widened):
        again, fresh = make(name, snapshot(params))
        fresh.load_state_dict(copy.deepcopy(sd))
        train(again, fresh, grads[3:])
        runs.append(snapshot(again))
    assert_params_equal(parameters(runs[1]), runs[0])


def test_a_compiled_training_step_steps_like_an_eager_one(name: str) -> None:
    """``torch.compile`` of a function that calls ``step()`` (as a compiled training step
    does): the optimizer step runs eagerly and gives the eager step's parameters and state.
    Catches: the step traced by the compiler (it mis-traced the step table's cache and
    every compiled step failed)."""
    grads = gradients(steps=3)
    params, opt = make(name)
    train(params, opt, grads)
    params2, opt2 = make(name)

    @torch.compile(backend="eager")
    def step() -> None:
        opt2.step()

    for g in grads:
        set_grads(params2, g)
        step()
    assert_params_equal(params2, snapshot(params))
    assert_state_dicts_equal(opt2.state_dict(), opt.state_dict())
