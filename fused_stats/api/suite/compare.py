"""The suite's comparison: tables over runs × points, trends against the labels, plots.

Points are aligned across depths by relative depth ``(j + 1) / P``, where ``j`` is the point's index
among the model's own residual points (:func:`fused_stats.residual_points`, recorded in the run
file) and ``P`` their number: the residual stream after block ``j + 1`` of ``P``, whichever points
the suite file lists. A point off the residual stream has no relative depth; its column is its name. A trend of a statistic against
a label is measured within each group of runs that hold the other design labels (width, depth,
step, model_type and hand-set labels) fixed; ``parameters`` follows from width and depth, so its
groups hold only the rest fixed. Run-level statistics (the held-out loss in nats per counted token,
and with a ``[growth]`` section the largest ``|C|_F²`` over the protocol's candidates, whatever its
verdict, so every run has one) trend the same way. Each trend is Spearman's ρ with the two-sided permutation p-value
of :func:`fused_stats.accumulators.trends.rank_correlation`, exact (every re-pairing enumerated)
up to 8 runs a group. Plots use matplotlib's object-oriented API (no pyplot).
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from ...accumulators.trends import rank_correlation
from ..report.document import fmt, save_figure

TREND_LABELS = ("width", "depth", "step", "parameters")
NOT_DESIGN = ("parameters",)


# ---------------------------------------------------------------------------- cells
def relative_depths(entry: dict) -> list[tuple[float | str, dict]]:
    """``(column, point)`` for each point of a run's report: its relative depth, or its name for a
    point that is not one of the model's residual points."""
    residual = entry.get("residual_points") or []
    index = {name: j for j, name in enumerate(residual)}
    out = []
    for point in entry["report"]["points"]:
        j = index.get(point["name"])
        out.append((point["name"] if j is None else round((j + 1) / len(residual), 4), point))
    return out


def columns(keys) -> list:
    """Relative depths in order, then the off-stream point names."""
    return sorted(set(keys), key=lambda r: (1, 0.0, r) if isinstance(r, str) else (0, r, ""))


def column_text(r) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def _budget_point(entry, b: int, name: str) -> dict:
    return entry["budgets"][b]["points"].get(name, {}) if entry["budgets"] else {}


def _sub(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def statistics(suite: dict) -> list[tuple[str, object]]:
    """``(title, cell(entry, point) -> value)`` for every table."""
    stats = [
        ("d_align (train)", lambda e, p: _sub(p, "train", "d_align")),
        ("d_par (train)", lambda e, p: _sub(p, "train", "d_par")),
        ("d_2 (train)", lambda e, p: _sub(p, "train", "d_2")),
        ("AG_max (train)", lambda e, p: _sub(p, "train", "ag_max")),
    ]
    for b, (M, K) in enumerate(suite["settings"]["splits"]):
        stats.append(
            (
                f"B_exact at M={M}, K={K}",
                lambda e, p, b=b: _sub(_budget_point(e, b, p["name"]), "certificate", "b_exact"),
            )
        )
        stats.append(
            (
                f"misalignment Pr(μ_Mᵀg_K ≤ 0) at M={M}, K={K}",
                lambda e, p, b=b: _sub(_budget_point(e, b, p["name"]), "misalignment", "probability"),
            )
        )
    if suite["settings"].get("cross"):
        stats.append(("|C|²_F (cross_frob2)", lambda e, p: _sub(p, "saturation", "cross_frob2")))
    return stats


def max_cross_frob2(entry: dict) -> float | None:
    """The largest ``|C|_F²`` among a run's growth candidates (None without advice)."""
    ranked = _sub(entry, "advice", "ranked") or []
    values = [c["cross_frob2"] for c in ranked if isinstance(c.get("cross_frob2"), (int, float))]
    return max(values) if values else None


def run_statistics(suite: dict) -> list[tuple[str, object]]:
    """``(title, value(entry))`` for the statistics a run has once, not per point."""
    stats = [("test loss (nats/token)", lambda e: e.get("test_loss"))]
    if suite.get("growth"):
        stats.append(("max |C|²_F over the growth candidates", max_cross_frob2))
    return stats


def _order(suite: dict) -> list[str]:
    def key(name):
        labels = suite["runs"][name]["labels"]
        return (
            str(labels.get("model_type") or ""),
            *(
                labels.get(k) if isinstance(labels.get(k), (int, float)) else -1
                for k in ("depth", "width", "step")
            ),
            name,
        )

    return sorted(suite["runs"], key=key)


def _pick_point(entry: dict, where: str):
    points = sorted(
        ((r, p) for r, p in relative_depths(entry) if not isinstance(r, str)), key=lambda rp: rp[0]
    )
    if not points:
        return None
    if where == "last":
        return points[-1][1]
    if where == "first":
        return points[0][1]
    target = float(where)
    return min(points, key=lambda rp: abs(rp[0] - target))[1]


# ---------------------------------------------------------------------------- trends
def design_labels(suite: dict) -> list[str]:
    keys = set()
    for run in suite["runs"].values():
        keys.update(k for k, v in run["labels"].items() if v is not None)
    return sorted(keys - set(NOT_DESIGN))


def trend_groups(suite: dict) -> list[tuple[str, str, list[str]]]:
    """``(label, group text, done run names)`` for every group a trend of a label is taken in: the
    done runs with a numeric value of the label, grouped by every other design label."""
    done = {n: r for n, r in suite["runs"].items() if r["status"] == "done"}
    asked = suite.get("trends")
    labels = (
        list(asked)
        if asked
        else [x for x in TREND_LABELS if any(r["labels"].get(x) is not None for r in done.values())]
    )
    design = design_labels(suite)
    out = []
    for x in labels:
        fixed = [k for k in design if k != x and not (x == "parameters" and k in ("width", "depth"))]
        groups = defaultdict(list)
        for name, run in done.items():
            if isinstance(run["labels"].get(x), (int, float)) and not isinstance(run["labels"].get(x), bool):
                groups[tuple((k, run["labels"].get(k)) for k in fixed)].append(name)
        for group, names in sorted(groups.items(), key=lambda g: str(g[0])):
            text = ", ".join(f"{k}={v}" for k, v in group if v is not None) or "all runs"
            out.append((x, text, names))
    return out


def trend_rows(suite: dict) -> list[dict]:
    """One row per (label, group, statistic) with at least 3 runs at 2+ label values."""
    done = {n: r for n, r in suite["runs"].items() if r["status"] == "done"}
    where = suite.get("point", "last")
    rows = []
    for x, group, names in trend_groups(suite):
        xs = [done[n]["labels"][x] for n in names]
        if len(names) < 3 or len(set(xs)) < 2:
            continue
        columns_of_y = []
        for title, cell in statistics(suite):
            ys = []
            for n in names:
                point = _pick_point(done[n], where)
                ys.append(None if point is None else cell(done[n], point))
            columns_of_y.append((title, ys))
        for title, value in run_statistics(suite):
            columns_of_y.append((title, [value(done[n]) for n in names]))
        for title, ys in columns_of_y:
            pairs = [(a, b) for a, b in zip(xs, ys) if isinstance(b, (int, float)) and math.isfinite(b)]
            if len(pairs) < 3:
                continue
            n = len(pairs)
            permutations = math.factorial(n) if n <= 8 else 100_000
            rho, p = rank_correlation([a for a, _ in pairs], [b for _, b in pairs], permutations=permutations)
            rows.append(
                {
                    "label": x,
                    "group": group,
                    "statistic": title,
                    "n": n,
                    "rho": rho,
                    "p": p,
                    "exact": n <= 8,
                    "runs": names,
                }
            )
    return rows


# ---------------------------------------------------------------------------- markdown
def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell


def render_markdown(suite: dict) -> str:
    names = _order(suite)
    done = [n for n in names if suite["runs"][n]["status"] == "done"]
    depths = columns(r for n in done for r, _ in relative_depths(suite["runs"][n]))
    label_keys = ["model_type", "width", "depth", "step", "parameters"]
    label_keys += [k for k in design_labels(suite) if k not in label_keys]
    out = [f"# Suite: {Path(suite['suite']['file']).name}", ""]
    out.append(f"- suite file SHA-256: `{suite['suite']['sha256']}`")
    tok = suite["tokenizer"]
    out.append(
        f"- tokenizer: {tok}"
        + (
            f" ({len(suite['data'])} distinct tokenizers: each run saw its own tokenisation of the same text)"
            if tok == "per-model"
            else ""
        )
    )
    for key, data in suite["data"].items():
        for stream in ("train", "test"):
            d = data[stream]
            out.append(
                f"- {stream} windows ({key[:12]}): {d['shape'][0]} × {d['shape'][1]} from `{d['source']}`, SHA-256 `{d['sha256']}`"
            )
    for warning in suite.get("warnings", []):
        out.append(f"- **warning**: {warning}")
    s = suite["settings"]
    points, cross = s["points"], s["cross"]
    if suite.get("growth"):  # the probe's points and cross-gradient are the protocol's
        points, cross = "the [growth] candidates", "the growth protocol's exact tangent"
    out.append(
        f"- probe: points {points}, unit {s['unit']}, mask {s['mask']}, second moment {s['second_moment']}, "
        f"dtype {s['dtype']}, cross {cross}, (M, K) budgets {s['splits']}, {s['trials']} misalignment trials"
    )
    out += [
        "",
        "## Runs",
        "",
        "| run | " + " | ".join(label_keys) + " | status |",
        "|---" * (len(label_keys) + 2) + "|",
    ]
    for n in names:
        r = suite["runs"][n]
        status = r["status"] if r["status"] == "done" else f"**failed**: {r['error']}"
        out.append(
            f"| {n} | "
            + " | ".join(
                fmt(r["labels"].get(k)) if not isinstance(r["labels"].get(k), str) else r["labels"][k]
                for k in label_keys
            )
            + f" | {status} |"
        )
    pending_labels = suite.get("pending_labels", {})
    for n in suite.get("pending", []):
        labels = pending_labels.get(n, {})
        out.append(
            f"| {n} | "
            + " | ".join(
                fmt(labels.get(k)) if not isinstance(labels.get(k), str) else labels[k] for k in label_keys
            )
            + " | pending (not finished yet) |"
        )
    if suite["failed"]:
        out += ["", f"**{len(suite['failed'])} failed run(s)**: {', '.join(suite['failed'])}"]
    if suite.get("pending"):
        out += [
            "",
            f"**{len(suite['pending'])} pending run(s)** (no finished run file yet): {', '.join(suite['pending'])}",
        ]
    header = "| run | " + " | ".join(_cell(column_text(r)) for r in depths) + " |"
    rule = "|---" * (len(depths) + 1) + "|"
    for title, cell in statistics(suite):
        note = (
            "Columns: relative depth of the point, (j + 1)/P for the model's residual point j of P "
            "(the stream after block j + 1); a point off the residual stream by its name."
        )
        if title.startswith("misalignment"):
            note += ' "—": no sample pool (it needs second_moment = "pool", or "auto" below its switch size).'
        out += ["", f"## {title}", "", note, "", header, rule]
        for n in done:
            entry = suite["runs"][n]
            at = dict(relative_depths(entry))
            cells = []
            for r in depths:
                point = at.get(r)
                value = None if point is None else cell(entry, point)
                text = fmt(value)
                if title.startswith("|C|") and point is not None and point.get("saturation"):
                    text += " (sat.)" if point["saturation"].get("saturated") else " (not sat.)"
                cells.append(text if point is not None else "")
            out.append(f"| {n} | " + " | ".join(cells) + " |")
    if suite.get("growth"):
        out += depth_sufficiency(suite, done, label_keys)
    rows = trend_rows(suite)
    out += ["", f"## Trends (point: {suite.get('point', 'last')})", ""]
    if rows:
        out += [
            "Spearman's ρ within groups that hold the other labels fixed; p: two-sided permutation p-value "
            "(exact: every re-pairing enumerated).",
            "",
            "| label | group | statistic | runs | ρ | p |",
            "|---|---|---|---|---|---|",
        ]
        for t in rows:
            if math.isnan(t["rho"]):
                rho, p = "undefined", "(a constant column)"
            else:
                rho, p = f"{t['rho']:+.2f}", f"{t['p']:.3g}" + ("" if t["exact"] else " (Monte Carlo)")
            out.append(f"| {t['label']} | {t['group']} | {_cell(t['statistic'])} | {t['n']} | {rho} | {p} |")
    else:
        out.append(
            "No trend: a trend needs 3 or more runs at 2 or more values of its label within a group "
            "that holds the other labels fixed."
        )
    groups = trend_groups(suite)
    short = [
        (x, group, names)
        for x, group, names in groups
        if len(names) < 3 or len({suite["runs"][n]["labels"][x] for n in names}) < 2
    ]
    if short:
        out += [
            "",
            "Groups without a trend (fewer than 3 runs, or one value of the label):",
            "",
            "| label | group | runs | values of the label |",
            "|---|---|---|---|",
        ]
        for x, group, names in short:
            values = sorted({suite["runs"][n]["labels"][x] for n in names})
            out.append(f"| {x} | {group} | {len(names)} | {', '.join(fmt(v) for v in values)} |")
    elif not groups:
        out.append("No done run has a numeric value of a trend label.")
    return "\n".join(out) + "\n"


def depth_sufficiency(suite: dict, done: list[str], label_keys: list[str]) -> list[str]:
    """The [growth] table: per run the advisor's verdict, its top significant candidate with that
    candidate's |C|_F² and Holm-adjusted p, and the held-out loss."""
    g = suite["growth"]
    out = [
        "",
        "## Depth sufficiency ([growth])",
        "",
        f"Protocol: family {g['family']}, init {g['init']}, seed {g['seed']}, candidates {g['candidates']}"
        + (f", budget (M, K) = {tuple(g['budget'])}" if g.get("budget") else "")
        + f"; alpha = {g['alpha']:g}, Holm-Bonferroni over each run's candidates. Top: the significant "
        "candidate of largest |C|_F² (none when saturated everywhere). Test loss: mean nats per "
        "counted token on the test windows, from the probe's own losses.",
        "",
        "| run | "
        + " | ".join(label_keys)
        + " | verdict | top candidate | \\|C\\|²_F | Holm p | test loss | perplexity |",
        "|---" * (len(label_keys) + 7) + "|",
    ]
    for n in done:
        entry = suite["runs"][n]
        advice = entry.get("advice") or {}
        ranked = advice.get("ranked") or []
        top = next((c for c in ranked if c["point"] == advice.get("top")), None)
        unsaturated = sum(not c["saturated"] for c in ranked)
        if not advice:
            verdict = "no advice"
        elif advice.get("saturated_everywhere"):
            verdict = f"saturated everywhere ({len(ranked)} candidates)"
        else:
            verdict = f"not saturated at {unsaturated} of {len(ranked)}"
        labels = entry["labels"]
        cells = [fmt(labels.get(k)) if not isinstance(labels.get(k), str) else labels[k] for k in label_keys]
        cells += [
            verdict,
            "—" if top is None else f"`{top['point']}`",
            "—" if top is None else fmt(top["cross_frob2"]),
            "—" if top is None else fmt(top["p_adjusted"]),
            fmt(entry.get("test_loss")),
            fmt(entry.get("test_perplexity")),
        ]
        out.append(f"| {n} | " + " | ".join(_cell(c) for c in cells) + " |")
    return out


# ---------------------------------------------------------------------------- plots
def _figure(panels: int):
    from ..report.plots import figure_classes

    Figure, FigureCanvasAgg = figure_classes()
    fig = Figure(figsize=(4.6 * panels, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, panels, i + 1) for i in range(panels)]


def _done(suite):
    return [n for n in _order(suite) if suite["runs"][n]["status"] == "done"]


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
                v = _sub(p, "train", "d_align")
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
        point = _pick_point(entry, where)
        if point is None:
            continue
        for ax, key in zip(axes, keys):
            ys = [_sub(_budget_point(entry, b, point["name"]), *key) for b in range(len(splits))]
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
                _sub(_pick_point(suite["runs"][n], where), "train", "ag_max"),
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
