"""bench/gpu_check.py without a GPU: the launcher itself (``--dry-run``), with failures made on purpose
in both of its phases. The kernels' correctness is not checked here: that is tests/test_gpu_kernels.py
on a GPU and tests/test_kernels_interpreter.py on CPU.

One dry run whose gpu tests are a stand-in file (``--tests``) with one test of each ending the
launcher must survive (passes, fails, errors in set-up, is skipped, crashes the pytest process with
SIGSEGV as a CUDA illegal-address abort would, hangs past ``--test-timeout``), and three failures
injected into the measurement sections:

* ``ceilings`` crashes (SIGSEGV);
* ``capture_speed`` hangs, and is killed at its 5-second timeout;
* the bf16 case of ``gram`` raises (one try per dtype: the section's other dtypes still run).

The checks: each test and section ends as it was made to, the tests after a crash or a hang still
run, every other section runs, and the JSON, the table and the exit status say what failed and how.
A second run takes the real gpu tests: on CPU they are collected and all skipped.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
MEASUREMENTS = (
    "env",
    "ceilings",
    "capture_speed",
    "second_moment",
    "gram",
    "cross",
    "probe_overhead",
    "stream",
)

STAND_IN_TESTS = textwrap.dedent(
    """
    import os
    import signal
    import time

    import pytest

    gpu = pytest.mark.gpu


    @gpu
    def test_passes():
        assert sum(range(4)) == 6


    @gpu
    def test_fails():
        assert 2 + 2 == 5, "wrong on purpose"


    @pytest.fixture
    def broken():
        raise RuntimeError("set-up broken on purpose")


    @gpu
    def test_setup_error(broken):
        pass


    @gpu
    def test_crashes():
        os.kill(os.getpid(), signal.SIGSEGV)


    @gpu
    def test_after_the_crash():
        assert "after" in "after the crash"


    @gpu
    def test_hangs():
        time.sleep(10**6)


    @gpu
    @pytest.mark.skip(reason="skipped on purpose")
    def test_skipped():
        pass


    @gpu
    def test_after_the_hang():
        assert [1, 2][-1] == 2


    def test_not_marked_gpu():
        raise AssertionError("only tests marked gpu run")
    """
)


def _dry_run(out_dir: Path, *extra: str, timeout=900):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out_dir), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    doc = json.loads((out_dir / "gpu_check_dry_run.json").read_text())
    return proc, doc


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    here = tmp_path_factory.mktemp("gpu_check")
    stand_in = here / "stand_in_gpu_tests.py"
    stand_in.write_text(STAND_IN_TESTS)
    return _dry_run(
        here,
        "--tests",
        str(stand_in),
        "--test-timeout",
        "5",
        "--skip",
        "cross",  # its kernel's own test runs it, tests/test_cross_kernel.py
        "--inject-failure",
        "ceilings:crash",
        "--inject-failure",
        "capture_speed:hang",
        "--timeout",
        "capture_speed=5",
        "--inject-failure",
        "gram.bf16:raise",
    )


def _outcomes(doc):
    return {nodeid.split("::")[-1]: r for nodeid, r in doc["sections"]["gpu_tests"]["results"].items()}


def test_each_gpu_test_ends_as_it_was_made_to(dry_run):
    proc, doc = dry_run
    got = _outcomes(doc)
    assert {name: r["outcome"] for name, r in got.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_setup_error": "error",
        "test_crashes": "crashed",
        "test_after_the_crash": "passed",
        "test_hangs": "hung",
        "test_skipped": "skipped",
        "test_after_the_hang": "passed",
    }, proc.stdout[-3000:]
    assert "wrong on purpose" in got["test_fails"]["message"]
    assert "set-up broken on purpose" in got["test_setup_error"]["message"]
    assert got["test_crashes"]["message"] == "crashed (signal 11)"
    assert "--test-timeout 5 s" in got["test_hangs"]["message"]
    assert got["test_skipped"]["message"] == "Skipped: skipped on purpose"
    tests = doc["sections"]["gpu_tests"]
    assert tests["status"] == "error" and tests["collected"] == 8
    assert (tests["passed"], tests["skipped"], len(tests["not_passed"])) == (3, 1, 4)
    assert tests["skip_reasons"] == {"Skipped: skipped on purpose": 1}


def test_injected_section_failures_stay_in_their_sections(dry_run):
    proc, doc = dry_run
    sections = doc["sections"]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert sections["ceilings"]["status"] == "error"
    assert "signal 11" in sections["ceilings"]["error"], sections["ceilings"]
    assert sections["capture_speed"]["status"] == "error"
    assert "timed out after 5 s" in sections["capture_speed"]["error"], sections["capture_speed"]
    gram = sections["gram"]
    assert gram["status"] == "error" and "bf16" in gram["error"], gram
    assert "failure injected at gram.bf16" in gram["bf16"]["error"]
    for label in ("fp64", "fp32", "fp32_x_fp64_pool"):  # the dtypes around the failed one
        assert gram[label]["ms"] > 0, gram[label]
    last = proc.stdout.strip().splitlines()[-1]  # the table is printed last, naming the failures
    assert "errors: ['gpu_tests', 'ceilings', 'capture_speed', 'gram']" in last, last


def test_every_other_section_ran(dry_run):
    _, doc = dry_run
    sections = doc["sections"]
    assert next(iter(sections)) == "gpu_tests"  # the tests first: they compile the kernels
    for name in ("env", "second_moment", "probe_overhead", "stream"):
        assert sections[name]["status"] == "ok", (name, sections[name])
    assert sections["second_moment"]["bf16"]["TFLOPs_triangle"] > 0
    overhead = sections["probe_overhead"]
    assert overhead["ratio"] == pytest.approx(overhead["probe_step_s"] / overhead["train_step_s"])
    assert sections["stream"]["host_step_s"] > 0 and sections["stream"]["folder_step_s"] > 0
    assert sections["cross"] == {"status": "skipped", "reason": "--skip"}
    for heavy in ("capture_sweep", "syrk_sweep", "compile_peers"):  # behind their flags
        assert sections[heavy]["status"] == "skipped" and "heavy" in sections[heavy]["reason"]
    rows = {(r["section"], r["metric"]) for r in doc["table"]}
    assert ("probe overhead", "probe step / training step") in rows
    assert ("gpu tests", "test_crashes") in rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_the_gpu_tests_are_collected_and_skipped(tmp_path):
    proc, doc = _dry_run(tmp_path, "--skip", ",".join(MEASUREMENTS))
    tests = doc["sections"]["gpu_tests"]
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert tests["status"] == "skipped" and tests["collected"] >= 40
    assert tests["skipped"] == tests["collected"] and tests["passed"] == 0
    assert tests["skip_reasons"] == {"Skipped: needs a CUDA device": tests["collected"]}


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


def test_tests_left_when_the_phase_runs_out_of_time_are_reported_not_run(tmp_path, monkeypatch):
    """In process, with a phase deadline shorter than --test-timeout: the test running then is killed
    and named, and the ones after it are listed as not run, so a short lease loses nothing silently."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    gpu_check = importlib.import_module("gpu_check")
    stand_in = tmp_path / "stand_in_gpu_tests.py"
    stand_in.write_text(STAND_IN_TESTS)
    args = gpu_check.parse_args(
        [
            "--dry-run",
            "--out",
            str(tmp_path),
            "--tests",
            f"{stand_in}::test_passes",
            f"{stand_in}::test_hangs",
        ]
        + [f"{stand_in}::test_after_the_hang", "--test-timeout", "600"]
    )
    run = gpu_check.Run(args, tmp_path / "gpu_check_dry_run.json")
    gpu_check.run_gpu_tests(run, args, deadline=gpu_check.time.time() + 8)
    tests = run.sections["gpu_tests"]
    got = {nodeid.split("::")[-1]: r for nodeid, r in tests["results"].items()}
    assert {name: r["outcome"] for name, r in got.items()} == {
        "test_passes": "passed",
        "test_hangs": "hung",
        "test_after_the_hang": "not run",
    }
    assert "--tests-timeout" in got["test_hangs"]["message"]
    assert tests["status"] == "error" and tests["seconds"] < 60
    assert tests["error"] == "2 of 3 gpu tests did not pass"  # no pytest started past the deadline
