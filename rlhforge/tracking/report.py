"""Run reports: PNG curves from metrics.jsonl (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path


def plot_curves(metrics: list[dict], keys: list[str], out: Path) -> Path | None:
    """One panel per metric key against step; returns the PNG path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    present = [k for k in keys if any(k in m for m in metrics)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4.5 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present):
        points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
