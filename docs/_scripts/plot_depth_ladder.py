"""Draw docs/depth_ladder.png from the depth ladder's default run (bench/results/depth_ladder_cpu.json).

    python docs/_scripts/plot_depth_ladder.py

Left: each rung's realised gain (held-out loss of staying at the same depth for the same FLOPs
minus that of the model grown by one zero layer), one line per seed. Right: the top candidate's
curvature gain before growth against that realised gain.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FormatStrFormatter

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "bench" / "results" / "depth_ladder_cpu.json"
TARGET = ROOT / "docs" / "depth_ladder.png"


def main() -> None:
    runs = json.loads(SOURCE.read_text())["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    for run in runs:
        depths = [rung["depth"] for rung in run["rungs"]]
        gains = [rung["realised_gain"] for rung in run["rungs"]]
        curvature = [rung["scores"]["curvature_gain"] for rung in run["rungs"]]
        (line,) = left.plot(depths, gains, marker="o", label=f"seed {run['seed']}")
        right.scatter(curvature, gains, color=line.get_color())
    for axis in (left, right):
        axis.axhline(0.0, color="grey", lw=0.8)
        axis.set_ylabel("realised gain (nats/byte; > 0: growing paid)")
    left.set_xlabel("depth before growing one zero layer")
    left.set_title("grown vs staying, equal FLOPs")
    left.legend(fontsize="small", ncols=2)
    right.set_xlabel("top candidate's curvature gain |g|⁴/(2 gᵀHg) before growth")
    # plain decimals: matplotlib's "1e-2" offset text would sit on top of the axis label
    right.xaxis.set_major_formatter(FormatStrFormatter("%.3f"))
    right.set_title("score before growth vs realised gain")
    fig.savefig(TARGET, dpi=110)
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
