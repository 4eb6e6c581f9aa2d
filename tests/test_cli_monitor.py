"""MonitorLog on an existing file (refused unless mode="append" / "overwrite"), run ids in every
line, and ``fused-stats report`` on a log that holds several runs (one table and plot per run).

The logged sample counts are checked against the number of samples fed in (counted here); each
run's records against the steps at which that run wrote them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.api.training.monitor_log import plot_monitor_log, read_monitor_log, split_runs
from fused_stats.cli import main

from tiny_models import TanhBlock

pytest.importorskip("matplotlib")


def per_sample_loss(model, x):
    return (model(x) ** 2).sum(dim=1)


def run_steps(log, steps, gen, batch=5, d=4):
    """A fresh two-block model, probed and logged at each of ``steps``; returns the samples fed."""
    model = nn.Sequential(TanhBlock(d), TanhBlock(d))
    probe = fs.Probe(model, points=["0", "1"], unit="sample", second_moment="dense")
    for step in steps:
        probe.step(torch.randn(batch, d, generator=gen), per_sample_loss)
        log.write(probe, step=step)
    return batch * len(steps)


def test_existing_log_is_refused_without_a_mode(tmp_path, gen):
    path = tmp_path / "run.jsonl"
    run_steps(fs.MonitorLog(path), [1, 2], gen)
    before = path.read_bytes()
    with pytest.raises(fs.FusedStatsError, match=r"run.jsonl.*already exists.*mode='append'"):
        fs.MonitorLog(path)
    assert path.read_bytes() == before
    with pytest.raises(fs.FusedStatsError, match="mode must be one of"):
        fs.MonitorLog(path, mode="add")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fs.MonitorLog(empty)  # an empty file holds no run: nothing to protect


def test_append_starts_a_new_run_and_run_id_continues_one(tmp_path, gen):
    path = tmp_path / "run.jsonl"
    first = fs.MonitorLog(path)
    n_first = run_steps(first, [1, 2, 3], gen)
    second = fs.MonitorLog(path, mode="append")
    n_second = run_steps(second, [1, 2], gen)
    assert first.run_id != second.run_id
    records = read_monitor_log(path)
    assert [r["run"] for r in records] == [first.run_id] * 3 + [second.run_id] * 2
    runs = split_runs(records)
    assert list(runs) == [first.run_id, second.run_id]
    assert [r["step"] for r in runs[first.run_id]] == [1, 2, 3]
    assert [r["step"] for r in runs[second.run_id]] == [1, 2]
    assert runs[first.run_id][-1]["points"]["1"]["n"] == n_first
    assert runs[second.run_id][-1]["points"]["1"]["n"] == n_second
    resumed = fs.MonitorLog(path, mode="append", run_id=second.run_id)
    run_steps(resumed, [3], gen)
    assert [r["step"] for r in split_runs(read_monitor_log(path))[second.run_id]] == [1, 2, 3]


def test_overwrite_replaces_the_file_at_the_first_line(tmp_path, gen):
    path = tmp_path / "run.jsonl"
    old = fs.MonitorLog(path)
    run_steps(old, [1, 2, 3], gen)
    log = fs.MonitorLog(path, mode="overwrite")
    assert len(read_monitor_log(path)) == 3  # nothing lost until a new line is written
    run_steps(log, [1, 2], gen)
    records = read_monitor_log(path)
    assert [(r["run"], r["step"]) for r in records] == [(log.run_id, 1), (log.run_id, 2)]


def test_report_on_a_log_with_two_runs_splits_them(tmp_path, gen, capsys):
    path = tmp_path / "run.jsonl"
    first = fs.MonitorLog(path)
    run_steps(first, [1, 2, 3, 4], gen)
    second = fs.MonitorLog(path, mode="append")
    run_steps(second, [1, 2], gen)
    with pytest.raises(fs.FusedStatsError, match="2 runs"):
        plot_monitor_log(path, tmp_path / "mixed.png")
    assert not (tmp_path / "mixed.png").exists()
    out = tmp_path / "cli"
    assert main(["report", str(path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"run 1 of 2 (id {first.run_id})" in printed
    assert f"run 2 of 2 (id {second.run_id})" in printed
    assert "4 records, steps 1 .. 4" in printed and "2 records, steps 1 .. 2" in printed
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == [f"run-run1-{first.run_id}.png", f"run-run2-{second.run_id}.png"]


def test_old_logs_without_run_ids_still_read(tmp_path, gen):
    path = tmp_path / "old.jsonl"
    run_steps(fs.MonitorLog(path), [1, 2], gen)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        del line["run"]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    records = read_monitor_log(path)
    assert list(split_runs(records)) == [None]
    assert plot_monitor_log(records, tmp_path / "old.png").stat().st_size > 1000
    # a second run appended to such a file: its steps restart, which is where it is split
    with open(path, "a") as handle:
        handle.write(json.dumps(dict(lines[0], step=1)) + "\n")
    runs = split_runs(read_monitor_log(path))
    assert {k: [r["step"] for r in v] for k, v in runs.items()} == {"unnamed-1": [1, 2], "unnamed-2": [1]}


def _monitor_figure(tmp_path, gen, monkeypatch):
    """The figure ``plot_monitor_log`` saves for a 5-step log (drawn; the PNG is written too)."""
    import fused_stats.api.report.plots as report_mod

    figures = []
    real = report_mod.save_figure
    monkeypatch.setattr(
        report_mod, "save_figure", lambda fig, path, **kw: figures.append(fig) or real(fig, path, **kw)
    )
    path = tmp_path / "run.jsonl"
    run_steps(fs.MonitorLog(path), [1, 2, 3, 4, 5], gen)
    plot_monitor_log(path, tmp_path / "run.png")
    (fig,) = figures
    fig.canvas.draw()
    return fig


def test_monitor_plot_has_integer_step_ticks_labels_and_legend_off_the_data(tmp_path, gen, monkeypatch):
    fig = _monitor_figure(tmp_path, gen, monkeypatch)
    renderer = fig.canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_ylabel().strip() and ax.get_xlabel() == "training step"
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        box = ax.get_window_extent(renderer)
        assert legend_box.x0 >= box.x1 or legend_box.y0 >= box.y1  # beside or above, not on


def test_monitor_log_axis_ticks_are_plain_numbers(tmp_path, gen, monkeypatch):
    """A log axis over less than a decade labels its ticks "2.6", not "2.6×10⁰"."""
    fig = _monitor_figure(tmp_path, gen, monkeypatch)
    logs = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert logs
    for ax in logs:
        texts = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
        assert texts, ax.get_title()
        for text in texts:
            assert "10^" not in text and "times" not in text and "×" not in text, (ax.get_title(), texts)
            float(text)  # a plain number
