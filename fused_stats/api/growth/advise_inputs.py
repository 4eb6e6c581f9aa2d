"""What :func:`.advise.advise` combines: the reports of its source, and the checks that they
can be combined (independent sample units, one model by fingerprint, one model structure).

Role: :func:`reports_of` turns a Probe, a Report, a report path or a list of them into report
dicts; :func:`check_units` refuses position units, :func:`check_one_model` reports of different
models (:func:`model_differences` says what differs), :func:`measured_structure` reads the model
structure the probes measured (the plan's ``structure``, kept in each report's growth protocol
record), which ``fs.grow(evidence=advice)`` checks against the model as it is.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import FusedStatsError
from ..report.document import Report

# the probe units whose samples are independent (one sequence, or one flattened sample, each)
INDEPENDENT_UNITS = ("sample", "flat")


def reports_of(source, probes=None) -> list[dict]:
    from ..probe.driver import Probe

    items = source if isinstance(source, (list, tuple)) else [source]
    out = []
    for item in items:
        if isinstance(item, Probe):
            out.append(item.report(misalignment_trials=0).data)
            if probes is not None:
                probes.append(item)
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


def check_units(reports: list[dict]) -> None:
    for i, data in enumerate(reports):
        unit = data.get("unit")
        if unit not in INDEPENDENT_UNITS:
            raise FusedStatsError(
                f"report {i} was probed with unit={unit!r}: the positions of one sequence are not "
                "independent samples, so the standard errors and the Holm-adjusted p-values of the "
                f"saturation test would not hold; advise takes units {list(INDEPENDENT_UNITS)} (probe "
                "with fs.Probe(..., unit='sample'): each sequence one sample)"
            )


def model_differences(a: dict, b: dict) -> list[str]:
    """What differs between two reports' ``model`` records (class, config, count, values)."""
    fa, fb = a["fingerprint"], b["fingerprint"]
    out = []
    if a.get("class") != b.get("class"):
        out.append(f"model class {a.get('class')} vs {b.get('class')}")
    if fa["config_digest"] != fb["config_digest"]:
        ca, cb = a.get("config") or {}, b.get("config") or {}
        keys = [k for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)]
        shown = ", ".join(f"{k} {ca.get(k)} vs {cb.get(k)}" for k in keys)
        out.append(
            f"configuration (digest {fa['config_digest'][:12]}… vs {fb['config_digest'][:12]}…"
            + (f": {shown}" if shown else "")
            + ")"
        )
    if fa["num_parameters"] != fb["num_parameters"]:
        out.append(f"parameter count {fa['num_parameters']:,} vs {fb['num_parameters']:,}")
    if fa["parameters_digest"] != fb["parameters_digest"]:
        out.append(
            f"parameter values (digest {fa['parameters_digest'][:12]}… vs {fb['parameters_digest'][:12]}…: "
            "other weights, e.g. another seed, checkpoint or training step)"
        )
    return out


def check_one_model(reports: list[dict]) -> None:
    """Several reports are combined only when their fingerprints name one model."""
    if len(reports) < 2:
        return
    for i, data in enumerate(reports):
        fingerprint = data["model"].get("fingerprint")
        if fingerprint is None:
            raise FusedStatsError(
                f"report {i} records no model fingerprint (written by an older fused_stats): cannot "
                "check that the reports measured one model; re-run its probe"
            )
        if fingerprint["parameters_digest"] is None:
            raise FusedStatsError(
                f"report {i} has no digest of the parameter values "
                f"({fingerprint.get('parameters_digest_missing')}): cannot check that the reports "
                "measured one model; probe the candidates in one run, or on a model whose weights "
                "this process holds"
            )
    for i, data in enumerate(reports[1:], 1):
        differences = model_differences(reports[0]["model"], data["model"])
        if differences:
            raise FusedStatsError(
                f"reports 0 and {i} were measured on different models: {'; '.join(differences)}. "
                "advise combines the reports of one model only"
            )


def measured_structure(records: list[dict]) -> dict | None:
    """The model structure the reports' probes measured (None: a report records none); refused
    when malformed or when the reports disagree (they measured different models)."""
    found = [r.get("model_structure") for r in records]
    if any(s is None for s in found):
        return None
    for i, s in enumerate(found):
        blocks = s.get("blocks") if isinstance(s, dict) else None
        if (
            not isinstance(blocks, dict)
            or not all(isinstance(n, int) for n in blocks.values())
            or not isinstance(s.get("record_events"), int)
        ):
            raise FusedStatsError(
                f"report {i}'s model_structure must be {{'blocks': {{container: int}}, 'record_events': int}}, got {s!r}"
            )
        if s != found[0]:
            raise FusedStatsError(
                f"reports 0 and {i} were measured on models of different structure ({found[0]} vs {s})"
            )
    return found[0]


__all__ = [
    "INDEPENDENT_UNITS",
    "check_one_model",
    "check_units",
    "measured_structure",
    "model_differences",
    "reports_of",
]
