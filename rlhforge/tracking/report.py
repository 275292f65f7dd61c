"""Run reports: PNG curves from metrics.jsonl (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path


def plot_curves(metrics: list[dict], keys: list[str], out: Path, columns: int = 3) -> Path | None:
    """One panel per metric key against step, ``columns`` panels a row (a grid); a noisy per-step series also
    gets its running mean over ~1/15 of the run, drawn over the raw points. Returns the PNG path, or None
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    present = [k for k in keys if any(k in m for m in metrics)]
    if not present:
        return None
    cols = max(1, min(columns, len(present)))
    rows = -(-len(present) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.3 * rows), squeeze=False)
    for i, key in enumerate(present):
        ax = axes[i // cols][i % cols]
        points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float))]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        if len(points) >= 30:
            w = max(2, len(points) // 15)
            ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=0.8, label="per step")
            smooth = [sum(ys[max(0, j - w + 1): j + 1]) / len(ys[max(0, j - w + 1): j + 1]) for j in range(len(ys))]
            ax.plot(xs, smooth, color="tab:blue", linewidth=1.8, label=f"mean of {w}")
            ax.legend(fontsize=7, loc="best")
        else:
            ax.plot(xs, ys, marker=".", color="tab:blue")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for j in range(len(present), rows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
