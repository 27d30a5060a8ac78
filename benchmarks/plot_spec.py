"""Draw a bench_spec_gpu.py result: speedup over plain decoding by Spec-Bench category and method at
batch 1, and overall by method for every batch size (one panel each). Needs matplotlib (not a
test dependency: pip install matplotlib).

    python benchmarks/plot_spec.py benchmarks/results/spec_bench_h200.json benchmarks/results/spec_bench_h200.png
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    result = json.load(open(src))
    rows = result["rows"]
    methods = [m for m in rows[0] if isinstance(rows[0][m], dict) and m != "plain"]
    fig, axes = plt.subplots(1, 1 + len(rows), figsize=(6 + 3 * len(rows), 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [3] + [1] * len(rows)})
    first = next((r for r in rows if any("vs_plain_by_category" in r[m] for m in methods)), None)
    ax = axes[0][0]
    if first is not None:
        cats = sorted(first[methods[0]]["vs_plain_by_category"])
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            vals = [first[m].get("vs_plain_by_category", {}).get(c, 0.0) for c in cats]
            ax.bar([x + i * width for x in range(len(cats))], vals, width, label=m)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=60, ha="right")
        ax.set_title(f"batch {first['batch']}: speedup by category")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.legend(fontsize=7)
    for ax, row in zip(axes[0][1:], rows):
        ax.bar(range(len(methods)), [row[m]["vs_plain"] for m in methods], color=[f"C{i}" for i in range(len(methods))])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(methods)), methods, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"batch {row['batch']}: overall")
    fig.suptitle(f"{result.get('device', '')} {result.get('date', '')[:10]}: speculation vs plain decoding")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
