"""The version-1 report dict of a probe's results (the input of :class:`~.document.Report`).

Role: one entry per point with its train and test estimates, certificate, misalignment,
realized alignment and saturation (each ``None`` where that point cannot give it, e.g. too few
samples or no test stream), plus the model's summary and fingerprint and the growth protocol's
entries that apply to the model. The caller (``Probe.report``) passes what it has measured: this
module reads the results through their public methods and never imports the probe (report/ is the
bottom layer of the api).
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence

from torch import nn

from ..._version import __version__
from ...errors import FusedStatsError
from .identity import model_fingerprint, protocol_with_model_entries


def _or_none(fn, *args, **kwargs):
    """``fn(...)`` as a plain dict, or None where it is refused (a weak point's missing entry)."""
    try:
        result = fn(*args, **kwargs)
    except FusedStatsError:
        return None
    return result.to_dict() if hasattr(result, "to_dict") else result


def report_data(
    results,
    model: nn.Module,
    *,
    points: Sequence[str],
    dims: Mapping[str, int],
    unit: str,
    second_moment: str,
    summary: dict,
    norm_histograms: Mapping,
    protocol: dict | None = None,
    with_saturation: bool = False,
    meta: dict | None = None,
    misalignment_trials: int = 2000,
) -> dict:
    """The report dict (:mod:`fused_stats.api.report.schema`).

    ``results``: an object with ``estimate(point, stream)``, ``certificate(point)``,
    ``misalignment(point, trials=)``, ``realized_alignment(point)`` and ``saturation(point)``
    (a :class:`fused_stats.api.probe.results.ProbeResults`); ``dims``: each point's width, empty
    before the first step; ``summary``: the model's ``{"class", "num_parameters", "config"}``;
    ``norm_histograms``: ``point -> NormHistogram`` of the train stream (points without one are
    left out); ``protocol``: the growth protocol's record, or None; ``with_saturation``: whether
    the probe keeps cross statistics; ``misalignment_trials``: 0 skips the misalignment.
    """
    if not dims:
        raise FusedStatsError("nothing probed yet: run Probe.step (or run) before a report")
    entries = []
    for index, name in enumerate(points):
        mis = None
        if misalignment_trials:
            mis = _or_none(results.misalignment, name, trials=misalignment_trials)
        hist = norm_histograms.get(name)
        realized = _or_none(results.realized_alignment, name)
        entries.append(
            {
                "name": name,
                "index": index,
                "dim": dims[name],
                "train": _or_none(results.estimate, name, "train"),
                "test": _or_none(results.estimate, name, "test"),
                "certificate": _or_none(results.certificate, name),
                "misalignment": mis,
                "realized_alignment": None if realized is None else realized["value"],
                "saturation": _or_none(results.saturation, name) if with_saturation else None,
                **({} if hist is None else {"norm_histogram": hist.to_dict()}),
            }
        )
    return {
        "format": "fused_stats.report",
        "version": 1,
        "fused_stats_version": __version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {**summary, "fingerprint": model_fingerprint(model)},
        "unit": unit,
        "second_moment": second_moment,
        "points": entries,
        **({"growth_protocol": protocol_with_model_entries(protocol, model)} if protocol else {}),
        "meta": dict(meta or {}),
    }
