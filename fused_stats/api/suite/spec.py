"""The suite file: a TOML document naming the checkpoints, the shared data and the probe settings.

Every key is checked here, before any data is read or any model is loaded: an unknown key, a
wrong type, a glob that matches nothing or a trend label that a run lacks is a
:class:`FusedStatsError` naming the key and the file. Labels of a run come from its
``config.json`` (``width`` = hidden size, ``depth`` = block count, ``model_type``), from its path
(``step(\\d+)``, or the named groups of ``[labels] path_regex``) and from the file (``labels =
{...}``); ``parameters`` is the loaded model's parameter count.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import FusedStatsError
from ...networks.pretrained import is_pretrained_spec, resolve_model
from ...tomlfile import read_toml
from ..growth.protocol_file import KEYS as PROTOCOL_KEYS

SECTIONS = {
    "data": {
        "train",
        "test",
        "seq_len",
        "sequences",
        "batch_size",
        "field",
        "tokenizer",
    },
    "probe": {
        "points",
        "unit",
        "mask",
        "second_moment",
        "cross",
        "splits",
        "dtype",
        "stream_blocks",
        "trials",
        "seed",
    },
    "labels": {"path_regex"},
    "compare": {"trends", "point"},
    # the protocol file's keys (candidates also as relative depths or "all") and advise's alpha
    "growth": {*PROTOCOL_KEYS, "alpha"},
}
RUN_KEYS = {"model", "glob", "name", "labels"}
# protocol keys handed to GrowthProtocol only when the file sets them (else its defaults hold)
GIVEN_ONLY = ("score", "adam_eps", "train_batch_size")
UNITS = ("sample", "position", "flat")
MASKS = ("labels", "attention", "none")
SECOND_MOMENTS = ("auto", "dense", "pool")
DTYPES = ("float32", "float64", "bfloat16")
STEP_REGEX = r"step(?P<step>\d+)"
# trend labels that follow from the run (not set by the experimenter)
DERIVED_LABELS = ("parameters",)


@dataclass
class RunSpec:
    name: str
    model: Path
    labels: dict
    source: str  # the [[runs]] entry it came from, for messages


@dataclass
class SuiteSpec:
    path: Path
    sha256: str
    data: dict
    probe: dict
    runs: list[RunSpec]
    trends: list[str] | None  # None: every label that varies
    point: str
    raw: dict = field(repr=False, default_factory=dict)
    growth: dict | None = None  # the checked [growth] section (None: no growth probe)

    @property
    def splits(self) -> list[tuple[int, int]]:
        return [tuple(s) for s in self.probe["splits"]]


def _fail(path: Path, message: str):
    raise FusedStatsError(f"suite file {str(path)!r}: {message}")


def _int(path, where: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(path, f"{where} must be an integer >= {low}, got {value!r}")
    return value


def _choice(path, where: str, value, choices) -> str:
    if value not in choices:
        _fail(path, f"{where} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def read_suite(path) -> SuiteSpec:
    """Parse and check a suite file; finds the runs (globs expanded, relative to the file's folder)."""
    path = Path(path)
    payload, raw = read_toml(path, "suite file")
    unknown = sorted(set(raw) - set(SECTIONS) - {"runs"})
    if unknown:
        _fail(path, f"unknown section or key {unknown[0]!r} (known: {', '.join(sorted(SECTIONS))}, runs)")
    for section, keys in SECTIONS.items():
        value = raw.get(section, {})
        if not isinstance(value, dict):
            _fail(path, f"[{section}] must be a table, got {type(value).__name__}")
        bad = sorted(set(value) - keys)
        if bad:
            _fail(path, f"unknown key {bad[0]!r} in [{section}] (known: {', '.join(sorted(keys))})")
    base = path.parent
    data = _check_data(path, raw.get("data", {}), base)
    probe = _check_probe(path, raw.get("probe", {}))
    growth = _check_growth(path, raw["growth"], raw.get("probe", {})) if "growth" in raw else None
    regex = raw.get("labels", {}).get("path_regex", STEP_REGEX)
    try:
        pattern = re.compile(regex)
    except (re.error, TypeError) as exc:
        _fail(path, f"[labels] path_regex {regex!r} is not a regular expression ({exc})")
    runs = _find_runs(path, raw.get("runs"), base, pattern)
    compare = raw.get("compare", {})
    trends = compare.get("trends")
    if trends is not None:
        if not isinstance(trends, list) or not all(isinstance(t, str) for t in trends):
            _fail(path, f"[compare] trends must be a list of label names, got {trends!r}")
        for label in trends:
            if label in DERIVED_LABELS:
                continue
            lacking = [r.name for r in runs if r.labels.get(label) is None]
            if lacking:
                _fail(
                    path,
                    f"[compare] trends asks for label {label!r}, which run(s) {', '.join(lacking)} lack "
                    "(set it with labels = {...} in their [[runs]] entry, or drop the trend)",
                )
    point = compare.get("point", "last")
    if point not in ("last", "first") and not _relative_depth(point):
        _fail(
            path,
            f"[compare] point must be 'last', 'first' or a relative depth in (0, 1] as a string (e.g. '0.5'), got {point!r}",
        )
    return SuiteSpec(
        path=path,
        sha256=hashlib.sha256(payload).hexdigest(),
        data=data,
        probe=probe,
        runs=runs,
        trends=trends,
        point=point,
        raw=raw,
        growth=growth,
    )


def _check_data(path: Path, data: dict, base: Path) -> dict:
    for key in ("train", "test", "seq_len", "sequences"):
        if key not in data:
            _fail(path, f"[data] needs {key!r}")
    out = dict(data)
    for key in ("train", "test"):
        if not isinstance(data[key], str):
            _fail(path, f"[data] {key} must be a path string, got {data[key]!r}")
        source = (base / data[key]).resolve()
        if not source.exists():
            _fail(path, f"[data] {key} = {data[key]!r}: {str(source)!r} does not exist")
        out[key] = source
    out["seq_len"] = _int(path, "[data] seq_len", data["seq_len"], low=2)
    out["sequences"] = _int(path, "[data] sequences", data["sequences"])
    out["batch_size"] = _int(path, "[data] batch_size", data.get("batch_size", 8))
    out["field"] = data.get("field", "text")
    if not isinstance(out["field"], str):
        _fail(path, f"[data] field must be a string, got {out['field']!r}")
    out["tokenizer"] = _choice(
        path, "[data] tokenizer", data.get("tokenizer", "shared"), ("shared", "per-model")
    )
    return out


def _check_probe(path: Path, probe: dict) -> dict:
    out = dict(probe)
    points = probe.get("points", "residual")
    if not (
        points == "residual"
        or (isinstance(points, list) and points and all(isinstance(p, str) for p in points))
    ):
        _fail(path, f'[probe] points must be "residual" or a non-empty list of module names, got {points!r}')
    out["points"] = points
    out["unit"] = _choice(path, "[probe] unit", probe.get("unit", "sample"), UNITS)
    default_mask = "labels" if out["unit"] == "position" else "attention"
    out["mask"] = _choice(path, "[probe] mask", probe.get("mask", default_mask), MASKS)
    out["second_moment"] = _choice(
        path, "[probe] second_moment", probe.get("second_moment", "auto"), SECOND_MOMENTS
    )
    out["dtype"] = _choice(path, "[probe] dtype", probe.get("dtype", "float32"), DTYPES)
    stream = probe.get("stream_blocks", "auto")
    if stream not in ("auto", True, False):
        _fail(path, f'[probe] stream_blocks must be "auto", true or false, got {stream!r}')
    out["stream_blocks"] = stream
    out["trials"] = _int(path, "[probe] trials", probe.get("trials", 2000), low=0)
    out["seed"] = _int(path, "[probe] seed", probe.get("seed", 0), low=0)
    cross = probe.get("cross")
    if cross is not None:
        from ...contracts import ACTIVATIONS

        if isinstance(cross, int) and not isinstance(cross, bool):
            cross = {"rank": cross}
        if not isinstance(cross, dict) or set(cross) - {"rank", "activation"} or "rank" not in cross:
            _fail(
                path,
                f'[probe] cross must be a rank (integer) or {{rank = R, activation = "gelu"}}, got {cross!r}',
            )
        rank = _int(path, "[probe] cross rank", cross["rank"])
        activation = _choice(path, "[probe] cross activation", cross.get("activation", "gelu"), ACTIVATIONS)
        if out["unit"] == "flat":
            _fail(path, '[probe] cross needs unit = "sample" or "position"; got unit = "flat"')
        cross = {"rank": rank, "activation": activation}
    out["cross"] = cross
    splits = probe.get("splits", [])
    if not isinstance(splits, list) or not all(
        isinstance(s, list)
        and len(s) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in s)
        for s in splits
    ):
        _fail(path, f"[probe] splits must be a list of [M, K] pairs of integers >= 1, got {splits!r}")
    out["splits"] = [list(s) for s in splits]
    return out


def _check_growth(path: Path, growth: dict, probe: dict) -> dict:
    """The [growth] section: candidates as point names, as relative depths in [0, 1] (mapped per
    model by :func:`growth_candidates`) or "all"; the other keys by the protocol file's rules
    (:func:`fused_stats.api.growth.protocol_file.check_table`), so a bad value is named before any
    model loads; plus ``alpha``, the advisor's level."""
    from ..growth.protocol_file import check_table

    for key in ("points", "cross"):
        if key in probe:
            _fail(
                path,
                f"[probe] {key} cannot be set with [growth]: the probe's points are the protocol's "
                "candidates and its cross-gradient is the protocol's exact tangent",
            )
    if probe.get("stream_blocks") is True:
        _fail(
            path,
            "[probe] stream_blocks = true cannot be set with [growth]: the growth tangent runs a new "
            'block next to the model\'s own, so it needs the whole model (leave it "auto" or false)',
        )
    if probe.get("unit", "sample") != "sample":
        _fail(
            path,
            f'[growth] needs [probe] unit = "sample" (the advisor\'s p-values need independent samples, '
            f"one sequence each), got unit = {probe['unit']!r}",
        )
    if "candidates" not in growth:
        _fail(path, '[growth] needs candidates (a list of point names, of relative depths, or "all")')
    cands = growth["candidates"]
    names = isinstance(cands, list) and cands and all(isinstance(c, str) and c for c in cands)
    depths = (
        isinstance(cands, list)
        and cands
        and all(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c <= 1 for c in cands)
    )
    if not (cands == "all" or names or depths):
        _fail(
            path,
            '[growth] candidates must be "all", a non-empty list of point names or a non-empty list of '
            f"relative depths in [0, 1] (0: the input boundary, 1: after the last block), got {cands!r}",
        )
    if isinstance(cands, list) and len(set(cands)) != len(cands):
        _fail(
            path,
            f"[growth] candidates lists {sorted(c for c in set(cands) if cands.count(c) > 1)[0]!r} twice",
        )
    # the protocol's own keys by the protocol file's rules (one checker for both files); relative
    # depths stand in as "all" until each model maps them to its points (growth_candidates)
    keys = {k: v for k, v in growth.items() if k != "alpha"}
    if depths:
        keys["candidates"] = "all"
    try:
        arguments = check_table(keys, "[growth]")
    except FusedStatsError as exc:
        _fail(path, str(exc))
    out = {
        "candidates": cands,
        "family": arguments.get("family", "layer"),
        "init": arguments.get("init", "zero"),
        "seed": arguments.get("seed", 0),
        "width": arguments.get("width"),
        "projection": arguments.get("projection"),
        "budget": None if "budget" not in arguments else list(arguments["budget"]),
        **{key: arguments[key] for key in GIVEN_ONLY if key in arguments},
    }
    alpha = growth.get("alpha", 0.05)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha < 1:
        _fail(path, f"[growth] alpha must be a number in (0, 1), got {alpha!r}")
    out["alpha"] = float(alpha)
    return out


def protocol_for(growth: dict, candidates: list[str]):
    """The fs.GrowthProtocol of a checked [growth] section with these (resolved) candidates."""
    from ..growth.protocol import GrowthProtocol

    return GrowthProtocol(
        candidates=tuple(candidates),
        family=growth["family"],
        init=growth["init"],
        seed=growth["seed"],
        width=growth["width"],
        projection=growth["projection"],
        budget=None if growth["budget"] is None else tuple(growth["budget"]),
        **{key: growth[key] for key in GIVEN_ONLY if key in growth},
    )


def growth_candidates(growth: dict, model, arch=None) -> tuple[list[str], dict | None]:
    """``(point names, {requested depth: point})`` of a [growth] section for ``model``.

    A relative depth ``d`` names the boundary after block ``round(d·L)`` of the model's ``L``
    blocks (the suite's own relative depth of a point, :func:`~.compare.relative_depths`), ``0``
    the input boundary; two depths that land on one boundary probe it once. "all": every
    :func:`fused_stats.growth_points`. ``arch``: the model's row of the architecture table when
    the caller has described it already (None: described here)."""
    import math

    from ..growth.architecture import describe
    from ..probe.points import residual_points

    points = list((arch or describe(model)).boundaries)
    cands = growth["candidates"]
    if cands == "all":
        return points, None
    if isinstance(cands[0], str):
        return list(cands), None
    try:
        residual = set(residual_points(model))
    except FusedStatsError:
        residual = set()
    blocks = [p for p in points if p in residual]
    entry = [p for p in points if p not in residual]
    if not blocks:
        raise FusedStatsError(
            f"[growth] candidates as relative depths need the model's blocks; {type(model).__name__} has "
            f"growth points {points} but none of them is a residual point"
        )
    chosen, mapping = [], {}
    for d in cands:
        j = math.floor(d * len(blocks) + 0.5)
        if j == 0:
            if not entry:
                raise FusedStatsError(
                    f"[growth] relative depth {d!r} is the input boundary, which {type(model).__name__} "
                    f"has no growth point for (its points: {points})"
                )
            name = entry[0]
        else:
            name = blocks[j - 1]
        mapping[str(d)] = name
        if name not in chosen:
            chosen.append(name)
    return chosen, mapping


def _relative_depth(value) -> bool:
    try:
        return isinstance(value, str) and 0 < float(value) <= 1
    except ValueError:
        return False


def _labels_from_path(pattern: re.Pattern, model: Path) -> dict:
    found = {}
    for match in pattern.finditer(str(model)):
        for key, value in match.groupdict().items():
            if value is not None:
                found[key] = _number(value)
    return found


def _number(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def config_labels(model: Path) -> dict:
    """``width``, ``depth`` and ``model_type`` from a checkpoint folder's ``config.json``."""
    from ..streaming.plan import model_shape

    config_file = model / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"run {str(model)!r}: cannot read {config_file.name}: {exc}") from None
    try:
        width, depth = model_shape(config)
    except FusedStatsError as exc:
        raise FusedStatsError(f"run {str(model)!r}: {exc}") from None
    return {"width": width, "depth": depth, "model_type": config.get("model_type")}


def _find_runs(path: Path, entries, base: Path, pattern: re.Pattern) -> list[RunSpec]:
    if not isinstance(entries, list) or not entries:
        _fail(path, 'needs at least one [[runs]] entry (model = "folder" or glob = "pattern")')
    found: list[tuple[Path, dict, str]] = []
    for i, entry in enumerate(entries):
        where = f"[[runs]] entry {i + 1}"
        if not isinstance(entry, dict):
            _fail(path, f"{where} must be a table")
        bad = sorted(set(entry) - RUN_KEYS)
        if bad:
            _fail(path, f"unknown key {bad[0]!r} in {where} (known: {', '.join(sorted(RUN_KEYS))})")
        if ("model" in entry) == ("glob" in entry):
            _fail(path, f'{where} needs exactly one of model = "folder" or glob = "pattern"')
        hand = entry.get("labels", {})
        if not isinstance(hand, dict):
            _fail(path, f"{where}: labels must be a table, got {hand!r}")
        if "name" in entry and ("glob" in entry or not isinstance(entry["name"], str) or not entry["name"]):
            _fail(path, f"{where}: name must be a non-empty string, and only with model = ...")
        if "model" in entry:
            if not isinstance(entry["model"], str):
                _fail(path, f"{where}: model must be a path string, got {entry['model']!r}")
            folder = (
                Path(resolve_model(entry["model"], base=base))
                if is_pretrained_spec(entry["model"])
                else base / entry["model"]
            )
            folder = folder.resolve()
            if not (folder / "config.json").is_file():
                _fail(
                    path,
                    f"{where}: model {entry['model']!r} ({str(folder)!r}) is not a folder with a config.json",
                )
            found.append((folder, hand, entry.get("name")))
        else:
            if not isinstance(entry["glob"], str):
                _fail(path, f"{where}: glob must be a string, got {entry['glob']!r}")
            matches = sorted(
                Path(m).resolve()
                for m in globlib.glob(str(base / entry["glob"]))
                if (Path(m) / "config.json").is_file()
            )
            if not matches:
                _fail(
                    path,
                    f"{where}: glob {entry['glob']!r} matches no checkpoint folder (with a config.json) under {str(base)!r}",
                )
            found.extend((m, hand, None) for m in matches)
    folders = [f for f, _, _ in found]
    dupes = sorted({str(f) for f in folders if folders.count(f) > 1})
    if dupes:
        _fail(path, f"checkpoint {dupes[0]!r} is named by more than one [[runs]] entry")
    names = _names(folders, [n for _, _, n in found])
    if len(set(names)) != len(names):
        _fail(path, f"two runs have the same name: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    runs = []
    for (folder, hand, _), name in zip(found, names):
        labels = config_labels(folder)
        labels.update(
            _labels_from_path(pattern, folder.relative_to(base) if folder.is_relative_to(base) else folder)
        )
        labels.update(hand)
        runs.append(RunSpec(name=name, model=folder, labels=labels, source=str(folder)))
    return sorted(runs, key=lambda r: r.name)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _names(folders: list[Path], given: list) -> list[str]:
    """Each run's name: the one the file gives, else the shortest tail of its path (folder name,
    then parent-folder, ...) that no other run shares."""
    out = []
    for i, folder in enumerate(folders):
        if given[i]:
            out.append(_safe(given[i]))
            continue
        for k in range(1, len(folder.parts) + 1):
            tail = folder.parts[-k:]
            if all(other.parts[-k:] != tail for j, other in enumerate(folders) if j != i):
                break
        out.append(_safe("-".join(tail)))
    return out
