"""Step-latency chart: owner compute per rank and strategy, one panel per case."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _latency_report import STRATEGIES


def draw_chart(cases: list[dict[str, Any]], path: Path) -> Path | None:
    """Write the chart to ``path``; None without matplotlib or a case to show."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shown = [c for c in cases if c["optimizer"] == "muon" and c["mesh"] == "fsdp"]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 3.6), squeeze=False)
    for ax, c in zip(axes[0], shown, strict=True):
        labels = [s for s in STRATEGIES if "compute_cpu_s" in c["runs"].get(s, {})]
        world = c["world"]
        width = 0.8 / world
        for r in range(world):
            ax.bar(
                [i + r * width for i in range(len(labels))],
                [c["runs"][s]["compute_cpu_s"][r] * 1e3 for s in labels],
                width,
                label=f"rank {r}",
            )
        ideal = c["single_device"]["compute_cpu_s"] * 1e3 / world
        ax.axhline(ideal, color="black", lw=0.8, ls="--", label="single device / W")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels(
            [s.replace("_no_overlap", "\nno overlap").replace("_", " ") for s in labels],
            rotation=45,
            ha="right",
            fontsize=7,
        )
        ax.set_title(f"{c['model_name']}, world {world}", fontsize=9)
        ax.set_ylabel("compute per rank (CPU ms)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    widest = max(range(len(shown)), key=lambda i: shown[i]["world"])
    axes[0][widest].legend(fontsize=6)
    fig.suptitle("Muon step: owner-side compute per rank", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
