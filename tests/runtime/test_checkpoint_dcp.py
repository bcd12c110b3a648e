"""torch.distributed.checkpoint round trips: bit-exact on the same mesh and on other meshes."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import canzona

from _cases import full_of, set_grads, three_linears

TIMEOUT = 120
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "muon": ("Muon", {"lr": 0.02}),
    "normuon": ("NorMuon", {"lr": 0.02, "beta2": 0.9}),  # per-row second moment: owner-held
    "shampoo": (
        "Shampoo",
        {"lr": 0.01, "precondition_frequency": 2, "start_preconditioning_step": 2},
    ),
    "soap": ("SOAP", {"lr": 0.01, "precondition_frequency": 2}),
}


def _model(layout: str) -> nn.Module:
    return three_linears(layout, 12, 20, 7)


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    shapes = {"up.weight": (20, 12), "down.weight": (12, 20), "down.bias": (12,)}
    shapes["head.weight"] = (7, 12)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    cls, kw = OPTIMIZERS[name]
    return getattr(canzona, cls)(canzona.param_groups(model), **kw)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    params = list(model.named_parameters())
    for step in steps:
        set_grads(params, _grads(step))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _fulls(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full_of(p) for n, p in model.named_parameters()}


def _state_fulls(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for pid, entry in opt.state_dict()["state"].items():
        for key, value in entry.items():
            out[f"{pid}.{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return out


def _options(flat: bool) -> StateDictOptions:
    """TorchTitan saves flattened optimizer state dicts; both forms must round trip."""
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _save(
    layout: str, name: str, steps: int, path: str, flat: bool = False
) -> dict[str, torch.Tensor]:
    model = _model(layout)
    opt = _optimizer(model, name)
    _train(model, opt, range(steps))
    model_sd, optim_sd = get_state_dict(model, opt, options=_options(flat))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return _fulls(model)


def _load_and_continue(
    layout: str, name: str, start: int, stop: int, path: str, flat: bool = False
) -> dict[str, Any]:
    model = _model(layout)
    opt = _optimizer(model, name)
    before = _fulls(model)
    # builds the optimizer state with one lr=0 step
    model_sd, optim_sd = get_state_dict(model, opt, options=_options(flat))
    after_init = _fulls(model)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(
        model,
        opt,
        model_state_dict=sd["model"],
        optim_state_dict=sd["optim"],
        options=_options(flat),
    )
    _train(model, opt, range(start, stop))
    unchanged = all(torch.equal(before[n], after_init[n]) for n in before)
    return {"params": _fulls(model), "state": _state_fulls(opt), "init_unchanged": unchanged}


def _uninterrupted(layout: str, name: str, stop: int) -> dict[str, Any]:
    model = _model(layout)
    opt = _optimizer(model, name)
    _train(model, opt, range(stop))
    return {"params": _fulls(model), "state": _state_fulls(opt)}


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flattened"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_mesh_resume_is_bit_exact(dist: Any, tmp_path: Path, name: str, flat: bool) -> None:
    """Catches: state missing from the checkpoint (owner-held factors, step counters), the
    lr=0 step that builds the template moving a parameter, state loaded into the wrong rows."""
    pool = dist(4)
    path = str(tmp_path / "ckpt")
    pool.run(_save, "fsdp_tp", name, 3, path, flat, timeout=TIMEOUT)
    resumed = pool.run(_load_and_continue, "fsdp_tp", name, 3, 6, path, flat, timeout=TIMEOUT)[0]
    straight = pool.run(_uninterrupted, "fsdp_tp", name, 6, timeout=TIMEOUT)[0]
    assert resumed["init_unchanged"]
    for key in ("params", "state"):
        assert resumed[key].keys() == straight[key].keys()
        for n, want in straight[key].items():
            assert torch.equal(resumed[key][n], want), f"{name}: {key} {n} differs"


def _consolidated_round_trip(name: str, broadcast: bool) -> dict[str, Any]:
    """A consolidated, CPU-offloaded state dict (``full_state_dict``, ``cpu_offload``) of an
    optimizer with a split group, loaded into a fresh one; both train on, against a run
    without the round trip.

    With ``broadcast`` only rank 0 holds the state dicts it loads (the offloaded ones,
    empty elsewhere), with ``broadcast_from_rank0`` (model and optimizer loaded apart:
    ``set_state_dict`` takes an empty model state dict for "optimizer only"). The fresh
    optimizer declares the same blocks otherwise (``sizes=`` for ``size=``)."""
    cls, kw = OPTIMIZERS[name]
    split = {"up.weight": canzona.Split(dim=0, size=5)}
    spelled = {"up.weight": canzona.Split(dim=0, sizes=(5, 5, 5, 5))}

    def build(
        split: dict[str, canzona.Split] = split,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model("fsdp_tp")
        return model, getattr(canzona, cls)(canzona.param_groups(model, split=split), **kw)

    model, opt = build()
    _train(model, opt, range(3))
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    offloaded = get_state_dict(model, opt, options=offload)[1]
    groups = offloaded.get("param_groups", [])  # rank 0 only
    kinds = sorted({type(v).__name__ for g in groups for k, v in g.items() if k != "params"})
    full = StateDictOptions(full_state_dict=True)  # every rank holds it
    # a copy: loaded in the process that saved it, the state dict's tensors (step counters)
    # would be shared with the original optimizer's, as in torch.optim
    model_sd, optim_sd = copy.deepcopy(get_state_dict(model, opt, options=full))
    resumed, resumed_opt = build(spelled)
    if broadcast:
        from_rank0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        model_sd, optim_sd = copy.deepcopy(get_state_dict(model, opt, options=offload))
        assert bool(optim_sd) == (tdist.get_rank() == 0)
        set_model_state_dict(resumed, model_sd, options=from_rank0)
        set_optimizer_state_dict(resumed, resumed_opt, optim_sd, options=from_rank0)
    else:
        set_state_dict(
            resumed, resumed_opt, model_state_dict=model_sd, optim_state_dict=optim_sd, options=full
        )
    for m, o in ((model, opt), (resumed, resumed_opt)):
        _train(m, o, range(3, 5))
    # gathered once, on every rank alike (collectives), before any comparison stops early
    got, want = _fulls(resumed), _fulls(model)
    got_state, want_state = _state_fulls(resumed_opt), _state_fulls(opt)
    return {
        "kinds": kinds,
        "split": resumed_opt.param_groups[1]["split"] == split["up.weight"],
        "params": got.keys() == want.keys()
        and all(torch.equal(v, want[n]) for n, v in got.items()),
        "state": got_state.keys() == want_state.keys()
        and all(torch.equal(v, want_state[k]) for k, v in got_state.items()),
    }


@pytest.mark.parametrize(
    ("name", "broadcast"),
    # every optimizer from rank 0; every rank's copy for all but Shampoo, whose owner-held
    # state (factors, roots, grafting moments) takes the path SOAP's does (a 7 s case)
    [(name, True) for name in sorted(OPTIMIZERS)]
    + [(name, False) for name in sorted(OPTIMIZERS) if name != "shampoo"],
    ids=lambda v: {True: "from-rank0", False: "every-rank"}.get(v, v),
)
def test_a_consolidated_offloaded_state_dict_round_trips(
    dist: Any, name: str, broadcast: bool
) -> None:
    """Catches: param-group values DCP's consolidation and offload refuse (``ns_dtype`` and
    ``root_dtype`` as torch.dtype objects, ``split`` as a Split raised "Unexpected value
    type"), values not read back as what they were (the split group losing its blocks), and
    a rank-0-only state dict broadcast into owner-held state in the wrong places, and a
    split saved as a tuple whose structure differs between declarations of the same blocks
    (the consolidated load copies leaf by leaf: ``KeyError: 'param_groups.1.split.2'``)."""
    outs = dist(4).run(_consolidated_round_trip, name, broadcast, timeout=TIMEOUT)
    assert set(outs[0]["kinds"]) <= {"bool", "float", "int", "str", "tuple", "list", "NoneType"}
    assert "str" in outs[0]["kinds"]  # the learning-rate adjustment's name, and dtypes
    for out in outs:
        assert out == {**out, "split": True, "params": True, "state": True}, out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_on_other_meshes(dist: Any, tmp_path: Path, name: str) -> None:
    """Save on (2, 2) FSDPxTP at world 4; resume on (2,) FSDP and on one process; and back.

    Every continued run equals an uninterrupted one-process run, bit for bit. Catches: state
    that DCP collapses to one rank's copy (state stored as plain per-rank tensors), owner-held
    state resharded to the wrong rows or matrices, a plan kept from the saving mesh."""
    want = dist(1).run(_uninterrupted, "plain", name, 6, timeout=TIMEOUT)[0]["params"]
    path4 = str(tmp_path / "from4")
    dist(4).run(_save, "fsdp_tp", name, 3, path4, timeout=TIMEOUT)
    on2 = dist(2).run(_load_and_continue, "fsdp", name, 3, 6, path4, timeout=TIMEOUT)[0]
    on1 = dist(1).run(_load_and_continue, "plain", name, 3, 6, path4, timeout=TIMEOUT)[0]
    path2 = str(tmp_path / "from2")
    dist(2).run(_save, "fsdp", name, 3, path2, timeout=TIMEOUT)
    on4 = dist(4).run(_load_and_continue, "fsdp_tp", name, 3, 6, path2, timeout=TIMEOUT)[0]
    for label, got in (("4->2", on2), ("4->1", on1), ("2->4", on4)):
        assert got["init_unchanged"]
        assert got["params"].keys() == want.keys()
        differ = sorted(n for n in want if not torch.equal(got["params"][n], want[n]))
        assert not differ, f"{name} {label}: not bitwise equal to one process: {differ}"


_GROUPS: dict[int, tdist.ProcessGroup] = {}


def _checkpoint_group() -> tdist.ProcessGroup:
    """A gloo group of its own for the checkpoint's collectives, one per worker process."""
    if os.getpid() not in _GROUPS:
        _GROUPS.clear()
        _GROUPS[os.getpid()] = tdist.new_group(backend="gloo")
    return _GROUPS[os.getpid()]


def _async_save_while_stepping(name: str, path: str) -> bool:
    """Save with ``dcp.async_save`` and step on while it writes; resume from what it wrote."""
    group = _checkpoint_group()
    model = _model("fsdp")
    opt = _optimizer(model, name)
    _train(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    saving = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                            process_group=group)  # fmt: skip
    _train(model, opt, range(3, 6))  # its collectives run while the save's do
    saving.result()
    resumed = _load_and_continue("fsdp", name, 3, 6, path)["params"]
    return all(torch.equal(a, resumed[n]) for n, a in _fulls(model).items())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_async_save_on_its_own_group_resumes_exactly(
    dist: Any, tmp_path: Path, name: str
) -> None:
    """``dcp.async_save`` on a process group of its own (as TorchTitan's async checkpoints
    run), the optimizer stepping on while it writes: the checkpoint holds the state of the
    moment it was taken, and a run resumed from it equals the one that went on, bit for bit.
    Pins the pattern docs/checkpointing.md gives. Catches: what ``state_dict()`` hands over
    that the save's stager does not copy (it copies tensors and leaves other objects shared),
    and steps that cannot run while the save's collectives are in flight."""
    assert dist(2).run(_async_save_while_stepping, name, str(tmp_path / "ck")) == [True] * 2


def _state_keys_identical(name: str) -> list[list[str]]:
    model = _model("fsdp_tp")
    opt = _optimizer(model, name)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    keys = sorted(f"{pid}.{k}" for pid, e in sd["state"].items() for k in e)
    kinds = sorted(
        f"{pid}.{k}:{'dtensor' if isinstance(v, DTensor) else 'tensor'}"
        for pid, e in sd["state"].items()
        for k, v in e.items()
    )
    return [keys, kinds]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_state_keys_and_kinds_identical_on_every_rank(dist: Any, name: str) -> None:
    """Catches: owner-held state listed only on its owner (DCP needs the same keys on every
    rank), and state that differs per rank stored as a plain tensor (DCP would keep one
    rank's copy)."""
    out = dist(4).run(_state_keys_identical, name, timeout=TIMEOUT)
    assert all(o == out[0] for o in out)
    for entry in out[0][1]:
        if not entry.endswith(".step:tensor"):
            assert entry.endswith(":dtensor"), entry


def _bad_load(kind: str) -> dict[str, Any]:
    model = _model("fsdp")
    opt = _optimizer(model, "shampoo")
    _train(model, opt, range(2))
    before = _state_fulls(opt)
    sd = copy.copy(opt.state_dict())
    sd["state"] = {k: dict(v) for k, v in sd["state"].items()}
    rank = tdist.get_rank()
    if kind == "missing_key" and rank == 1:
        del sd["state"][0]["factor_left"]
    elif kind == "extra_key":
        sd["state"][0]["bogus"] = torch.zeros(1)
    elif kind == "other_optimizer":
        sd = torch.optim.AdamW(model.parameters()).state_dict()
    elif kind == "no_state_on_one" and rank == 1:  # a dict saved before the first step
        sd["state"] = {}
    elif kind == "entry_dropped_on_one" and rank == 1:
        del sd["state"][0]
    elif kind == "step_on_one" and rank == 1:
        sd["state"][0]["step"] = sd["state"][0]["step"] + 1
    elif kind == "other_mesh":  # the same ranks, another mesh: rank 1's dict only
        other = init_device_mesh("cpu", (tdist.get_world_size(),), mesh_dim_names=("other",))
        if rank == 1:
            key, v = next((k, v) for k, v in sd["state"][0].items() if isinstance(v, DTensor))
            sd["state"][0][key] = DTensor.from_local(v.to_local(), other, v.placements)
    try:
        opt.load_state_dict(sd)
        outcome = ("ok", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    after = _state_fulls(opt)
    unchanged = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before
    )
    return {"outcome": outcome, "unchanged": unchanged}


DIFFERENT_ON_ONE = {
    "no_state_on_one": "no state on ranks [1]",
    "entry_dropped_on_one": "no state on ranks [1]",
    "step_on_one": "step 3.0 on ranks [1]",
}


@pytest.mark.parametrize(
    "kind", ["missing_key", "extra_key", "other_optimizer", "other_mesh", *DIFFERENT_ON_ONE]
)
def test_bad_state_dict_raises_everywhere_and_changes_nothing(dist: Any, kind: str) -> None:
    """Catches: a rank that loads its good dict while another rank's is bad (the ranks would
    then disagree), a partial load before the error, and an error without the key's name.
    A dict valid on its own but unlike the other ranks' (no state, a parameter's entry
    dropped, another step) loaded on one rank: before, the ranks with owner-held state to
    place waited in its exchange for the rank that skipped it (a hang until the process
    group's timeout), and without such state the ranks went on stepping from different
    states."""
    out = dist(4).run(_bad_load, kind, timeout=TIMEOUT)
    for rank, o in enumerate(out):
        assert o["unchanged"], (rank, o)
        assert o["outcome"][0] == "ValueError", (rank, o)
    if kind in DIFFERENT_ON_ONE:  # every rank sees every rank's steps: the same message
        assert all(o["outcome"][1] == out[0]["outcome"][1] for o in out), out
        assert (
            "the ranks loaded different state ('up.weight': step 2.0 on ranks [0, 2, 3], "
            + (DIFFERENT_ON_ONE[kind])
            in out[0]["outcome"][1]
        ), out[0]
    if kind in ("missing_key", "other_mesh"):  # only rank 1's dict is bad: it names the key,
        named = "'factor_left'" if kind == "missing_key" else "of parameter 'up.weight': state on"
        assert named in out[1]["outcome"][1]
        for o in out[:1] + out[2:]:  # the others the rank
            assert "failed on ranks [1]" in o["outcome"][1]
