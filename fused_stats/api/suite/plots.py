"""The suite's comparison as figures: statistics against width, budget, depth and step, the
saturation test, and the growth advice (:data:`PLOTS`, one PNG each where the suite holds a sweep
along that axis). Values from :mod:`fused_stats.api.suite.cells`; matplotlib's
object-oriented API (no pyplot).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ..report.document import fmt, save_figure
from .cells import (
    budget_point,
    column_text,
    columns,
    design_labels,
    max_cross_frob2,
    nested,
    pick_point,
    relative_depths,
    run_order,
    statistics,
)


def _figure(panels: int):
    from ..report.plots import figure_classes

    Figure, FigureCanvasAgg = figure_classes()
    fig = Figure(figsize=(4.6 * panels, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _done(suite):
    return [n for n in run_order(suite) if suite["runs"][n]["status"] == "done"]


def _group_by(suite, names, keys):
    groups = defaultdict(list)
    for n in names:
        groups[tuple(suite["runs"][n]["labels"].get(k) for k in keys)].append(n)
    return dict(sorted(groups.items(), key=lambda g: str(g[0])))


def _sweeps(suite, axis: str, fixed: tuple[str, ...]) -> dict:
    """The done runs with an int label ``axis``, grouped by the labels ``fixed``; only groups in
    which ``axis`` takes more than one value (a sweep along it)."""
    names = [n for n in _done(suite) if isinstance(suite["runs"][n]["labels"].get(axis), int)]
    return {
        g: ns
        for g, ns in _group_by(suite, names, fixed).items()
        if len({suite["runs"][n]["labels"][axis] for n in ns}) > 1
    }


def _plain_ticks(axis) -> None:
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _logy(ax, values):
    # a log axis only where the values span a decade (below, it would show no labelled tick)
    if values and all(v > 0 for v in values) and max(values) > 10 * min(values):
        ax.set_yscale("log")
        _plain_ticks(ax.yaxis)


def plot_width(suite, path) -> Path | None:
    groups = _sweeps(suite, "width", ("model_type", "depth", "step"))
    if not groups:
        return None
    fig, axes = _figure(len(groups))
    for ax, (group, ns) in zip(axes, groups.items()):
        series = defaultdict(list)
        for n in ns:
            for r, p in relative_depths(suite["runs"][n]):
                v = nested(p, "train", "d_align")
                if isinstance(v, float) and math.isfinite(v):
                    series[r].append((suite["runs"][n]["labels"]["width"], v))
        values = []
        for r, pts in ((r, series[r]) for r in columns(series)):
            pts.sort()
            ax.plot(
                [a for a, _ in pts], [b for _, b in pts], marker="o", label=f"rel. depth {column_text(r)}"
            )
            values += [b for _, b in pts]
        _logy(ax, values)
        ax.set_xscale("log", base=2)
        widths = sorted({suite["runs"][n]["labels"]["width"] for n in ns})
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.xaxis.set_minor_formatter(lambda v, _: "")
        ax.set_xlabel("width (hidden size)")
        ax.set_ylabel("d_align (train)")
        ax.set_title(
            ", ".join(f"{k}={v}" for k, v in zip(("model", "depth", "step"), group) if v is not None),
            fontsize=9,
        )
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def plot_budgets(suite, path) -> Path | None:
    """Misalignment and B_exact against n_eff, one line per run: the log x axis ticked at each
    budget (labelled with its M, K), both probabilities on the symlog axis of the report plots (0
    stays visible below the smallest decade), one legend under both panels."""
    from matplotlib.ticker import NullLocator

    from ..report.plots import _probability_axis

    splits = suite["settings"]["splits"]
    names = _done(suite)
    if not splits or not names:
        return None
    fig, axes = _figure(2)
    fig.set_size_inches(11.0, 4.6)
    where = suite.get("point", "last")
    xs = [M * K / (M + K + 1) for M, K in splits]
    keys = (("misalignment", "probability"), ("certificate", "b_exact"))
    values = {key: [] for key in keys}
    for n in names:
        entry = suite["runs"][n]
        point = pick_point(entry, where)
        if point is None:
            continue
        for ax, key in zip(axes, keys):
            ys = [nested(budget_point(entry, b, point["name"]), *key) for b in range(len(splits))]
            pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float))]
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=n)
                values[key] += [b for _, b in pts]
    ticks = defaultdict(list)  # two budgets with one n_eff share a tick
    for x, (M, K) in zip(xs, splits):
        ticks[round(x, 6)].append(f"M={M}, K={K}")
    titles = ("empirical misalignment Pr(μ_Mᵀg_K ≤ 0)", "certificate B_exact (a bound on it)")
    for ax, key, title in zip(axes, keys, titles):
        ax.set_xscale("log")
        ax.set_xticks(list(ticks), [f"{x:.3g}\n" + "\n".join(mk) for x, mk in ticks.items()], fontsize=7)
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(min(ticks) / 1.3, max(ticks) * 1.3)
        ax.set_xlabel("n_eff = MK/(M+K+1)")
        _probability_axis(ax, values[key])
        ax.set_ylabel(("Pr(μ_Mᵀg_K ≤ 0)" if key[0] == "misalignment" else "B_exact") + " (symlog)")
        ax.set_title(f"{title}, point: {where}", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        handles, labels = axes[1].get_legend_handles_labels()
    if handles:
        fig.legend(
            handles, labels, loc="outside lower center", ncol=min(6, len(handles)), fontsize=7, frameon=False
        )
    return save_figure(fig, path, dpi=110)


def plot_depth(suite, path) -> Path | None:
    groups = _sweeps(suite, "depth", ("model_type", "width", "step"))
    if not groups:
        return None
    fig, (ax,) = _figure(1)
    where = suite.get("point", "last")
    values = []
    for group, ns in groups.items():
        pts = sorted(
            (
                suite["runs"][n]["labels"]["depth"],
                nested(pick_point(suite["runs"][n], where), "train", "ag_max"),
            )
            for n in ns
        )
        pts = [(a, b) for a, b in pts if isinstance(b, float)]
        ax.plot(
            [a for a, _ in pts],
            [b for _, b in pts],
            marker="o",
            label=", ".join(f"{k}={v}" for k, v in zip(("model", "width", "step"), group) if v is not None),
        )
        values += [b for _, b in pts]
    _logy(ax, values)
    depths = sorted({suite["runs"][n]["labels"]["depth"] for ns in groups.values() for n in ns})
    ax.set_xticks(depths, [str(d) for d in depths])
    ax.set_xlabel("depth (blocks)")
    ax.set_ylabel(f"AG_max = max_i |q_i| (train, point: {where})")
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


def plot_saturation(suite, path) -> Path | None:
    """Runs × points: colour = log10 |C|²_F with the verdict (S saturated, × not) in the cell; an
    estimate ≤ 0 (no logarithm: the unbiased estimate of a |C|² near 0) is hatched, a run without
    that point (or without its |C|²) is grey, each named in the legend."""
    if not suite["settings"].get("cross"):
        return None
    names = _done(suite)
    depths = columns(r for n in names for r, _ in relative_depths(suite["runs"][n]))
    import numpy as np
    from matplotlib.patches import Patch, Rectangle

    grid = np.full((len(names), len(depths)), np.nan)
    marks, at_most_zero = [], []
    for i, n in enumerate(names):
        for r, p in relative_depths(suite["runs"][n]):
            sat = p.get("saturation")
            if sat and isinstance(sat.get("cross_frob2"), float):
                j = depths.index(r)
                if sat["cross_frob2"] > 0:
                    grid[i, j] = math.log10(sat["cross_frob2"])
                else:
                    at_most_zero.append((i, j))
                marks.append((i, j, "S" if sat.get("saturated") else "×"))
    if not marks:
        return None
    from ..report.plots import figure_classes

    Figure, FigureCanvasAgg = figure_classes()
    longest = max(len(n) for n in names)
    width = 2.6 + 0.07 * longest + 0.75 * len(depths)  # names, cells, colour bar and legend
    fig = Figure(figsize=(max(6.0, width), 2.2 + 0.34 * len(names)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_facecolor("0.82")  # no value here: grey
    image = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="viridis")
    for i, j in at_most_zero:
        ax.add_patch(
            Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", edgecolor="tab:red", hatch="//", lw=0)
        )
    zero = set(at_most_zero)
    for i, j, text in marks:
        light = (i, j) in zero
        ax.text(
            j, i, text + (" ≤0" if light else ""), ha="center", va="center",
            color="black" if light else "white", fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1} if light else None,
        )  # fmt: skip
    ax.set_xticks(range(len(depths)), [column_text(r) for r in depths], fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("relative depth")
    ax.set_title("log10 |C|²_F (S: saturated, C = 0 not rejected; ×: not saturated)", fontsize=9)
    fig.colorbar(image, ax=ax, label="log10 |C|²_F")
    fig.legend(
        handles=[
            Patch(facecolor="white", edgecolor="tab:red", hatch="//", label="estimate ≤ 0 (no log)"),
            Patch(facecolor="0.82", edgecolor="0.5", label="no such point in this run"),
        ],
        loc="outside lower center",
        ncol=2,
        fontsize=7,
        frameon=False,
    )
    return save_figure(fig, path, dpi=110)


def plot_steps(suite, path) -> Path | None:
    names = [n for n in _done(suite) if isinstance(suite["runs"][n]["labels"].get("step"), (int, float))]
    fixed = [k for k in design_labels(suite) if k != "step"]
    groups = {g: ns for g, ns in _group_by(suite, names, fixed).items() if len(ns) > 1}
    if not groups:
        return None
    every = statistics(suite)
    stats = [s for s in every if s[0].split()[0] in ("d_align", "AG_max", "|C|²_F")]
    stats += [s for s in every if s[0].startswith("misalignment")][-1:]  # the largest (M, K)
    fig, axes = _figure(len(stats))
    for ax, (title, cell) in zip(axes, stats):
        for group, ns in groups.items():
            series = defaultdict(list)
            for n in ns:
                entry = suite["runs"][n]
                for r, p in relative_depths(entry):
                    v = cell(entry, p)
                    if isinstance(v, float) and math.isfinite(v):
                        series[r].append((entry["labels"]["step"], v))
            tag = ", ".join(
                f"{k}={v}"
                for k, v in zip(fixed, group)
                if v is not None and k in ("model_type", "width", "depth")
            )
            for r, pts in ((r, series[r]) for r in columns(series)):
                pts.sort()
                where_text = f"rel. depth {column_text(r)}"
                label = f"{tag}, {where_text}" if len(groups) > 1 else where_text
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=label)
        ax.set_xlabel("training step")
        ax.set_title(title if len(groups) > 1 else f"{title}\n{tag}", fontsize=8)
        if ax.lines:
            ax.legend(fontsize=6)
    return save_figure(fig, path, dpi=110)


def plot_growth(suite, path) -> Path | None:
    """Two panels against the first of depth, step, width that varies: the largest |C|²_F over
    the growth candidates (filled: a significant candidate exists; open: saturated everywhere)
    and the held-out loss, one line per group holding the other design labels fixed."""
    if not suite.get("growth"):
        return None
    names = [n for n in _done(suite) if suite["runs"][n].get("advice")]
    axis = next(
        (
            x
            for x in ("depth", "step", "width")
            if len({suite["runs"][n]["labels"].get(x) for n in names} - {None}) > 1
        ),
        None,
    )
    if axis is None:
        return None
    names = [n for n in names if isinstance(suite["runs"][n]["labels"].get(axis), (int, float))]
    fixed = [k for k in design_labels(suite) if k != axis]
    groups = _group_by(suite, names, fixed)
    fig, (left, right) = _figure(2)
    values = []
    for group, ns in groups.items():
        runs = sorted((suite["runs"][n] for n in ns), key=lambda e: e["labels"][axis])
        xs = [e["labels"][axis] for e in runs]
        tag = ", ".join(f"{k}={v}" for k, v in zip(fixed, group) if v is not None) or "all runs"
        tops = [max_cross_frob2(e) for e in runs]
        (line,) = left.plot(xs, [math.nan if y is None else y for y in tops], marker="", label=tag)
        for x, y, e in zip(xs, tops, runs):
            if y is None:
                continue
            sat = e["advice"]["saturated_everywhere"]
            left.plot(
                [x], [y], marker="o", ls="", color=line.get_color(), mfc="white" if sat else line.get_color()
            )
            values.append(y)
        losses = [math.nan if e.get("test_loss") is None else e["test_loss"] for e in runs]
        right.plot(xs, losses, marker="o", color=line.get_color(), label=tag)
    _logy(left, values)
    for ax in (left, right):
        ticks = sorted({suite["runs"][n]["labels"][axis] for n in names})
        ax.set_xticks(ticks, [fmt(t) for t in ticks])
        ax.set_xlabel(axis)
    left.set_ylabel("max |C|²_F over the candidates")
    left.set_title("growth gain (filled: significant; open: saturated everywhere)", fontsize=8)
    right.set_ylabel("test loss (nats/token)")
    right.set_title("held-out loss", fontsize=8)
    right.legend(fontsize=7)
    return save_figure(fig, path, dpi=110)


PLOTS = {
    "suite_width.png": plot_width,
    "suite_budgets.png": plot_budgets,
    "suite_depth.png": plot_depth,
    "suite_saturation.png": plot_saturation,
    "suite_steps.png": plot_steps,
    "suite_growth.png": plot_growth,
}


def render_plots(suite: dict, out: Path) -> list[Path]:
    written = []
    for name, plot in PLOTS.items():
        path = plot(suite, out / name)
        if path is not None:
            written.append(path)
    return written
