"""bench/gpu_check.py without a GPU: ``--dry-run`` runs every section through Triton's interpreter at
tiny sizes, each in its own child process, and failures made on purpose stay where they are.

One dry run (the cross section left out: its own test runs it, tests/test_cross_kernel.py) with
three injected failures, one of each kind the isolation must survive:

* ``ceilings`` crashes (SIGSEGV, as a CUDA illegal-address abort would end the process);
* ``capture_speed`` hangs, and is killed at its 5-second timeout;
* the bf16 case of ``gram`` raises (one try per dtype: the section's other dtypes still run).

Both are sections that skip themselves on CPU anyway, so every section with work to do on CPU still
runs: the checks below are that every other section, the new ones included, ran and passed, that
the sections right after each failure did, and that the JSON and the table say what failed and how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
NEW_SECTIONS = ("preflight", "capture_two_pass", "capture_layouts", "bf16_bias", "repeat", "additivity")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--out",
            str(out_dir),
            "--skip",
            "cross",
            "--inject-failure",
            "ceilings:crash",
            "--inject-failure",
            "capture_speed:hang",
            "--timeout",
            "capture_speed=5",
            "--inject-failure",
            "gram.bf16:raise",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    doc = json.loads((out_dir / "gpu_check_dry_run.json").read_text())
    return proc, doc


def test_injected_failures_stay_in_their_sections(dry_run):
    proc, doc = dry_run
    sections = doc["sections"]
    assert proc.returncode == 1, proc.stdout[-3000:]  # errors were reported
    assert sections["ceilings"]["status"] == "error"
    assert "signal 11" in sections["ceilings"]["error"], sections["ceilings"]
    assert sections["capture_speed"]["status"] == "error"
    assert "timed out after 5 s" in sections["capture_speed"]["error"], sections["capture_speed"]
    gram = sections["gram"]
    assert gram["status"] == "error" and "bf16" in gram["error"], gram
    assert "failure injected at gram.bf16" in gram["bf16"]["error"]
    for label in ("fp64", "fp32", "fp32_x_fp64_pool"):  # the dtypes around the failed one
        assert gram[label]["ok"], gram[label]
    # the sections right after each failure ran
    for name in ("capture_correctness", "second_moment", "repeat"):
        assert sections[name]["status"] == "ok", sections[name]
    last = proc.stdout.strip().splitlines()[-1]  # the table is printed last, naming the failures
    assert "'ceilings', 'capture_speed', 'gram'" in last, last


def test_every_other_section_ran_and_passed(dry_run):
    _, doc = dry_run
    sections = doc["sections"]
    failed_on_purpose = {"ceilings", "capture_speed", "gram"}
    for name, entry in sections.items():
        if name in failed_on_purpose:
            continue
        assert entry["status"] in ("ok", "skipped"), (name, entry)
    for name in NEW_SECTIONS + ("capture_correctness", "second_moment"):
        assert sections[name]["status"] == "ok" and sections[name]["all_ok"], (name, sections[name])
    assert sections["grad_stats"]["ok"] and sections["stream"]["status"] == "ok"
    assert sections["cross"] == {"status": "skipped", "reason": "--skip"}
    for heavy in ("capture_sweep", "syrk_sweep", "compile_peers"):  # behind their flags
        assert sections[heavy]["status"] == "skipped" and "heavy" in sections[heavy]["reason"]


def test_preflight_launches_every_variant(dry_run):
    _, doc = dry_run
    pre = doc["sections"]["preflight"]
    assert pre["missing_internals"] == []
    launches = pre["launches"]
    for variant in (
        "capture_two_pass",
        "capture_sample_t_lt_16",
        "syrk_fp64",
        "syrk_bf16_split_k",
        "gram_fp64",
        "gram_fp32_x_fp64",
        "cross_sample_fp64",
        "cross_position_fp64",
    ):
        assert launches[variant]["ok"], (variant, launches[variant])
    assert pre["triton"] and pre["torch"] == torch.__version__


def test_without_a_gpu_the_real_run_refuses(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1 and "no CUDA device" in proc.stdout
