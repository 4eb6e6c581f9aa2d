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
  the zero parameters (``ΔL ≈ −η |∇L|²`` with ``∇L = C`` at the zero block).
* With ``protocol.projection = k`` the probe measures ``|C Pᵀ|_F²``, whose mean over the
  ``N(0, 1/r)`` Gaussian ``P`` is ``(k/r)|C|_F²``; ``cross_frob2``, ``se`` and the predicted
  change are rescaled by ``r/k`` (``r``: the point's tangent width, recorded in the report), so
  candidates of different ``r`` rank on one scale; ``p`` is scale-free and unchanged.

Everything is computed from report dicts, so advice from a live probe and from its saved report
are the same; the protocol's digest must match the one recorded in every report.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ...accumulators.estimators import Estimate
from ...errors import FusedStatsError
from ..report.document import Report, fmt, save_figure
from .protocol import GrowthProtocol
from .tangent import GrowthTangent  # noqa: F401  (registers GrowthProtocol as a probe feature source)

CORRECTION = "Holm-Bonferroni"


@dataclass(frozen=True)
class Candidate:
    """One row of :attr:`Advice.ranked`."""

    point: str
    cross_frob2: float
    se: float
    z: float
    p_value: float
    p_adjusted: float
    saturated: bool
    d_align: float | None
    b_exact: float | None
    predicted_change: float
    n: int
    rank: int
    features: int | None = None  # r, the full tangent's width (rank: k under a projection)


@dataclass(frozen=True)
class Advice:
    """The ranked candidates, the protocol (verbatim, with its digest) and the test's settings."""

    ranked: tuple[Candidate, ...]
    protocol: dict
    digest: str
    alpha: float
    correction: str
    M: int | None
    K: int | None

    @property
    def saturated_everywhere(self) -> bool:
        return all(c.saturated for c in self.ranked)

    @property
    def verdict(self) -> str:
        m = len(self.ranked)
        if self.saturated_everywhere:
            return (
                f"Saturated everywhere: at none of the {m} candidates is C = 0 rejected at level "
                f"{self.alpha:g} ({self.correction} over {m} candidates). To first order a new block of "
                "this protocol would not lower the loss anywhere; the test gives no reason to grow."
            )
        grow = [c.point for c in self.ranked if not c.saturated]
        return (
            f"Not saturated at {len(grow)} of {m} candidates (C = 0 rejected at family-wise level "
            f"{self.alpha:g}, {self.correction}): {', '.join(grow)}. Largest first-order gain: "
            f"{self.ranked[0].point} (|C|_F² = {fmt(self.ranked[0].cross_frob2)})."
        )

    def to_dict(self) -> dict:
        return {
            "format": "fused_stats.advice",
            "version": 1,
            "digest": self.digest,
            "protocol": self.protocol,
            "alpha": self.alpha,
            "correction": self.correction,
            "M": self.M,
            "K": self.K,
            "saturated_everywhere": self.saturated_everywhere,
            "verdict": self.verdict,
            "ranked": [asdict(c) for c in self.ranked],
        }

    def to_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=True) + "\n")
        return path

    def to_markdown(self) -> str:
        lines = [
            "# Growth advice",
            "",
            f"Protocol digest (SHA-256): `{self.digest}`",
            "",
            "```json",
            json.dumps(self.protocol, indent=2, sort_keys=True),
            "```",
            "",
            f"Saturation test of H0: C = 0 per candidate at family-wise level {self.alpha:g}, "
            f"{self.correction} over {len(self.ranked)} candidates; certificate at "
            + (f"M = {self.M}, K = {self.K}" if self.M else "the report's M = train n, K = test n")
            + "; predicted change = −|C|_F² per unit SGD step on the new zero parameters."
            + (
                ""
                if self.protocol.get("projection") is None
                else f" Measured through a fixed random projection to k = {self.protocol['projection']} "
                "features: |C|_F² and se are (r/k)|C Pᵀ|_F², unbiased over P; p is unchanged."
            ),
            "",
            "| rank | point | n | r | ‖C‖_F² | se | z | p | p (Holm) | saturated | d_align | B_exact "
            "| predicted ΔL per unit step |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for i, c in enumerate(self.ranked, 1):
            lines.append(
                f"| {i} | {c.point} | {c.n} | {c.features or c.rank} | {fmt(c.cross_frob2)} | {fmt(c.se)} "
                f"| {fmt(c.z)} "
                f"| {fmt(c.p_value)} | {fmt(c.p_adjusted)} | {'yes' if c.saturated else 'no'} "
                f"| {fmt(c.d_align)} | {fmt(c.b_exact)} | {fmt(c.predicted_change)} |"
            )
        lines += ["", self.verdict, ""]
        return "\n".join(lines)

    def plot(self, path) -> Path:
        """|C|_F² ± se per candidate (filled: not saturated) and the Holm-adjusted p-values."""
        from ..report.plots import figure_classes

        Figure, Canvas = figure_classes()
        names = [c.point for c in self.ranked]
        ys = [c.cross_frob2 for c in self.ranked]
        es = [c.se for c in self.ranked]
        fig = Figure(figsize=(max(8.0, 1.0 + 0.9 * len(names)), 4.2))
        Canvas(fig)
        a1, a2 = fig.subplots(1, 2)
        xs = list(range(len(names)))
        colors = ["tab:blue" if not c.saturated else "white" for c in self.ranked]
        a1.bar(xs, ys, yerr=es, color=colors, edgecolor="tab:blue", capsize=3)
        a1.axhline(0.0, color="black", lw=0.8)
        a1.set_title("first-order gain |C|_F² ± se (filled: not saturated)", fontsize=9)
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


def _reports(source) -> list[dict]:
    from ..probe.driver import Probe

    items = source if isinstance(source, (list, tuple)) else [source]
    out = []
    for item in items:
        if isinstance(item, Probe):
            out.append(item.report(misalignment_trials=0).data)
        elif isinstance(item, Report):
            out.append(item.data)
        elif isinstance(item, (str, Path)):
            out.append(Report.from_json(item).data)
        elif isinstance(item, dict):
            out.append(Report(item).data)
        else:
            raise FusedStatsError(
                f"advise takes a Probe, a Report, a report path or a list of them; got {type(item).__name__}"
            )
    if not out:
        raise FusedStatsError("advise needs at least one probe or report")
    return out


def _estimate(record: dict) -> Estimate:
    names = {f.name for f in fields(Estimate)} - {"plugin"}
    return Estimate(**{k: v for k, v in record.items() if k in names})


def advise(source, protocol: GrowthProtocol | None = None, alpha: float = 0.05, M=None, K=None) -> Advice:
    """Rank the candidates of ``protocol`` (module docstring).

    ``source``: a Probe built with ``cross=protocol``, a Report / report path, or a list of them
    (e.g. the candidates probed in separate runs; each candidate once). ``protocol``: checked
    against the digest recorded in the reports (None: the recorded one). ``M, K``: the certificate's
    sizes (None: the protocol's ``budget``, else the report's). Every candidate of the protocol must have a saturation result.
    """
    if not 0 < alpha < 1:
        raise FusedStatsError(f"alpha must be in (0, 1), got {alpha!r}")
    if (M is None) != (K is None):
        raise FusedStatsError(f"give both M and K or neither, got M={M!r}, K={K!r}")
    reports = _reports(source)
    records = []
    for i, data in enumerate(reports):
        rec = data.get("growth_protocol")
        if not isinstance(rec, dict) or "digest" not in rec:
            raise FusedStatsError(
                f"report {i} records no growth protocol: probe with fs.Probe(model, points=protocol.candidates, "
                "cross=protocol)"
            )
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
    for rec in records:
        ranks.update(rec.get("feature_ranks") or {})
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
        ranked.append(
            Candidate(
                point=name,
                cross_frob2=scale * float(sat["cross_frob2"]),
                se=scale * float(sat["cross_frob2_se"]),
                z=float(sat["z"]),
                p_value=float(sat["p_value"]),
                p_adjusted=p_adj,
                saturated=p_adj > alpha,
                d_align=d_align,
                b_exact=b_exact,
                predicted_change=-scale * float(sat["cross_frob2"]),
                n=int(sat["n"]),
                rank=int(sat["rank"]),
                features=ranks.get(name),
            )
        )
    ranked.sort(key=lambda c: -c.cross_frob2)
    return Advice(tuple(ranked), protocol.to_dict(), digest, alpha, CORRECTION, M, K)


__all__ = ["Advice", "Candidate", "advise", "holm"]
