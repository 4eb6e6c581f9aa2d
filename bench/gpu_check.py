#!/usr/bin/env python3
"""The one prepared GPU check (docs/design.md, section 8): the gpu tests, then the measurements.

Run on a CUDA machine (written for an H200) from the repository root; the first command::

    python3 bench/gpu_check.py                # at most 8 minutes (--max-s 480)
    python3 bench/gpu_check.py --dry-run      # no GPU needed: the launcher itself at tiny sizes
    python3 bench/gpu_check.py --sweeps --compile-peers   # then, if time is left: the heavy extras

1. Correctness: ``pytest -m gpu tests/test_gpu_kernels.py`` (``--tests`` for others) in a child
   process, watched: a test that runs past ``--test-timeout`` is killed, and one that crashes the
   process (a CUDA illegal-address abort, a segfault) or hangs is recorded and the others run again
   without it; all of them within ``--tests-timeout``. The same tests run on any GPU machine with
   ``pytest -m gpu``.
2. Measurements, each section in its own child process with its own timeout (:data:`TIMEOUT_S`,
   ``--timeout NAME=SECONDS``), each dtype or case in its own try:

   * ceilings: copy bandwidth (``torch.clone`` of a tensor of the capture input's size, bytes read +
     written) and dense matmul rates (bf16, TF32, fp64);
   * capture-reduce GB/s against the copy bandwidth (target >= 85 %; bytes it must move, see
     bench/KERNELS.md); second moment TFLOP/s from bf16 rows against the bf16 matmul rate (target
     >= 60 %, counting the triangle's FLOPs ``d (d + 1) R``; fp32 rows use tf32x3, reported against
     a third of the TF32 rate, with no target); Gram rows and cross gradient times; the torch twin in
     eager mode as the peer column (``torch.compile`` peers with ``--compile-peers``);
   * probe overhead: one probe step against one training step of a LLaMA-shaped model;
   * the weight-streamed probe step (``stream``): block host-to-device GB/s against a pinned copy,
     streamed / in-memory step ratio.

No section starts after ``--max-s`` seconds (default 480) and each child's timeout is cut to the
time left. The JSON is rewritten after every section (``$OUT/gpu_check.json`` when ``OUT`` is set,
else ``bench/results/gpu_check.json``, or ``--out DIR``; a dry run writes ``gpu_check_dry_run.json``)
and a table is printed last; the exit status is 1 when a test or a section failed. Sections marked
optional are skipped once ``--budget-s`` seconds (default 420) have passed. ``--skip a,b`` leaves
sections out (``gpu_tests`` too); ``--in-process`` runs the sections in this process (no isolation;
for debugging). ``--inject-failure SECTION[.CASE]:KIND`` (KIND = ``raise``, ``crash``, ``hang``)
makes a section or one case fail on purpose: the test of the isolation uses it.

A dry run on CPU: the gpu tests are collected and skipped, and every measurement section runs at
tiny sizes through Triton's interpreter, timed by the wall clock (its figures mean nothing).

This file is the launcher (options, the order of the sections, child processes, the JSON); the
gpu tests' phase and each section's measurements are modules of ``bench/gpu_sections/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_sections.capture_speed import section_capture_speed, section_capture_sweep
from gpu_sections.cross import section_cross
from gpu_sections.gpu_tests import run_gpu_tests
from gpu_sections.harness import ROOT, T0, Ctx, Run, inject, json_default  # noqa: F401  (inject: for callers)
from gpu_sections.machine import section_ceilings, section_env
from gpu_sections.peers import section_compile_peers
from gpu_sections.probe import section_probe_overhead, section_stream
from gpu_sections.second_moment import section_gram, section_second_moment, section_syrk_sweep

if str(ROOT) not in sys.path:  # the GPU machine runs from a plain checkout (package not installed)
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes (checks the launcher); without CUDA the gpu tests skip and the kernels run "
        "through Triton's interpreter, timings meaningless",
    )
    p.add_argument("--out", default=None, help="directory for gpu_check.json")
    p.add_argument("--tokens", type=int, default=65536, help="B x T of the capture/GEMM problems")
    p.add_argument("--d", type=int, default=4096, help="feature dimension")
    p.add_argument(
        "--stream-blocks",
        type=int,
        default=4,
        help="blocks of the LLaMA-shaped model of the weight-streaming section",
    )
    p.add_argument("--skip", default="", help="comma-separated sections (gpu_tests included) to leave out")
    p.add_argument(
        "--tests",
        nargs="+",
        default=["tests/test_gpu_kernels.py"],
        help="what pytest -m gpu runs first (paths or node ids; tests/ for every gpu test)",
    )
    p.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for all the gpu tests")
    p.add_argument(
        "--test-timeout", type=float, default=120.0, help="seconds one gpu test may run before it is killed"
    )
    p.add_argument(
        "--max-restarts", type=int, default=4, help="reruns of the rest after a test crashes or hangs"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip optional sections after this many seconds",
    )
    p.add_argument(
        "--max-s",
        type=float,
        default=None,
        help="hard wall: no section starts after this many seconds, and none runs past it "
        "(default 480; none for a dry run, whose speed is the CPU's)",
    )
    p.add_argument("--sweeps", action="store_true", help="also the configuration sweeps (heavy)")
    p.add_argument("--compile-peers", action="store_true", help="also torch.compile peers (slow to compile)")
    p.add_argument(
        "--timeout", action="append", default=[], metavar="NAME=SECONDS", help="a section's timeout"
    )
    p.add_argument("--in-process", action="store_true", help="no child processes (no isolation)")
    p.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="SECTION[.CASE]:KIND",
        help="fail on purpose (KIND: raise, crash, hang); tests the isolation",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one section
    p.add_argument("--child-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def out_path(args) -> Path:
    if args.out:
        base = Path(args.out)
    elif os.environ.get("OUT"):
        base = Path(os.environ["OUT"])
    else:
        base = ROOT / "bench" / "results"
    base.mkdir(parents=True, exist_ok=True)
    # a CPU dry run must never be mistaken for (or overwrite) the GPU results
    return base / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")


# name, function, kind: "core" always runs, "optional" is skipped past --budget-s, "sweep" and
# "compile" only with --sweeps / --compile-peers (heavy: left out of the first command)
SECTIONS = [
    ("env", section_env, "core"),
    ("ceilings", section_ceilings, "core"),
    ("capture_speed", section_capture_speed, "core"),
    ("second_moment", section_second_moment, "core"),
    ("gram", section_gram, "core"),
    ("cross", section_cross, "core"),
    ("probe_overhead", section_probe_overhead, "core"),
    ("stream", section_stream, "optional"),
    ("capture_sweep", section_capture_sweep, "sweep"),
    ("syrk_sweep", section_syrk_sweep, "sweep"),
    ("compile_peers", section_compile_peers, "compile"),
]
# per-section wall-clock limits of the child processes (seconds); the gpu tests compile the kernels
# first, and Triton's on-disk cache serves the sections
TIMEOUT_S = {"stream": 240, "compile_peers": 300, "capture_sweep": 240, "syrk_sweep": 240}
DEFAULT_TIMEOUT_S = 150


def _timeouts(args) -> dict:
    out = dict(TIMEOUT_S)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        out[name] = float(seconds)
    return out


def _child_main(args) -> int:
    """Run the one section ``args.child`` in this process (the parent's options and the peers of the
    sections before it come from ``--child-dir``); its result goes to ``<dir>/<name>.json``."""
    import torch

    child_dir = Path(args.child_dir)
    run = Run(args, child_dir / f"{args.child}.json")
    peers_file = child_dir / "peers.json"
    if peers_file.exists():
        run.peers.update(json.loads(peers_file.read_text()))
    ctx = Ctx(args)
    ctx.peers = run.peers
    fn = dict((n, f) for n, f, _ in SECTIONS)[args.child]
    run.section(args.child, lambda r: fn(r, ctx))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, inside the section's time
    return 0


def _run_child(run, name: str, child_dir: Path, timeout: float) -> None:
    """Section ``name`` in a child process: its entry, rows and peers merged into ``run``; a crash,
    a hang (killed at ``timeout``) or a missing result is that section's error, with whatever
    cases it had finished."""
    (child_dir / "peers.json").write_text(json.dumps(run.peers, default=json_default))
    result = child_dir / f"{name}.json"
    result.unlink(missing_ok=True)
    argv = [arg for arg in sys.argv[1:]]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--child",
        name,
        "--child-dir",
        str(child_dir),
    ]
    start = time.time()
    print(f"[{start - T0:6.1f}s] {name} (child process, timeout {timeout:.0f} s) ...", flush=True)
    error = None
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        output, _ = proc.communicate()
        error = f"timed out after {timeout:.0f} s (killed)"
    if error is None and proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        error = f"child process died ({how})"
    for line in (output or "").splitlines():
        if not line.startswith("["):  # the child's own progress lines are the parent's already
            print(f"    | {line}", flush=True)
    doc = {}
    if result.exists():
        try:
            doc = json.loads(result.read_text())
        except ValueError:
            doc = {}
    entry = dict(doc.get("sections", {}).get(name, {}))
    if error is not None:
        entry.update(status="error", error=error, output_tail=(output or "")[-3000:])
    elif not entry:
        entry = {
            "status": "error",
            "error": "the child wrote no result",
            "output_tail": (output or "")[-3000:],
        }
    entry["seconds"] = round(time.time() - start, 2)
    run.sections[name] = entry
    run.table.extend(doc.get("table", []))
    run.peers.update(doc.get("peers", {}))
    if entry.get("status") == "error":
        print(f"    error: {entry.get('error')}", flush=True)
    run.write()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run and not os.environ.get("TRITON_INTERPRET"):
        # must be set before Triton is imported when there is no GPU (harmless with one: the
        # kernels pick the compiled path for CUDA tensors); children inherit it
        os.environ["TRITON_INTERPRET"] = "1"
    if args.child:
        return _child_main(args)
    import torch

    path = out_path(args)
    run = Run(args, path)
    if not torch.cuda.is_available() and not args.dry_run:
        msg = "no CUDA device: this check needs a GPU (use --dry-run to check the script on CPU)"
        print(msg)
        run.meta["error"] = msg
        run.write()
        return 1
    if args.dry_run:
        print(
            "dry run: tiny sizes"
            + (
                ""
                if torch.cuda.is_available()
                else ", no CUDA: gpu tests skipped, kernels through Triton's interpreter, timings meaningless"
            )
        )
    skip = {x for x in args.skip.split(",") if x}
    unknown = skip - {name for name, _, _ in SECTIONS} - {"gpu_tests"}
    if unknown:
        print(f"unknown sections in --skip: {sorted(unknown)}")
        return 2
    timeouts = _timeouts(args)
    if args.max_s is None:
        args.max_s = math.inf if args.dry_run else 480.0
    if "gpu_tests" in skip:
        run.sections["gpu_tests"] = {"status": "skipped", "reason": "--skip"}
    else:
        run_gpu_tests(run, args, deadline=min(time.time() + args.tests_timeout, T0 + args.max_s - 20))
    ctx = None
    if args.in_process:
        ctx = Ctx(args)
        ctx.peers = run.peers
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as child_dir:
        for name, fn, kind in SECTIONS:
            reason = None
            if name in skip:
                reason = "--skip"
            elif kind == "sweep" and not args.sweeps:
                reason = "heavy: run with --sweeps"
            elif kind == "compile" and not args.compile_peers:
                reason = "heavy: run with --compile-peers"
            elif kind == "optional" and time.time() - T0 > args.budget_s:
                reason = f"time budget {args.budget_s:.0f}s"
            elif args.max_s - (time.time() - T0) < 20:
                reason = f"out of time (--max-s {args.max_s:.0f})"
            if reason:
                run.sections[name] = {"status": "skipped", "reason": reason}
                run.write()
                continue
            if args.in_process:
                run.section(name, lambda r, fn=fn: fn(r, ctx))
            else:
                left = args.max_s - (time.time() - T0)
                _run_child(run, name, Path(child_dir), min(timeouts.get(name, DEFAULT_TIMEOUT_S), left))
    run.meta["elapsed_s"] = round(time.time() - T0, 1)
    run.write()
    run.print_table()
    errors = [n for n, s in run.sections.items() if s.get("status") == "error"]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
