"""Probe reports: a versioned JSON document, a markdown rendering and PNG plots.

Role: the one exchange format between :class:`fused_stats.Probe` (which fills it), the
``fused-stats`` CLI (which prints, stores and re-renders it) and users' own analysis. A
:class:`Report` wraps exactly this dict (version 1)::

    {"format": "fused_stats.report", "version": 1, "fused_stats_version": str,
     "created": ISO 8601 str,
     "model": {"class": str, "num_parameters": int, "config": dict,
               "fingerprint": {"config_digest": str, "num_parameters": int,
                               "parameters_digest": str | None}   (optional, :mod:`.identity`)},
     "unit": str, "second_moment": str,
     "points": [{"name": str, "index": int, "dim": int,
                 "train": Estimate dict | None, "test": Estimate dict | None,
                 "certificate": Certificate dict | None, "misalignment": Misalignment dict | None,
                 "realized_alignment": float | None, "saturation": dict | None,
                 "norm_histogram": {"n": int, "edges": [float] * (bins + 1), "counts": [int] * bins,
                                    "underflow": int, "overflow": int}   (optional)}],
     "growth_protocol": {"digest": str, "protocol": dict, "feature_ranks": {point: int},
                         "model_zero_parameters": dict,
                         "model_structure": {"blocks": {container: int}, "record_events": int}}
                        (optional: a probe with cross=protocol; model_structure: the model measured),
     "meta": dict}

The Estimate / Certificate / Misalignment dicts are the ``to_dict()`` of the classes in
:mod:`fused_stats.accumulators`. No numbers are computed here; the report only shows what the
accumulators finalised: ``|μ|²`` (``mu_norm2``), ``d_par = |μ|⁴/μᵀΣμ``, ``d_2 = |μ|⁴/tr(Σ²)``,
``d_align = min(d_par, d_2)``, the certificate bounds ``B_align = 1/(1 + n_eff d_align)`` and
``B_exact = Var/(Var + |μ|⁴)`` with ``n_eff = MK/(M+K+1)`` (width paper, Theorem 1;
docs/design.md, section 2), the empirical misalignment ``Pr(μ_Mᵀg_K ≤ 0)`` over random splits of a pool, the
realized alignment ``s_trainᵀ s_test/(MK)``, the depth paper's ``AG_max = max_i |q_i|`` and,
when the probe kept one (``Probe(norm_histogram=...)``), the train stream's histogram of the
per-sample norms ``|q_i|`` in log-spaced bins (count ``k`` holds ``edges[k] ≤ |q_i| < edges[k+1]``).

This module holds the :class:`Report` (JSON in and out, markdown); the package's other modules
hold the format's keys and validation (:mod:`.schema`, which also writes non-finite floats as
strict-JSON strings), the sweeps over several reports (:mod:`.sweeps`) and the plots
(:mod:`.plots`), whose public functions are importable from here too.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path

from ...accumulators.cross_estimators import saturation_line
from ...accumulators.cross_stats import UNADJUSTED_TEST
from ...accumulators.estimators import D_ALIGN_READING
from ...accumulators.persistence import write_text_atomic
from ...accumulators.trends import median, rank_correlation  # noqa: F401  (re-exported)
from ...errors import FusedStatsError
from .plots import plot_report, plot_sweep, save_figure  # noqa: F401  (re-exported)
from .schema import FORMAT, VERSION, cell, decode, encode, fmt, fmt_se, same, validate  # noqa: F401
from .sweeps import (  # noqa: F401  (re-exported)
    SWEEP_COLUMNS,
    SWEEP_CONFIG_KEYS,
    SWEEP_TRENDS,
    cosine,
    pick_point,
    sweep_rows,
    sweep_summary,
    sweep_value,
    trend_sentence,
)


class Report:
    """A probe report (module docstring has the dict layout).

    Parameters
    ----------
    data : dict
        The version-1 report dict; validated on construction (a bad dict raises
        :class:`FusedStatsError` naming the offending key).

    Examples
    --------
    >>> report = probe.report(meta={"width": 64, "seed": 0})      # doctest: +SKIP
    >>> report.to_json("out/report.json"); print(report.to_markdown())  # doctest: +SKIP
    >>> Report.from_json("out/report.json").plot("out/report.png")      # doctest: +SKIP
    """

    def __init__(self, data: dict):
        validate(data)
        self.data = data

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def now() -> str:
        """Current time as the ISO 8601 string used in ``created``."""
        return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    # ------------------------------------------------------------------ access
    @property
    def points(self) -> list[dict]:
        return sorted(self.data["points"], key=lambda p: p["index"])

    @property
    def meta(self) -> dict:
        return self.data["meta"]

    @property
    def model(self) -> dict:
        return self.data["model"]

    def point(self, name: str) -> dict:
        for p in self.data["points"]:
            if p["name"] == name:
                return p
        raise FusedStatsError(f"report has no point {name!r}; points: {[p['name'] for p in self.points]}")

    def __repr__(self) -> str:
        return (
            f"Report(model={self.model['class']!r}, points={len(self.data['points'])}, "
            f"unit={self.data['unit']!r}, meta={self.meta!r})"
        )

    def __eq__(self, other) -> bool:
        if not isinstance(other, Report):
            return NotImplemented
        return same(self.data, other.data)

    # ------------------------------------------------------------------ JSON
    def to_json(self, path) -> Path:
        """Write strict JSON atomically (non-finite floats as strings); returns the path."""
        path = Path(path)
        text = json.dumps(encode(self.data), indent=1, allow_nan=False, sort_keys=False)
        write_text_atomic(path, text + "\n")
        return path

    @classmethod
    def from_json(cls, path) -> Report:
        """Read and validate a report file; any problem raises :class:`FusedStatsError`."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FusedStatsError(f"report file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise FusedStatsError(f"cannot read report file {str(path)!r}: {exc}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FusedStatsError(
                f"report file {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}, "
                f"column {exc.colno})"
            ) from None
        try:
            return cls(decode(raw))
        except FusedStatsError as exc:
            raise FusedStatsError(f"{path}: {exc}") from None

    # ------------------------------------------------------------------ markdown
    def to_markdown(self) -> str:
        """A header, one summary row per point, then one table per point (train and test) and,
        where the point carries one, its norm histogram."""
        d, model, meta = self.data, self.model, self.meta
        lines = [f"# fused_stats report: {model['class']}", ""]
        lines.append(
            f"- parameters: {model['num_parameters']:,}; unit: `{d['unit']}`; "
            f"second moment: `{d['second_moment']}`"
        )
        if model["config"]:
            lines.append("- config: " + ", ".join(f"{k}={v}" for k, v in model["config"].items()))
        if meta:
            lines.append(
                "- meta: "
                + ", ".join(f"{k}={fmt(v)}" for k, v in meta.items() if not isinstance(v, (dict, list)))
            )
        fingerprint = model.get("fingerprint")
        if fingerprint is not None:
            values = fingerprint["parameters_digest"]
            lines.append(
                f"- model fingerprint: config `{fingerprint['config_digest'][:12]}`, parameter values "
                + (
                    f"`{values[:12]}`"
                    if values
                    else f"not digested ({fingerprint.get('parameters_digest_missing')})"
                )
            )
        protocol = d.get("growth_protocol")
        if protocol is not None:
            record = protocol.get("protocol") or {}
            lines.append(
                f"- growth protocol `{protocol.get('digest', '?')[:12]}` (SHA-256): family "
                f"`{record.get('family')}`, candidates "
                + ", ".join(f"`{c}`" for c in record.get("candidates", []))
            )
        lines.append(f"- created {d['created']} by fused_stats {d['fused_stats_version']}")
        with_cross = any(p["saturation"] is not None for p in self.points)
        lines += [
            "",
            "## Summary",
            "",
            D_ALIGN_READING,
            "",
            "Which stream each number comes from: n, d_align and AG_max from the train stream alone; "
            "B_align and B_exact from the pooled train + test moments at the certificate's M and K; "
            "the misalignment over random M/K splits of the pooled samples; the realized alignment "
            "from the train mean against the test mean"
            + (
                "; ‖C‖_F², p and saturated from the train stream's saturation test (H0: C = 0, "
                "this point alone, not adjusted for the others)."
                if with_cross
                else "."
            ),
            "",
            "| point | index | dim | n (train) | d_align (train) | B_align (pooled) | B_exact (pooled) | "
            "misalignment (pooled splits) | realized alignment (train · test) | AG_max (train) |"
            + (" ‖C‖_F² (train) | p | saturated |" if with_cross else ""),
            "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if with_cross else ""),
        ]
        for p in self.points:
            tr, cert, mis, sat = p["train"], p["certificate"], p["misalignment"], p["saturation"]
            verdict = (
                f" {fmt(cell(sat, 'cross_frob2'))} | {fmt(cell(sat, 'p_value'))} | "
                f"{fmt(cell(sat, 'saturated'))} |"
                if with_cross
                else ""
            )
            lines.append(
                f"| `{p['name']}` | {p['index']} | {p['dim']} | {fmt(cell(tr, 'n'))} | "
                f"{fmt(cell(tr, 'd_align'))} | {fmt(cell(cert, 'b_align'))} | "
                f"{fmt(cell(cert, 'b_exact'))} | {fmt(cell(mis, 'probability'))} | "
                f"{fmt(p['realized_alignment'])} | {fmt(cell(tr, 'ag_max'))} |{verdict}"
            )
        for p in self.points:
            lines += [
                "",
                f"## Point `{p['name']}` (index {p['index']}, dim {p['dim']})",
                "",
                "| quantity | train | test |",
                "|---|---|---|",
            ]
            rows = (
                ("n", "n"),
                ("‖μ‖²", "mu_norm2"),
                ("‖μ‖⁴", "mu_norm4"),
                ("μᵀΣμ", "mu_sigma_mu"),
                ("tr(Σ²)", "trace_sigma2"),
                ("d_par", "d_par"),
                ("d_2", "d_2"),
                ("d_align", "d_align"),
                ("AG_max", "ag_max"),
                ("AG_mean", "ag_mean"),
            )
            for label, key in rows:
                lines.append(f"| {label} | {fmt(cell(p['train'], key))} | {fmt(cell(p['test'], key))} |")
            plug = {s: (p[s] or {}).get("plugin") for s in ("train", "test")}
            for label, key in (
                ("S = ‖q̄‖²", "S"),
                ("V", "V"),
                ("T", "T"),
                ("d_par", "d_par"),
                ("d_2", "d_2"),
                ("d_align", "d_align"),
            ):
                if plug["train"] or plug["test"]:  # what per-sequence scripts report from rows
                    lines.append(
                        f"| {label} (plug-in, biased) | {fmt(cell(plug['train'], key))} | "
                        f"{fmt(cell(plug['test'], key))} |"
                    )
            for stream in ("train", "test"):
                for key, why in ((p[stream] or {}).get("not_estimable") or {}).items():
                    lines.append(f"\n- {key} ({stream}) not estimable: {why}")
            cert = p["certificate"]
            if cert is None:
                lines.append("\n- certificate: not computed")
            else:
                # "estimable": whether the bounds could be computed at all ("certified" before)
                estimable = cert.get("estimable", cert.get("certified", True))
                status = "" if estimable else f" (not estimable: {cert.get('reason') or 'no signal'})"
                lines.append(
                    f"\n- certificate (M={cert['M']}, K={cert['K']}, n_eff={fmt(cert['n_eff'])}): "
                    f"b_align={fmt(cert['b_align'])}, b_exact={fmt(cert['b_exact'])}{status}"
                )
            mis = p["misalignment"]
            if mis is None:
                lines.append("- empirical misalignment: not computed (needs a sample pool)")
            else:
                lines.append(
                    f"- empirical misalignment (M={mis['M']}, K={mis['K']}, "
                    f"{mis['trials']} splits): {fmt(mis['probability'])} "
                    f"± {fmt(mis['stderr'])}"
                )
            lines.append(f"- realized alignment (train mean · test mean): {fmt(p['realized_alignment'])}")
            sat = p["saturation"]
            if sat is not None:
                details = [
                    f"{k}={fmt(sat.get(k))}" for k in ("n", "rank", "ag_max", "ag_mean") if k in sat
                ] + [f"{k} not estimable: {why}" for k, why in (sat.get("not_estimable") or {}).items()]
                lines.append(
                    f"- saturation ({sat.get('test', UNADJUSTED_TEST)}): {saturation_line(_no_nan(sat))}"
                    + (f" ({', '.join(details)})" if details else "")
                )
            hist = p.get("norm_histogram")
            if hist is not None:
                lines += _histogram_lines(hist)
        return "\n".join(lines) + "\n"

    def histogram_points(self) -> list[dict]:
        """The points that carry a norm histogram, in index order."""
        return [p for p in self.points if p.get("norm_histogram") is not None]

    def to_markdown_file(self, path) -> Path:
        path = Path(path)
        write_text_atomic(path, self.to_markdown())
        return path

    # ------------------------------------------------------------------ plots
    def plot(self, path) -> Path:
        """PNG of the points (:func:`fused_stats.api.report.plots.plot_report`)."""
        return plot_report(self, path)


def _no_nan(sat: dict) -> dict:
    """A saturation dict with NaN (how reports written before such values became None stored a
    standard error not estimable at this n) as None."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in sat.items()}


def _histogram_lines(hist: dict) -> list[str]:
    """The markdown section of one point's norm histogram: a row per bin that holds samples,
    plus the underflow and overflow rows."""
    edges, counts = hist["edges"], hist["counts"]
    lines = [
        "",
        f"### Per-sample norm histogram (train stream, n={hist['n']}; bins without samples omitted)",
        "",
        "| \\|q_i\\| in | count |",
        "|---|---|",
        f"| [0, {fmt(edges[0], '.3g')}) | {hist['underflow']} |",
    ]
    for low, high, count in zip(edges, edges[1:], counts):
        if count:
            lines.append(f"| [{fmt(low, '.3g')}, {fmt(high, '.3g')}) | {count} |")
    lines.append(f"| [{fmt(edges[-1], '.3g')}, inf) | {hist['overflow']} |")
    return lines
