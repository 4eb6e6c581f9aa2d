"""``fused-stats demo --width-study``: a powered, pre-registered test that d_align grows with width.

Role: the demo's width sweep (:mod:`.experiment`) with enough widths, seeds and tokens to resolve
the width paper's trend in miniature; its design is fixed in docs/width_study.md before any
confirmatory run. Each (width N, seed) model is trained and probed by
:func:`fused_stats.demo.experiment.run_one` (lr = base_lr · 32 / N, :func:`.models.lr_for`), and
two residual points are read: the middle one (index ``(L - 1) // 2``) and the last.

The statistic, per point and quantity y (d_align, the misalignment probability, B_exact):
the OLS fit ``ln y = a + b ln N`` over all runs with y > 0 (a run with y ≤ 0 or none is left out
and counted), ``b = S_xy / S_xx``, ``se(b) = sqrt(SSR / (n - 2) / S_xx)``, ``t = b / se(b)`` on
``n - 2`` degrees of freedom; ``p_greater = Pr(T ≥ t)`` tests b > 0 (the textbook simple
regression, e.g. Wasserman, "All of Statistics", 13.1). The robustness fit regresses the seed
average of ln y at each width on ln N (n = the widths). Training is checked against the unigram
plateau: every run's final training loss must be below the unigram entropy of the training
bytes, ``-Σ_v p_v ln p_v``.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..errors import FusedStatsError

# the pre-registered design (docs/width_study.md): confirmatory seeds never used while developing
DEFAULT_WIDTHS = (32, 64, 128, 256)
DEFAULT_SEEDS = (200, 201, 202, 203)
# seeds used while developing (pilots, --quick); never confirmatory
EXPLORATORY_SEEDS = tuple(range(900, 910))
ALPHA = 0.05
QUANTITIES = ("d_align", "misalignment", "b_exact")


@dataclass
class WidthStudyConfig:
    """What the width study runs; :meth:`quick` is the smoke run of the tests."""

    widths: tuple = DEFAULT_WIDTHS
    seeds: tuple = DEFAULT_SEEDS
    depth: int = 4
    seq_len: int = 64
    batch_size: int = 16
    train_steps: int = 192
    probe_batches: int = 16
    base_lr: float = 3e-3
    split: int = 32
    trials: int = 2000

    @classmethod
    def quick(cls, **overrides) -> WidthStudyConfig:
        base = dict(
            widths=(32, 64),
            seeds=EXPLORATORY_SEEDS[:2],
            depth=2,
            train_steps=16,
            probe_batches=4,
            split=16,
            trials=300,
        )
        base.update(overrides)
        return cls(**base)

    def demo_config(self):
        """The :class:`~fused_stats.demo.experiment.DemoConfig` every run is trained and probed with."""
        from .experiment import DemoConfig

        return DemoConfig(
            widths=tuple(self.widths),
            depths=(self.depth,),
            seeds=tuple(self.seeds),
            width_sweep_depth=self.depth,
            depth_sweep_width=self.widths[0],
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            train_steps=self.train_steps,
            probe_batches=self.probe_batches,
            base_lr=self.base_lr,
            split=self.split,
            trials=self.trials,
        )

    def validate(self) -> None:
        if len(set(self.widths)) < 2:
            raise FusedStatsError(f"the width study needs >= 2 distinct widths, got {list(self.widths)}")
        if len(set(self.seeds)) != len(self.seeds):
            raise FusedStatsError(f"--seeds lists a seed twice: {list(self.seeds)}")
        if len(set(self.widths)) != len(self.widths):
            raise FusedStatsError(f"--widths lists a width twice: {list(self.widths)}")
        self.demo_config().validate()

    def middle_index(self) -> int:
        return (self.depth - 1) // 2


# ---------------------------------------------------------------------------- statistics
def ols_loglog(xs, ys) -> dict:
    """OLS fit of ``ln y = a + b ln x`` over the pairs with x > 0 and y > 0 (module docstring).

    Returns ``exponent`` (b), ``intercept`` (a), ``se`` (of b; None when n < 3), ``n``, ``df``,
    ``t``, ``p_greater`` (one-sided, H1: b > 0), ``p_less`` (H1: b < 0) and ``excluded`` (the
    pairs left out: y missing, non-finite or ≤ 0). Fewer than 2 distinct x give None numbers.
    """
    from scipy import stats

    pairs, excluded = [], 0
    for x, y in zip(xs, ys):
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y <= 0:
            excluded += 1
            continue
        pairs.append((math.log(x), math.log(y)))
    n = len(pairs)
    out = dict(exponent=None, intercept=None, se=None, n=n, df=n - 2, t=None, p_greater=None, p_less=None)
    out["excluded"] = excluded
    if n < 2 or len({p[0] for p in pairs}) < 2:
        return out
    lx = np.array([p[0] for p in pairs])
    ly = np.array([p[1] for p in pairs])
    dx = lx - lx.mean()
    sxx = float(dx @ dx)
    b = float(dx @ (ly - ly.mean())) / sxx
    a = float(ly.mean() - b * lx.mean())
    out.update(exponent=b, intercept=a)
    if n < 3:
        return out
    resid = ly - (a + b * lx)
    se = math.sqrt(float(resid @ resid) / (n - 2) / sxx)
    out["se"] = se
    if se > 0:
        t = b / se
        out.update(t=t, p_greater=float(stats.t.sf(t, n - 2)), p_less=float(stats.t.cdf(t, n - 2)))
    return out


def seed_average_fit(rows: list[dict], key: str) -> dict:
    """:func:`ols_loglog` of the per-width mean over seeds of ``ln rows[key]`` (the mean of the
    logs, i.e. the geometric mean of the values; runs with y ≤ 0 left out) against the width."""
    logs: dict[int, list] = {}
    for r in rows:
        y = r.get(key)
        if y is not None and math.isfinite(y) and y > 0:
            logs.setdefault(r["width"], []).append(math.log(y))
    widths = sorted(logs)
    return ols_loglog(widths, [math.exp(sum(logs[w]) / len(logs[w])) for w in widths])


def unigram_entropy(corpus) -> float:
    """Entropy (nats) of the byte frequencies of every training-split file: the loss of the best
    model that ignores context, the plateau a language model must pass."""
    counts = np.zeros(256, dtype=np.float64)
    for path in corpus.splits["train"].files:
        counts += np.bincount(np.frombuffer(path.read_bytes(), dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def verdict(primary: dict, robust: dict, plateau_ok: bool) -> str:
    """The pre-registered decision rule (docs/width_study.md) in words."""
    p, q = primary.get("p_greater"), robust.get("p_greater")
    if p is None:
        text = "no test: fewer than 3 runs with d_align > 0 at the last point"
    elif p < ALPHA and q is not None and q < ALPHA:
        text = f"b > 0 shown: one-sided p = {p:.3g} (all runs) and {q:.3g} (seed averages), both < {ALPHA}"
    elif p < ALPHA:
        qs = "untestable" if q is None else f"p = {q:.3g}"
        text = f"b > 0 in the all-runs fit (p = {p:.3g}) but not robust: the seed-average fit has {qs}"
    else:
        text = f"b > 0 not shown: one-sided p = {p:.3g} >= {ALPHA}"
    if not plateau_ok:
        text += "; NOT every model passed the unigram plateau, so the study is not valid as designed"
    return text


# ---------------------------------------------------------------------------- running
def run_rows(report, cfg: WidthStudyConfig) -> list[dict]:
    """The runs-table rows of one trained model's report: its middle and its last point."""
    from ..api.report.sweeps import cosine

    m = report.meta
    points = report.points
    picked = [("middle", points[min(cfg.middle_index(), len(points) - 1)]), ("last", points[-1])]
    rows = []
    for label, p in picked:
        tr, cert, mis = p["train"] or {}, p["certificate"] or {}, p["misalignment"] or {}
        rows.append(
            {
                "width": m["width"],
                "seed": m["seed"],
                "point": label,
                "point_name": p["name"],
                "d_align": tr.get("d_align"),
                "d_par": tr.get("d_par"),
                "d_2": tr.get("d_2"),
                "misalignment": mis.get("probability"),
                "b_exact": cert.get("b_exact"),
                "b_align": cert.get("b_align"),
                "cosine": cosine(p),
                "train_loss": m["train_loss"],
                "first_loss": m["first_loss"],
                "test_loss": m["test_loss"],
                "lr": m["lr"],
                "tokens": m["tokens"],
                "train_seconds": m["train_seconds"],
                "probe_seconds": m["probe_seconds"],
            }
        )
    return rows


def fits_of(rows: list[dict]) -> dict:
    """Per point and quantity: the all-runs fit and the seed-average fit; plus the per-seed slopes
    of d_align (one fit per seed over the widths)."""
    out = {}
    for label in ("middle", "last"):
        at = [r for r in rows if r["point"] == label]
        out[label] = {
            key: {
                "all_runs": ols_loglog([r["width"] for r in at], [r[key] for r in at]),
                "seed_average": seed_average_fit(at, key),
            }
            for key in QUANTITIES
        }
        per_seed = {}
        for seed in sorted({r["seed"] for r in at}):
            mine = [r for r in at if r["seed"] == seed]
            per_seed[str(seed)] = ols_loglog([r["width"] for r in mine], [r["d_align"] for r in mine])[
                "exponent"
            ]
        out[label]["d_align_per_seed_exponent"] = per_seed
    return out


def _fmt_fit(name: str, fit: dict, direction: str) -> str:
    if fit["exponent"] is None:
        return f"{name}: no fit ({fit['n']} runs with a positive value)"
    se = "n/a" if fit["se"] is None else f"{fit['se']:.3f}"
    p = fit["p_greater"] if direction == ">" else fit["p_less"]
    ps = "" if p is None else f", one-sided p(b {direction} 0) = {p:.3g}"
    left = f", {fit['excluded']} runs left out (value <= 0 or none)" if fit["excluded"] else ""
    return f"{name}: b = {fit['exponent']:+.3f} ± {se} (n = {fit['n']}{ps}){left}"


def summary_lines(result: dict) -> list[str]:
    """The printed tables: per width and point, the medians over seeds; the fits; the verdict."""
    rows, lines = result["runs"], []
    for label in ("middle", "last"):
        at = [r for r in rows if r["point"] == label]
        names = sorted({r["point_name"] for r in at})
        lines += ["", f"== {label} residual point ({', '.join(names)}) =="]
        lines.append(
            f"{'width':>6} {'runs':>4} {'d_align (geo mean)':>19} {'misalign':>9} {'B_exact':>8} {'loss':>6}"
        )
        for w in sorted({r["width"] for r in at}):
            mine = [r for r in at if r["width"] == w]
            pos = [r["d_align"] for r in mine if r["d_align"] is not None and r["d_align"] > 0]
            geo = math.exp(sum(map(math.log, pos)) / len(pos)) if pos else float("nan")
            mis = np.nanmean([np.nan if r["misalignment"] is None else r["misalignment"] for r in mine])
            bex = np.nanmean([np.nan if r["b_exact"] is None else r["b_exact"] for r in mine])
            loss = np.mean([r["train_loss"] for r in mine])
            lines.append(f"{w:>6} {len(mine):>4} {geo:>19.4g} {mis:>9.4f} {bex:>8.4f} {loss:>6.3f}")
        fits = result["fits"][label]
        lines.append(_fmt_fit("ln d_align on ln width, all runs", fits["d_align"]["all_runs"], ">"))
        lines.append(_fmt_fit("  the same, seed averages", fits["d_align"]["seed_average"], ">"))
        slopes = fits["d_align_per_seed_exponent"]
        lines.append(
            "  per-seed exponents: "
            + " ".join(f"{s}: {'n/a' if b is None else f'{b:+.2f}'}" for s, b in slopes.items())
        )
        lines.append(_fmt_fit("ln misalignment on ln width", fits["misalignment"]["all_runs"], "<"))
        lines.append(_fmt_fit("ln B_exact on ln width", fits["b_exact"]["all_runs"], "<"))
    plateau = result["plateau"]
    lines += [
        "",
        f"unigram plateau: entropy of the training bytes {plateau['unigram_entropy']:.3f} nats; final "
        f"training loss {plateau['min_train_loss']:.3f} .. {plateau['max_train_loss']:.3f} "
        f"({plateau['below']} of {plateau['models']} models below it)",
        f"decision (last point, pre-registered in docs/width_study.md): {result['verdict']}",
    ]
    return lines


def plot_width_study(result: dict, path) -> Path:
    """PNG: d_align vs width on log-log axes, one panel per point: every run (one colour per
    seed), the geometric mean over seeds per width, and the all-runs fitted line with its
    exponent ± se in the legend."""
    from ..api.report.plots import figure_classes, save_figure

    Figure, FigureCanvasAgg = figure_classes()
    fig = Figure(figsize=(10.5, 5.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, squeeze=False)[0]
    rows = result["runs"]
    for ax, label in zip(axes, ("middle", "last")):
        at = [r for r in rows if r["point"] == label and r["d_align"] is not None and r["d_align"] > 0]
        widths = sorted({r["width"] for r in rows})
        for i, seed in enumerate(sorted({r["seed"] for r in rows})):
            mine = [r for r in at if r["seed"] == seed]
            ax.scatter(
                [r["width"] for r in mine],
                [r["d_align"] for r in mine],
                s=20,
                alpha=0.7,
                color=f"C{i % 10}",
                label=f"seed {seed}" if len(mine) else None,
            )
        means = [
            (w, math.exp(np.mean([math.log(r["d_align"]) for r in at if r["width"] == w])))
            for w in widths
            if any(r["width"] == w for r in at)
        ]
        ax.plot(*zip(*means), "D", color="black", ms=6, label="geometric mean over seeds")
        fit = result["fits"][label]["d_align"]["all_runs"]
        if fit["exponent"] is not None:
            grid = np.geomspace(min(widths), max(widths), 50)
            se = "n/a" if fit["se"] is None else f"{fit['se']:.2f}"
            ax.plot(
                grid,
                np.exp(fit["intercept"]) * grid ** fit["exponent"],
                color="tab:red",
                label=f"OLS fit: d_align ∝ N^({fit['exponent']:.2f} ± {se}), n = {fit['n']}",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(widths)
        ax.set_xticklabels([str(w) for w in widths])
        ax.set_xlabel("width N")
        ax.set_ylabel("d_align (train stream)")
        names = sorted({r["point_name"] for r in rows if r["point"] == label})
        ax.set_title(f"{label} residual point ({', '.join(names)})", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        # below the axes: inside, it covered the low runs
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    cfg = result["config"]
    fig.suptitle(
        f"width study: depth {cfg['depth']}, {cfg['train_steps'] * cfg['batch_size'] * cfg['seq_len']:,} "
        f"training bytes per model, lr = {cfg['base_lr']:g} * 32 / N, seeds {list(cfg['seeds'])}",
        fontsize=9,
    )
    return save_figure(fig, path)


def run_width_study(cfg: WidthStudyConfig, out, echo=print, progress: bool | None = None) -> dict:
    """Train and probe every (width, seed) model, fit, print, and write ``width_study.json``,
    ``width_study.png`` and ``width_study.md`` under ``out``; returns the JSON's dict."""
    import torch

    from ..accumulators.persistence import write_text_atomic
    from ..progress import Progress
    from .corpus import StdlibCorpus
    from .experiment import run_one

    cfg.validate()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    demo = cfg.demo_config()
    corpus = StdlibCorpus(cfg.seq_len, probe_windows=cfg.probe_batches * cfg.batch_size)
    need, have = cfg.train_steps * cfg.batch_size, len(corpus.order("train", 0))
    if need > have:
        raise FusedStatsError(f"the width study needs {need} training windows, the corpus has {have}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    entropy = unigram_entropy(corpus)
    tokens = cfg.train_steps * cfg.batch_size * cfg.seq_len
    head = [
        f"fused-stats demo --width-study: widths {list(cfg.widths)}, seeds {list(cfg.seeds)}, depth "
        f"{cfg.depth}, {tokens:,} training bytes per model, lr = {cfg.base_lr:g} * 32 / width, "
        f"{torch.get_num_threads()} threads",
        f"corpus: {corpus.describe()}; unigram entropy of the training bytes {entropy:.3f} nats",
    ]
    for line in head:
        echo(line)
    runs = [(w, s) for s in cfg.seeds for w in sorted(cfg.widths)]
    rows: list[dict] = []
    bar = Progress(
        len(runs) * cfg.train_steps, "width study", enabled=progress is not False, unit="training steps"
    )
    try:
        for width, seed in runs:
            bar.set_description(f"width {width} seed {seed}")
            report = run_one(corpus, demo, width, cfg.depth, seed, bar)
            rows += run_rows(report, cfg)
            m, d_last = report.meta, rows[-1]["d_align"]
            bar.write(
                f"width {width:<4} seed {seed}: loss {m['first_loss']:.2f} -> {m['train_loss']:.3f} "
                f"(held-out {m['test_loss']:.3f}), lr {m['lr']:.3g}, train {m['train_seconds']:.1f} s, "
                f"probe {m['probe_seconds']:.1f} s, d_align(last) {'none' if d_last is None else f'{d_last:.4g}'}",
                echo,
            )
    finally:
        bar.close()
    losses = [r["train_loss"] for r in rows if r["point"] == "last"]
    plateau = {
        "unigram_entropy": entropy,
        "min_train_loss": min(losses),
        "max_train_loss": max(losses),
        "below": sum(v < entropy for v in losses),
        "models": len(losses),
    }
    fits = fits_of(rows)
    last = fits["last"]["d_align"]
    result = {
        "config": asdict(cfg),
        "defaults": {"widths": list(DEFAULT_WIDTHS), "seeds": list(DEFAULT_SEEDS)},
        "exploratory_seeds": list(EXPLORATORY_SEEDS),
        "confirmatory": set(cfg.seeds).isdisjoint(EXPLORATORY_SEEDS),
        "runs": rows,
        "fit": {
            k: last["all_runs"][k] for k in ("exponent", "se", "n", "t", "p_greater", "intercept", "excluded")
        },
        "fit_seed_average": last["seed_average"],
        "fits": fits,
        "plateau": plateau,
        "alpha": ALPHA,
        "verdict": verdict(last["all_runs"], last["seed_average"], plateau["below"] == plateau["models"]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.platform()}",
        "torch_threads": torch.get_num_threads(),
    }
    lines = summary_lines(result)
    files = []
    try:
        files.append(plot_width_study(result, out / "width_study.png"))
    except FusedStatsError as exc:  # matplotlib missing: tables and JSON still written
        lines.append(f"(plot skipped: {exc})")
    result["wall_seconds"] = time.perf_counter() - wall0
    result["cpu_seconds"] = time.process_time() - cpu0
    write_text_atomic(out / "width_study.json", json.dumps(result, indent=1) + "\n")
    lines.append(
        f"wrote {out / 'width_study.json'}, {', '.join(str(f) for f in files)}{', ' if files else ''}"
        f"{out / 'width_study.md'}; total {result['wall_seconds']:.0f} s wall, "
        f"{result['cpu_seconds']:.0f} s CPU for {len(runs)} models"
    )
    for line in lines:
        echo(line)
    write_text_atomic(
        out / "width_study.md",
        "# fused-stats demo --width-study\n\n```\n" + "\n".join(head + lines) + "\n```\n",
    )
    return result
