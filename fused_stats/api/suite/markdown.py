"""The suite's comparison as markdown: one table per statistic (runs × relative depths), the
run-level statistics, the trends (Spearman's ρ with its permutation p-value, per group of runs
holding the other design labels fixed) and, with ``[growth]``, the depth-sufficiency table.
The values come from :mod:`fused_stats.api.suite.cells`; this module only lays them out.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..report.document import fmt
from .cells import (
    column_text,
    columns,
    design_labels,
    relative_depths,
    run_order,
    statistics,
    trend_groups,
    trend_rows,
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | would end the table cell


def render_markdown(suite: dict) -> str:
    names = run_order(suite)
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
