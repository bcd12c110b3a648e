"""Param-group values in state dicts: DCP-safe forms, and groups that must match at load."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import canzona
from canzona.optim.group_values import loaded_value, saved_value


@pytest.mark.parametrize(
    "value",
    [
        torch.bfloat16,
        torch.float64,
        canzona.Split(dim=0, sizes=(4, 4, 8)),
        canzona.Split(dim=1, size=16),
        "original",
        (3.4445, -4.775, 2.0315),
        None,
        0.02,
    ],
)
def test_group_values_round_trip(value: Any) -> None:
    """Catches: a value ``state_dict()`` writes that does not read back as itself."""
    saved = saved_value(value)
    assert not isinstance(saved, torch.dtype | canzona.Split)
    assert loaded_value(saved) == value
    assert loaded_value(value) == value  # checkpoints written with the objects still load


def test_a_saved_split_is_one_leaf_and_earlier_tuples_still_load() -> None:
    """Catches: a split saved as a tuple whose structure depends on how the blocks were
    declared (a consolidated load copies leaf by leaf and cannot match them), and the
    tagged tuples of earlier checkpoints (DCP may hand them back as lists) no longer read."""
    for split in (canzona.Split(dim=0, size=4), canzona.Split(dim=0, sizes=(4, 4, 4))):
        saved = saved_value(split)
        assert isinstance(saved, str) and saved.startswith("canzona.Split {")
        assert loaded_value(saved) == split
    old = ["canzona.Split", 0, [4, 12], None]
    assert loaded_value(old) == canzona.Split(dim=0, sizes=(4, 12))
    assert loaded_value(tuple(old)) == canzona.Split(dim=0, sizes=(4, 12))
    assert loaded_value("torch.not_a_dtype") == "torch.not_a_dtype"
    assert loaded_value(["a", 1, 2, 3]) == ["a", 1, 2, 3]
    with pytest.raises(ValueError, match="a saved split must be"):
        loaded_value('canzona.Split {"dim": 0}')


def _trained(split: canzona.Split | None, flatten: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    qkv = nn.Parameter(torch.randn(12, 8) if not flatten else torch.randn(12, 2, 4))
    group: dict[str, Any] = {"params": [("qkv", qkv)], "flatten": flatten}
    if split is not None:
        group["split"] = split
    opt = canzona.Shampoo([group], lr=0.01, precondition_frequency=1)
    qkv.grad = torch.randn_like(qkv)
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize(
    ("saved", "mine", "detail"),
    [
        (canzona.Split(dim=0, size=4), None, "split Split(dim=0, sizes=None, size=4)"),
        (None, canzona.Split(dim=0, size=4), "split None does not match"),
        (canzona.Split(dim=0, size=4), canzona.Split(dim=0, size=6), "size=6"),
    ],
)
def test_a_state_dict_of_other_blocks_is_refused(
    saved: canzona.Split | None, mine: canzona.Split | None, detail: str
) -> None:
    """Catches: a checkpoint saved with another ``split`` accepted (its per-block state
    matched the template's keys) and its owner-held state silently dropped."""
    sd = _trained(saved)
    torch.manual_seed(1)
    p = nn.Parameter(torch.randn(12, 8))
    group: dict[str, Any] = {"params": [("qkv", p)]}
    if mine is not None:
        group["split"] = mine
    opt = canzona.Shampoo([group], lr=0.01, precondition_frequency=1)
    with pytest.raises(ValueError, match="param group 0: state dict split") as info:
        opt.load_state_dict(sd)
    assert detail in str(info.value)
    assert opt.state_dict()["state"] == {}


def test_a_split_declared_otherwise_into_the_same_blocks_loads() -> None:
    """Catches: ``Split(0, sizes=(4, 4, 4))`` refused for a checkpoint saved with
    ``Split(0, size=4)`` (the same three blocks of 12 rows, the same per-block state)."""
    sd = _trained(canzona.Split(dim=0, size=4))
    saved_state = sd["state"][0]
    p = nn.Parameter(torch.randn(12, 8))
    group = {"params": [("qkv", p)], "split": canzona.Split(dim=0, sizes=(4, 4, 4))}
    opt = canzona.Shampoo([group], lr=0.01, precondition_frequency=1)
    opt.load_state_dict(sd)
    loaded = opt.state_dict()["state"][0]
    assert sorted(loaded) == sorted(saved_state)
    for key, value in saved_state.items():
        assert torch.equal(loaded[key], value), key
    with pytest.raises(ValueError, match="sizes=\\(4, 8\\)"):  # other blocks: refused
        other = {"params": [("qkv", p)], "split": canzona.Split(dim=0, sizes=(4, 8))}
        canzona.Shampoo([other], lr=0.01, precondition_frequency=1).load_state_dict(sd)


def test_a_state_dict_of_a_flattened_weight_needs_flatten() -> None:
    """Catches: a (12, 2, 4) weight's state as one (12, 8) matrix loaded for a stack of 12."""
    sd = _trained(None, flatten=True)
    p = nn.Parameter(torch.randn(12, 2, 4))
    opt = canzona.Shampoo([{"params": [("qkv", p)]}], lr=0.01)
    with pytest.raises(ValueError, match="state dict flatten True does not match"):
        opt.load_state_dict(sd)


def test_each_blocks_state_is_saved_under_its_own_index() -> None:
    """Catches: block ``j``'s owner-held state saved under another block's key (the round
    trip within one version still matches, so only the meaning changes: a checkpoint of
    another version, or a tool reading ``factor_left#0`` as block 0, gets the wrong head's
    preconditioners). Compared with Shampoo on the blocks as separate parameters."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(8, 6, generator=gen)
    grads = [torch.randn(8, 6, generator=gen) for _ in range(3)]
    p = nn.Parameter(start.clone())
    opt = canzona.Shampoo([{"params": [p], "split": canzona.Split(dim=0, size=4)}], lr=0.01)
    blocks = [nn.Parameter(start[4 * i : 4 * i + 4].clone()) for i in range(2)]
    ref = canzona.Shampoo([{"params": blocks}], lr=0.01)
    for g in grads:
        p.grad = g.clone()
        for i, b in enumerate(blocks):
            b.grad = g[4 * i : 4 * i + 4].clone()
        opt.step()
        ref.step()
    saved, separate = opt.state_dict()["state"][0], ref.state_dict()["state"]
    compared = 0
    for j in range(2):
        for key, value in separate[j].items():
            if key != "step":
                assert torch.equal(saved[f"{key}#{j}"], value), (key, j)
                compared += 1
    assert compared >= 2 * 4  # factors, roots and moments of both blocks
