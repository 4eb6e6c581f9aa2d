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
writes the suite files.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ...accumulators.persistence import write_atomic
from ...errors import FusedStatsError
from ..report.schema import decode, encode
from .data import Windows, held_out_warnings
from .identity import run_key, stale_because
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


# ---------------------------------------------------------------------------- one run
def stream_decision(spec: SuiteSpec, run: RunSpec, device) -> tuple[bool, str]:
    """``stream_blocks``: as the file says, or for "auto" whether the memory plan of the whole
    model (weights, every block's activations, the gradients in flight and the reduced rows,
    accumulators) fits the device's free memory."""
    setting = spec.probe["stream_blocks"]
    if spec.growth is not None:  # the spec refuses true: a streamed model has no block to grow beside
        return False, "[growth] probes the whole model (its tangent runs a new block beside the model's own)"
    if setting is not True and setting is not False:
        from ..streaming.plan import human_bytes, plan_streaming

        size = {"float32": 4, "float64": 8, "bfloat16": 2}[spec.probe["dtype"]]
        plan = plan_streaming(
            run.model,
            tokens=spec.data["batch_size"] * spec.data["seq_len"],
            samples=spec.data["batch_size"],
            dtype_bytes=size,
            pool_size=2 * spec.data["sequences"],
        )
        whole = (
            plan.model_bytes
            + plan.blocks * plan.block_activation_bytes
            + plan.gradient_bytes
            + plan.reduced_bytes
            + plan.accumulator_bytes
        )
        free = _free_bytes(device)
        stream = free is not None and whole > 0.9 * free
        return (
            stream,
            f"auto: whole model needs ~{human_bytes(whole)}, "
            f"{'unknown' if free is None else human_bytes(free)} free",
        )
    return bool(setting), "set in the suite file"


def _free_bytes(device) -> int | None:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def probe_windows(model, windows: Windows, spec: SuiteSpec, device, progress: bool, meta: dict):
    """Probe ``model`` on the windows; returns ``(report dict, budgets, extra)`` where ``budgets``
    lists, per (M, K) of the file, each point's certificate and misalignment, and ``extra`` holds
    ``test_loss``/``test_perplexity`` (from the probe's own per-sample losses on the test stream)
    and, with a [growth] section, the ``advice``."""
    import torch

    from ...progress import Progress
    from ..probe.driver import Probe
    from ..probe.losses import causal_lm_loss
    from ..probe.spec import CrossSpec

    p = spec.probe
    protocol, depths = None, None
    if spec.growth is not None:
        protocol, depths = growth_protocol(spec, model)
        probe = Probe(model, unit=p["unit"], second_moment=p["second_moment"], cross=protocol)
    else:
        cross = (
            None
            if p["cross"] is None
            else CrossSpec(rank=p["cross"]["rank"], activation=p["cross"]["activation"], seed=p["seed"])
        )
        probe = Probe(
            model, points=p["points"], unit=p["unit"], second_moment=p["second_moment"], cross=cross
        )
    held_out = TokenLoss()
    B = spec.data["batch_size"]
    for stream, rows in (("train", windows.train), ("test", windows.test)):
        ids = torch.from_numpy(rows)
        batches = [ids[i : i + B].to(device) for i in range(0, ids.shape[0], B)]
        loss_fn = held_out.recording(causal_lm_loss) if stream == "test" else causal_lm_loss
        with Progress(len(batches), f"  probe {stream}", enabled=progress, unit="batches") as bar:
            for batch in batches:
                probe.step({"input_ids": batch, "labels": batch}, loss_fn, stream=stream, mask=p["mask"])
                bar.update()
    report = probe.report(meta=meta, misalignment_trials=0)
    budgets = []
    for M, K in spec.splits:
        per_point = {}
        for name in probe.points:
            mis = None
            if p["trials"]:
                mis = _or_none(probe.misalignment, name, M, K, trials=p["trials"], seed=p["seed"])
            per_point[name] = {
                "certificate": _or_none(probe.certificate, name, M=M, K=K),
                "misalignment": mis,
            }
        budgets.append({"M": M, "K": K, "points": per_point})
    extra = {"test_loss": held_out.mean(), "test_perplexity": held_out.perplexity()}
    if protocol is not None:
        from ..growth.advise import advise

        extra["advice"] = advice_entry(advise(probe, alpha=spec.growth["alpha"]), depths)
    return report.data, budgets, extra


class TokenLoss:
    """Mean loss per counted token over the batches a loss function saw: ``Σ_b ℓ_b n_b / Σ_b n_b``,
    with ``ℓ_b`` the per-sequence mean of :func:`~fused_stats.causal_lm_loss` and ``n_b`` its
    counted targets (:func:`~fused_stats.api.probe.losses.causal_targets`, the rule that loss
    averages over), so it is the sum of the token losses over their number."""

    def __init__(self):
        self.loss_sum = 0.0
        self.tokens = 0

    def recording(self, loss_fn):
        from ..probe.losses import causal_targets

        def record(model, batch):
            losses = loss_fn(model, batch)
            labels = batch.get("labels", batch.get("input_ids"))
            counts = causal_targets(labels, batch.get("attention_mask")).sum(-1)
            # fp64 sums: a float32 running total would drift over many windows
            self.loss_sum += float((losses.detach().double() * counts.double()).sum())
            self.tokens += int(counts.sum())
            return losses

        return record

    def mean(self) -> float | None:
        return self.loss_sum / self.tokens if self.tokens else None

    def perplexity(self) -> float | None:
        mean = self.mean()
        return None if mean is None else math.exp(mean)


def growth_protocol(spec: SuiteSpec, model):
    """The [growth] section's protocol for ``model`` (its candidates resolved and checked on it)
    and the map of relative depths to the points they name (None for names or "all")."""
    from .spec import growth_candidates, protocol_for

    candidates, depths = growth_candidates(spec.growth, model)
    protocol = protocol_for(spec.growth, candidates)
    protocol.check(model)
    return protocol, depths


def advice_entry(advice, depths: dict | None) -> dict:
    """A run's ``advice`` in suite.json: what :func:`fused_stats.advise` found (Holm over the run's
    candidates), one row per candidate in its ranked order."""
    top = advice.top
    return {
        "verdict": advice.verdict,
        "saturated_everywhere": advice.saturated_everywhere,
        "top": None if top is None else top.point,
        "alpha": advice.alpha,
        "correction": advice.correction,
        "digest": advice.digest,
        "protocol": advice.protocol,
        "depths": depths,
        "ranked": [
            {
                "point": c.point,
                "cross_frob2": c.cross_frob2,
                "se": c.se,
                "p_value": c.p_value,
                "p_adjusted": c.p_adjusted,
                "saturated": c.saturated,
            }
            for c in advice.ranked
        ],
    }


def _or_none(compute, *args, **kwargs):
    try:
        return compute(*args, **kwargs).to_dict()
    except FusedStatsError:  # too few samples for this (M, K), or no pool for the misalignment
        return None


def run_meta(spec: SuiteSpec, run: RunSpec, windows: Windows, device) -> dict:
    return {
        "suite_run": run.name,
        "labels": run.labels,
        # report --sweep width|depth reads these two keys
        "width": run.labels.get("width"),
        "depth": run.labels.get("depth"),
        "data": {s: windows.sha256(s) for s in ("train", "test")},
        "seq_len": spec.data["seq_len"],
        "sequences": spec.data["sequences"],
        "batch_size": spec.data["batch_size"],
        "mask": spec.probe["mask"],
        "device": str(device),
        "certificate_sizes": spec.splits,
    }


def check_points(spec: SuiteSpec, run: RunSpec, device, loader):
    """Load ``run`` (the first this process probes) and check the file's ``[probe] points``
    against it, before any other model loads or any file is written; returns the model so that
    the run does not load it twice (None when the points are "residual": nothing to check)."""
    from ..probe.points import resolve_points

    if spec.probe["points"] == "residual" and spec.growth is None:
        return None
    try:
        stream, _ = stream_decision(spec, run, device)
        model = loader(run.model, spec.probe["dtype"], device, stream)
    except Exception:  # a torn shard, OOM: the run itself fails and records why, the suite goes on
        return None
    section = "[growth] candidates" if spec.growth is not None else "[probe] points"
    try:
        if spec.growth is not None:
            growth_protocol(spec, model)
        else:
            resolve_points(model, spec.probe["points"])
    except FusedStatsError as exc:
        raise FusedStatsError(
            f"suite file {str(spec.path)!r}: {section}, checked on run {run.name} "
            f"({str(run.model)!r}) before any other model loads: {exc}"
        ) from None
    return model


def reuse_loaded(loader, path: Path, model):
    """``loader``, except that the first request for ``path`` returns the already loaded ``model``."""
    held = {"model": model}

    def load(folder, dtype, device, stream):
        if held["model"] is not None and Path(folder) == Path(path):
            model, held["model"] = held["model"], None
            return model
        return loader(folder, dtype, device, stream)

    return load


def execute_run(spec, run, windows, device, loader, progress, echo, key: dict) -> dict:
    """Load and probe one run; any exception is recorded in the entry (the suite goes on)."""
    import torch

    from ..probe.points import residual_points

    entry = {
        "name": run.name,
        "model": str(run.model),
        "labels": dict(run.labels),
        "key": key,
        "tokenizer": windows.tokenizer,
        "status": "failed",
        "error": None,
        "residual_points": None,
        "report": None,
        "budgets": None,
        "test_loss": None,
        "test_perplexity": None,
        "advice": None,
        "timing": {},
    }
    try:
        stream, why = stream_decision(spec, run, device)
        entry["timing"]["stream_blocks"] = stream
        t0 = time.perf_counter()
        model = loader(run.model, spec.probe["dtype"], device, stream)
        t1 = time.perf_counter()
        entry["timing"]["load_s"] = t1 - t0
        entry["labels"]["parameters"] = int(sum(p.numel() for p in model.parameters()))
        try:  # the relative depth of a point is its place among these (compare.relative_depths)
            entry["residual_points"] = residual_points(model)
        except FusedStatsError:
            entry["residual_points"] = None
        if hasattr(model, "eval"):
            model.eval()  # dropout off: the gradients are the deterministic function's
        report, budgets, extra = probe_windows(
            model, windows, spec, device, progress, run_meta(spec, run, windows, device)
        )
        entry["timing"]["probe_s"] = time.perf_counter() - t1
        entry.update(status="done", report=report, budgets=budgets, **extra)
        echo(
            f"{run.name}: loaded in {t1 - t0:.2f} s ({'streamed; ' if stream else ''}{why}), probed in {entry['timing']['probe_s']:.2f} s"
        )
    except Exception as exc:  # a corrupt shard, OOM, a bad config: recorded, the suite goes on
        entry["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        echo(f"{run.name}: FAILED: {entry['error']}")
    finally:
        model = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return entry


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
