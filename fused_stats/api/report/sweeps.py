"""Sweeps over several reports: one row per report, the sweep table and its trend sentences.

Role: a width or depth sweep groups reports by the sweep variable (``meta["width"]`` /
``meta["depth"]``, else the model config's ``hidden_size`` / ``num_hidden_layers``), shows the
median [min, max] over the runs at each value, and for the key quantities Spearman's ρ against the
variable with a permutation p-value (:mod:`fused_stats.accumulators.trends`). No statistic is
computed here beyond those summaries of what the reports hold.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from ...accumulators import trends
from ...accumulators.trends import cosine as trend_cosine
from ...accumulators.trends import median
from ...errors import FusedStatsError
from .schema import cell, finite, fmt, is_int

# where a report without meta[x] keeps its width or depth: the HF config sizes (GPT-2's n_embd and
# n_layer read as these through its attribute_map), else the probe's own summary of the model
# (its "width" attribute, its number of residual points), as model_summary records them
SWEEP_CONFIG_KEYS = {"width": ("hidden_size", "width"), "depth": ("num_hidden_layers", "depth")}


def sweep_value(report, x: str):
    """``report``'s value of the sweep variable ``x``: ``meta[x]`` (as the demo and users set it),
    else the first of :data:`SWEEP_CONFIG_KEYS` in the model config; None when neither exists."""
    if x in report.meta:
        return report.meta[x]
    config = report.model["config"]
    return next((config[k] for k in SWEEP_CONFIG_KEYS.get(x, ()) if is_int(config.get(k))), None)


def sweep_rows(reports: list, x: str, point: str | int = "last") -> list[dict]:
    """One flat row per report: x value, seed and the chosen point's numbers (for tables/plots)."""
    rows = []
    for r in reports:
        if not (hasattr(r, "meta") and hasattr(r, "points") and hasattr(r, "model")):
            raise FusedStatsError(f"plot_sweep takes Report objects, got {type(r).__name__}")
        xv = sweep_value(r, x)
        if xv is None:
            raise FusedStatsError(
                f"report of {r.model['class']} has no meta[{x!r}] (meta keys: {sorted(r.meta)}) "
                f"and no config {' / '.join(SWEEP_CONFIG_KEYS[x])}; a {x} sweep needs one in every report"
            )
        p = pick_point(r, point)
        tr, cert, mis, sat = p["train"], p["certificate"], p["misalignment"], p["saturation"]
        # optional: mean token norm of the stream at each point, recorded by the demo
        norms = r.meta.get("stream_norm")
        norm = norms.get(p["name"]) if isinstance(norms, dict) else None
        rows.append(
            {
                "x": xv,
                "seed": r.meta.get("seed"),
                "point": p["name"],
                "d_align": finite(cell(tr, "d_align")),
                "ag_max": finite(cell(tr, "ag_max")),
                "ag_mean": finite(cell(tr, "ag_mean")),
                "b_align": finite(cell(cert, "b_align")),
                "b_exact": finite(cell(cert, "b_exact")),
                "misalignment": finite(cell(mis, "probability")),
                "realized_alignment": finite(p["realized_alignment"]),
                "cosine": finite(cosine(p)),
                "d_par": finite(cell(tr, "d_par")),
                "d_2": finite(cell(tr, "d_2")),
                "cross_frob2": finite(cell(sat, "cross_frob2")),
                "test_loss": finite(r.meta.get("test_loss")),
                "stream_norm": finite(norm),
                "ag_max_scaled": (
                    None
                    if norm is None or finite(cell(tr, "ag_max")) is None
                    else cell(tr, "ag_max") * norm / math.sqrt(p["dim"])
                ),
            }
        )
    return rows


def cosine(point: dict) -> float | None:
    """Estimated cosine of the train and test mean gradients at a report point
    (:func:`fused_stats.accumulators.trends.cosine`)."""
    tr, te = point["train"], point["test"]
    if tr is None or te is None:
        return None
    return trend_cosine(point["realized_alignment"], tr.get("mu_norm2"), te.get("mu_norm2"))


# what a sweep table shows per x value: (column title, row key), and the trend checked
SWEEP_COLUMNS = {
    "width": (
        ("d_align", "d_align"),
        ("d_par", "d_par"),
        ("d_2", "d_2"),
        ("cos(train,test)", "cosine"),
        ("B_exact", "b_exact"),
        ("misalignment", "misalignment"),
        ("test loss", "test_loss"),
    ),
    "depth": (
        ("AG_max", "ag_max"),
        ("AG_mean", "ag_mean"),
        ("|z|", "stream_norm"),
        ("AG_max*|z|/sqrt(d)", "ag_max_scaled"),
        ("|C|_F^2", "cross_frob2"),
        ("test loss", "test_loss"),
    ),
}


SWEEP_TRENDS = {
    "width": ("d_align", "misalignment"),
    "depth": ("ag_max", "ag_max_scaled", "cross_frob2", "test_loss"),
}


def sweep_summary(reports: Iterable, x: str, point: str | int = "last", permutations: int = 10_000) -> str:
    """A text table of a sweep (median [min, max] over the reports at each x value) and, for the
    sweep's key quantities, Spearman's ρ against x over all reports with a permutation p-value
    and a plain-words reading that says when no trend is visible."""
    if x not in SWEEP_COLUMNS:
        raise FusedStatsError(f"sweep_summary: x must be 'width' or 'depth', got {x!r}")
    rows = sweep_rows(list(reports), x, point)
    columns = [(t, k) for t, k in SWEEP_COLUMNS[x] if any(r.get(k) is not None for r in rows)]
    groups = defaultdict(list)
    for r in rows:
        groups[r["x"]].append(r)
    head = [x, "runs"] + [t for t, _ in columns]
    table = [head]
    for xv in sorted(groups):
        line = [str(xv), str(len(groups[xv]))]
        for _, key in columns:
            vals = [r[key] for r in groups[xv] if r.get(key) is not None]
            if not vals:
                line.append("—")
            elif len(vals) == 1:
                line.append(fmt(vals[0], ".3g"))
            else:
                line.append(f"{fmt(median(vals), '.3g')} [{fmt(min(vals), '.3g')}, {fmt(max(vals), '.3g')}]")
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    out = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
    where = f"the {point} residual point of each model" if point in ("last", "first") else f"point {point!r}"
    out.append(f"(median [min, max] over the runs at each {x}, at {where}; {len(rows)} runs)")
    for key in SWEEP_TRENDS[x]:
        if any(r.get(key) is not None for r in rows):
            out.append(trend_sentence(rows, x, key, permutations))
    return "\n".join(out)


def trend_sentence(rows: list[dict], x: str, key: str, permutations: int = 10_000) -> str:
    """Spearman's ρ of ``key`` against ``x`` over sweep rows, with its permutation p-value, in
    words (:func:`fused_stats.accumulators.trends.trend_sentence`)."""
    pairs = [(r["x"], r[key]) for r in rows if r.get(key) is not None]
    return trends.trend_sentence([a for a, _ in pairs], [b for _, b in pairs], x, key, permutations)


def pick_point(report, point) -> dict:
    """The point ``point`` of ``report``: "last", "first", an index or a name."""
    pts = report.points
    if not pts:
        raise FusedStatsError(f"report of {report.model['class']} has no points")
    if point == "last":
        return pts[-1]
    if point == "first":
        return pts[0]
    if is_int(point):
        for p in pts:
            if p["index"] == point:
                return p
        raise FusedStatsError(f"report has no point with index {point}; indices: {[p['index'] for p in pts]}")
    return report.point(point)
