"""The growth advisor: rank a protocol's candidates by the measured first-order gain.

Role: :func:`advise` reads, per candidate, the saturation test of the probed block (the exact
tangent of the protocol's new block, :mod:`.tangent`) and the width certificate at the same
point, and ranks the candidates by ``|C|_F²`` (docs/design.md, sections 2.4, 2.7, 2.8):

* ``cross_frob2`` (unbiased ``|C|_F²``), ``se`` (its Hoeffding standard error), ``p_value`` of
  ``H0: C = 0`` and ``p_adjusted``: Holm–Bonferroni over the ``m`` candidates (Holm 1979,
  "A simple sequentially rejective multiple test procedure"): with the p-values sorted
  ``p_(1) ≤ … ≤ p_(m)``, ``p̃_(i) = max_{j≤i} min(1, (m − j + 1) p_(j))``; a candidate is
  ``saturated`` unless ``p̃ ≤ alpha``. This controls the family-wise error rate (the chance of
  calling any saturated candidate unsaturated) at ``alpha`` under any dependence between points.
* ``d_align`` (train stream) and ``b_exact``: the certificate at ``(M, K)``: the ``M, K`` given to
  :func:`advise`, else the protocol's declared ``budget``, both from the train estimate; with
  neither, the report's own (pooled moments at train n, test n).
* ``predicted_change = −|C|_F²``: the first-order change of the mean loss per unit SGD step on
  the zero parameters (``ΔL ≈ −η |∇L|²`` with ``∇L = C`` at the zero block). A negative unbiased
  estimate (possible when ``C`` is near 0) predicts nothing: ``predicted_change`` is None and
  reads "no detectable gain", never a change of the loss.
* ``predicted_change_sgd = −⟨C_M, C_K⟩`` and ``predicted_change_adam = −⟨s_M, C_K⟩``
  (``s_M = C_M/(|C_M| + ε)``, ``ε = protocol.adam_eps``): the first SGD and zero-state Adam/AdamW
  step's change of the mean test loss per unit step, and ``signal_fraction = |C|_F²/E|c_i|²``
  (:mod:`.scores`), from the report's ``growth_protocol.scores``; None where the report has none,
  and the Adam one under a projection.
* ``split_adam_score = (⟨s_A, C_B⟩ + ⟨s_B, C_A⟩)/2`` on the two halves of the train stream by
  step parity (A: train steps 0, 2, …; the feature source keeps A's tangent sum, B is the rest):
  each term's mean is ``E[s_A]·C``, no noise-on-noise term; it equals
  :func:`fused_stats.split_adam_score` on the same batches. None under a projection, for a
  report made without it, or when train samples came in other than by ``Probe.step``.
* Ranked by ``protocol.score`` (:func:`score_of`; default ``cross_frob2``). The verdict names the
  candidate of largest score among the significant ones (Holm-adjusted ``p̃ ≤ alpha``) only; with
  none, "saturated everywhere at alpha".
* With ``protocol.projection = k`` the probe measures ``|C Pᵀ|_F²``, whose mean over the
  ``N(0, 1/r)`` Gaussian ``P`` is ``(k/r)|C|_F²``; ``cross_frob2``, ``se`` and the predicted
  change are rescaled by ``r/k`` (``r``: the point's tangent width, recorded in the report), so
  candidates of different ``r`` rank on one scale; ``p`` is scale-free and unchanged.

Everything is computed from report dicts, so advice from a live probe and from its saved report
are the same. Refused: a protocol digest other than the one recorded in every report; reports
of ``unit="position"`` (the positions of one sequence are not independent samples, so neither
the standard error nor the p-values hold; probe with ``unit="sample"``, each sequence one
sample); several reports whose model fingerprints differ (config digest, parameter count, digest
of the parameter values: :mod:`fused_stats.api.report.identity`), or that lack one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from ...accumulators.estimators import D_ALIGN_READING, Estimate
from ...errors import FusedStatsError
from ..report.document import fmt, fmt_se, save_figure
from .advise_inputs import check_one_model, check_units, measured_structure, reports_of
from .first_step import tangent_record
from .protocol import DEFAULT_ADAM_EPS, DEFAULT_SCORE, GrowthProtocol, check_record_version
from .scores import NO_ADAM_UNDER_PROJECTION

CORRECTION = "Holm-Bonferroni"
NO_DETECTABLE_GAIN = "no detectable gain"
# what each candidate's p_adjusted and saturated are (a Saturation's own p is unadjusted)
ADJUSTED_TEST = "one-sided z-test of H0: C = 0, Holm-adjusted across the candidates"


@dataclass(frozen=True)
class Candidate:
    """One row of :attr:`Advice.ranked`."""

    point: str
    cross_frob2: float
    se: float | None  # SE of the estimate (full Hoeffding); None: not estimable at this n
    z: float | None  # None where the null variance estimate is 0
    p_value: float
    p_adjusted: float
    saturated: bool  # Holm-adjusted p > alpha
    d_align: float | None
    b_exact: float | None
    predicted_change: float | None  # −|C|_F²; None when the estimate is negative (no detectable gain)
    n: int
    rank: int
    features: int | None = None  # r, the full tangent's width (rank: k under a projection)
    # scores.py: first-step predictions of the mean test loss per unit step, and the signal fraction
    predicted_change_sgd: float | None = None  # −⟨C_M, C_K⟩
    predicted_change_adam: float | None = None  # −⟨s_M, C_K⟩; None under a projection
    signal_fraction: float | None = None  # |C|_F² / E|c_i|_F² (train stream)
    # (⟨s_A, C_B⟩ + ⟨s_B, C_A⟩)/2, halves A/B: even/odd train steps; None under a projection
    split_adam_score: float | None = None
    se_null: float | None = None  # SE under H0: C = 0, the one z and p come from
    # advice from a live probe: the mean train / test tangents for fs.predicted_change (not saved)
    first_step: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Advice:
    """The ranked candidates, the protocol (verbatim, with its digest), the test's settings, the
    model the reports measured (``model``: class, parameter count and fingerprint), the
    protocol's zero parameters that apply to it (``zero_parameters``; None: not recorded) and the
    model's structure when measured (``structure``: ``{"blocks": {container: count},
    "record_events": n}``, the plan's; None: not recorded). ``fs.grow(evidence=advice)`` and
    ``fs.predicted_change`` refuse the advice once the model's structure differs from it."""

    ranked: tuple[Candidate, ...]
    protocol: dict
    digest: str
    alpha: float
    correction: str
    M: int | None
    K: int | None
    model: dict | None = None
    zero_parameters: dict | None = None
    score: str = DEFAULT_SCORE  # the protocol's ranking score
    adam_eps: float = DEFAULT_ADAM_EPS
    structure: dict | None = None

    @property
    def saturated_everywhere(self) -> bool:
        return all(c.saturated for c in self.ranked)

    @property
    def top(self) -> Candidate | None:
        """The significant candidate of largest ranking score (None: saturated everywhere)."""
        significant = [c for c in self.ranked if not c.saturated]
        return max(significant, key=lambda c: score_of(c, self.score)) if significant else None

    @property
    def verdict(self) -> str:
        m = len(self.ranked)
        top = self.top
        if top is None:
            return (
                f"Saturated everywhere at alpha={self.alpha:g}: at none of the {m} candidates is C = 0 "
                f"rejected ({ADJUSTED_TEST}, {self.correction} over {m}). To first order a new block of "
                "this protocol would not lower the loss anywhere; the test gives no reason to grow."
            )
        grow = [c.point for c in self.ranked if not c.saturated]
        return (
            f"Not saturated at {len(grow)} of {m} candidates (C = 0 rejected at family-wise level "
            f"alpha={self.alpha:g}, {ADJUSTED_TEST}, {self.correction}): {', '.join(grow)}. Largest "
            f"significant {SCORE_LABELS[self.score]}: {top.point} ("
            + ("" if self.score == DEFAULT_SCORE else f"{self.score} = {fmt(score_of(top, self.score))}, ")
            + f"|C|_F² = {fmt(top.cross_frob2)}, "
            f"Holm-adjusted p = {fmt(top.p_adjusted)})."
        )

    def to_dict(self) -> dict:
        return {
            "format": "fused_stats.advice",
            "version": 1,
            "digest": self.digest,
            "protocol": self.protocol,
            "alpha": self.alpha,
            "correction": self.correction,
            "test": ADJUSTED_TEST,
            "model": self.model,
            "zero_parameters": self.zero_parameters,
            "M": self.M,
            "K": self.K,
            "score": self.score,
            "adam_eps": self.adam_eps,
            "model_structure": self.structure,
            "adam_available": self.protocol.get("projection") is None,
            "saturated_everywhere": self.saturated_everywhere,
            "verdict": self.verdict,
            "ranked": [
                {f.name: getattr(c, f.name) for f in fields(c) if f.name != "first_step"} for c in self.ranked
            ],
        }

    def to_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=True) + "\n")
        return path

    def _protocol_lines(self) -> list[str]:
        """The protocol by digest, its settings, and the zero parameters of this model only (the
        full record, with every architecture's entries, is in advice.json)."""
        p = self.protocol
        settings = ", ".join(
            f"{key} `{p[key]}`"
            for key in ("family", "init", "seed", "width", "projection", "budget")
            if p.get(key) is not None
        )
        lines = [
            f"Protocol digest (SHA-256): `{self.digest}` ({settings}; full record in advice.json).",
            "",
            f"Candidates: {', '.join(f'`{c}`' for c in p.get('candidates', []))}.",
            "",
        ]
        if self.model is not None:
            fingerprint = self.model.get("fingerprint") or {}
            values = fingerprint.get("parameters_digest")
            lines += [
                f"Model: {self.model.get('class')}, {self.model.get('num_parameters'):,} parameters"
                + (
                    f"; fingerprint: config `{fingerprint['config_digest'][:12]}`, parameter values "
                    f"`{values[:12] if values else 'not digested'}`"
                    if fingerprint
                    else ""
                )
                + ".",
                "",
            ]
        if self.structure is not None:
            blocks = ", ".join(f"{c}: {n} blocks" for c, n in self.structure["blocks"].items())
            lines += [
                f"Measured on the model with {blocks}, {self.structure['record_events']} growth record "
                "events: the candidate names are those of that model (a growth since renumbers them).",
                "",
            ]
        if self.zero_parameters is None:
            lines.append("Zero parameters of the new blocks: not recorded in the reports (see advice.json).")
        else:
            shown = "; ".join(
                f"{kind}: " + ", ".join(f"`{name}`" for name in names)
                for kind, names in self.zero_parameters.items()
            )
            lines.append(f"Zero parameters of the new blocks in this model: {shown or 'none'}.")
        return [*lines, ""]

    def to_markdown(self) -> str:
        lines = [
            "# Growth advice",
            "",
            *self._protocol_lines(),
            f"Saturation test per candidate: {ADJUSTED_TEST}, at family-wise level {self.alpha:g} "
            f"({self.correction} over {len(self.ranked)} candidates); p is each candidate's own "
            "(unadjusted, as probe.saturation gives it), p (Holm) the adjusted one; certificate at "
            + (f"M = {self.M}, K = {self.K}" if self.M else "the report's M = train n, K = test n")
            + "; predicted change = −|C|_F² per unit SGD step on the new zero parameters "
            f"({NO_DETECTABLE_GAIN!r} where the unbiased estimate is negative); ranked by "
            f"`{self.score}`. First step on the mean test loss per unit step: SGD −⟨C_M, C_K⟩, "
            + _adam_label(self.protocol.get("train_batch_size"), self.adam_eps)
            + ("" if self.protocol.get("projection") is None else f" (Adam: {NO_ADAM_UNDER_PROJECTION})")
            + "; signal fraction = |C|_F²/E|c_i|_F² (train); '-': not in the report."
            + (
                ""
                if self.protocol.get("projection") is None
                else f" Measured through a fixed random projection to k = {self.protocol['projection']} "
                "features: |C|_F² and se are (r/k)|C Pᵀ|_F², unbiased over P; p is unchanged."
            )
            + " Two standard errors: se (H0) is the spread of ‖C‖_F² under C = 0, the scale z and p "
            "come from; se (estimate) is the error of ‖C‖_F² itself, larger where C ≠ 0, so an "
            "estimate within one se (estimate) of 0 can still reject C = 0.",
            "",
            D_ALIGN_READING,
            "",
            "| rank | point | n | r | ‖C‖_F² | se (H0) | z | p | p (Holm) | saturated | se (estimate) "
            "| d_align | B_exact "
            "| predicted ΔL per unit step | ΔL SGD | ΔL Adam | signal fraction | split Adam score |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for i, c in enumerate(self.ranked, 1):
            lines.append(
                f"| {i} | {c.point} | {c.n} | {c.features or c.rank} | {fmt(c.cross_frob2)} "
                f"| {_cell(c.se_null)} | {_cell(c.z)} "
                f"| {fmt(c.p_value)} | {fmt(c.p_adjusted)} | {'yes' if c.saturated else 'no'} | {fmt_se(c.se)} "
                f"| {fmt(c.d_align)} | {fmt(c.b_exact)} | "
                f"{NO_DETECTABLE_GAIN if c.predicted_change is None else fmt(c.predicted_change)} "
                f"| {_cell(c.predicted_change_sgd)} | {_cell(c.predicted_change_adam)} "
                f"| {_cell(c.signal_fraction)} | {_cell(c.split_adam_score)} |"
            )
        lines += ["", self.verdict, ""]
        return "\n".join(lines)

    def plot(self, path) -> Path:
        """|C|_F² per candidate with ± its SE under H0 (thick, the test's scale) and ± its own SE
        (thin; filled: not saturated), and the Holm-adjusted p-values."""
        from ..report.plots import figure_classes

        Figure, Canvas = figure_classes()
        names = [c.point for c in self.ranked]
        ys = [c.cross_frob2 for c in self.ranked]
        es = [0.0 if c.se is None else c.se for c in self.ranked]
        es0 = [0.0 if c.se_null is None else c.se_null for c in self.ranked]
        fig = Figure(figsize=(max(8.0, 1.0 + 0.9 * len(names)), 4.2))
        Canvas(fig)
        a1, a2 = fig.subplots(1, 2)
        xs = list(range(len(names)))
        colors = ["tab:blue" if not c.saturated else "white" for c in self.ranked]
        a1.bar(xs, ys, color=colors, edgecolor="tab:blue")
        a1.errorbar(xs, ys, yerr=es0, fmt="none", elinewidth=6, alpha=0.35, color="tab:orange",
                    label="± se under H0 (the test's)")  # fmt: skip
        a1.errorbar(xs, ys, yerr=es, fmt="none", capsize=3, color="black", label="± se of the estimate")
        a1.axhline(0.0, color="black", lw=0.8)
        a1.legend(loc="upper right", fontsize=7)
        a1.set_title("first-order gain |C|_F² (filled: not saturated)", fontsize=9)
        p = [max(c.p_adjusted, 1e-300) for c in self.ranked]
        a2.bar(xs, [-math.log10(v) for v in p], color="tab:orange")
        a2.axhline(-math.log10(self.alpha), color="black", ls="--", lw=0.8, label=f"alpha = {self.alpha:g}")
        a2.set_title(f"-log10 p ({self.correction})", fontsize=9)
        a2.legend(loc="upper right", fontsize=8)
        for ax in (a1, a2):
            ax.set_xticks(xs)
            ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        fig.suptitle(f"growth advice, protocol {self.digest[:12]}", fontsize=10)
        fig.tight_layout()
        return save_figure(fig, path)


def _adam_label(size, eps: float) -> str:
    if size is None:
        return (
            f"zero-state Adam/AdamW −⟨s_M, C_K⟩ with s_M = C_M/(|C_M|+ε), ε = {eps:g}, the M train "
            "samples as one batch (GrowthProtocol(train_batch_size=B) for a step on B)"
        )
    return (
        f"zero-state Adam/AdamW on a batch of B = {size}: the mean of −⟨s_b, C_K⟩ over B-sized "
        f"sub-batches of the train stream, s_b = C_b/(|C_b|+ε), ε = {eps:g}"
    )


def _scaled(scale: float, value) -> float | None:
    """``scale · value``, None where the report holds none (not estimable; NaN or inf in reports
    written before such values became None)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return scale * float(value)


def _cell(value) -> str:
    return "-" if value is None else fmt(value)


SCORE_LABELS = {
    "cross_frob2": "first-order gain",
    "signal_fraction": "signal fraction |C|_F²/E|c|²",
    "adam_first_step": "predicted zero-state Adam first-step drop",
    "split_adam": "split Adam score ⟨s_A, C_B⟩",
}


def score_of(candidate: Candidate, score: str) -> float:
    """The ranking value of ``candidate`` under ``score`` (larger: better; a missing one last)."""
    if score == "cross_frob2":
        return candidate.cross_frob2
    if score == "signal_fraction":
        value = candidate.signal_fraction
        return -math.inf if value is None else value
    if score == "split_adam":
        value = candidate.split_adam_score
        return -math.inf if value is None else value
    value = candidate.predicted_change_adam
    return -math.inf if value is None else -value


def holm(p_values: list[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input order (module docstring)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * p_values[i]))
        out[i] = running
    return out


def _estimate(record: dict) -> Estimate:
    names = {f.name for f in fields(Estimate)} - {"plugin"}
    return Estimate(**{k: v for k, v in record.items() if k in names})


def advise(source, protocol: GrowthProtocol | None = None, alpha: float = 0.05, M=None, K=None) -> Advice:
    """Rank the candidates of ``protocol`` (module docstring).

    ``source``: a Probe built with ``cross=protocol``, a Report / report path, or a list of them
    (e.g. the candidates probed in separate runs; each candidate once). ``protocol``: checked
    against the digest recorded in the reports (None: the recorded one). ``M, K``: the certificate's
    sizes (None: the protocol's ``budget``, else the report's). Every candidate of the protocol must
    have a saturation result; refusals are listed in the module docstring.
    """
    if not 0 < alpha < 1:
        raise FusedStatsError(f"alpha must be in (0, 1), got {alpha!r}")
    if (M is None) != (K is None):
        raise FusedStatsError(f"give both M and K or neither, got M={M!r}, K={K!r}")
    probes: list = []
    reports = reports_of(source, probes)
    check_units(reports)
    check_one_model(reports)
    records = []
    for i, data in enumerate(reports):
        rec = data.get("growth_protocol")
        if not isinstance(rec, dict) or "digest" not in rec:
            raise FusedStatsError(
                f"report {i} records no growth protocol: probe with fs.Probe(model, points=protocol.candidates, "
                "cross=protocol)"
            )
        check_record_version(rec.get("protocol"), f"the growth protocol recorded in report {i}")
        records.append(rec)
    digests = {r["digest"] for r in records}
    if len(digests) != 1:
        raise FusedStatsError(f"the reports were made under different growth protocols: {sorted(digests)}")
    digest = digests.pop()
    if protocol is None:
        protocol = GrowthProtocol.from_dict(records[0]["protocol"])
    if (
        protocol.digest != digest
        or protocol.digest != GrowthProtocol.from_dict(records[0]["protocol"]).digest
    ):
        raise FusedStatsError(
            f"protocol digest {protocol.digest[:12]}… differs from the one recorded in the reports "
            f"({digest[:12]}…): the statistics were measured under another protocol"
        )
    if M is None and protocol.budget is not None:
        M, K = protocol.budget
    found: dict[str, dict] = {}
    for data in reports:
        for point in data["points"]:
            if point["name"] in protocol.candidates:
                if point["name"] in found:
                    raise FusedStatsError(f"candidate {point['name']!r} appears in more than one report")
                found[point["name"]] = point
    missing = [c for c in protocol.candidates if c not in found or not found[c].get("saturation")]
    if missing:
        unprobed = [c for c in missing if c not in found]
        short = [c for c in missing if c in found]
        reasons = [f"{unprobed} not in any report (probe them first)"] if unprobed else []
        if short:
            reasons.append(f"{short} probed, but the test needs at least 2 samples in the train stream")
        raise FusedStatsError("candidates without a saturation result: " + "; ".join(reasons))
    ranks: dict[str, int] = {}
    scores: dict[str, dict] = {}
    for rec in records:
        ranks.update(rec.get("feature_ranks") or {})
        scores.update(rec.get("scores") or {})
    if protocol.projection is not None:
        unknown = [c for c in protocol.candidates if c not in ranks]
        if unknown:
            raise FusedStatsError(
                f"the reports do not record the tangent width r at {unknown}, needed to rescale the "
                f"projected |C P^T|^2 (projection={protocol.projection}) to |C|^2; re-run the probe"
            )
    rows = []
    for name in protocol.candidates:
        point = found[name]
        sat = point["saturation"]
        train = point.get("train")
        d_align = None if train is None else train.get("d_align")
        if M is not None:
            b_exact = None if train is None else _estimate(train).certificate(M, K).b_exact
        else:
            cert = point.get("certificate")
            b_exact = None if cert is None else cert.get("b_exact")
        rows.append((name, sat, d_align, b_exact))
    adjusted = holm([float(r[1]["p_value"]) for r in rows])
    ranked = []
    for (name, sat, d_align, b_exact), p_adj in zip(rows, adjusted):
        # E_P |C Pᵀ|² = (k/r)|C|² (module docstring): one scale for candidates of different r
        scale = 1.0 if protocol.projection is None else ranks[name] / protocol.projection
        extra = scores.get(name) or {}
        sgd, adam, sq = extra.get("sgd_inner"), extra.get("adam_inner"), extra.get("mean_sq_norm")
        a_on_b, b_on_a = extra.get("split_a_on_b"), extra.get("split_b_on_a")
        split = (
            None
            if a_on_b is None or b_on_a is None or protocol.projection is not None
            else (a_on_b + b_on_a) / 2
        )
        ranked.append(
            Candidate(
                point=name,
                cross_frob2=scale * float(sat["cross_frob2"]),
                se=_scaled(scale, sat.get("cross_frob2_se")),
                se_null=_scaled(scale, sat.get("cross_frob2_se_null")),
                z=_scaled(1.0, sat.get("z")),
                p_value=float(sat["p_value"]),
                p_adjusted=p_adj,
                saturated=p_adj > alpha,
                d_align=d_align,
                b_exact=b_exact,
                predicted_change=None if sat["cross_frob2"] < 0 else -scale * float(sat["cross_frob2"]),
                n=int(sat["n"]),
                rank=int(sat["rank"]),
                features=ranks.get(name),
                predicted_change_sgd=None if sgd is None else -scale * sgd,
                predicted_change_adam=None if adam is None or protocol.projection is not None else -adam,
                # E_P of both terms scales by k/r: the fraction is rescaled by neither
                signal_fraction=None if not sq else float(sat["cross_frob2"]) / sq,
                split_adam_score=split,
                first_step=next(
                    (r for r in (tangent_record(p, name) for p in probes) if r is not None), None
                ),
            )
        )
    if protocol.score != DEFAULT_SCORE:
        # a score some candidates lack would rank them by their order in the protocol: refuse
        missing = [c.point for c in ranked if score_of(c, protocol.score) == -math.inf]
        if missing:
            need = (
                "a test stream (probe.step(..., stream='test')): the Adam prediction is <s_M, C_K>"
                if protocol.score == "adam_first_step"
                else "the per-sample squared norms of the tangent (a report made by this version)"
            )
            raise FusedStatsError(
                f"the protocol ranks by score {protocol.score!r}, which is not available for {missing}: it "
                f"needs {need}"
            )
    ranked.sort(key=lambda c: -score_of(c, protocol.score))
    model = reports[0]["model"]
    return Advice(
        tuple(ranked),
        protocol.to_dict(),
        digest,
        alpha,
        CORRECTION,
        M,
        K,
        model={k: model[k] for k in ("class", "num_parameters", "fingerprint") if k in model},
        zero_parameters=records[0].get("model_zero_parameters"),
        score=protocol.score,
        adam_eps=protocol.adam_eps,
        structure=measured_structure(records),
    )


__all__ = ["Advice", "Candidate", "advise", "holm", "score_of"]
