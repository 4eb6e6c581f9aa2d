"""Running a suite: shards, resumable per-run files, and ``suite.json`` from every finished run.

Files under ``DIR``: ``plan.json`` (the suite file's SHA-256, the windows' SHA-256 per tokenizer
and the run list with each run's key, :mod:`.identity`; written atomically, identical from every
shard), ``runs/<name>.json`` (one finished run, ``status`` done or failed, with the key it ran
under), and, once every run of the plan has a file with the plan's key, ``suite.json``,
``suite.md`` and the plots. A run file with another key (suite file, windows, checkpoint files or
package version changed) is stale and the run is probed again; ``force`` probes every run again.
A plan from another suite file or other windows is refused unless ``force``, or unless none of
its runs finished (a file that failed validation leaves nothing to protect).

Sharding: run ``k`` (runs sorted by name) belongs to shard ``k mod n``. The shard comes from
``--shard i/n``, else from torchrun's ``RANK``/``WORLD_SIZE`` and a SLURM array's
``SLURM_ARRAY_TASK_ID``/``SLURM_ARRAY_TASK_MIN``/``SLURM_ARRAY_TASK_STEP``/``SLURM_ARRAY_TASK_COUNT``
(both together: rank ``r`` of task ``t`` is shard ``t·WORLD_SIZE + r``). No process waits for
another: each checks after its own share whether the plan is complete, so the last to finish
writes the suite files. One run's own work (load, probe, its entry) is
:mod:`fused_stats.api.suite.single_run`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ...accumulators.persistence import write_atomic
from ...errors import FusedStatsError
from ..report.schema import decode, encode
from .data import Windows, held_out_warnings
from .identity import run_key, stale_because
from .single_run import (  # noqa: F401  (re-exported)
    TokenLoss,
    advice_entry,
    check_points,
    execute_run,
    growth_plan,
    growth_protocol,
    probe_windows,
    reuse_loaded,
    run_meta,
    stream_decision,
)
from .spec import RunSpec, SuiteSpec

FORMAT = "fused_stats.suite"
VERSION = 1


@dataclass(frozen=True)
class Shard:
    index: int
    count: int
    how: str  # "single", "--shard", "torchrun", "slurm", "slurm+torchrun"
    local_rank: int | None = None


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise FusedStatsError(f"--shard must be I/N with integers 0 <= I < N, got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise FusedStatsError(f"--shard must be I/N with 0 <= I < N, got {text!r}")
    return i, n


def _env_int(env, key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise FusedStatsError(f"environment variable {key}={env[key]!r} is not an integer") from None


def shard_from_env(explicit: str | None = None, env=None) -> Shard:
    """This process's shard (module docstring); ``explicit`` is ``--shard i/n``."""
    env = os.environ if env is None else env
    local = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
    if explicit:
        i, n = parse_shard(explicit)
        return Shard(i, n, "--shard", local)
    index, count, how = 0, 1, []
    if "SLURM_ARRAY_TASK_ID" in env:
        task = _env_int(env, "SLURM_ARRAY_TASK_ID")
        low = _env_int(env, "SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in env else 0
        step = _env_int(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
        if "SLURM_ARRAY_TASK_COUNT" not in env:
            raise FusedStatsError(
                "SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; pass --shard I/N"
            )
        count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
        high = (
            _env_int(env, "SLURM_ARRAY_TASK_MAX")
            if "SLURM_ARRAY_TASK_MAX" in env
            else low + step * (count - 1)
        )
        # an array given as a list (--array=1,4,9) has no constant step: the task id alone cannot say
        # which of the COUNT shares is this task's
        if step < 1 or (task - low) % step or (high - low) != step * (count - 1):
            raise FusedStatsError(
                f"SLURM array ids {low}..{high} (step {step}, {count} tasks) are not evenly spaced; "
                "use --array=A-B[:S] or pass --shard I/N"
            )
        index = (task - low) // step
        how.append("slurm")
    if "WORLD_SIZE" in env and "RANK" in env:
        world, rank = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
        if world < 1 or not 0 <= rank < world:
            raise FusedStatsError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
        index, count = index * world + rank, count * world
        how.append("torchrun")
    return Shard(index, count, "+".join(how) or "single", local)


def my_runs(runs: list[RunSpec], shard: Shard) -> list[RunSpec]:
    return [r for k, r in enumerate(runs) if k % shard.count == shard.index]


# ---------------------------------------------------------------------------- files
def _dump(path: Path, obj) -> None:
    write_atomic(path, (json.dumps(encode(obj), indent=1, allow_nan=False) + "\n").encode("utf-8"))


def _load(path: Path):
    try:
        return decode(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"cannot read {str(path)!r}: {exc}") from None


def plan_document(spec: SuiteSpec, windows: dict[str, Windows], run_tokenizer: dict[str, str]) -> dict:
    return {
        "format": FORMAT + ".plan",
        "version": VERSION,
        "suite": {"file": str(spec.path.resolve()), "sha256": spec.sha256},
        "tokenizer": spec.data["tokenizer"],
        "data": {key: w.describe() for key, w in windows.items()},
        "warnings": held_out_warnings(spec.data, windows),
        "settings": {
            "seq_len": spec.data["seq_len"],
            "sequences": spec.data["sequences"],
            "batch_size": spec.data["batch_size"],
            **{k: v for k, v in spec.probe.items()},
        },
        "trends": spec.trends,
        "point": spec.point,
        "growth": spec.growth,
        "runs": [
            {
                "name": r.name,
                "model": str(r.model),
                "labels": r.labels,
                "tokenizer": run_tokenizer[r.name],
                "key": run_key(
                    spec.sha256,
                    {s: windows[run_tokenizer[r.name]].sha256(s) for s in ("train", "test")},
                    r.model,
                    spec.growth,
                ),
            }
            for r in spec.runs
        ],
    }


def plan_keys(plan: dict) -> dict[str, dict]:
    return {item["name"]: item.get("key") for item in plan["runs"]}


def open_dir(out: Path, plan: dict, force: bool) -> None:
    """Create ``out`` or check that it belongs to this suite file (and these windows)."""
    existing = out / "plan.json"
    if out.exists() and not out.is_dir():
        raise FusedStatsError(f"--out {str(out)!r} is a file; a suite writes a folder")
    if existing.is_file():
        old = _load(existing)
        if not force and _any_done(out, old):
            if old.get("suite", {}).get("sha256") != plan["suite"]["sha256"]:
                raise FusedStatsError(
                    f"{str(out)!r} holds a suite run from a different suite file (sha256 "
                    f"{str(old.get('suite', {}).get('sha256'))[:12]}…, this file {plan['suite']['sha256'][:12]}…); "
                    "pass --force to redo it with this file, or choose another --out"
                )
            if old.get("data") != plan["data"]:
                raise FusedStatsError(
                    f"{str(out)!r}: the data windows changed since this suite was started (their "
                    "SHA-256 differ from plan.json); pass --force to redo every run, or choose another --out"
                )
        if old == plan:
            return
        _remove_outputs(out)  # they describe the old plan; the last run of this one writes them again
    _dump(existing, plan)


def _remove_outputs(out: Path) -> None:
    from .compare import PLOTS

    for name in ("suite.json", "suite.md", *PLOTS):
        (out / name).unlink(missing_ok=True)


def _any_done(out: Path, plan: dict) -> bool:
    """Whether any run of ``plan`` finished (status done) under the plan's key."""
    keys = plan_keys(plan) if isinstance(plan.get("runs"), list) else {}
    return any((finished(out, name, key) or {}).get("status") == "done" for name, key in keys.items())


def run_file(out: Path, name: str) -> Path:
    return out / "runs" / f"{name}.json"


def read_run(out: Path, name: str) -> dict | None:
    """The run's file (None when missing or torn)."""
    path = run_file(out, name)
    if not path.is_file():
        return None
    try:
        entry = _load(path)
    except FusedStatsError:
        return None
    return entry if isinstance(entry, dict) else None


def finished(out: Path, name: str, key: dict | None) -> dict | None:
    """The run's file when it was finished under ``key`` (a torn or stale file: None)."""
    entry = read_run(out, name)
    if entry is None or key is None:
        return None
    return entry if entry.get("key") == key and entry.get("status") in ("done", "failed") else None


# ---------------------------------------------------------------------------- this shard's runs
def execute(
    spec,
    out: Path,
    windows: dict,
    run_tokenizer: dict,
    shard: Shard,
    device,
    loader,
    progress: bool,
    keys: dict[str, dict],
    force: bool = False,
    echo=print,
):
    """Run this shard's runs that have no done-file under their key (every one under ``force``);
    returns ``(done, skipped, failed)`` name lists."""
    from ...progress import Progress

    mine = my_runs(spec.runs, shard)
    done, skipped, failed = [], [], []
    with Progress(len(mine), "suite", enabled=progress, unit="runs") as bar:
        for k, run in enumerate(mine, 1):
            key = keys[run.name]
            old = read_run(out, run.name)
            if old is not None and not force:
                why = stale_because(old.get("key"), key)
                if why is None and old.get("status") == "done":
                    skipped.append(run.name)
                    bar.update()
                    continue
                bar.write(f"{run.name}: probed again: " + (why or "its last try failed"))
            step = run.labels.get("step")
            bar.set_description(
                f"suite {k}/{len(mine)}: {run.name}" + (f" (step {step})" if step is not None else "")
            )
            entry = execute_run(
                spec,
                run,
                windows[run_tokenizer[run.name]],
                device,
                loader,
                progress,
                lambda m: bar.write(m),
                key,
            )
            _dump(run_file(out, run.name), entry)
            (done if entry["status"] == "done" else failed).append(run.name)
            bar.update()
    return done, skipped, failed


# ---------------------------------------------------------------------------- the suite document
def collect(out: Path, partial: bool = False) -> tuple[dict | None, list[str]]:
    """``(suite document, pending names)``: the document over every finished run of
    ``out/plan.json``; None while runs are pending unless ``partial``."""
    plan_file = out / "plan.json"
    if not plan_file.is_file():
        raise FusedStatsError(f"{str(out)!r} is not a suite folder (no plan.json)")
    plan = _load(plan_file)
    runs, pending, pending_labels = {}, [], {}
    for item in plan["runs"]:
        entry = finished(out, item["name"], item.get("key"))
        if entry is None:
            pending.append(item["name"])
            pending_labels[item["name"]] = item["labels"]
            continue
        runs[item["name"]] = {
            "model": entry["model"],
            "labels": entry["labels"],
            "tokenizer": entry["tokenizer"],
            "status": entry["status"],
            "error": entry["error"],
            "residual_points": entry.get("residual_points"),
            "report": entry["report"],
            "budgets": entry["budgets"],
            "test_loss": entry.get("test_loss"),
            "test_perplexity": entry.get("test_perplexity"),
            "advice": entry.get("advice"),
        }
    if pending and not partial:
        return None, pending
    suite = {
        "format": FORMAT,
        "version": VERSION,
        "suite": plan["suite"],
        "tokenizer": plan["tokenizer"],
        "data": plan["data"],
        "warnings": plan.get("warnings", []),
        "settings": plan["settings"],
        "trends": plan["trends"],
        "point": plan["point"],
        "growth": plan.get("growth"),
        "runs": runs,
        "failed": sorted(n for n, r in runs.items() if r["status"] == "failed"),
        "pending": pending,
    }
    if pending:  # the runs table lists them, with the labels the suite file gives them
        suite["pending_labels"] = pending_labels
    return suite, pending


def write_suite(out: Path, suite: dict, plots: bool = True) -> list[Path]:
    from .compare import render_markdown, render_plots

    _dump(out / "suite.json", suite)
    written = [out / "suite.json"]
    write_atomic(out / "suite.md", render_markdown(suite).encode("utf-8"))
    written.append(out / "suite.md")
    if plots:
        written.extend(render_plots(suite, out))
    return written
