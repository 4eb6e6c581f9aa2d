"""``fused-stats grow-demo`` follows the output-folder rule of the other commands: a non-empty
``--out`` is refused (exit 2, one error line, nothing written) unless ``--force``; a missing or
empty one is used. The training itself is replaced by a recorder (it is tested in
tests/test_grow_demo.py); only the folder check before it runs is under test here."""

from __future__ import annotations

import pytest
from test_cli_errors import fails, listing

import fused_stats.demo.growth as growth_demo
from fused_stats.cli import main


@pytest.fixture
def runs(monkeypatch):
    calls = []
    monkeypatch.setattr(growth_demo, "run_growth_demo", lambda cfg, out: calls.append(str(out)))
    return calls


def test_non_empty_out_refused_without_force(here, capsys, runs):
    out = here / "grown"
    out.mkdir()
    (out / "summary.md").write_text("an earlier run\n")
    fails(["grow-demo", "--quick", "--out", out], capsys, here, str(out), "'summary.md'", "--force")
    assert runs == [] and (out / "summary.md").read_text() == "an earlier run\n"


def test_force_missing_and_empty_out_run(here, capsys, runs):
    out = here / "grown"
    out.mkdir()
    (out / "summary.md").write_text("an earlier run\n")
    assert main(["grow-demo", "--quick", "--out", str(out), "--force"]) == 0
    (here / "empty").mkdir()
    before = listing(here)
    assert main(["grow-demo", "--quick", "--out", str(here / "empty")]) == 0
    assert main(["grow-demo", "--quick", "--out", str(here / "new")]) == 0
    assert runs == [str(out), str(here / "empty"), str(here / "new")] and listing(here) == before


def test_file_as_out_refused(here, capsys, runs):
    (here / "a_file").write_text("x")
    fails(["grow-demo", "--quick", "--out", here / "a_file"], capsys, here, "a_file", "is a file")
    assert runs == []
