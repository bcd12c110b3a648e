"""benchmarks/device_plans.py: plans priced in a device table's seconds, not in FLOPs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from canzona.plan import MatrixSpec, MuonCost
from canzona.plan.measured import MeasuredCost, save_cost_table
from canzona.plan.models import model_specs

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import device_plans  # noqa: E402


def _table(path: Path, slow: float, stacks: list[list[int]] | None = None) -> None:
    """Qwen3-0.6B's per-head shapes ``slow`` times dearer per FLOP than its MLP shapes."""
    base = MuonCost()
    shapes = sorted({(s.m, s.n) for s in model_specs("qwen3-0.6b", split="heads")})
    rate = 1e-12  # seconds per FLOP
    table = []
    for m, n in shapes:
        factor = slow if min(m, n) <= 128 else 1.0
        table.append(((m, n), factor * rate * base.flops(MatrixSpec("x", (m, n)))))
    cost = MeasuredCost(base=base, table=tuple(table))
    meta = {"device": "test", "torch": "x", "ns_dtype": "bfloat16", "stacks": stacks or []}
    save_cost_table(path, cost, meta)


def test_device_plans_price_every_plan_in_the_table_seconds(tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    tables.mkdir()
    _table(tables / "qwen3-0.6b__heads__w8.json", slow=4.0, stacks=[[128, 1024, 8]])
    _table(tables / "qwen3-0.6b__heads__w64.json", slow=1.0)
    doc = tmp_path / "doc.md"
    assert (
        device_plans.main(["--tables", str(tables), "--out", str(tmp_path), "--doc", str(doc)]) == 0
    )
    payload = json.loads((tmp_path / "device_plans.json").read_text())
    (case,) = payload["cases"]
    assert (case["model"], case["split"], case["matrices"]) == ("qwen3-0.6b", "heads", 1428)
    eight, sixty_four = case["worlds"]  # each world planned with its own table
    assert (eight["world"], sixty_four["world"]) == (8, 64)
    rel = {tuple(r["shape"]): r["relative"] for r in eight["shapes"]}
    assert rel[(128, 1024)] == pytest.approx(4.0) and rel[(3072, 1024)] == pytest.approx(1.0)
    assert [r["relative"] for r in sixty_four["shapes"]] == pytest.approx([1.0] * 4)
    rows = eight["strategies"]
    assert rows["canzona (measured)"]["vs_measured"] == 1.0
    # the FLOP plan balances FLOPs, which the table prices unevenly: dearer in seconds
    assert rows["canzona (FLOPs)"]["makespan_ratio_flops"] < 1.01
    assert rows["canzona (FLOPs)"]["vs_measured"] > 1.05
    assert rows["canzona (measured)"]["makespan_ratio_s"] < 1.01
    text = doc.read_text()
    assert "### qwen3-0.6b, split heads (1428 matrices; test" in text
    assert "128×1024 (stack 8) 4.00" in text.split("- world 8: ")[1].split("\n")[0]


def test_a_table_name_without_model_and_split_is_refused(tmp_path: Path) -> None:
    for name in ("qwen3-32b.json", "qwen3-32b__heads.json", "qwen3-32b__heads__64.json"):
        with pytest.raises(ValueError, match=f"got '{name}'"):
            device_plans.table_case(tmp_path / name)
    assert device_plans.table_case(tmp_path / "a__qkv__w64.json") == ("a", "qkv", 64)
    with pytest.raises(SystemExit, match="no cost tables"):
        device_plans.main(["--tables", str(tmp_path), "--no-docs"])


def test_longer_stacks_of_the_gpu_check_give_the_tables_pieces(tmp_path: Path) -> None:
    """Catches: the GPU check's 64-block stacks ignored (tables priced as one call however
    long the stack), or pieces given where one call predicts the longer stack better."""
    check = tmp_path / "gpu_check.json"
    heads = [
        {"shape": "head (128x1024)", "batch": 8, "canzona": 0.4e-3},
        {"shape": "head (128x1024)", "batch": 64, "canzona": 2.7e-3},
        {"shape": "o head (1024x128)", "batch": 64, "canzona": 1.0e-3},
    ]
    check.write_text(json.dumps({"commit": "abc1234", "heads": heads}))
    timed = device_plans.long_stacks(check)
    assert timed == {(128, 1024): {8: 0.4e-3, 64: 2.7e-3}, (1024, 128): {64: 1.0e-3}}
    assert device_plans.long_stacks(tmp_path / "missing.json") == {}
    table = MeasuredCost(
        base=MuonCost(),
        table=(((128, 1024), 0.05e-3), ((1024, 128), 0.05e-3)),
        batches=(((128, 1024), 0.35e-3, 0.01e-3), ((1024, 128), 0.35e-3, 0.01e-3)),
    )
    stacks = {(128, 1024): 8, (1024, 128): 8}
    priced, evidence = device_plans.with_pieces(table, stacks, timed)
    assert priced.piece_size(128, 1024) == 8  # 2.7 ms: nearer 8 pieces (3.4) than one call
    assert priced.piece_size(1024, 128) is None  # 1.0 ms: one call (0.99 ms)
    assert [e["piece_size"] for e in evidence] == [8, None]
    assert evidence[0]["pieces_s"] == pytest.approx(8 * 0.35e-3 + 64 * 0.01e-3)
    # no stack longer than the table's (or no table stack): nothing decided
    same, none = device_plans.with_pieces(table, {(128, 1024): 64}, timed)
    assert none == [] and same.pieces == ()
