"""The report format (version 1): its keys, validation, JSON encoding and number formatting.

Role: the one definition of what a :class:`~fused_stats.api.report.document.Report` dict holds
(its layout is in that module's docstring), shared by the document, the sweeps, the plots and the
monitor log. JSON has no infinity or NaN (``d_par`` is ``inf`` when the ``μᵀΣμ`` estimate is ≤ 0),
so :func:`encode` writes non-finite floats as the strings ``"Infinity"``, ``"-Infinity"`` and
``"NaN"`` and :func:`decode` turns them back into floats; the file itself is strict JSON.
"""

from __future__ import annotations

import dataclasses
import math

from ...accumulators import Certificate, Estimate, Misalignment
from ...errors import FusedStatsError

FORMAT = "fused_stats.report"
VERSION = 1


_NULLABLE = ("float | None",)


def _number_fields(cls) -> tuple[str, ...]:
    """The int and float fields of a result dataclass (the numbers its ``to_dict`` writes), those
    that may be None (not estimable at this n) included."""
    return tuple(
        f.name for f in dataclasses.fields(cls) if f.type in ("int", "float", int, float, *_NULLABLE)
    )


def _nullable_fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.type in _NULLABLE)


# Keys a point's sub-dicts must carry, as numbers (or null where the field may be not estimable);
# extra keys (e.g. ``effective_rank``) are kept as they are.
ESTIMATE_KEYS = _number_fields(Estimate)
NULLABLE_KEYS = frozenset(_nullable_fields(Estimate) + _nullable_fields(Certificate))
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
# keys of the optional model["fingerprint"] (which model the statistics were measured on)
FINGERPRINT_KEYS = ("config_digest", "num_parameters", "parameters_digest")
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


def encode(value):
    """Replace non-finite floats by strings, recursively (JSON cannot hold them)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return _NONFINITE_OUT[value]
        return value
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars in user meta
        try:
            return encode(value.item())
        except (TypeError, ValueError):
            pass
    return value


def decode(value):
    """Inverse of :func:`encode`: the three marker strings become floats again."""
    if isinstance(value, str):
        return _NONFINITE_IN.get(value, value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value) -> bool:
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
        if not is_number(value[k]) and not (value[k] is None and k in NULLABLE_KEYS):
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
    if not is_int(model.get("num_parameters")):
        raise FusedStatsError(
            f"report: model['num_parameters'] must be an int, got {model.get('num_parameters')!r}"
        )
    if not isinstance(model.get("config"), dict):
        raise FusedStatsError(f"report: model['config'] must be a dict, got {model.get('config')!r}")
    if "fingerprint" in model:
        _check_fingerprint(model["fingerprint"])
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
            if not is_int(point[key]):
                raise FusedStatsError(f"report: point {name!r}: {key} must be an int, got {point[key]!r}")
        _check_sub(f"point {name!r} train", point["train"], ESTIMATE_KEYS)
        _check_sub(f"point {name!r} test", point["test"], ESTIMATE_KEYS)
        _check_sub(f"point {name!r} certificate", point["certificate"], CERTIFICATE_KEYS)
        _check_sub(f"point {name!r} misalignment", point["misalignment"], MISALIGNMENT_KEYS)
        ra = point["realized_alignment"]
        if ra is not None and not is_number(ra):
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


def _check_fingerprint(fingerprint) -> None:
    """Raise unless ``fingerprint`` is a model fingerprint dict (:mod:`.identity`)."""
    where = "report: model['fingerprint']"
    if not isinstance(fingerprint, dict):
        raise FusedStatsError(f"{where} must be a dict, got {type(fingerprint).__name__}")
    missing = [k for k in FINGERPRINT_KEYS if k not in fingerprint]
    if missing:
        raise FusedStatsError(f"{where} lacks keys {missing}")
    if not isinstance(fingerprint["config_digest"], str):
        raise FusedStatsError(
            f"{where}['config_digest'] must be a string, got {fingerprint['config_digest']!r}"
        )
    if not is_int(fingerprint["num_parameters"]):
        raise FusedStatsError(
            f"{where}['num_parameters'] must be an int, got {fingerprint['num_parameters']!r}"
        )
    digest = fingerprint["parameters_digest"]
    if digest is not None and not isinstance(digest, str):
        raise FusedStatsError(f"{where}['parameters_digest'] must be a string or null, got {digest!r}")


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
        and all(is_number(e) and e > 0 for e in edges)
        and all(is_int(c) and c >= 0 for c in counts)
    ):
        raise FusedStatsError(
            f"{where}: needs counts (non-negative ints, one per bin) and one more positive edge "
            f"than counts; got {len(edges) if isinstance(edges, list) else edges!r} edges and "
            f"{len(counts) if isinstance(counts, list) else counts!r} counts"
        )
    for key in ("n", "underflow", "overflow"):
        if not is_int(hist[key]) or hist[key] < 0:
            raise FusedStatsError(f"{where}: {key} must be a non-negative int, got {hist[key]!r}")
    if sum(counts) + hist["underflow"] + hist["overflow"] != hist["n"]:
        raise FusedStatsError(
            f"{where}: the counts add up to {sum(counts) + hist['underflow'] + hist['overflow']}, "
            f"n={hist['n']}"
        )


def fmt(value, spec: str = ".4g") -> str:
    """A number as the markdown shows it; ``—`` for missing values (a field not estimable at
    this n is None; the report prints its reason beside it)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if is_int(value):
        return str(value)
    if is_number(value):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(value, spec)
    return str(value)


SE_NOT_ESTIMABLE = "SE not estimable at this n"


def fmt_se(value, spec: str = ".4g") -> str:
    """A standard error as printed: a missing one (None; NaN in reports written before such values
    became None) says it is not estimable instead of showing a number."""
    if value is None or (is_number(value) and math.isnan(value)):
        return SE_NOT_ESTIMABLE
    return fmt(value, spec)


def cell(sub: dict | None, key: str):
    return None if sub is None else sub.get(key)


def finite(value):
    if value is None or not is_number(value) or not math.isfinite(value):
        return None
    return float(value)


def same(a, b) -> bool:
    """Structural equality that treats NaN as equal to NaN (for round-trip checks)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
