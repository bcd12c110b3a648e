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
