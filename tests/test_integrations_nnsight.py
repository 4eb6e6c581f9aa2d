"""nnsight: the example that folds gradients into fs.GradStats inside an nnsight trace agrees
with fs.Probe and a per-sample loop (the script checks and exits non-zero otherwise)."""

from __future__ import annotations

import pytest

pytest.importorskip("nnsight")

from example_scripts import run_script


def test_example_nnsight_runs():
    out = run_script("probe_nnsight.py", "--tiny")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agree" in out.stdout
