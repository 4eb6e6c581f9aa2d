"""``fused-stats demo --toy`` resumes after an interruption.

A Ctrl-C (simulated: ``KeyboardInterrupt`` from the second model's training, after the first
run's JSON is written) ends the command with exit 130 and one line; the rerun with the same
command line trains only the missing models (training calls counted) and writes the same runs,
interventions and tables as an uninterrupted run into another folder. Another configuration in
that folder is refused without ``--force``; with it, the other configuration's runs are removed
and every run is recomputed. Tiny configuration: 3 models of width 16/32, depth 1/2, 2 steps.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

import fused_stats as fs
from fused_stats.cli import main
from fused_stats.demo import experiment

TINY = [
    "--widths", "16", "32", "--depths", "1", "2", "--width-sweep-depth", "1", "--depth-sweep-width", "16",
    "--seeds", "0", "--steps", "2", "--probe-batches", "1", "--split", "4",
]  # fmt: skip
RUNS = ["w16-d1-s0.json", "w16-d2-s0.json", "w32-d1-s0.json"]
TIMES = ("train_seconds", "probe_seconds", "cpu_seconds", "wall_seconds")


def demo(out, *extra):
    return main(["demo", "--toy", *TINY, "--out", str(out), "--no-progress", "--threads", "1", *extra])


@pytest.fixture
def trainings(monkeypatch):
    """Counts the models trained; ``interrupt_at`` = n raises KeyboardInterrupt at the n-th."""
    calls = {"n": 0, "interrupt_at": None}
    real = experiment.train_model

    def counted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["interrupt_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(experiment, "train_model", counted)
    return calls


def runs_without_times(out) -> dict:
    runs = {}
    for path in sorted((out / "runs").glob("*.json")):
        data = json.loads(path.read_text())
        data.pop("created")
        for key in TIMES:
            data["meta"].pop(key)
        runs[path.name] = data
    return runs


def tables(out) -> str:
    """summary.md from the width sweep to the interventions' footnote (no run lines, no times)."""
    text = (out / "summary.md").read_text()
    return text[text.index("== Width sweep") : text.index("What was measured")]


def test_interrupted_demo_resumes_and_equals_an_uninterrupted_run(tmp_path, trainings, capsys):
    ref = tmp_path / "ref"
    assert demo(ref) == 0 and trainings["n"] == 3
    out = tmp_path / "out"
    trainings.update(n=0, interrupt_at=2)
    capsys.readouterr()
    assert demo(out) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "interrupted" in err, err
    assert sorted(p.name for p in (out / "runs").iterdir()) == RUNS[:1]
    assert not (out / "summary.md").exists()

    trainings.update(n=0, interrupt_at=None)
    assert demo(out) == 0, capsys.readouterr().err
    assert trainings["n"] == 2  # the finished run was read back, not trained again
    assert "1 finished earlier, read back" in capsys.readouterr().out
    assert runs_without_times(out) == runs_without_times(ref)
    assert sorted(runs_without_times(out)) == RUNS
    assert json.loads((out / "interventions.json").read_text()) == json.loads(
        (ref / "interventions.json").read_text()
    )
    assert tables(out) == tables(ref)
    assert "measured (central) | ratio | one-sided step" in tables(out)

    # a finished folder: nothing trained, the interventions come from the deepest run's report
    trainings.update(n=0)
    assert demo(out) == 0 and trainings["n"] == 0
    assert tables(out) == tables(ref)
    kept = fs.Report.from_json(out / "runs" / "w16-d2-s0.json")
    assert kept.meta["interventions"] == json.loads((ref / "interventions.json").read_text())


def test_another_configuration_is_refused_and_forced_afresh(tmp_path, trainings, capsys):
    out = tmp_path / "out"
    assert demo(out) == 0 and trainings["n"] == 3
    before = {p.name: p.read_bytes() for p in (out / "runs").iterdir()}
    other = ["--widths", "16", "--steps", "3"]  # drops the width-32 run, retrains the others
    trainings.update(n=0)
    capsys.readouterr()
    assert demo(out, *other) == 2 and trainings["n"] == 0
    err = capsys.readouterr().err.strip()
    assert "another configuration" in err and "widths [16, 32] -> [16]" in err and "train_steps 2 -> 3" in err
    assert {p.name: p.read_bytes() for p in (out / "runs").iterdir()} == before

    assert demo(out, *other, "--force") == 0
    assert trainings["n"] == 2  # nothing of the other configuration was reused
    assert sorted(p.name for p in (out / "runs").iterdir()) == RUNS[:2]
    for path in (out / "runs").iterdir():
        assert fs.Report.from_json(path).meta["tokens"] == 3 * 16 * 64
    summary = (out / "summary.md").read_text()
    assert "runs: widths [16] at depth 1" in summary and "for 2 runs\n" in summary

    # --force with the configuration the folder holds: every run recomputed
    trainings.update(n=0)
    assert demo(out, *other, "--force") == 0 and trainings["n"] == 2


def test_folder_of_no_demo_is_refused_without_force(tmp_path, trainings, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert demo(out) == 2 and trainings["n"] == 0
    err = capsys.readouterr().err
    assert "'notes.txt'" in err and "demo_config.json" in err and "--force" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
