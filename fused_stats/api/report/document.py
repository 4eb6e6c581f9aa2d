"""Probe reports: a versioned JSON document, a markdown rendering and PNG plots.

Role: the one exchange format between :class:`fused_stats.Probe` (which fills it), the
``fused-stats`` CLI (which prints, stores and re-renders it) and users' own analysis. A
:class:`Report` wraps exactly this dict (version 1)::

    {"format": "fused_stats.report", "version": 1, "fused_stats_version": str,
     "created": ISO 8601 str,
     "model": {"class": str, "num_parameters": int, "config": dict},
     "unit": str, "second_moment": str,
     "points": [{"name": str, "index": int, "dim": int,
                 "train": Estimate dict | None, "test": Estimate dict | None,
                 "certificate": Certificate dict | None, "misalignment": Misalignment dict | None,
                 "realized_alignment": float | None, "saturation": dict | None,
                 "norm_histogram": {"n": int, "edges": [float] * (bins + 1), "counts": [int] * bins,
                                    "underflow": int, "overflow": int}   (optional)}],
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

JSON has no infinity or NaN (``d_par`` is ``inf`` when the ``μᵀΣμ`` estimate is ≤ 0), so
non-finite floats are written as the strings ``"Infinity"``, ``"-Infinity"`` and ``"NaN"`` and
turned back into floats on reading; the file itself is strict JSON (``allow_nan=False``).

Plots use matplotlib's object-oriented API on an Agg canvas (no pyplot, so the user's interactive
backend is never switched); matplotlib is imported only when plotting.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from ...accumulators import Certificate, Estimate, Misalignment, trends
from ...accumulators.persistence import write_atomic
from ...accumulators.trends import cosine as trend_cosine
from ...accumulators.trends import median, rank_correlation  # noqa: F401  (re-exported)
from ...errors import FusedStatsError

FORMAT = "fused_stats.report"
VERSION = 1


def _number_fields(cls) -> tuple[str, ...]:
    """The int and float fields of a result dataclass (the numbers its ``to_dict`` writes)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", int, float))


# Keys a point's sub-dicts must carry, as numbers; extra keys (e.g. ``effective_rank``) are kept
# as they are.
ESTIMATE_KEYS = _number_fields(Estimate)
CERTIFICATE_KEYS = _number_fields(Certificate)
MISALIGNMENT_KEYS = _number_fields(Misalignment)
TOP_KEYS = (
    "format",
    "version",
    "fused_stats_version",
    "created",
    "model",
    "unit",
    "second_moment",
    "points",
    "meta",
)
POINT_KEYS = (
    "name",
    "index",
    "dim",
    "train",
    "test",
    "certificate",
    "misalignment",
    "realized_alignment",
    "saturation",
)

_NONFINITE_OUT = {math.inf: "Infinity", -math.inf: "-Infinity"}
_NONFINITE_IN = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


# ---------------------------------------------------------------------------- JSON encoding
def _encode(value):
    """Replace non-finite floats by strings, recursively (JSON cannot hold them)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return _NONFINITE_OUT[value]
        return value
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars in user meta
        try:
            return _encode(value.item())
        except (TypeError, ValueError):
            pass
    return value


def _decode(value):
    """Inverse of :func:`_encode`: the three marker strings become floats again."""
    if isinstance(value, str):
        return _NONFINITE_IN.get(value, value)
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _write_atomic(path: Path, text: str) -> None:
    """Temp file in the target folder, fsync, rename: a reader never sees a half-written file."""
    write_atomic(Path(path), text.encode("utf-8"))


# ---------------------------------------------------------------------------- validation
def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sub(where: str, value, keys: tuple[str, ...]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise FusedStatsError(f"report: {where} must be a dict or null, got {type(value).__name__}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise FusedStatsError(f"report: {where} lacks keys {missing} (has {sorted(value)})")
    for k in keys:
        if not _is_number(value[k]):
            raise FusedStatsError(f"report: {where}[{k!r}] must be a number, got {value[k]!r}")


def validate(data) -> None:
    """Raise :class:`FusedStatsError` naming the first problem in a report dict."""
    if not isinstance(data, dict):
        raise FusedStatsError(f"report: expected a JSON object (dict), got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise FusedStatsError(
            f"report: format is {data.get('format')!r}, expected {FORMAT!r} (not a fused_stats report)"
        )
    if data.get("version") != VERSION:
        raise FusedStatsError(
            f"report: unsupported version {data.get('version')!r}; this fused_stats reads version "
            f"{VERSION} (written by a newer or older release?)"
        )
    missing = [k for k in TOP_KEYS if k not in data]
    if missing:
        raise FusedStatsError(f"report: missing top-level keys {missing}")
    for key in ("fused_stats_version", "created", "unit", "second_moment"):
        if not isinstance(data[key], str):
            raise FusedStatsError(f"report: {key} must be a string, got {data[key]!r}")
    model = data["model"]
    if not isinstance(model, dict):
        raise FusedStatsError(f"report: model must be a dict, got {type(model).__name__}")
    if not isinstance(model.get("class"), str):
        raise FusedStatsError(f"report: model['class'] must be a string, got {model.get('class')!r}")
    if not _is_int(model.get("num_parameters")):
        raise FusedStatsError(
            f"report: model['num_parameters'] must be an int, got {model.get('num_parameters')!r}"
        )
    if not isinstance(model.get("config"), dict):
        raise FusedStatsError(f"report: model['config'] must be a dict, got {model.get('config')!r}")
    if not isinstance(data["meta"], dict):
        raise FusedStatsError(f"report: meta must be a dict, got {type(data['meta']).__name__}")
    points = data["points"]
    if not isinstance(points, list):
        raise FusedStatsError(f"report: points must be a list, got {type(points).__name__}")
    seen = set()
    for i, point in enumerate(points):
        if not isinstance(point, dict):
            raise FusedStatsError(f"report: points[{i}] must be a dict, got {type(point).__name__}")
        missing = [k for k in POINT_KEYS if k not in point]
        if missing:
            raise FusedStatsError(f"report: points[{i}] lacks keys {missing}")
        name = point["name"]
        if not isinstance(name, str):
            raise FusedStatsError(f"report: points[{i}]['name'] must be a string, got {name!r}")
        if name in seen:
            raise FusedStatsError(f"report: point name {name!r} appears twice")
        seen.add(name)
        for key in ("index", "dim"):
            if not _is_int(point[key]):
                raise FusedStatsError(f"report: point {name!r}: {key} must be an int, got {point[key]!r}")
        _check_sub(f"point {name!r} train", point["train"], ESTIMATE_KEYS)
        _check_sub(f"point {name!r} test", point["test"], ESTIMATE_KEYS)
        _check_sub(f"point {name!r} certificate", point["certificate"], CERTIFICATE_KEYS)
        _check_sub(f"point {name!r} misalignment", point["misalignment"], MISALIGNMENT_KEYS)
        ra = point["realized_alignment"]
        if ra is not None and not _is_number(ra):
            raise FusedStatsError(
                f"report: point {name!r}: realized_alignment must be a number or null, got {ra!r}"
            )
        if point["saturation"] is not None and not isinstance(point["saturation"], dict):
            raise FusedStatsError(
                f"report: point {name!r}: saturation must be a dict or null, "
                f"got {type(point['saturation']).__name__}"
            )
        if "norm_histogram" in point:
            _check_histogram(name, point["norm_histogram"])


def _check_histogram(name: str, hist) -> None:
    """Raise unless ``hist`` is a norm histogram dict (module docstring)."""
    where = f"report: point {name!r}: norm_histogram"
    if not isinstance(hist, dict):
        raise FusedStatsError(f"{where} must be a dict, got {type(hist).__name__}")
    missing = [k for k in ("n", "edges", "counts", "underflow", "overflow") if k not in hist]
    if missing:
        raise FusedStatsError(f"{where} lacks keys {missing}")
    edges, counts = hist["edges"], hist["counts"]
    if not (
        isinstance(edges, list)
        and isinstance(counts, list)
        and len(counts) >= 1
        and len(edges) == len(counts) + 1
        and all(_is_number(e) and e > 0 for e in edges)
        and all(_is_int(c) and c >= 0 for c in counts)
    ):
        raise FusedStatsError(
            f"{where}: needs counts (non-negative ints, one per bin) and one more positive edge "
            f"than counts; got {len(edges) if isinstance(edges, list) else edges!r} edges and "
            f"{len(counts) if isinstance(counts, list) else counts!r} counts"
        )
    for key in ("n", "underflow", "overflow"):
        if not _is_int(hist[key]) or hist[key] < 0:
            raise FusedStatsError(f"{where}: {key} must be a non-negative int, got {hist[key]!r}")
    if sum(counts) + hist["underflow"] + hist["overflow"] != hist["n"]:
        raise FusedStatsError(
            f"{where}: the counts add up to {sum(counts) + hist['underflow'] + hist['overflow']}, "
            f"n={hist['n']}"
        )


# ---------------------------------------------------------------------------- formatting
def fmt(value, spec: str = ".4g") -> str:
    """A number as the markdown shows it; ``—`` for missing values."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_int(value):
        return str(value)
    if _is_number(value):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(value, spec)
    return str(value)


SE_NOT_ESTIMABLE = "SE not estimable at this n"


def fmt_se(value, spec: str = ".4g") -> str:
    """A standard error as printed: a NaN one (its variance estimate came out negative) says so
    instead of showing a number."""
    if _is_number(value) and math.isnan(value):
        return SE_NOT_ESTIMABLE
    return fmt(value, spec)


def _cell(sub: dict | None, key: str):
    return None if sub is None else sub.get(key)


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
        return _same(self.data, other.data)

    # ------------------------------------------------------------------ JSON
    def to_json(self, path) -> Path:
        """Write strict JSON atomically (non-finite floats as strings); returns the path."""
        path = Path(path)
        text = json.dumps(_encode(self.data), indent=1, allow_nan=False, sort_keys=False)
        _write_atomic(path, text + "\n")
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
            return cls(_decode(raw))
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
        lines.append(f"- created {d['created']} by fused_stats {d['fused_stats_version']}")
        lines += [
            "",
            "## Summary (train stream; certificate and misalignment at the sizes shown)",
            "",
            "| point | index | dim | n | d_align | B_align | B_exact | misalignment | "
            "realized alignment | AG_max |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for p in self.points:
            tr, cert, mis = p["train"], p["certificate"], p["misalignment"]
            lines.append(
                f"| `{p['name']}` | {p['index']} | {p['dim']} | {fmt(_cell(tr, 'n'))} | "
                f"{fmt(_cell(tr, 'd_align'))} | {fmt(_cell(cert, 'b_align'))} | "
                f"{fmt(_cell(cert, 'b_exact'))} | {fmt(_cell(mis, 'probability'))} | "
                f"{fmt(p['realized_alignment'])} | {fmt(_cell(tr, 'ag_max'))} |"
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
                lines.append(f"| {label} | {fmt(_cell(p['train'], key))} | {fmt(_cell(p['test'], key))} |")
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
                        f"| {label} (plug-in, biased) | {fmt(_cell(plug['train'], key))} | "
                        f"{fmt(_cell(plug['test'], key))} |"
                    )
            cert = p["certificate"]
            if cert is None:
                lines.append("\n- certificate: not computed")
            else:
                status = "" if cert.get("certified", True) else f" ({cert.get('reason') or 'no signal'})"
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
                parts = [
                    f"{k}={fmt_se(v) if k.endswith('_se') else fmt(v)}"
                    for k, v in sat.items()
                    if not isinstance(v, (dict, list))
                ]
                lines.append("- saturation: " + ", ".join(parts))
            hist = p.get("norm_histogram")
            if hist is not None:
                lines += _histogram_lines(hist)
        return "\n".join(lines) + "\n"

    def histogram_points(self) -> list[dict]:
        """The points that carry a norm histogram, in index order."""
        return [p for p in self.points if p.get("norm_histogram") is not None]

    def to_markdown_file(self, path) -> Path:
        path = Path(path)
        _write_atomic(path, self.to_markdown())
        return path

    # ------------------------------------------------------------------ plots
    def plot(self, path) -> Path:
        """PNG: d_align (train, test) and AG_max per point; certificate bounds vs empirical
        misalignment per point; the per-sample norm histograms (train) where the points carry
        them. A panel whose numbers were not computed is left out."""
        Figure, FigureCanvasAgg = _matplotlib()
        pts = self.points
        xs = [p["index"] for p in pts]
        labels = [p["name"] for p in pts]

        def series(section, key):
            return [_finite(_cell(p[section], key)) for p in pts]

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
        if self.histogram_points():
            panels.append("norm_histogram")
        if not panels:
            raise FusedStatsError("report plot: no point has a finite estimate to plot")
        fig = Figure(figsize=(4.4 * len(panels) + 0.6, 4.8), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, len(panels), squeeze=False)[0]
        for ax, panel in zip(axes, panels):
            if panel == "norm_histogram":
                _histogram_panel(ax, self.histogram_points())
                continue
            if panel in ("d_align", "ag_max"):
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
                if has_cert:
                    _line(ax, xs, series("certificate", "b_align"), marker="^", label="B_align (certificate)")
                    _line(ax, xs, series("certificate", "b_exact"), marker="v", label="B_exact (Cantelli)")
                if has_mis:
                    _errorbar(
                        ax,
                        xs,
                        series("misalignment", "probability"),
                        series("misalignment", "stderr"),
                        marker="o",
                        label="empirical Pr(misaligned)",
                    )
                ax.set_ylim(-0.02, 1.02)
                ax.set_title(
                    " vs ".join(
                        t
                        for t, on in (("certificate bound", has_cert), ("empirical misalignment", has_mis))
                        if on
                    )
                )
                ax.set_ylabel("probability of misalignment")
            ax.set_xticks(xs)
            ax.set_xticklabels([_short(n) for n in labels], rotation=45, ha="right", fontsize=7)
            ax.set_xlabel("insertion point")
            ax.grid(alpha=0.3)
            _scientific(ax)
            _legend_below(ax)
        fig.suptitle(
            f"{self.model['class']} ({self.model['num_parameters']:,} params)" + _meta_title(self.meta),
            fontsize=9,
        )
        _place_legends(fig, axes)
        return save_figure(fig, path)


# ---------------------------------------------------------------------------- sweeps
def plot_sweep(reports: Iterable[Report], x: str, path, point: str | int = "last") -> Path:
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
    Figure, FigureCanvasAgg = _matplotlib()

    def has(*keys):
        return any(r.get(k) is not None for r in rows for k in keys)

    # (title, y label, [(key, legend label)]) per panel, only for data that exists
    if x == "width":
        panels = [
            ("d_align vs width (spread over seeds)", "d_align (train)", [("d_align", "d_align (train)")])
        ]
        parts = [
            (k, t)
            for k, t in (
                ("misalignment", "empirical Pr(misaligned)"),
                ("b_align", "B_align (certificate)"),
                ("b_exact", "B_exact (Cantelli)"),
            )
            if has(k)
        ]
        if parts:
            title = " vs ".join(
                t
                for t, on in (
                    ("certificate bound", has("b_align", "b_exact")),
                    ("empirical misalignment", has("misalignment")),
                )
                if on
            )
            panels.append((f"transfer: {title}", "probability of misalignment", parts))
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
            _spread(ax, rows, key, label)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        if x == "width":
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(v) for v in xs])
        ax.xaxis.set_minor_locator(_null_locator())
        if ylabel == "probability of misalignment":
            ax.set_ylim(-0.02, 1.02)
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


# where a report without meta[x] keeps its width or depth: the HF config sizes (GPT-2's n_embd and
# n_layer read as these through its attribute_map), else the probe's own summary of the model
# (its "width" attribute, its number of residual points), as model_summary records them
SWEEP_CONFIG_KEYS = {"width": ("hidden_size", "width"), "depth": ("num_hidden_layers", "depth")}


def sweep_value(report: Report, x: str):
    """``report``'s value of the sweep variable ``x``: ``meta[x]`` (as the demo and users set it),
    else the first of :data:`SWEEP_CONFIG_KEYS` in the model config; None when neither exists."""
    if x in report.meta:
        return report.meta[x]
    config = report.model["config"]
    return next((config[k] for k in SWEEP_CONFIG_KEYS.get(x, ()) if _is_int(config.get(k))), None)


def sweep_rows(reports: list[Report], x: str, point: str | int = "last") -> list[dict]:
    """One flat row per report: x value, seed and the chosen point's numbers (for tables/plots)."""
    rows = []
    for r in reports:
        if not isinstance(r, Report):
            raise FusedStatsError(f"plot_sweep takes Report objects, got {type(r).__name__}")
        xv = sweep_value(r, x)
        if xv is None:
            raise FusedStatsError(
                f"report of {r.model['class']} has no meta[{x!r}] (meta keys: {sorted(r.meta)}) "
                f"and no config {' / '.join(SWEEP_CONFIG_KEYS[x])}; a {x} sweep needs one in every report"
            )
        p = _pick(r, point)
        tr, cert, mis, sat = p["train"], p["certificate"], p["misalignment"], p["saturation"]
        # optional: mean token norm of the stream at each point, recorded by the demo
        norms = r.meta.get("stream_norm")
        norm = norms.get(p["name"]) if isinstance(norms, dict) else None
        rows.append(
            {
                "x": xv,
                "seed": r.meta.get("seed"),
                "point": p["name"],
                "d_align": _finite(_cell(tr, "d_align")),
                "ag_max": _finite(_cell(tr, "ag_max")),
                "ag_mean": _finite(_cell(tr, "ag_mean")),
                "b_align": _finite(_cell(cert, "b_align")),
                "b_exact": _finite(_cell(cert, "b_exact")),
                "misalignment": _finite(_cell(mis, "probability")),
                "realized_alignment": _finite(p["realized_alignment"]),
                "cosine": _finite(cosine(p)),
                "d_par": _finite(_cell(tr, "d_par")),
                "d_2": _finite(_cell(tr, "d_2")),
                "cross_frob2": _finite(_cell(sat, "cross_frob2")),
                "test_loss": _finite(r.meta.get("test_loss")),
                "stream_norm": _finite(norm),
                "ag_max_scaled": (
                    None
                    if norm is None or _finite(_cell(tr, "ag_max")) is None
                    else _cell(tr, "ag_max") * norm / math.sqrt(p["dim"])
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


def sweep_summary(
    reports: Iterable[Report], x: str, point: str | int = "last", permutations: int = 10_000
) -> str:
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


def _pick(report: Report, point) -> dict:
    pts = report.points
    if not pts:
        raise FusedStatsError(f"report of {report.model['class']} has no points")
    if point == "last":
        return pts[-1]
    if point == "first":
        return pts[0]
    if _is_int(point):
        for p in pts:
            if p["index"] == point:
                return p
        raise FusedStatsError(f"report has no point with index {point}; indices: {[p['index'] for p in pts]}")
    return report.point(point)


# ---------------------------------------------------------------------------- plot helpers
def _matplotlib():
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


_save = save_figure


def _null_locator():
    from matplotlib.ticker import NullLocator

    return NullLocator()


def _scientific(ax) -> None:
    """Tick labels like 2.5e-4 as a shared ×10⁻⁴ offset instead of long decimals (linear axes)."""
    if ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 4), useMathText=True)


def _symlog(ax, positive) -> None:
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
    ax.set_ylim(-0.1 * 10.0**low, 10.0**high)


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


def _finite(value):
    if value is None or not _is_number(value) or not math.isfinite(value):
        return None
    return float(value)


def _line(ax, xs, ys, **kw):
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if pairs:
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], **kw)


def _errorbar(ax, xs, ys, es, **kw):
    trip = [(x, y, e or 0.0) for x, y, e in zip(xs, ys, es) if y is not None]
    if trip:
        ax.errorbar([t[0] for t in trip], [t[1] for t in trip], yerr=[t[2] for t in trip], capsize=3, **kw)


def _spread(ax, rows, key, label):
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
    (line,) = ax.plot(xs, med, marker="o", label=f"{label} (median)")
    ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
    dots = [(x, v) for x in xs for v in groups[x]]
    ax.scatter([d[0] for d in dots], [d[1] for d in dots], s=10, color=line.get_color(), alpha=0.6)


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


def _same(a, b) -> bool:
    """Structural equality that treats NaN as equal to NaN (for round-trip checks)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
