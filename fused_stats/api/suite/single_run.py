"""One run of a suite: load its model, probe the suite's windows, and make its run entry.

:func:`execute_run` loads a run's model (streamed block by block when :func:`stream_decision`
says the whole model would not fit: weights + every block's activations + gradients in flight +
reduced rows + accumulators > 90% of the free memory), probes the train and test windows
(:func:`probe_windows`), and returns the entry ``runs/<name>.json`` records: the report, per
(M, K) each point's certificate and misalignment, the held-out loss per counted token
``Σ_b ℓ_b n_b / Σ_b n_b`` (:class:`TokenLoss`) and, with ``[growth]``, the advice. Any exception is
recorded in the entry, so the suite goes on. Which runs are probed, and resuming, are
:mod:`fused_stats.api.suite.runner`'s.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ...errors import FusedStatsError
from .data import Windows
from .spec import RunSpec, SuiteSpec


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
    plan, depths = None, None
    if spec.growth is not None:
        plan, depths = growth_plan(spec, model)
        probe = Probe(model, unit=p["unit"], second_moment=p["second_moment"], cross=plan)
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
    if plan is not None:
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


def growth_plan(spec: SuiteSpec, model):
    """The [growth] section's :class:`~fused_stats.api.growth.plan.GrowthPlan` for ``model`` (its
    candidates resolved and checked on it; the model described once) and the map of relative
    depths to the points they name (None for names or "all")."""
    from ..growth.architecture import describe
    from ..growth.plan import GrowthPlan
    from .spec import growth_candidates, protocol_for

    arch = describe(model)
    candidates, depths = growth_candidates(spec.growth, model, arch)
    return GrowthPlan.from_architecture(model, protocol_for(spec.growth, candidates), arch), depths


def growth_protocol(spec: SuiteSpec, model):
    """``(protocol, depths)`` of :func:`growth_plan`."""
    plan, depths = growth_plan(spec, model)
    return plan.protocol, depths


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
            growth_plan(spec, model)
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
