"""docs/growth/coverage.md is what tools/growth_coverage.py generates from the adapter table and
the tests' parametrisation now, and every row of the table is checked by some test."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fused_stats.api.growth import architecture

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("growth_coverage", ROOT / "tools" / "growth_coverage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_coverage_page_is_current():
    tool = _tool()
    assert tool.PAGE.read_text() == tool.render(), "run python tools/growth_coverage.py"


def test_every_table_row_has_a_row_with_tests():
    rows = {mt: (depth, width, nodes) for mt, depth, width, nodes in _tool().rows()}
    assert set(rows) == set(architecture.ADAPTERS) | set(architecture.REFUSED)
    assert all(nodes for _, _, nodes in rows.values())
    assert rows["phi3"][1] == "exact" and rows["mixtral"][0].startswith("refused: its MLP is a mixture")


def test_a_row_without_a_test_stops_the_tool(monkeypatch):
    monkeypatch.setitem(architecture.ADAPTERS, "untested", architecture._llama_like("untested"))
    with pytest.raises(SystemExit, match="untested: no depth test"):
        _tool().rows()
