"""Tests of ``fused-stats demo --width-study`` (fused_stats/demo/width_study.py).

References: the OLS fit against ``numpy.polyfit`` and ``scipy.stats.linregress`` (slope, its
standard error and the one-sided p-value) and the textbook ``sqrt(SSR / (n - 2) / S_xx)`` written
out here, on synthetic data with a known exponent; the unigram entropy against a count of the
files' bytes with ``collections.Counter``; the quick run's fit recomputed from its own runs table.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import math

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import fused_stats as fs
from fused_stats.cli import build_parser, main
from fused_stats.demo.width_study import (
    DEFAULT_SEEDS,
    DEFAULT_WIDTHS,
    EXPLORATORY_SEEDS,
    WidthStudyConfig,
    ols_loglog,
    seed_average_fit,
    unigram_entropy,
    verdict,
)


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("width_study")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--width-study", "--quick", "--out", str(out), "--no-progress", "--threads", "1"])
    return out, rc, buf.getvalue()


def test_quick_run_writes_the_json(quick_out):
    out, rc, text = quick_out
    assert rc == 0
    data = json.loads((out / "width_study.json").read_text())
    cfg = WidthStudyConfig.quick()
    assert data["defaults"] == {"widths": list(DEFAULT_WIDTHS), "seeds": list(DEFAULT_SEEDS)}
    assert data["config"]["widths"] == list(cfg.widths) and data["config"]["seeds"] == list(cfg.seeds)
    assert not data["confirmatory"]  # --quick runs exploratory seeds
    runs = data["runs"]
    assert len(runs) == 2 * len(cfg.widths) * len(cfg.seeds)
    keys = {"width", "seed", "point", "point_name", "d_align", "misalignment", "b_exact", "train_loss", "lr"}
    assert all(keys <= set(r) for r in runs)
    assert {(r["width"], r["seed"], r["point"]) for r in runs} == {
        (w, s, p) for w in cfg.widths for s in cfg.seeds for p in ("middle", "last")
    }
    # depth 2: the middle point is block 1's output, the last block 2's
    assert {r["point_name"] for r in runs if r["point"] == "middle"} == {"model.layers.0"}
    assert {r["point_name"] for r in runs if r["point"] == "last"} == {"model.layers.1"}
    assert {"exponent", "se", "n"} <= set(data["fit"])
    assert set(data["fits"]) == {"middle", "last"}
    for point in ("middle", "last"):
        assert {"d_align", "misalignment", "b_exact"} <= set(data["fits"][point])
    assert data["plateau"]["models"] == len(cfg.widths) * len(cfg.seeds)
    assert (out / "width_study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decision (last point" in text and "ln d_align on ln width" in text


def test_quick_run_fit_recomputed_from_its_runs(quick_out):
    data = json.loads((quick_out[0] / "width_study.json").read_text())
    last = [r for r in data["runs"] if r["point"] == "last" and r["d_align"] is not None and r["d_align"] > 0]
    x = np.log([r["width"] for r in last])
    y = np.log([r["d_align"] for r in last])
    slope, intercept = np.polyfit(x, y, 1)
    assert data["fit"]["n"] == len(last) == 4
    assert data["fit"]["exponent"] == pytest.approx(slope, rel=1e-9, abs=1e-12)
    assert data["fit"]["intercept"] == pytest.approx(intercept, rel=1e-9, abs=1e-12)
    middle = [r for r in data["runs"] if r["point"] == "middle"]
    mis = [(r["width"], r["misalignment"]) for r in middle if r["misalignment"]]
    fit = data["fits"]["middle"]["misalignment"]["all_runs"]
    assert fit["n"] == len(mis) and fit["excluded"] == len(middle) - len(mis)
    losses = [r["train_loss"] for r in data["runs"] if r["point"] == "last"]
    assert data["plateau"]["below"] == sum(v < data["plateau"]["unigram_entropy"] for v in losses)


def test_lr_scales_as_one_over_width_on_the_runs(quick_out):
    data = json.loads((quick_out[0] / "width_study.json").read_text())
    base = data["config"]["base_lr"]
    by_width = {r["width"]: r["lr"] for r in data["runs"]}
    assert len(by_width) == 2
    for width, lr in by_width.items():
        assert lr == pytest.approx(base * 32 / width, rel=1e-12)
    assert all(r["lr"] == by_width[r["width"]] for r in data["runs"])  # the same for every seed


def test_lr_of_the_realised_optimizer_step_scales_with_width():
    """The learning rate the run's AdamW actually used: Adam's first update of a weight is
    lr * warm-up factor * g / (|g| + eps), so the largest |Δw| of a layer is lr * factor (eps
    aside): the realised step, not the config value, halves from width 32 to 64."""
    import torch

    from fused_stats.demo.corpus import StdlibCorpus
    from fused_stats.demo.experiment import train_model
    from fused_stats.demo.models import build_llama, lr_factor

    cfg = WidthStudyConfig.quick(train_steps=1).demo_config()
    corpus = StdlibCorpus(cfg.seq_len, probe_windows=cfg.probe_batches * cfg.batch_size)
    steps = {}
    for width in (32, 64):
        before = build_llama(width, 2, cfg.seq_len, 905).model.layers[0].mlp.up_proj.weight.detach().clone()
        model, _ = train_model(corpus, cfg, width, 2, 905)
        after = model.model.layers[0].mlp.up_proj.weight.detach()
        steps[width] = float((after - before).abs().max()) / lr_factor(0, 1)
    torch.testing.assert_close(steps[32], cfg.base_lr, rtol=1e-3, atol=0)
    torch.testing.assert_close(steps[64], cfg.base_lr / 2, rtol=1e-3, atol=0)


def test_ols_against_polyfit_linregress_and_textbook_se():
    from scipy import stats

    gen = np.random.default_rng(17)
    widths = np.repeat([32.0, 64.0, 128.0, 256.0], 5)
    true_b = 0.45
    y = 0.003 * widths**true_b * np.exp(gen.normal(0, 0.3, widths.size))
    fit = ols_loglog(widths.tolist(), y.tolist())
    lx, ly = np.log(widths), np.log(y)
    slope, intercept = np.polyfit(lx, ly, 1)
    resid = ly - (intercept + slope * lx)
    se = math.sqrt((resid @ resid) / (lx.size - 2) / ((lx - lx.mean()) @ (lx - lx.mean())))
    ref = stats.linregress(lx, ly, alternative="greater")
    assert fit["n"] == 20 and fit["df"] == 18 and fit["excluded"] == 0
    assert fit["exponent"] == pytest.approx(slope, rel=1e-12)
    assert fit["intercept"] == pytest.approx(intercept, rel=1e-12)
    assert fit["se"] == pytest.approx(se, rel=1e-12)
    assert fit["se"] == pytest.approx(ref.stderr, rel=1e-10)
    assert fit["p_greater"] == pytest.approx(ref.pvalue, rel=1e-8)
    assert fit["p_less"] == pytest.approx(1 - ref.pvalue, rel=1e-8)
    assert abs(fit["exponent"] - true_b) < 3 * fit["se"]
    # a decreasing power law: the test of b > 0 does not fire, the test of b < 0 does
    down = ols_loglog(widths.tolist(), (1 / y).tolist())
    assert down["exponent"] == pytest.approx(-slope, rel=1e-12)
    assert down["p_greater"] > 0.5 and down["p_less"] == pytest.approx(ref.pvalue, rel=1e-8)


def test_ols_leaves_out_nonpositive_and_missing_values():
    xs = [32, 32, 64, 64, 128, 128]
    ys = [0.01, -0.002, 0.02, None, 0.05, 0.0]
    fit = ols_loglog(xs, ys)
    slope = np.polyfit(np.log([32, 64, 128]), np.log([0.01, 0.02, 0.05]), 1)[0]
    assert fit["n"] == 3 and fit["excluded"] == 3
    assert fit["exponent"] == pytest.approx(slope, rel=1e-12)
    two = ols_loglog([32, 64], [0.01, 0.02])
    assert two["exponent"] == pytest.approx(1.0) and two["se"] is None and two["p_greater"] is None
    assert ols_loglog([32, 32, 32], [0.1, 0.2, 0.3])["exponent"] is None  # one width: no slope


def test_seed_average_fit_is_the_fit_of_the_mean_logs():
    gen = np.random.default_rng(3)
    rows = [
        {"width": w, "seed": s, "d_align": float(0.01 * w**0.3 * np.exp(gen.normal(0, 0.5)))}
        for w in (32, 64, 128, 256)
        for s in range(4)
    ]
    fit = seed_average_fit(rows, "d_align")
    means = [np.mean([math.log(r["d_align"]) for r in rows if r["width"] == w]) for w in (32, 64, 128, 256)]
    slope = np.polyfit(np.log([32, 64, 128, 256]), means, 1)[0]
    assert fit["n"] == 4 and fit["exponent"] == pytest.approx(slope, rel=1e-12)
    # balanced design: the same slope as the all-runs fit, another standard error
    all_runs = ols_loglog([r["width"] for r in rows], [r["d_align"] for r in rows])
    assert fit["exponent"] == pytest.approx(all_runs["exponent"], rel=1e-12)
    assert fit["se"] != pytest.approx(all_runs["se"], rel=1e-3)


def test_unigram_entropy_against_byte_counts(tmp_path):
    from fused_stats.demo.corpus import StdlibCorpus

    gen = np.random.default_rng(5)
    for i in range(30):
        data = gen.choice(np.arange(40, 60), size=int(gen.integers(20, 90)), p=None).astype(np.uint8)
        (tmp_path / f"m{i}.py").write_bytes(data.tobytes())
    corpus = StdlibCorpus(8, held_out=0.3, root=tmp_path, probe_windows=2)
    counts = collections.Counter()
    for path in corpus.splits["train"].files:
        counts.update(path.read_bytes())
    total = sum(counts.values())
    expected = -sum(c / total * math.log(c / total) for c in counts.values())
    assert unigram_entropy(corpus) == pytest.approx(expected, rel=1e-12)


def test_verdict_follows_the_decision_rule():
    def fit(p):
        return {"p_greater": p}

    assert verdict(fit(0.01), fit(0.03), True).startswith("b > 0 shown")
    assert "not robust" in verdict(fit(0.01), fit(0.2), True)
    assert verdict(fit(0.2), fit(0.01), True).startswith("b > 0 not shown")
    assert verdict(fit(0.05), fit(0.01), True).startswith("b > 0 not shown")  # p < alpha, strictly
    assert "NOT every model passed" in verdict(fit(0.01), fit(0.01), False)


def test_defaults_meet_the_design():
    cfg = WidthStudyConfig()
    assert len(cfg.widths) >= 4 and max(cfg.widths) >= 256 and len(cfg.seeds) >= 4
    assert set(cfg.seeds).isdisjoint(EXPLORATORY_SEEDS)
    assert set(WidthStudyConfig.quick().seeds) <= set(EXPLORATORY_SEEDS)
    assert cfg.middle_index() == 1 and WidthStudyConfig(depth=2).middle_index() == 0
    assert cfg.train_steps * cfg.batch_size * cfg.seq_len == 196_608


def test_cli_flag_parses_and_maps_to_the_config():
    args = build_parser().parse_args(
        ["demo", "--width-study", "--widths", "32", "48", "--seeds", "7", "8", "--steps", "5", "--lr", "0.01"]
    )
    assert args.width_study and args.widths == [(32,), (48,)] and args.steps == 5
    assert not build_parser().parse_args(["demo"]).width_study


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--depths", "1", "2"], "--depths has no effect with --width-study"),
        (["--seeds", "3", "3"], "lists a seed twice"),
        (["--widths", "32"], "needs >= 2 distinct widths"),
        (["--widths", "32", "40"], "multiples of 16"),
    ],
)
def test_bad_options_are_refused_before_a_folder_is_made(tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    assert main(["demo", "--width-study", "--quick", "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_run_refuses_a_full_out_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["demo", "--width-study", "--quick", "--out", str(tmp_path)]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    with pytest.raises(fs.FusedStatsError, match="lists a width twice"):
        WidthStudyConfig(widths=(32, 32, 64)).validate()


def test_cli_options_reach_the_study_config(tmp_path, monkeypatch):
    import fused_stats.demo.width_study as ws

    seen = {}
    monkeypatch.setattr(ws, "run_width_study", lambda cfg, out, progress=None: seen.update(cfg=cfg, out=out))
    argv = ["demo", "--width-study", "--widths", "32", "48", "--seeds", "7", "8", "--steps", "5"]
    argv += ["--lr", "0.01", "--width-sweep-depth", "3", "--probe-batches", "5", "--split", "8"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    cfg = seen["cfg"]
    assert (cfg.widths, cfg.seeds, cfg.train_steps, cfg.base_lr) == ((32, 48), (7, 8), 5, 0.01)
    assert (cfg.depth, cfg.probe_batches, cfg.split) == (3, 5, 8)
    assert main(["demo", "--width-study", "--out", str(tmp_path / "b")]) == 0
    assert seen["cfg"] == WidthStudyConfig()
    assert main(["demo", "--width-study", "--quick", "--steps", "3", "--out", str(tmp_path / "c")]) == 0
    assert seen["cfg"] == WidthStudyConfig.quick(train_steps=3)
