"""Tests of fused_stats.api.report.document: JSON round trip (with inf/nan), markdown numbers, PNG plots,
sweep plots and rejection of bad files.

References: the report's numbers are checked against brute-force U-statistics over ordered tuples
of distinct indices (written here, independent of the package's centred streaming formulas) and
against the certificate/Cantelli formulas evaluated directly from those brute-force values.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import sys

import pytest
import torch

import fused_stats as fs
from fused_stats.api.report.document import Report, fmt, plot_sweep, sweep_rows


# ---------------------------------------------------------------------------- references
def brute_force(q: torch.Tensor) -> dict:
    """U1..U4 by explicit loops over ordered tuples of distinct indices (fp64, small n)."""
    q = q.double()
    n = q.shape[0]
    g = q @ q.T
    u1 = sum(g[i, j] for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    u2 = sum(g[i, j] ** 2 for i, j in itertools.permutations(range(n), 2)) / (n * (n - 1))
    u3 = sum(g[i, j] * g[j, k] for i, j, k in itertools.permutations(range(n), 3)) / (n * (n - 1) * (n - 2))
    u4 = sum(g[i, j] * g[k, m] for i, j, k, m in itertools.permutations(range(n), 4)) / (
        n * (n - 1) * (n - 2) * (n - 3)
    )
    mu4, msm, tr2 = float(u4), float(u3 - u4), float(u2 - 2 * u3 + u4)
    norms = q.norm(dim=1)
    # docs/design.md, section 2 conventions: |mu|^4 <= 0 means no signal (dimensions 0); a ratio over
    # a variance estimate <= 0 is not estimable (None), and d_align is then the other ratio
    if mu4 > 0:
        d_par = mu4 / msm if msm > 0 else None
        d_2 = mu4 / tr2 if tr2 > 0 else None
    else:
        d_par = d_2 = 0.0
    ratios = [d for d in (d_par, d_2) if d is not None]
    return {
        "n": n,
        "mu_norm2": float(u1),
        "mu_norm4": mu4,
        "mu_sigma_mu": msm,
        "trace_sigma2": tr2,
        "d_par": d_par,
        "d_2": d_2,
        "d_align": min(ratios) if ratios else None,
        "ag_max": float(norms.max()),
        "ag_mean": float(norms.mean()),
    }


def samples(n: int, d: int, seed: int, shift: float = 0.3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=gen, dtype=torch.float64) * shift
    return mean + torch.randn(n, d, generator=gen, dtype=torch.float64)


def make_data(n_train=9, n_test=8, d=5, seed=0, points=2) -> tuple[dict, list]:
    """A report dict built from GradStats fed seeded data; also returns the raw samples."""
    entries, raw = [], []
    for index in range(points):
        qa = samples(n_train, d, seed + 10 * index)
        qb = samples(n_test, d, seed + 10 * index + 1) * 0.5 + qa.mean(0)
        train = fs.GradStats(d, second_moment="pool", name=f"layers.{index}")
        test = fs.GradStats(d, second_moment="pool", name=f"layers.{index}")
        train.update(qa[:4])
        train.update(qa[4:])
        test.update(qb)
        est = train.estimate()
        entries.append(
            {
                "name": f"model.layers.{index}",
                "index": index,
                "dim": d,
                "train": est.to_dict(),
                "test": test.estimate().to_dict(),
                "certificate": est.certificate(3, 4).to_dict(),
                "misalignment": fs.misalignment_probability(train, 3, 4, trials=500, seed=1).to_dict(),
                "realized_alignment": fs.realized_alignment(train, test),
                "saturation": None,
            }
        )
        raw.append((qa, qb))
    data = {
        "format": "fused_stats.report",
        "version": 1,
        "fused_stats_version": fs.__version__,
        "created": Report.now(),
        "model": {
            "class": "TinyModel",
            "num_parameters": 1234,
            "config": {"hidden_size": d, "num_layers": points},
        },
        "unit": "sample",
        "second_moment": "pool",
        "points": entries,
        "meta": {"width": d, "depth": points, "seed": seed},
    }
    return data, raw


# ---------------------------------------------------------------------------- the dict itself
def test_report_numbers_equal_brute_force_u_statistics():
    data, raw = make_data()
    for entry, (qa, qb) in zip(data["points"], raw):
        for stream, q in (("train", qa), ("test", qb)):
            ref = brute_force(q)
            for key, value in ref.items():
                if value is None:  # not estimable at this n: None, never inf
                    assert entry[stream][key] is None and key in entry[stream]["not_estimable"], key
                    continue
                assert entry[stream][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (stream, key)
        ref = brute_force(qa)
        M, K = 3, 4
        # both variance components are >= 0 in the population: a negative estimate counts as 0
        var = (1 / M + 1 / K) * max(ref["mu_sigma_mu"], 0) + max(ref["trace_sigma2"], 0) / (M * K)
        assert entry["certificate"]["b_exact"] == pytest.approx(var / (var + ref["mu_norm4"]), rel=1e-9)
        n_eff = M * K / (M + K + 1)
        assert entry["certificate"]["b_align"] == pytest.approx(1 / (1 + n_eff * ref["d_align"]), rel=1e-9)
        assert entry["realized_alignment"] == pytest.approx(float(qa.mean(0) @ qb.mean(0)), rel=1e-9)


# ---------------------------------------------------------------------------- JSON
def test_json_round_trip_keeps_inf_and_nan(tmp_path):
    data, _ = make_data()
    data["points"][0]["train"]["d_par"] = math.inf
    data["points"][0]["test"]["mu_sigma_mu"] = -math.inf
    data["points"][1]["realized_alignment"] = math.nan
    data["points"][1]["saturation"] = {"cross_frob2": 0.25, "cross_frob2_se": math.nan, "saturated": False}
    data["meta"]["test_loss"] = math.nan
    report = Report(data)
    path = report.to_json(tmp_path / "sub" / "r.json")
    text = path.read_text()

    def reject(token):
        raise AssertionError(f"non-standard JSON constant {token} in the file")

    json.loads(text, parse_constant=reject)  # strict JSON: no bare NaN / Infinity
    assert '"Infinity"' in text and '"-Infinity"' in text and '"NaN"' in text
    back = Report.from_json(path)
    assert back == report
    assert back.data["points"][0]["train"]["d_par"] == math.inf
    assert back.data["points"][0]["test"]["mu_sigma_mu"] == -math.inf
    assert math.isnan(back.data["points"][1]["realized_alignment"])
    assert math.isnan(back.meta["test_loss"])
    assert back.data["points"][1]["saturation"]["saturated"] is False
    # a finite value survives bit-exactly (json writes repr, which round-trips floats)
    assert back.data["points"][0]["train"]["mu_norm2"] == data["points"][0]["train"]["mu_norm2"]
    assert not list(tmp_path.joinpath("sub").glob(".*tmp"))  # no temp file left behind


def test_equality_detects_a_changed_number():
    a, _ = make_data()
    b, _ = make_data()
    b["created"] = a["created"]
    assert Report(a) == Report(b)
    b["points"][1]["train"]["mu_norm2"] += 1e-12
    assert Report(a) != Report(b)


# ---------------------------------------------------------------------------- markdown
def _table_after(markdown: str, heading: str) -> dict[str, list[str]]:
    block = markdown.split(heading, 1)[1]
    rows = {}
    for line in block.splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith(("| quantity", "| point")) and "---" not in line:
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_markdown_shows_brute_force_values():
    data, raw = make_data()
    md = Report(data).to_markdown()
    labels = {
        "n": "n",
        "‖μ‖²": "mu_norm2",
        "‖μ‖⁴": "mu_norm4",
        "μᵀΣμ": "mu_sigma_mu",
        "tr(Σ²)": "trace_sigma2",
        "d_par": "d_par",
        "d_2": "d_2",
        "d_align": "d_align",
        "AG_max": "ag_max",
        "AG_mean": "ag_mean",
    }
    for entry, (qa, qb) in zip(data["points"], raw):
        table = _table_after(md, f"## Point `{entry['name']}`")
        for label, key in labels.items():
            for col, q in enumerate((qa, qb)):
                if brute_force(q)[key] is None:  # not estimable at this n
                    assert table[label][col] == "—", (label, col)
                    continue
                shown = float(table[label][col])
                # 4 significant digits are printed
                assert shown == pytest.approx(brute_force(q)[key], rel=1e-3), (label, col)
        section = md.split(f"## Point `{entry['name']}`", 1)[1].split("## Point", 1)[0]
        cert = entry["certificate"]
        m = re.search(r"b_align=([-\d.e+]+), b_exact=([-\d.e+]+)", section)
        assert float(m.group(1)) == pytest.approx(cert["b_align"], rel=1e-3)
        assert float(m.group(2)) == pytest.approx(cert["b_exact"], rel=1e-3)
        m = re.search(r"splits\): ([-\d.e+]+) ± ([-\d.e+]+)", section)
        assert float(m.group(1)) == pytest.approx(entry["misalignment"]["probability"], abs=1e-4)
        m = re.search(r"realized alignment \(train mean · test mean\): ([-\d.e+]+)", section)
        assert float(m.group(1)) == pytest.approx(float(qa.mean(0) @ qb.mean(0)), rel=1e-3)
    summary = _table_after(md, "## Summary")
    assert set(summary) == {f"`{p['name']}`" for p in data["points"]}


def test_markdown_marks_missing_and_nonfinite_values():
    data, _ = make_data(points=1)
    data["points"][0]["test"] = None
    data["points"][0]["misalignment"] = None
    data["points"][0]["train"]["d_par"] = math.inf
    md = Report(data).to_markdown()
    table = _table_after(md, "## Point `model.layers.0`")
    assert table["d_par"] == ["inf", "—"]
    assert "empirical misalignment: not computed" in md


# ---------------------------------------------------------------------------- plots
def _read_png(path):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    # not a blank canvas: something was drawn
    assert float(img[..., :3].std()) > 0.01
    return img


def test_plot_writes_readable_png(tmp_path):
    data, _ = make_data(points=3)
    data["points"][1]["train"]["d_align"] = math.inf  # skipped, not a crash
    data["points"][2]["misalignment"] = None
    _read_png(Report(data).plot(tmp_path / "r.png"))


def test_plot_sweeps_and_rows(tmp_path):
    reports = []
    for width in (4, 6, 8):
        for seed in (0, 1):
            data, _ = make_data(d=width, seed=seed + width)
            data["meta"] = {
                "width": width,
                "depth": width // 2,
                "seed": seed,
                "test_loss": 1.0 / width,
                "stream_norm": {p["name"]: 2.0 + p["index"] for p in data["points"]},
            }
            data["points"][-1]["saturation"] = {"cross_frob2": 0.1 * width, "cross_frob2_se": 0.01}
            reports.append(Report(data))
    rows = sweep_rows(reports, "width")
    assert [(r["x"], r["seed"]) for r in rows] == [(w, s) for w in (4, 6, 8) for s in (0, 1)]
    for r, rep in zip(rows, reports):
        last = rep.points[-1]
        assert r["point"] == last["name"] and r["d_align"] == last["train"]["d_align"]
        norm = 2.0 + last["index"]
        assert r["stream_norm"] == norm
        assert r["ag_max_scaled"] == pytest.approx(last["train"]["ag_max"] * norm / math.sqrt(last["dim"]))
    _read_png(plot_sweep(reports, "width", tmp_path / "w.png"))
    _read_png(plot_sweep(reports, "depth", tmp_path / "d.png", point="first"))
    with pytest.raises(fs.FusedStatsError, match="x must be"):
        plot_sweep(reports, "height", tmp_path / "x.png")
    # without meta["width"] the config's hidden_size labels the run; without either it is refused
    del reports[0].data["meta"]["width"]
    reports[0].data["model"]["config"]["hidden_size"] = 40
    assert sweep_rows(reports, "width")[0]["x"] == 40
    del reports[0].data["model"]["config"]["hidden_size"]
    with pytest.raises(fs.FusedStatsError, match=r"meta\['width'\].*hidden_size"):
        plot_sweep(reports, "width", tmp_path / "x.png")


def test_missing_matplotlib_gives_clear_error(tmp_path, monkeypatch):
    data, _ = make_data(points=1)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    with pytest.raises(fs.FusedStatsError, match="pip install"):
        Report(data).plot(tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format="something.else"), "not a fused_stats report"),
        (lambda d: d.update(version=2), "unsupported version 2"),
        (lambda d: d.pop("meta"), "missing top-level keys \\['meta'\\]"),
        (lambda d: d["model"].update(num_parameters="many"), "num_parameters"),
        (lambda d: d["points"][0]["train"].pop("d_align"), "lacks keys \\['d_align'\\]"),
        (lambda d: d["points"][0]["certificate"].update(b_exact="high"), "b_exact"),
        (lambda d: d["points"][1].update(name="model.layers.0"), "appears twice"),
        (lambda d: d["points"][0].update(realized_alignment=[1.0]), "realized_alignment"),
        (lambda d: d["points"][0].update(index=1.5), "index must be an int"),
    ],
)
def test_bad_report_dicts_raise(mutate, message):
    data, _ = make_data()
    mutate(data)
    with pytest.raises(fs.FusedStatsError, match=message):
        Report(data)


def test_bad_files_raise(tmp_path):
    with pytest.raises(fs.FusedStatsError, match="does not exist"):
        Report.from_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "fused_stats.report", "version": ')
    with pytest.raises(fs.FusedStatsError, match="not valid JSON"):
        Report.from_json(broken)
    data, _ = make_data()
    data["version"] = 99
    future = tmp_path / "future.json"
    future.write_text(json.dumps(data))
    with pytest.raises(fs.FusedStatsError, match=r"future.json.*unsupported version 99"):
        Report.from_json(future)
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(fs.FusedStatsError, match="JSON object"):
        Report.from_json(listing)


def test_failed_write_keeps_existing_file(tmp_path, monkeypatch):
    data, _ = make_data()
    path = Report(data).to_json(tmp_path / "r.json")
    before = path.read_bytes()
    import fused_stats.accumulators.persistence as persistence

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(persistence.os, "fsync", boom)
    data2, _ = make_data(seed=5)
    with pytest.raises(OSError, match="disk full"):
        Report(data2).to_json(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


# ---------------------------------------------------------------------------- sweep summaries
def _exact_spearman(xs, ys):
    """Reference: ρ from the textbook formula on average ranks, p by enumerating every
    permutation (small n only)."""

    def ranks(v):
        return [sum(1 for w in v if w < a) + (sum(1 for w in v if w == a) + 1) / 2 for a in v]

    def corr(a, b):
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        return num / math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))

    rx, ry = ranks(xs), ranks(ys)
    rho = corr(rx, ry)
    perms = list(itertools.permutations(ry))
    p = sum(abs(corr(rx, list(q))) >= abs(rho) - 1e-12 for q in perms) / len(perms)
    return rho, p


@pytest.mark.parametrize(
    "xs, ys",
    [
        ([1, 2, 3, 4, 5, 6], [0.1, 0.3, 0.2, 0.5, 0.4, 0.9]),
        ([32, 32, 64, 64, 128, 128], [0.01, 0.03, 0.02, 0.02, 0.05, 0.04]),  # ties
        ([1, 2, 3, 4, 5], [5.0, 3.0, 4.0, 1.0, 2.0]),
    ],
)
def test_rank_correlation_small_n_is_the_exact_permutation_test(xs, ys):
    from fused_stats.accumulators.trends import rank_correlation

    # n! <= permutations: every re-pairing is enumerated, so rho and p equal the exact reference
    rho, p = rank_correlation(xs, ys, permutations=20_000, seed=3)
    ref_rho, ref_p = _exact_spearman(xs, ys)
    assert rho == pytest.approx(ref_rho, abs=1e-12)
    assert p == pytest.approx(ref_p, abs=1e-12)


def test_rank_correlation_monte_carlo_matches_exact_enumeration():
    from fused_stats.accumulators.trends import rank_correlation

    gen = torch.Generator().manual_seed(11)
    xs = [16, 16, 32, 32, 64, 64, 128, 128]
    ys = (
        torch.tensor([float(x) for x in xs]).log() * 0.3 + torch.randn(8, generator=gen, dtype=torch.float64)
    ).tolist()
    rho, p = rank_correlation(xs, ys, permutations=20_000, seed=5)  # 20000 < 8! = 40320
    ref_rho, ref_p = _exact_spearman(xs, ys)
    assert rho == pytest.approx(ref_rho, abs=1e-12)
    assert abs(p - ref_p) <= 4 * math.sqrt(ref_p * (1 - ref_p) / 20_000) + 1e-4
    assert 0 < ref_p < 1


def test_spearman_rho_equals_the_rank_difference_formula():
    from fused_stats.accumulators.trends import rank_correlation

    gen = torch.Generator().manual_seed(2)
    for n in (5, 9, 14):
        xs = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
        ys = torch.randn(n, generator=gen, dtype=torch.float64).tolist()
        rank = {v: i + 1 for i, v in enumerate(sorted(xs))}
        rank_y = {v: i + 1 for i, v in enumerate(sorted(ys))}
        d2 = sum((rank[a] - rank_y[b]) ** 2 for a, b in zip(xs, ys))
        # no ties: rho = 1 - 6 sum d^2 / (n (n^2 - 1))   (Spearman's formula)
        rho, _ = rank_correlation(xs, ys, permutations=200)
        assert rho == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-12)


def test_p_value_does_not_depend_on_the_order_of_the_runs():
    from fused_stats.accumulators.trends import rank_correlation
    from fused_stats.api.report.document import sweep_summary

    gen = torch.Generator().manual_seed(4)
    xs = [1, 2, 4, 8] * 3
    ys = torch.randn(12, generator=gen, dtype=torch.float64).tolist()
    order = torch.randperm(12, generator=gen).tolist()
    first = rank_correlation(xs, ys, permutations=5000, seed=0)
    second = rank_correlation([xs[i] for i in order], [ys[i] for i in order], permutations=5000)
    assert first == second
    reports = []
    for depth, value in zip(xs, ys):
        data, _ = make_data(points=1, seed=len(reports))
        data["meta"] = {"depth": depth, "seed": len(reports), "test_loss": value}
        reports.append(Report(data))
    text = sweep_summary(reports, "depth")
    assert sweep_summary([reports[i] for i in order], "depth") == text
    assert f"p = {first[1]:.3g}" in next(
        line for line in text.splitlines() if line.startswith("test_loss vs")
    )


def test_cosine_of_the_mean_gradients():
    from fused_stats.accumulators.trends import cosine

    assert cosine(0.5, 1.0, 4.0) == pytest.approx(0.25)
    assert cosine(0.5, -1.0, 4.0) is None and cosine(None, 1.0, 1.0) is None
    assert cosine(math.nan, 1.0, 1.0) is None


def test_sweep_summary_medians_and_trend_words():
    from fused_stats.api.report.document import sweep_summary

    reports = []
    for width, values in (
        (16, (0.010, 0.020, 0.015)),
        (32, (0.030, 0.050, 0.040)),
        (64, (0.070, 0.060, 0.080)),
    ):
        for seed, value in enumerate(values):
            data, _ = make_data(points=2, seed=seed)
            data["meta"] = {"width": width, "seed": seed}
            data["points"][-1]["train"]["d_align"] = value
            data["points"][-1]["misalignment"]["probability"] = 0.3  # constant: no trend
            reports.append(Report(data))
    text = sweep_summary(reports, "width")
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()[0].isdigit()}
    assert rows["16"].split()[2] == "0.015" and rows["64"].split()[2] == "0.07"
    assert "[0.01," in rows["16"] and "0.02]" in rows["16"]
    assert "d_align vs width: increases with width" in text
    assert "misalignment vs width: rank correlation undefined" in text
    for r, v in zip(reports, [0.03, 0.01, 0.02, 0.02, 0.03, 0.01, 0.01, 0.03, 0.02]):
        r.data["points"][-1]["train"]["d_align"] = v
    assert "d_align vs width: no clear monotone trend" in sweep_summary(reports, "width")
    assert "too few runs" in sweep_summary(reports[:3], "width")


def test_png_files_get_the_permissions_of_the_json_and_markdown(tmp_path):
    import os
    import stat

    data, _ = make_data(points=2)
    report = Report(data)
    old = os.umask(0o022)
    try:
        files = [
            report.to_json(tmp_path / "r.json"),
            report.to_markdown_file(tmp_path / "r.md"),
            report.plot(tmp_path / "r.png"),
            plot_sweep([report, Report(make_data(seed=1)[0])], "width", tmp_path / "s.png"),
        ]
    finally:
        os.umask(old)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
    assert modes == {name: 0o644 for name in modes}, modes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.md", "r.png", "s.png"]


# ---------------------------------------------------------------------------- plots as a reader sees them
@pytest.fixture
def captured(monkeypatch):
    """The figures the plot functions save (the PNG is still written)."""
    import fused_stats.api.report.plots as report_mod

    figures = []
    real = report_mod.save_figure

    def keep(fig, path, **kw):
        figures.append(fig)
        return real(fig, path, **kw)

    monkeypatch.setattr(report_mod, "save_figure", keep)
    return figures


def _check_readable(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert ax.get_ylabel().strip(), ax.get_title()
        legend = ax.get_legend()
        if legend is not None:  # the legend sits below the axes and its tick labels
            assert legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0 + 1
        labels = [t for t in ax.get_yticklabels() if t.get_text() and t.get_visible()]
        ys = sorted(
            t.get_window_extent(renderer).y0
            for t in labels
            if ax.get_ylim()[0] <= t.get_position()[1] <= ax.get_ylim()[1]
        )
        heights = [t.get_window_extent(renderer).height for t in labels]
        for a, b in itertools.pairwise(ys):
            assert b - a >= 0.9 * max(heights), (ax.get_title(), ys)  # no two labels overlap


def test_report_plot_panels_only_for_computed_numbers(tmp_path, captured):
    data, _ = make_data(points=3)
    for p in data["points"]:
        p["misalignment"] = None
    Report(data).plot(tmp_path / "a.png")
    (fig,) = captured
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 3 and "misalignment" not in titles[2] and "certificate" in titles[2]
    _check_readable(fig)
    for p in data["points"]:
        p["certificate"] = None
    Report(data).plot(tmp_path / "b.png")
    assert len(captured[1].axes) == 2  # no transfer panel at all
    _check_readable(captured[1])


def test_sweep_plots_are_readable_with_symlog_zeros(tmp_path, captured):
    reports = []
    values = [0.0, 0.046, 1.3e-4, 7.2e-5, 3.3e-3, 9.9e-5, 8.7e-4, 2.3e-3, 1.2e-3]
    for i, value in enumerate(values):
        data, _ = make_data(points=2, seed=i)
        data["meta"] = {
            "width": (32, 64, 128)[i // 3],
            "depth": (1, 2, 4)[i // 3],
            "seed": i % 3,
            "test_loss": 2.0 + 0.01 * i,
        }
        data["points"][-1]["train"]["d_align"] = value
        data["points"][-1]["saturation"] = {"cross_frob2": 1e-4 * (i + 1), "cross_frob2_se": 1e-5}
        reports.append(Report(data))
    plot_sweep(reports, "width", tmp_path / "w.png")
    plot_sweep(reports, "depth", tmp_path / "d.png")
    width_fig, depth_fig = captured
    assert width_fig.axes[0].get_yscale() == "symlog"
    texts = [t.get_text() for t in width_fig.axes[0].get_yticklabels()]
    assert texts[0] == "0" and len(texts) == len(set(texts))
    for fig in captured:
        _check_readable(fig)
    # no stream_norm in meta: no panel for the scale-free AG_max
    assert [ax.get_title() for ax in depth_fig.axes] == [
        "AG_max vs depth (spread over seeds)",
        "cross-gradient vs depth",
        "held-out loss vs depth",
    ]


# ---------------------------------------------------------------------------- norm histogram
class _TwoLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 6)
        self.act = torch.nn.Tanh()
        self.second = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.second(self.act(self.first(x)))


def _per_sample_norms(model, x, y, name) -> list[float]:
    """|∂ℓ_i/∂z_i| at module ``name``: one forward and one backward per sample."""
    norms = []
    for i in range(x.shape[0]):
        seen = {}
        handle = model.get_submodule(name).register_forward_hook(
            lambda mod, args, out, seen=seen: seen.setdefault("z", out)
        )
        try:
            loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        finally:
            handle.remove()
        (g,) = torch.autograd.grad(loss, [seen["z"]])
        norms.append(float(g.reshape(-1).norm()))
    return norms


def test_report_renders_the_norm_histogram_of_per_sample_norms(tmp_path, captured):
    import numpy as np

    gen = torch.Generator().manual_seed(7)
    model = _TwoLayer().double()
    low, high, bins = 0.1, 1.5, 8
    probe = fs.Probe(
        model,
        points=["first", "second"],
        second_moment="pool",
        norm_histogram={"low": low, "high": high, "bins": bins},
    )
    xs = [torch.randn(10, 4, generator=gen, dtype=torch.float64) * 2 for _ in range(2)]
    ys = [torch.randint(0, 3, (10,), generator=gen) for _ in range(2)]
    for x, y in zip(xs, ys):
        probe.step((x, y), fs.classification_loss)
    report = probe.report(misalignment_trials=0)
    report = Report.from_json(report.to_json(tmp_path / "r.json"))  # survives the JSON file
    md = report.to_markdown()
    edges = np.logspace(np.log10(low), np.log10(high), bins + 1)
    expected = {}
    for name in probe.points:
        norms = np.array(_per_sample_norms(model, torch.cat(xs), torch.cat(ys), name))
        counts, _ = np.histogram(norms, bins=edges)
        expected[name] = counts.tolist()
        section = md.split(f"## Point `{name}`", 1)[1].split("## Point", 1)[0]
        rows = {}
        for line in section.split("### Per-sample norm histogram", 1)[1].splitlines():
            if line.startswith("| ["):
                cells = [c.strip() for c in line.strip("|").split("|")]
                rows[cells[0]] = int(cells[1])
        shown = [rows.get(f"[{a:.3g}, {b:.3g})", 0) for a, b in itertools.pairwise(edges)]
        assert shown == expected[name], name
        assert rows[f"[0, {edges[0]:.3g})"] == int((norms < low).sum())
        assert rows[f"[{edges[-1]:.3g}, inf)"] == int((norms >= high).sum())
        assert sum(rows.values()) == 20
    # the plot: one panel of bars whose heights are those counts, on a log |q| axis
    report.plot(tmp_path / "r.png")
    (fig,) = captured
    ax = next(a for a in fig.axes if "norm histogram" in a.get_title())
    assert ax.get_xscale() == "log"
    heights = [round(bar.get_height()) for bar in ax.patches]
    assert heights == expected["first"] + expected["second"]
    lefts = [bar.get_x() for bar in ax.patches[:bins]]
    assert lefts == pytest.approx(edges[:-1].tolist(), rel=1e-12)
    _check_readable(fig)
    # a report without histograms has no such panel and no such section
    plain, _ = make_data(points=2)
    Report(plain).plot(tmp_path / "p.png")
    assert not any("norm histogram" in a.get_title() for a in captured[1].axes)
    assert "norm histogram" not in Report(plain).to_markdown()


def test_bad_norm_histogram_is_rejected():
    data, _ = make_data(points=1)
    good = {"n": 3, "edges": [0.1, 1.0, 10.0], "counts": [1, 1], "underflow": 1, "overflow": 0}
    data["points"][0]["norm_histogram"] = dict(good, counts=[2, 1])
    with pytest.raises(fs.FusedStatsError, match="norm_histogram: the counts add up to 4, n=3"):
        Report(data)
    data["points"][0]["norm_histogram"] = dict(good, edges=[0.1, 1.0])
    with pytest.raises(fs.FusedStatsError, match="one more positive edge than counts"):
        Report(data)
    data["points"][0]["norm_histogram"] = good
    assert "| [0.1, 1) | 1 |" in Report(data).to_markdown()


def test_markdown_says_when_the_saturation_se_is_not_estimable():
    """A NaN standard error (negative variance estimate) is named as such, never shown as 0 or nan."""
    data, _ = make_data(points=2)
    data["points"][0]["saturation"] = {"cross_frob2": 3e-5, "cross_frob2_se": math.nan, "z": 0.9}
    data["points"][1]["saturation"] = {"cross_frob2": 3e-5, "cross_frob2_se": 2.5e-5, "z": 0.9}
    lines = [line for line in Report(data).to_markdown().splitlines() if line.startswith("- saturation")]
    assert len(lines) == 2
    assert "SE of the estimate = not estimable" in lines[0] and "nan" not in lines[0]
    assert "SE of the estimate = 2.5e-05" in lines[1]


def _transfer_colours(ax) -> dict:
    """Legend label (up to its first comma or bracket) -> the colour of that curve."""
    import matplotlib.colors as mcolors

    handles, labels = ax.get_legend_handles_labels()
    out = {}
    for handle, label in zip(handles, labels):
        line = handle.lines[0] if hasattr(handle, "lines") else handle  # an errorbar container
        out[re.split(r"[,(]", label)[0].strip()] = mcolors.to_hex(line.get_color())
    return out


def test_transfer_curves_keep_their_colours_and_small_probabilities_show(tmp_path, captured):
    """The per-point and the sweep figure draw B_align, B_exact and the misalignment in the same
    colours, on an axis where a misalignment of 1e-3 sits well above 0 (a linear 0-1 axis would
    put it within a pixel of the zero line)."""
    reports = []
    for i, width in enumerate((32, 64)):
        data, _ = make_data(points=2, seed=i)
        data["meta"] = {"width": width, "seed": 0}
        for p in data["points"]:
            p["misalignment"] = {**p["misalignment"], "probability": 1e-3, "stderr": 5e-4}
        reports.append(Report(data))
    reports[0].plot(tmp_path / "p.png")
    plot_sweep(reports, "width", tmp_path / "w.png")
    point_fig, sweep_fig = captured
    point_ax = next(ax for ax in point_fig.axes if "misalignment" in ax.get_title())
    sweep_ax = next(ax for ax in sweep_fig.axes if "misalignment" in ax.get_title())
    a, b = _transfer_colours(point_ax), _transfer_colours(sweep_ax)
    for name in ("B_exact", "B_align", "empirical Pr"):
        ka = next(k for k in a if k.startswith(name))
        kb = next(k for k in b if k.startswith(name))
        assert a[ka] == b[kb], (name, a, b)
    assert len(set(a.values())) == 3
    for ax in (point_ax, sweep_ax):
        assert ax.get_yscale() == "symlog"
        to_axes = ax.transScale + ax.transLimits
        y0, y1 = (to_axes.transform((0, v))[1] for v in (0.0, 1e-3))
        assert y1 - y0 > 0.05, (y0, y1)  # 1e-3 is a visible distance above 0
        _check_readable(ax.figure)


def test_report_plot_has_a_saturation_panel_with_cross(tmp_path, captured):
    data, _ = make_data(points=3)
    ses = [2e-5, math.nan, 1e-5]
    for p, se, sat in zip(data["points"], ses, (False, False, True)):
        p["saturation"] = {"cross_frob2": 3e-5 * (p["index"] + 1), "cross_frob2_se": se, "saturated": sat}
    Report(data).plot(tmp_path / "s.png")
    (fig,) = captured
    (ax,) = [ax for ax in fig.axes if "cross-gradient" in ax.get_title()]
    labels = ax.get_legend_handles_labels()[1]
    assert any("|C|_F^2" in t for t in labels) and any("SE not estimable" in t for t in labels)
    assert any("saturated" in t for t in labels)
    series = [list(line.get_ydata()) for line in ax.get_lines()]
    assert [3e-5, 6e-5, 9e-5] in series  # the values themselves, one marker per point
    assert [9e-5] in series  # the saturated point gets the open marker
    _check_readable(fig)
    for p in data["points"]:
        p["saturation"] = None
    Report(data).plot(tmp_path / "n.png")
    assert not any("cross-gradient" in ax.get_title() for ax in captured[1].axes)


def test_summary_table_names_the_stream_of_every_number():
    """d_align is the train stream's, the bounds come from the pooled moments: the header says so,
    and the d_align cell is the train value even where the test value differs."""
    data, _ = make_data(points=2)
    md = Report(data).to_markdown()
    head = next(line for line in md.splitlines() if line.startswith("| point"))
    for title in ("n (train)", "d_align (train)", "B_align (pooled)", "B_exact (pooled)",
                  "misalignment (pooled splits)", "realized alignment (train · test)", "AG_max (train)"):  # fmt: skip
        assert f"| {title} |" in head, (title, head)
    summary = _table_after(md, "## Summary")
    for p in data["points"]:
        assert p["train"]["d_align"] != p["test"]["d_align"]
        assert summary[f"`{p['name']}`"][3] == fmt(p["train"]["d_align"])
