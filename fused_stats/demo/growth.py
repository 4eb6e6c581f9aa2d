"""Grown vs scratch in miniature: does the advisor's choice of insertion point pay off?

Role: the growth experiment of both source papers on the demo's corpus (:mod:`.corpus`) and
models (:mod:`.models`), small enough for a few minutes on 2 CPU cores. Per seed the experiment
(:mod:`.growth_arms`: its arms and the realised quantities) trains a shallow model, probes and
advises it, grows it at every candidate and trains on, trains the deeper model from scratch, and
scores every candidate before growth against its new layer trained alone. This module summarises
the seeds into tables, a figure and the record the CLI writes. Per score, seed and realised
quantity (:data:`REALISED`: the drop of the new layer trained alone, and the gain after
continued training), Spearman's ρ and its exact permutation p-value
(:func:`fused_stats.accumulators.trends.rank_correlation`); pooled over seeds, the mean of the
per-seed ρ with a stratified permutation test (:func:`stratified_rank_test`: candidates shuffled
within each seed, exact when there are at most ``10_000`` joint permutations) and the exact
sign-flip test of the per-seed ρ (:func:`paired_test`).

The scores answer "does a descent direction exist at this point, and how steep is it for one
small step"; the realised quantities answer "which point gains most after a few Adam steps of
the new layer" and "after training the grown model on": the rank correlations check the first
against the second.

Held-out loss: mean next-byte cross-entropy on ``eval_batches`` batches of held-out files. Arms
are compared across seeds by the paired difference to ``scratch_flops`` (mean, sd, range) and an
exact sign-flip permutation test of the mean paired difference (2^seeds assignments). The text
states what the runs show, whatever it is.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from ..api.growth.protocol import DEFAULT_SCORE
from ..errors import FusedStatsError
from .growth_arms import (  # noqa: F401  (re-exported)
    ARMS,
    REALISED,
    SCORES,
    GrowthDemoConfig,
    run_seed,
    scores_before_growth,
    training_flops_per_token,
)

# each check of the scores: the realised quantity, whether the input boundary is left out (its
# features and stream gradient are on another scale than inside the stack), what the table's
# header says (formatted with the config) and what the verdict calls it
SCORE_CHECKS = {
    "drop_alone": (
        "candidate_drop",
        False,
        "the held-out drop of a zero layer trained alone for {short_steps} AdamW steps, {candidates} candidates",
        "the drop of the new layer trained alone",
    ),
    "gain_continued": (
        "candidate_gain_continued",
        False,
        "the held-out gain over no growth after {steps2} steps of the whole grown model, {candidates} candidates",
        "the gain over no growth after continued training",
    ),
    "gain_continued_blocks": (
        "candidate_gain_continued",
        True,
        "the same gain over the {depth} block outputs only (the input boundary left out)",
        "that gain over the block outputs only",
    ),
}
SCORE_LABELS = {
    "cross_frob2": "|C|_F²",
    "signal_fraction": "signal fraction |C|²/E|c|²",
    "gain_sgd": "SGD first step ⟨C_M,C_K⟩",
    "gain_adam": "Adam first step ⟨s_M,C_K⟩",
    "split_adam": "split Adam ⟨s_A,C_B⟩",
    "curvature_gain": "curvature gain |g|⁴/2gᵀHg",
}


def paired_test(diffs: list[float]) -> float:
    """Two-sided exact sign-flip permutation p-value of the mean of paired differences."""
    n = len(diffs)
    if n == 0:
        return math.nan
    observed = abs(sum(diffs)) - 1e-12
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, diffs))) >= observed
        for signs in itertools.product((1, -1), repeat=n)
    )
    return hits / 2**n


def stratified_rank_test(groups, permutations: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Mean over groups (seeds) of Spearman's ρ of paired ``(xs, ys)``, and its two-sided
    permutation p-value with the ``ys`` shuffled within each group independently (the null: no
    relation within any seed). Exact over all joint permutations when there are at most
    ``permutations`` of them, else ``(hits + 1)/(permutations + 1)`` from random ones. Groups
    whose ρ is undefined (constant side, fewer than 3 finite pairs) are left out."""
    import numpy as np

    from ..accumulators.trends import _finite_pairs, average_ranks

    centred = []
    for xs, ys in groups:
        pairs = _finite_pairs(xs, ys)
        if len(pairs) < 3:
            continue
        rx = average_ranks([a for a, _ in pairs])
        ry = average_ranks([b for _, b in pairs])
        cx, cy = rx - rx.mean(), ry - ry.mean()
        scale = math.sqrt(float(cx @ cx) * float(cy @ cy))
        if scale > 0:
            centred.append((cx / scale, cy))
    if not centred:
        return math.nan, math.nan
    observed = sum(float(cx @ cy) for cx, cy in centred) / len(centred)
    threshold = abs(observed) - 1e-12
    joint = math.prod(math.factorial(len(cy)) for _, cy in centred)
    if joint <= permutations:
        per_group = [np.array(list(itertools.permutations(cy))) @ cx for cx, cy in centred]
        means = sum(np.meshgrid(*per_group, indexing="ij")) / len(centred)
        return observed, float((np.abs(means) >= threshold).mean())
    rng = np.random.default_rng(seed)
    total = np.zeros(permutations)
    for cx, cy in centred:
        total += rng.permuted(np.tile(cy, (permutations, 1)), axis=1) @ cx
    hits = int((np.abs(total / len(centred)) >= threshold).sum())
    return observed, (hits + 1) / (permutations + 1)


def _spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else math.nan,
        "min": min(values),
        "max": max(values),
    }


def _finite(value) -> float:
    return math.nan if value is None else float(value)


def summarize(cfg: GrowthDemoConfig, runs: list[dict]) -> tuple[dict, list[str]]:
    """Spread over seeds per arm, paired differences to ``scratch_flops`` with the sign-flip
    test, every candidate's gain after continued training, the rank correlations of every score
    with both realised quantities, and sentences saying what the runs show."""
    table = {a: _spread([r["arms"][a]["held_out_loss"] for r in runs]) for a in ARMS}
    paired = {}
    for arm in ARMS:
        if arm == "scratch_flops":
            continue
        diffs = [r["arms"][arm]["held_out_loss"] - r["arms"]["scratch_flops"]["held_out_loss"] for r in runs]
        paired[arm] = {**_spread(diffs), "p_value": paired_test(diffs), "wins": sum(d < 0 for d in diffs)}
    top_vs_last = [r["arms"]["top"]["held_out_loss"] - r["arms"]["last"]["held_out_loss"] for r in runs]
    agreement = stratified_rank_test(
        [tuple([r[key][c] for c in r["candidates"]] for key in REALISED) for r in runs]
    )
    summary = {
        "held_out_loss": table,
        "paired_vs_scratch_flops": paired,
        "top_minus_last": {**_spread(top_vs_last), "p_value": paired_test(top_vs_last)},
        "gain_continued_by_candidate": _gain_by_candidate(runs),
        "drop_vs_gain_continued": {"mean_rho": agreement[0], "p_stratified_permutation": agreement[1]},
        "saturated_everywhere": [r["advice"]["saturated_everywhere"] for r in runs],
        "scores": {check: _score_summary(runs, *SCORE_CHECKS[check][:2]) for check in SCORE_CHECKS},
    }
    n = len(runs)
    lines = [
        f"Held-out loss (nats/byte) over {n} seeds, width {cfg.width}, depth {cfg.depth} -> {cfg.depth + 1}:",
        f"{'arm':<14} {'mean':>8} {'sd':>8} {'min':>8} {'max':>8}   vs scratch_flops: mean diff, wins, p",
    ]
    for arm in ARMS:
        t = table[arm]
        row = f"{arm:<14} {t['mean']:8.4f} {t['sd']:8.4f} {t['min']:8.4f} {t['max']:8.4f}"
        if arm in paired:
            d = paired[arm]
            row += f"   {d['mean']:+.4f}, {d['wins']}/{n}, p = {d['p_value']:.3f}"
        lines.append(row)
    t = summary["top_minus_last"]
    lines.append(
        f"advisor's top minus its last candidate: mean {t['mean']:+.4f} (range {t['min']:+.4f} .. "
        f"{t['max']:+.4f}), sign-flip p = {t['p_value']:.3f}"
    )
    sat = summary["saturated_everywhere"]
    lines.append(
        f"advisor verdict: saturated everywhere in {sum(sat)} of {n} seeds (Holm-Bonferroni, alpha {cfg.alpha})"
    )
    lines += _gain_lines(summary, cfg, n)
    for check in SCORE_CHECKS:
        lines += _score_lines(summary["scores"][check], cfg, n, check)
    lines += _verdict(summary, runs)
    return summary, lines


def _gain_by_candidate(runs: list[dict]) -> dict:
    """Per boundary (the same list in every seed): the spread over seeds of its gain over no
    growth after continued training, in how many seeds it was positive, and in how many it was
    the seed's largest."""
    out = {}
    for c in runs[0]["candidates"]:
        values = [r["candidate_gain_continued"][c] for r in runs]
        best = sum(max(r["candidates"], key=r["candidate_gain_continued"].get) == c for r in runs)
        out[c] = {**_spread(values), "positive": sum(v > 0 for v in values), "best": best}
    return out


def _gain_lines(summary: dict, cfg: GrowthDemoConfig, n: int) -> list[str]:
    lines = [
        f"Where growth helps: held-out gain over no growth (the 'stay' arm) after {cfg.steps2} more steps of "
        "the whole model grown by one zero layer at each boundary (positive: the layer helped):",
        f"{'boundary':<20} {'mean':>8} {'sd':>8} {'min':>8} {'max':>8} {'gain>0':>7} {'best':>5}",
    ]
    for c, v in summary["gain_continued_by_candidate"].items():
        lines.append(
            f"{c:<20} {v['mean']:+8.4f} {v['sd']:8.4f} {v['min']:+8.4f} {v['max']:+8.4f} "
            f"{v['positive']:>4}/{n:<2} {v['best']:>3}/{n}"
        )
    a = summary["drop_vs_gain_continued"]
    lines.append(
        f"drop of the new layer trained alone vs gain after continued training: mean per-seed rho "
        f"{a['mean_rho']:+.2f} (stratified permutation p = {a['p_stratified_permutation']:.3f})"
    )
    return lines


def _pairs(run: dict, key: str, blocks_only: bool, name: str) -> tuple[list[str], list[float], list[float]]:
    """One seed's checked candidates, the score ``name`` of each before growth (NaN where
    undefined) and the realised quantity ``key``; ``blocks_only`` leaves the input boundary out."""
    points = [c for c in run["candidates"] if not (blocks_only and c == run["input_point"])]
    return points, [_finite(run["candidate_scores"][c][name]) for c in points], [run[key][c] for c in points]


def _rhos(runs: list[dict], key: str, blocks_only: bool, name: str) -> list[float]:
    """Spearman's ρ per seed of the score ``name`` with the realised quantity ``key``."""
    from ..accumulators.trends import rank_correlation

    return [rank_correlation(*_pairs(r, key, blocks_only, name)[1:])[0] for r in runs]


def _score_summary(runs: list[dict], key: str, blocks_only: bool) -> dict:
    """Per score: the per-seed ρ with the realised quantity ``key`` (:data:`REALISED`), their
    mean with the stratified permutation p, the sign-flip p of the per-seed ρ, the per-seed
    difference to the protocol's default score's ρ with its sign-flip p (does another score
    rank better? None for the default itself), and how often the score's top candidate (its
    unique largest value) was the candidate of largest realised value."""
    default_rhos = _rhos(runs, key, blocks_only, DEFAULT_SCORE)
    out = {}
    for name in SCORES:
        groups, hits = [], 0
        for r in runs:
            points, xs, ys = _pairs(r, key, blocks_only, name)
            groups.append((xs, ys))
            finite = [x for x in xs if math.isfinite(x)]
            # the score's top: its unique largest finite value (a constant score has none)
            tops = [c for c, x in zip(points, xs) if finite and x == max(finite)]
            hits += len(tops) == 1 and tops[0] == points[ys.index(max(ys))]
        rhos = _rhos(runs, key, blocks_only, name)
        defined = [v for v in rhos if not math.isnan(v)]
        versus = [v for v in (a - b for a, b in zip(rhos, default_rhos)) if not math.isnan(v)]
        mean_rho, p_perm = stratified_rank_test(groups)
        out[name] = {
            "rho_per_seed": rhos,
            "mean_rho": mean_rho,
            "p_stratified_permutation": p_perm,
            "p_sign_flip": paired_test(defined),
            "positive_seeds": sum(v > 0 for v in defined),
            "seeds_defined": len(defined),
            "minus_default": None
            if name == DEFAULT_SCORE
            else {
                "default": DEFAULT_SCORE,
                "mean": statistics.fmean(versus) if versus else math.nan,
                "p_sign_flip": paired_test(versus),
            },
            "top_is_best": hits,
        }
    return out


def _score_lines(scores: dict, cfg: GrowthDemoConfig, n: int, check: str) -> list[str]:
    header = SCORE_CHECKS[check][2].format(candidates=cfg.depth + 1, **asdict(cfg))
    default = DEFAULT_SCORE
    lines = [
        f"Which candidate: Spearman rho of each score (before growth) with {header} per seed:",
        f"{'score':<16} {'rho per seed':<{7 * n}} {'mean':>6} {'p perm':>7} {'p flip':>7} {'rho>0':>6} "
        f"{'top=best':>8}  {'- ' + default:>15} {'p flip':>7}",
    ]
    for name in SCORES:
        v = scores[name]
        per_seed = " ".join(f"{x:+.2f}" if not math.isnan(x) else "  nan" for x in v["rho_per_seed"])
        d = v["minus_default"]
        versus = f"{'':>15} {'':>7}" if d is None else f"{d['mean']:+15.2f} {d['p_sign_flip']:7.3f}"
        lines.append(
            f"{name:<16} {per_seed:<{7 * n}} {v['mean_rho']:+6.2f} {v['p_stratified_permutation']:7.3f} "
            f"{v['p_sign_flip']:7.3f} {v['positive_seeds']:>3}/{v['seeds_defined']:<2} {v['top_is_best']:>5}/{n}  "
            + versus
        )
    lines.append(
        "(p perm: candidates shuffled within each seed, statistic the mean rho; p flip: exact sign-flip of "
        f"the per-seed rho, smallest attainable {2 / 2**n:.3f}; top=best: seeds where the score's top "
        f"candidate had the largest realised value; - {default}: mean per-seed rho minus that of the "
        "protocol's default score, with its sign-flip p)"
    )
    return lines


def _verdict(summary: dict, runs: list[dict]) -> list[str]:
    """What the runs show, in words (whatever they show)."""
    out, n, default = [], len(runs), DEFAULT_SCORE
    p = summary["paired_vs_scratch_flops"]
    min_p = 2 / 2**n
    for arm, label in (
        ("top", "grown at the advisor's top candidate (not grown where it found none significant)"),
        ("scratch_steps", "scratch at equal steps"),
    ):
        d = p[arm]
        direction = "lower" if d["mean"] < 0 else "higher"
        sig = "significant" if d["p_value"] <= 0.05 else "not significant"
        out.append(
            f"- {label}: held-out loss {direction} than scratch at equal FLOPs by {abs(d['mean']):.4f} on "
            f"average ({d['wins']}/{n} seeds lower; paired sign-flip p = {d['p_value']:.3f}, {sig}"
            + (f"; with {n} seeds the smallest attainable p is {min_p:.3f}" if min_p > 0.05 else "")
            + ")."
        )
    t = summary["top_minus_last"]
    out.append(
        "- the block placed at the advisor's top candidate ended "
        + ("lower" if t["mean"] < 0 else "not lower")
        + f" than at its last-ranked one (mean difference {t['mean']:+.4f}, sign-flip p = {t['p_value']:.3f}, "
        + ("significant" if t["p_value"] <= 0.05 else "not significant")
        + ")."
    )
    gains = summary["gain_continued_by_candidate"]
    positive = sum(v["positive"] for v in gains.values())
    out.append(
        f"- a zero layer beat no growth after continued training in {positive} of {n * len(gains)} "
        "(seed, boundary) pairs."
    )
    # the verdict's significance filter against the ranking alone: where the first-ranked
    # candidate was not Holm-significant, what growing there would have gained instead
    filtered = [r for r in runs if r["arms"]["top"]["point"] != r["advice"]["ranked"][0]["point"]]
    if filtered:
        first = [r["candidate_gain_continued"][r["advice"]["ranked"][0]["point"]] for r in filtered]
        top = [r["arms"]["stay"]["held_out_loss"] - r["arms"]["top"]["held_out_loss"] for r in filtered]
        out.append(
            f"- in {len(filtered)} of {n} seeds (" + ", ".join(str(r["seed"]) for r in filtered) + ") the "
            "advisor's first-ranked candidate was not Holm-significant, so its top was another candidate or "
            f"none; there the first-ranked one gained {statistics.fmean(first):+.4f} on average after "
            f"continued training, the advisor's top {statistics.fmean(top):+.4f}."
        )
    for run in runs:
        if run["advice"]["saturated_everywhere"]:
            realised = run["candidate_gain_continued"]
            best = max(realised, key=realised.get)
            out.append(
                f"- seed {run['seed']} was saturated everywhere (no boundary significant after Holm), yet "
                f"a zero layer gained after continued training at {sum(v > 0 for v in realised.values())} "
                f"of {len(realised)} boundaries (largest {realised[best]:+.4f} at {best}): the test found no "
                "first-order descent direction at this probe size, which is not evidence that none exists."
                if any(v > 0 for v in realised.values())
                else f"- seed {run['seed']} was saturated everywhere, and no zero layer gained after continued "
                "training at any boundary."
            )
    for check, (*_, label) in SCORE_CHECKS.items():
        scores = summary["scores"][check]
        significant = [m for m in SCORES if scores[m]["p_stratified_permutation"] <= 0.05]
        better = [
            m
            for m in SCORES
            if (d := scores[m]["minus_default"]) is not None and d["p_sign_flip"] <= 0.05 and d["mean"] > 0
        ]
        out.append(
            f"- scores vs {label}: "
            + (
                "rank-correlated across seeds (stratified permutation p <= 0.05; the sign of the mean rho "
                "says which way): "
                + ", ".join(f"{m} (mean rho {scores[m]['mean_rho']:+.2f})" for m in significant)
                + "; the others: no evidence either way"
                if significant
                else "no score is significantly rank-correlated across seeds (stratified permutation p > 0.05 "
                "for all)"
            )
            + (
                f"; ranks better than the default {default} (sign-flip p <= 0.05): " + ", ".join(better) + "."
                if better
                else f"; no score ranks significantly better than the default {default}"
                + (
                    f" (with {n} seeds the sign-flip test cannot reach p <= 0.05)."
                    if 2 / 2**n > 0.05
                    else " (sign-flip p > 0.05 for each)."
                )
            )
        )
    out.append(
        "The scores are first-order (one quadratic) predictions of one small step on the new parameters: "
        "whether a descent direction exists there and how steep; the realised quantities are after many "
        "steps, so rho says how far the first predicts the second. These are tiny models trained briefly, a "
        "few seeds: a description of these runs, not a test of the papers' claims."
    )
    return out


def plot_growth_demo(runs: list[dict], path) -> Path:
    """Top row: held-out loss per arm (a tick at the mean over seeds, one dot per seed; the arms
    are categories, no lines join them), and every boundary's gain over no growth after
    continued training (one dot per seed). Then one row per realised quantity
    (:data:`REALISED`), one panel per score: the score before growth (symmetric-log x: some
    scores can be negative) against the realised value per candidate, one colour per seed, each
    dot labelled with its boundary."""
    from ..api.report.plots import figure_classes, save_figure

    Figure, Canvas = figure_classes()
    fig = Figure(figsize=(21, 10.5))
    Canvas(fig)
    grid = fig.add_gridspec(len(REALISED) + 1, len(SCORES))
    rhos = {(key, name): _rhos(runs, key, False, name) for key in REALISED for name in SCORES}
    half = len(SCORES) // 2
    a1, a2 = fig.add_subplot(grid[0, :half]), fig.add_subplot(grid[0, half:])
    spread = 0.35 / max(len(runs), 1)

    def offset(i):
        return (i - (len(runs) - 1) / 2) * spread

    xs = list(range(len(ARMS)))
    means = [statistics.fmean(run["arms"][a]["held_out_loss"] for run in runs) for a in ARMS]
    # the mean as a short bar-width tick, not a bar: the loss axis does not start at zero
    a1.scatter(xs, means, marker="_", s=700, linewidths=1.5, color="black", label="mean over seeds", zorder=2)
    candidates = runs[0]["candidates"]
    for i, run in enumerate(runs):
        style = dict(color=f"C{i % 10}", s=22, zorder=3, label=f"seed {run['seed']}")
        a1.scatter([x + offset(i) for x in xs], [run["arms"][a]["held_out_loss"] for a in ARMS], **style)
        a2.scatter(
            [k + offset(i) for k in range(len(candidates))],
            [run["candidate_gain_continued"][c] for c in candidates],
            **style,
        )
    a1.set_xticks(xs)
    a1.set_xticklabels(ARMS, rotation=30, ha="right", fontsize=8)
    a1.set_ylabel("held-out loss (nats/byte)")
    a1.set_title("after growth vs from scratch ('stay': not grown)", fontsize=9)
    # headroom above the highest dot for the legend, so it covers no point
    low, high = a1.get_ylim()
    a1.set_ylim(low, high + 0.45 * (high - low))
    a1.legend(fontsize=6, loc="upper left", ncol=4, markerscale=0.6)
    a2.axhline(0.0, color="black", lw=0.6)
    a2.set_xticks(range(len(candidates)))
    a2.set_xticklabels([c.removeprefix("model.") for c in candidates], rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("held-out gain over 'stay'", fontsize=8)
    a2.set_title("where growth helps: one zero layer at each boundary, whole model trained on", fontsize=9)
    for row, (key, label) in enumerate(REALISED.items(), start=1):
        for column, name in enumerate(SCORES):
            ax = fig.add_subplot(grid[row, column])
            values = [abs(_finite(r["candidate_scores"][c][name])) for r in runs for c in r["candidates"]]
            nonzero = [v for v in values if math.isfinite(v) and v > 0]
            for i, run in enumerate(runs):
                pts = [(_finite(run["candidate_scores"][c][name]), run[key][c], c) for c in run["candidates"]]
                pts = [q for q in pts if math.isfinite(q[0])]
                rho = rhos[key, name][i]
                ax.scatter(
                    [q[0] for q in pts],
                    [q[1] for q in pts],
                    color=f"C{i % 10}",
                    s=14,
                    label=f"seed {run['seed']} (ρ {rho:+.2f})",
                )
                for x, y, c in pts:
                    ax.annotate(
                        c.rsplit(".", 1)[-1], (x, y), fontsize=5, xytext=(2, 2), textcoords="offset points"
                    )
            if nonzero:
                ax.set_xscale("symlog", linthresh=min(nonzero))
            ax.axhline(0.0, color="black", lw=0.6)
            ax.set_xlabel(SCORE_LABELS[name] + " before growth", fontsize=7)
            if column == 0:
                ax.set_ylabel(label.replace(", ", ",\n"), fontsize=7)
            ax.tick_params(labelsize=6)
            ax.legend(fontsize=5)
    fig.tight_layout()
    return save_figure(fig, path)


def run_growth_demo(cfg: GrowthDemoConfig, out, echo=print) -> dict:
    """Run every seed, print the summary, write ``growth_demo.json`` and ``growth_demo.md``."""
    from ..accumulators.persistence import write_text_atomic
    from .corpus import StdlibCorpus

    cfg.validate()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = Path(out)
    corpus = StdlibCorpus(cfg.seq_len, probe_windows=cfg.probe_batches * cfg.batch_size)
    need = (cfg.steps1 + cfg.steps2) * cfg.batch_size * 2
    if need > len(corpus.order("train", 0)):
        raise FusedStatsError(f"the growth demo needs about {need} training windows; the corpus is smaller")
    echo(
        f"grow-demo: width {cfg.width}, depth {cfg.depth} -> {cfg.depth + 1}, seeds {list(cfg.seeds)}, "
        f"{cfg.steps1} + {cfg.steps2} steps of {cfg.batch_size} x {cfg.seq_len} bytes; {corpus.describe()}"
    )
    runs = [run_seed(corpus, cfg, seed, echo) for seed in cfg.seeds]
    summary, lines = summarize(cfg, runs)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    lines.append(f"total: {wall:.0f} s wall, {cpu:.0f} s CPU (process time)")
    for line in lines:
        echo(line)
    record = {
        "config": asdict(cfg),
        "runs": runs,
        "summary": summary,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
    }
    write_text_atomic(out / "growth_demo.json", json.dumps(record, indent=1, default=float) + "\n")
    try:
        plot_growth_demo(runs, out / "growth_demo.png")
        lines.append(f"wrote {out / 'growth_demo.json'}, {out / 'growth_demo.md'}, {out / 'growth_demo.png'}")
    except FusedStatsError as exc:  # matplotlib missing: JSON and text still written
        lines.append(f"(plot skipped: {exc})")
    echo(lines[-1])
    write_text_atomic(
        out / "growth_demo.md", "# fused-stats grow-demo\n\n```\n" + "\n".join(lines) + "\n```\n"
    )
    return record
