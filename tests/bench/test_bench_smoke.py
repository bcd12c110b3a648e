"""Smoke tests of the benchmark scripts: tiny sizes, results in a temporary directory.

They check that each script runs end to end, that its report has the expected structure and
that every owner strategy ends with the same parameters. No timing is asserted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

pytest.importorskip("torch")

STRATEGIES = ("replicated", "round_robin", "count", "numel", "canzona", "canzona_no_overlap")


def _section(doc: Path, name: str) -> str:
    text = doc.read_text()
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    assert begin in text and end in text
    return text[text.index(begin) : text.index(end)]


def _check_case(case: dict, peers: tuple[str, ...] = ()) -> None:
    runs = case["runs"]
    assert set(STRATEGIES) <= set(runs)
    for label in STRATEGIES:
        run = runs[label]
        assert run["identical"] is True, (case["case"], label)
        assert run["step_s"] > 0
        world = case["world"]
        for key in ("compute_cpu_s", "compute_s", "bytes_sent", "bytes_received", "collectives"):
            assert len(run[key]) == world, key
        assert run["redundancy"] > 0 and run["balance"] >= 1.0
    assert runs["replicated"]["vs_replicated"] == pytest.approx(1.0)
    assert case["single_device"]["matches_distributed"] is True
    for peer in peers:
        assert "step_s" in runs[peer] or "error" in runs[peer]


def test_step_latency_tiny(tmp_path: Path) -> None:
    import step_latency

    doc = tmp_path / "benchmarks.md"
    payload = step_latency.main(
        [
            "--tiny",
            "--world",
            "2",
            "--optimizer",
            "muon",
            "--peers",
            "full_tensor",
            "--out",
            str(tmp_path),
            "--doc",
            str(doc),
            "--chart",
            str(tmp_path / "c.png"),
        ]
    )
    saved = json.loads((tmp_path / "step_latency_tiny.json").read_text())
    assert saved["machine"]["torch"]
    assert {c["case"] for c in saved["cases"]} == {"muon/qwen/fsdp/w2", "muon/hetero/fsdp/w2"}
    for case in payload["cases"]:
        _check_case(case, ("full_tensor",) if case["model"] == "qwen" else ())
    assert payload["cases"][0]["runs"]["full_tensor"]["identical"] is True
    assert {t["name"] for t in payload["targets"]}
    section = _section(doc, "step_latency")
    assert "### Targets" in section and "replicated" in section


def test_step_latency_tiny_fsdp_tp_shampoo(tmp_path: Path) -> None:
    import step_latency

    payload = step_latency.main(
        [
            "--tiny",
            "--world",
            "4",
            "--mesh",
            "fsdp_tp",
            "fsdp",
            "--model",
            "qwen",
            "small",
            "--optimizer",
            "muon",
            "shampoo",
            "--peers",
            "",
            "--out",
            str(tmp_path),
            "--doc",
            str(tmp_path / "b.md"),
            "--chart",
            str(tmp_path / "c.png"),
        ]
    )
    keys = {c["case"] for c in payload["cases"]}
    assert keys == {"muon/qwen/fsdp/w4", "muon/qwen/fsdp_tp/w4", "shampoo/small/fsdp/w4"}
    for case in payload["cases"]:
        _check_case(case)


def test_train_step_tiny(tmp_path: Path) -> None:
    import train_step

    doc = tmp_path / "benchmarks.md"
    payload = train_step.main(["--tiny", "--out", str(tmp_path), "--doc", str(doc)])
    results = payload["results"]
    assert set(results) == {"canzona", "replicated", "adamw"}
    for r in results.values():
        assert r["iteration_s"] > 0 and 0 < r["step_share"] < 1
    assert results["canzona"]["same_parameters_as_replicated"] is True
    assert results["canzona"]["losses"] == results["replicated"]["losses"]
    assert (tmp_path / "train_step_tiny.json").exists()
    assert "forward + backward" in _section(doc, "train_step")


def test_kernels_tiny(tmp_path: Path) -> None:
    import kernels

    doc = tmp_path / "benchmarks.md"
    payload = kernels.main(
        [
            "--models",
            "qwen3-0.6b",
            "--scale",
            "32",
            "--batch",
            "2",
            "--repeats",
            "1",
            "--out-dir",
            str(tmp_path),
            "--doc",
            str(doc),
        ]
    )
    assert payload["results"] and (tmp_path / "kernels.json").exists()
    assert _section(doc, "kernels")


def test_plan_quality_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plan_quality

    import _report

    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(plan_quality, "PLOT_PATH", tmp_path / "plot.png")
    assert plan_quality.main(["--quick", "--no-docs"]) == 0
    saved = json.loads((tmp_path / "plan_quality_quick.json").read_text())
    assert saved["summary"]["all"]["canzona"]["mean_makespan_ratio"] >= 1.0


def test_run_all_knows_every_script() -> None:
    import run_all

    for name in run_all.SCRIPTS:
        assert (BENCH / f"{name}.py").exists()
