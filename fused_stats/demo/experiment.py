"""The demo's experiment: width and depth sweeps of small byte-level LLaMA-style models.

Role: the two papers' trend experiments in miniature, on text every Python install has
(:mod:`.corpus`), with models trained in one pass over fresh text (:mod:`.models`) and probed
with :class:`fused_stats.Probe` at every block's residual output.

For each (width N, depth L, seed) run:

1. train a fresh model on ``train_steps`` batches of new training-split windows;
2. probe it with ``unit="sample"`` (one vector per sequence: ``q_b = Σ_t ∂ℓ_b/∂z_t``, the
   gradient of the sequence's mean next-byte loss with respect to a bias added to the stream)
   on two streams: ``train`` = windows of the *training files* that the optimiser never stepped
   on, ``test`` = windows of the *held-out files*;
3. read off, per point, the unbiased ``|μ|²``, ``d_par = |μ|⁴/μᵀΣμ``, ``d_2 = |μ|⁴/tr(Σ²)``,
   ``d_align = min(d_par, d_2)``, ``AG_max = max_b |q_b|``; the certificate
   ``B_align = 1/(1 + n_eff d_align)``, ``B_exact`` (Cantelli) and the empirical misalignment
   ``Pr(μ_Mᵀ g_K ≤ 0)`` over random (M, K) splits of the pooled train + test pool, at
   ``M = K = split`` (docs/design.md, section 2; width paper, Theorem 1); the train/test realized alignment;
   the held-out loss. The depth paper's cross-gradient saturation signal ``|C|_F²`` is added when
   the installed Probe supports ``cross=`` (:func:`_saturation`).

The depth sweep also lists, per run, ``|C|_F²`` with its standard error and the saturation test's
decision (:func:`saturation_lines`); and one trained model of the depth sweep (its deepest, first
seed) gets the direct interventions of :func:`fused_stats.intervene`, a zero bias and a zero
block at its last residual point, run on an fp64 copy so that the small changes of small steps are
resolved: measured (a central difference) vs first-order predicted test-loss change per η, for an
SGD and a zero-state Adam step (:func:`intervention_lines`).

Each run's report is written to ``runs/`` when the run is done, with the configuration's key; a
rerun of the same configuration into the same folder reads those back and computes only the
missing runs (:mod:`.toy_resume`).

The width sweep runs every width at ``width_sweep_depth``; the depth sweep every depth at
``depth_sweep_width`` (a shared (N, L) run is trained once). Tables show the median and range over
seeds, and Spearman's ρ of the key quantity against width / depth over all runs, with a
permutation p-value (:func:`fused_stats.api.report.document.sweep_summary`): the text says what these runs
show, including "no clear trend", and never asserts the papers' results.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import time
from dataclasses import dataclass, field

import torch

from ..errors import FusedStatsError


@dataclass
class DemoConfig:
    """What the demo runs; :meth:`quick` is the small version used by tests."""

    widths: tuple = (32, 64, 128)
    depths: tuple = (1, 2, 4, 8)
    seeds: tuple = (0, 1, 2)
    width_sweep_depth: int = 4
    depth_sweep_width: int = 64
    seq_len: int = 64
    batch_size: int = 16
    train_steps: int = 128
    probe_batches: int = 16
    base_lr: float = 3e-3
    split: int = 32
    trials: int = 2000
    cross_rank: int = 16
    point: str = "last"
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls, **overrides) -> DemoConfig:
        base = dict(
            widths=(32, 64),
            depths=(1, 2),
            seeds=(0, 1),
            width_sweep_depth=2,
            depth_sweep_width=32,
            train_steps=24,
            probe_batches=4,
            split=16,
            trials=500,
        )
        base.update(overrides)
        return cls(**base)

    def runs(self) -> list[tuple[int, int, int]]:
        """Distinct (width, depth, seed) runs of both sweeps, cheapest models first."""
        shapes = {(w, self.width_sweep_depth) for w in self.widths}
        shapes |= {(self.depth_sweep_width, d) for d in self.depths}
        ordered = sorted(shapes, key=lambda wd: (wd[0] * wd[0] * wd[1], wd))
        return [(w, d, s) for s in self.seeds for (w, d) in ordered]

    def validate(self) -> None:
        for name in ("widths", "depths", "seeds"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 0 for v in values):
                raise FusedStatsError(f"--{name} needs non-negative integers, got {values!r}")
        for w in (*self.widths, self.depth_sweep_width):
            if w < 16 or w % 16:
                raise FusedStatsError(f"widths must be multiples of 16 (head size), got {w}")
        if min(self.depths) < 1 or self.width_sweep_depth < 1:
            raise FusedStatsError(f"depths must be >= 1, got {self.depths}")
        n = self.probe_batches * self.batch_size
        if self.split < 1 or self.split > n:
            raise FusedStatsError(
                f"split M = K = {self.split} needs 2*{self.split} <= the pooled probe samples "
                f"({2 * n}); raise probe batches or lower split"
            )
        if n < 4:
            raise FusedStatsError(f"the probe needs >= 4 samples per stream, got {n}")


def _saturation(probe, name: str):
    """The depth probe's saturation signal at ``name`` as a dict, or None without ``cross=`` or
    with too few samples for it."""
    if probe.cross is None:
        return None
    try:
        return probe.saturation(name).to_dict()
    except FusedStatsError:
        return None


def _make_probe(model, cfg: DemoConfig):
    """A pool-mode Probe at the residual points, with the cross-gradient block when available."""
    import fused_stats as fs

    spec_cls = getattr(fs, "CrossSpec", None)
    if spec_cls is not None:
        try:
            return fs.Probe(
                model,
                points="residual",
                unit="sample",
                second_moment="pool",
                cross=spec_cls(rank=cfg.cross_rank, seed=0),
            )
        except (FusedStatsError, TypeError):
            pass  # this Probe does not take cross= yet: AG_max only
    return fs.Probe(model, points="residual", unit="sample", second_moment="pool")


def train_model(corpus, cfg: DemoConfig, width: int, depth: int, seed: int, bar=None):
    """A fresh (width, depth, seed) model trained once over new training text; returns
    ``(model, info)`` with the training summary of :func:`fused_stats.demo.models.train`."""
    from .models import build_llama, lr_for, train

    model = build_llama(width, depth, cfg.seq_len, seed)
    info = train(
        model,
        corpus.batches("train", seed, cfg.batch_size, cfg.train_steps),
        cfg.train_steps,
        lr_for(width, cfg.base_lr),
        progress=bar,
    )
    return model, info


def certificates_at(probe, data: dict, M: int, K: int, trials: int, seed: int = 0) -> dict:
    """Replace every point's certificate and misalignment in a report dict by their values at
    split sizes (M, K) (moments from the pooled train + test samples, as :class:`Probe` does)."""
    for point in data["points"]:
        name = point["name"]
        try:
            point["certificate"] = probe.certificate(name, M=M, K=K).to_dict()
        except FusedStatsError:
            point["certificate"] = None
        try:
            point["misalignment"] = probe.misalignment(name, M, K, trials=trials, seed=seed).to_dict()
        except FusedStatsError:
            point["misalignment"] = None
    return data


def probe_model(model, corpus, cfg: DemoConfig, meta: dict):
    """Probe a trained model on the fixed train/test probe sets; returns ``(Report, probe)``."""
    import fused_stats as fs

    from ..api.report.document import Report
    from .models import eval_loss

    B = cfg.batch_size
    # probe streams: the reserved windows of the training files (never in any training order)
    # and of the held-out files; the same text for every run
    train_batches = corpus.probe_batches("train", B, cfg.probe_batches)
    test_batches = corpus.probe_batches("test", B, cfg.probe_batches)
    t0 = time.perf_counter()
    probe = _make_probe(model, cfg)
    norms: dict[str, list] = {}

    def stream_norm(cap):
        # mean Euclidean norm of the stream's tokens z_t (train stream): the scale that a
        # following RMSNorm divides gradients by (∂ℓ/∂z ∝ √d/|z|)
        if cap.stream == "train":
            tok = cap.activation.movedim(cap.feature_dim, -1).norm(dim=-1)
            if cap.mask is not None:
                tok = tok[cap.mask.expand_as(tok)] if cap.mask.dim() == tok.dim() else tok[cap.mask]
            acc = norms.setdefault(cap.point, [0.0, 0])
            acc[0] += float(tok.double().sum())
            acc[1] += tok.numel()

    probe.add_callback(stream_norm)
    for stream, batches in (("train", train_batches), ("test", test_batches)):
        for ids in batches:
            probe.step({"input_ids": ids}, fs.causal_lm_loss, stream=stream)
    meta = dict(
        meta,
        probe_seconds=time.perf_counter() - t0,
        stream_norm={k: v[0] / v[1] for k, v in norms.items() if v[1]},
        test_loss=eval_loss(model, test_batches),
        probe_samples_per_stream=B * cfg.probe_batches,
        seq_len=cfg.seq_len,
        corpus="python stdlib .py bytes, split by file",
        certificate_sizes=[cfg.split, cfg.split],
    )
    data = probe.report(meta=meta, misalignment_trials=0).data
    certificates_at(probe, data, cfg.split, cfg.split, cfg.trials, seed=meta.get("seed", 0))
    for point in data["points"]:
        if point["saturation"] is None:
            point["saturation"] = _saturation(probe, point["name"])
    return Report(data), probe


def run_one(corpus, cfg: DemoConfig, width: int, depth: int, seed: int, bar=None, keep_model: bool = False):
    """Train, probe and report one model; returns a :class:`fused_stats.Report` (and the trained
    model when ``keep_model``)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    model, info = train_model(corpus, cfg, width, depth, seed, bar)
    meta = {
        "width": width,
        "depth": depth,
        "seed": seed,
        "tokens": info["tokens"],
        "lr": info["lr"],
        "train_loss": info["final_loss"],
        "first_loss": info["first_loss"],
        "train_seconds": info["train_seconds"],
    }
    report, _ = probe_model(model, corpus, cfg, meta)
    report.meta["cpu_seconds"] = time.process_time() - cpu0
    report.meta["wall_seconds"] = time.perf_counter() - wall0
    return (report, model) if keep_model else report


def saturation_lines(reports, point: str | int = "last") -> list[str]:
    """One line per run (by depth, then seed): ``|C|_F²`` ± its standard error at ``point``, the
    saturation test's z and decision, AG_max and the held-out loss."""
    from ..api.report.schema import fmt_se
    from ..api.report.sweeps import pick_point

    lines = []
    for r in sorted(reports, key=lambda r: (r.meta["depth"], r.meta["seed"])):
        p = pick_point(r, point)
        sat = p.get("saturation")
        head = f"depth {r.meta['depth']:<2} seed {r.meta['seed']}  {p['name']:<16}"
        ag = (p.get("train") or {}).get("ag_max")
        tail = f"AG_max {ag:.3g}  test loss {r.meta['test_loss']:.3f}" if ag is not None else ""
        if not sat:
            lines.append(f"{head}  |C|_F^2 not available  {tail}")
            continue
        verdict = "saturated (C = 0 not rejected)" if sat["saturated"] else "not saturated"
        lines.append(
            f"{head}  |C|_F^2 = {sat['cross_frob2']:.3g} ± {fmt_se(sat['cross_frob2_se'], '.2g')} "
            f"(z = {sat['z']:.2f}, p = {sat['p_value']:.3g}: {verdict} at "
            f"alpha = {sat['alpha']:g}, unadjusted)  {tail}"
        )
    return lines


INTERVENTION_ETAS = (1.0, 0.1, 0.03)


def intervention_lines(model, corpus, cfg: DemoConfig, etas=INTERVENTION_ETAS) -> tuple[list, list]:
    """Both direct interventions (zero bias, zero block of rank ``cfg.cross_rank``) at the last
    residual point of an fp64 copy of ``model``, with the probe's train/test windows; returns
    ``(text lines, [Intervention.to_dict(), ...])``. ``model`` itself is not touched."""
    import copy

    import fused_stats as fs

    model64 = copy.deepcopy(model).double()
    point = fs.residual_points(model64)[-1]
    B = cfg.batch_size
    train = corpus.probe_batches("train", B, cfg.probe_batches)
    test = corpus.probe_batches("test", B, cfg.probe_batches)
    dicts = []
    for kind in ("bias", "block"):
        result = fs.intervene(
            model64,
            point,
            train,
            test,
            list(etas),
            kind=kind,
            loss_fn=fs.causal_lm_loss,
            spec=fs.CrossSpec(rank=cfg.cross_rank, seed=0),
        )
        dicts.append(result.to_dict())
    return intervention_markdown(dicts), dicts


def intervention_markdown(dicts: list[dict]) -> list[str]:
    """The text lines of :func:`intervention_lines` from its dicts (as a run's report keeps them)."""
    from ..api.growth.intervene import Intervention

    lines = []
    for d in dicts:
        lines += ["", Intervention.from_dict(d).to_markdown()]
    return lines


def _header(cfg: DemoConfig, corpus) -> list[str]:
    import transformers

    from .. import __version__

    tokens = cfg.train_steps * cfg.batch_size * cfg.seq_len
    n_probe = cfg.probe_batches * cfg.batch_size
    return [
        f"fused-stats demo ({__version__}) — {_dt.datetime.now().isoformat(timespec='seconds')}, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, {torch.get_num_threads()} threads",
        f"corpus: this Python's standard library source as bytes (vocab 256) — {corpus.describe()}",
        f"models: LLaMA-style decoders (RMSNorm, RoPE, SwiGLU, head size 16), trained once over "
        f"{tokens:,} fresh training bytes each ({cfg.train_steps} AdamW steps of "
        f"{cfg.batch_size} x {cfg.seq_len}), lr = {cfg.base_lr:g} * 32 / width",
        f"probe: per-sequence activation gradients at every block's residual output; train "
        f"stream = {n_probe} windows of training files, test stream = {n_probe} windows of "
        f"held-out files (the same for every run, never trained on); certificate and "
        f"misalignment at M = K = {cfg.split}",
        f"runs: widths {list(cfg.widths)} at depth {cfg.width_sweep_depth}; depths "
        f"{list(cfg.depths)} at width {cfg.depth_sweep_width}; seeds {list(cfg.seeds)}",
    ]


def run_demo(cfg: DemoConfig, out, echo=print, progress: bool | None = None, force: bool = False) -> dict:
    """Run both sweeps, print tables, write reports/plots under ``out``; returns a summary dict.

    ``progress``: False = no progress output; True or None = the rule of
    :mod:`fused_stats.progress` (a bar on a terminal, a plain line every 30 s otherwise).
    A rerun into the same ``out`` with the same configuration reads the runs finished before back
    and computes only the missing ones; ``force`` starts afresh (:mod:`.toy_resume`).
    """
    from ..api.report.document import Report, plot_sweep, sweep_summary
    from ..progress import Progress
    from .corpus import StdlibCorpus
    from .toy_resume import KEY_FIELD, check_out, finished_run, open_out, run_path

    cfg.validate()
    check_out(cfg, out, force)  # refused before anything is read or written
    wall0, cpu0 = time.perf_counter(), time.process_time()
    need = cfg.train_steps * cfg.batch_size
    corpus = StdlibCorpus(cfg.seq_len, probe_windows=cfg.probe_batches * cfg.batch_size)
    have = len(corpus.order("train", 0))
    if need > have:
        raise FusedStatsError(f"the demo needs {need} training windows, the corpus has {have}")
    out, key, resume = open_out(cfg, out, force)
    lines = _header(cfg, corpus)
    for line in lines:
        echo(line)
    runs = cfg.runs()
    reports: list[Report] = []
    # the model that gets the interventions: the deepest of the depth sweep, first seed; they
    # are computed as soon as it is trained and kept in its report, so a resumed demo has them
    keep = (cfg.depth_sweep_width, max(cfg.depths), cfg.seeds[0])
    reused = 0
    bar = Progress(len(runs) * cfg.train_steps, "demo", enabled=progress is not False, unit="training steps")
    try:
        for width, depth, seed in runs:
            bar.set_description(f"width {width} depth {depth} seed {seed}")
            report = finished_run(out, key, width, depth, seed) if resume else None
            read_back = report is not None
            if read_back:
                reused += 1
                bar.update(cfg.train_steps)
            else:
                report, model = run_one(corpus, cfg, width, depth, seed, bar, keep_model=True)
                report.meta[KEY_FIELD] = key
                if (width, depth, seed) == keep:
                    report.meta["interventions"] = intervention_lines(model, corpus, cfg)[1]
                del model
                report.to_json(run_path(out, width, depth, seed))
            m = report.meta
            msg = (
                f"run width={width:<4} depth={depth:<2} seed={seed}: loss {m['first_loss']:.2f} "
                f"-> {m['train_loss']:.3f} (held-out {m['test_loss']:.3f}), "
                f"train {m['train_seconds']:.1f} s, probe {m['probe_seconds']:.1f} s"
                + (
                    f" (finished earlier: read back from {run_path(out, width, depth, seed).name})"
                    if read_back
                    else ""
                )
            )
            bar.write(msg, echo)  # keeps a terminal bar intact
            lines.append(msg)
            reports.append(report)
    finally:
        bar.set_description("demo")
        bar.close()

    width_runs = [
        r for r in reports if r.meta["depth"] == cfg.width_sweep_depth and r.meta["width"] in cfg.widths
    ]
    depth_runs = [
        r for r in reports if r.meta["width"] == cfg.depth_sweep_width and r.meta["depth"] in cfg.depths
    ]
    sections = []
    title = (
        f"Width sweep (depth {cfg.width_sweep_depth}): effective alignment dimension and "
        f"transfer at the last residual point"
    )
    sections += [
        "",
        f"== {title} ==",
        sweep_summary(width_runs, "width", cfg.point),
        "(cos(train,test) = realized alignment / sqrt(|mu_train|^2 |mu_test|^2), a ratio "
        "of unbiased estimates: noisy when the mean is weak, and it can exceed 1)",
    ]
    title = (
        f"Depth sweep (width {cfg.depth_sweep_width}): activation-gradient norm at the last residual point"
    )
    sections += ["", f"== {title} ==", sweep_summary(depth_runs, "depth", cfg.point)]
    sections.append(
        "(|z| = mean token norm of the residual stream at that point; the final RMSNorm divides "
        "gradients there by |z|/sqrt(d), so AG_max*|z|/sqrt(d) removes that scale: compare both "
        "before reading a fall of AG_max with depth as saturation)"
    )
    if not any(p["saturation"] for r in depth_runs for p in r.points):
        sections.append(
            "(the cross-gradient saturation signal |C|_F^2 is not available in this "
            "version of the Probe; AG_max is the depth paper's practical indicator)"
        )
    else:
        sections += [
            "",
            f"Saturation test per run (zero-output block of rank {cfg.cross_rank}, "
            "gelu features; |C|_F^2 is unbiased, ± one standard error; a value within "
            "noise of 0 means no first-order gain from a block inserted there):",
        ]
        sections += saturation_lines(depth_runs, cfg.point)
    kept = next(r for r in reports if (r.meta["width"], r.meta["depth"], r.meta["seed"]) == keep)
    dicts = kept.meta.get("interventions")
    if dicts:
        title = (
            f"Direct interventions on the width {keep[0]}, depth {keep[1]}, seed {keep[2]} "
            "model (fp64 copy): one step of size eta on an inserted zero parameter (SGD, then "
            "zero-state Adam), from the probe's train windows; first-order change of the mean "
            "held-out loss, measured as a central difference"
        )
        sections += ["", f"== {title} ==", *intervention_markdown(dicts)]
        sections.append(
            "(predicted = -eta mu_M.g_K for the bias, -eta <C_M, C_K>_F for the block, -eta <s, g_K> "
            "for Adam; measured = (L(step) - L(-step))/2, the step against its mirror step: the "
            "curvature term cancels, so the ratio is 1 + O(eta^2) and tends to 1 as eta shrinks; "
            "Adam's sign-like step moves every coordinate by eta, so it needs a smaller eta than SGD. "
            "one-sided step = L(step) - L(zero parameter), curvature included: for Adam it can have "
            "the wrong sign)"
        )
        from ..accumulators.persistence import write_text_atomic

        write_text_atomic(out / "interventions.json", json.dumps(dicts, indent=1) + "\n")
    files = [out / "interventions.json"] if dicts else []
    try:
        files.append(plot_sweep(width_runs, "width", out / "width_sweep.png", cfg.point))
        files.append(plot_sweep(depth_runs, "depth", out / "depth_sweep.png", cfg.point))
        deepest = max(depth_runs, key=lambda r: (r.meta["depth"], -r.meta["seed"]))
        files.append(
            deepest.plot(
                out / f"points_w{deepest.meta['width']}-d{deepest.meta['depth']}-s{deepest.meta['seed']}.png"
            )
        )
    except FusedStatsError as exc:  # matplotlib missing: tables and JSON still written
        sections.append(f"(plots skipped: {exc})")
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    sections += [
        "",
        "What was measured: per-sequence activation gradients of small models trained briefly "
        "on Python source, probed on fixed text. Small models and short training give small, "
        "noisy statistics with a large seed-to-seed scatter: the trend lines above are rank "
        "correlations over all runs, a description of these runs, not a test of the papers' "
        "claims.",
        f"wrote {len(reports)} JSON reports to {out / 'runs'}, "
        + ", ".join(str(f) for f in files)
        + f", {out / 'summary.md'}",
        f"total: {wall:.0f} s wall, {cpu:.0f} s CPU (process time) for {len(runs)} runs"
        + (f" ({reused} finished earlier, read back from {out / 'runs'})" if reused else ""),
    ]
    for line in sections:
        echo(line)
    text = "\n".join(lines + sections) + "\n"
    from ..accumulators.persistence import write_text_atomic

    write_text_atomic(out / "summary.md", "# fused-stats demo\n\n```\n" + text + "```\n")
    return {
        "reports": reports,
        "width_runs": width_runs,
        "depth_runs": depth_runs,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "files": files,
        "text": text,
    }
