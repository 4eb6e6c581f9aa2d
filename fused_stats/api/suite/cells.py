"""The suite's statistics over runs × points: cells aligned by relative depth, and their trends.

Points are aligned across depths by relative depth ``(j + 1) / P``, where ``j`` is the point's
index among the model's own residual points (:func:`fused_stats.residual_points`, recorded in the
run file) and ``P`` their number: the residual stream after block ``j + 1`` of ``P``, whichever
points the suite file lists. A point off the residual stream has no relative depth; its column is
its name. A trend of a statistic against a label is measured within each group of runs that hold
the other design labels (width, depth, step, model_type and hand-set labels) fixed;
``parameters`` follows from width and depth, so its groups hold only the rest fixed. Run-level
statistics (the held-out loss in nats per counted token, and with a ``[growth]`` section the
largest ``|C|_F²`` over the protocol's candidates, whatever its verdict, so every run has one)
trend the same way. Each trend is Spearman's ρ with the two-sided permutation p-value of
:func:`fused_stats.accumulators.trends.rank_correlation`, exact (every re-pairing enumerated) up
to 8 runs a group.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ...accumulators.trends import rank_correlation

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


def budget_point(entry, b: int, name: str) -> dict:
    return entry["budgets"][b]["points"].get(name, {}) if entry["budgets"] else {}


def nested(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def statistics(suite: dict) -> list[tuple[str, object]]:
    """``(title, cell(entry, point) -> value)`` for every table."""
    stats = [
        ("d_align (train)", lambda e, p: nested(p, "train", "d_align")),
        ("d_par (train)", lambda e, p: nested(p, "train", "d_par")),
        ("d_2 (train)", lambda e, p: nested(p, "train", "d_2")),
        ("AG_max (train)", lambda e, p: nested(p, "train", "ag_max")),
    ]
    for b, (M, K) in enumerate(suite["settings"]["splits"]):
        stats.append(
            (
                f"B_exact at M={M}, K={K}",
                lambda e, p, b=b: nested(budget_point(e, b, p["name"]), "certificate", "b_exact"),
            )
        )
        stats.append(
            (
                f"misalignment Pr(μ_Mᵀg_K ≤ 0) at M={M}, K={K}",
                lambda e, p, b=b: nested(budget_point(e, b, p["name"]), "misalignment", "probability"),
            )
        )
    if suite["settings"].get("cross"):
        stats.append(("|C|²_F (cross_frob2)", lambda e, p: nested(p, "saturation", "cross_frob2")))
    return stats


def max_cross_frob2(entry: dict) -> float | None:
    """The largest ``|C|_F²`` among a run's growth candidates (None without advice)."""
    ranked = nested(entry, "advice", "ranked") or []
    values = [c["cross_frob2"] for c in ranked if isinstance(c.get("cross_frob2"), (int, float))]
    return max(values) if values else None


def run_statistics(suite: dict) -> list[tuple[str, object]]:
    """``(title, value(entry))`` for the statistics a run has once, not per point."""
    stats = [("test loss (nats/token)", lambda e: e.get("test_loss"))]
    if suite.get("growth"):
        stats.append(("max |C|²_F over the growth candidates", max_cross_frob2))
    return stats


def run_order(suite: dict) -> list[str]:
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


def pick_point(entry: dict, where: str):
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
                point = pick_point(done[n], where)
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
