"""The ``canzona demo`` job (placeholder until the training demo lands: prints a plan report)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the demo; for now, the planner report for an embedded Qwen3 model."""
    from canzona import cli

    return cli.main(["plan", "--model", "qwen3-8b", "--world", "64", *(argv or [])])
