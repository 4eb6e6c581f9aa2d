"""nnsight: the example that folds gradients into fs.GradStats inside an nnsight trace agrees
with fs.Probe and a per-sample loop (the script checks and exits non-zero otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nnsight")

ROOT = Path(__file__).resolve().parents[1]


def test_example_nnsight_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "probe_nnsight.py"), "--tiny"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agree" in out.stdout
