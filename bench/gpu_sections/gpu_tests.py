"""Phase 1 of the GPU check: ``pytest -m gpu`` in a watched child process.

This module is also that pytest process's plugin (``-p gpu_sections.gpu_tests``): its hooks log
each test's start and reports as JSON lines, flushed at once, so that a crash or a hang still
leaves which test was running. :func:`run_gpu_tests` kills a test that runs past
``--test-timeout`` (or the phase past its deadline), records a test that crashes the process or
hangs, and runs the rest again without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import ROOT, T0


# the pytest hooks (module docstring)
def _log_event(**event):
    path = os.environ.get("GPU_CHECK_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def pytest_collection_finish(session):
    _log_event(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    _log_event(event="start", nodeid=nodeid, t=time.time())


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    else:
        message = report.longreprtext[-1500:] if report.failed else ""
    _log_event(
        event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=message
    )


def _read_log(path: Path):
    """(collected nodeids, {nodeid: outcome and message}, the nodeid started last and not finished)."""
    collected, results, running = [], {}, None
    if not path.exists():
        return collected, results, running
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if e["event"] == "collected":
            collected = e["nodeids"]
        elif e["event"] == "start":
            running = (e["nodeid"], e["t"])
        elif e["event"] == "report":
            entry = results.setdefault(e["nodeid"], {"outcome": "passed", "message": ""})
            # a failed setup or teardown is the test's error; a skip in setup its skip
            if e["outcome"] == "failed":
                entry.update(outcome="failed" if e["when"] == "call" else "error", message=e["message"])
            elif e["outcome"] == "skipped" and entry["outcome"] == "passed":
                entry.update(outcome="skipped", message=e["message"])
            if e["when"] == "teardown" and running and running[0] == e["nodeid"]:
                running = None
    return collected, results, running


def _pytest_once(args, log: Path, deselect, deadline: float):
    """One pytest process over the gpu tests, watched: killed when a test runs past --test-timeout or
    the phase past ``deadline``. Returns (how it ended, the test it was killed in, its output)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-p", "no:cacheprovider"]
    cmd += ["-p", "gpu_sections.gpu_tests", *args.tests]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    env = dict(os.environ, GPU_CHECK_TEST_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        killed = None
        while proc.poll() is None:
            time.sleep(0.2)
            _, _, running = _read_log(log)
            now = time.time()
            if running and now - running[1] > args.test_timeout:
                killed = (running[0], f"hung: killed after --test-timeout {args.test_timeout:g} s")
            elif now > deadline:
                killed = (
                    running[0] if running else None,
                    "killed: the tests' time (--tests-timeout) ran out",
                )
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
                proc.wait()
        output.seek(0)
        text = output.read()
    if killed:
        return killed[1], killed[0], text
    rc = proc.returncode
    if rc < 0:
        return f"crashed (signal {-rc})", None, text
    return rc, None, text


def run_gpu_tests(run, args, deadline: float) -> None:
    """The ``gpu`` tests in a pytest child process; a test that crashes the process or hangs is
    recorded and the rest run again without it (and without those already done)."""
    start = time.time()
    print(f"[{start - T0:6.1f}s] gpu_tests (pytest -m gpu {' '.join(args.tests)}) ...", flush=True)
    results: dict = {}
    collected: list = []
    entry: dict = {"status": "ok", "command": f"pytest -m gpu {' '.join(args.tests)}"}
    if importlib.util.find_spec("pytest") is None:
        entry.update(status="error", error="pytest is not installed (pip install pytest): no gpu test ran")
        print(f"    error: {entry['error']}", flush=True)
        run.row("gpu tests", "not run", None, note=entry["error"], ok=False)
        run.sections["gpu_tests"] = entry
        run.write()
        return
    with tempfile.TemporaryDirectory(prefix="gpu_tests_") as tmp:
        for attempt in range(args.max_restarts + 1):
            log = Path(tmp) / f"log{attempt}.jsonl"
            ended, killed_in, output = _pytest_once(args, log, list(results), deadline)
            got, new, running = _read_log(log)
            collected = collected or got
            results.update(new)
            victim = killed_in or (running[0] if running else None)
            if isinstance(ended, int):  # pytest exited by itself: 0 passed, 1 failed, 5 none selected
                if ended not in (0, 1, 5) or not collected:
                    entry.update(
                        status="error", error=f"pytest exit code {ended}", output_tail=output[-3000:]
                    )
                break
            if victim is None:  # died outside any test (collection, start-up)
                entry.update(
                    status="error", error=f"pytest {ended} outside a test", output_tail=output[-3000:]
                )
                break
            results[victim] = {
                "outcome": "crashed" if ended.startswith("crashed") else "hung",
                "message": ended,
            }
            print(f"    {victim}: {ended}", flush=True)
            if time.time() > deadline:
                break
        else:
            entry.update(status="error", error=f"stopped after {args.max_restarts} restarts")
    for nodeid in collected:
        results.setdefault(nodeid, {"outcome": "not run", "message": "the tests' time ran out"})
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "skipped")}
    bad = {n: r for n, r in results.items() if r["outcome"] not in ("passed", "skipped")}
    reasons: dict = {}
    for r in results.values():
        if r["outcome"] == "skipped":
            reasons[r["message"]] = reasons.get(r["message"], 0) + 1
    entry.update(collected=len(collected), **counts, not_passed=bad, skip_reasons=reasons, results=results)
    if bad and entry["status"] == "ok":
        entry.update(status="error", error=f"{len(bad)} of {len(collected)} gpu tests did not pass")
    elif entry["status"] == "ok" and not counts["passed"]:
        if args.dry_run:  # a CPU machine skips them all: nothing measured, nothing wrong
            entry.update(status="skipped", reason=f"{counts['skipped']} gpu tests collected, all skipped")
        else:
            entry.update(status="error", error="no gpu test passed")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) + f", {len(bad)} not passed"
    ok = None if entry["status"] == "skipped" else not bad and counts["passed"] > 0
    run.row("gpu tests", f"{len(collected)} collected", None, note=summary, ok=ok)
    for nodeid, r in bad.items():
        last = (r["message"].strip().splitlines() or [""])[-1]
        run.row("gpu tests", nodeid.split("::", 1)[-1], None, note=f"{r['outcome']}: {last[:150]}", ok=False)
        print(f"    {r['outcome']}: {nodeid}: {last[:300]}", flush=True)
    entry["seconds"] = round(time.time() - start, 2)
    run.sections["gpu_tests"] = entry
    run.write()
