"""PNG plots of a report and of sweeps (matplotlib's object-oriented API on an Agg canvas: no
pyplot, so a user's interactive backend is never switched; matplotlib is imported only here, when
plotting).

Role: :func:`plot_report` draws one report's points (d_align and AG_max per point, the
certificate bounds against the empirical misalignment, the |C|_F² saturation signal, the norm
histograms); :func:`plot_sweep` a width or depth sweep. The three transfer curves keep one colour
and marker everywhere (:data:`TRANSFER_STYLE`), and probabilities near 1e-3 stay visible on a log
axis. Every file is written with :func:`save_figure` (atomically, like the JSON).
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ...accumulators.persistence import write_atomic
from ...accumulators.trends import median
from ...errors import FusedStatsError
from .schema import cell, finite
from .sweeps import sweep_rows

# one colour, marker and name per transfer curve in every plot (per-point and sweep figures)
TRANSFER_STYLE = {
    "misalignment": {"color": "tab:red", "marker": "o", "label": "empirical Pr(misaligned), pooled splits"},
    "b_exact": {"color": "tab:blue", "marker": "v", "label": "B_exact (Cantelli), pooled moments"},
    "b_align": {"color": "tab:green", "marker": "^", "label": "B_align (certificate), pooled moments"},
}
PROBABILITY_LABEL = "probability of misalignment"


def plot_report(report, path) -> Path:
    """PNG: d_align (train, test) and AG_max per point; certificate bounds vs empirical
    misalignment per point (symlog axis: 0 and every decade down to the smallest value); the
    cross-gradient |C|_F² with its standard error where the probe had ``cross=``; the per-sample
    norm histograms (train) where the points carry them. A panel whose numbers were not computed
    is left out."""
    Figure, FigureCanvasAgg = figure_classes()
    pts = report.points
    xs = [p["index"] for p in pts]
    labels = [p["name"] for p in pts]

    def series(section, key):
        return [finite(cell(p[section], key)) for p in pts]

    def present(section, key):
        return any(v is not None for v in series(section, key))

    panels = []
    if present("train", "d_align") or present("test", "d_align"):
        panels.append("d_align")
    if present("train", "ag_max") or present("test", "ag_max"):
        panels.append("ag_max")
    has_cert = present("certificate", "b_align") or present("certificate", "b_exact")
    has_mis = present("misalignment", "probability")
    if has_cert or has_mis:
        panels.append("transfer")
    if present("saturation", "cross_frob2"):
        panels.append("saturation")
    if report.histogram_points():
        panels.append("norm_histogram")
    if not panels:
        raise FusedStatsError("report plot: no point has a finite estimate to plot")
    fig = Figure(figsize=(4.4 * len(panels) + 0.6, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        if panel == "norm_histogram":
            _histogram_panel(ax, report.histogram_points())
            continue
        if panel == "saturation":
            _saturation_panel(ax, xs, pts)
        elif panel in ("d_align", "ag_max"):
            for stream, marker in (("train", "o"), ("test", "s")):
                ys = series(stream, panel)
                if any(y is not None for y in ys):
                    _line(ax, xs, ys, marker=marker, label=f"{stream} stream")
            if panel == "d_align":
                ax.set_title("d_align per point")
                ax.set_ylabel("d_align = min(d_par, d_2)")
            else:
                ax.set_title("AG_max per point")
                ax.set_ylabel("AG_max = max_i |q_i|")
        else:
            if has_mis:
                _errorbar(
                    ax,
                    xs,
                    series("misalignment", "probability"),
                    series("misalignment", "stderr"),
                    **TRANSFER_STYLE["misalignment"],
                )
            if has_cert:
                _line(ax, xs, series("certificate", "b_exact"), **TRANSFER_STYLE["b_exact"])
                _line(ax, xs, series("certificate", "b_align"), **TRANSFER_STYLE["b_align"])
            _probability_axis(
                ax,
                series("misalignment", "probability")
                + series("certificate", "b_exact")
                + series("certificate", "b_align"),
            )
            ax.set_title(
                " vs ".join(
                    t
                    for t, on in (("certificate bound", has_cert), ("empirical misalignment", has_mis))
                    if on
                )
            )
        ax.set_xticks(xs)
        ax.set_xticklabels([_short(n) for n in labels], rotation=45, ha="right", fontsize=7)
        ax.set_xlabel("insertion point")
        ax.grid(alpha=0.3)
        _scientific(ax)
        _legend_below(ax)
    fig.suptitle(
        f"{report.model['class']} ({report.model['num_parameters']:,} params)" + _meta_title(report.meta),
        fontsize=9,
    )
    _place_legends(fig, axes)
    return save_figure(fig, path)


def plot_sweep(reports: Iterable, x: str, path, point: str | int = "last") -> Path:
    """PNG of a sweep over several reports (several seeds per x value are shown as a spread).

    ``x="width"``: d_align (train) vs ``meta["width"]`` at the chosen point (default: the last,
    i.e. highest-index, point), median over seeds with min-max band and every seed as a dot; and
    the certificate bound and empirical misalignment vs width (when computed).
    ``x="depth"``: AG_max (train) at the chosen point vs ``meta["depth"]``, the same spread; the
    scale-free AG_max, the saturation signal ``cross_frob2`` and ``meta["test_loss"]`` when present.
    ``point`` is "last", "first", an index or a point name. A panel is drawn only for numbers
    the reports hold.
    """
    if x not in ("width", "depth"):
        raise FusedStatsError(f"plot_sweep: x must be 'width' or 'depth', got {x!r}")
    reports = list(reports)
    if not reports:
        raise FusedStatsError("plot_sweep needs at least one report")
    rows = sweep_rows(reports, x, point)
    Figure, FigureCanvasAgg = figure_classes()

    def has(*keys):
        return any(r.get(k) is not None for r in rows for k in keys)

    # (title, y label, [(key, legend label)]) per panel, only for data that exists
    if x == "width":
        panels = [
            ("d_align vs width (spread over seeds)", "d_align (train)", [("d_align", "d_align (train)")])
        ]
        parts = [(k, TRANSFER_STYLE[k]["label"]) for k in ("misalignment", "b_exact", "b_align") if has(k)]
        if parts:
            title = " vs ".join(
                t
                for t, on in (
                    ("certificate bound", has("b_align", "b_exact")),
                    ("empirical misalignment", has("misalignment")),
                )
                if on
            )
            panels.append((f"transfer: {title}", PROBABILITY_LABEL, parts))
    else:
        panels = [
            (
                "AG_max vs depth (spread over seeds)",
                "gradient norm |q_i| (train)",
                [("ag_max", "AG_max (train)"), ("ag_mean", "AG_mean (train)")],
            )
        ]
        if has("ag_max_scaled"):
            panels.append(
                (
                    "AG_max without the stream scale",
                    "AG_max * |z| / sqrt(d)",
                    [("ag_max_scaled", "AG_max*|z|/sqrt(d)")],
                )
            )
        if has("cross_frob2"):
            panels.append(
                (
                    "cross-gradient vs depth",
                    "|C|_F^2 (unbiased)",
                    [("cross_frob2", "|C|_F^2 (saturation signal)")],
                )
            )
        if has("test_loss"):
            panels.append(
                ("held-out loss vs depth", "held-out loss (nats)", [("test_loss", "held-out loss")])
            )
    fig = Figure(figsize=(4.6 * len(panels) + 1.0, 4.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    xs = sorted({r["x"] for r in rows})
    for ax, (title, ylabel, parts) in zip(axes, panels):
        for key, label in parts:
            style = TRANSFER_STYLE.get(key, {})
            _spread(ax, rows, key, label, color=style.get("color"), marker=style.get("marker", "o"))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        if x == "width":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(v) for v in xs])
        ax.xaxis.set_minor_locator(_null_locator())
        if ylabel == PROBABILITY_LABEL:
            _probability_axis(ax, [r.get(k) for r in rows for k, _ in parts])
        _scientific(ax)
        _legend_below(ax)
    if x == "width":
        positive = [r["d_align"] for r in rows if r.get("d_align") is not None and r["d_align"] > 0]
        if positive and max(positive) > 20 * min(positive):
            # values span decades and 0 means "no signal": a symlog axis keeps both visible
            _symlog(axes[0], positive)
            axes[0].set_ylabel("d_align (train; symlog, 0 = no detectable mean)")
    fig.suptitle(f"sweep over {x}: {len(reports)} reports, point={point!r}", fontsize=9)
    _place_legends(fig, axes)
    return save_figure(fig, path)


def figure_classes():
    """matplotlib's ``Figure`` and Agg canvas, imported on first use (plots are an optional extra)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise FusedStatsError(
            "plots need matplotlib, which is not installed: pip install 'fused-stats[plot]' "
            "(or pip install matplotlib)"
        ) from None
    return Figure, FigureCanvasAgg


def save_figure(fig, path, **savefig) -> Path:
    """Render ``fig`` as PNG and write it like the JSON and markdown files (:func:`write_atomic`:
    a viewer never reads half a PNG, and the file gets the same permissions)."""
    import io

    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **savefig)
    write_atomic(path, buffer.getvalue())
    return path


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _scientific(ax) -> None:
    """Tick labels like 2.5e-4 as a shared ×10⁻⁴ offset instead of long decimals (linear axes)."""
    if ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 4), useMathText=True)


def _probability_axis(ax, values) -> None:
    """Probabilities on a symlog axis from the smallest positive value's decade up to 1, with 0
    kept visible below it: a misalignment of 1e-3 next to a bound of 0.7 is not flattened onto
    the zero line as on a linear 0-1 axis. Only 0s (or nothing): the linear 0-1 axis."""
    positive = [v for v in values if v is not None and v > 0]
    ax.set_ylabel(PROBABILITY_LABEL + (" (symlog)" if positive else ""))
    if not positive:
        ax.set_ylim(-0.02, 1.02)
        return
    _symlog(ax, [*positive, 1.0], top=1.3)


def _saturation_panel(ax, xs, points) -> None:
    """|C|_F² per point with two labelled bars: ± the SE under H0 (the scale the test's p comes
    from; thick) and ± the estimate's own SE (thin, capped; none where it is not estimable), a
    zero line (C = 0: saturated), and open markers where the test did not reject C = 0."""
    value = [finite(cell(p["saturation"], "cross_frob2")) for p in points]
    se = [finite(cell(p["saturation"], "cross_frob2_se")) for p in points]
    se_null = [finite(cell(p["saturation"], "cross_frob2_se_null")) for p in points]
    kept = [cell(p["saturation"], "saturated") for p in points]
    ax.axhline(0.0, color="grey", linewidth=0.8)
    _errorbar(
        ax, xs, value, se_null, fmt="none", elinewidth=6, alpha=0.35, color="tab:orange",
        label="± SE under H0 (what the test's p uses)",
    )  # fmt: skip
    _errorbar(
        ax, xs, value, se, marker="o", color="tab:purple", label="|C|_F^2 (unbiased) ± SE of the estimate"
    )
    open_x = [x for x, v, s in zip(xs, value, kept) if v is not None and s]
    if open_x:
        ax.plot(
            open_x,
            [v for v, s in zip(value, kept) if v is not None and s],
            linestyle="none",
            marker="o",
            markersize=10,
            markerfacecolor="none",
            color="tab:purple",
            label="saturated (C = 0 not rejected)",
        )
    if any(v is not None and s is None for v, s in zip(value, se)):
        ax.plot([], [], linestyle="none", label="no bar: SE not estimable at this n")
    ax.set_title("depth probe: cross-gradient per point")
    ax.set_ylabel("|C|_F^2 (0 = no gain from a block)")


def _symlog(ax, positive, top: float | None = None) -> None:
    """A symlog y axis with ticks only at 0 and at whole decades from the smallest positive value
    up: the linear part around 0 gets half a decade of height, so "0" and the first decade's label
    never overlap."""
    from matplotlib.ticker import FuncFormatter

    low = math.floor(math.log10(min(positive)))
    high = math.ceil(math.log10(max(positive)))
    ax.set_yscale("symlog", linthresh=10.0**low, linscale=0.5)
    ax.set_yticks([0.0] + [10.0**k for k in range(low, high + 1)])
    ax.yaxis.set_major_formatter(
        FuncFormatter(lambda v, _: "0" if v == 0 else f"$10^{{{round(math.log10(v))}}}$")
    )
    ax.yaxis.set_minor_locator(_null_locator())
    ax.set_ylim(-0.1 * 10.0**low, top if top is not None else 10.0**high)


def _legend_below(ax) -> None:
    """The legend under the axes, below its tick and axis labels (placed by :func:`_place_legends`
    once the layout is known), never over the data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.2),
            fontsize=7,
            ncol=min(2, len(handles)),
            frameon=False,
        )


def _place_legends(fig, axes) -> None:
    """Move each axes' legend just under its x axis (tick labels may be rotated and long): lay
    the figure out, measure the x axis, place, and lay out again with the legends in place."""
    for _ in range(2):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for ax in axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            box = ax.xaxis.get_tightbbox(renderer)
            if box is None:
                continue
            bottom = ax.transAxes.inverted().transform((0, box.y0))[1]
            legend.set_bbox_to_anchor((0.5, bottom - 0.01), transform=ax.transAxes)


def _line(ax, xs, ys, **kw):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pairs:
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], **kw)


def _errorbar(ax, xs, ys, es, **kw):
    trip = [(x, y, e or 0.0) for x, y, e in zip(xs, ys, es) if y is not None]
    if trip:
        kw.setdefault("capsize", 3)
        ax.errorbar([t[0] for t in trip], [t[1] for t in trip], yerr=[t[2] for t in trip], **kw)


def _spread(ax, rows, key, label, color=None, marker="o"):
    """Every seed as a dot, the median as a line and the min-max range as a band."""
    groups = defaultdict(list)
    for r in rows:
        if r.get(key) is not None:
            groups[r["x"]].append(r[key])
    if not groups:
        return
    xs = sorted(groups)
    med = [median(groups[x]) for x in xs]
    lo = [min(groups[x]) for x in xs]
    hi = [max(groups[x]) for x in xs]
    (line,) = ax.plot(xs, med, marker=marker, color=color, label=f"{label} (median)")
    ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
    dots = [(x, v) for x in xs for v in groups[x]]
    ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=10, color=line.get_color(), alpha=0.6)


def _histogram_panel(ax, points: list[dict]) -> None:
    """Counts per bin on a log |q| axis, one bar series per point (underflow and overflow in the
    legend)."""
    several = len(points) > 1
    for p in points:
        hist = p["norm_histogram"]
        edges = hist["edges"]
        widths = [b - a for a, b in itertools.pairwise(edges)]
        outside = (
            f", {hist['underflow']} below, {hist['overflow']} above"
            if (hist["underflow"] or hist["overflow"])
            else ""
        )
        ax.bar(
            edges[:-1],
            hist["counts"],
            width=widths,
            align="edge",
            alpha=0.5 if several else 0.8,
            edgecolor="black",
            linewidth=0.3,
            label=f"{_short(p['name'])}{outside}",
        )
    ax.set_xscale("log")
    ax.set_title("per-sample norm histogram (train)")
    ax.set_xlabel("|q_i| (log scale)")
    ax.set_ylabel("samples per bin")
    ax.grid(alpha=0.3)
    _legend_below(ax)


def _short(name: str) -> str:
    return name if len(name) <= 24 else "…" + name[-23:]


def _meta_title(meta: dict) -> str:
    keys = [k for k in ("width", "depth", "seed", "tokens") if k in meta]
    return ("  " + ", ".join(f"{k}={meta[k]}" for k in keys)) if keys else ""
