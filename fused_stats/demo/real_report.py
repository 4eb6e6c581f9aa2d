"""The real-model demo's outputs: the summary, the Markdown tables, two plots, written atomically.

Role: turn :func:`fused_stats.demo.real.run_real_demo`'s result dict into ``real_demo.json``,
``real_demo.md``, ``real_profile.png`` (per layer against depth: ``d_align``, ``|μ|²``,
``|C|_F²`` with its null SE, ``AG_max``) and ``real_certificate.png`` (the certificate ``B_exact``
against the empirical misalignment at each ``(M, K)``). A value that is not estimable is None in the
JSON, "—" in the tables and absent from the plots, never nan or inf.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..accumulators.cross_estimators import saturation_line
from ..accumulators.estimators import D_ALIGN_READING
from ..accumulators.persistence import write_atomic

FILES = {
    "json": "real_demo.json",
    "md": "real_demo.md",
    "profile": "real_profile.png",
    "cert": "real_certificate.png",
}


def fmt(value, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)


def _range(values, spec: str = ".3g") -> str:
    values = [v for v in values if v is not None]
    return f"{fmt(min(values), spec)}–{fmt(max(values), spec)}" if values else "—"


def summary_lines(result: dict) -> list[str]:
    """The short answer: what the real model says, one line per question."""
    rows = result["points"]
    L = len(rows)
    d = [r["d_align"] for r in rows]
    d_known = sorted(v for v in d if v is not None)
    median = d_known[len(d_known) // 2] if d_known else None
    pairs = [s for r in rows for s in r["splits"]]
    bounded = sum(1 for s in pairs if s["bounded"])
    not_saturated = sum(1 for r in rows if r["saturation"].get("saturated") is False)
    cert = rows[0]["certificate"]
    lines = [
        f"- Model: {result['model']['source']}; test loss {result['data']['test_loss']:.3f} nats/token on "
        f"{result['data']['test_sequences']} held-out sequences of {result['data']['seq_len']} tokens.",
        f"- d_align over the {L} residual points: {_range(d)} (median {fmt(median)}), from "
        f"{result['data']['train_sequences']} + {result['data']['test_sequences']} sequences pooled.",
        f"- Certificate at M = K = {cert['M']}: B_exact {_range(r['certificate']['b_exact'] for r in rows)} "
        "across the points.",
        f"- Empirical misalignment at or below B_exact (within 2 Monte Carlo SE) at {bounded} of "
        f"{len(pairs)} (point, M, K) pairs.",
        f"- Depth saturation (rank-{result['config']['cross_rank']} zero block, each point's own test at "
        f"alpha 0.05): {not_saturated} of {L} points not saturated.",
    ]
    for kind in ("zero bias", "zero layer"):
        for opt in ("SGD", "AdamW"):
            ratios = [
                r["ratio"]
                for item in result["interventions"]
                if item["kind"] == kind
                for r in item["rows"]
                if r["optimizer"] == opt
            ]
            lines.append(
                f"- {kind}, {opt} first step: measured (central difference) / predicted {_range(ratios, '.4f')} "
                f"over {len(ratios)} steps."
            )
    return lines


def markdown(result: dict) -> str:
    m, data, machine = result["model"], result["data"], result["machine"]
    lines = [
        f"# fused_stats on a real pretrained LLM: {m['name']}",
        "",
        f"{m['class']}, {m['parameters'] / 1e6:.1f}M parameters: {m['source']} (dequantised Q4 weights are a "
        "real model, not the original full-precision one). Text: "
        f"{data['text']}; {data['train_sequences']} train and {data['test_sequences']} test sequences of "
        f"{data['seq_len']} tokens. {machine['platform']}, torch {machine['torch']}, {machine['threads']} "
        f"threads, {machine['date']}; {result['seconds']['total']:.0f} s.",
        "",
        "## The answer",
        "",
        *summary_lines(result),
        "",
        f"How to read d_align: {D_ALIGN_READING}",
        "",
        "## Per residual point",
        "",
        'Moments of the train and test sequences pooled (unbiased; `unit="sample"`, one vector per '
        "sequence). Certificate and misalignment at "
        f"M = K = {result['points'][0]['certificate']['M']}. ‖C‖_F²: a rank-{result['config']['cross_rank']} "
        "zero-output block's cross-gradient on the train stream, tested for C = 0 with its null SE.",
        "",
        "| point | ‖μ‖² | d_par | d_2 | d_align | B_align | B_exact | misaligned | ‖C‖_F² | SE (H0) | p | saturated | AG_max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["points"]:
        c, s = r["certificate"], r["saturation"]
        emp = next((x for x in r["splits"] if (x["M"], x["K"]) == (c["M"], c["K"])), None)
        lines.append(
            f"| {r['point']} | {fmt(r['mu_norm2'])} | {fmt(r['d_par'])} | {fmt(r['d_2'])} | {fmt(r['d_align'])} "
            f"| {fmt(c['b_align'])} | {fmt(c['b_exact'])} | {fmt(emp['misalignment'] if emp else None)} "
            f"| {fmt(s.get('cross_frob2'))} | {fmt(s.get('cross_frob2_se_null'))} | {fmt(s.get('p_value'))} "
            f"| {'no' if s.get('saturated') is False else 'yes' if s.get('saturated') else '—'} | {fmt(r['ag_max'])} |"
        )
    reasons = [
        (r["point"], k, v) for r in result["points"] for k, v in (r.get("not_estimable") or {}).items()
    ]
    if reasons:
        lines += ["", *(f"- `{p}`: {k} not estimable: {why}" for p, k, why in reasons)]
    lines += [
        "",
        "## Certificate against the empirical misalignment",
        "",
        "B_exact bounds Pr(μ_Mᵀg_K ≤ 0) (Cantelli); the empirical value is the fraction of "
        f"{result['config']['trials']} random disjoint (M, K) splits of the pooled sequences with "
        "μ_Mᵀg_K ≤ 0 (± its Monte Carlo SE).",
        "",
        "| M = K | B_align (median) | B_exact (median) | misaligned (median) | bounded |",
        "|---:|---:|---:|---:|---:|",
    ]
    for k, split in enumerate(result["points"][0]["splits"]):
        col = [r["splits"][k] for r in result["points"]]

        def med(key, col=col):
            vals = sorted(x[key] for x in col if x[key] is not None)
            return vals[len(vals) // 2] if vals else None

        held = sum(1 for x in col if x["bounded"])
        lines.append(
            f"| {split['M']} | {fmt(med('b_align'))} | {fmt(med('b_exact'))} | {fmt(med('misalignment'))} "
            f"| {held} of {len(col)} |"
        )
    lines += ["", "## Would one more zero layer help? (the exact tangent of a new decoder layer)", ""]
    for point, sat in result["layer_saturation"].items():
        lines.append(f"- after `{point}`: {saturation_line(sat)}")
    lines += [
        "",
        "## Direct interventions",
        "",
        "One first step of torch's SGD and AdamW (zero state, defaults) on a parameter inserted at zero; "
        "measured = (L(θ₀ + Δ) − L(θ₀ − Δ))/2 on the test sequences (the step against its mirror: the "
        "curvature term cancels), predicted = the probe's first-order change. Step sizes are set from the "
        "train stream alone, so that the train-side prediction is "
        f"{', '.join(f'−{t:g}' for t in result['config']['targets'])} nats.",
        "",
    ]
    from .real_intervene import intervention_lines

    for item in result["interventions"]:
        lines += [*intervention_lines(item), ""]
    return "\n".join(lines).rstrip() + "\n"


def _plot_profile(result: dict, path: Path) -> None:
    from ..api.report.plots import figure_classes, save_figure

    Figure, Canvas = figure_classes()
    rows = result["points"]
    depth = list(range(1, len(rows) + 1))
    fig = Figure(figsize=(11, 7.5))
    Canvas(fig)
    axes = fig.subplots(2, 2, sharex=True)
    panels = (
        (axes[0][0], "d_align", "d_align (pooled)", lambda r: r["d_align"]),
        (axes[0][1], "mu_norm2", "‖μ‖² (train + test)", lambda r: r["mu_norm2"]),
        (
            axes[1][0],
            "cross",
            f"|C|_F² (rank-{result['config']['cross_rank']} zero block, train)",
            lambda r: r["saturation"].get("cross_frob2"),
        ),
        (axes[1][1], "ag_max", "AG_max = max_i ‖q_i‖", lambda r: r["ag_max"]),
    )
    for ax, key, title, get in panels:
        xs = [x for x, r in zip(depth, rows) if get(r) is not None and get(r) > 0]
        ys = [get(r) for r in rows if get(r) is not None and get(r) > 0]
        if key == "cross":
            saturated = [r["saturation"].get("saturated") for r in rows if get(r) is not None and get(r) > 0]
            se = [
                r["saturation"].get("cross_frob2_se_null") or 0.0
                for r in rows
                if get(r) is not None and get(r) > 0
            ]
            ax.errorbar(xs, ys, yerr=se, fmt="none", ecolor="0.6", label="± SE under H0 (the test's)")
            ax.scatter(
                [x for x, s in zip(xs, saturated) if s is False],
                [y for y, s in zip(ys, saturated) if s is False],
                color="tab:red",
                zorder=3,
                label="not saturated (p ≤ 0.05)",
            )
            ax.scatter(
                [x for x, s in zip(xs, saturated) if s is not False],
                [y for y, s in zip(ys, saturated) if s is not False],
                color="tab:blue",
                zorder=3,
                label="saturated",
            )
            ax.legend(fontsize=8)
        else:
            ax.plot(xs, ys, marker="o", color="tab:blue")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("residual point (after block k)")
    fig.suptitle(
        f"{result['model']['name']}: statistics at each residual point ({result['model']['source'][:60]}…)",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def _plot_certificate(result: dict, path: Path) -> None:
    from ..api.report.plots import figure_classes, save_figure

    Figure, Canvas = figure_classes()
    fig = Figure(figsize=(6.5, 5.5))
    Canvas(fig)
    ax = fig.subplots()
    splits = result["points"][0]["splits"]
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for k, split in enumerate(splits):
        b = [r["splits"][k]["b_exact"] for r in result["points"]]
        e = [r["splits"][k]["misalignment"] for r in result["points"]]
        ax.scatter(
            b, [max(v, 1e-4) for v in e], s=18, color=colors[k % len(colors)], label=f"M = K = {split['M']}"
        )
    ax.plot([1e-4, 1], [1e-4, 1], color="0.3", lw=1, label="misaligned = B_exact")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("certificate B_exact (upper bound)")
    ax.set_ylabel("empirical Pr(μ_Mᵀg_K ≤ 0) (0 drawn at 1e-4)")
    ax.set_title("Below the line: the bound holds (one dot per residual point)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    """Write the four files into ``out`` (each atomically); returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {key: out / name for key, name in FILES.items()}
    _plot_profile(result, paths["profile"])
    _plot_certificate(result, paths["cert"])
    write_atomic(paths["md"], markdown(result).encode("utf-8"))
    write_atomic(paths["json"], (json.dumps(result, indent=1, allow_nan=False) + "\n").encode("utf-8"))
    return paths
