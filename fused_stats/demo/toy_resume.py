"""Resuming the toy demo (``fused-stats demo --toy``) after an interruption.

Role: the demo's runs take minutes; a Ctrl-C or a lost session must not cost the finished ones.
Every run's report is written atomically to ``runs/w{width}-d{depth}-s{seed}.json`` as soon as
the run is done, stamped with the configuration's key (:func:`config_key`: a digest of every
:class:`~fused_stats.demo.experiment.DemoConfig` field and the package version), and the folder's
``demo_config.json`` records the configuration it belongs to. A rerun with the same configuration
into the same ``--out`` reads the finished runs back and computes only the missing ones. A folder
that holds anything else (another configuration, or files of no demo) is refused unless
``--force``; ``--force`` starts this configuration afresh: it removes the run files and the
summary outputs that another configuration left, so that nothing of it reaches the tables, and
recomputes every run (as ``fused-stats suite --force`` does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from ..errors import FusedStatsError

MANIFEST = "demo_config.json"
FORMAT = "fused-stats toy demo"
KEY_FIELD = "demo_config_key"  # in each run report's meta
# what a run of another configuration leaves at the top of the folder (the plots' names vary)
SUMMARY_OUTPUTS = ("summary.md", "interventions.json", "width_sweep.png", "depth_sweep.png")


def config_record(cfg) -> dict:
    """The configuration as JSON (tuples as lists), with the package version that computes it."""
    from .. import __version__

    return {
        "format": FORMAT,
        "version": __version__,
        "config": json.loads(json.dumps(dataclasses.asdict(cfg))),
    }


def config_key(cfg) -> str:
    """A digest of :func:`config_record`: equal keys, equal runs."""
    text = json.dumps(config_record(cfg), sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def run_path(out, width: int, depth: int, seed: int) -> Path:
    return Path(out) / "runs" / f"w{width}-d{depth}-s{seed}.json"


def _recorded(out: Path) -> dict | None:
    """The folder's manifest, or None when it has none or it is unreadable."""
    try:
        data = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _differences(old: dict, new: dict) -> str:
    """The fields two configuration records differ in, as ``name old -> new``."""
    changed = [
        f"{name} {old['config'].get(name)!r} -> {value!r}"
        for name, value in new["config"].items()
        if old.get("config", {}).get(name) != value
    ]
    if old.get("version") != new["version"]:
        changed.append(f"fused_stats version {old.get('version')!r} -> {new['version']!r}")
    return ", ".join(changed) or "the recorded key differs"


def check_out(cfg, out, force: bool, option: str = "--out") -> Path:
    """Refuse ``out`` before anything is written unless it is missing, empty, this configuration's
    folder (a resume) or ``force`` is given; a file is always refused."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FusedStatsError(f"{option} {str(out)!r} is a file; the command writes a folder")
    if force or not out.is_dir():
        return out
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return out
    old = _recorded(out)
    if old is not None and old.get("key") == config_key(cfg):
        return out
    if old is not None:
        raise FusedStatsError(
            f"{option} {str(out)!r} holds a toy demo run of another configuration "
            f"({_differences(old, dict(config_record(cfg)))}); rerun with its configuration to resume "
            "it, pass --force to start this one there (the other configuration's runs are removed), "
            "or choose another folder"
        )
    shown = ", ".join(repr(n) for n in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    raise FusedStatsError(
        f"{option} {str(out)!r} holds {shown} already and no {MANIFEST} of a toy demo run to resume; "
        "pass --force to write into it (files of the same names are replaced) or choose an empty folder"
    )


def open_out(cfg, out, force: bool) -> tuple[Path, str, bool]:
    """Check ``out`` (:func:`check_out`), create ``out/runs`` and record this configuration;
    returns ``(out, key, resume)``. Under ``force``, or when the folder recorded another
    configuration, the run files and summary outputs of before are removed (``resume`` False)."""
    from ..accumulators.persistence import write_text_atomic

    out = check_out(cfg, out, force)
    key = config_key(cfg)
    old = _recorded(out) if out.is_dir() else None
    resume = not force and old is not None and old.get("key") == key
    (out / "runs").mkdir(parents=True, exist_ok=True)
    if not resume:
        for path in (out / "runs").glob("w*-d*-s*.json"):
            path.unlink()
        for name in SUMMARY_OUTPUTS:
            (out / name).unlink(missing_ok=True)
        for path in out.glob("points_w*-d*-s*.png"):
            path.unlink()
        write_text_atomic(out / MANIFEST, json.dumps(dict(config_record(cfg), key=key), indent=1) + "\n")
    return out, key, resume


def finished_run(out, key: str, width: int, depth: int, seed: int):
    """The run's report when a run of this configuration finished it (else None: never run, or
    a file another configuration or an older fused_stats wrote)."""
    from ..api.report.document import Report

    path = run_path(out, width, depth, seed)
    if not path.is_file():
        return None
    try:
        report = Report.from_json(path)
    except FusedStatsError:
        return None
    return report if report.meta.get(KEY_FIELD) == key else None
