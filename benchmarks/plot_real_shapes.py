"""Bar plot of a ``bench_vs_trl.py --preset ...`` result: peak RSS and seconds per step per side, for
every work and shape in the file, with each side's ratio to rlhforge written on its bar.

    python benchmarks/plot_real_shapes.py benchmarks/results/vs_trl_vocab-real-small.json
    # -> benchmarks/results/vs_trl_vocab-real-small.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_trl import label  # noqa: E402


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(path.read_text())
    points = [p for p in results["points"] if any("error" not in r for r in p["sides"].values())]
    sides = sorted({s for p in points for s, r in p["sides"].items() if "error" not in r},
                   key=lambda s: (s != "trl", s))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(sides), 1)
    for ax, key, title in ((axes[0], "peak_rss_gb", "peak RSS (GB)"), (axes[1], "seconds_per_step", "seconds per step")):
        for i, side in enumerate(sides):
            xs, ys, notes = [], [], []
            for j, p in enumerate(points):
                r, ref = p["sides"].get(side, {}), p["sides"].get("rlhforge", {})
                if key not in r:
                    continue
                xs.append(j + (i - (len(sides) - 1) / 2) * width)
                ys.append(r[key])
                notes.append(f"{r[key] / ref[key]:.2f}x" if key in ref and ref[key] else "")
            bars = ax.bar(xs, ys, width, label=side)
            for bar, note in zip(bars, notes):
                ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks(range(len(points)), [f"{p['work'].upper()} {label(p['point'])}" for p in points], fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    model = results.get("setup", {}).get("model") or results["setup"].get("merged_from", [{}])[0].get("model", "")
    fig.suptitle(f"{model}; CPU (ratios: side / rlhforge)", fontsize=9)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"wrote {plot(Path(arg))}")
